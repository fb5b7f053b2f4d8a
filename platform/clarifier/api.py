"""The public API: what users, jobs and notebooks import. Everything else is internal and may move.

    from clarifier import api
    cfg = api.load_config("platform/clarifier/quickstart.yaml", ["train.max_steps=20"])
    api.prepare(cfg); result = api.train(cfg)
    report = api.evaluate(cfg, result.model_dir)
    engine = api.load_engine("models:/clarifier@champion")

Names load lazily (PEP 562), so ``import clarifier.api`` is cheap and pulls in Ray, MLflow or torch
only when a stage that needs them is used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # configuration (pure)
    "ClarifierConfig": "clarifier.core.config", "ConfigError": "clarifier.core.config",
    "load_config": "clarifier.core.config", "build_config": "clarifier.core.config",
    # the request / response schema (pure)
    "Example": "clarifier.core.schema", "ClarifyRequest": "clarifier.core.schema",
    "ClarifyResponse": "clarifier.core.schema",
    # stages
    "prepare": "clarifier.data.pipeline", "load_split": "clarifier.data.outputs",
    "read_manifest": "clarifier.data.outputs",
    "train": "clarifier.train.trainer", "TrainResult": "clarifier.train.trainer",
    "adapt_head": "clarifier.train.adapt", "AdaptError": "clarifier.train.adapt",
    "evaluate": "clarifier.evaluation.evaluate", "run_audit": "clarifier.evaluation.audit",
    "register_adapter": "clarifier.registry.registry", "promote": "clarifier.registry.promotion",
    "rollback": "clarifier.registry.promotion",
    "build_app": "clarifier.serving.app", "load_recipe": "clarifier.recipes",
    # models and inference
    "load_engine": "clarifier.engine.loading", "resolve_model": "clarifier.engine.loading",
    "ClarifierEngine": "clarifier.engine.inference",
    # calling a deployment
    "ClarifierClient": "clarifier.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"clarifier.api has no {name!r} (public names: {', '.join(__all__)})")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
