"""MLflow model registry: register trained adapters, move aliases, resolve ``models:/`` and ``runs:/`` URIs to folders.

Aliases are the only promotion mechanism (MLflow stages are deprecated). A registered version's
``source`` is the run's ``adapter`` artifact folder (MLflow 3 only registers ``runs:/`` paths of
logged models, so the version is created from the artifact URI directly).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from clarifier.engine.loading import ResolvedModel, download_once
from clarifier.engine.models import ModelResolutionError


def _client(tracking_uri: str | None = None):
    from mlflow import MlflowClient

    from clarifier.runtime.mlflow_uri import check_reachable, tracking_uri as resolve

    uri = resolve(tracking_uri)
    check_reachable(uri)  # seconds, not MLflow's four minutes of retries, when the server is down
    return MlflowClient(tracking_uri=uri)


def _not_found(exc) -> bool:
    """An MlflowException that means "no such model/version/alias" (not an outage or a refusal)."""
    return getattr(exc, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


# Metrics kept as model-version tags (``eval.<key>``) and compared by the promotion gate / diff:
# key -> path into an ``evaluate_predictions`` metrics dict.
KEY_METRICS: dict[str, tuple[str, ...]] = {
    "f1": ("decision", "f1"),
    "precision": ("decision", "precision"),
    "recall": ("decision", "recall"),
    "over_asking_rate": ("decision", "over_asking_rate"),
    "under_asking_rate": ("decision", "under_asking_rate"),
    "auroc": ("auroc",),
    "ece": ("ece",),
    "validity": ("validity",),
    "rougeL_f": ("question", "rougeL_f"),
    "semantic_similarity": ("question", "semantic_similarity"),
    "grounding_em": ("grounding", "exact_match"),
    "n": ("n",),
}
EVAL_SET_TAG = "eval.sets."  # + first 16 hex of the evaluation set's fingerprint -> JSON {data, fingerprint, metrics}


def key_metrics(metrics: dict) -> dict[str, float | None]:
    """The ``KEY_METRICS`` of an ``evaluate_predictions`` result (None where undefined)."""
    out: dict[str, float | None] = {}
    for key, path in KEY_METRICS.items():
        v = metrics
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        out[key] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return out


def eval_set_tags(data_name: str, fingerprint: str, metrics: dict[str, float | None]) -> dict[str, str]:
    """The per-evaluation-set tag of a version: ``eval.sets.<fp16>`` = compact JSON."""
    import json

    body = {"data": data_name[-300:], "fingerprint": fingerprint,
            "metrics": dict(metrics)}  # exact floats: the gate compares these
    return {EVAL_SET_TAG + fingerprint[:16]: json.dumps(body, separators=(",", ":"))}


def eval_tags(report: dict) -> dict[str, str]:
    """Version tags from an evaluation report: ``eval.<metric>`` of the model, its data set and fingerprint."""
    km = key_metrics(report["models"]["model"]["metrics"])
    tags = {f"eval.{k}": ("" if v is None else repr(v)) for k, v in km.items()}
    tags["eval.data"] = str(report.get("data_name") or report.get("data") or "")[-500:]
    fp = report.get("data_fingerprint") or ""
    tags["eval.data_fingerprint"] = fp
    if fp:
        tags.update(eval_set_tags(tags["eval.data"], fp, km))
    return tags


def logged_eval_sets(tags: dict) -> dict[str, dict]:
    """fingerprint -> {"data", "fingerprint", "metrics"} for every evaluation set logged on a version."""
    import json

    out = {}
    for k, v in (tags or {}).items():
        if k.startswith(EVAL_SET_TAG):
            try:
                body = json.loads(v)
                out[body["fingerprint"]] = body
            except (ValueError, KeyError, TypeError):
                continue
    return out


def _run_json_artifact(client, run_id: str, path: str):
    """A JSON artifact of a run, or None when the run does not have it."""
    import json

    folder, _, fname = path.rpartition("/")
    try:
        if not any(a.path == path for a in client.list_artifacts(run_id, folder or None)):
            return None, None
        with tempfile.TemporaryDirectory() as d:
            local = client.download_artifacts(run_id, path, d)
            text = Path(local).read_text()
        return json.loads(text), text
    except Exception:  # an unreadable artifact is no lineage, not a failed registration
        return None, None


def lineage_tags(run_id: str, tracking_uri: str | None = None, client=None) -> dict[str, str]:
    """Tags of a new version from its training run: run id, data manifest (uri, sha256), base model, eval metrics.

    The manifest is the run's ``data/manifest.json`` artifact (logged by training), the eval metrics
    its ``eval/report.json`` (logged by ``clarifier eval --run-id``) when there is one.
    """
    client = client or _client(tracking_uri)
    run = client.get_run(run_id)
    t, p = run.data.tags, run.data.params
    tags = {"clarifier.run_id": run_id}
    base = t.get("clarifier.base_model") or p.get("model.base_model")
    if base:
        tags["clarifier.base_model"] = base
    manifest, text = _run_json_artifact(client, run_id, "data/manifest.json")
    data_uri = (manifest or {}).get("output") or t.get("clarifier.data") or p.get("data.output")
    if data_uri:
        tags["clarifier.data"] = str(data_uri)
    if text is not None:
        tags["clarifier.data_manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        tags["clarifier.data_manifest"] = f"runs:/{run_id}/data/manifest.json"
    report, _ = _run_json_artifact(client, run_id, "eval/report.json")
    if report and isinstance(report.get("models"), dict) and "model" in report["models"]:
        tags.update(eval_tags(report))
    return tags


CARD_METRICS = ("f1", "precision", "recall", "over_asking_rate", "auroc", "ece", "validity", "rougeL_f",
                 "semantic_similarity", "grounding_em", "n")


def model_card(tags: dict[str, str], meta: dict | None = None, params: dict | None = None,
               run_url: str | None = None) -> str:
    """The Markdown description of a model version: what it is, what it was trained on, how it did.

    ``tags`` are the version's lineage and eval tags (:func:`lineage_tags`), ``meta`` the model's
    ``clarifier.json`` (threshold, precision, calibration), ``params`` the training run's params."""
    meta, params = meta or {}, params or {}
    rows = [("base model", tags.get("clarifier.base_model") or meta.get("base_model")),
            ("fine-tuning", meta.get("finetune") or params.get("model.finetune")),
            ("recipe", ", ".join(f"{k} {params[k]}" for k in ("train.variant", "train.max_steps", "train.balance",
                                                            "model.lora.r") if params.get(k)) or None),
            ("training run", f"[{tags.get('clarifier.run_id')}]({run_url})" if run_url else tags.get("clarifier.run_id")),
            ("data", tags.get("clarifier.data")),
            ("data manifest", (f"{tags.get('clarifier.data_manifest')} (sha256 "
                               f"{tags['clarifier.data_manifest_sha256'][:12]}...)")
             if tags.get("clarifier.data_manifest_sha256") else None),
            ("threshold", None if meta.get("threshold") is None else
             f"{float(meta['threshold']):.3f}" + (f" ({meta['calibration'].get('rule')}, {meta['calibration'].get('split')} "
                                                  f"split, n={meta['calibration'].get('n')})"
                                                  if isinstance(meta.get("calibration"), dict) else "")),
            ("precision", meta.get("precision"))]
    lines = ["**Clarifier query-clarification model**", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows if v not in (None, "")]
    metrics = [(k, tags.get(f"eval.{k}")) for k in CARD_METRICS if tags.get(f"eval.{k}") not in (None, "")]
    if metrics:
        fp = tags.get("eval.data_fingerprint") or ""
        lines += ["", f"Evaluation on `{tags.get('eval.data') or '?'}`" + (f" (fingerprint `{fp[:16]}`)" if fp else "")
                  + ":", "", "| metric | value |", "|---|---|"]
        for k, v in metrics:
            num = _num(v)
            lines.append(f"| {k} | {int(num) if k == 'n' and num is not None else (f'{num:.4f}' if num is not None else v)} |")
    else:
        lines += ["", "No evaluation report on the training run (`clarifier eval --run-id <run>` logs one)."]
    return "\n".join(lines)


def run_url(tracking_uri: str | None, experiment_id: str, run_id: str) -> str | None:
    """The MLflow UI page of a run when the tracking URI is a server (http[s]://)."""
    if tracking_uri and tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return None


def register_adapter(run_id: str, name: str, *, artifact_path: str = "adapter", alias: str | None = None,
                     tags: dict | None = None, tracking_uri: str | None = None):
    """Create a model version from a run's adapter artifacts; optionally point ``alias`` at it.

    The version is tagged with its lineage (``lineage_tags``: run id, data manifest, base model,
    eval metrics when the run has an eval report); ``tags`` are added on top.
    """
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        client.get_registered_model(name)
    except MlflowException as exc:
        if not _not_found(exc):
            raise
        client.create_registered_model(name, description="Clarifier query-clarification models (PEFT LoRA adapters or fully fine-tuned weights).")
    run = client.get_run(run_id)
    source = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path}"
    all_tags = {**lineage_tags(run_id, client=client), **{k: str(v) for k, v in (tags or {}).items()}}
    meta, _ = _run_json_artifact(client, run_id, f"{artifact_path}/clarifier.json")
    card = model_card(all_tags, meta, run.data.params, run_url(client.tracking_uri, run.info.experiment_id, run_id))
    mv = client.create_model_version(name=name, source=source, run_id=run_id, tags=all_tags, description=card)
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


def resolve_registry_uri(uri: str, cache_dir: str | Path | None = None, tracking_uri: str | None = None) -> ResolvedModel:
    """The model folder behind ``models:/name@alias``, ``models:/name/3`` or ``runs:/<id>/<path>``,
    downloaded once into ``cache_dir``. Registered for those schemes as entry points (pyproject.toml,
    group ``clarifier.model_uri_schemes``); call :func:`clarifier.engine.loading.resolve_model`, which
    also takes folders and ``s3://``."""
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
        folder = download_once(key, cache_dir, lambda dst: mlflow.artifacts.download_artifacts(
            artifact_uri=mv.source, dst_path=dst, tracking_uri=tracking_uri))
        return ResolvedModel(folder, label)
    if uri.startswith("runs:/"):
        key = "run-" + hashlib.sha256(uri.encode()).hexdigest()[:16]
        folder = download_once(key, cache_dir, lambda dst: mlflow.artifacts.download_artifacts(
            artifact_uri=uri, dst_path=dst, tracking_uri=tracking_uri))
        return ResolvedModel(folder, uri)
    raise ModelResolutionError(f"{uri}: the registry resolves models:/ and runs:/ URIs only")


# ---- queries (``clarifier models list / diff`` render these) ---------------------------------


class RegistryError(LookupError):
    """A registered model or version that does not exist (the message says which)."""


def _num(v) -> float | None:
    try:
        return None if v in (None, "") else float(v)
    except (TypeError, ValueError):
        return None


def list_versions(name: str, tracking_uri: str | None = None) -> list[dict]:
    """Every version of ``name``, oldest first: aliases, key eval metrics, gate decisions, run."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        rm = client.get_registered_model(name)
    except MlflowException as exc:
        if not _not_found(exc):
            raise
        raise RegistryError(f"no registered model {name!r}") from None
    aliases: dict[str, list[str]] = {}
    for a, v in (rm.aliases or {}).items():
        aliases.setdefault(str(v), []).append(a)
    out = []
    for mv in sorted(client.search_model_versions(f"name='{name}'"), key=lambda m: int(m.version)):
        tags = mv.tags or {}
        out.append({
            "version": str(mv.version), "aliases": sorted(aliases.get(str(mv.version), [])),
            "f1": _num(tags.get("eval.f1")), "over_asking_rate": _num(tags.get("eval.over_asking_rate")),
            "validity": _num(tags.get("eval.validity")), "eval_data": tags.get("eval.data"),
            "gates": {k.split(".")[1]: v for k, v in tags.items() if k.startswith("gate.") and k.endswith(".decision")},
            "run_id": mv.run_id,
            "run_url": _version_run_url(client, tracking_uri, mv.run_id),
        })
    return out


def _version_run_url(client, tracking_uri: str | None, run_id: str | None) -> str | None:
    if not run_id:
        return None
    try:
        return run_url(tracking_uri or client.tracking_uri, client.get_run(run_id).info.experiment_id, run_id)
    except Exception:  # the run was deleted: the version still lists
        return None


def compare_versions(name: str, v1: str, v2: str, tracking_uri: str | None = None) -> dict:
    """Key metrics of two versions on their common evaluation set when they have one (else each
    version's own registration eval, with ``common: False``), plus their lineage tags."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        a, b = client.get_model_version(name, v1), client.get_model_version(name, v2)
    except MlflowException as exc:
        raise RegistryError(str(exc)) from None
    sa, sb = logged_eval_sets(a.tags), logged_eval_sets(b.tags)
    common = [fp for fp in sa if fp in sb]
    if common:
        fp = a.tags.get("eval.data_fingerprint") if a.tags.get("eval.data_fingerprint") in common else common[0]
        ma, mb, where = sa[fp]["metrics"], sb[fp]["metrics"], f"on {sa[fp]['data']} ({fp[:12]})"
    else:
        ma, mb = ({k: mv.tags.get(f"eval.{k}") for k in KEY_METRICS} for mv in (a, b))
        where = "WARNING: no common evaluation set; each version's own registration eval"
    lineage = []
    for label, key in (("run", None), ("base model", "clarifier.base_model"), ("data manifest", "clarifier.data_manifest_sha256")):
        lineage.append((label, a.run_id if key is None else a.tags.get(key), b.run_id if key is None else b.tags.get(key)))
    return {"where": where, "common": bool(common), "metrics": [(k, _num(ma.get(k)), _num(mb.get(k))) for k in KEY_METRICS],
            "lineage": lineage}
