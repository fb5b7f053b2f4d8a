"""The audit's estimator: Rogan-Gladen correction, its bootstrap interval, the verdict."""

from __future__ import annotations

import numpy as np
import pytest

from clarifier.core.prevalence import ErrorRates, rogan_gladen, share_estimate, verdict


def test_rogan_gladen_inverts_the_flagging_model():
    for pi in (0.0, 0.05, 0.15, 0.3, 0.8):
        sens, spec = 0.7, 0.9
        observed = pi * sens + (1 - pi) * (1 - spec)
        assert rogan_gladen(observed, sens, spec) == pytest.approx(pi)


def test_rogan_gladen_clips_and_refuses_a_chance_level_model():
    assert rogan_gladen(0.01, 0.7, 0.9) == 0.0  # below the false-positive rate: clipped, not negative
    assert rogan_gladen(0.99, 0.7, 0.9) == 1.0
    assert np.isnan(rogan_gladen(0.3, 0.5, 0.5))  # sens + spec = 1: not identifiable
    arr = rogan_gladen(np.array([0.16, 0.3]), np.array([0.7, 0.4]), np.array([0.9, 0.5]))
    assert arr[0] == pytest.approx(0.1) and np.isnan(arr[1])


def test_error_rates_validation_and_usability():
    assert ErrorRates(tp=7, fn=3, tn=9, fp=1).usable
    assert not ErrorRates(tp=5, fn=5, tn=5, fp=5).usable  # chance
    assert not ErrorRates(tp=0, fn=0, tn=9, fp=1).usable  # recall unmeasured
    with pytest.raises(ValueError, match="negative"):
        ErrorRates(tp=-1, fn=3, tn=9, fp=1)
    d = ErrorRates(tp=7, fn=3, tn=9, fp=1, source="x").as_dict()
    assert d["recall"] == pytest.approx(0.7) and d["false_positive_rate"] == pytest.approx(0.1)


def _simulated_audit(rng, pi, sens, spec, conversations=400, turns_per_conv=3, labelled=400):
    """Buckets of (turns, flags) from a classifier with known error rates, and the labelled set it was measured on."""
    truth = rng.random((conversations, turns_per_conv)) < pi
    flags = np.where(truth, rng.random(truth.shape) < sens, rng.random(truth.shape) < 1 - spec)
    pos = rng.random(labelled // 2) < sens
    neg = rng.random(labelled // 2) < 1 - spec
    rates = ErrorRates(tp=int(pos.sum()), fn=int((~pos).sum()), tn=int((~neg).sum()), fp=int(neg.sum()))
    return flags.sum(axis=1), np.full(conversations, turns_per_conv), truth.mean(), rates


@pytest.mark.parametrize("pi", [0.05, 0.15, 0.30])
def test_corrected_interval_covers_the_planted_share(pi):
    """Across seeds, the corrected 95% interval contains the realised true share about 95% of the time,
    while the raw flagged share is biased (its interval misses it most of the time at 5% and 30%)."""
    covered = raw_covered = 0
    runs = 40
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        k, n, true_share, rates = _simulated_audit(rng, pi, sens=0.6, spec=0.9)
        est = share_estimate(k, n, rates, bootstrap=400, seed=seed)
        covered += est["corrected_ci"][0] <= true_share <= est["corrected_ci"][1]
        raw_covered += est["raw_ci"][0] <= true_share <= est["raw_ci"][1]
        assert est["corrected_ci"][1] - est["corrected_ci"][0] > est["raw_ci"][1] - est["raw_ci"][0]
    assert covered >= 0.85 * runs, f"corrected interval covered the planted share in {covered}/{runs} runs"
    if pi != 0.15:  # raw flags: 12.5% for 5% and 25% for 30% (at 15% the bias is only 2.5 points)
        assert raw_covered < 0.5 * runs


def test_bootstrap_resamples_conversations_not_turns():
    """All turns of a conversation flagged together (perfectly correlated): the interval must be
    as wide as the conversation count says, not the turn count."""
    rng = np.random.default_rng(0)
    conv_flag = rng.random(50) < 0.3
    k = conv_flag.astype(int) * 20
    n = np.full(50, 20)
    est = share_estimate(k, n, None, bootstrap=500, seed=0)
    lo, hi = est["raw_ci"]
    assert hi - lo > 0.15  # ~ 4 binomial standard errors of 50 conversations, not of 1000 turns (~0.06)
    assert est["corrected"] is None and est["buckets"] == 50


def test_share_estimate_inputs_and_empty():
    assert share_estimate([0, 0], [0, 0])["raw"] is None
    with pytest.raises(ValueError, match="flagged <= turns"):
        share_estimate([3], [2])
    with pytest.raises(ValueError, match="differ in length"):
        share_estimate([1, 2], [3])
    unusable = share_estimate([5, 5], [10, 10], ErrorRates(tp=5, fn=5, tn=5, fp=5))
    assert unusable["raw"] == 0.5 and unusable["corrected"] is None


def test_verdict_flips_at_the_rule():
    base = {"confidence": 0.95, "corrected": None, "corrected_ci": None}
    above = verdict({**base, "raw": 0.25, "raw_ci": [0.2, 0.3]}, 0.15)
    below = verdict({**base, "raw": 0.08, "raw_ci": [0.05, 0.11]}, 0.15)
    straddle = verdict({**base, "raw": 0.15, "raw_ci": [0.12, 0.19]}, 0.15)
    assert (above["decision"], below["decision"], straddle["decision"]) == ("worth_it", "not_worth_it", "inconclusive")
    assert "NOT corrected" in above["sentence"] and "15.0% rule" in above["sentence"]
    corrected = verdict({**base, "raw": 0.3, "raw_ci": [0.25, 0.35], "corrected": 0.1, "corrected_ci": [0.05, 0.14]}, 0.15)
    assert corrected["decision"] == "not_worth_it" and corrected["corrected"]  # the corrected figure decides
    assert verdict({"raw": None, "raw_ci": None}, 0.15)["decision"] == "no_data"


def test_a_model_no_better_than_chance_gives_no_verdict():
    """Zero recall on the labelled turns: a 0% flagged share is the model's blindness, not a finding."""
    blind = ErrorRates(tp=0, fn=20, tn=60, fp=2, source="82 labelled turns in these logs (in-domain)")
    est = share_estimate([0, 0, 0], [30, 40, 50], blind, bootstrap=200)
    assert est["corrected"] is None  # not identifiable
    v = verdict(est, 0.15, rates=blind)
    assert v["decision"] == "undetermined" and "recall 0.00" in v["sentence"] and "hardly tell the classes apart" in v["sentence"]
    assert verdict(est, 0.15)["decision"] == "not_worth_it"  # without measured rates only the raw share is known


def test_youden_threshold_and_confusion_counts():
    from clarifier.core.prevalence import confusion_at, youden_threshold

    scores, gold = [0.9, 0.8, 0.7, 0.3, 0.2], [True, True, False, True, False]
    thr, j = youden_threshold(scores, gold)
    assert thr == pytest.approx(0.75) and j == pytest.approx(2 / 3)  # between the scores it separates
    r = confusion_at(scores, gold, thr)
    assert (r.tp, r.fn, r.tn, r.fp) == (2, 1, 2, 0) and r.youden_j == pytest.approx(2 / 3)
    thr0, j0 = youden_threshold([0.9, 0.8, 0.1], [False, False, True])  # inversely related: flag nothing
    assert j0 == 0.0 and confusion_at([0.9, 0.8, 0.1], [False, False, True], thr0).fp == 0
    with pytest.raises(ValueError, match="both classes"):
        youden_threshold([0.5, 0.6], [True, True])


def test_no_error_rates_at_all_gives_no_verdict_unless_raw_is_asked_for():
    est = share_estimate([0, 1, 0], [30, 40, 50], None, bootstrap=200)
    assert verdict(est, 0.15, require_correction=True)["decision"] == "undetermined"
    assert "--eval-report" in verdict(est, 0.15, require_correction=True)["sentence"]
    assert verdict(est, 0.15)["decision"] == "not_worth_it"  # audit.error_rates=none: the raw share decides
