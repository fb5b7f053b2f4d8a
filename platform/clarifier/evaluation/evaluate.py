"""The evaluation job: a model and its baselines on one held-out split, one report, logged to MLflow."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from clarifier.core.config import ClarifierConfig
from clarifier.engine.precision import describe
from clarifier.core.schema import Example


@dataclass
class EvalData:
    """An evaluation set as read: its examples, the malformed lines skipped, and its identity."""

    examples: list[Example]
    skipped: list[dict] = field(default_factory=list)  # {"source", "line", "reason"}
    name: str = ""
    fingerprint: str = ""  # sha256 of the examples' canonical JSON, in order


def fingerprint_examples(examples: list[Example]) -> str:
    """Identity of an evaluation set: sha256 over the examples' canonical JSON, in order."""
    h = hashlib.sha256()
    for e in examples:
        # decision_only is left out when false, so sets from before the field keep their fingerprint
        h.update(e.model_dump_json(exclude=None if e.decision_only else {"decision_only"}).encode())
        h.update(b"\n")
    return h.hexdigest()


MAX_MISTAKES = 50  # wrong decisions kept in a report (all are counted)
BUILTIN_SETS_DIR = Path(__file__).resolve().parent / "sets"


def builtin_eval_sets() -> list[str]:
    """Evaluation sets shipped with the package (``builtin:<name>``), e.g. ``probes``."""
    return sorted(p.stem for p in BUILTIN_SETS_DIR.glob("*.jsonl"))


def resolve_eval_set(data: str) -> str:
    """``builtin:<name>`` -> the shipped JSONL file; any other location is returned unchanged."""
    if not data.startswith("builtin:"):
        return data
    name = data.split(":", 1)[1].strip("/")
    path = BUILTIN_SETS_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"no built-in evaluation set {name!r} (shipped: {', '.join(builtin_eval_sets()) or 'none'}); "
                         "a data-job output folder or an evaluation-set JSONL file, folder or s3:// prefix works too")
    return str(path)


def mistaken_decisions(examples: list[Example], preds: list) -> list[dict]:
    """The examples whose decision was wrong, in order: id, source, query, gold, confidence, the
    generated question and ``meta.why`` (why the gold label holds, where the set says)."""
    from clarifier.core.schema import source_of

    return [{"id": e.id, "source": source_of(e), "query": e.query, "gold": e.needs_clarification,
             "confidence": round(float(p.confidence), 4), "question": p.question, "why": e.meta.get("why")}
            for e, p in zip(examples, preds) if bool(p.needs_clarification) != bool(e.needs_clarification)]


def load_eval_data(data: str, split: str = "test", *, max_examples: int | None = None, report=print) -> EvalData:
    """A data-job output folder (its ``split``), an evaluation-set JSONL file/folder or a built-in
    set (``builtin:probes``, :func:`resolve_eval_set`), with its identity.

    ``max_examples`` keeps the first N (the fingerprint is of what is evaluated).
    """
    from clarifier.runtime import storage
    from clarifier.data.outputs import load_split

    path = resolve_eval_set(data)
    if storage.exists(storage.join(path, "manifest.json")):
        examples, skipped, name = load_split(path, split), [], f"{path}#{split}"
    else:
        examples, skipped = read_eval_jsonl(path, report=report)
        name = data  # builtin:<name> stays the set's name; its file is in the package
    if max_examples:
        examples = examples[:max_examples]
    return EvalData(examples, skipped, name, fingerprint_examples(examples))


def load_examples(data: str, split: str = "test") -> list[Example]:
    """Examples from a data-job output folder (its ``split``) or an evaluation-set JSONL file."""
    return load_eval_data(data, split).examples


def read_eval_jsonl(uri: str, report=print) -> tuple[list[Example], list[dict]]:
    """Read evaluation-set JSONL (file, folder or s3:// prefix; ``.gz`` too) with the data job's validation.

    Each malformed line is reported (``source:line: reason``) and skipped; the skipped lines are
    returned as ``{"source", "line", "reason"}`` records. Lines are validated by the same
    ``parse_line`` as the data job, files read and split into lines the same way.
    """
    import gzip
    import zlib

    from clarifier.runtime import storage
    from clarifier.data.validate import read_file, split_lines
    from clarifier.data.validate import parse_line

    out: list[Example] = []
    skipped: list[dict] = []
    for f in storage.list_files(uri, (".jsonl", ".jsonl.gz", ".json")) or storage.list_files(uri):
        fs, path = storage.filesystem(f)
        raw = read_file(fs, path)
        if f.endswith(".gz"):
            try:
                raw = gzip.decompress(raw)
            except (OSError, EOFError, ValueError, zlib.error) as exc:
                skipped.append({"source": f, "line": 0, "reason": f"cannot decompress gzip file: {exc}"})
                report(f"[eval] skipped {f}: cannot decompress gzip file: {exc}")
                continue
        for i, line in enumerate(split_lines(raw), start=1):
            if not line.strip():
                continue
            exs, q = parse_line(line, f, i)
            if q is not None:
                skipped.append({"source": q["source"], "line": q["line"], "reason": q["reason"]})
                report(f"[eval] skipped {f}:{i}: {q['reason']}")
            out.extend(exs)
    if skipped:
        report(f"[eval] {len(skipped)} malformed lines skipped, {len(out)} examples kept")
    return out, skipped


def similarity_fn_for(cfg: ClarifierConfig, progress):
    """``SentenceEncoder(...).similarity`` for the question metric, or None (disabled / not installed)."""
    if not cfg.eval.semantic_encoder:
        return None, "disabled (eval.semantic_encoder is null)"
    from clarifier.engine.similarity import EncoderNotAvailable, SentenceEncoder

    try:
        return SentenceEncoder(cfg.eval.semantic_encoder).similarity, cfg.eval.semantic_encoder
    except EncoderNotAvailable as exc:
        progress(f"[eval] WARNING: no semantic similarity: {exc}")
        return None, f"unavailable: {exc}"


def _predict(cfg: ClarifierConfig, spec: dict, examples: list[Example], *, opts, engine=None, mode: str = "predict",
             progress=print, bar=None) -> list:
    """Predictions through the configured engine (``eval.engine``): in process, or Ray Data actors."""
    from clarifier.core.metrics import Prediction
    from clarifier.engine.ray_pool import ray_predict

    if cfg.eval.engine == "ray":
        from clarifier.runtime.cluster import init_ray

        init_ray()
        return ray_predict(examples, spec, opts=opts, mode=mode, batch_size=cfg.eval.batch_size, progress=progress,
                           **cfg.eval.ray_pool())
    if mode == "score":
        return [Prediction(needs_clarification=p >= engine.threshold, confidence=p)
                for p in engine.score_examples(examples, cfg.eval.batch_size, bar)]
    return engine.predict(examples, batch_size=cfg.eval.batch_size, progress=bar)


def evaluate(cfg: ClarifierConfig, model_uri: str, data: str | None = None, *, run_id: str | None = None,
             out_dir: str | None = None, progress=print, table: bool = True) -> dict:
    """Evaluate ``model_uri`` (models:/, runs:/, s3:// or folder) and the configured baselines.

    Returns the report dict (also written as JSON/Markdown/PNG to ``out_dir``, by default a new
    :func:`default_report_folder` under ``storage.root``, and, with ``run_id``, logged to that MLflow run as
    metrics ``eval/<metric>`` and artifacts ``eval/``).
    ``table=False`` leaves the table out of ``progress`` (the quickstart ends with its own summary).
    Scoring and generation run in this process (``eval.engine=local``) or in a pool of Ray Data
    actors (``eval.engine=ray``); the always-ask, never-ask and lexical baselines are always in it.
    """
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import resolve_model
    from clarifier.runtime.mlflow_uri import tracking_uri as resolve_tracking_uri
    from clarifier.evaluation.baselines import baseline_predictions
    from clarifier.core.metrics import evaluate_predictions
    from clarifier.evaluation.report import format_source_table, format_table, write_report

    data = data or cfg.data.output
    if not data:
        raise ValueError("no evaluation data: pass --data (a data-job output folder or an evaluation-set JSONL) "
                         "or set data.output")
    ed = load_eval_data(data, cfg.eval.split, max_examples=cfg.eval.max_examples, report=progress)
    examples = ed.examples
    if not examples:
        raise ValueError(f"no evaluation examples in {data} (split {cfg.eval.split!r}; "
                         f"{len(ed.skipped)} malformed lines skipped)")
    gold = [e.needs_clarification for e in examples]
    precision = describe(cfg.model.precision, "cuda" if cfg.eval.ray_gpus_per_actor else "cpu")
    progress(f"[eval] {len(examples)} examples ({sum(gold)} need clarification) from {data}"
             + (f"; {len(ed.skipped)} malformed lines skipped" if ed.skipped else "") + f"; inference in {precision}")

    def bar(name):
        def _p(done, total):
            if done == total or done % max(cfg.eval.batch_size * 4, 1) == 0:
                progress(f"[eval] {name}: {done}/{total}")
        return _p

    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    resolved = resolve_model(model_uri, tracking_uri=tracking_uri)
    meta = read_meta(resolved.folder)
    spec = {"model_uri": model_uri, "tracking_uri": tracking_uri, "cache_dir": cfg.model.cache_dir,
            "max_new_tokens": cfg.eval.max_new_tokens, "precision": cfg.model.precision, "decode": cfg.model.decode}
    sim_fn, sim_info = similarity_fn_for(cfg, progress)

    def row(preds, **extra) -> dict:
        return {"metrics": evaluate_predictions(examples, preds, similarity_fn=sim_fn),
                "scores": [p.confidence for p in preds], "gold": gold, **extra}

    t0 = time.time()
    preds = _model_predictions(cfg, spec, resolved, examples, progress, bar("model"))
    secs = time.time() - t0
    models: dict[str, dict] = {"model": row(preds)}
    mistakes = mistaken_decisions(examples, preds)
    samples = [{"id": e.id, "query": e.query, "gold": e.needs_clarification, "gold_question": e.clarifying_question,
                "pred": p.needs_clarification, "confidence": round(p.confidence, 4), "question": p.question,
                "grounding_turns": list(p.grounding_turns), "valid": p.valid}
               for e, p in list(zip(examples, preds))[:20]]
    for name, uri in cfg.eval.compare.items():  # e.g. the pipeline variant, beside the joint model
        if name in ("model", "always_ask", "never_ask", "lexical", "base_model", SURFACE):
            raise ValueError(f"eval.compare name {name!r} is taken by a built-in row; pick another")
        other = resolve_model(uri, tracking_uri=tracking_uri)
        models[name] = row(_model_predictions(cfg, {**spec, "model_uri": uri}, other, examples, progress, bar(name)),
                           model_uri=uri, model_version=other.version)
    for name in dict.fromkeys(["always_ask", "never_ask", "lexical", *cfg.eval.baselines]):
        models[name] = row(_zero_shot_predictions(cfg, meta, examples, progress, bar(name)) if name == "base_model"
                           else baseline_predictions(name, examples))
    control_preds, control_info = surface_control_row(cfg, data, examples, progress)
    models[SURFACE] = row(control_preds, control=control_info)
    skill = surface_skill(examples, models["model"]["scores"], models[SURFACE]["scores"])
    report = {
        "model_uri": model_uri, "model_version": resolved.version, "data": data, "split": cfg.eval.split,
        "data_name": ed.name, "data_fingerprint": ed.fingerprint,
        "n": len(examples), "skipped_lines": len(ed.skipped), "skipped": ed.skipped[:50],
        "threshold": meta.threshold, "engine": cfg.eval.engine, "seconds_model": round(secs, 1),
        "precision": precision, "trained_precision": meta.precision,
        "semantic_encoder": sim_info,
        "notes": "base_model is the untrained base model with the same prompt, zero-shot (clarify iff "
                 "P(clarify) > P(answer)), decision only (no decoding). lexical is the rule-based heuristic "
                 "of clarifier.evaluation.baselines (pronoun/short query + 2+ candidate entities in the history).",
        "skill": skill,
        "models": models, "samples": samples, "n_mistakes": len(mistakes), "mistakes": mistakes[:MAX_MISTAKES],
    }
    out = Path(out_dir) if out_dir else default_report_folder(cfg)
    paths = write_report(report, out)
    (out / "samples.json").write_text(json.dumps(samples, indent=2))
    if table:
        progress(format_table(report))
        by_source = format_source_table(report)
        if by_source:
            progress("By source (model):\n" + by_source)
    progress(f"[eval] {skill['verdict']}")
    if run_id:
        _log_to_mlflow(run_id, report, out, tracking_uri)
    report["paths"] = {k: str(v) for k, v in paths.items()}
    return report


SURFACE = "surface_control"


def surface_control_row(cfg: ClarifierConfig, data: str, examples: list[Example], progress=print):
    """The surface control's row (:func:`clarifier.evaluation.baselines.surface_control_predictions`): fitted on the
    train split of ``data`` when it is a data-job output that has one (threshold on ``eval.calibration_split``), else
    cross-fitted on the evaluation set itself. Returns ``(predictions, how it was fitted)``."""
    from clarifier.data.outputs import load_split, read_manifest
    from clarifier.evaluation.baselines import surface_control_predictions
    from clarifier.runtime import storage

    path = resolve_eval_set(data)
    train: list[Example] = []
    cal: list[Example] = []
    if storage.exists(storage.join(path, "manifest.json")) and cfg.eval.split != "train":
        splits = (read_manifest(path).get("counts") or {}).get("splits") or {}
        if "train" in splits:
            train = load_split(path, "train")
            cs = cfg.eval.calibration_split
            cal = load_split(path, cs) if cs and cs in splits and cs != cfg.eval.split else []
    preds, info = surface_control_predictions(train, cal, examples, cfg.eval.max_over_asking)
    progress(f"[eval] surface control (position and length only): fitted on {info['fitted_on']}")
    return preds, info


def surface_skill(examples: list[Example], model_scores: list[float], control_scores: list[float]) -> dict:
    """The model's margin over the surface control (:func:`clarifier.core.surface.skill_over_control`): inside each
    source and their mean where the set has more than one source, else on the whole set."""
    from clarifier.core.schema import source_of
    from clarifier.core.surface import skill_over_control

    sources = [source_of(e) for e in examples]
    return skill_over_control([bool(e.needs_clarification) for e in examples], model_scores, control_scores,
                              sources if len(set(sources)) > 1 else None)


def default_report_folder(cfg: ClarifierConfig) -> Path:
    """Where a report goes when no folder is named: ``<storage.root>/eval/<UTC time>-<6 hex>`` (an ``s3://``
    root: the same under the local cache), beside the training runs' own evaluation copies, kept and said."""
    from clarifier.train.trainer import run_folder

    return run_folder(cfg, f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}", "eval")


def evaluate_training_run(cfg: ClarifierConfig, model_dir: str, run_id: str, *, out_dir: str | None = None,
                          progress=print) -> dict | None:
    """The evaluation every training run ends with: ``model_dir`` on ``eval.split`` of ``data.output``,
    logged to the training run ``run_id`` (metrics ``eval/...``, artifacts ``eval/``: report.md, report.json,
    plots; the local copy in ``out_dir``, default ``<storage.root>/eval/<run_id>``). Returns the report, or None
    (said in one line) when the data has no such split to evaluate on."""
    from clarifier.data.outputs import read_manifest

    data = cfg.data.output
    try:
        splits = read_manifest(data).get("counts", {}).get("splits", {}) if data else None
    except FileNotFoundError:
        splits = None
    if splits is None:
        progress(f"[eval] skipped: no data-job output at data.output={data!r} to evaluate on")
        return None
    if not splits.get(cfg.eval.split, {}).get("examples"):
        progress(f"[eval] skipped: split {cfg.eval.split!r} of {data} is empty (set eval.split to another split)")
        return None
    if out_dir is None:
        from clarifier.train.trainer import run_folder

        out_dir = str(run_folder(cfg, run_id, "eval"))
    report = evaluate(cfg, model_dir, data, run_id=run_id, out_dir=out_dir, progress=progress)
    progress(f"[eval] report logged to MLflow run {run_id} (artifacts eval/report.md and plots); "
             f"local copy {report['paths']['markdown']}")
    return report


def _model_predictions(cfg: ClarifierConfig, spec: dict, resolved, examples: list[Example], progress, bar) -> list:
    """A trained model's predictions: loaded in this process (``eval.engine=local``), else by the actors."""
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import load_engine

    engine = None
    if cfg.eval.engine == "local":
        engine = load_engine(resolved.folder, version=resolved.version, cache_dir=cfg.model.cache_dir,
                             max_new_tokens=cfg.eval.max_new_tokens, precision=cfg.model.precision,
                             decode=cfg.model.decode)
    else:  # a folder on this disk reaches actors on other nodes through the object store
        from clarifier.engine.ray_pool import model_fields
        from clarifier.runtime.cluster import init_ray

        init_ray()
        spec = {**{k: v for k, v in spec.items() if k != "model_uri"}, **model_fields(spec["model_uri"])}
    return _predict(cfg, spec, examples, opts=read_meta(resolved.folder).prompt_options(), engine=engine,
                    progress=progress, bar=bar)


def _zero_shot_predictions(cfg: ClarifierConfig, meta, examples: list[Example], progress, bar) -> list:
    """The untrained base model with the model's prompt, decision only, clarify iff P(clarify) > P(answer)
    (threshold 0.5, not calibrated: the recipe benchmark's zero-shot rows calibrate on dev)."""
    from clarifier.engine.inference import ClarifierEngine

    spec = {"base_model": meta.base_model, "cache_dir": cfg.model.cache_dir, "threshold": 0.5,
            "prompt": meta.prompt or {}, "precision": cfg.model.precision}
    engine = None
    if cfg.eval.engine == "local":
        engine = ClarifierEngine.from_base(meta.base_model, cache_dir=cfg.model.cache_dir, threshold=0.5,
                                           prompt_opts=meta.prompt_options(), precision=cfg.model.precision)
    return _predict(cfg, spec, examples, opts=meta.prompt_options(), engine=engine, mode="score", progress=progress,
                    bar=bar)


def _flat_metrics(prefix: str, d: dict) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}/{k}"
        if isinstance(v, dict):
            out.update(_flat_metrics(key, v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def _log_to_mlflow(run_id: str, report: dict, out: Path, tracking_uri: str | None) -> None:
    import mlflow

    from clarifier.runtime.mlflow_uri import check_reachable

    if tracking_uri:
        check_reachable(tracking_uri)
        mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        metrics = {}
        for name, m in report["models"].items():
            prefix = "eval" if name == "model" else f"eval_baseline/{name}"
            metrics.update(_flat_metrics(prefix, m["metrics"]))
        skill = report.get("skill") or {}
        for key in ("within_source", "mixed"):  # the margin over the surface control, and its interval
            f = skill.get(key) or {}
            if f.get("skill") is not None:
                metrics[f"eval/skill/{key}"] = f["skill"]
                if f.get("interval"):
                    metrics[f"eval/skill/{key}_lo"], metrics[f"eval/skill/{key}_hi"] = f["interval"]
        mlflow.log_metrics(metrics)
        mlflow.set_tags({"eval.data": report.get("data_name", ""), "eval.data_fingerprint": report.get("data_fingerprint", ""),
                         "eval.precision": report.get("precision", ""),
                         "eval.beats_surface_control": str(bool(skill.get("beats_control"))).lower()})
        mlflow.log_artifacts(str(out), artifact_path="eval")
