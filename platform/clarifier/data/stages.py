"""The data job's per-block stages, run in Ray workers (:mod:`clarifier.data.pipeline` assembles them):
``parse_files`` (read, gunzip, split into lines, validate, label, split by conversation),
``mark_duplicates`` (rows after the first of a duplicated input), the ``Encoder`` (tokenise with the
joint objective, filter ``too_long``) and ``EncodeAndWrite``, the actor that tokenises, marks and writes
a batch and returns its counts. The Arrow schemas of their outputs are here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa

from clarifier.core.config import LabellingConfig
from clarifier.core.request_record import META_KEY
from clarifier.core.schema import Example
from clarifier.data.grounding import AGREE_COLUMNS, GROUNDING_COLUMNS
from clarifier.core.schema import source_of
from clarifier.data.split import assign_split
from clarifier.data.validate import UnreadableFile, check_object, parse_line_full, quarantine_record, read_lines
from clarifier.runtime import relay

LABELLING_REASON_PREFIX = "labelling:"  # filtered_by_reason keys of user turns the labelling rules dropped

# One row per file ("file": line counts), per quarantined line, or per example.
PARSED_SCHEMA = pa.schema([
    ("kind", pa.string()),
    ("source", pa.string()),
    ("line", pa.int64()),
    ("reason", pa.string()),
    ("raw", pa.string()),
    ("id", pa.string()),
    ("conversation_id", pa.string()),
    ("split", pa.string()),
    ("example_json", pa.string()),
    ("needs_clarification", pa.bool_()),
    ("data_source", pa.string()),  # the dataset the example came from (clarifier.data.sources.source_of)
    ("dedup_key", pa.string()),
    ("order_key", pa.string()),  # examples: (source, line, id) as one string that sorts like the tuple
    # "file" rows: the file's counts (the manifest's counts are sums of these)
    ("n_lines", pa.int64()),
    ("n_blank", pa.int64()),
    ("n_examples", pa.int64()),
    ("n_quarantined", pa.int64()),
    ("n_filtered", pa.int64()),
    ("n_lines_with_examples", pa.int64()),
])
FILE_COUNTS = ["n_lines", "n_blank", "n_examples", "n_quarantined", "n_filtered", "n_lines_with_examples"]
EXAMPLE_FIELDS = ["source", "line", "id", "conversation_id", "split", "example_json", "needs_clarification",
                  "data_source", "dedup_key", "order_key"]
ENCODED_SCHEMA = pa.schema([PARSED_SCHEMA.field(n) for n in EXAMPLE_FIELDS] + [
    ("status", pa.string()),  # "ok" | "duplicate" | "too_long"
    ("reason", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("labels", pa.list_(pa.int32())),
    ("loss_weights", pa.list_(pa.float32())),
    ("segment_ids", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("clarify", pa.int64()),
    *GROUNDING_COLUMNS,  # filled by the silver-grounding stage, when it runs
])


# ---- stage functions (run in Ray workers) ---------------------------------------------------


def dedup_key(ex: Example) -> str:
    """Identity of an example's input: its history (roles and texts), query and passages (ids and
    texts; left out when there are none, so passage-free examples keep their earlier keys). The same
    query after the same history with other passages is another input: in RAG logs it can need
    clarification with one retrieval and not with another."""
    parts: list = [[[t.role, t.text] for t in ex.history], ex.query]
    if ex.passages:
        parts.append([[p.id, p.text] for p in ex.passages])
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()


def order_key(source: str, line: int, example_id: str, label: bool) -> str:
    """``(source, line, id)`` as one string that sorts like the tuple (the dedup keeps the smallest),
    with the example's label at the end (so the kept row's label travels with it)."""
    return f"{source}\x00{int(line):012d}\x00{example_id}\x00{int(bool(label))}"


def _file_row(source: str, rows: list[dict], n_lines: int, n_blank: int) -> dict:
    """The "file" row of one input file: its line counts and how many rows of each kind it gave."""
    kinds = [r["kind"] for r in rows]
    return {"kind": "file", "source": source, "n_lines": n_lines, "n_blank": n_blank,
            "n_examples": kinds.count("example"), "n_quarantined": kinds.count("quarantine"),
            "n_filtered": kinds.count("filtered"),
            "n_lines_with_examples": len({r["line"] for r in rows if r["kind"] == "example"})}


def _record_rows(examples: list[Example], filtered, source: str, line_no: int, seed: int, fractions: dict) -> list[dict]:
    """PARSED_SCHEMA rows of one good record: its examples, then the user turns the labelling rules filtered."""
    rows = []
    for k, ex in enumerate(examples):
        rows.append({
            "kind": "example",
            "source": source,
            "line": line_no,
            "id": ex.id,
            "conversation_id": ex.conversation_id,
            "split": assign_split(ex.conversation_id, seed, fractions),
            "example_json": ex.model_dump_json(),
            "needs_clarification": ex.needs_clarification,
            "data_source": source_of(ex),
            "dedup_key": dedup_key(ex),
            "order_key": order_key(source, line_no, ex.id, ex.needs_clarification),
        })
    # A record with filtered turns always has >= 1 example (else it is quarantined): same conversation.
    conv = examples[0].conversation_id if examples else ""
    for f in filtered:
        rows.append({
            "kind": "filtered", "source": source, "line": line_no, "reason": LABELLING_REASON_PREFIX + f.reason,
            "raw": f.text, "id": f"{conv}:{f.turn_index}", "conversation_id": conv,
            "split": assign_split(conv, seed, fractions),
        })
    return rows


def _parquet_rows(filesystem, path: str, source: str, seed: int, fractions: dict, max_turn_chars: int,
                  rules: LabellingConfig | None) -> list[dict]:
    """A Parquet input file: each table row is one record (an example or a conversation log); line = row number."""
    import pyarrow.parquet as pq

    rows: list[dict] = []
    n = 0
    try:
        with filesystem.open_input_file(path) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
                for rec in batch.to_pylist():
                    n += 1
                    obj = {k: v for k, v in rec.items() if v is not None}  # null = absent (column unions)
                    raw = json.dumps(obj, ensure_ascii=False, default=str)
                    examples, q, filtered = check_object(obj, source, n, raw, max_turn_chars, rules)
                    if q is not None:
                        rows.append({"kind": "quarantine", **q})
                    else:
                        rows.extend(_record_rows(examples, filtered, source, n, seed, fractions))
    except (OSError, ValueError, pa.ArrowException) as exc:  # not Parquet / truncated: keep what was read
        n += 1
        rows.append({"kind": "quarantine", **quarantine_record(source, 0, f"cannot read Parquet file after {n - 1} rows: {exc}", b"")})
    rows.append(_file_row(source, rows, n, 0))
    return rows


def parse_files(batch: pa.Table, *, filesystem, scheme: str, seed: int, fractions: dict, max_turn_chars: int,
                labelling: dict | None = None, progress: tuple | None = None) -> pa.Table:
    """Rows of file paths -> PARSED_SCHEMA rows (one per file, per quarantined line, per example,
    per user turn filtered by the labelling rules). ``progress``: ``(relay handle, total files)``."""
    rules = LabellingConfig.model_validate(labelling) if labelling else None
    rows: list[dict] = []
    for path in batch.column("path").to_pylist():
        source = scheme + path
        if path.endswith(".parquet"):
            rows.extend(_parquet_rows(filesystem, path, source, seed, fractions, max_turn_chars, rules))
            continue
        n_lines = n_blank = 0
        mine: list[dict] = []
        try:
            lines = read_lines(filesystem, path)
        except UnreadableFile as exc:
            mine.append({"kind": "quarantine", **quarantine_record(source, 0, str(exc), b"")})
            rows.extend([*mine, _file_row(source, mine, 1, 0)])
            continue
        for line_no, raw in enumerate(lines, start=1):
            if not raw.strip():
                n_blank += 1
                continue
            n_lines += 1
            examples, q, filtered = parse_line_full(raw, source, line_no, max_turn_chars, rules)
            if q is not None:
                mine.append({"kind": "quarantine", **q})
                continue
            mine.extend(_record_rows(examples, filtered, source, line_no, seed, fractions))
        rows.extend([*mine, _file_row(source, mine, n_lines, n_blank)])
    if progress:
        relay.count(progress[0], "[data] read", batch.num_rows, progress[1], "files")
    return pa.Table.from_pylist(rows, schema=PARSED_SCHEMA)


def duplicate_keys(keys: pa.Table) -> pa.Table:
    """``dedup_key``/``order_key`` rows -> one row per key seen more than once, with its first
    (smallest) ``order_key`` as ``first``: the duplicate search over one partition of the keys."""
    import pyarrow.compute as pc

    g = keys.group_by("dedup_key").aggregate([("order_key", "min"), ("order_key", "count")])
    g = g.filter(pc.greater(g["order_key_count"], 1))
    return pa.table({"dedup_key": g["dedup_key"], "first": g["order_key_min"]})


def mark_duplicates(batch: pa.Table, *, first: dict[str, str]) -> pa.Table:
    """Rows whose ``dedup_key`` has duplicates (``first``: key -> the kept row's ``order_key``, the
    smallest) become ``status="duplicate"`` unless they are that first row."""
    if not first:
        return batch
    keys, orders = batch.column("dedup_key").to_pylist(), batch.column("order_key").to_pylist()
    labels = batch.column("needs_clarification").to_pylist()
    status, reason = batch.column("status").to_pylist(), batch.column("reason").to_pylist()
    for k, (key, order) in enumerate(zip(keys, orders)):
        kept = first.get(key)
        if kept is None or order == kept:
            continue
        _, _, kept_id, kept_label = kept.split("\x00")
        conflict = " with a different label" if int(bool(labels[k])) != int(kept_label) else ""
        status[k] = "duplicate"
        reason[k] = f"duplicate of {kept_id} (same history, query and passages{conflict})"
    batch = batch.set_column(batch.schema.get_field_index("status"), "status", pa.array(status, pa.string()))
    return batch.set_column(batch.schema.get_field_index("reason"), "reason", pa.array(reason, pa.string()))


class Encoder:
    """Callable class for ``map_batches``: loads the tokenizer once per actor; each batch is
    tokenised with one call for its prompts and one for its targets (``encode_examples``)."""

    def __init__(self, base_model: str, resolved: str, cache_dir: str | None, weights: dict,
                 prompt: dict, max_length: int, progress: tuple | None = None):
        from clarifier.engine.models import load_tokenizer, resolve_base_model
        from clarifier.core.prompt import PromptOptions
        from clarifier.core.objective import SegmentWeights

        # The driver's resolved folder when this node has it, else resolve here (other node: own cache).
        path = resolved if (Path(resolved) / "config.json").is_file() else resolve_base_model(base_model, cache_dir)
        self.tokenizer = load_tokenizer(path)
        self.weights = SegmentWeights(**weights)
        self.opts = PromptOptions(**prompt)  # ModelConfig.prompt_meta()
        self.max_length = max_length
        self.progress = progress  # (relay handle, total examples)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from clarifier.core.objective import encode_examples

        names = [n for n in ENCODED_SCHEMA.names if n in batch.column_names]
        rows = batch.select(names).to_pylist()
        examples = [Example.model_validate_json(r["example_json"]) for r in rows]
        encs = encode_examples(examples, self.tokenizer, self.weights, self.opts, self.max_length)
        for r, enc in zip(rows, encs):
            r.update(status="ok", reason=None, clarify=int(bool(r["needs_clarification"])))
            for name, _ in GROUNDING_COLUMNS:
                r.setdefault(name, "" if name == "grounding_source" else 0)
            if enc["truncated"]:
                r.update(status="too_long", input_ids=[], labels=[], loss_weights=[], segment_ids=[], num_tokens=0,
                         reason=f"prompt ({enc['prompt_len']} tokens) + target exceed data.max_length={self.max_length}")
                continue
            r.update(input_ids=enc["input_ids"], labels=enc["labels"], loss_weights=enc["loss_weights"],
                     segment_ids=enc["segment_ids"], num_tokens=len(enc["input_ids"]))
        if self.progress:
            relay.count(self.progress[0], "[data] tokenise", len(rows), self.progress[1], "examples")
        return pa.Table.from_pylist(rows, schema=ENCODED_SCHEMA)


# One row per (split, status, grounding source, data source) of a batch ("group"; ``conversations``: the
# 8-byte hashes of the distinct conversations of its kept rows), plus one "padding" row (the batch's kept
# train rows padded in micro-batches) and, with packing, one "packed" row (blocks written).
COUNTS_SCHEMA = pa.schema([
    ("kind", pa.string()), ("split", pa.string()), ("status", pa.string()), ("grounding_source", pa.string()),
    ("data_source", pa.string()), ("n", pa.int64()), ("clarify", pa.int64()),
    *[(name, pa.int64()) for name in AGREE_COLUMNS],
    ("conversations", pa.list_(pa.uint64())),
    ("tokens", pa.int64()), ("slots", pa.int64()), ("blocks", pa.int64()),
    ("payload", pa.string()),  # "tokenizer" row (each actor's first batch): what the manifest records of it
])


def tokenizer_info(tok, base_model: str, resolved: str, prompt: dict) -> dict:
    """What the data job's manifest records of the tokenizer it used, of the prompt it rendered (``prompt``:
    ``ModelConfig.prompt_meta()``) and of how targets were cut to the prompt."""
    from clarifier.core.objective import TARGET_GROUNDING

    return {
        "base_model": base_model,
        "resolved_path": resolved,
        "name_or_path": getattr(tok, "name_or_path", resolved),
        "vocab_size": len(tok),
        **prompt,
        "target_grounding": TARGET_GROUNDING,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    }


def conversation_hash(conversation_id: str) -> int:
    """8 bytes of BLAKE2b of a conversation id: what the driver gathers to count distinct conversations."""
    return int.from_bytes(hashlib.blake2b(conversation_id.encode(), digest_size=8).digest(), "little")


class EncodeAndWrite:
    """The data job's last stage, one actor per CPU: tokenise a batch (:class:`Encoder`), mark its
    duplicates (:func:`mark_duplicates`), write its rows where they belong (``<split>/`` when kept,
    ``filtered/`` with the reason otherwise, ``train_packed/`` blocks with packing) and return only
    the batch's counts (``COUNTS_SCHEMA``). Nothing tokenised goes through the object store and no
    later pass re-reads it. File names derive from the batch's first and last rows, so a retried
    batch overwrites its own files instead of adding copies. Input rows that are not examples
    (a parsed file's count and quarantine rows) are skipped."""

    def __init__(self, *, encoder: dict, first: dict[str, str], filesystem, output: str, split_columns: list[str],
                 filtered_columns: list[str], micro_batch_size: int, packing: dict | None = None):
        self.encoder = Encoder(**encoder)
        self.first, self.fs, self.output = first, filesystem, output
        self.split_columns, self.filtered_columns = split_columns, filtered_columns
        self.micro_batch_size, self.packing = micro_batch_size, packing
        self.made: set[str] = set()
        self.info = tokenizer_info(self.encoder.tokenizer, encoder["base_model"], encoder["resolved"], encoder["prompt"])
        self.reported = False

    def _write(self, table: pa.Table, folder: str, name: str) -> None:
        import pyarrow.parquet as pq

        path = f"{self.output}/{folder}"
        if path not in self.made:
            self.fs.create_dir(path, recursive=True)
            self.made.add(path)
        pq.write_table(table, f"{path}/{name}.parquet", filesystem=self.fs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        from clarifier.data.packing import pack_table, padding_stats

        if "kind" in batch.column_names:
            batch = batch.filter(pc.equal(batch["kind"], "example"))
        if not batch.num_rows:
            return COUNTS_SCHEMA.empty_table()
        t = mark_duplicates(self.encoder(batch), first=self.first)
        orders = t.column("order_key")
        name = "part-" + hashlib.sha1(f"{orders[0]}\x01{orders[-1]}\x01{t.num_rows}".encode()).hexdigest()[:20]
        ok = pc.equal(t["status"], "ok")
        counts: list[dict] = []
        for split in pc.unique(t["split"]).to_pylist():
            kept = t.filter(pc.and_(ok, pc.equal(t["split"], split)))
            if kept.num_rows:
                self._write(kept.select(self.split_columns), split, name)
            if split == "train" and kept.num_rows:
                counts.append({"kind": "padding", **padding_stats(kept, micro_batch_size=self.micro_batch_size).to_pylist()[0]})
                if self.packing:
                    blocks = pack_table(kept, block_length=self.packing["block_length"], pad_id=self.info["pad_token_id"])
                    self._write(blocks, self.packing["folder"], name)
                    counts.append({"kind": "packed", "blocks": blocks.num_rows,
                                   "tokens": pc.sum(blocks["num_tokens"]).as_py() or 0,
                                   "n": pc.sum(blocks["num_examples"]).as_py() or 0})
        dropped = t.filter(pc.invert(ok))
        if dropped.num_rows:
            self._write(dropped.rename_columns(["raw" if c == "example_json" else c for c in dropped.column_names])
                        .select(self.filtered_columns), "filtered", name)
        keys = ["split", "status", "grounding_source", "data_source"]
        rows = t.select([*keys, "clarify", "conversation_id", *AGREE_COLUMNS]).to_pylist()
        groups: dict[tuple, dict] = {}
        for r in rows:
            g = groups.setdefault(tuple(r[k] for k in keys), {"kind": "group", **{k: r[k] for k in keys}, "n": 0,
                                                              "clarify": 0, **{a: 0 for a in AGREE_COLUMNS}, "conversations": set()})
            g["n"] += 1
            g["clarify"] += int(r["clarify"] or 0)
            for a in AGREE_COLUMNS:
                g[a] += int(r[a] or 0)
            if r["status"] == "ok":
                g["conversations"].add(conversation_hash(r["conversation_id"]))
        for g in groups.values():
            g["conversations"] = sorted(g["conversations"])
        if not self.reported:
            counts.append({"kind": "tokenizer", "payload": json.dumps(self.info)})
            self.reported = True
        return pa.Table.from_pylist([*groups.values(), *counts], schema=COUNTS_SCHEMA)


# ---- request logs (data.request_log): records -> conversations -> labelled examples ----------------

REQUEST_RECORD_SCHEMA = pa.schema([("conversation_id", pa.string()), ("record_json", pa.string()),
                                   ("source", pa.string()), ("line", pa.int64())])
# "example": payload = Example JSON; "skip" / "rule": payload = the reason / rule, n = how many;
# "unreadable": payload = the raw line (the data job then quarantines it with its reason), reason = why.
LABELLED_SCHEMA = pa.schema([("kind", pa.string()), ("payload", pa.string()), ("n", pa.int64())])


def read_request_records(batch: pa.Table, *, filesystem, scheme: str) -> pa.Table:
    """Rows of request-log file paths -> one row per record (``conversation_id`` ``""`` for a line that is
    not a request-log record: it is passed on raw and quarantined by the data job)."""
    rows: list[dict] = []
    for path in batch.column("path").to_pylist():
        try:
            lines = read_lines(filesystem, path)
        except UnreadableFile as exc:
            rows.append({"conversation_id": "", "record_json": json.dumps({"unreadable_file": scheme + path,
                         "error": str(exc)}), "source": scheme + path, "line": 0})
            continue
        for line_no, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            text = raw.decode("utf-8", errors="replace")
            try:
                obj = json.loads(text)
                cid = obj["conversation_id"] if META_KEY in (obj.get("meta") or {}) else ""
            except (ValueError, TypeError, KeyError, AttributeError):
                cid = ""
            rows.append({"conversation_id": str(cid or ""), "record_json": text, "source": scheme + path,
                         "line": line_no})
    return pa.Table.from_pylist(rows, schema=REQUEST_RECORD_SCHEMA)


def label_request_conversation(group: pa.Table, *, labelling: dict, min_overlap: float) -> pa.Table:
    """One conversation's records (a ``groupby("conversation_id")`` group) -> LABELLED_SCHEMA rows."""
    from collections import Counter

    from clarifier.data.served_logs import assemble, label_served

    records = group.column("record_json").to_pylist()
    if not group.column("conversation_id")[0].as_py():  # not request-log records: passed on to be quarantined
        return pa.Table.from_pylist([{"kind": "unreadable", "payload": r, "n": 1} for r in records],
                                    schema=LABELLED_SCHEMA)
    rows: list[dict] = []
    try:
        log, skipped = assemble([json.loads(r) for r in records])
        examples, more = label_served(log, LabellingConfig.model_validate(labelling), min_overlap)
    except ValueError as exc:  # a record that is not a valid conversation log: the data job says why
        rows.extend({"kind": "unreadable", "payload": r, "n": 1} for r in records)
        rows.append({"kind": "skip", "payload": f"invalid_records: {str(exc).splitlines()[0][:200]}", "n": len(records)})
        return pa.Table.from_pylist(rows, schema=LABELLED_SCHEMA)
    rules = Counter(e.meta["labelling_rule"] for e in examples)
    rows.extend({"kind": "example", "payload": e.model_dump_json(), "n": 1} for e in examples)
    rows.extend({"kind": "rule", "payload": k, "n": v} for k, v in rules.items())
    rows.extend({"kind": "skip", "payload": k, "n": v} for k, v in (skipped + more).items())
    rows.append({"kind": "conversation", "payload": "", "n": 1})
    return pa.Table.from_pylist(rows, schema=LABELLED_SCHEMA)


def write_labelled_shard(batch: pa.Table, *, filesystem, folder: str) -> pa.Table:
    """Write a batch's examples (and unreadable lines) as one JSONL file under ``folder``; return its counts."""
    import uuid
    from collections import Counter

    kinds = batch.column("kind").to_pylist()
    payloads = batch.column("payload").to_pylist()
    ns = batch.column("n").to_pylist()
    lines = [p for k, p in zip(kinds, payloads) if k in ("example", "unreadable")]
    if lines:
        filesystem.create_dir(folder, recursive=True)
        with filesystem.open_output_stream(f"{folder}/part-{uuid.uuid4().hex[:16]}.jsonl") as f:
            f.write(("\n".join(lines) + "\n").encode("utf-8"))
    counts: Counter = Counter()
    for k, p, n in zip(kinds, payloads, ns):
        counts[(k, p if k in ("rule", "skip") else "")] += int(n)
    return pa.Table.from_pylist([{"kind": k, "payload": p, "n": n} for (k, p), n in counts.items()],
                                schema=LABELLED_SCHEMA)
