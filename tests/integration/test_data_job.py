"""The Ray Data job end to end on a local 2-CPU Ray: logs with bad lines -> Parquet splits + manifest."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from clarifier.core.config import build_config
from clarifier.data.pipeline import prepare
from clarifier.data.outputs import FILTERED_COLUMNS, QUARANTINE_COLUMNS, SPLIT_COLUMNS, load_split, read_manifest
from clarifier.data.split import assign_split
from clarifier.data.synthetic import generate_conversations, write_logs
from clarifier.core.schema import ConversationLog

pytestmark = pytest.mark.integration
RAY_CPUS = 2

N_CONV = 60
SEED = 5


def _table(folder: Path, columns=None):
    return pads.dataset(str(folder), format="parquet").to_table(columns=columns)


@pytest.fixture(scope="module")
def job(ray_local, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("datajob")
    logs, out = tmp / "logs", tmp / "data"
    files = [Path(u) for u in write_logs(str(logs), N_CONV, seed=SEED, shards=3)]
    first = files[0].read_text().splitlines()
    n0 = len(first)
    # Shard 0 gets bad lines appended (1-based line numbers below), a blank line and one duplicate.
    long_query = {"id": "long-1", "query": "ζ" * 590, "needs_clarification": False}
    extra = [
        "{not json",                                                # n0+1
        "",                                                         # n0+2 blank: skipped, not a row
        json.dumps({"id": "q-missing", "needs_clarification": False}),  # n0+3
        json.dumps({"id": "o", "query": "hi", "needs_clarification": False,
                    "history": [{"role": "user", "text": "x" * 200_001}]}),  # n0+4 oversized (the abuse guard)
        first[0],                                                   # n0+5 duplicate of line 1
        json.dumps(long_query),                                     # n0+6 too long after tokenising
        json.dumps({"id": "eval-1", "history": [], "query": "what is my balance?", "needs_clarification": False}),
    ]
    files[0].write_text("\n".join(first + extra) + "\n")
    with open(files[1], "ab") as f:
        f.write(b'{"id": "u", "query": "caf\xe9", "needs_clarification": false}\n')
    # Shard 2 is gzip-compressed; plus a file that is not valid gzip and one that is ignored.
    gz = files[2].with_suffix(".jsonl.gz")
    gz.write_bytes(gzip.compress(files[2].read_bytes()))
    files[2].unlink()
    (logs / "corrupt.jsonl.gz").write_bytes(b"this is not gzip")
    (logs / "notes.txt").write_text("ignored: not a .jsonl file\n")

    cfg = build_config({}, [f"data.input={logs}", f"data.output={out}", f"model.base_model={tiny_model_dir}",
                            f"data.seed={SEED}", "data.max_length=512"])
    lines: list[str] = []
    manifest = prepare(cfg, progress=lines.append)
    return {"cfg": cfg, "manifest": manifest, "out": out, "logs": logs, "n0": n0, "progress": lines,
            "shard0": str(files[0].resolve()), "shard1": str(files[1].resolve())}


def _gold():
    return {e.id: e for c in generate_conversations(N_CONV, SEED) for e in ConversationLog.model_validate(c).explode()}


@pytest.mark.timeout(180)
def test_counts_add_up(job):
    m = job["manifest"]
    c = m["counts"]
    gold = _gold()
    assert m == read_manifest(str(job["out"]))
    assert c["files"] == 4 and len(m["inputs"]) == 4 and not any(i.endswith(".txt") for i in m["inputs"])
    # rows: N_CONV conversation lines + 6 non-blank extra lines in shard 0 + 1 in shard 1 + the corrupt gz file
    assert c["rows_read"] == N_CONV + 6 + 1 + 1
    assert c["blank_lines"] == 1
    assert c["quarantined"] == 5  # bad JSON, missing query, oversized turn, invalid UTF-8, corrupt gzip
    assert c["rows_read"] == c["rows_with_examples"] + c["quarantined"]
    assert c["examples"] == len(gold) + c["filtered_by_reason"]["duplicate"] + 2  # + long-1 + eval-1
    assert c["filtered_by_reason"]["too_long"] == 1
    assert c["filtered_by_reason"]["duplicate"] >= 1
    assert c["examples"] == c["kept"] + c["filtered"]
    assert c["kept"] == sum(s["examples"] for s in c["splits"].values()) == len(gold) + 1
    assert all(m["invariants"].values())
    assert set(c["splits"]) == {"train", "dev", "test"} and c["splits"]["train"]["examples"] > 0
    clar = sum(s["clarify"] for s in c["splits"].values())
    assert clar == sum(e.needs_clarification for e in gold.values())
    assert m["config"]["data"]["seed"] == SEED and m["config"]["tokenizer"]["vocab_size"] > 0
    assert m["config"]["tokenizer"]["target_grounding"] == "shown-turns"  # targets name only turns the prompt shows
    assert m["code"]["clarifier_version"] and m["created_at"] and "row_definition" in m
    assert any("quarantined" in line for line in job["progress"])
    # rows as they pass, summed over the workers (files read; examples tokenised, the final count last)
    reads = [line for line in job["progress"] if line.startswith("[data] read: ")]
    tokenised = [line for line in job["progress"] if line.startswith("[data] tokenise: ")]
    assert reads and reads[-1] == f"[data] read: {c['files']}/{c['files']} files"
    assert tokenised and tokenised[-1] == f"[data] tokenise: {c['examples']}/{c['examples']} examples"


@pytest.mark.timeout(60)
def test_quarantine_has_bad_lines_with_reasons(job):
    t = _table(job["out"] / "quarantine")
    assert t.column_names == QUARANTINE_COLUMNS
    rows = {(Path(r["source"]).name, r["line"]): r for r in t.to_pylist()}
    n0 = job["n0"]
    s0, s1 = Path(job["shard0"]).name, Path(job["shard1"]).name
    assert rows[(s0, n0 + 1)]["reason"].startswith("bad JSON") and rows[(s0, n0 + 1)]["raw"] == "{not json"
    assert rows[(s0, n0 + 3)]["reason"].startswith("query")
    assert "max_turn_chars" in rows[(s0, n0 + 4)]["reason"]
    s1_lines = len(Path(job["shard1"]).read_bytes().splitlines())
    assert rows[(s1, s1_lines)]["reason"].startswith("invalid UTF-8")
    assert rows[("corrupt.jsonl.gz", 0)]["reason"].startswith("cannot decompress")
    assert len(rows) == 5


@pytest.mark.timeout(60)
def test_filtered_rows_keep_their_reason(job):
    t = _table(job["out"] / "filtered")
    assert t.column_names == FILTERED_COLUMNS
    rows = t.to_pylist()
    too_long = [r for r in rows if r["id"] == "long-1"]
    assert len(too_long) == 1 and "max_length" in too_long[0]["reason"] and too_long[0]["line"] == job["n0"] + 6
    dups = [r for r in rows if r["reason"].startswith("duplicate")]
    assert dups and all(Path(r["source"]).name == Path(job["shard0"]).name and r["line"] == job["n0"] + 5 for r in dups)


@pytest.mark.timeout(60)
def test_splits_by_conversation_with_columns(job):
    out, cfg = job["out"], job["cfg"]
    seen: dict[str, str] = {}
    for split in ("train", "dev", "test"):
        t = _table(out / split)
        assert set(SPLIT_COLUMNS) <= set(t.column_names)
        assert t.num_rows == job["manifest"]["counts"]["splits"][split]["examples"]
        for r in t.to_pylist():
            assert r["split"] == split
            assert seen.setdefault(r["conversation_id"], split) == split, "conversation in two splits"
            assert r["conversation_id"] == json.loads(r["example_json"])["meta"].get("conversation_id", r["id"])
            assert assign_split(r["conversation_id"], cfg.data.seed, cfg.data.split) == split
            n = r["num_tokens"]
            assert n == len(r["input_ids"]) == len(r["labels"]) == len(r["loss_weights"]) == len(r["segment_ids"])
            assert 0 < n <= cfg.data.max_length
            assert all((lab == -100) == (seg == 0) for lab, seg in zip(r["labels"], r["segment_ids"]))
            assert max(r["loss_weights"]) == (cfg.train.loss_weights.decision)
    assert len(seen) > 10


@pytest.mark.timeout(60)
def test_load_split_round_trips(job):
    gold = _gold()
    got = {}
    for split in ("train", "dev", "test"):
        for e in load_split(str(job["out"]), split):
            assert e.id not in got
            got[e.id] = e
    assert got.pop("eval-1").query == "what is my balance?"
    assert set(got) == set(gold)
    for k, e in got.items():
        assert e.model_dump() == gold[k].model_dump()


@pytest.mark.timeout(180)
def test_rerun_overwrites_cleanly(job, tmp_path):
    out = job["out"]
    stray = out / "train" / "stale.parquet"
    stray.write_bytes(b"not parquet")
    cfg = job["cfg"].model_copy(deep=True)
    cfg.data.seed = SEED + 1
    cfg.data.split = {"train": 0.5, "dev": 0.0, "test": 0.5}
    m = prepare(cfg, progress=lambda s: None)
    assert not stray.exists() and not (out / "dev").exists()
    assert m["counts"]["splits"]["dev"]["examples"] == 0
    assert m["counts"]["kept"] == job["manifest"]["counts"]["kept"]
    total = sum(_table(out / s).num_rows for s in ("train", "test"))
    assert total == m["counts"]["kept"]
    assert load_split(str(out), "dev") == []
    assert read_manifest(str(out))["config"]["data"]["seed"] == SEED + 1


@pytest.mark.timeout(180)
def test_s3_input_and_output(ray_local, tiny_model_dir, s3_bucket):
    base = f"s3://{s3_bucket}"
    write_logs(f"{base}/logs", 12, seed=9, shards=2)
    cfg = build_config({}, [f"data.input={base}/logs", f"data.output={base}/data", f"model.base_model={tiny_model_dir}"])
    m = prepare(cfg, progress=lambda s: None)
    assert all(i.startswith(f"{base}/logs/") for i in m["inputs"])
    assert m["counts"]["rows_read"] == 12 and m["counts"]["quarantined"] == 0
    assert read_manifest(f"{base}/data") == m
    n = sum(len(load_split(f"{base}/data", s)) for s in ("train", "dev", "test"))
    assert n == m["counts"]["kept"] > 0
