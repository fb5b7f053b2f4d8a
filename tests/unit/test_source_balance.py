"""Measuring and removing what a mixed set rewards: knowing which dataset a turn came from."""

from collections import Counter

import pytest

from clarifier.core.metrics import (auroc, decision_metrics, operating_point_at_over_asking, source_only_auroc,
                                    source_only_auroc_from_counts, source_only_scores, within_source_summary)
from clarifier.train.loop import balanced_counts, balanced_epoch_order, batch_indices, training_mix

# Source "a" asks 90% of the time, "b" 10%: the source alone ranks well on the mixed set.
SOURCES = ["a"] * 20 + ["b"] * 20
GOLD = [i < 18 for i in range(20)] + [i < 2 for i in range(20)]


def test_source_only_control_ranks_a_mixed_set_but_nothing_inside_a_source():
    assert source_only_auroc(SOURCES, GOLD) == pytest.approx(0.9)  # (18*18 + 0.5*(18*2 + 2*18)) / (20*20)
    scores = source_only_scores(SOURCES, GOLD, SOURCES)
    summary = within_source_summary(GOLD, scores, SOURCES)
    assert auroc(GOLD, scores) > 0.85
    assert summary["macro_auroc"] == 0.5 and summary["by_source"]["a"]["auroc"] == 0.5
    counts = {s: {"examples": 20, "clarify": sum(g for g, x in zip(GOLD, SOURCES) if x == s)} for s in "ab"}
    assert source_only_auroc_from_counts(counts) == pytest.approx(source_only_auroc(SOURCES, GOLD))
    # unseen source at test time: the overall share
    assert source_only_scores(SOURCES, GOLD, ["c"]) == [0.5]


def test_within_source_summary_scores_each_source_and_skips_single_class_ones():
    gold = [True, False, True, False, True, True]
    scores = [0.9, 0.1, 0.2, 0.8, 0.5, 0.6]
    src = ["x", "x", "y", "y", "z", "z"]
    s = within_source_summary(gold, scores, src)
    assert s["by_source"]["x"]["auroc"] == 1.0 and s["by_source"]["y"]["auroc"] == 0.0
    assert s["by_source"]["z"]["auroc"] is None and s["sources_scored"] == ["x", "y"]
    assert s["macro_auroc"] == 0.5 and s["min_auroc"] == 0.0
    assert s["by_source"]["x"]["recall_at_budget"] == 1.0 and s["by_source"]["y"]["recall_at_budget"] == 0.0


def test_operating_point_at_budget_never_exceeds_it():
    gold = [True, True, False, False, False, False, False, False, False, False, False]
    scores = [0.9, 0.3, 0.8, 0.7, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    op = operating_point_at_over_asking(gold, scores, 0.10)
    assert op["over_asking_rate"] <= 0.10 and op["recall"] == 0.5 and op["threshold"] == 0.9
    assert operating_point_at_over_asking([True], [0.5], 0.1) is None


def test_macro_f1_averages_both_classes():
    d = decision_metrics([True, True, False, False], [True, False, False, False])
    assert d["f1"] == pytest.approx(2 / 3)
    assert d["macro_f1"] == pytest.approx((2 / 3 + 0.8) / 2)


def test_balanced_order_halves_every_source_and_keeps_its_size():
    keys = tuple(zip(SOURCES + ["c"] * 6, GOLD + [True] * 6))
    order = balanced_epoch_order(keys, seed=3, epoch=0)
    assert len(order) == len(keys)
    picked = Counter(keys[i] for i in order)
    assert picked[("a", True)] == 10 and picked[("a", False)] == 10
    assert picked[("b", True)] == 10 and picked[("b", False)] == 10
    assert picked[("c", True)] == 6  # a single-class source is kept as it is
    # the 2 clarify rows of "b" are drawn 5 times each; majority rows are subsampled differently per epoch
    assert list(order) == list(balanced_epoch_order(keys, seed=3, epoch=0))
    assert list(order) != list(balanced_epoch_order(keys, seed=3, epoch=1))
    mixed_sources = [keys[i][0] for i in order]
    mixed_gold = [keys[i][1] for i in order if keys[i][0] != "c"]
    assert source_only_auroc([s for s in mixed_sources if s != "c"], mixed_gold) == 0.5


def test_batches_follow_the_balanced_order_across_ranks():
    keys = tuple(zip(SOURCES, GOLD))
    order = list(balanced_epoch_order(keys, 0, 0))
    got = [i for j in range(10) for r in range(2) for i in batch_indices(40, 0, 2, r, 2, j, keys)]
    assert got == order


def test_training_mix_reports_the_control_before_and_after_balancing():
    counts = {"examples": 40, "clarify": 20, "by_source": {"a": {"examples": 20, "clarify": 18},
                                                             "b": {"examples": 20, "clarify": 2}}}
    none = training_mix("none", counts)
    bal = training_mix("source_class", counts)
    assert none["source_only_auroc"] == pytest.approx(0.9) and none["clarify"] == 20
    assert bal["source_only_auroc"] == 0.5 and bal["source_only_auroc_natural"] == pytest.approx(0.9)
    assert balanced_counts(counts["by_source"]) == {"a": {"examples": 20, "clarify": 10}, "b": {"examples": 20, "clarify": 10}}
    with pytest.raises(ValueError, match="rerun `clarifier data prepare`"):
        training_mix("source_class", {"examples": 4, "clarify": 2})
