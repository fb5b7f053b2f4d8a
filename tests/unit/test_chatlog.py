"""Logs as teams have them (OpenAI transcripts, conversation logs, examples) -> audited turns and signals."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from clarifier.core.config import load_config
from clarifier.data.audit_stages import parse_audit_files
from clarifier.data.chatlog import audit_turns
from clarifier.data.signals import feedback_polarity, text_signals

SIGNALS_CFG = load_config().audit.signals


def transcript(**extra):
    return {"id": "c1", "metadata": {"domain": "routers", "region": "eu", **extra.pop("metadata", {})}, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "I have a router and a modem."},
        {"role": "assistant", "content": "Great, how can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "how do I reset it?"}, {"type": "image_url", "image_url": {}}],
         "needs_clarification": True},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1"}]},
        {"role": "tool", "tool_call_id": "call-1", "content": json.dumps(
            [{"doc_id": "kb-1", "text": "Reset the router: hold the button."}, {"id": "kb-2", "page_content": "Reset the modem."}])},
        {"role": "assistant", "content": "I couldn't find that in the manuals.", "feedback": "thumbs_down"},
        {"role": "user", "content": "how do I reset the router?", "documents": [{"doc_id": "kb-1", "text": "Hold it 10 s."}]},
        {"role": "assistant", "content": "Hold the button for 10 seconds."},
    ], **extra}


def test_transcript_turns_history_passages_and_outcomes():
    turns = audit_turns(transcript(), "fallback")
    assert [t.id for t in turns] == ["c1:1", "c1:3", "c1:7"]
    t = turns[1]
    assert [h.role for h in t.history] == ["user", "assistant"]  # system and tool-call messages are not turns
    assert t.query == "how do I reset it?" and t.turn_index == 2 and t.user_position == 2
    assert [p.id for p in t.passages] == ["kb-1", "kb-2"]  # from the tool message, both id spellings
    assert t.answer == "I couldn't find that in the manuals." and t.feedback == ["thumbs_down"]
    assert t.next_user == "how do I reset the router?" and t.gold is True
    assert t.meta == {"domain": "routers", "region": "eu"}
    assert [p.id for p in turns[2].passages] == ["kb-1"] and turns[2].next_user is None
    assert turns[0].passages == [] and turns[0].gold is None
    ex = t.example()
    assert ex.query == t.query and ex.meta["conversation_id"] == "c1"


def test_conversation_level_documents_feedback_and_escalation():
    rec = transcript(metadata={"documents": [{"doc_id": "faq", "text": "FAQ"}], "escalated": True,
                               "feedback": [{"message_index": 2, "rating": 1}]})
    turns = audit_turns(rec, "f")
    assert [p.id for p in turns[0].passages] == ["faq"]  # a turn without its own passages gets the conversation's
    assert turns[0].feedback == [1]
    assert [t.escalated for t in turns] == [False, False, True]  # the last answered turn
    assert "documents" not in turns[0].meta and "feedback" not in turns[0].meta


@pytest.mark.parametrize("rec, match", [
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\].role: 'bot' is not one of"),
    ({"messages": []}, "messages: expected a non-empty list"),
    ({"messages": [{"role": "user", "content": "  "}]}, r"messages\[0\].content: a user message is empty"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "has no user message"),
    ({"messages": [{"role": "user", "content": "q", "documents": [{"doc_id": 1}]}]}, r"documents\[0\]: a document needs a text"),
    ({"messages": [{"role": "user", "content": "q", "needs_clarification": "yes"}]}, "needs_clarification must be true or false"),
    ({"messages": [{"role": "user", "content": 5}]}, r"content: expected a string or a list of parts"),
    ({"messages": [{"role": "user", "content": "q"}], "metadata": {"feedback": [{"rating": 1}]}}, "integer message_index"),
    ({"foo": 1}, "not a chat transcript"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_records_name_the_field(rec, match):
    with pytest.raises(ValueError, match=match):
        audit_turns(rec, "f")


def test_platform_conversation_log_and_example():
    log = {"conversation_id": "p1", "domain": "bank", "turns": [
        {"role": "user", "text": "my card", "meta": {"rating": 1, "segment": "a"}},
        {"role": "assistant", "text": "Which card?"},
        {"role": "user", "text": "the debit card", "label": {"needs_clarification": False}},
    ]}
    turns = audit_turns(log, "f")
    assert [t.id for t in turns] == ["p1:0", "p1:2"]
    assert turns[0].answer == "Which card?" and turns[0].feedback == [1] and turns[0].next_user == "the debit card"
    assert turns[0].meta == {"segment": "a", "domain": "bank"}
    assert turns[1].gold is False and turns[1].answer is None
    ex = audit_turns({"id": "e1", "query": "which one?", "needs_clarification": True, "clarifying_question": "Which?",
                      "history": [{"role": "user", "text": "a or b"}]}, "f")
    assert len(ex) == 1 and ex[0].gold is True and ex[0].user_position == 2


@pytest.mark.parametrize("value, expected", [
    ("down", True), ("Thumbs_Down", True), ("👎", True), ("up", False), (False, True), (True, False),
    (1, True), (2, True), (4, False), ("1", True), ({"thumbs": "down"}, True), ({"rating": 5}, False),
    ("meh", None), ({"comment": "x"}, None),
])
def test_feedback_polarity(value, expected):
    assert feedback_polarity(value, SIGNALS_CFG.feedback) is expected


def test_text_signals():
    turns = audit_turns(transcript(), "f")
    s = text_signals(turns[1], SIGNALS_CFG)
    assert s["feedback"] is True and s["no_answer"] is True and s["escalation"] is False
    s0 = text_signals(turns[0], SIGNALS_CFG)
    assert s0["feedback"] is None and s0["no_answer"] is False  # no feedback on that answer at all
    esc = audit_turns({"messages": [{"role": "user", "content": "help"},
                                    {"role": "assistant", "content": "Let me transfer you to a human agent."}]}, "f")
    assert text_signals(esc[0], SIGNALS_CFG)["escalation"] is True
    off = SIGNALS_CFG.model_copy(deep=True)
    off.no_answer.enabled = False
    assert text_signals(turns[1], off)["no_answer"] is None
    unknown = audit_turns({"messages": [{"role": "user", "content": "q"},
                                        {"role": "assistant", "content": "a", "feedback": "meh"}]}, "f")
    s = text_signals(unknown[0], SIGNALS_CFG)
    assert s["feedback"] is None and s["feedback_unknown"] is True


def test_read_stage_counts_every_line(tmp_path):
    """Good lines give turns, bad lines are quarantined with the reason, a long turn over the abuse guard
    too; a long answer under it is kept; gzip works; the file row's counts add up."""
    cfg = load_config(None, ["audit.max_turn_chars=10000"]).audit
    long_ok = transcript()
    long_ok["messages"][6]["content"] = "x" * 5000  # a real, long RAG answer: kept
    too_long = transcript(id="c2")
    too_long["messages"][2]["content"] = "y" * 20000
    lines = [json.dumps(long_ok), "", "{bad", json.dumps(too_long), json.dumps({"messages": [{"role": "bot", "content": "x"}]})]
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    out = parse_audit_files(pa.table({"path": [str(tmp_path / "a.jsonl.gz")]}), filesystem=pafs.LocalFileSystem(),
                            scheme="", audit=cfg.model_dump()).to_pylist()
    kinds = [r["kind"] for r in out]
    assert kinds.count("turn") == 3 and kinds.count("quarantine") == 3
    reasons = [r["reason"] for r in out if r["kind"] == "quarantine"]
    assert reasons[0].startswith("bad JSON") and "history 1 has 20000 chars (> audit.max_turn_chars=10000" in reasons[1]
    assert "'bot' is not one of" in reasons[2]
    f = [r for r in out if r["kind"] == "file"][0]
    assert (f["n_lines"], f["n_blank"], f["n_turns"], f["n_quarantined"], f["n_lines_with_turns"]) == (4, 1, 3, 3, 1)
    t = [r for r in out if r["kind"] == "turn"][1]
    assert t["feedback"] is True and t["no_answer"] is False and t["seg_domain"] == "routers" and t["gold"] is True
    assert 0 <= t["bucket"] < cfg.buckets and t["next_user"] == "how do I reset the router?"
