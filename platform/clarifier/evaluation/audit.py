"""The RAG-log audit: is a clarifier worth it for this assistant? A Ray Data batch job over logs.

    summary = run_audit(cfg)     # cfg.audit.logs, cfg.audit.output, cfg.audit.model_uri

Stages (Ray Data; only small counts reach the driver):

1. **read** every log file under ``audit.logs`` (folder, file or ``s3://``; JSONL, JSONL.gz, Parquet):
   each record becomes its user turns with their outcome signals, or one quarantine row naming the
   problem (:mod:`clarifier.data.audit_stages`); quarantined lines go to ``<output>/quarantine/``.
   The files are read twice: once for the counts and the quarantine, once streaming into the scorer
   pool (nothing holds all the turns; reading costs a tiny fraction of scoring);
2. **reformulation** (``audit.signals.reformulation``): MiniLM similarity of each user turn and the
   next, computed by the scorer actors (they hold the encoder beside the clarifier);
3. **score**: P(clarify) of every user turn, the engine's one-forward-pass decision
   (``ClarifierEngine.score``) in a pool of ``audit.actors`` scorer actors; ``flagged`` = at the
   model's threshold; ``failed`` = any failure signal. Written to ``<output>/turns/`` (Parquet: ids,
   score, decision, signals, segments and the turn itself, for reading and re-scoring);
4. **aggregate**: per (dimension, value, conversation bucket, failed) counts, in one pass over the
   written turns (:func:`partial_counts`, a Ray groupby);
5. in the driver: the flagged share of all turns and of failed turns, each with a bootstrap interval
   over conversation buckets and **corrected for the model's error rates** (Rogan-Gladen,
   :mod:`clarifier.core.prevalence`), the verdict against ``audit.rule_share``, breakdowns by segment,
   turn position and failure signal, a score histogram; questions generated for a seeded sample of
   flagged turns; the report (:mod:`clarifier.evaluation.audit_report`), logged to MLflow when a
   tracking URI is set.

The model's error rates (``audit.error_rates``) come from the logs' own labelled turns when there are
enough of them (the only in-domain measurement), else from an evaluation report, else from the
counts its calibration stored with the model (its dev split).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa

from clarifier.core.config import ClarifierConfig
from clarifier.core.prevalence import ErrorRates, share_estimate, verdict
from clarifier.data.pipeline import SUFFIXES  # the data job's input formats, read the same way
from clarifier.data.audit_stages import (FILE_COUNTS, QUARANTINE_COLUMNS, first_record_is_request_log, read_log_turns,
                                         segment_column)
from clarifier.data.signals import SIGNALS
from clarifier.runtime import storage

TURNS_DIR, QUARANTINE_DIR, REPORT = "turns", "quarantine", "report.json"
SCORES = "scores.json"  # what the turns in TURNS_DIR were scored from (audit.reuse_scores checks it)
HIST_BINS = 20
POSITIONS = 5  # user positions 1..4 and "5+"
TURN_COLUMNS = ["id", "conversation_id", "turn_index", "user_position", "bucket", "sample_key", "score", "flagged",
                "failed", "answered", "n_passages", *SIGNALS, "feedback_unknown", "reformulation_sim", "gold",
                "source", "line", "turn_json"]


class AuditError(RuntimeError):
    """The audit failed part-way (storage, a worker); the message names the logs and the output."""


# ---- stages run in Ray workers ---------------------------------------------------------------


class TurnScorer:
    """Ray Data UDF (actor pool): ``score`` = P(clarify) of each row's ``turn_json``, ``flagged`` at the
    model's threshold, the reformulation signal (with ``reformulation``: the MiniLM encoder held by the
    same actor) and ``failed`` from the signal columns. One pool holds both models, so the cheap stages
    after it never wait for a CPU."""

    def __init__(self, spec: dict, batch_size: int = 8, cpus: float = 1, reformulation: dict | None = None,
                 counter=None):
        from clarifier.data.signals import ReformulationScorer
        from clarifier.engine.ray_pool import engine_from_spec

        self.engine = engine_from_spec(spec, cpus)
        self.batch_size = batch_size
        self.reformulation = ReformulationScorer(**reformulation) if reformulation else None
        self.counter = counter  # clarifier.runtime.progress.RowCounter: the driver's progress lines

    def __call__(self, batch: pa.Table) -> pa.Table:
        from clarifier.core.schema import Example

        examples = [Example.model_validate_json(s) for s in batch.column("turn_json").to_pylist()]
        scores = self.engine.score_examples(examples, self.batch_size)  # the block's turns batched by length
        thr = self.engine.threshold
        batch = batch.append_column("score", pa.array(scores, pa.float64()))
        batch = batch.append_column("flagged", pa.array([s >= thr for s in scores], pa.bool_()))
        if self.reformulation is not None:
            batch = self.reformulation(batch)
        else:
            batch = batch.append_column("reformulation_sim", pa.array([None] * batch.num_rows, pa.float32()))
            batch = batch.append_column("reformulation", pa.array([None] * batch.num_rows, pa.bool_()))
        if self.counter is not None:
            self.counter.add.remote(batch.num_rows)
        return mark_failed(batch)


def mark_failed(batch: pa.Table) -> pa.Table:
    """``failed`` = any failure signal (feedback negative, no answer, escalation, reformulation)."""
    cols = {s: batch.column(s).to_pylist() for s in SIGNALS}
    failed = [any(bool(cols[s][i]) for s in SIGNALS) for i in range(batch.num_rows)]
    return batch.append_column("failed", pa.array(failed, pa.bool_()))


def _position(p: int) -> str:
    return str(p) if p < POSITIONS else f"{POSITIONS}+"


def labelled_rows(batch: pa.Table) -> pa.Table:
    """The labelled turns of a batch (a few per cent of the logs): ``score``, ``gold``, ``bucket`` and the
    ``turn_json`` the surface control reads."""
    t = batch.select(["score", "gold", "bucket", "turn_json"])
    return t.filter(pa.compute.is_valid(t.column("gold")))


def partial_counts(batch: pa.Table, *, segments: list[str], threshold: float | None = None) -> pa.Table:
    """Counts of one batch of scored turns: rows ``(dim, value, bucket, failed, n, flagged)``.

    Dimensions: ``all``; ``position`` (user turn 1..4, 5+); ``answered``; ``passages`` (with/without);
    ``segment:<field>``; ``signal`` (the turns each failure signal fired on); ``feedback`` (``seen`` /
    ``unknown``); ``gold`` (labelled turns: true/false); ``hist`` (score bins of width 1/20, bucket 0).
    ``flagged`` is the model's decision, or ``score >= threshold`` when one is given (audit.threshold).
    """
    d = batch.to_pydict()
    if threshold is not None:
        d["flagged"] = [float(x) >= threshold for x in d["score"]]
    acc: dict[tuple, list[int]] = {}

    def add(dim, value, bucket, failed, flagged):
        a = acc.setdefault((dim, value, bucket, failed), [0, 0])
        a[0] += 1
        a[1] += int(flagged)

    for i in range(batch.num_rows):
        b, f, k = int(d["bucket"][i]), bool(d["failed"][i]), bool(d["flagged"][i])
        add("all", "", b, f, k)
        add("position", _position(int(d["user_position"][i])), b, f, k)
        add("answered", "yes" if d["answered"][i] else "no", b, f, k)
        add("passages", "with" if d["n_passages"][i] else "without", b, f, k)
        for s in segments:
            add(f"segment:{s}", d[segment_column(s)][i], b, f, k)
        for s in SIGNALS:
            if d[s][i]:
                add("signal", s, b, f, k)
        if d["feedback"][i] is not None:
            add("feedback", "seen", b, f, k)
        if d["feedback_unknown"][i]:
            add("feedback", "unknown", b, f, k)
        if d["gold"][i] is not None:
            add("gold", "true" if d["gold"][i] else "false", b, f, k)
        add("hist", f"{min(int(float(d['score'][i]) * HIST_BINS), HIST_BINS - 1):02d}", 0, f, k)
    keys = list(acc)
    return pa.table({"dim": [k[0] for k in keys], "value": [k[1] for k in keys], "bucket": [k[2] for k in keys],
                     "failed": [k[3] for k in keys], "n": [acc[k][0] for k in keys], "flagged": [acc[k][1] for k in keys]},
                    schema=pa.schema([("dim", pa.string()), ("value", pa.string()), ("bucket", pa.int64()),
                                      ("failed", pa.bool_()), ("n", pa.int64()), ("flagged", pa.int64())]))


def smallest_keys(batch: pa.Table, *, k: int) -> pa.Table:
    """The ``k`` rows of a batch with the smallest ``sample_key`` (a seeded sample that merges exactly)."""
    if batch.num_rows <= k:
        return batch
    order = pa.compute.sort_indices(batch, sort_keys=[("sample_key", "ascending")])
    return batch.take(order[:k])


# ---- the driver ------------------------------------------------------------------------------


def default_model_uri(cfg: ClarifierConfig) -> str:
    """``audit.model_uri``; else the registry's ``name@alias`` when a tracking URI is set; else the
    quickstart's model folder; else an error saying what to pass."""
    import os

    if cfg.audit.model_uri:
        return cfg.audit.model_uri
    if cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return f"models:/{cfg.registry.model_name}@{cfg.registry.alias}"
    quick = Path(".clarifier/quickstart/model")
    if (quick / "clarifier.json").is_file():
        return str(quick.resolve())
    raise ValueError("no model to audit with: pass --model (a model folder, models:/name@alias with a tracking URI, "
                     "runs:/..., s3://...), or run `clarifier quickstart` first (its model is the default)")


def labelled_skill(rows: list[dict], min_labelled: int, notes: list[str], progress) -> dict | None:
    """On the logs' own labelled turns (``rows`` of :func:`labelled_rows`): the model's AUROC against the surface
    control's (position and length only, cross-fitted on those turns by conversation), with the paired bootstrap interval of the margin
    (:func:`clarifier.core.surface.skill_over_control`), and where their passages carry the retriever's scores what
    those add to the model (``retriever_scores``); None with fewer than ``min_labelled`` of each class."""
    from clarifier.core.retrieval import retriever_score_check
    from clarifier.core.schema import Example
    from clarifier.core.surface import cross_fitted_scores, skill_over_control

    gold = [bool(r["gold"]) for r in rows]
    if min(sum(gold), len(gold) - sum(gold)) < min_labelled:
        return None
    examples = [Example.model_validate_json(r["turn_json"]) for r in rows]
    groups = [e.conversation_id for e in examples]
    scores = [float(r["score"]) for r in rows]
    control = cross_fitted_scores(examples, gold, groups=groups)
    skill = skill_over_control(gold, scores, control, model="the model")
    skill["n"], skill["clarify"] = len(gold), sum(gold)
    skill["retriever_scores"] = retriever_score_check(examples, gold, scores, groups=groups)
    progress(f"[audit] on the {len(gold)} labelled turns: {skill['verdict']}")
    if skill["retriever_scores"]:
        progress(f"[audit] on the {len(gold)} labelled turns: {skill['retriever_scores']['verdict']}")
    if not skill["beats_control"]:
        notes.append(f"on the logs' {len(gold)} labelled turns the model does not rank better than position and "
                     "length alone (the surface control): its flags may follow where turns sit and how long they are")
    return skill


def _estimation_threshold(cfg: ClarifierConfig, meta, rows: list[dict], notes: list[str],
                          progress) -> tuple[dict, ErrorRates | None]:
    """The threshold the shares are estimated at (``audit.threshold``) and, when it was chosen on the
    labelled turns, the error rates measured on the other half of them: ``({"value": None | float,
    "mode", ...}, rates or None)``; value None = the model's own decisions."""
    import numpy as np

    from clarifier.core.prevalence import confusion_at, youden_threshold

    a = cfg.audit
    model = {"value": None, "mode": "model", "threshold": meta.threshold}
    if a.threshold == "model":
        return model, None
    if a.error_rates not in ("auto", "labels"):
        if a.threshold != "auto":
            raise ValueError(f"audit.threshold={a.threshold} needs error rates from labelled turns "
                             f"(audit.error_rates=auto or labels), not {a.error_rates!r}: those were measured at the "
                             "model's threshold")
        return model, None
    score = np.array([r["score"] for r in rows], dtype=float)
    gold = np.array([bool(r["gold"]) for r in rows])
    half_a = np.array([int(r["bucket"]) % 2 == 0 for r in rows], dtype=bool)
    if not isinstance(a.threshold, str):  # a number: error rates from all the labelled turns at it
        thr = float(a.threshold)
        rates = confusion_at(score, gold, thr, f"{len(rows)} labelled turns in these logs at threshold {thr:.3f}")
        if min(rates.tp + rates.fn, rates.tn + rates.fp) < a.min_labelled:
            raise ValueError(f"audit.threshold={thr} needs audit.min_labelled={a.min_labelled} labelled turns of each "
                             f"class; the logs have {rates.tp + rates.fn} needing clarification and {rates.tn + rates.fp} clear")
        return {"value": thr, "mode": "fixed", "threshold": thr}, rates
    enough = all(int(np.sum(h & (gold == c))) >= a.min_labelled for h in (half_a, ~half_a) for c in (True, False))
    if not enough:
        if a.threshold == "youden":
            notes.append(f"audit.threshold=youden needs {a.min_labelled} labelled turns of each class in each half "
                         f"of the conversations; the logs have {int(gold.sum())} needing clarification and "
                         f"{int((~gold).sum())} clear in all: estimated at the model's threshold")
        return model, None
    thr, j = youden_threshold(score[half_a], gold[half_a])
    rates = confusion_at(score[~half_a], gold[~half_a], thr,
                         f"{int((~half_a).sum())} labelled turns in these logs (in-domain; the threshold was chosen "
                         f"on the other {int(half_a.sum())})")
    progress(f"[audit] estimation threshold {thr:.3f} (Youden's J {j:.2f} on {int(half_a.sum())} labelled turns; the "
             f"model serves at {meta.threshold:.3f}); error rates from the other {int((~half_a).sum())}: recall "
             f"{rates.sensitivity:.2f}, false-positive rate {1 - rates.specificity:.2f}")
    return {"value": thr, "mode": "youden", "threshold": thr, "youden_j": j, "chosen_on": int(half_a.sum()),
            "rates_from": int((~half_a).sum())}, rates


def _error_rates(cfg: ClarifierConfig, meta, gold: dict[str, tuple[int, int]], notes: list[str]) -> ErrorRates | None:
    """The model's confusion counts for the correction (see ``audit.error_rates``)."""
    a = cfg.audit
    pos_n, pos_k = gold.get("true", (0, 0))
    neg_n, neg_k = gold.get("false", (0, 0))
    labels = ErrorRates(tp=pos_k, fn=pos_n - pos_k, tn=neg_n - neg_k, fp=neg_k,
                        source=f"{pos_n + neg_n} labelled turns in these logs (in-domain)")
    enough = pos_n >= a.min_labelled and neg_n >= a.min_labelled

    def from_report() -> ErrorRates | None:
        if not a.eval_report:
            return None
        try:
            rep = json.loads(storage.read_text(a.eval_report))
            dm = rep["models"]["model"]["metrics"]["decision"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"audit.eval_report {a.eval_report!r} is not a `clarifier eval` report.json "
                             f"({type(exc).__name__}: {exc})") from None
        thr = rep.get("threshold")
        if thr is not None and abs(float(thr) - float(meta.threshold)) > 1e-6:
            notes.append(f"the evaluation report was made at threshold {float(thr):.3f}, the model now has "
                         f"{meta.threshold:.3f}: its error rates may not apply")
        return ErrorRates(tp=dm["tp"], fn=dm["fn"], tn=dm["tn"], fp=dm["fp"],
                          source=f"evaluation report {a.eval_report} ({rep.get('data_name') or rep.get('data')}, n={dm['n']})")

    def from_calibration() -> ErrorRates | None:
        c = getattr(meta, "calibration", None)
        if not c:
            return None
        return ErrorRates(tp=c["tp"], fn=c["fn"], tn=c["tn"], fp=c["fp"],
                          source=f"the model's calibration split ({c.get('split', 'dev')}, n={c['n']})")

    choice = a.error_rates
    if choice == "none":
        notes.append("audit.error_rates=none: the shares are the model's raw flags, not corrected")
        return None
    if choice == "labels" or (choice == "auto" and enough):
        if not enough:
            notes.append(f"audit.error_rates=labels but the logs have {pos_n} labelled turns needing clarification "
                         f"and {neg_n} clear ones (< audit.min_labelled={a.min_labelled} each): not corrected")
            return None
        rates = labels
    elif choice == "report" or (choice == "auto" and a.eval_report):
        rates = from_report()
        if rates is None:
            raise ValueError("audit.error_rates=report needs audit.eval_report (a `clarifier eval` report.json)")
    else:
        rates = from_calibration()
        if rates is None:
            notes.append("the model has no stored calibration counts and no evaluation report or labelled turns were "
                         "given: not corrected (set audit.eval_report, or label some turns of these logs)")
            return None
    if choice == "auto" and not enough and pos_n + neg_n:
        notes.append(f"{pos_n + neg_n} labelled turns in the logs are fewer than audit.min_labelled={a.min_labelled} "
                     "per class; the error rates come from " + rates.source)
    if not rates.usable:
        notes.append(f"the model's error rates ({rates.source}: recall {rates.sensitivity}, false-positive rate "
                     f"{None if rates.specificity is None else 1 - rates.specificity}) are no better than chance: "
                     "the flagged share cannot be corrected")
    if "in-domain" not in rates.source:
        notes.append("the error rates were measured on other data than these logs; on logs unlike that data they may "
                     "differ (label ~100 turns of each class in these logs for an in-domain correction)")
    return rates


def _scored_from(files: list[str], model_uri: str, resolved, cfg: ClarifierConfig) -> dict:
    """What the scored turns depend on: the log files (and their sizes), the model (its clarifier.json),
    the segment fields, the signals' settings, the buckets. ``audit.reuse_scores`` needs all equal."""
    import hashlib

    meta_json = Path(resolved.folder, "clarifier.json").read_bytes()
    a = cfg.audit
    return {"logs": a.logs, "files": storage.sizes(files), "model_uri": model_uri, "model_version": resolved.version,
            "model_meta_sha256": hashlib.sha256(meta_json).hexdigest(), "segments": list(a.segments),
            "signals": a.signals.model_dump(mode="json"), "buckets": a.buckets, "max_turn_chars": a.max_turn_chars}


def _check_reusable(output: str, now: dict) -> None:
    uri = storage.join(output, SCORES)
    if not storage.exists(uri) or not storage.exists(storage.join(output, TURNS_DIR)):
        raise ValueError(f"audit.reuse_scores: no scored turns to reuse in {output} ({SCORES} or {TURNS_DIR}/ missing): "
                         "run the audit once without --reuse-scores")
    try:
        before = json.loads(storage.read_text(uri))
    except ValueError as exc:
        raise ValueError(f"audit.reuse_scores: {uri} is not readable JSON ({exc})") from None
    changed = [k for k in now if before.get(k) != now[k]]
    if changed:
        detail = "; ".join(f"{k}: {_short(before.get(k))} then, {_short(now[k])} now" for k in changed)
        raise ValueError(f"audit.reuse_scores: the turns in {output} were scored from other inputs ({detail}): "
                         "run without --reuse-scores to score again")


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def _estimates(groups: dict, rates, cfg) -> dict:
    a = cfg.audit

    def est(by_bucket, which):
        k = [v[which][1] for v in by_bucket.values()]
        n = [v[which][0] for v in by_bucket.values()]
        return share_estimate(k, n, rates, bootstrap=a.bootstrap, confidence=a.confidence, seed=a.seed)

    return {key: {"turns": est(b, "all"), "failed": est(b, "failed")} for key, b in groups.items()}


def _group(rows: list[dict], max_values: int) -> dict:
    """``{(dim, value): {bucket: {"all": [n, k], "failed": [n, k]}}}``, rare segment values as 'other'."""
    totals: dict[tuple, int] = {}
    for r in rows:
        totals[(r["dim"], r["value"])] = totals.get((r["dim"], r["value"]), 0) + r["n"]
    keep: set[tuple] = set()
    for dim in {d for d, _ in totals}:
        vals = sorted(((n, v) for (d, v), n in totals.items() if d == dim), reverse=True)
        limit = max_values if dim.startswith("segment:") else len(vals)
        keep |= {(dim, v) for _, v in vals[:limit]}
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["dim"], r["value"]) if (r["dim"], r["value"]) in keep else (r["dim"], "other")
        cell = out.setdefault(key, {}).setdefault(r["bucket"], {"all": [0, 0], "failed": [0, 0]})
        cell["all"][0] += r["n"]
        cell["all"][1] += r["flagged"]
        if r["failed"]:
            cell["failed"][0] += r["n"]
            cell["failed"][1] += r["flagged"]
    return out


def run_audit(cfg: ClarifierConfig, progress: Callable[[str], None] = print) -> dict:
    """Run the audit for ``cfg.audit`` and return its summary (also ``<output>/report.json``)."""
    a = cfg.audit
    if not a.logs:
        raise ValueError("audit.logs is empty: pass --logs (a folder, file or s3:// prefix of chat logs)")
    if not a.output:
        raise ValueError("audit.output is empty: pass --out (a folder or s3:// prefix for the report)")
    if not a.formats:
        raise ValueError("audit.formats is empty: list at least one of jsonl, jsonl.gz, parquet")
    try:
        with _small_blocks():
            return _run(cfg, progress)
    except (ValueError, FileNotFoundError, AuditError):
        raise
    except Exception as exc:
        if type(exc).__name__ == "ModelResolutionError":
            raise
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        raise AuditError(f"audit failed ({type(exc).__name__}: {(lines[-1] if lines else '')[:500]}); logs "
                         f"{a.logs!r}, output {a.output!r}: rerun once the cause is fixed") from exc


# Ray Data keeps a task's output as one block up to 128 MiB; one log file would then be one block,
# scored by one actor while the others idle. Blocks of this size (a few scorer calls of turns with
# their history and passages) spread a file over the pool, and each actor takes at most
# SCORE_IN_FLIGHT of them at a time, so the first actor up does not queue every block for itself.
SCORE_BLOCK_BYTES = 128 * 1024
SCORE_IN_FLIGHT = 2
ROWS_PER_FILE = 20_000  # the small blocks are written as fewer, larger Parquet files


@contextlib.contextmanager
def _small_blocks():
    import ray.data

    ctx = ray.data.DataContext.get_current()
    old = ctx.target_max_block_size
    ctx.target_max_block_size = SCORE_BLOCK_BYTES
    try:
        yield
    finally:
        ctx.target_max_block_size = old


def _run(cfg: ClarifierConfig, progress) -> dict:
    from ray.data.expressions import col

    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import resolve_model
    from clarifier.engine.precision import describe
    from clarifier.runtime.cluster import init_ray, pool_size
    from clarifier.runtime.mlflow_uri import tracking_uri as resolve_tracking_uri
    from clarifier.runtime.progress import counted

    a = cfg.audit
    t0 = time.time()
    started = _dt.datetime.now(_dt.timezone.utc)
    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    model_uri = a.model_uri or default_model_uri(cfg)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    resolved = resolve_model(model_uri, cache_dir=cfg.model.cache_dir, tracking_uri=tracking_uri)
    meta = read_meta(resolved.folder)
    if Path(model_uri).is_dir():
        model_uri = str(Path(model_uri).resolve())  # actors may run in another working directory
    files = storage.list_files(a.logs, tuple(SUFFIXES[f] for f in a.formats))
    if not files:
        raise FileNotFoundError(f"no {'/'.join(SUFFIXES[f] for f in a.formats)} files under {a.logs}")
    progress(f"[audit] {len(files)} log file(s) under {a.logs}; model {model_uri} (version {resolved.version or '-'}, "
             f"threshold {meta.threshold:.3f})")
    scored_from = _scored_from(files, model_uri, resolved, cfg)
    if a.reuse_scores:
        _check_reusable(a.output, scored_from)
        progress(f"[audit] reusing the scored turns in {storage.join(a.output, TURNS_DIR)} (audit.reuse_scores)")
    else:
        storage.delete_file(storage.join(a.output, SCORES))
        storage.delete_dir(storage.join(a.output, TURNS_DIR))
    storage.delete_dir(storage.join(a.output, QUARANTINE_DIR))

    ray = init_ray()
    fs, _ = storage.filesystem(a.logs)
    scheme = "s3://" if storage.is_s3(a.logs) else ""
    paths = [storage.filesystem(f)[1] for f in files]

    request_log = first_record_is_request_log(fs, paths)
    if request_log:
        progress("[audit] the logs are a serving request log: each conversation put back together from its requests, "
                 "each turn counted once")

    def read(**remote):
        return read_log_turns(ray, paths, filesystem=fs, scheme=scheme, audit=a.model_dump(),
                              labelling=cfg.data.labelling.model_dump(),
                              min_overlap=cfg.data.request_log.min_reformulation_overlap, request_log=request_log,
                              **remote)

    # Pass 1, without the model: the counts and the quarantine (only those rows are kept: small).
    # Pass 2 reads the logs again and streams the turns through the scorer pool into Parquet, so no
    # stage holds all the turns (reading is a tiny fraction of scoring).
    parsed = read().filter(expr=col("kind") != "turn").materialize()
    per_file = parsed.filter(expr=col("kind") == "file").select_columns(FILE_COUNTS).take_all()
    counts = {k: sum(int(r[k] or 0) for r in per_file) for k in FILE_COUNTS}
    if counts["n_lines"] != counts["n_lines_with_turns"] + counts["n_quarantined"]:
        raise AuditError(f"count mismatch: {counts['n_lines']} rows read but {counts['n_lines_with_turns']} gave turns "
                         f"and {counts['n_quarantined']} were quarantined")
    progress(f"[audit] read {counts['n_lines']} {'request-log records' if request_log else 'conversations'}: "
             f"{counts['n_turns']} user turns, "
             f"{counts['n_quarantined']} quarantined" + (f" (-> {storage.join(a.output, QUARANTINE_DIR)})"
                                                         if counts["n_quarantined"] else ""))
    quarantine_reasons: dict[str, int] = {}
    if counts["n_quarantined"]:
        q = parsed.filter(expr=col("kind") == "quarantine").select_columns(QUARANTINE_COLUMNS)
        uri = storage.join(a.output, QUARANTINE_DIR)
        qfs, qpath = storage.filesystem(uri)
        q.write_parquet(qpath, filesystem=qfs, min_rows_per_file=ROWS_PER_FILE)
        kinds = q.select_columns(["reason"]).map_batches(_reason_kind, batch_format="pyarrow")
        quarantine_reasons = {r["kind"]: int(r["count()"]) for r in kinds.groupby("kind").count().take_all()}
    if not counts["n_turns"]:
        raise ValueError(f"no user turns in {a.logs}: {counts['n_quarantined']} of {counts['n_lines']} records were "
                         f"quarantined (see {storage.join(a.output, QUARANTINE_DIR)})")

    # The stages around the scorer pool take no CPU of their own: with every CPU held by scorer actors
    # (audit.actors x audit.cpus_per_actor = the cluster's CPUs) they still run.
    turns = read(num_cpus=0, concurrency=max(1, min(4, len(paths)))).filter(expr=col("kind") == "turn", num_cpus=0)
    rf = a.signals.reformulation
    reform = {"encoder": rf.encoder, "min_similarity": rf.min_similarity, "cpus": a.cpus_per_actor} if rf.enabled else None
    if rf.enabled:
        progress(f"[audit] reformulation signal: {rf.encoder or 'all-MiniLM-L6-v2'} similarity >= {rf.min_similarity}")
    from clarifier.engine.ray_pool import model_fields

    spec = {**model_fields(model_uri), "tracking_uri": tracking_uri, "cache_dir": cfg.model.cache_dir,
            "max_new_tokens": cfg.eval.max_new_tokens, "precision": cfg.model.precision,
            **({"device": "cuda"} if a.gpus_per_actor else {})}
    precision = describe(cfg.model.precision, "cuda" if a.gpus_per_actor else "cpu")
    turns_uri = storage.join(a.output, TURNS_DIR)
    tfs, tpath = storage.filesystem(turns_uri)
    seg_cols = [segment_column(s) for s in a.segments]
    actors = None  # the scorer actors this run started (None: the scores were reused)
    if a.reuse_scores:
        t_scored = 0.0
    else:
        actors = pool_size(ray, a.actors, cpus_per_actor=a.cpus_per_actor, gpus_per_actor=a.gpus_per_actor,
                           rows=counts["n_turns"], rows_per_block=a.batch_size * 4)
        progress(f"[audit] scoring {counts['n_turns']} turns with {actors} actor(s)"
                 f"{' (audit.actors=auto)' if a.actors == 'auto' else ''}, {precision}")
        with counted(ray, "[audit]", counts["n_turns"], progress) as counter:
            scored = turns.map_batches(
                TurnScorer, batch_size=a.batch_size * 4, batch_format="pyarrow",
                fn_constructor_kwargs={"spec": spec, "batch_size": a.batch_size, "cpus": a.cpus_per_actor,
                                       "reformulation": reform, "counter": counter},
                compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=SCORE_IN_FLIGHT),
                num_cpus=a.cpus_per_actor,
                num_gpus=a.gpus_per_actor or None,
            )
            scored.select_columns(TURN_COLUMNS + seg_cols, num_cpus=0).write_parquet(
                tpath, filesystem=tfs, min_rows_per_file=ROWS_PER_FILE, ray_remote_args={"num_cpus": 0})
        t_scored = time.time() - t0
        storage.write_text(storage.join(a.output, SCORES), json.dumps(scored_from, indent=1))
        progress(f"[audit] scored turns -> {turns_uri} ({t_scored:.0f}s)")

    written = ray.data.read_parquet(tpath, filesystem=tfs)
    # A request log's records are requests (each with its conversation so far): count the conversations themselves.
    conversations = (written.select_columns(["conversation_id"]).groupby("conversation_id").count().count()
                     if request_log else counts["n_lines_with_turns"])
    notes: list[str] = []
    if a.reuse_scores:
        notes.append(f"the scores were reused from an earlier run of this audit ({storage.join(a.output, SCORES)}); "
                     "the turns were not scored again")
    labelled = written.map_batches(labelled_rows, batch_format="pyarrow", num_cpus=0).take_all()  # read once
    est_threshold, chosen_rates = _estimation_threshold(cfg, meta, labelled, notes, progress)
    skill = labelled_skill(labelled, a.min_labelled, notes, progress)
    agg_cols = ["bucket", "failed", "flagged", "user_position", "answered", "n_passages", *SIGNALS, "feedback_unknown",
                "gold", "score", *seg_cols]
    rows = (written.select_columns(agg_cols)
            .map_batches(partial_counts, batch_format="pyarrow",
                         fn_kwargs={"segments": list(a.segments), "threshold": est_threshold["value"]})
            .groupby(["dim", "value", "bucket", "failed"]).sum(["n", "flagged"]).take_all())
    rows = [{"dim": r["dim"], "value": r["value"], "bucket": int(r["bucket"]), "failed": bool(r["failed"]),
             "n": int(r["sum(n)"]), "flagged": int(r["sum(flagged)"])} for r in rows]
    hist = _histogram([r for r in rows if r["dim"] == "hist"])
    groups = _group([r for r in rows if r["dim"] != "hist"], a.max_segment_values)
    gold = {v: (sum(c["all"][0] for c in b.values()), sum(c["all"][1] for c in b.values()))
            for (d, v), b in groups.items() if d == "gold"}
    rates = chosen_rates or _error_rates(cfg, meta, gold, notes)
    ests = _estimates(groups, rates, cfg)
    head = ests[("all", "")]
    if head["turns"]["n"] != counts["n_turns"]:  # every read turn was scored and counted, or the job says so
        raise AuditError(f"count mismatch: {counts['n_turns']} user turns read but {head['turns']['n']} scored "
                         f"(see {turns_uri})")
    answer = verdict(head["failed"], a.rule_share, rates=rates, min_j=a.min_youden_j,
                     require_correction=a.error_rates != "none")
    signals_seen = {s: ests.get(("signal", s), {}).get("turns", {}).get("n", 0) for s in SIGNALS}
    signals_seen["feedback_values"] = ests.get(("feedback", "seen"), {}).get("turns", {}).get("n", 0)
    signals_seen["feedback_not_understood"] = ests.get(("feedback", "unknown"), {}).get("turns", {}).get("n", 0)
    if not head["failed"]["n"]:
        notes.append("no turn in these logs carries a failure signal (feedback, no-answer replies, escalation, "
                     "reformulation): only the flagged share of all turns is reported")

    sample = _sample_questions(ray, written, spec, meta.prompt_options(), a, progress) if a.sample_questions else []
    summary = {
        "started": started.isoformat(timespec="seconds"), "seconds": round(time.time() - t0, 1),
        "seconds_read_and_score": round(t_scored, 1), "reused_scores": a.reuse_scores, "logs": a.logs, "output": a.output,
        "model_uri": model_uri, "model_version": resolved.version, "base_model": meta.base_model,
        "threshold": meta.threshold, "estimation_threshold": est_threshold, "precision": precision, "actors": actors,
        "counts": {"files": len(files), "records": counts["n_lines"], "request_log": bool(request_log),
                   "conversations": int(conversations),
                   "blank_lines": counts["n_blank"],
                   "quarantined": counts["n_quarantined"], "quarantine_reasons": quarantine_reasons,
                   "turns": counts["n_turns"], "failed_turns": head["failed"]["n"]},
        "signals_present": signals_seen,
        "error_rates": rates.as_dict() if rates else None,
        "skill_on_labelled_turns": skill,
        "rule_share": a.rule_share, "verdict": answer,
        "flagged_share": head["turns"], "failed_needing_clarification": head["failed"],
        "breakdowns": _breakdowns(ests, a.segments),
        "histogram": hist, "sample": sample, "notes": notes,
        "config": a.model_dump(mode="json"),
    }
    from clarifier.evaluation.audit_report import format_summary, write_audit_report

    summary["paths"] = _write_report(summary, a.output, write_audit_report)
    _log_to_mlflow(cfg, summary, progress)
    progress(format_summary(summary))
    return summary


def _reason_kind(batch: pa.Table) -> pa.Table:
    """A quarantine reason's kind: its text before the first colon ("bad JSON", "messages[3].role")."""
    return pa.table({"kind": [r.split(":")[0][:80] for r in batch.column("reason").to_pylist()]})


def _histogram(rows: list[dict]) -> dict:
    bins = [{"lo": i / HIST_BINS, "hi": (i + 1) / HIST_BINS, "failed": 0, "ok": 0} for i in range(HIST_BINS)]
    for r in rows:
        bins[int(r["value"])]["failed" if r["failed"] else "ok"] += r["n"]
    return {"bins": bins}


def _breakdowns(ests: dict, segments: list[str]) -> dict:
    def rows(dim):
        out = [{"value": v, "turns": e["turns"], "failed": e["failed"]} for (d, v), e in ests.items() if d == dim]
        return sorted(out, key=lambda r: (-r["turns"]["n"], r["value"]))

    out = {f"segment:{s}": rows(f"segment:{s}") for s in segments}
    out["position"] = sorted(rows("position"), key=lambda r: r["value"])
    out["signal"] = rows("signal")
    out["answered"] = rows("answered")
    out["passages"] = rows("passages")
    return out


def _sample_questions(ray, written, spec: dict, opts, a, progress) -> list[dict]:
    """Questions for a seeded sample of flagged turns (the smallest sample keys), generated by the model."""
    from ray.data.expressions import col

    from clarifier.core.schema import Example
    from clarifier.engine.ray_pool import ray_predict

    k = a.sample_questions
    cand = (written.filter(expr=col("flagged"))
            .select_columns(["sample_key", "id", "score", "failed", "turn_json"])
            .map_batches(smallest_keys, batch_format="pyarrow", fn_kwargs={"k": k}).take_all())
    cand = sorted(cand, key=lambda r: r["sample_key"])[:k]
    if not cand:
        return []
    examples = [Example.model_validate_json(r["turn_json"]) for r in cand]
    progress(f"[audit] generating questions for {len(examples)} flagged turns (a seeded sample)")
    preds = ray_predict(examples, spec, opts=opts, mode="predict", batch_size=a.batch_size, actors=1,
                        cpus_per_actor=a.cpus_per_actor, gpus_per_actor=a.gpus_per_actor)
    return [{"id": r["id"], "score": round(float(r["score"]), 4), "failed": bool(r["failed"]),
             "history": [t.model_dump() for t in e.history[-4:]], "query": e.query,
             "passages": [p.id for p in e.passages], "question": p.question, "valid": p.valid,
             "grounding_turns": list(p.grounding_turns)}
            for r, e, p in zip(cand, examples, preds)]


def _write_report(summary: dict, output: str, writer) -> dict:
    if storage.is_s3(output):
        with tempfile.TemporaryDirectory(prefix="clarifier-audit-") as tmp:
            paths = writer(summary, Path(tmp))
            storage.upload_dir(tmp, output)
            return {k: storage.join(output, Path(v).name) for k, v in paths.items()}
    return {k: str(v) for k, v in writer(summary, Path(output)).items()}


def _log_to_mlflow(cfg: ClarifierConfig, summary: dict, progress) -> None:
    """Logs the audit as an MLflow run (experiment ``<train.experiment>-audit``) when a tracking URI is set."""
    import os

    uri = cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    import mlflow

    from clarifier.runtime.mlflow_uri import absolute_tracking_uri

    mlflow.set_tracking_uri(absolute_tracking_uri(uri))
    mlflow.set_experiment(f"{cfg.train.experiment}-audit")
    f, t = summary["failed_needing_clarification"], summary["flagged_share"]
    metrics = {"audit/turns": summary["counts"]["turns"], "audit/failed_turns": f["n"],
               "audit/quarantined": summary["counts"]["quarantined"]}
    for name, est in (("flagged_share", t), ("failed_needing_clarification", f)):
        for key in ("raw", "corrected"):
            if est.get(key) is not None:
                metrics[f"audit/{name}/{key}"] = est[key]
                ci = est.get(f"{key}_ci")
                if ci:
                    metrics[f"audit/{name}/{key}_lo"], metrics[f"audit/{name}/{key}_hi"] = ci
    with mlflow.start_run(run_name=f"audit-{summary['started'][:10]}") as run:
        mlflow.log_params({"logs": summary["logs"], "model_uri": summary["model_uri"], "rule_share": summary["rule_share"],
                           "error_rates": (summary["error_rates"] or {}).get("source", "none")[:500]})
        mlflow.set_tags({"clarifier.stage": "audit", "audit.verdict": summary["verdict"]["decision"],
                         "audit.model_version": str(summary["model_version"] or "")})
        mlflow.log_metrics(metrics)
        for p in summary["paths"].values():
            if not storage.is_s3(p) and Path(p).is_file():
                mlflow.log_artifact(p, artifact_path="audit")
        summary["mlflow_run_id"] = run.info.run_id
    progress(f"[audit] logged to MLflow run {summary['mlflow_run_id']} (experiment {cfg.train.experiment}-audit)")
