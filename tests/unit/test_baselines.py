"""The model-free baselines, in particular the lexical heuristic (clarifier.evaluation.baselines)."""

from __future__ import annotations

import pytest

from clarifier.evaluation.baselines import baseline_predictions, candidate_entities, lexical_decision, lexical_predictions
from clarifier.core.metrics import evaluate_predictions
from clarifier.core.schema import Example, Turn


def _h(*texts, roles=None):
    roles = roles or ["user" if i % 2 == 0 else "assistant" for i in range(len(texts))]
    return [Turn(role=r, text=t) for r, t in zip(roles, texts)]


ROUTER_MODEM = _h("My router keeps dropping Wi-Fi and I also have a cable modem.", "Both can cause that.")


def test_candidates_are_introduced_noun_phrases_with_their_turns():
    hist = _h("I have a student checking account and a savings account.", "Sure.",
              "Also my car loan.", "I can see the checking account on your profile.")
    cands = candidate_entities(hist)
    assert [c.key for c in cands] == ["checking account", "savings account", "car loan"]
    assert cands[0].turns == (0, 3)  # the later definite mention adds a grounding turn
    assert cands[2].turns == (2,)


def test_same_head_merges_unless_both_modified_differently():
    hist = _h("I booked a Saturday ferry to Tangier.", "The ferry is confirmed.", "I also have a ferry.")
    assert [c.key for c in candidate_entities(hist)] == ["saturday ferry"]


def test_generic_nouns_and_system_turns_are_not_candidates():
    hist = _h("You are a bank assistant with a savings account.", "I have a question about my daughter.",
              roles=["system", "user"])
    assert candidate_entities(hist) == []


def test_pronoun_with_two_candidates_clarifies_with_template_and_grounding():
    d = lexical_decision(ROUTER_MODEM, "How do I reset it?")
    assert d.clarify and d.reason == "ambiguous_reference" and d.confidence >= 0.5
    assert d.candidates == ("router", "cable modem")
    assert d.question == "Do you mean the router or the cable modem?"
    assert d.grounding_turns == (0,)


def test_three_candidates_question_lists_all():
    hist = _h("I have a laptop.", "ok", "And a printer.", "ok", "And my smart speaker.", "ok")
    d = lexical_decision(hist, "it broke")
    assert d.clarify
    assert d.question == "Do you mean the laptop, the printer or the smart speaker?"
    assert d.grounding_turns == (0, 2, 4)


def test_query_naming_a_candidate_is_resolved():
    d = lexical_decision(ROUTER_MODEM, "How do I reset the modem?")
    assert not d.clarify and d.reason == "resolved" and d.confidence < 0.5
    # same head, two modifiers: naming the head alone is not enough, with the modifier it is
    hist = _h("I have a checking account and a savings account.", "Sure.")
    assert lexical_decision(hist, "what's the fee on the account?").clarify is False  # long, no pronoun
    assert lexical_decision(hist, "close the account?").clarify is True  # short, ambiguous head
    assert lexical_decision(hist, "close the savings account?").clarify is False


def test_single_candidate_answers():
    d = lexical_decision(_h("My Garmin smartwatch is slow.", "Try a restart."), "Is it under warranty?")
    assert not d.clarify and d.reason == "single_candidate" and d.question is None


def test_short_query_without_context_is_underspecified():
    d = lexical_decision([], "refund?")
    assert d.clarify and d.reason == "underspecified"
    assert d.question == 'Could you tell me more about what you mean by "refund?"?'
    assert d.grounding_turns == ()
    # a long self-contained query is clear
    d = lexical_decision([], "How do I change the PIN of my debit card at an ATM?")
    assert not d.clarify and d.reason == "clear"


def test_short_fragment_with_two_candidates_clarifies_without_pronoun():
    assert lexical_decision(ROUTER_MODEM, "reset??").clarify


def test_confidence_is_at_least_half_exactly_when_clarifying():
    cases = [(ROUTER_MODEM, "how do I reset it?"), (ROUTER_MODEM, "reset the router please, how?"),
             ([], "help"), ([], "what is the weather like in Paris today?"),
             (_h("I have a Dell laptop."), "is it broken?")]
    for hist, q in cases:
        d = lexical_decision(hist, q)
        assert (d.confidence >= 0.5) == d.clarify, (q, d)


def test_lexical_predictions_and_metrics_on_a_small_set():
    ex = [
        Example(id="a", history=ROUTER_MODEM, query="how do I reset it?", needs_clarification=True,
                clarifying_question="Do you mean the router or the cable modem?", grounding_turns=[0]),
        Example(id="b", history=ROUTER_MODEM, query="how do I reset the modem?", needs_clarification=False),
        Example(id="c", history=_h("I have a Dell laptop.", "ok"), query="is it broken?", needs_clarification=False),
        Example(id="d", history=[], query="refund?", needs_clarification=False),
    ]
    preds = lexical_predictions(ex)
    assert [p.needs_clarification for p in preds] == [True, False, False, True]
    assert preds[0].grounding_turns == (0,) and preds[1].grounding_turns == ()
    m = evaluate_predictions(ex, preds)
    d = m["decision"]
    assert (d["tp"], d["fp"], d["fn"], d["tn"]) == (1, 1, 0, 2)
    assert m["question"]["rougeL_f"] == pytest.approx(1.0)
    assert m["grounding"]["exact_match"] == 1.0
    assert m["auroc"] == pytest.approx(1.0)  # the true positive has the highest confidence


def test_baseline_predictions_by_name():
    ex = [Example(id="x", query="q", needs_clarification=False)] * 3
    assert [p.needs_clarification for p in baseline_predictions("always_ask", ex)] == [True] * 3
    assert [p.confidence for p in baseline_predictions("never_ask", ex)] == [0.0] * 3
    assert len(baseline_predictions("lexical", ex)) == 3
    with pytest.raises(ValueError, match="unknown baseline 'oracle'"):
        baseline_predictions("oracle", ex)


def test_baselines_module_is_pure():
    import subprocess
    import sys

    code = ("import sys, clarifier.evaluation.baselines\n"
            "bad = [m for m in ('ray', 'mlflow', 'torch') if m in sys.modules]\nassert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
