"""Which turns to label next (clarifier.core.selection): the kept-apart slice, the uncertain pool, the diversity
pick, and the queue's order -- reproducible, one kept-apart turn per conversation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from clarifier.core.selection import (active_selection, diverse_pick, kept_apart_slice, margins, random_selection,
                                      select_part, uncertain_pool)
from clarifier.evaluation.label_queue import interleave


def _turns(n: int, seed: int = 0):
    rng = random.Random(seed)
    ids = [f"t{i:03d}" for i in range(n)]
    convs = [f"c{i // 3}" for i in range(n)]  # three turns per conversation
    scores = [rng.random() for _ in range(n)]
    return ids, convs, scores


def test_kept_apart_slice_is_stratified_one_per_conversation_and_order_free():
    ids, convs, scores = _turns(300)
    kept = kept_apart_slice(ids, convs, scores, 40, seed=3, strata=4)
    assert len(kept) == 40 and len({convs[i] for i in kept}) == 40
    edges = np.quantile(scores, [0.25, 0.5, 0.75])
    per = np.bincount(np.searchsorted(edges, [scores[i] for i in kept], side="right"), minlength=4)
    assert per.tolist() == [10, 10, 10, 10]  # every score band is in the estimate
    shuffled = list(range(300))
    random.Random(9).shuffle(shuffled)
    again = kept_apart_slice([ids[i] for i in shuffled], [convs[i] for i in shuffled], [scores[i] for i in shuffled],
                             40, seed=3, strata=4)
    assert sorted(ids[shuffled[j]] for j in again) == sorted(ids[i] for i in kept)  # input order does not matter
    assert sorted(kept_apart_slice(ids, convs, scores, 40, seed=4)) != sorted(kept)  # the seed does
    assert len(kept_apart_slice(ids[:9], convs[:9], scores[:9], 5)) == 3  # only three conversations
    assert kept_apart_slice(ids, convs, scores, 0) == []


def test_the_uncertain_pool_is_nearest_the_threshold_in_log_odds():
    ids = ["a", "b", "c", "d", "e"]
    scores = [0.5, 0.9, 0.31, 0.05, 0.69]
    assert uncertain_pool(ids, scores, 0.3, range(5), 2) == [2, 0]
    assert uncertain_pool(ids, scores, 0.3, [1, 3, 4], 2) == [4, 3]  # only the eligible (0.05 is nearer than 0.9)
    m = margins([0.5, 0.73106], 0.5)
    assert m[0] == 0 and abs(m[1] - 1.0) < 1e-3


def test_diverse_pick_takes_the_most_uncertain_turn_of_each_cluster():
    rng = np.random.default_rng(0)
    centres = np.eye(8)[:4] * 10
    emb = np.concatenate([c + rng.normal(0, 0.1, (10, 8)) for c in centres])  # four topics, ten turns each
    pool = list(range(100, 140))
    m = [float(x) for x in rng.random(40)]
    picked, clusters = diverse_pick(pool, m, emb, 4, seed=0)
    topics = {(p - 100) // 10 for p in picked}
    assert topics == {0, 1, 2, 3} and len(set(clusters)) == 4  # one per topic, not four from the first
    for p in picked:
        t = (p - 100) // 10
        assert m[p - 100] == min(m[t * 10:(t + 1) * 10])  # the most uncertain of its topic
    assert [m[p - 100] for p in picked] == sorted(m[p - 100] for p in picked)
    assert diverse_pick(pool[:3], m[:3], None, 5)[0] == [pool[j] for j in np.argsort(m[:3])]


def test_active_selection_embeds_only_its_pool():
    ids, _, scores = _turns(200, 1)
    seen = []

    def embed(idx):
        seen.append(list(idx))
        return np.array([[float(i % 5), float(i % 7)] for i in idx])

    picked, _ = active_selection(ids, scores, 0.5, range(200), 10, embed, pool_factor=3)
    assert len(picked) == 10 and len(seen) == 1 and len(seen[0]) == 30
    assert set(picked) <= set(seen[0])


def test_interleave_spreads_the_kept_apart_slice_over_the_queue():
    order = interleave(list(range(8)), [100, 101])
    assert [i for _, i in order if _ == "active"] == list(range(8))
    assert [pos for pos, (part, _) in enumerate(order) if part == "kept_apart"] in ([4, 9], [3, 8], [4, 8])
    assert interleave([], [1, 2]) == [("kept_apart", 1), ("kept_apart", 2)]
    assert interleave([1], []) == [("active", 1)]
    assert interleave([1, 2], [9], "random") == [("random", 1), ("random", 2), ("kept_apart", 9)]


def test_random_selection_is_seeded_order_free_and_only_from_the_eligible():
    ids, _, scores = _turns(200, 2)
    eligible = list(range(0, 200, 2))
    picked = random_selection(ids, eligible, 20, seed=5)
    assert len(picked) == len(set(picked)) == 20 and set(picked) <= set(eligible)
    assert random_selection(ids, list(reversed(eligible)), 20, seed=5) == picked  # arrival order does not matter
    assert random_selection(ids, eligible, 20, seed=6) != picked  # the seed does
    assert sorted(picked) != sorted(eligible)[:20]  # not the first turns, nor chosen by score:
    near = uncertain_pool(ids, scores, 0.5, eligible, 20, seed=5)
    assert set(picked) != set(near)
    assert random_selection(ids, eligible, 500) == random_selection(ids, eligible, 100)  # at most the eligible
    assert random_selection(ids, eligible, 0) == []



def test_select_part_by_strategy():
    ids, _, scores = _turns(120, 3)
    embed = lambda idx: np.array([[float(i % 4), float(i % 3)] for i in idx])  # noqa: E731
    assert select_part("random", ids, scores, 0.5, range(120), 8, embed, seed=1) == (
        random_selection(ids, range(120), 8, seed=1), [])
    assert select_part("active", ids, scores, 0.5, range(120), 8, embed, seed=1, pool_factor=2) == active_selection(
        ids, scores, 0.5, range(120), 8, embed, seed=1, pool_factor=2)
    with pytest.raises(ValueError, match="strategy 'uncertain': one of active, random"):
        select_part("uncertain", ids, scores, 0.5, range(120), 8, embed)
