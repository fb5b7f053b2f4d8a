"""Named recipes: a training configuration in ``clarifier/recipes/configs/<name>.yaml`` that names its own data.

``clarifier train --recipe joint-public`` loads ``clarifier/recipes/configs/joint-public.yaml`` (a normal config
file whose ``data.sources`` import the public datasets), runs the data job unless its output
already holds the same data (same ``data`` config and base model in the manifest), then trains.
``clarifier recipe benchmark <name>`` runs the comparison table of the recipe
(``clarifier/recipes/plans/<name>.yaml``; see :mod:`clarifier.recipes.benchmark`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from clarifier.core.config import ClarifierConfig, ConfigError, load_config

# Package data (pyproject.toml): found the same way from a checkout, an editable or a wheel install.
RECIPES_DIR = Path(__file__).resolve().parent / "configs"
PLANS_DIR = Path(__file__).resolve().parent / "plans"


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    """``clarifier/recipes/configs/<name>.yaml`` for a recipe name; a path to a YAML file is returned as is."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"recipe file {name_or_path} does not exist")
        return p
    path = RECIPES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"no recipe named {name_or_path!r} in {RECIPES_DIR} (available: {', '.join(available_recipes()) or 'none'})")
    return path


def load_recipe(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> ClarifierConfig:
    return load_config(recipe_path(name_or_path), overrides)


def data_is_current(cfg: ClarifierConfig) -> bool:
    """True when ``data.output`` holds a finished data job for exactly this ``data`` config, base model and
    prompt, whose targets were cut to the prompt as today's are (``objective.TARGET_GROUNDING``)."""
    from clarifier.core.objective import TARGET_GROUNDING
    from clarifier.data.outputs import read_manifest

    try:
        manifest = read_manifest(cfg.data.output)
    except FileNotFoundError:
        return False
    conf = manifest.get("config") or {}
    tok = conf.get("tokenizer") or {}
    return (conf.get("data") == cfg.data.model_dump(mode="json") and tok.get("base_model") == cfg.model.base_model
            and not cfg.model.prompt_differences(tok) and tok.get("target_grounding") == TARGET_GROUNDING)


def prepare_if_needed(cfg: ClarifierConfig, progress: Callable[[str], None] = print, force: bool = False) -> dict:
    """Run the data job for ``cfg`` unless its output is already current; returns the manifest."""
    from clarifier.data.pipeline import prepare
    from clarifier.data.outputs import read_manifest

    if not force and data_is_current(cfg):
        progress(f"[recipe] reusing the data job's output in {cfg.data.output} (same data config and base model)")
        return read_manifest(cfg.data.output)
    return prepare(cfg, progress=progress)
