import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from clarifier.core.schema import ClarifyRequest, ConversationLog, Example

SHARED_EXAMPLE = {
    "id": "abc-1",
    "history": [{"role": "user", "text": "..."}, {"role": "assistant", "text": "..."}],
    "query": "the user's latest message",
    "needs_clarification": True,
    "clarifying_question": "Which of the two contracts do you mean?",
    "grounding_turns": [0, 1],
    "passages": [{"id": "p1", "text": "..."}],
    "meta": {},
}


def test_accepts_the_shared_evaluation_format_and_ignores_unknown_keys():
    ex = Example.model_validate({**SHARED_EXAMPLE, "extra_key": 1})
    assert ex.grounding_turns == [0, 1] and ex.passages[0].id == "p1"
    minimal = Example.model_validate({"id": "x", "history": [], "query": "q", "needs_clarification": False,
                                      "clarifying_question": None, "grounding_turns": []})
    assert minimal.passages == [] and minimal.meta == {}


def test_shared_readme_example_parses():
    readme = Path(__file__).resolve().parents[3] / "shared" / "README.md"
    if not readme.is_file():
        pytest.skip("../shared not present")
    block = readme.read_text().split("```json", 1)[1].split("```", 1)[0]
    assert Example.model_validate(json.loads(block)).needs_clarification is True


@pytest.mark.parametrize("patch,fragment", [
    ({"query": "   "}, "query is empty"),
    ({"grounding_turns": [0, 7]}, "outside history"),
    ({"clarifying_question": None}, "clarifying_question is empty"),
    ({"history": [{"role": "bot", "text": "x"}]}, "role"),
    ({"needs_clarification": "maybe"}, "needs_clarification"),
    ({"decision_only": True, "needs_clarification": False, "clarifying_question": None}, "decision_only is for positives"),
    ({"decision_only": True}, "no clarifying_question or grounding"),
])
def test_invalid_examples_name_the_problem(patch, fragment):
    with pytest.raises(ValidationError, match=fragment):
        Example.model_validate({**SHARED_EXAMPLE, **patch})


def test_conversation_log_explodes_labelled_user_turns():
    log = ConversationLog.model_validate({
        "conversation_id": "c1", "domain": "devices",
        "turns": [
            {"role": "user", "text": "I have a router and a modem.", "label": {"needs_clarification": False}},
            {"role": "assistant", "text": "OK."},
            {"role": "user", "text": "How do I reset it?",
             "label": {"needs_clarification": True, "clarifying_question": "The router or the modem?",
                       "grounding_turns": [0]}},
        ]})
    exs = log.explode()
    assert [e.id for e in exs] == ["c1:0", "c1:2"]
    assert exs[0].history == [] and len(exs[1].history) == 2
    assert exs[1].conversation_id == "c1" and exs[1].meta["domain"] == "devices"


def test_conversation_log_turn_passages_and_meta_override_the_conversations():
    """RAG logs: each user turn carries what retrieval returned for it; absent = the conversation's."""
    log = ConversationLog.model_validate({
        "conversation_id": "c2", "passages": [{"id": "p1", "text": "shared"}], "meta": {"source": "s", "kind": "log"},
        "turns": [
            {"role": "user", "text": "what's the limit?", "passages": [{"id": "p1", "text": "ATM limit"}, {"id": "p2", "text": "credit limit"}],
             "meta": {"kind": "rag_ambiguous"},
             "label": {"needs_clarification": True, "clarifying_question": "ATM or credit?", "grounding_passages": ["p1", "p2"]}},
            {"role": "assistant", "text": "ATM or credit?"},
            {"role": "user", "text": "credit", "label": {"needs_clarification": False}},
            {"role": "assistant", "text": "It's 5,000."},
            {"role": "user", "text": "thanks", "passages": [], "label": {"needs_clarification": False}},
        ]})
    a, b, c = log.explode()
    assert [p.text for p in a.passages] == ["ATM limit", "credit limit"] and a.grounding_passages == ["p1", "p2"]
    assert a.meta == {"source": "s", "kind": "rag_ambiguous", "conversation_id": "c2", "turn_index": 0}
    assert [p.text for p in b.passages] == ["shared"] and b.meta["kind"] == "log"
    assert c.passages == []  # an empty list is "retrieval returned nothing", not "absent"
    bad = {"conversation_id": "c3", "turns": [{"role": "user", "text": "q"},
                                               {"role": "assistant", "text": "a", "passages": [{"id": "p", "text": "t"}]}]}
    with pytest.raises(ValidationError, match=r"turns\[1\]: only user turns can carry passages"):
        ConversationLog.model_validate(bad)
    wrong = {"conversation_id": "c4", "turns": [{"role": "user", "text": "q", "passages": [{"id": "p1", "text": "t"}],
                                                  "label": {"needs_clarification": True, "clarifying_question": "?",
                                                            "grounding_passages": ["p9"]}}]}
    with pytest.raises(ValueError, match=r"turn 0: .*p9"):
        ConversationLog.model_validate(wrong).explode()


def test_conversation_log_bad_label_names_the_turn():
    log = ConversationLog.model_validate({
        "conversation_id": "c1",
        "turns": [{"role": "user", "text": "hi"},
                  {"role": "user", "text": "reset it", "label": {"needs_clarification": True,
                                                                 "clarifying_question": "which?",
                                                                 "grounding_turns": [4]}}]})
    with pytest.raises(ValueError, match="turn 1"):
        log.explode()


def test_clarify_request_rejects_unknown_fields_and_blank_query():
    with pytest.raises(ValidationError):
        ClarifyRequest.model_validate({"query": "x", "histroy": []})
    with pytest.raises(ValidationError, match="query"):
        ClarifyRequest.model_validate({"query": "  "})


def test_a_decision_only_positive_needs_no_question():
    ex = Example.model_validate({**SHARED_EXAMPLE, "decision_only": True, "clarifying_question": None,
                                 "grounding_turns": [], "grounding_passages": []})
    assert ex.needs_clarification and ex.decision_only and ex.clarifying_question is None
    assert Example.model_validate(SHARED_EXAMPLE).decision_only is False
