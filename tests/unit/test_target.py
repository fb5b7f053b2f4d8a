import pytest

from clarifier.core.target import (
    JointTarget,
    TargetParseError,
    parse_target,
    question_problem,
    render_segments,
    render_target,
    try_parse_target,
)


@pytest.mark.parametrize("t", [
    JointTarget(False),
    JointTarget(True, "Do you mean the router or the modem?", (0, 2), ()),
    JointTarget(True, "Which card?", (), ("p1", "doc-7")),
    JointTarget(True, "Which one?", (), ()),
])
def test_round_trip(t):
    assert parse_target(render_target(t)) == t


def test_fixed_order_decision_grounding_question():
    text = render_target(JointTarget(True, "Which one?", (1,), ("p1",)))
    assert text.splitlines() == ["decision: clarify", "grounding: turns=1 passages=p1", "question: Which one?"]
    assert [s for s, _ in render_segments(JointTarget(True, "Q?", (0,)))] == ["format", "decision", "grounding", "question"]
    assert render_target(JointTarget(False)) == "decision: answer"


def test_question_is_one_line():
    t = JointTarget(True, "Which\n one  do you\tmean?", (0,))
    assert parse_target(render_target(t)).question == "Which one do you mean?"


def test_render_rejects_empty_question_and_bad_passage_ids():
    with pytest.raises(ValueError):
        render_target(JointTarget(True, "  "))
    with pytest.raises(ValueError):
        render_target(JointTarget(True, "q?", (), ("a b",)))


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"),
    ("maybe", "line 1"),
    ("decision: perhaps", "unknown decision"),
    ("decision: answer\nquestion: why?", "after 'decision: answer'"),
    ("decision: clarify", "grounding line"),
    ("decision: clarify\nquestion: which?\ngrounding: turns=none passages=none", "line 2"),
    ("decision: clarify\ngrounding: turns=a,b passages=none\nquestion: x?", "turn indexes"),
    ("decision: clarify\ngrounding: turns=0,,1 passages=none\nquestion: x?", "empty item"),
    ("decision: clarify\ngrounding: turns=0 passages=none\nwhich one?", "line 3"),
    ("decision: clarify\ngrounding: turns=0 passages=none\nquestion: x?\nmore", "unexpected text"),
])
def test_malformed_output_is_reported_not_guessed(text, fragment):
    with pytest.raises(TargetParseError, match=fragment.replace("(", r"\(").replace("'", "'")):
        parse_target(text)
    target, err = try_parse_target(text)
    assert target is None and fragment.split()[0].strip("'") in err


def test_grounding_checked_against_request():
    text = "decision: clarify\ngrounding: turns=0,5 passages=p9\nquestion: which?"
    with pytest.raises(TargetParseError, match="do not exist"):
        parse_target(text, history_len=3)
    with pytest.raises(TargetParseError, match="not among"):
        parse_target(text, history_len=6, passage_ids=["p1"])
    assert parse_target(text, history_len=6, passage_ids=["p9"]).grounding_turns == (0, 5)


@pytest.mark.parametrize("question, fragment", [
    ("are you asking about the user?||none", "'|'"),
    ("which one? turns=0,1", "'turns='"),
    ("which PASSAGES=p1", "'passages='"),
    ("Decision: clarify", "'decision:'"),
    ("x grounding: y", "'grounding:'"),
    ("question: which?", "'question:'"),
    ("a?", "2 non-space characters"),
])
def test_a_question_with_target_syntax_or_too_short_is_malformed(question, fragment):
    text = f"decision: clarify\ngrounding: turns=0 passages=none\nquestion: {question}"
    target, err = try_parse_target(text)
    assert target is None and fragment in err
    assert question_problem(question) == err


def test_a_plain_question_passes_the_hygiene_check():
    assert question_problem("Do you mean the router, or: the modem (x = y)?") is None
    assert parse_target("decision: clarify\ngrounding: turns=0 passages=none\nquestion: Why?").question == "Why?"
