"""Where a model comes from and which engine runs it: :func:`resolve_model` and :func:`load_engine`.

A model is named by a URI. A folder or ``s3://`` prefix is resolved here; any other scheme
(``models:/name@alias``, ``runs:/<id>/adapter``, ``builtin:<name>``) goes to the resolver registered for it, MLflow's
way: an entry point in the group ``clarifier.model_uri_schemes`` (name = scheme, value =
``module:function(uri, cache_dir, tracking_uri) -> ResolvedModel``). The registry stage
(:mod:`clarifier.registry.registry`) provides ``models`` and ``runs``; a source checkout that is not
pip-installed falls back to the same two names below. The engine layer therefore never imports
the registry: it looks the resolver up by scheme.

:func:`load_engine` then picks the engine the folder holds: a joint model (one adapter or fully
fine-tuned weights, :class:`~clarifier.engine.inference.ClarifierEngine`) or a
``train.variant=pipeline`` folder (``pipeline.json``, :class:`~clarifier.engine.pipeline.PipelineEngine`).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from clarifier.engine.models import ModelResolutionError, default_cache_dir
from clarifier.runtime import storage

SCHEME_GROUP = "clarifier.model_uri_schemes"
_BUILTIN_SCHEMES = {  # what pyproject.toml registers, for a checkout that is not pip-installed
    "models": "clarifier.registry.registry:resolve_registry_uri",
    "runs": "clarifier.registry.registry:resolve_registry_uri",
    "builtin": "clarifier.engine.builtin:resolve_builtin_uri",
}


@dataclass(frozen=True)
class ResolvedModel:
    folder: Path
    version: str  # "name/3" for registry models, else the URI


@lru_cache(maxsize=None)
def _schemes() -> dict[str, str]:
    found = dict(_BUILTIN_SCHEMES)
    found.update({ep.name: ep.value for ep in entry_points(group=SCHEME_GROUP)})
    return found


def scheme_resolver(scheme: str) -> Callable[..., ResolvedModel]:
    target = _schemes().get(scheme)
    if target is None:
        raise ModelResolutionError(f"no resolver for model URIs {scheme}:/ (known: folder, s3://, "
                                   f"{', '.join(s + ':/' for s in sorted(_schemes()))}; add one with an entry point "
                                   f"in the group {SCHEME_GROUP})")
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def resolve_model(uri: str | Path, cache_dir: str | Path | None = None, tracking_uri: str | None = None) -> ResolvedModel:
    """The local folder behind a model URI (downloaded once into ``cache_dir``)."""
    uri = str(uri)
    if storage.is_s3(uri):
        key = "s3-" + hashlib.sha256(uri.encode()).hexdigest()[:16]
        return ResolvedModel(download_once(key, cache_dir, lambda dst: storage.download_prefix(uri, dst) and dst), uri)
    scheme = uri.split(":", 1)[0] if ":" in uri else ""
    # "scheme:/..." of any scheme (an unknown one gets the list), or "name:rest" of a registered one
    # (builtin:clarifier-smollm2-135m); "C:/..." is a drive, not a scheme.
    if (len(scheme) > 1 and not Path(uri).expanduser().is_dir()
            and (uri.startswith(f"{scheme}:/") or scheme in _schemes())):
        return scheme_resolver(scheme)(uri, cache_dir=cache_dir, tracking_uri=tracking_uri)
    p = Path(uri).expanduser()
    if not p.is_dir():
        raise ModelResolutionError(f"model {uri} is not a folder, s3:// prefix or "
                                   f"{', '.join(s + ':/' for s in sorted(_schemes()))} URI")
    return ResolvedModel(p, str(p))


def download_once(key: str, cache_dir, fetch: Callable[[str], object]) -> Path:
    """``fetch(tmp_dir)`` into ``<cache>/<key>`` unless a finished copy is there; atomic (rename)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir().parent / "registry"
    out = root / key
    if (out / "clarifier.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".", dir=root))
    try:
        got = fetch(str(tmp))
        got = Path(got) if got else tmp
        # download_artifacts returns the folder it wrote; its contents are the model folder.
        if not (got / "clarifier.json").is_file():
            inner = [d for d in got.iterdir() if d.is_dir() and (d / "clarifier.json").is_file()]
            if len(inner) == 1:
                got = inner[0]
            else:
                raise ModelResolutionError(f"downloaded model for {key} has no clarifier.json")
        if out.exists():
            shutil.rmtree(out)
        os.replace(got, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_engine(uri: str | Path, *, version: str | None = None, download_dir=None, tracking_uri: str | None = None,
                cache_dir=None, threshold: float | None = None, max_new_tokens: int = 48, precision: str = "auto",
                device: str = "cpu", decision_head: bool = True, decode: str = "auto"):
    """Resolve ``uri`` and load the engine its folder holds (joint or pipeline) in ``precision`` on
    ``device``. ``download_dir`` caches downloaded model folders; ``cache_dir`` base-model weights;
    ``decision_head=False`` ignores a decision head the folder holds (the decision-token logits decide); ``decode``:
    :data:`clarifier.engine.decode.DECODE_MODES`."""
    from clarifier.engine.inference import ClarifierEngine
    from clarifier.engine.pipeline import PipelineEngine, is_pipeline_folder

    resolved = resolve_model(uri, cache_dir=download_dir, tracking_uri=tracking_uri)
    cls = PipelineEngine if is_pipeline_folder(resolved.folder) else ClarifierEngine
    return cls.from_folder(resolved.folder, version=version or resolved.version, cache_dir=cache_dir,
                           threshold=threshold, max_new_tokens=max_new_tokens, precision=precision, device=device,
                           decision_head=decision_head, decode=decode)
