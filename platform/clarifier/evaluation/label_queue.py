"""``clarifier label select``: a labelling queue chosen from a team's own logs. A Ray Data job like the audit.

    summary = select_queue(cfg, logs="s3://bucket/chat-logs/", out="s3://bucket/label-queue/", n=100)

1. **read** every log file as the audit reads them (:mod:`clarifier.data.audit_stages`: OpenAI transcripts,
   conversation logs, examples; JSONL, JSONL.gz, Parquet; ``audit.formats``); records that cannot be read go to
   ``<out>/quarantine/`` and are counted. Logs whose first record is a **serving request log** record
   (``serve.request_log``) are read as one: each conversation put back together from its requests (each turn
   once), and a turn that what happened next labels (:mod:`clarifier.data.served_logs`: Clarifier asked and the
   user answered, the user restated the request, ...) carries that label as ``meta.prelabel`` -- a pre-label the
   labelling page shows for a person to confirm (Label Studio export: its pre-annotation);
2. **score** every user turn with the model (P(clarify), the engine's one-pass decision) on a pool of
   ``audit.actors`` scorer actors, written to ``<out>/scored/`` (Parquet);
3. in the driver, on ids and scores only (:mod:`clarifier.core.selection`): leave out turns already labelled (a
   gold label in the logs, or an id in a ``--labelled`` file: earlier labels or queues, so no turn is queued
   twice), draw the **kept-apart slice** (stratified by score, one turn per conversation), then from the other
   conversations the **active part** (``strategy="active"``): the turns nearest the threshold, spread over
   clusters of a MiniLM embedding of the turn (only that pool is embedded), or a seeded random draw
   (``strategy="random"``);
4. write ``<out>/queue.jsonl``: one turn per line in labelling order (the two parts interleaved, so any prefix
   labelled holds both in proportion), each an evaluation-set record without its label -- ``id``, ``history``,
   ``query``, ``passages``, and ``meta.queue`` (``part``: ``active``, ``random`` or ``kept_apart``, the score,
   threshold, cluster, source file and line). Adding ``needs_clarification`` (and a question, or ``decision_only: true``)
   to a line makes it a labelled turn ``clarifier adapt`` reads; ``<out>/queue.json`` records how the queue was
   chosen.

The same seed, logs and model give the same queue.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa

from clarifier.core.config import ClarifierConfig
from clarifier.runtime import storage

QUEUE, MANIFEST, SCORED, QUARANTINE = "queue.jsonl", "queue.json", "scored", "quarantine"
SCORED_COLUMNS = ["id", "conversation_id", "turn_index", "score", "gold", "source", "line", "turn_json"]
PARTS = ("active", "random", "kept_apart")


class QueueError(RuntimeError):
    """The selection failed part-way (storage, a worker); the message names the logs and the output."""


def labelled_ids(paths: list[str]) -> set[str]:
    """Turn ids in JSONL files of earlier labels or queues (one record with an ``id`` per line); a line without
    one is an error naming the file and line."""
    from clarifier.data.label_store import jsonl_records

    out: set[str] = set()
    for path in paths:
        for no, rec in jsonl_records(storage.read_text(path), path):
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
                raise ValueError(f"{path}:{no}: a labelled turn needs a string 'id' (the turn ids the queue gave)")
            out.add(rec["id"])
    return out


def interleave(active: list[int], kept: list[int], part: str = "active") -> list[tuple[str, int]]:
    """Both parts in one labelling order, each in its own order, spread in proportion over the queue (``part``:
    the name of the one that is not kept apart)."""
    out, n_a, n_k = [], len(active), len(kept)
    ia = ik = 0
    while ia < n_a or ik < n_k:
        # take from the part that is furthest behind its share of the queue so far
        if ik >= n_k or (ia < n_a and (ia + 1) / n_a <= (ik + 1) / n_k):
            out.append((part, active[ia]))
            ia += 1
        else:
            out.append(("kept_apart", kept[ik]))
            ik += 1
    return out


def turn_text(example) -> str:
    """What a turn is about, for the diversity clusters: the latest message and the user turn before it."""
    users = [t.text for t in example.history if str(getattr(t.role, "value", t.role)) == "user"]
    return (users[-1][-300:] + " || " if users else "") + example.query[:500]


def select_queue(cfg: ClarifierConfig, *, logs: str, out: str, n: int = 100, kept_apart: int | None = None,
                 model_uri: str | None = None, labelled: list[str] | None = None, seed: int = 0,
                 encoder: str | None = None, pool_factor: int = 4, strata: int = 4, strategy: str = "active",
                 progress: Callable[[str], None] = print) -> dict:
    """Choose ``n`` turns of ``logs`` to label (``kept_apart`` of them, default a fifth, as the kept-apart slice;
    the others by ``strategy``: ``active`` or ``random``) and write the queue to ``out``; returns the summary also
    written as ``<out>/queue.json``."""
    from clarifier.core.selection import STRATEGIES

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if n < 1:
        raise ValueError(f"n={n}: queue at least one turn")
    k = max(1, round(n / 5)) if kept_apart is None else kept_apart
    if not 0 <= k <= n:
        raise ValueError(f"kept_apart={k}: between 0 and n={n}")
    if not logs:
        raise ValueError("no logs: pass --logs (a folder, file or s3:// prefix of chat logs)")
    if not out:
        raise ValueError("no output: pass --out (a folder or s3:// prefix for the queue)")
    try:
        return _select(cfg, logs, out, n, k, model_uri, labelled or [], seed, encoder, pool_factor, strata, strategy,
                       progress)
    except (ValueError, FileNotFoundError, QueueError):
        raise
    except Exception as exc:
        if type(exc).__name__ == "ModelResolutionError":
            raise
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        raise QueueError(f"label select failed ({type(exc).__name__}: {(lines[-1] if lines else '')[:500]}); logs "
                         f"{logs!r}, output {out!r}: rerun once the cause is fixed") from exc


def _select(cfg, logs, out, n, k, model_uri, labelled, seed, encoder, pool_factor, strata, strategy,
            progress) -> dict:
    import ray.data
    from ray.data.expressions import col

    from clarifier.core.schema import Example
    from clarifier.core.selection import kept_apart_slice, select_part
    from clarifier.data.audit_stages import (FILE_COUNTS, QUARANTINE_COLUMNS, first_record_is_request_log,
                                             read_log_turns)
    from clarifier.data.pipeline import SUFFIXES
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import resolve_model
    from clarifier.engine.ray_pool import model_fields
    from clarifier.evaluation.audit import SCORE_IN_FLIGHT, TurnScorer, _small_blocks, default_model_uri
    from clarifier.runtime.cluster import init_ray, pool_size
    from clarifier.runtime.mlflow_uri import tracking_uri as resolve_tracking_uri
    from clarifier.runtime.progress import counted

    a = cfg.audit
    t0 = time.time()
    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    model_uri = model_uri or default_model_uri(cfg)
    resolved = resolve_model(model_uri, cache_dir=cfg.model.cache_dir, tracking_uri=tracking_uri)
    meta = read_meta(resolved.folder)
    if Path(model_uri).is_dir():
        model_uri = str(Path(model_uri).resolve())  # actors may run in another working directory
    skip = labelled_ids(labelled)
    files = storage.list_files(logs, tuple(SUFFIXES[f] for f in a.formats))
    if not files:
        raise FileNotFoundError(f"no {'/'.join(SUFFIXES[f] for f in a.formats)} files under {logs}")
    progress(f"[label] {len(files)} log file(s) under {logs}; model {model_uri} (threshold {meta.threshold:.3f}); "
             f"{len(skip)} turn id(s) already labelled or queued")
    for name in (QUEUE, MANIFEST):
        storage.delete_file(storage.join(out, name))
    for name in (SCORED, QUARANTINE):
        storage.delete_dir(storage.join(out, name))

    ray = init_ray()
    fs, _ = storage.filesystem(logs)
    scheme = "s3://" if storage.is_s3(logs) else ""
    paths = [storage.filesystem(f)[1] for f in files]

    request_log = first_record_is_request_log(fs, paths)
    if request_log:
        progress("[label] the logs are a serving request log: conversations put back together from their requests; "
                 "turns that what happened next labels get a pre-label to confirm")

    def read(**remote):
        return read_log_turns(ray, paths, filesystem=fs, scheme=scheme, audit=a.model_dump(),
                              labelling=cfg.data.labelling.model_dump(),
                              min_overlap=cfg.data.request_log.min_reformulation_overlap, request_log=request_log,
                              **remote)

    with _small_blocks():
        parsed = read().filter(expr=col("kind") != "turn").materialize()
        per_file = parsed.filter(expr=col("kind") == "file").select_columns(FILE_COUNTS).take_all()
        counts = {c: sum(int(r[c] or 0) for r in per_file) for c in FILE_COUNTS}
        if counts["n_quarantined"]:
            qfs, qpath = storage.filesystem(storage.join(out, QUARANTINE))
            parsed.filter(expr=col("kind") == "quarantine").select_columns(QUARANTINE_COLUMNS).write_parquet(
                qpath, filesystem=qfs)
        what = "request-log records" if request_log else "conversations"
        progress(f"[label] read {counts['n_lines']} {what}: {counts['n_turns']} user turns, "
                 f"{counts['n_quarantined']} quarantined"
                 + (f" (-> {storage.join(out, QUARANTINE)})" if counts["n_quarantined"] else ""))
        if not counts["n_turns"]:
            raise ValueError(f"no user turns in {logs}: {counts['n_quarantined']} of {counts['n_lines']} records "
                             f"were quarantined")
        spec = {**model_fields(model_uri), "tracking_uri": tracking_uri, "cache_dir": cfg.model.cache_dir,
                "max_new_tokens": cfg.eval.max_new_tokens, "precision": cfg.model.precision,
                **({"device": "cuda"} if a.gpus_per_actor else {})}
        actors = pool_size(ray, a.actors, cpus_per_actor=a.cpus_per_actor, gpus_per_actor=a.gpus_per_actor,
                           rows=counts["n_turns"], rows_per_block=a.batch_size * 4)
        progress(f"[label] scoring {counts['n_turns']} turns with {actors} actor(s)"
                 f"{' (audit.actors=auto)' if a.actors == 'auto' else ''}")
        turns = read(num_cpus=0, concurrency=max(1, min(4, len(paths)))).filter(expr=col("kind") == "turn", num_cpus=0)
        sfs, spath = storage.filesystem(storage.join(out, SCORED))
        with counted(ray, "[label]", counts["n_turns"], progress) as counter:
            scored = turns.map_batches(
                TurnScorer, batch_size=a.batch_size * 4, batch_format="pyarrow",
                fn_constructor_kwargs={"spec": spec, "batch_size": a.batch_size, "cpus": a.cpus_per_actor,
                                       "counter": counter},
                compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=SCORE_IN_FLIGHT),
                num_cpus=a.cpus_per_actor, num_gpus=a.gpus_per_actor or None)
            scored.select_columns(SCORED_COLUMNS, num_cpus=0).write_parquet(spath, filesystem=sfs,
                                                                            ray_remote_args={"num_cpus": 0})
    written = ray.data.read_parquet(spath, filesystem=sfs)
    rows = sorted(written.select_columns(["id", "conversation_id", "score", "gold"]).take_all(), key=lambda r: r["id"])
    if len(rows) != counts["n_turns"]:
        raise QueueError(f"count mismatch: {counts['n_turns']} user turns read but {len(rows)} scored")
    progress(f"[label] scored {len(rows)} turns ({time.time() - t0:.0f}s)")

    ids = [r["id"] for r in rows]
    convs = [str(r["conversation_id"]) for r in rows]
    scores = [float(r["score"]) for r in rows]
    gold_in_logs = sum(1 for r in rows if r["gold"] is not None)
    eligible = [i for i, r in enumerate(rows) if r["gold"] is None and r["id"] not in skip]
    if not eligible:
        raise ValueError(f"every one of the {len(rows)} turns in {logs} is labelled already (in the logs or in "
                         f"{', '.join(labelled) or 'the --labelled files'}): nothing to queue")
    kept_local = kept_apart_slice([ids[i] for i in eligible], [convs[i] for i in eligible],
                                  [scores[i] for i in eligible], k, seed=seed, strata=strata)
    kept = [eligible[j] for j in kept_local]
    kept_convs = {convs[i] for i in kept}
    rest = [i for i in eligible if convs[i] not in kept_convs]

    pool_examples: dict[int, Example] = {}
    where: dict[int, tuple] = {}  # (source file, line) of each fetched turn

    def fetch(indexes: list[int]) -> dict[int, Example]:
        want = {ids[i]: i for i in indexes if i not in pool_examples}
        if want:
            got = written.filter(lambda r: r["id"] in want).select_columns(["id", "turn_json", "source", "line"])
            for r in got.take_all():
                pool_examples[want[r["id"]]] = Example.model_validate_json(r["turn_json"])
                where[want[r["id"]]] = (r["source"], r["line"])
        return {i: pool_examples[i] for i in indexes}

    def embed(indexes: list[int]):
        from clarifier.engine.similarity import SentenceEncoder

        ex = fetch(indexes)
        progress(f"[label] embedding the {len(indexes)} turns nearest the threshold for the diversity clusters")
        return SentenceEncoder(encoder).encode([turn_text(ex[i]) for i in indexes])

    active, clusters = select_part(strategy, ids, scores, meta.threshold, rest, n - len(kept), embed, seed=seed,
                                   pool_factor=pool_factor)
    cluster_of = dict(zip(active, clusters))
    order = interleave(active, kept, strategy)
    examples = fetch([i for _, i in order])
    lines = []
    for pos, (part, i) in enumerate(order, 1):
        e = examples[i]
        rec = e.model_dump(mode="json", include={"id", "history", "query", "passages"})
        rec["meta"] = {**e.meta, "queue": {
            "position": pos, "part": part, "score": round(scores[i], 6), "threshold": meta.threshold,
            "cluster": cluster_of.get(i), "source": where[i][0], "line": where[i][1]}}
        lines.append(json.dumps(rec, ensure_ascii=False))
    storage.write_text(storage.join(out, QUEUE), "".join(line + "\n" for line in lines))
    near = sum(1 for i in active if abs(scores[i] - meta.threshold) <= 0.1)
    prelabels = [(examples[i].meta or {}).get("prelabel") for _, i in order]
    prelabels = [p for p in prelabels if p]
    summary = {
        "logs": logs, "output": out, "model_uri": model_uri, "model_version": resolved.version,
        "threshold": meta.threshold, "seed": seed, "n": len(order), "asked": n, "strategy": strategy,
        strategy: len(active), "kept_apart": len(kept), "clusters": len(set(clusters)),
        "pool_factor": pool_factor, "strata": strata, "encoder": encoder or "all-MiniLM-L6-v2",
        "counts": {"files": len(files), "records": counts["n_lines"], "quarantined": counts["n_quarantined"],
                   "turns": len(rows), "labelled_in_logs": gold_in_logs, "skipped_as_labelled_or_queued":
                   sum(1 for r in rows if r["gold"] is None and r["id"] in skip), "eligible": len(eligible)},
        "active_within_0.1_of_threshold": near, "request_log": request_log,
        "prelabelled": {"turns": len(prelabels),
                        "by_rule": {r: sum(1 for p in prelabels if p["rule"] == r)
                                    for r in sorted({p["rule"] for p in prelabels})}},
        "queue": storage.join(out, QUEUE), "labelled_files": list(labelled),
        "seconds": round(time.time() - t0, 1), "date": time.strftime("%Y-%m-%d"),
    }
    storage.write_text(storage.join(out, MANIFEST), json.dumps(summary, indent=1) + "\n")
    chosen = (f"{len(active)} drawn at random" if strategy == "random" else
              f"{len(active)} near the threshold over {summary['clusters']} clusters")
    progress(f"[label] queued {len(order)} turns -> {summary['queue']}: {chosen}, {len(kept)} kept apart for the "
             f"estimate (one per conversation, stratified by score)"
             + (f"; {len(prelabels)} carry a pre-label from what happened next {summary['prelabelled']['by_rule']}"
                if request_log else ""))
    return summary
