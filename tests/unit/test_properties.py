"""Property-based tests (hypothesis): parsers and the config loader only raise their documented errors.

- ``parse_line`` never raises: any bytes become examples or one quarantine record with a reason.
- ``parse_target`` raises only ``TargetParseError``; every valid target round-trips (a rendered
  question that is not servable -- target syntax in it, too short -- is reported, not passed on).
- ``build_config`` / ``apply_override`` raise only ``ConfigError``.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clarifier.core.config import ConfigError, build_config
from clarifier.data.validate import parse_line
from clarifier.core.schema import Example
from clarifier.core.target import (
    JointTarget,
    TargetParseError,
    parse_target,
    question_problem,
    render_target,
    try_parse_target,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=5),
    max_leaves=20,
)
roles = st.sampled_from(["user", "assistant", "system", "bot", "", 3])
turns = st.lists(st.fixed_dictionaries({"role": roles, "text": st.text(max_size=40) | st.integers()}), max_size=5)
# Records shaped like the two input formats, with every field possibly wrong.
record_like = st.fixed_dictionaries(
    {},
    optional={
        "id": st.text(max_size=10) | st.integers(),
        "query": st.text(max_size=40) | st.none() | st.integers(),
        "history": turns | json_values,
        "needs_clarification": st.booleans() | json_scalars,
        "clarifying_question": st.text(max_size=40) | st.none(),
        "grounding_turns": st.lists(st.integers(-3, 8), max_size=4) | json_values,
        "passages": st.lists(st.fixed_dictionaries({"id": st.text(max_size=5), "text": st.text(max_size=20)}), max_size=3),
        "turns": st.lists(st.fixed_dictionaries(
            {"role": roles, "text": st.text(max_size=40)},
            optional={"label": st.fixed_dictionaries({"needs_clarification": json_scalars},
                                                     optional={"clarifying_question": st.text(max_size=20),
                                                               "grounding_turns": st.lists(st.integers(-2, 6), max_size=3)})}),
            max_size=5),
        "conversation_id": st.text(max_size=8) | st.integers(),
    },
)


def _check_parse_result(examples, q):
    if q is None:
        assert examples and all(isinstance(e, Example) for e in examples)
    else:
        assert examples == []
        assert set(q) == {"source", "line", "reason", "raw"}
        assert isinstance(q["reason"], str) and q["reason"] and q["line"] == 7 and q["source"] == "src.jsonl"


@SETTINGS
@given(st.binary(max_size=300))
def test_parse_line_never_raises_on_bytes(raw):
    _check_parse_result(*parse_line(raw, "src.jsonl", 7))


@SETTINGS
@given(json_values)
def test_parse_line_never_raises_on_any_json(value):
    _check_parse_result(*parse_line(json.dumps(value), "src.jsonl", 7))


@SETTINGS
@given(record_like)
def test_parse_line_on_record_shaped_input(rec):
    examples, q = parse_line(json.dumps(rec), "src.jsonl", 7, max_turn_chars=30)
    _check_parse_result(examples, q)
    for e in examples:  # whatever is accepted satisfies the contract
        assert e.query.strip()
        assert all(0 <= i < len(e.history) for i in e.grounding_turns)
        assert (e.clarifying_question is not None) == e.needs_clarification


@SETTINGS
@given(st.text(max_size=200))
def test_parse_target_raises_only_its_error(text):
    try:
        t = parse_target(text, history_len=3, passage_ids=["p1"])
    except TargetParseError as exc:
        assert str(exc)
        assert try_parse_target(text, history_len=3, passage_ids=["p1"])[0] is None
    else:
        assert isinstance(t, JointTarget)
        assert all(0 <= i < 3 for i in t.grounding_turns) and set(t.grounding_passages) <= {"p1"}


question_text = st.text(st.characters(blacklist_categories=["Cs", "Cc", "Zl", "Zp"]), min_size=1, max_size=60).filter(
    lambda s: s.strip())


@SETTINGS
@given(
    clarify=st.booleans(),
    question=question_text,
    turns_=st.lists(st.integers(0, 20), max_size=4, unique=True),
    passages=st.lists(st.from_regex(r"[A-Za-z0-9_\-:.]{1,8}", fullmatch=True), max_size=3, unique=True),
)
def test_render_then_parse_round_trips(clarify, question, turns_, passages):
    t = JointTarget(clarify, question if clarify else None,
                    tuple(sorted(turns_)) if clarify else (), tuple(passages) if clarify else ())
    try:
        text = render_target(t)
    except ValueError:  # e.g. a question that collapses to nothing on one line
        return
    if clarify and question_problem(" ".join(question.split())):
        with pytest.raises(TargetParseError, match="question"):
            parse_target(text)
        return
    back = parse_target(text)
    assert back.needs_clarification == clarify
    if clarify:
        assert set(back.grounding_turns) == set(t.grounding_turns)
        assert list(back.grounding_passages) == list(t.grounding_passages)
        assert back.question and back.question.strip()


keys = st.sampled_from(["train.max_steps", "train.learning_rate", "model.lora.r", "data.split", "serve.port",
                        "eval.threshold", "train", "nope.key", "train.nope", "model..r", "", "data.packing.enabled",
                        "train.loss_weights.decision", "registry.model_name"])
values = st.text(max_size=20) | st.sampled_from(["-1", "0", "1e9", "[1,2]", "{a: 1}", "true", "null", ":", "{"])


@SETTINGS
@given(st.lists(st.tuples(keys, values), max_size=4), st.booleans())
def test_config_overrides_raise_only_config_error(pairs, with_equals):
    overrides = [f"{k}={v}" if with_equals else f"{k}{v}" for k, v in pairs]
    try:
        build_config({}, overrides)
    except ConfigError as exc:
        assert str(exc)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["train", "data", "model", "serve", "x"]), json_values, max_size=3))
def test_config_documents_raise_only_config_error(doc):
    try:
        build_config(doc)
    except ConfigError as exc:
        assert "invalid config" in str(exc)


def test_a_known_bad_override_names_the_key():
    with pytest.raises(ConfigError, match="train.max_steps"):
        build_config({}, ["train.max_steps=-3"])
