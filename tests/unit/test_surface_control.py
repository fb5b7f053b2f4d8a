"""The surface control (clarifier.core.surface): position and length features only, fitted per source where it can,
cross-fitted by conversation, and the model's skill stated as its margin over it."""

from __future__ import annotations

import math
import random

import pytest

from clarifier.core.schema import Example
from clarifier.core.surface import (FEATURES, cross_fitted_scores, fit_surface_control, skill_over_control,
                                    surface_features)
from clarifier.core.metrics import auroc


def ex(i: int, history: int, query: str, passages: int = 0, source: str = "s", conv: str | None = None) -> Example:
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "text": "word " * (k + 1)} for k in range(history)]
    return Example(id=f"e{i}", history=turns, query=query, needs_clarification=False,
                   passages=[{"id": f"p{k}", "text": "x" * 50} for k in range(passages)],
                   meta={"source": source, "conversation_id": conv or f"c{i}"})


def test_features_are_position_length_and_punctuation_only():
    e = ex(0, history=3, query="how do I reset it?", passages=2)
    f = dict(zip(FEATURES, surface_features(e)))
    assert f["user_turn_index"] == pytest.approx(math.log1p(2))  # turns 0 and 2 are the user's
    assert f["history_turns"] == pytest.approx(math.log1p(3))
    assert f["query_words"] == pytest.approx(math.log1p(5))
    assert f["passages"] == pytest.approx(math.log1p(2)) and f["passage_chars"] == pytest.approx(math.log1p(100))
    assert f["query_ends_with_question_mark"] == 1.0
    # the words themselves carry nothing: same lengths, other words, same features
    assert surface_features(ex(1, 3, "how do I ping it?", 2)) == surface_features(ex(2, 3, "how do I book it?", 2))
    assert surface_features({"history": [], "query": "hi", "passages": []})[1] == 0.0


def planted(n: int, seed: int, source: str = "s", early_asks: bool = True):
    """Turns whose label follows their position (early turns need a question) plus noise."""
    rng = random.Random(seed)
    exs, gold = [], []
    for i in range(n):
        h = rng.randrange(0, 12)
        y = (h < 4) if early_asks else (h >= 8)
        if rng.random() < 0.15:
            y = not y
        exs.append(ex(i, h, "what about the other one" if rng.random() < 0.5 else "and the price?", source=source))
        gold.append(y)
    return exs, gold


def test_the_control_ranks_turns_whose_label_follows_their_position():
    train, gt = planted(300, 0)
    test, gs = planted(200, 1)
    ctl = fit_surface_control(train, gt)
    assert auroc(gs, ctl.scores(test)) > 0.8


def test_a_source_gets_a_fit_of_its_own_where_it_has_the_turns():
    a, ga = planted(200, 0, "a", early_asks=True)
    b, gb = planted(200, 1, "b", early_asks=False)  # the opposite rule: a pooled fit cannot serve both
    ctl = fit_surface_control(a + b, ga + gb, ["a"] * 200 + ["b"] * 200)
    assert set(ctl.by_source) == {"a", "b"}
    ta, tga = planted(150, 2, "a", True)
    tb, tgb = planted(150, 3, "b", False)
    sc = ctl.scores(ta + tb, ["a"] * 150 + ["b"] * 150)
    assert auroc(tga, sc[:150]) > 0.8 and auroc(tgb, sc[150:]) > 0.8
    few = fit_surface_control(a[:15] + b, ga[:15] + gb, ["a"] * 15 + ["b"] * 200)
    assert set(few.by_source) == {"b"}  # too few turns of a class in "a": the pooled fit scores them


def test_cross_fitted_scores_never_score_a_turn_with_a_fit_that_saw_its_conversation():
    exs, gold = planted(120, 4)
    convs = [f"c{i // 3}" for i in range(120)]  # three turns per conversation
    sc = cross_fitted_scores(exs, gold, groups=convs, folds=4)
    assert len(sc) == 120 and auroc(gold, sc) > 0.75
    assert cross_fitted_scores(exs[:3], [True, True, True]) == [1.0, 1.0, 1.0]  # one class: its share


def test_skill_is_the_margin_over_the_control_and_the_verdict_says_when_there_is_none():
    exs, gold = planted(400, 5)
    sources = ["s" if i % 2 else "t" for i in range(400)]
    control = fit_surface_control(*planted(400, 6)).scores(exs)
    rng = random.Random(0)
    strong = [(1.0 if g else 0.0) + rng.gauss(0, 0.3) for g in gold]  # knows the label well beyond position
    s = skill_over_control(gold, strong, control, sources, n_resamples=200)
    assert s["headline"] == "within_source" and s["beats_control"]
    assert s["within_source"]["skill"] == pytest.approx(s["within_source"]["model_auroc"] - s["within_source"]["control_auroc"])
    assert s["verdict"].startswith("the model beats its surface control")
    echo = [c + rng.gauss(0, 0.01) for c in control]  # position and length again, nothing more
    s = skill_over_control(gold, echo, control, sources, n_resamples=200, model="clarifier")
    assert not s["beats_control"] and "does NOT beat its surface control" in s["verdict"]
    assert s["verdict"].startswith("clarifier")


def test_an_evaluation_set_alone_gets_a_cross_fitted_control_and_the_report_leads_with_the_margin(tmp_path):
    import json

    from clarifier.core.config import ClarifierConfig
    from clarifier.evaluation.evaluate import surface_control_row, surface_skill
    from clarifier.evaluation.report import write_report

    exs, gold = planted(160, 7)
    exs = [e.model_copy(update={"needs_clarification": g, "decision_only": g}) for e, g in zip(exs, gold)]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(e.model_dump(mode="json")) + "\n" for e in exs))
    said = []
    preds, info = surface_control_row(ClarifierConfig(), str(path), exs, said.append)
    assert "out of fold" in info["fitted_on"] and any("surface control" in s for s in said)
    scores = [p.confidence for p in preds]
    assert auroc(gold, scores) > 0.75  # position alone ranks these turns
    assert all(p.needs_clarification == (p.confidence >= info["threshold"]) for p in preds)
    skill = surface_skill(exs, scores, scores)  # a "model" that is the control again has no skill
    assert skill["headline"] == "mixed" and skill["mixed"]["skill"] == 0 and not skill["beats_control"]
    report = {"models": {"model": {"metrics": {}, "scores": scores, "gold": gold},
                         "surface_control": {"metrics": {}, "scores": scores, "gold": gold}}, "skill": skill}
    md = (tmp_path / "out").joinpath("report.md")
    write_report(report, tmp_path / "out")
    text = md.read_text()
    assert text.index("## Skill over the surface control") < text.index("| Model |")  # the headline comes first
    assert "does NOT beat its surface control" in text and "+0.000" in text
