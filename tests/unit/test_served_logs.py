"""Request-log records -> conversations -> labels from what happened next (clarifier.data.served_logs)."""

from __future__ import annotations

import random

import pytest

from clarifier.core.config import LabellingConfig
from clarifier.data.served_logs import RULES, SKIP_REASONS, assemble, label_served
from support.served import conversation

RULES_CFG = LabellingConfig()


def labels(records: list[dict]):
    log, skipped = assemble(records)
    examples, more = label_served(log, RULES_CFG)
    return {e.meta["turn_index"]: (e.needs_clarification, e.meta["labelling_rule"], e.clarifying_question)
            for e in examples}, skipped + more, examples


def test_asked_and_answered_is_a_silver_positive_then_a_normal_turn_a_negative():
    recs = conversation("c1", [
        ("how do I reset it?", "The router or the modem?", "The router or the modem?"),  # the app shows it
        ("the modem", None, "Hold the reset button for 10 seconds."),
        ("and how do I update its firmware?", None, "Open the admin page."),  # last: nothing follows
    ])
    random.Random(0).shuffle(recs)  # shards arrive in any order
    got, skipped, examples = labels(recs)
    assert got == {0: (True, "served_question_answered", "The router or the modem?"),
                   2: (False, "served_silent_continued", None)}
    assert skipped == {"no_follow_up": 1}
    pos = next(e for e in examples if e.needs_clarification)
    assert pos.meta["silver_target"] is True and pos.history == [] and pos.grounding_passages == ["kb-1"]
    neg = next(e for e in examples if not e.needs_clarification)
    assert [t.text for t in neg.history] == ["how do I reset it?", "The router or the modem?"]
    assert neg.meta["served"]["model_version"] == "clarifier/2" and neg.id == "c1:2"


def test_silence_before_a_reformulation_is_a_decision_only_positive_and_the_apps_question_a_missed_positive():
    reform = conversation("c2", [("reset my router device", None, "Unplug it."),
                                 ("how do I reset my router device properly", None, "Press reset."),
                                 ("ok thanks bye", None, "Bye!")])
    got, skipped, examples = labels(reform)
    assert got == {0: (True, "missed_reformulated", None), 2: (False, "served_silent_continued", None)}
    assert skipped == {"no_follow_up": 1}
    miss = next(e for e in examples if e.meta["labelling_rule"] == "missed_reformulated")
    assert miss.decision_only and not miss.grounding_passages and miss.query == "reset my router device"
    app_asked = conversation("c3", [("reset it", None, "Do you mean the router or the modem?"),
                                    ("router", None, "Hold the button.")])
    got, skipped, _ = labels(app_asked)
    assert got == {0: (True, "missed_app_asked", "Do you mean the router or the modem?")}


def test_a_question_the_app_did_not_show_or_nobody_answered_gives_no_label():
    not_shown = conversation("c4", [("reset it", "Which device?", "Hold the button."), ("thanks", None, "Bye.")])
    got, skipped, _ = labels(not_shown)
    assert 0 not in got and skipped["question_not_shown"] == 1
    unanswered = conversation("c5", [("reset it", "Which device?", "Which device?")])
    got, skipped, _ = labels(unanswered)
    assert got == {} and skipped == {"no_follow_up": 1}  # the log ends before the app's reply


def test_an_edited_history_is_counted_not_guessed():
    recs = conversation("c6", [("reset it", None, "Press reset."), ("thanks", None, "Bye.")])
    recs[0]["turns"][-1]["text"] = "reset IT please"  # not what the later request's history says
    got, skipped, _ = labels(recs)
    assert skipped["text_mismatch"] == 1 and skipped["not_served"] == 1 and got == {}


def test_records_of_two_conversations_are_refused():
    with pytest.raises(ValueError, match="several conversations"):
        assemble(conversation("a", [("x", None, "y")]) + conversation("b", [("x", None, "y")]))
    assert set(RULES) and set(SKIP_REASONS)


def _rows(records: list[dict], cid: str | None = None) -> list[dict]:
    """``clarifier label select``'s reading of one conversation's request-log records (a Ray groupby group)."""
    import json

    import pyarrow as pa

    from clarifier.core.config import AuditConfig
    from clarifier.data.audit_stages import request_log_turn_rows

    group = pa.Table.from_pylist([{"conversation_id": r.get("conversation_id", "") if cid is None else cid,
                                   "record_json": json.dumps(r), "source": "log/part-0.jsonl", "line": i + 1}
                                  for i, r in enumerate(records)])
    return request_log_turn_rows(group, audit=AuditConfig().model_dump(), labelling=RULES_CFG.model_dump(),
                                 min_overlap=0.5).to_pylist()


def test_label_select_reads_each_turn_of_a_request_log_once_with_its_prelabel():
    import json

    recs = conversation("c1", [("how do I reset it?", "The router or the modem?", "The router or the modem?"),
                               ("the modem", None, "Hold the reset button for 10 seconds."),
                               ("and its firmware?", None, "Open the admin page.")])
    random.Random(1).shuffle(recs)
    rows = _rows(recs)
    turns = [r for r in rows if r["kind"] == "turn"]
    assert [r["id"] for r in turns] == ["c1:0", "c1:2", "c1:4"]  # three requests repeat turn 0: read once
    pre = {r["id"]: json.loads(r["turn_json"])["meta"].get("prelabel") for r in turns}
    assert pre["c1:0"]["needs_clarification"] is True and pre["c1:0"]["rule"] == "served_question_answered"
    assert pre["c1:0"]["question"] == "The router or the modem?" and pre["c1:0"]["why"] == RULES[pre["c1:0"]["rule"]]
    assert pre["c1:2"] == {"needs_clarification": False, "rule": "served_silent_continued",
                           "why": RULES["served_silent_continued"]}
    assert pre["c1:4"] is None  # nothing followed: no pre-label, still a turn to label
    assert all(r["gold"] is None for r in turns)  # a pre-label is not a label: the turn stays eligible
    counts = [r for r in rows if r["kind"] == "file"]
    assert len(counts) == 1 and counts[0]["n_lines"] == 3 and counts[0]["n_turns"] == 3

    omitted = conversation("c2", [("reset it", None, "Press reset."), ("thanks", None, "Bye.")])
    omitted[1]["turns"] = omitted[1]["turns"][-1:]  # serve.request_log.omit: [history]
    omitted[1]["meta"]["request_log"]["history_omitted"] = True
    ids = [r["id"] for r in _rows(omitted[1:]) if r["kind"] == "turn"]
    assert ids == ["c2:2"]  # named by its index in the conversation, as the data job's labels name it

    other = _rows([{"messages": [{"role": "user", "content": "hi"}]}], cid="")
    assert [r["kind"] for r in other] == ["quarantine", "file"] and "not a request-log record" in other[0]["reason"]


def test_a_request_log_is_told_from_chat_logs_by_its_first_record(tmp_path):
    import gzip
    import json

    import pyarrow.fs as pafs

    from clarifier.data.audit_stages import first_record_is_request_log

    fs = pafs.LocalFileSystem()
    log = tmp_path / "requests.jsonl.gz"
    log.write_bytes(gzip.compress(("\n" + json.dumps(conversation("c1", [("x", None, "y")])[0]) + "\n").encode()))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert first_record_is_request_log(fs, [str(log)]) and not first_record_is_request_log(fs, [str(chat)])
    assert not first_record_is_request_log(fs, [str(tmp_path / "x.parquet")])
