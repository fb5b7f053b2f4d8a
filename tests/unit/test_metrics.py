"""Hand-computed checks of clarifier.core.metrics."""

from __future__ import annotations

import pytest

from clarifier.core.metrics import Prediction, auroc, calibration_bins, decision_metrics, evaluate_predictions, expected_calibration_error, grounding_metrics, pick_threshold, question_metrics, threshold_sweep
from clarifier.core.schema import Example, Passage, Turn


# ---- decision --------------------------------------------------------------------------------


def test_decision_metrics_hand_computed():
    gold = [True, True, True, False, False, False, False]
    pred = [True, True, False, True, False, False, False]
    m = decision_metrics(gold, pred)
    assert (m["tp"], m["fp"], m["fn"], m["tn"], m["n"]) == (2, 1, 1, 3, 7)
    assert m["precision"] == pytest.approx(2 / 3)
    assert m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(2 / 3)
    assert m["accuracy"] == pytest.approx(5 / 7)
    assert m["over_asking_rate"] == pytest.approx(1 / 4)
    assert m["under_asking_rate"] == pytest.approx(1 / 3)


def test_decision_metrics_asymmetric_precision_recall():
    m = decision_metrics([True, True, True, True, False], [True, False, False, False, True])
    assert m["precision"] == pytest.approx(0.5)
    assert m["recall"] == pytest.approx(0.25)
    assert m["f1"] == pytest.approx(2 * 0.5 * 0.25 / 0.75)
    assert m["over_asking_rate"] == pytest.approx(1.0)
    assert m["under_asking_rate"] == pytest.approx(0.75)


def test_decision_metrics_zero_over_zero_is_zero():
    # never predicts clarify, no gold clarify: precision, recall, f1, under-asking are 0/0
    m = decision_metrics([False, False], [False, False])
    assert m["precision"] == 0.0 and m["recall"] == 0.0 and m["f1"] == 0.0
    assert m["under_asking_rate"] == 0.0
    assert m["over_asking_rate"] == 0.0
    assert m["accuracy"] == 1.0
    # only gold clarify: over-asking has no clear turns to count
    m = decision_metrics([True, True], [True, False])
    assert m["over_asking_rate"] == 0.0
    assert m["precision"] == 1.0 and m["recall"] == 0.5
    # empty input
    m = decision_metrics([], [])
    assert m["n"] == 0 and m["accuracy"] == 0.0 and m["f1"] == 0.0


def test_decision_metrics_length_mismatch():
    with pytest.raises(ValueError):
        decision_metrics([True], [True, False])


# ---- auroc / calibration ---------------------------------------------------------------------


def test_auroc_hand_computed():
    # pairs (pos, neg): (0.8,0.6) ok, (0.8,0.2) ok, (0.4,0.6) wrong, (0.4,0.2) ok -> 3/4
    assert auroc([True, True, False, False], [0.8, 0.4, 0.6, 0.2]) == pytest.approx(0.75)
    assert auroc([True, False], [0.9, 0.1]) == pytest.approx(1.0)
    assert auroc([True, False], [0.1, 0.9]) == pytest.approx(0.0)


def test_auroc_ties_count_half():
    # (0.5,0.5) tie -> 0.5, (0.5,0.1) -> 1 ; over 2 pairs -> 0.75
    assert auroc([True, False, False], [0.5, 0.5, 0.1]) == pytest.approx(0.75)


def test_auroc_single_class_is_none():
    assert auroc([True, True], [0.1, 0.9]) is None
    assert auroc([False, False, False], [0.1, 0.2, 0.3]) is None
    assert auroc([], []) is None


def test_ece_hand_computed():
    gold = [True, False, True, True]
    scores = [0.95, 0.95, 0.15, 0.05]
    # bin 9: conf 0.95, observed 0.5 -> |0.45| * 2/4 ; bin 1: 0.15 vs 1 -> 0.85 * 1/4 ;
    # bin 0: 0.05 vs 1 -> 0.95 * 1/4
    expected = 0.45 * 0.5 + 0.85 * 0.25 + 0.95 * 0.25
    assert expected_calibration_error(gold, scores) == pytest.approx(expected)
    # bin 1 holds 0.95, 0.95: |0.95 - 0.5| * 2/4 ; bin 0 holds 0.15, 0.05: |0.10 - 1| * 2/4
    assert expected_calibration_error(gold, scores, bins=2) == pytest.approx(0.45 * 0.5 + 0.9 * 0.5)


def test_ece_perfect_and_edges():
    assert expected_calibration_error([True, False], [1.0, 0.0]) == pytest.approx(0.0)
    assert expected_calibration_error([], []) == 0.0
    rows = calibration_bins([True], [1.0], bins=4)
    assert [r["count"] for r in rows] == [0, 0, 0, 1]  # 1.0 falls in the last bin
    assert rows[0]["mean_confidence"] is None
    with pytest.raises(ValueError):
        expected_calibration_error([True], [1.5])


# ---- threshold sweep / pick ------------------------------------------------------------------

GOLD = [True, True, False, True, False, False]
SCORES = [0.9, 0.8, 0.7, 0.6, 0.3, 0.1]


def test_threshold_sweep_points():
    rows = threshold_sweep(GOLD, SCORES)
    assert [r["threshold"] for r in rows] == [0.1, 0.3, 0.6, 0.7, 0.8, 0.9]
    by_t = {r["threshold"]: r for r in rows}
    # t=0.7: predicts 0.9, 0.8, 0.7 -> tp 2, fp 1
    assert by_t[0.7]["precision"] == pytest.approx(2 / 3)
    assert by_t[0.7]["recall"] == pytest.approx(2 / 3)
    assert by_t[0.7]["over_asking_rate"] == pytest.approx(1 / 3)
    # t=0.6: tp 3, fp 1
    assert by_t[0.6]["recall"] == pytest.approx(1.0)
    assert by_t[0.6]["precision"] == pytest.approx(3 / 4)
    # t=0.1: everything clarify
    assert by_t[0.1]["over_asking_rate"] == pytest.approx(1.0)
    assert by_t[0.9]["precision"] == pytest.approx(1.0) and by_t[0.9]["recall"] == pytest.approx(1 / 3)


def test_threshold_sweep_groups_ties():
    rows = threshold_sweep([True, False, True], [0.5, 0.5, 0.2])
    assert [r["threshold"] for r in rows] == [0.2, 0.5]
    assert rows[1]["tp"] == 1 and rows[1]["fp"] == 1
    assert threshold_sweep([], []) == []


def test_pick_threshold_respects_budget():
    # budget 0: cannot include the 0.7 negative -> 0.8 (recall 2/3)
    assert pick_threshold(GOLD, SCORES, max_over_asking=0.0) == 0.8
    # budget 1/3: one of three negatives allowed -> 0.6 reaches recall 1
    t = pick_threshold(GOLD, SCORES, max_over_asking=0.34)
    assert t == 0.6
    for budget in (0.0, 0.2, 0.34, 0.5, 0.7, 1.0):
        t = pick_threshold(GOLD, SCORES, budget)
        m = decision_metrics(GOLD, [s >= t for s in SCORES])
        assert m["over_asking_rate"] <= budget
        # no other candidate within budget has higher recall
        best = max(r["recall"] for r in threshold_sweep(GOLD, SCORES) if r["over_asking_rate"] <= budget)
        assert m["recall"] == pytest.approx(best)


def test_pick_threshold_prefers_less_over_asking_at_equal_recall():
    # all positives above all negatives: recall 1 already at 0.8, lower thresholds only over-ask
    assert pick_threshold([True, True, False, False], [0.9, 0.8, 0.4, 0.2], max_over_asking=1.0) == 0.8


def test_pick_threshold_nothing_within_budget_never_clarifies():
    t = pick_threshold([True, False], [0.5, 0.9], max_over_asking=0.0)
    assert t > 0.9
    assert decision_metrics([True, False], [s >= t for s in (0.5, 0.9)])["over_asking_rate"] == 0.0
    with pytest.raises(ValueError):
        pick_threshold([], [], 0.1)


# ---- question / grounding --------------------------------------------------------------------


def test_question_metrics_identical_and_partial():
    q = "which router do you mean"
    m = question_metrics([q], [q])
    assert m["n"] == 1
    assert m["rougeL_f"] == pytest.approx(1.0)
    assert m["bleu"] == pytest.approx(100.0)
    assert m["chrf"] == pytest.approx(100.0)
    # LCS 2 of 5 reference tokens and 2 of 2 hypothesis tokens: F = 2*1*0.4/1.4
    m = question_metrics([q, q], [q, "Which router?"])
    assert m["rougeL_f"] == pytest.approx((1.0 + 2 * 0.4 / 1.4) / 2)
    assert m["n"] == 2
    assert 0.0 < m["bleu"] < 100.0


def test_question_metrics_disjoint_and_empty():
    m = question_metrics(["alpha beta gamma"], ["delta epsilon zeta"])
    assert m["rougeL_f"] == 0.0 and m["bleu"] == 0.0
    assert question_metrics([], []) == {"rougeL_f": None, "bleu": None, "chrf": None, "n": 0}


def test_grounding_metrics_hand_computed_and_skipped():
    gold = [[0, 2], [1], [], [3], []]
    pred = [[2, 0], [1, 3], [0], [], []]
    m = grounding_metrics(gold, pred)
    assert m["n"] == 3 and m["skipped"] == 2
    assert m["exact_match"] == pytest.approx(1 / 3)
    # F1 per row: 1.0 ; P=1/2 R=1 -> 2/3 ; empty pred -> 0
    assert m["f1"] == pytest.approx((1.0 + 2 / 3 + 0.0) / 3)


def test_grounding_metrics_all_skipped():
    m = grounding_metrics([[], []], [[1], []])
    assert m == {"exact_match": None, "f1": None, "n": 0, "skipped": 2}


# ---- evaluate_predictions ----------------------------------------------------------------------


def _ex(i, clarify, question=None, turns=(), passages=()):
    history = [Turn(role="user", text="hi"), Turn(role="assistant", text="hello"), Turn(role="user", text="x")]
    return Example(
        id=f"e{i}",
        history=history,
        query="how do I reset it?",
        needs_clarification=clarify,
        clarifying_question=question,
        grounding_turns=list(turns),
        grounding_passages=list(passages),
        passages=[Passage(id="p1", text="a"), Passage(id="p2", text="b")],
    )


Q = "which router do you mean"


def _fixture():
    examples = [
        _ex(0, True, Q, turns=(0, 2), passages=("p1",)),  # TP, grounding exact
        _ex(1, True, Q, turns=(1,)),  # TP, grounding wrong
        _ex(2, True, Q),  # TP, no gold grounding -> skipped
        _ex(3, True, Q, turns=(0,)),  # FN
        _ex(4, False),  # FP
        _ex(5, False),  # TN
    ]
    preds = [
        Prediction(True, 0.9, Q, (2, 0), ("p1",)),
        Prediction(True, 0.8, "Which router?", (2,)),
        Prediction(True, 0.7, "", (0,)),  # TP without a question
        Prediction(False, 0.4),
        Prediction(True, 0.6, "something else?", (), (), valid=True),
        Prediction(False, 0.1, valid=False),
    ]
    return examples, preds


def test_evaluate_predictions_combines_everything():
    examples, preds = _fixture()
    m = evaluate_predictions(examples, preds)
    d = m["decision"]
    assert (d["tp"], d["fp"], d["fn"], d["tn"]) == (3, 1, 1, 1)
    assert d["precision"] == pytest.approx(3 / 4) and d["recall"] == pytest.approx(3 / 4)
    assert d["over_asking_rate"] == pytest.approx(1 / 2)
    assert m["n"] == 6 and m["threshold"] is None
    # AUROC: positives .9 .8 .7 .4 vs negatives .6 .1 -> wrong pair only (.4, .6): 7/8
    assert m["auroc"] == pytest.approx(7 / 8)
    assert m["ece"] == pytest.approx(
        expected_calibration_error([e.needs_clarification for e in examples], [p.confidence for p in preds])
    )
    # question metrics only on the two TPs with a question; the third is counted as missing
    assert m["question"]["n"] == 2 and m["question"]["missing"] == 1
    assert m["question"]["rougeL_f"] == pytest.approx((1.0 + 2 * 0.4 / 1.4) / 2)
    # grounding on 3 TPs: one without gold grounding is skipped; FN row (gold (0,)) not counted
    g = m["grounding"]
    assert g["n"] == 2 and g["skipped"] == 1
    assert g["exact_match"] == pytest.approx(0.5)
    assert g["f1"] == pytest.approx(0.5)
    assert m["grounding_passages"]["n"] == 1 and m["grounding_passages"]["exact_match"] == 1.0
    assert m["validity"] == pytest.approx(5 / 6) and m["n_invalid"] == 1


def test_decision_only_positives_count_for_the_decision_not_for_questions_or_grounding():
    examples, preds = _fixture()
    miss = Example(id="m", history=examples[0].history, query="reset it", needs_clarification=True, decision_only=True)
    m = evaluate_predictions([*examples, miss], [*preds, Prediction(True, 0.95, "Which one?", (0,), ("p1",))])
    base = evaluate_predictions(examples, preds)
    assert m["decision"]["tp"] == base["decision"]["tp"] + 1
    assert m["question"] == base["question"] and m["grounding"] == base["grounding"]
    assert m["grounding_passages"] == base["grounding_passages"]


def test_evaluate_predictions_threshold_overrides_decisions():
    examples, preds = _fixture()
    m = evaluate_predictions(examples, preds, threshold=0.8)  # inclusive: 0.8 clarifies
    d = m["decision"]
    # clarify iff confidence >= 0.8: e0, e1 only
    assert (d["tp"], d["fp"], d["fn"], d["tn"]) == (2, 0, 2, 2)
    assert m["threshold"] == 0.8
    assert m["question"]["n"] == 2 and m["question"]["missing"] == 0
    assert m["grounding"]["n"] == 2 and m["grounding"]["skipped"] == 0
    # a threshold below every score asks everywhere, whatever needs_clarification said
    m = evaluate_predictions(examples, preds, threshold=0.0)
    assert m["decision"]["over_asking_rate"] == 1.0 and m["decision"]["recall"] == 1.0
    # AUROC does not depend on the threshold
    assert m["auroc"] == pytest.approx(7 / 8)


def test_evaluate_predictions_length_mismatch():
    examples, preds = _fixture()
    with pytest.raises(ValueError):
        evaluate_predictions(examples, preds[:-1])


def test_metrics_module_is_pure():
    import subprocess
    import sys

    code = (
        "import sys, clarifier.core.metrics\n"
        "bad = [m for m in ('ray', 'mlflow', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- semantic similarity / a small fixed set, every number by hand -------------------------------


def _word_overlap_similarity(a, b):
    """A stand-in encoder: Jaccard overlap of word sets (so the expected numbers are hand-computable)."""
    out = []
    for x, y in zip(a, b):
        sx, sy = set(x.lower().split()), set(y.lower().split())
        out.append(len(sx & sy) / len(sx | sy))
    return out


def test_semantic_similarity_on_true_positives_only():
    examples, preds = _fixture()
    m = evaluate_predictions(examples, preds, similarity_fn=_word_overlap_similarity)
    # pairs: (Q, Q) -> 1.0 ; (Q, "Which router?") -> {which} & ... : "which router do you mean" vs "which router?"
    # words {which, router, do, you, mean} vs {which, router?} -> 1 shared / 6 -> 1/6
    assert m["question"]["semantic_similarity"] == pytest.approx((1.0 + 1 / 6) / 2)
    # without an encoder the metric is present and None
    assert evaluate_predictions(examples, preds)["question"]["semantic_similarity"] is None


def test_semantic_similarity_checks_the_encoder_output():
    from clarifier.core.metrics import semantic_similarity

    assert semantic_similarity([], [], _word_overlap_similarity) is None
    assert semantic_similarity(["a b"], ["a c"], _word_overlap_similarity) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="returned 1 values for 2 pairs"):
        semantic_similarity(["a", "b"], ["a", "b"], lambda x, y: [1.0])


def test_small_fixed_set_every_metric_by_hand():
    """Eight turns, one model; every reported number recomputed by hand."""
    hist = [Turn(role="user", text="router and modem"), Turn(role="assistant", text="ok")]
    gold = [True, True, True, False, False, False, False, True]
    examples = [Example(id=f"s{i}", history=hist, query="reset it?", needs_clarification=g,
                        clarifying_question="which device do you mean" if g else None,
                        grounding_turns=[0] if g else []) for i, g in enumerate(gold)]
    scores = [0.9, 0.8, 0.3, 0.7, 0.2, 0.1, 0.4, 0.6]
    preds = [Prediction(s >= 0.5, s, "which device do you mean" if s >= 0.5 else None, (0,) if s >= 0.5 else ())
             for s in scores]
    preds[7] = Prediction(True, 0.6, "which one", (0, 1))
    m = evaluate_predictions(examples, preds, similarity_fn=_word_overlap_similarity)
    d = m["decision"]
    # clarify predicted: s0 s1 s3 s7 ; gold clarify: s0 s1 s2 s7
    assert (d["tp"], d["fp"], d["fn"], d["tn"]) == (3, 1, 1, 3)
    assert d["precision"] == pytest.approx(3 / 4) and d["recall"] == pytest.approx(3 / 4)
    assert d["f1"] == pytest.approx(3 / 4)
    assert d["over_asking_rate"] == pytest.approx(1 / 4) and d["under_asking_rate"] == pytest.approx(1 / 4)
    assert d["accuracy"] == pytest.approx(6 / 8)
    # AUROC: positives .9 .8 .3 .6 vs negatives .7 .2 .1 .4 -> 16 pairs; wrong: (.3,.7) (.3,.4) (.6,.7) -> 13/16
    assert m["auroc"] == pytest.approx(13 / 16)
    # ECE (10 bins): bins .1 .2 .3 .4 .6 .7 .8 .9 each hold one score; |conf - gold| summed / 8
    ece = (abs(0.1 - 0) + abs(0.2 - 0) + abs(0.3 - 1) + abs(0.4 - 0) + abs(0.6 - 1) + abs(0.7 - 0)
           + abs(0.8 - 1) + abs(0.9 - 1)) / 8
    assert m["ece"] == pytest.approx(ece)
    # TPs s0 s1 s7: questions identical, identical, "which one" vs "which device do you mean" (1/6 Jaccard)
    assert m["question"]["n"] == 3
    assert m["question"]["semantic_similarity"] == pytest.approx((1 + 1 + 1 / 6) / 3)
    # ROUGE-L F of "which one" vs the reference: LCS 1, P 1/2, R 1/5 -> F = 2/7
    assert m["question"]["rougeL_f"] == pytest.approx((1 + 1 + 2 / 7) / 3)
    # grounding: {0}, {0}, {0,1} vs gold {0} -> EM 2/3, set-F1 (1 + 1 + 2/3) / 3
    assert m["grounding"]["exact_match"] == pytest.approx(2 / 3)
    assert m["grounding"]["f1"] == pytest.approx((1 + 1 + 2 / 3) / 3)
    assert m["validity"] == 1.0


# ---- paired bootstrap ------------------------------------------------------------------------


def test_paired_bootstrap_separates_a_real_difference_from_a_tie():
    from clarifier.core.metrics import paired_bootstrap

    import random

    rng = random.Random(1)
    gold = [i % 3 == 0 for i in range(150)]
    perfect = (gold, [1.0 if g else 0.0 for g in gold])
    noise_scores = [rng.random() for _ in gold]
    noise = ([s > 0.5 for s in noise_scores], noise_scores)
    out = paired_bootstrap(gold, {"perfect": perfect, "noise": noise, "perfect_again": perfect},
                           reference="perfect", n_resamples=200, seed=0)
    s = out["systems"]
    assert s["perfect"]["f1"] == [1.0, 1.0] and s["perfect"]["auroc"] == [1.0, 1.0]
    assert "f1_diff" not in s["perfect"]
    assert s["perfect_again"]["f1_diff"] == [0.0, 0.0]  # paired: identical systems differ by exactly 0
    lo, hi = s["noise"]["f1_diff"]
    assert hi < 0 and s["noise"]["auroc_diff"][1] < 0  # the interval excludes 0
    lo, hi = s["noise"]["auroc"]
    assert lo < 0.5 < hi or abs(0.5 - (lo + hi) / 2) < 0.15
    assert out == paired_bootstrap(gold, {"perfect": perfect, "noise": noise, "perfect_again": perfect},
                                   reference="perfect", n_resamples=200, seed=0)


def test_paired_bootstrap_by_source_resamples_the_within_source_mean():
    """With sources, each resample draws inside every source and the mean within-source AUROC gets an
    interval: a system that only knows the source ranks well on the mixed set and at chance inside."""
    from clarifier.core.metrics import paired_bootstrap

    sources = ["a"] * 60 + ["b"] * 60
    gold = [i % 4 == 0 for i in range(60)] + [i % 4 != 0 for i in range(60)]  # a asks 25%, b 75%
    source_only = ([s == "b" for s in sources], [0.75 if s == "b" else 0.25 for s in sources])
    inside = ([g for g in gold], [(0.6 if g else 0.4) + (0.3 if s == "b" else 0.0) for g, s in zip(gold, sources)])
    out = paired_bootstrap(gold, {"source_only": source_only, "inside": inside}, reference="source_only",
                           n_resamples=200, seed=0, sources=sources)
    s = out["systems"]
    assert out["stratified_by_source"] is True
    assert s["source_only"]["macro_auroc"] == [0.5, 0.5] and s["source_only"]["auroc"][0] > 0.6  # mixed: 0.75
    assert s["inside"]["macro_auroc"] == [1.0, 1.0] and s["inside"]["macro_auroc_diff"] == [0.5, 0.5]
    with pytest.raises(ValueError, match="sources"):
        paired_bootstrap(gold, {"inside": inside}, sources=sources[:-1])


def test_paired_bootstrap_rejects_bad_input():
    from clarifier.core.metrics import paired_bootstrap

    with pytest.raises(ValueError, match="noise decisions"):
        paired_bootstrap([True, False], {"noise": ([True], [0.1, 0.2])})
    with pytest.raises(ValueError, match="reference 'joint'"):
        paired_bootstrap([True, False], {"noise": ([True, False], [0.1, 0.2])}, reference="joint")


def test_decisions_by_source_per_source_counts_and_in_evaluate_predictions():
    from clarifier.core.metrics import decisions_by_source

    gold = [True, False, False, True, False, False]
    decided = [True, True, True, False, False, False]
    sources = ["a", "a", "a", "b", "b", "b"]
    by = decisions_by_source(gold, decided, sources)
    assert sorted(by) == ["a", "b"]
    assert (by["a"]["tp"], by["a"]["fp"], by["a"]["over_asking_rate"]) == (1, 2, 1.0)   # asks on every clear turn of a
    assert (by["b"]["fn"], by["b"]["over_asking_rate"], by["b"]["recall"]) == (1, 0.0, 0.0)
    with pytest.raises(ValueError):
        decisions_by_source(gold, decided[:-1], sources)
    examples = [Example(id=f"e{i}", query="q", needs_clarification=g, clarifying_question="which?" if g else None,
                        meta={"source": s}) for i, (g, s) in enumerate(zip(gold, sources))]
    m = evaluate_predictions(examples, [Prediction(d, 0.9 if d else 0.1) for d in decided])
    assert m["decision_by_source"] == by
    # with a threshold the decisions are the thresholded scores, per source too
    m = evaluate_predictions(examples, [Prediction(d, 0.9 if d else 0.1) for d in decided], threshold=0.95)
    assert all(v["tp"] + v["fp"] == 0 for v in m["decision_by_source"].values())
