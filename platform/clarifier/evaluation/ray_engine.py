"""Batched evaluation through Ray Data: ``ds.map_batches(ScorerActor, compute=ActorPoolStrategy(...))``.

Each scorer actor loads the model once (``ClarifierEngine``) and answers whole batches. The results
are the local engine's, example for example: the dataset is cut into blocks whose sizes are
multiples of ``batch_size`` and every actor call re-groups its rows by ``idx // batch_size``, so
each example is scored in exactly the batch (same neighbours, same padding) it would be scored in
by ``ClarifierEngine.predict(examples, batch_size)`` in this process.

With ``gpus_per_actor > 0`` each actor loads its model on its CUDA device (the CPU-equality
guarantee above is for CPU actors; GPU kernels may differ from a CPU run in the last bits). Each
actor computes in the spec's ``precision`` (``model.precision``) and uses exactly the CPUs it
reserved as torch threads.

The actor resolves the model URI itself (``models:/``, ``runs:/``, ``s3://`` download into the
node's cache), so it works on a multi-node cluster; a plain local folder works where the actor's
node can see that path (single node).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Callable, Sequence

from clarifier.core.schema import Example
from clarifier.core.metrics import Prediction


def engine_from_spec(spec: dict, cpus: float = 1):
    """The ``ClarifierEngine`` a scorer actor holds (see :class:`ScorerActor` for ``spec``), computing
    with exactly ``cpus`` torch threads."""
    from clarifier.core.prompt import PromptOptions
    from clarifier.engine.inference import ClarifierEngine
    from clarifier.engine.precision import set_threads

    set_threads(cpus)  # exactly the CPUs this actor reserved
    device, precision = spec.get("device", "cpu"), spec.get("precision", "auto")
    if spec.get("base_model"):
        return ClarifierEngine.from_base(
            spec["base_model"], cache_dir=spec.get("cache_dir"), threshold=float(spec.get("threshold", 0.5)),
            prompt_opts=PromptOptions(**(spec.get("prompt") or {})),
            max_new_tokens=int(spec.get("max_new_tokens", 48)), precision=precision, device=device)
    from clarifier.engine.loading import load_engine

    return load_engine(
        spec["model_uri"], download_dir=spec.get("download_dir"), tracking_uri=spec.get("tracking_uri"),
        cache_dir=spec.get("cache_dir"), max_new_tokens=int(spec.get("max_new_tokens", 48)),
        precision=precision, device=device)


class ScorerActor:
    """A stateful Ray Data UDF: one ``ClarifierEngine`` per actor, loaded in ``__init__``.

    ``spec`` is either ``{"model_uri", "tracking_uri", "cache_dir", "max_new_tokens"}`` (a trained
    model folder) or ``{"base_model", "prompt", "threshold", "cache_dir"}`` (the untrained base
    model with the same prompt). ``mode`` is ``"predict"`` (decision, then question and grounding
    above the threshold) or ``"score"`` (decision only).
    """

    def __init__(self, spec: dict, mode: str = "predict", batch_size: int = 8, cpus: float = 1):
        if mode not in ("predict", "score"):
            raise ValueError(f"ScorerActor mode must be 'predict' or 'score', got {mode!r}")
        self.engine = engine_from_spec(spec, cpus)
        self.mode = mode
        self.batch_size = batch_size

    def __call__(self, batch: dict) -> dict:
        idx = [int(i) for i in batch["idx"]]
        examples = [Example.model_validate_json(s) for s in batch["example_json"]]
        groups: dict[int, list[int]] = {}
        for pos, i in enumerate(idx):
            groups.setdefault(i // self.batch_size, []).append(pos)
        preds: list[Prediction | None] = [None] * len(idx)
        for _, positions in sorted(groups.items()):
            positions.sort(key=lambda p: idx[p])
            chunk = [examples[p] for p in positions]
            if self.mode == "score":
                out = [Prediction(needs_clarification=s >= self.engine.threshold, confidence=s)
                       for s in self.engine.score(([(e.history, e.query, e.passages) for e in chunk]))]
            else:
                out = self.engine.predict(chunk, batch_size=len(chunk))
            for p, pred in zip(positions, out):
                preds[p] = pred
        return {"idx": idx, "pred_json": [json.dumps(asdict(p)) for p in preds]}


def _pred_from_json(s: str) -> Prediction:
    d = json.loads(s)
    d["grounding_turns"] = tuple(d.get("grounding_turns") or ())
    d["grounding_passages"] = tuple(d.get("grounding_passages") or ())
    return Prediction(**d)


def ray_predict(examples: Sequence[Example], spec: dict, *, mode: str = "predict", batch_size: int = 8,
                actors: int = 1, cpus_per_actor: float = 1, gpus_per_actor: float = 0,
                progress: Callable[[str], None] | None = None) -> list[Prediction]:
    """Predictions for ``examples`` (in their order) from a pool of ``actors`` ``ScorerActor``s.

    Ray must already be initialised (``clarifier.runtime.cluster.init_ray``); equal to
    ``ClarifierEngine.predict(examples, batch_size)`` (or ``score_examples`` with ``mode="score"``).
    """
    import pyarrow as pa
    import ray

    if not ray.is_initialized():
        raise RuntimeError("eval.engine=ray needs a running Ray (clarifier.runtime.cluster.init_ray()); none is initialised")
    if not examples:
        return []
    n = len(examples)
    # Blocks of a multiple of batch_size rows (a few per actor), so Ray's batches line up with the
    # local engine's batches.
    per_block = batch_size * max(1, math.ceil(n / batch_size / (4 * max(actors, 1))))
    tables = []
    for start in range(0, n, per_block):
        chunk = examples[start:start + per_block]
        tables.append(pa.table({"idx": list(range(start, start + len(chunk))),
                                "example_json": [e.model_dump_json() for e in chunk]}))
    ds = ray.data.from_arrow(tables)
    if gpus_per_actor:
        spec = {**spec, "device": "cuda"}
    ds = ds.map_batches(
        ScorerActor,
        fn_constructor_kwargs={"spec": spec, "mode": mode, "batch_size": batch_size, "cpus": cpus_per_actor},
        compute=ray.data.ActorPoolStrategy(size=actors),
        batch_size=batch_size,
        num_cpus=cpus_per_actor,
        num_gpus=gpus_per_actor or None,
    )
    rows = ds.take_all()
    if len(rows) != n:
        raise RuntimeError(f"Ray evaluation returned {len(rows)} predictions for {n} examples")
    rows.sort(key=lambda r: int(r["idx"]))
    if progress:
        progress(f"[eval] ray: {n} examples scored by {actors} actor(s)")
    return [_pred_from_json(r["pred_json"]) for r in rows]
