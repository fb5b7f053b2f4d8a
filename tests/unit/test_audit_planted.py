"""The audit's statistics on logs with a planted truth: synthetic RAG chat logs in the OpenAI format
(clarifier.data.synthetic_chatlogs) with a planted share of failed turns that needed clarification,
read by the audit's own parser and signals, flagged by a simulated clarifier of known recall and
false-positive rate, estimated with the audit's estimator and the error rates measured on the
logs' labelled sample. The corrected interval must contain the planted share across seeds and rates,
the raw one must not (it is biased), and the verdict must flip at the rule.

The real job (Ray, a model) on the same kind of logs: tests/integration/test_audit.py and
benchmarks/audit/bench_audit.py. Reformulation is read here with the generator's lexical check
instead of the MiniLM encoder (tests/unit/test_synthetic_chatlogs.py -m slow shows the encoder
finds exactly the planted ones).
"""

from __future__ import annotations

import random

import pytest

from clarifier.core.config import load_config
from clarifier.core.prevalence import ErrorRates, share_estimate, verdict
from clarifier.data.audit_stages import bucket_of
from clarifier.data.chatlog import audit_turns
from clarifier.data.signals import text_signals
from clarifier.data.synthetic_chatlogs import generate_chatlogs, is_restatement, planted_summary

CFG = load_config().audit
RECALL, FPR = 0.75, 0.12


def audit_estimate(rate: float, seed: int, n: int = 700) -> tuple[dict, float]:
    records = generate_chatlogs(n, seed=seed, planted_share=rate, labelled_share=0.3)
    truth = {f"{r['id']}:{i}": e["needs_clarification"] for r in records for i, e in r["planted"].items()}
    rng = random.Random(f"clf:{seed}:{rate}")
    buckets: dict[int, list[int]] = {}
    tp = fn = tn = fp = 0
    for r in records:
        for t in audit_turns(r, "f"):
            s = text_signals(t, CFG.signals)
            failed = bool(s["feedback"] or s["no_answer"] or s["escalation"]
                          or (t.next_user and is_restatement(t.query, t.next_user)))
            need = truth[t.id]
            flagged = rng.random() < (RECALL if need else FPR)  # the simulated clarifier
            if t.gold is not None:  # the logs' labelled sample measures its error rates
                tp, fn = tp + (t.gold and flagged), fn + (t.gold and not flagged)
                fp, tn = fp + (not t.gold and flagged), tn + (not t.gold and not flagged)
            if failed:
                b = buckets.setdefault(bucket_of(t.conversation_id, CFG.buckets), [0, 0])
                b[0] += 1
                b[1] += flagged
    rates = ErrorRates(tp=tp, fn=fn, tn=tn, fp=fp)
    est = share_estimate([b[1] for b in buckets.values()], [b[0] for b in buckets.values()], rates,
                         bootstrap=500, seed=seed)
    return est, planted_summary(records)["share"]


@pytest.mark.parametrize("rate", [0.05, 0.15, 0.30])
def test_corrected_interval_contains_the_planted_share(rate):
    covered = raw_covered = 0
    seeds = range(6)
    for seed in seeds:
        est, planted = audit_estimate(rate, seed)
        assert planted == pytest.approx(rate, abs=0.01)
        lo, hi = est["corrected_ci"]
        covered += lo <= planted <= hi
        raw_covered += est["raw_ci"][0] <= planted <= est["raw_ci"][1]
    assert covered >= 5, f"the corrected interval held the planted share in {covered}/{len(seeds)} runs"
    if rate == 0.05:  # the raw flags of failed turns: 0.05*0.75 + 0.95*0.12 = 15%, three times the truth
        assert raw_covered <= 1


def test_verdict_flips_at_the_rule():
    low, _ = audit_estimate(0.05, seed=11, n=1200)
    high, _ = audit_estimate(0.30, seed=11, n=1200)
    assert verdict(low, CFG.rule_share)["decision"] == "not_worth_it"
    assert verdict(high, CFG.rule_share)["decision"] == "worth_it"
    at, _ = audit_estimate(0.15, seed=11, n=700)
    assert verdict(at, CFG.rule_share)["decision"] == "inconclusive"


def youden_estimate(rate: float, seed: int, n: int = 700) -> tuple[dict, dict, float]:
    """A weak, conservative clarifier: scores overlap (AUROC ~0.75) and its own threshold (0.8) flags almost
    nothing. Estimated at its threshold (blind) and at Youden's threshold chosen on the labelled turns of
    even buckets, with the error rates of the odd buckets (what ``audit.threshold=auto`` does)."""
    import numpy as np

    from clarifier.core.prevalence import confusion_at, youden_threshold

    records = generate_chatlogs(n, seed=seed, planted_share=rate, labelled_share=0.3)
    truth = {f"{r['id']}:{i}": e["needs_clarification"] for r in records for i, e in r["planted"].items()}
    rng = np.random.default_rng(seed)
    turns = []  # (bucket, failed, score, gold)
    for r in records:
        for t in audit_turns(r, "f"):
            s = text_signals(t, CFG.signals)
            failed = bool(s["feedback"] or s["no_answer"] or s["escalation"]
                          or (t.next_user and is_restatement(t.query, t.next_user)))
            score = float(np.clip(rng.normal(0.45 if truth[t.id] else 0.30, 0.15), 0, 1))
            turns.append((bucket_of(t.conversation_id, CFG.buckets), failed, score, t.gold))
    lab = [(b, s, g) for b, _, s, g in turns if g is not None]
    even = [(s, g) for b, s, g in lab if b % 2 == 0]
    odd = [(s, g) for b, s, g in lab if b % 2 == 1]
    thr, _ = youden_threshold([s for s, _ in even], [g for _, g in even])
    rates = confusion_at([s for s, _ in odd], [g for _, g in odd], thr)
    blind = confusion_at([s for _, s, _ in lab], [g for _, _, g in lab], 0.8)

    def estimate(at: float, r: ErrorRates) -> dict:
        buckets: dict[int, list[int]] = {}
        for b, failed, score, _ in turns:
            if failed:
                c = buckets.setdefault(b, [0, 0])
                c[0] += 1
                c[1] += score >= at
        return share_estimate([c[1] for c in buckets.values()], [c[0] for c in buckets.values()], r,
                              bootstrap=500, seed=seed)

    est = estimate(thr, rates)
    low = estimate(0.8, blind)
    return est, {"blind": blind, "low": low}, planted_summary(records)["share"]


@pytest.mark.parametrize("rate", [0.15, 0.30])
def test_youden_threshold_recovers_the_share_a_conservative_model_cannot_see(rate):
    covered = 0
    for seed in range(5):
        est, at_model, share = youden_estimate(rate, seed)
        covered += est["corrected_ci"][0] <= share <= est["corrected_ci"][1]
        # at its own threshold the model is (nearly) blind: its corrected [0, 0] would be a false certainty
        v = verdict(at_model["low"], CFG.rule_share, rates=at_model["blind"])
        assert at_model["blind"].sensitivity < 0.1
        assert v["decision"] == "undetermined", v
    assert covered >= 4, covered
