"""MLflow model registry: register trained adapters, move aliases, resolve model URIs to folders.

Aliases are the only promotion mechanism (MLflow stages are deprecated). A registered version's
``source`` is the run's ``adapter`` artifact folder (MLflow 3 only registers ``runs:/`` paths of
logged models, so the version is created from the artifact URI directly).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..models import ModelResolutionError, default_cache_dir
from .. import storage


@dataclass(frozen=True)
class ResolvedModel:
    folder: Path
    version: str  # "name/3" for registry models, else the URI


def _client(tracking_uri: str | None = None):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def register_adapter(run_id: str, name: str, *, artifact_path: str = "adapter", alias: str | None = None,
                     tags: dict | None = None, tracking_uri: str | None = None):
    """Create a model version from a run's adapter artifacts; optionally point ``alias`` at it."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="Clarifier query-clarification adapters (PEFT LoRA).")
    run = client.get_run(run_id)
    source = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path}"
    mv = client.create_model_version(name=name, source=source, run_id=run_id, tags={k: str(v) for k, v in (tags or {}).items()})
    if alias:
        client.set_registered_model_alias(name, alias, mv.version)
    return mv


def set_alias(name: str, alias: str, version: str | int, tracking_uri: str | None = None) -> None:
    _client(tracking_uri).set_registered_model_alias(name, alias, str(version))


def _parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/name@alias`` or ``models:/name/3`` -> (name, alias, version)."""
    rest = uri[len("models:/"):].strip("/")
    if "@" in rest:
        name, alias = rest.split("@", 1)
        return name, alias, None
    if "/" in rest:
        name, version = rest.rsplit("/", 1)
        return name, None, version
    raise ModelResolutionError(f"{uri}: expected models:/<name>@<alias> or models:/<name>/<version>")


def resolve_model_uri(uri: str, cache_dir: str | Path | None = None, tracking_uri: str | None = None) -> ResolvedModel:
    """Download (once) the model folder behind a ``models:/``, ``runs:/``, ``s3://`` URI or a folder."""
    import mlflow

    if uri.startswith("models:/"):
        name, alias, version = _parse_models_uri(uri)
        client = _client(tracking_uri)
        try:
            mv = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
        except Exception as exc:  # MlflowException with a RESOURCE_DOES_NOT_EXIST code
            raise ModelResolutionError(f"{uri}: no such registered model version ({exc})") from None
        label = f"{name}/{mv.version}"
        key = f"{mv.name}-v{mv.version}-{hashlib.sha256(mv.source.encode()).hexdigest()[:8]}"
        folder = _download_once(key, cache_dir, lambda dst: mlflow.artifacts.download_artifacts(
            artifact_uri=mv.source, dst_path=dst, tracking_uri=tracking_uri))
        return ResolvedModel(folder, label)
    if uri.startswith("runs:/"):
        key = "run-" + hashlib.sha256(uri.encode()).hexdigest()[:16]
        folder = _download_once(key, cache_dir, lambda dst: mlflow.artifacts.download_artifacts(
            artifact_uri=uri, dst_path=dst, tracking_uri=tracking_uri))
        return ResolvedModel(folder, uri)
    if storage.is_s3(uri):
        key = "s3-" + hashlib.sha256(uri.encode()).hexdigest()[:16]
        folder = _download_once(key, cache_dir, lambda dst: storage.download_prefix(uri, dst) and dst)
        return ResolvedModel(folder, uri)
    p = Path(uri).expanduser()
    if not p.is_dir():
        raise ModelResolutionError(f"model {uri} is not a folder, models:/, runs:/ or s3:// URI")
    return ResolvedModel(p, str(p))


def _download_once(key: str, cache_dir, fetch) -> Path:
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
