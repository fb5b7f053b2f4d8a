"""The audit's read stage, run in Ray workers: log files -> one row per user turn (or per bad line).

``parse_audit_files`` reads each file (JSONL, JSONL.gz, Parquet; gunzipped here), turns every record
into its user turns with :func:`clarifier.data.chatlog.audit_turns`, computes the text signals
(:func:`clarifier.data.signals.text_signals`), and emits rows of :data:`AUDIT_SCHEMA`: ``kind`` is
``turn``, ``quarantine`` (a bad line, with the reason naming the field) or ``file`` (the file's counts:
``rows_read == rows_with_turns + quarantined`` is checked by the job). Nothing is dropped silently.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa

from clarifier.core.config import AuditConfig
from clarifier.data.chatlog import AuditTurn, audit_turns, stable_id
from clarifier.data.signals import text_signals
from clarifier.data.validate import UnreadableFile, decode_line, quarantine_record, read_lines

NONE_VALUE = "(none)"

_BASE = [
    ("kind", pa.string()),
    ("source", pa.string()),
    ("line", pa.int64()),
    ("reason", pa.string()),
    ("raw", pa.string()),
    # turn rows
    ("id", pa.string()),
    ("conversation_id", pa.string()),
    ("turn_index", pa.int64()),
    ("user_position", pa.int64()),
    ("bucket", pa.int64()),
    ("sample_key", pa.string()),
    ("query", pa.string()),
    ("next_user", pa.string()),
    ("answered", pa.bool_()),
    ("n_passages", pa.int64()),
    ("feedback", pa.bool_()),  # null: no understood feedback on the answer
    ("feedback_unknown", pa.bool_()),
    ("no_answer", pa.bool_()),
    ("escalation", pa.bool_()),
    ("gold", pa.bool_()),
    ("turn_json", pa.string()),
    # file rows
    ("n_lines", pa.int64()),
    ("n_blank", pa.int64()),
    ("n_turns", pa.int64()),
    ("n_quarantined", pa.int64()),
    ("n_lines_with_turns", pa.int64()),
]
FILE_COUNTS = ["n_lines", "n_blank", "n_turns", "n_quarantined", "n_lines_with_turns"]
QUARANTINE_COLUMNS = ["source", "line", "reason", "raw"]


def segment_column(field: str) -> str:
    return "seg_" + "".join(c if c.isalnum() or c == "_" else "_" for c in field)


def audit_schema(segments: list[str]) -> pa.Schema:
    return pa.schema(_BASE + [(segment_column(s), pa.string()) for s in segments])


def bucket_of(conversation_id: str, buckets: int) -> int:
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:12], 16) % buckets


def _too_long(turns: list[AuditTurn], limit: int) -> str | None:
    t = turns[-1]  # the last user turn's history holds every earlier turn
    texts = [("history", i, h.text) for i, h in enumerate(t.history)] + [("query", None, x.query) for x in turns]
    texts += [("answer", None, x.answer or "") for x in turns]
    texts += [("passage", p.id, p.text) for x in turns for p in x.passages]
    for kind, where, text in texts:
        if len(text) > limit:
            at = f"{kind} {where}" if where is not None else kind
            return (f"{at} has {len(text)} chars (> audit.max_turn_chars={limit}, a guard against abuse; long turns "
                    "are otherwise truncated for the prompt)")
    return None


def _segment_value(meta: dict, field: str) -> str:
    v = meta.get(field)
    if v is None or v == "":
        return NONE_VALUE
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True, ensure_ascii=False)


def _turn_rows(obj, source: str, line_no: int, raw, cfg: AuditConfig) -> list[dict]:
    try:
        turns = audit_turns(obj, stable_id(source, line_no))
        problem = _too_long(turns, cfg.max_turn_chars)
    except ValueError as exc:
        problem = str(exc).replace("Value error, ", "")
    except Exception as exc:  # defensive: a parser bug must not abort the audit
        problem = f"unexpected error reading the record: {type(exc).__name__}: {exc}"
    if problem:
        return [{"kind": "quarantine", **quarantine_record(source, line_no, problem, raw)}]
    rows = []
    for t in turns:
        sig = text_signals(t, cfg.signals)
        row = {
            "kind": "turn", "source": source, "line": line_no, "id": t.id, "conversation_id": t.conversation_id,
            "turn_index": t.turn_index, "user_position": t.user_position,
            "bucket": bucket_of(t.conversation_id, cfg.buckets),
            "sample_key": hashlib.sha256(f"{cfg.seed}:{t.id}".encode()).hexdigest()[:16],
            "query": t.query, "next_user": t.next_user if cfg.signals.reformulation.enabled else None,
            "answered": t.answer is not None, "n_passages": len(t.passages),
            "feedback": sig["feedback"], "feedback_unknown": sig["feedback_unknown"],
            "no_answer": sig["no_answer"], "escalation": sig["escalation"], "gold": t.gold,
            "turn_json": t.example().model_dump_json(),
        }
        for s in cfg.segments:
            row[segment_column(s)] = _segment_value(t.meta, s)
        rows.append(row)
    return rows


def _file_row(source: str, rows: list[dict], n_lines: int, n_blank: int) -> dict:
    kinds = [r["kind"] for r in rows]
    return {"kind": "file", "source": source, "n_lines": n_lines, "n_blank": n_blank, "n_turns": kinds.count("turn"),
            "n_quarantined": kinds.count("quarantine"),
            "n_lines_with_turns": len({r["line"] for r in rows if r["kind"] == "turn"})}


def _parquet_rows(filesystem, path: str, source: str, cfg: AuditConfig) -> list[dict]:
    import pyarrow.parquet as pq

    rows: list[dict] = []
    n = 0
    try:
        with filesystem.open_input_file(path) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=512):
                for rec in batch.to_pylist():
                    n += 1
                    obj = {k: v for k, v in rec.items() if v is not None}
                    if isinstance(obj.get("messages"), str):  # a transcript stored as a JSON string column
                        try:
                            obj["messages"] = json.loads(obj["messages"])
                        except json.JSONDecodeError:
                            pass
                    rows += _turn_rows(obj, source, n, json.dumps(obj, ensure_ascii=False, default=str), cfg)
    except (OSError, ValueError, pa.ArrowException) as exc:
        n += 1
        rows.append({"kind": "quarantine", **quarantine_record(source, 0, f"cannot read Parquet file after {n - 1} rows: {exc}", b"")})
    rows.append(_file_row(source, rows, n, 0))
    return rows


def parse_audit_files(batch: pa.Table, *, filesystem, scheme: str, audit: dict) -> pa.Table:
    """Rows of file paths -> :func:`audit_schema` rows (see the module docstring)."""
    cfg = AuditConfig.model_validate(audit)
    rows: list[dict] = []
    for path in batch.column("path").to_pylist():
        source = scheme + path
        if path.endswith(".parquet"):
            rows += _parquet_rows(filesystem, path, source, cfg)
            continue
        mine: list[dict] = []
        try:
            lines = read_lines(filesystem, path)
        except UnreadableFile as exc:
            mine.append({"kind": "quarantine", **quarantine_record(source, 0, str(exc), b"")})
            rows += [*mine, _file_row(source, mine, 1, 0)]
            continue
        n_lines = n_blank = 0
        for line_no, raw in enumerate(lines, start=1):
            if not raw.strip():
                n_blank += 1
                continue
            n_lines += 1
            obj, q = decode_line(raw, source, line_no)
            mine += [{"kind": "quarantine", **q}] if q else _turn_rows(obj, source, line_no, raw, cfg)
        rows += [*mine, _file_row(source, mine, n_lines, n_blank)]
    return pa.Table.from_pylist(rows, schema=audit_schema(cfg.segments))


# ---- the serving request log as a source of turns to label (clarifier label select) ----------

NOT_A_REQUEST_RECORD = ("not a request-log record (no meta.request_log, as serve.request_log writes them): a folder "
                        "read as a request log holds only those; give chat logs in their own folder")


def first_record_is_request_log(filesystem, paths: list[str]) -> bool:
    """Whether the first record of the first JSONL file under ``paths`` is a request-log record (the serving
    request log, :mod:`clarifier.core.request_record`): the logs are then read as one (see
    :func:`request_log_turn_rows`)."""
    from clarifier.core.request_record import META_KEY

    for path in paths:
        if path.endswith(".parquet"):
            continue
        try:
            lines = read_lines(filesystem, path)
        except UnreadableFile:
            continue
        for raw in lines:
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except ValueError:
                    return False
                return isinstance(obj, dict) and isinstance(obj.get("meta"), dict) and META_KEY in obj["meta"]
    return False


def request_log_turn_rows(group: pa.Table, *, audit: dict, labelling: dict, min_overlap: float) -> pa.Table:
    """One conversation's request-log records (a ``groupby("conversation_id")`` group of
    :func:`clarifier.data.stages.read_request_records` rows) -> :func:`audit_schema` rows: the user turns of the
    conversation put back together (:func:`clarifier.data.served_logs.assemble`: each turn once, however many
    requests repeated it in their history), each turn that what happened next labels
    (:func:`clarifier.data.served_logs.label_served`) carrying that label as ``meta.prelabel`` -- a pre-label for a
    person to confirm on the labelling page; a quarantine row per record that is not a request-log record or
    does not assemble (the reason names why); and one count row (its ``n_lines``: the records read)."""
    from clarifier.core.config import LabellingConfig
    from clarifier.data.served_logs import RULES, assemble, label_served

    cfg = AuditConfig.model_validate(audit)
    records = group.column("record_json").to_pylist()
    sources, lines = group.column("source").to_pylist(), group.column("line").to_pylist()
    cid = group.column("conversation_id")[0].as_py()

    def quarantined(reason: str) -> list[dict]:
        return [{"kind": "quarantine", **quarantine_record(s, n, reason, r)} for r, s, n in zip(records, sources, lines)]

    if not cid:
        rows = []
        for r, s, n in zip(records, sources, lines):
            try:
                err = json.loads(r).get("error") if "unreadable_file" in r[:40] else None
            except ValueError:
                err = None
            rows.append({"kind": "quarantine", **quarantine_record(s, n, err or NOT_A_REQUEST_RECORD, r)})
    else:
        try:
            parsed = [json.loads(r) for r in records]
            log, _ = assemble(parsed)
            examples, _ = label_served(log, LabellingConfig.model_validate(labelling), min_overlap)
        except ValueError as exc:
            rows = quarantined(f"the conversation's request-log records do not fit together: "
                               f"{str(exc).splitlines()[0][:300]}")
        else:
            offset = int(log.meta.get("request_log_offset", 0))
            for e in examples:
                i = int(e.meta["turn_index"]) - offset
                rule = e.meta["labelling_rule"]
                log.turns[i].meta = {**(log.turns[i].meta or {}), "prelabel": {
                    "needs_clarification": e.needs_clarification, "rule": rule, "why": RULES[rule],
                    **({"question": e.clarifying_question} if e.clarifying_question else {})}}
            longest = max(range(len(parsed)), key=lambda j: len(parsed[j].get("turns") or []))
            obj = log.model_dump(mode="json", exclude_none=True)
            rows = _turn_rows(obj, sources[longest], lines[longest], records[longest], cfg)
            if offset:  # history omitted: the turn's index in the conversation, as the data job's labels name it
                for row in rows:
                    if row["kind"] == "turn":
                        row["turn_index"] += offset
                        row["id"] = f"{cid}:{row['turn_index']}"
                        turn = json.loads(row["turn_json"])
                        turn["id"] = row["id"]
                        row["turn_json"] = json.dumps(turn, ensure_ascii=False)
    counts = _file_row(sources[0], rows, len(records), 0)
    counts["n_lines_with_turns"] = len(records) if counts["n_turns"] else 0  # every record fed the turns read once
    rows.append(counts)
    return pa.Table.from_pylist(rows, schema=audit_schema(cfg.segments))


def read_log_turns(ray, paths: list[str], *, filesystem, scheme: str, audit: dict, labelling: dict,
                   min_overlap: float, request_log: bool, **remote):
    """The audit's and ``label select``'s read stage as a Ray Dataset of :func:`audit_schema` rows: chat logs through
    :func:`parse_audit_files`; a serving request log (``request_log``: :func:`first_record_is_request_log`) through
    :func:`clarifier.data.stages.read_request_records` and a ``groupby`` per conversation into
    :func:`request_log_turn_rows` (each turn once, with its pre-label). ``remote``: Ray options of the read."""
    from clarifier.data.stages import read_request_records

    items = ray.data.from_items([{"path": p} for p in paths], override_num_blocks=min(len(paths), 200))
    if not request_log:
        return items.map_batches(parse_audit_files, batch_size=1, batch_format="pyarrow",
                                 fn_kwargs={"filesystem": filesystem, "scheme": scheme, "audit": audit}, **remote)
    records = items.map_batches(read_request_records, batch_size=1, batch_format="pyarrow",
                                fn_kwargs={"filesystem": filesystem, "scheme": scheme}, **remote)
    partitions = max(1, min(200, 4 * len(paths)))  # not Ray's default 200 for a few files
    return records.groupby("conversation_id", num_partitions=partitions).map_groups(
        request_log_turn_rows, batch_format="pyarrow", num_cpus=remote.get("num_cpus", 1),
        fn_kwargs={"audit": audit, "labelling": labelling, "min_overlap": min_overlap})
