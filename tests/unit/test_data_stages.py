"""The data job's last stage (EncodeAndWrite) without Ray: what a batch writes and the counts it returns."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pytest

from clarifier.data.outputs import FILTERED_COLUMNS, SPLIT_COLUMNS
from clarifier.data.stages import EncodeAndWrite, conversation_hash, duplicate_keys, parse_files


def _log(cid: str, query: str) -> dict:
    return {"conversation_id": cid, "turns": [
        {"role": "user", "text": "My router and my modem both blink."},
        {"role": "assistant", "text": "Both can cause that."},
        {"role": "user", "text": query, "label": {"needs_clarification": True, "clarifying_question": "Which one?",
                                                   "grounding_turns": [0]}},
        {"role": "assistant", "text": "Which one?"},
        {"role": "user", "text": "The router, thanks.", "label": {"needs_clarification": False}}]}


@pytest.fixture()
def parsed(tmp_path):
    logs = [_log(f"c{k}", f"How do I reset it ({k})?") for k in range(6)]
    logs.append(_log("c-copy", "How do I reset it (0)?"))  # the same inputs as c0: two duplicates
    f = tmp_path / "logs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in logs))
    return parse_files(pa.table({"path": [str(f)]}), filesystem=pafs.LocalFileSystem(), scheme="", seed=0,
                       fractions={"train": 0.5, "dev": 0.25, "test": 0.25}, max_turn_chars=10_000)


def _stage(tiny_model_dir, out, parsed) -> EncodeAndWrite:
    ex = parsed.filter(pc.equal(parsed["kind"], "example"))
    keys, orders = ex.column("dedup_key").to_pylist(), ex.column("order_key").to_pylist()
    first = {}
    for k, o in zip(keys, orders):
        if keys.count(k) > 1:
            first[k] = min(first.get(k, o), o)
    assert len(first) == 2  # c0's two turns
    found = duplicate_keys(ex.select(["dedup_key", "order_key"]))
    assert dict(zip(found.column("dedup_key").to_pylist(), found.column("first").to_pylist())) == first
    return EncodeAndWrite(
        encoder={"base_model": str(tiny_model_dir), "resolved": str(tiny_model_dir), "cache_dir": None, "weights": {},
                 "prompt": {"max_prompt_tokens": 256}, "max_length": 512},
        first=first, filesystem=pafs.LocalFileSystem(), output=str(out), split_columns=SPLIT_COLUMNS,
        filtered_columns=FILTERED_COLUMNS, micro_batch_size=2,
        packing={"block_length": 512, "folder": "train_packed"})


def _read(folder):
    return pads.dataset(str(folder), format="parquet").to_table() if folder.is_dir() else None


def test_a_batch_is_written_where_it_belongs_and_only_counts_come_back(tiny_model_dir, tmp_path, parsed):
    out = tmp_path / "out"
    counts = _stage(tiny_model_dir, out, parsed)(parsed).to_pylist()

    groups = [r for r in counts if r["kind"] == "group"]
    assert sum(r["n"] for r in groups) == 14  # 7 logs x 2 labelled turns; file rows are skipped
    dup = [r for r in groups if r["status"] == "duplicate"]
    assert sum(r["n"] for r in dup) == 2 and all(not r["conversations"] for r in dup)
    filtered = _read(out / "filtered")
    assert filtered.column_names == FILTERED_COLUMNS and filtered.num_rows == 2
    assert all(r.startswith("duplicate of c0:") for r in filtered.column("reason").to_pylist())
    assert set(filtered.column("conversation_id").to_pylist()) == {"c-copy"}

    kept = {s: _read(out / s) for s in ("train", "dev", "test")}
    for split, table in kept.items():
        ok = [r for r in groups if r["status"] == "ok" and r["split"] == split]
        assert (table.num_rows if table is not None else 0) == sum(r["n"] for r in ok)
        if table is not None:
            assert table.column_names == SPLIT_COLUMNS
            hashes = {h for r in ok for h in r["conversations"]}
            assert hashes == {conversation_hash(c) for c in table.column("conversation_id").to_pylist()}
    packed = [r for r in counts if r["kind"] == "packed"]
    assert sum(r["n"] for r in packed) == kept["train"].num_rows
    assert _read(out / "train_packed").num_rows == sum(r["blocks"] for r in packed)
    padding = [r for r in counts if r["kind"] == "padding"]
    assert padding[0]["tokens"] == sum(kept["train"].column("num_tokens").to_pylist()) <= padding[0]["slots"]
    tok = [json.loads(r["payload"]) for r in counts if r["kind"] == "tokenizer"]
    assert len(tok) == 1 and tok[0]["vocab_size"] > 0


def test_a_retried_batch_overwrites_its_own_files(tiny_model_dir, tmp_path, parsed):
    out = tmp_path / "out"
    stage = _stage(tiny_model_dir, out, parsed)
    stage(parsed)
    files = sorted(p.relative_to(out) for p in out.rglob("*.parquet"))
    again = stage(parsed).to_pylist()
    assert sorted(p.relative_to(out) for p in out.rglob("*.parquet")) == files
    assert not [r for r in again if r["kind"] == "tokenizer"]  # reported once per actor
    other = stage(parsed.slice(0, 6))  # another batch: other files
    assert other.num_rows and len(list(out.rglob("*.parquet"))) > len(files)
