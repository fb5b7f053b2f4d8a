"""Models that ship inside the package: ``builtin:<name>`` (e.g. ``builtin:clarifier-smollm2-135m``).

A built-in model is an ordinary Clarifier model folder (LoRA adapter in bf16 safetensors,
``clarifier.json`` with its calibrated threshold, tokenizer files, ``MODEL_CARD.md``) kept under
``clarifier/builtin_models/<name>/`` as package data, so ``clarifier serve``, ``eval`` and the
quickstart can use a trained clarifier without training one. Its base model must be installable
(the built-in base models of :mod:`clarifier.engine.models`). Folders are written by
``clarifier models package`` (:mod:`clarifier.recipes.ship`).
"""

from __future__ import annotations

from pathlib import Path

from clarifier.engine.models import ModelResolutionError

SCHEME = "builtin"
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin_models"
CARD_FILE = "MODEL_CARD.md"


def builtin_models() -> list[str]:
    """Names of the models shipped with this installation."""
    if not BUILTIN_DIR.is_dir():
        return []
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if (p / "clarifier.json").is_file())


def builtin_name(uri: str) -> str:
    """``builtin:<name>`` / ``builtin:/<name>`` -> ``<name>``."""
    if not uri.startswith(f"{SCHEME}:"):
        raise ModelResolutionError(f"{uri!r} is not a {SCHEME}:<name> URI")
    return uri.split(":", 1)[1].strip("/")


def resolve_builtin_uri(uri: str, cache_dir=None, tracking_uri: str | None = None):
    """The package folder of a built-in model (nothing is downloaded or copied)."""
    from clarifier.engine.loading import ResolvedModel

    name = builtin_name(uri)
    folder = BUILTIN_DIR / name
    if not (folder / "clarifier.json").is_file():
        have = builtin_models()
        raise ModelResolutionError(f"no built-in model {name!r} in {BUILTIN_DIR} (shipped: {', '.join(have) or 'none'}); "
                                   "a model folder, s3://, models:/ or runs:/ URI works too")
    return ResolvedModel(folder, f"{SCHEME}:{name}")
