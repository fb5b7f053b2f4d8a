"""The evaluation job: a model and its baselines on one held-out split, one report, logged to MLflow."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from ..config import ClarifierConfig
from ..schema import Example


def load_examples(data: str, split: str = "test") -> list[Example]:
    """Examples from a data-job output folder (its ``split``) or an evaluation-set JSONL file."""
    from .. import storage
    from ..data.pipeline import load_split

    if storage.exists(storage.join(data, "manifest.json")):
        return load_split(data, split)
    return load_eval_jsonl(data)


def load_eval_jsonl(uri: str, report=print) -> list[Example]:
    """Read an evaluation-set JSONL file; malformed lines are reported with their number and skipped."""
    from .. import storage
    from ..data.validate import parse_line

    out: list[Example] = []
    bad = 0
    for f in storage.list_files(uri):
        fs, path = storage.filesystem(f)
        with fs.open_input_stream(path) as s:
            raw = s.read()
        if f.endswith(".gz"):
            import gzip

            raw = gzip.decompress(raw)
        for i, line in enumerate(raw.split(b"\n"), start=1):
            if not line.strip():
                continue
            exs, q = parse_line(line, f, i)
            if q is not None:
                bad += 1
                report(f"[eval] skipped {f}:{i}: {q['reason']}")
            out.extend(exs)
    if bad:
        report(f"[eval] {bad} malformed lines skipped, {len(out)} examples kept")
    return out


def _baseline(name: str, examples: list[Example]):
    from .metrics import Prediction

    if name == "always_ask":
        return [Prediction(needs_clarification=True, confidence=1.0) for _ in examples]
    if name == "never_ask":
        return [Prediction(needs_clarification=False, confidence=0.0) for _ in examples]
    raise ValueError(f"unknown baseline {name!r}")


def _score_only(engine, examples: list[Example], batch_size: int, progress) -> list:
    """Decision-only predictions (no decoding): the cheap path for the zero-shot base baseline."""
    from .metrics import Prediction

    return [Prediction(needs_clarification=p >= engine.threshold, confidence=p)
            for p in engine.score_examples(examples, batch_size, progress)]


def evaluate(cfg: ClarifierConfig, model_uri: str, data: str | None = None, *, run_id: str | None = None,
             out_dir: str | None = None, progress=print) -> dict:
    """Evaluate ``model_uri`` (models:/, runs:/, s3:// or folder) and the configured baselines.

    Returns the report dict (also written as JSON/Markdown/PNG to ``out_dir`` and, with
    ``run_id``, logged to that MLflow run as metrics ``eval/<metric>`` and artifacts ``eval/``).
    """
    from ..inference import ClarifierEngine
    from ..registry.registry import resolve_model_uri
    from .metrics import evaluate_predictions
    from .report import format_table, write_report

    data = data or cfg.data.output
    examples = load_examples(data, cfg.eval.split)
    if cfg.eval.max_examples:
        examples = examples[: cfg.eval.max_examples]
    if not examples:
        raise ValueError(f"no evaluation examples in {data} (split {cfg.eval.split!r})")
    gold = [e.needs_clarification for e in examples]
    progress(f"[eval] {len(examples)} examples ({sum(gold)} need clarification) from {data}")

    def bar(name):
        def _p(done, total):
            if done == total or done % max(cfg.eval.batch_size * 4, 1) == 0:
                progress(f"[eval] {name}: {done}/{total}")
        return _p

    tracking_uri = cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    resolved = resolve_model_uri(model_uri, tracking_uri=tracking_uri)
    engine = ClarifierEngine.from_folder(resolved.folder, version=resolved.version, cache_dir=cfg.model.cache_dir,
                                         max_new_tokens=cfg.eval.max_new_tokens)
    models: dict[str, dict] = {}
    t0 = time.time()
    preds = engine.predict(examples, batch_size=cfg.eval.batch_size, progress=bar("model"))
    secs = time.time() - t0
    models["model"] = {"metrics": evaluate_predictions(examples, preds), "scores": [p.confidence for p in preds], "gold": gold}
    samples = [{"id": e.id, "query": e.query, "gold": e.needs_clarification, "gold_question": e.clarifying_question,
                "pred": p.needs_clarification, "confidence": round(p.confidence, 4), "question": p.question,
                "grounding_turns": list(p.grounding_turns), "valid": p.valid}
               for e, p in list(zip(examples, preds))[:20]]
    for name in cfg.eval.baselines:
        if name == "base_model":
            # Zero-shot decision: clarify iff P(clarify) > P(answer), i.e. threshold 0.5.
            base = ClarifierEngine.from_base(engine_base(resolved.folder), cache_dir=cfg.model.cache_dir,
                                             threshold=0.5, prompt_opts=engine.opts)
            bp = _score_only(base, examples, cfg.eval.batch_size, bar("base_model"))
            del base
        else:
            bp = _baseline(name, examples)
        models[name] = {"metrics": evaluate_predictions(examples, bp), "scores": [p.confidence for p in bp], "gold": gold}
    report = {
        "model_uri": model_uri, "model_version": resolved.version, "data": data, "split": cfg.eval.split,
        "n": len(examples), "threshold": engine.threshold, "seconds_model": round(secs, 1),
        "notes": "base_model is the untrained base model with the same prompt, zero-shot (clarify iff "
                 "P(clarify) > P(answer)), decision only (no decoding).",
        "models": models, "samples": samples,
    }
    out = Path(out_dir or tempfile.mkdtemp(prefix="clarifier-eval-"))
    paths = write_report(report, out)
    (out / "samples.json").write_text(json.dumps(samples, indent=2))
    progress(format_table(report))
    if run_id:
        _log_to_mlflow(run_id, report, out, tracking_uri)
    report["paths"] = {k: str(v) for k, v in paths.items()}
    return report


def engine_base(folder) -> str:
    from ..inference import read_meta

    return read_meta(folder).base_model


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

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        metrics = {}
        for name, m in report["models"].items():
            prefix = "eval" if name == "model" else f"eval_baseline/{name}"
            metrics.update(_flat_metrics(prefix, m["metrics"]))
        mlflow.log_metrics(metrics)
        mlflow.log_artifacts(str(out), artifact_path="eval")
