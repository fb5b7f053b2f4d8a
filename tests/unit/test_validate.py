import json
import re
from pathlib import Path

import pytest

from clarifier.core.schema import Example, Passage, Turn
from clarifier.data.stages import dedup_key
from clarifier.data.synthetic import generate_conversations
from clarifier.data.validate import RAW_LIMIT, parse_line

SHARED_README = Path(__file__).resolve().parents[2].parent / "shared" / "README.md"

GOOD_EXAMPLE = {
    "id": "abc-1",
    "history": [{"role": "user", "text": "I have two contracts."}, {"role": "assistant", "text": "Which one?"}],
    "query": "cancel it",
    "needs_clarification": True,
    "clarifying_question": "Which of the two contracts do you mean?",
    "grounding_turns": [0, 1],
    "passages": [{"id": "p1", "text": "Contracts can be cancelled monthly."}],
    "meta": {},
}


def bad(line, **kw):
    examples, q = parse_line(line, "logs/a.jsonl", 7, **kw)
    assert examples == [] and q is not None
    assert q["source"] == "logs/a.jsonl" and q["line"] == 7 and isinstance(q["raw"], str)
    return q["reason"]


def with_(**changes):
    d = json.loads(json.dumps(GOOD_EXAMPLE))
    for k, v in changes.items():
        if v is ...:
            d.pop(k)
        else:
            d[k] = v
    return json.dumps(d)


def test_eval_set_example_accepted():
    examples, q = parse_line(json.dumps(GOOD_EXAMPLE), "x", 1)
    assert q is None and len(examples) == 1
    ex = examples[0]
    assert ex.id == "abc-1" and ex.grounding_turns == [0, 1] and ex.conversation_id == "abc-1"


def test_bytes_and_unknown_keys_accepted():
    line = with_(extra_field={"anything": 1}).encode() + b"\r\n"
    examples, q = parse_line(line, "x", 1)
    assert q is None and examples[0].query == "cancel it"


def test_shared_readme_format_example_accepted():
    if not SHARED_README.is_file():
        pytest.skip("../shared/README.md not present")
    block = re.search(r"```json\n(.*?)```", SHARED_README.read_text(), re.S)
    assert block, "no json block in ../shared/README.md"
    record = json.loads(block.group(1))
    examples, q = parse_line(json.dumps(record), "README.md", 1)
    assert q is None, q
    assert examples[0].needs_clarification is True


def test_conversation_log_gives_one_example_per_labelled_turn():
    conv = generate_conversations(30, seed=4)
    for c in conv:
        examples, q = parse_line(json.dumps(c), "x", 1)
        assert q is None
        assert len(examples) == sum(1 for t in c["turns"] if "label" in t)
        assert all(e.conversation_id == c["conversation_id"] for e in examples)


def test_invalid_utf8():
    reason = bad(b'{"id": "a", "query": "caf\xe9"}')
    assert "invalid UTF-8" in reason


def test_bad_json():
    assert bad('{"id": "a", "query": ').startswith("bad JSON")
    assert bad("not json").startswith("bad JSON")


def test_not_an_object():
    assert "not a JSON object" in bad("[1, 2]")
    assert "not a JSON object" in bad('"just a string"')


def test_neither_example_nor_log():
    assert "neither 'query'" in bad('{"foo": 1}')


def test_missing_query():
    reason = bad(with_(query=...))
    assert reason.startswith("query") and "required" in reason.lower()


def test_empty_query():
    assert "query" in bad(with_(query="   "))
    assert "empty" in bad(with_(query="   "))


def test_wrong_types():
    assert bad(with_(needs_clarification="maybe")).startswith("needs_clarification")
    assert bad(with_(history="hello")).startswith("history")
    assert bad(with_(grounding_turns=["x"])).startswith("grounding_turns")


def test_clarify_without_question():
    assert "clarifying_question" in bad(with_(clarifying_question=None))


def test_grounding_out_of_range():
    assert "grounding_turns" in bad(with_(grounding_turns=[5]))


def test_unknown_role():
    reason = bad(with_(history=[{"role": "bot", "text": "hi"}], grounding_turns=[0]))
    assert reason == "history[0].role 'bot' is not one of user/assistant/system"
    log = {"conversation_id": "c", "turns": [{"role": "agent", "text": "hi"},
                                              {"role": "user", "text": "q", "label": {"needs_clarification": False}}]}
    assert bad(json.dumps(log)).startswith("turns[0].role 'agent'")


def test_oversized_turn():
    reason = bad(with_(history=[{"role": "user", "text": "x" * 501}, {"role": "assistant", "text": "ok"}]), max_turn_chars=500)
    assert reason == "history[0].text has 501 chars (> max_turn_chars=500)"
    assert "query has" in bad(with_(query="y" * 600), max_turn_chars=500)
    log = {"conversation_id": "c", "turns": [{"role": "user", "text": "z" * 600, "label": {"needs_clarification": False}}]}
    assert bad(json.dumps(log), max_turn_chars=500).startswith("turns[0].text has 600 chars")


def test_default_turn_limit_from_config():
    from clarifier.core.config import DataConfig

    limit = DataConfig().max_turn_chars
    assert parse_line(with_(query="q" * limit), "x", 1)[1] is None
    assert "max_turn_chars" in bad(with_(query="q" * (limit + 1)))


def test_conversation_log_problems():
    assert "no turns" in bad('{"conversation_id": "x", "turns": []}')
    assert "no labelled user turns" in bad('{"conversation_id": "x", "turns": [{"role": "user", "text": "hi"}]}')
    label_on_assistant = {"conversation_id": "x", "turns": [
        {"role": "user", "text": "hi"}, {"role": "assistant", "text": "yo", "label": {"needs_clarification": False}}]}
    assert bad(json.dumps(label_on_assistant)).startswith("turn 1: only user turns")
    missing_id = {"turns": [{"role": "user", "text": "hi", "label": {"needs_clarification": False}}]}
    assert bad(json.dumps(missing_id)).startswith("conversation_id")


def test_empty_line_and_raw_truncation():
    assert bad("   ") == "empty line"
    q = parse_line("[" + "1," * 5000, "x", 3)[1]
    assert q["reason"].startswith("bad JSON") and len(q["raw"]) < RAW_LIMIT + 50


@pytest.mark.parametrize("line", [b"\x00\x01", b"{" * 100000, "\ud800", b"", None, 123])
def test_never_raises(line):
    examples, q = parse_line(line, "x", 1)
    assert examples == [] and q is not None and q["reason"]


def test_passages_are_part_of_the_dedup_identity():
    """The data job drops exact duplicates; the same query after the same history is another input
    when retrieval returned other passages (here: one reading vs two)."""
    h = [Turn(role="user", text="hi")]
    one = Example(id="a", history=h, query="what's the limit?", needs_clarification=False,
                  passages=[Passage(id="p1", text="Debit card limit: $500.")])
    two = Example(id="b", history=h, query="what's the limit?", needs_clarification=True, clarifying_question="Which?",
                  passages=[Passage(id="p1", text="Debit card limit: $500."), Passage(id="p2", text="Credit limit: $5,000.")])
    assert dedup_key(one) != dedup_key(two)
    assert dedup_key(one) == dedup_key(one.model_copy(update={"id": "c"}))
    bare = Example(id="d", history=h, query="what's the limit?", needs_clarification=False)
    assert dedup_key(bare) != dedup_key(one) and dedup_key(bare) == dedup_key(bare.model_copy(update={"id": "e"}))


def test_a_long_real_rag_answer_is_kept_by_default():
    """A public multi-turn RAG benchmark has assistant answers of ~5,000 characters: part of a real
    conversation, not abuse. The default guard is far above them (the renderer truncates by tokens)."""
    rec = with_(history=[{"role": "user", "text": "how do I configure it?"}, {"role": "assistant", "text": "a" * 4990},
                         {"role": "user", "text": "and the other one?"}, {"role": "assistant", "text": "b" * 12000}])
    examples, q = parse_line(rec, "x", 1)
    assert q is None and len(examples[0].history[1].text) == 4990
