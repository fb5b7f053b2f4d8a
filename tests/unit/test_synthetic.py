import json
from collections import defaultdict
from pathlib import Path

import pytest

from clarifier.data.synthetic import KINDS, generate_conversations, write_logs
from clarifier.core.schema import ConversationLog


@pytest.fixture(scope="module")
def convs():
    return generate_conversations(300, seed=11)


@pytest.fixture(scope="module")
def examples(convs):
    return [e for c in convs for e in ConversationLog.model_validate(c).explode()]


def test_deterministic_for_a_seed():
    assert generate_conversations(40, seed=5) == generate_conversations(40, seed=5)
    assert generate_conversations(40, seed=5)[:10] == generate_conversations(10, seed=5)
    assert generate_conversations(40, seed=5) != generate_conversations(40, seed=6)


def test_all_validate_and_are_json(convs):
    for c in convs:
        assert json.loads(json.dumps(c)) == c
        exs = ConversationLog.model_validate(c).explode()
        assert 1 <= len(exs) <= 3
        # the last turn is always the labelled decision point
        assert exs[-1].meta["turn_index"] == len(c["turns"]) - 1


def test_unique_ids_and_several_domains(convs):
    assert len({c["conversation_id"] for c in convs}) == len(convs)
    assert len({c["domain"] for c in convs}) >= 4
    assert {c["meta"]["kind"] for c in convs} == set(KINDS)


def test_clarify_share_is_balanced(examples):
    share = sum(e.needs_clarification for e in examples) / len(examples)
    assert 0.30 <= share <= 0.60, share


def test_same_query_text_occurs_with_both_labels(examples):
    labels = defaultdict(set)
    for e in examples:
        labels[e.query.strip().lower()].add(e.needs_clarification)
    both = [q for q, v in labels.items() if len(v) == 2]
    assert len(both) >= 10, both


def test_grounding_points_into_history_at_candidate_turns(examples):
    clar = [e for e in examples if e.needs_clarification]
    assert clar
    for e in clar:
        assert e.grounding_turns
        assert all(0 <= i < len(e.history) for i in e.grounding_turns)
        assert e.clarifying_question and e.clarifying_question.endswith("?")
        # every candidate is named in the question and introduced in a grounded turn
        for name in e.meta["candidates"]:
            assert name in e.clarifying_question
            assert any(name in e.history[i].text for i in e.grounding_turns), (e.id, name)
        ids = {p.id for p in e.passages}
        assert set(e.grounding_passages) <= ids
    assert any(e.grounding_passages for e in clar)
    assert any(e.history[e.grounding_turns[0]].role == "assistant" for e in clar)


def test_clear_turns_have_no_question(examples):
    for e in examples:
        if not e.needs_clarification:
            assert e.clarifying_question is None


def test_questions_vary(examples):
    templates = {e.clarifying_question.split(" the ")[0] for e in examples if e.needs_clarification}
    assert len(templates) >= 4


def test_write_logs(tmp_path: Path):
    uris = write_logs(str(tmp_path / "logs"), n=10, seed=2, shards=3)
    assert len(uris) == 3
    lines = [json.loads(line) for u in uris for line in Path(u).read_text().splitlines()]
    assert sorted(c["conversation_id"] for c in lines) == sorted(c["conversation_id"] for c in generate_conversations(10, 2))
