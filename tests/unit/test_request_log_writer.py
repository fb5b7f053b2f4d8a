"""The request log's records and its writer (clarifier.serving.request_log) on a local folder."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from clarifier.core.config import RequestLogConfig, ServeConfig
from clarifier.core.schema import ClarifyRequest, ClarifyResponse, ConversationLog
from clarifier.core.request_record import REDACTED, request_record
from clarifier.serving.request_log import RequestLog

REQ = ClarifyRequest(history=[{"role": "user", "text": "I have a router and a modem, mail me at ann@example.com"},
                              {"role": "assistant", "text": "OK"}],
                     query="how do I reset it?", passages=[{"id": "kb-3", "text": "Hold the reset button."}],
                     conversation_id="c-17")
RESP = ClarifyResponse(needs_clarification=True, confidence=0.91, threshold=0.5, question="The router or the modem?",
                       grounding={"turns": [0], "passages": ["kb-3"]}, model_version="clarifier/3")


def _records(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.rglob("*.jsonl*")):
        data = f.read_bytes()
        out.extend(json.loads(line) for line in (gzip.decompress(data) if f.suffix == ".gz" else data).splitlines())
    return out


def test_a_record_is_a_conversation_log_the_data_job_and_the_audit_read():
    from clarifier.data.chatlog import audit_turns
    from clarifier.data.validate import parse_line_full

    rec = request_record(REQ, RESP, route="clarify", request_id="r1", at=1764688801.5)
    log = ConversationLog.model_validate(rec)
    assert log.conversation_id == "c-17" and [t.role for t in log.turns] == ["user", "assistant", "user"]
    query = log.turns[-1]
    assert query.text == "how do I reset it?" and query.passages[0].id == "kb-3"
    assert query.meta["served"] == {"needs_clarification": True, "confidence": 0.91, "threshold": 0.5,
                                    "question": "The router or the modem?",
                                    "grounding": {"turns": [0], "passages": ["kb-3"]},
                                    "model_version": "clarifier/3", "valid_output": True}
    assert rec["meta"]["request_log"] == {"version": 1, "request_id": "r1", "route": "clarify",
                                          "at": "2025-12-02T15:20:01.500Z", "turn_index": 2,
                                          "client_conversation_id": True, "history_omitted": False}
    # The data job reads the shape; one request alone carries no label yet (what happened next does).
    examples, quarantined, _ = parse_line_full(json.dumps(rec), "requests.jsonl", 1)
    assert examples == [] and quarantined["reason"].startswith("conversation has no labelled user turns")
    turns = audit_turns(rec, "x")
    assert [t.query for t in turns][-1] == "how do I reset it?"


def test_without_a_client_id_each_request_is_its_own_conversation_and_omit_drops_parts():
    anon = request_record(REQ.model_copy(update={"conversation_id": None}), RESP, route="clarify",
                          request_id="abc", at=0)
    assert anon["conversation_id"] == "request-abc" and anon["meta"]["request_log"]["client_conversation_id"] is False
    lean = request_record(REQ, RESP, route="clarify", request_id="r", at=0, omit=["history", "passages.text"])
    assert len(lean["turns"]) == 1 and lean["meta"]["request_log"]["turn_index"] == 2
    assert lean["meta"]["request_log"]["history_omitted"] is True
    assert lean["turns"][0]["passages"] == [{"id": "kb-3", "text": ""}]
    bare = request_record(REQ, RESP, route="clarify", request_id="r", at=0, omit=["passages"])
    assert "passages" not in bare["turns"][-1]
    assert "Hold the reset" not in json.dumps(bare) and "Hold the reset" not in json.dumps(lean)


def test_shards_rotate_by_records_and_age_and_are_whole_gzip_jsonl(tmp_path):
    now = [1000.0]
    cfg = RequestLogConfig(uri=str(tmp_path / "log"), shard_records=3, shard_age_s=30)
    rl = RequestLog(cfg, writer_id="replica/1", clock=lambda: now[0], start=False)
    for i in range(7):
        rl.append(request_record(REQ, RESP, route="clarify", request_id=f"r{i}", at=now[0]))
    rl._drain()
    files = sorted((tmp_path / "log").rglob("*"))
    shards = [f for f in files if f.is_file()]
    assert len(shards) == 2 and all(f.name.startswith("replica-1-") and f.name.endswith(".jsonl.gz") for f in shards)
    assert rl.buffered == 1  # the 7th waits in the open shard
    rl._seal_if_old()
    rl._drain()
    assert rl.buffered == 1  # not old yet
    now[0] += 30
    rl._seal_if_old()
    rl._drain()
    assert rl.buffered == 0 and rl.counts["written"] == 7 and rl.counts["shards"] == 3
    recs = _records(tmp_path / "log")
    assert sorted(r["meta"]["request_log"]["request_id"] for r in recs) == [f"r{i}" for i in range(7)]
    assert not [f for f in (tmp_path / "log").rglob(".*")]  # no temp file left
    assert {f.parent.name for f in shards} == {"1970-01-01"}


def test_a_failing_store_buffers_up_to_the_bound_counts_the_overflow_and_catches_up(tmp_path, caplog):
    blocked = tmp_path / "store"
    blocked.write_text("a file where the folder should be")  # every shard write fails
    counted: dict[str, int] = {}
    cfg = RequestLogConfig(uri=str(blocked / "log"), shard_records=2, max_buffered=5)
    rl = RequestLog(cfg, on_count=lambda k, n: counted.__setitem__(k, counted.get(k, 0) + n), start=False)
    with caplog.at_level(logging.WARNING, logger="ray.serve.clarifier"):
        taken = [rl.append(request_record(REQ, RESP, route="clarify", request_id=f"r{i}", at=0)) for i in range(8)]
        rl._drain()
    assert taken == [True] * 5 + [False] * 3
    assert rl.buffered == 5 and counted == {"dropped_overflow": 3} and rl.counts["write_errors"] == 1
    assert any("dropped" in m and "max_buffered=5" in m for m in caplog.messages)
    assert any("failed" in m and "wait in memory" in m for m in caplog.messages)
    blocked.unlink()  # the store is back
    rl.flush(timeout_s=5)
    assert rl.buffered == 0 and counted["written"] == 5
    assert len(_records(blocked / "log")) == 5


def test_close_writes_what_is_held_and_counts_what_it_could_not(tmp_path, caplog):
    rl = RequestLog(RequestLogConfig(uri=str(tmp_path / "ok"), shard_records=100, compress=False))
    for i in range(4):
        rl.append(request_record(REQ, RESP, route="clarify", request_id=f"r{i}", at=0))
    assert rl.close()["written"] == 4 and len(_records(tmp_path / "ok")) == 4
    assert not rl.append({"late": True})  # closed: refused and counted, not silently kept
    assert rl.counts["dropped_shutdown"] == 1

    blocked = tmp_path / "blocked"
    blocked.write_text("")
    rl = RequestLog(RequestLogConfig(uri=str(blocked / "log")))
    rl.append(request_record(REQ, RESP, route="clarify", request_id="r", at=0))
    with caplog.at_level(logging.ERROR, logger="ray.serve.clarifier"):
        counts = rl.close(timeout_s=1)
    assert counts["dropped_shutdown"] == 1 and counts["written"] == 0
    assert any("1 record(s) could not be written" in m for m in caplog.messages)


def test_redaction_runs_on_every_text_before_writing(tmp_path):
    cfg = RequestLogConfig(uri=str(tmp_path / "log"), redact=[r"[\w.]+@[\w.]+", r"(?i)reset button"])
    rl = RequestLog(cfg, start=False)
    resp = RESP.model_copy(update={"question": "Is ann@example.com your login?"})
    rl.append(request_record(REQ, resp, route="clarify", request_id="r", at=0))
    rl.flush()
    text = json.dumps(_records(tmp_path / "log"))
    assert "ann@example.com" not in text and "reset button" not in text and text.count(REDACTED) == 3


def test_config_refuses_bad_patterns_and_unknown_parts():
    with pytest.raises(ValueError, match=r"pattern \[0\]"):
        RequestLogConfig(uri="x", redact=["("])
    with pytest.raises(ValueError, match="history"):
        ServeConfig.model_validate({"request_log": {"omit": ["query"]}})
    with pytest.raises(ValueError, match="request log is off"):
        RequestLog(RequestLogConfig())
    assert ServeConfig().request_log.uri is None  # off by default


def test_gzip_files_are_copied_byte_for_byte(tmp_path):
    """pyarrow guesses compression from a .gz suffix unless told not to: a copy would be gunzipped (or a shard
    gzipped twice)."""
    from clarifier.runtime import storage

    src = tmp_path / "src"
    src.mkdir()
    blob = gzip.compress(b'{"a": 1}\n')
    (src / "shard.jsonl.gz").write_bytes(blob)
    storage.upload_dir(src, str(tmp_path / "up"))
    assert (tmp_path / "up" / "shard.jsonl.gz").read_bytes() == blob
    storage.download_prefix(str(tmp_path / "up"), tmp_path / "down")
    assert (tmp_path / "down" / "shard.jsonl.gz").read_bytes() == blob
