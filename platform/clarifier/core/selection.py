"""Which turns of a team's logs a person should label next (``clarifier label select``). Pure: numpy and
scikit-learn, no Ray.

Two parts of a queue, both reproducible from a seed whatever order the turns arrive in (every tie and every draw
is decided by a hash of the seed and the turn's or conversation's id):

* the **kept-apart slice** (:func:`kept_apart_slice`): turns drawn at random, stratified by the model's score
  (``strata`` bins of equal count over all the turns), at most one per conversation. Labelled, they are never
  fitted on: ``clarifier adapt`` reports its figures on them, an honest estimate of how the adapted model does on
  turns it never saw. Their conversations are left out of the rest of the queue, so no fit sees a neighbour of a
  kept-apart turn;
* the **active part** (:func:`active_selection`): among the other turns, the ``pool_factor x n`` whose score sits
  nearest the model's threshold (in log-odds: where a label moves the decision most), spread over ``n`` clusters
  of a sentence embedding of the turn (k-means), the most uncertain turn of each cluster -- so 50 labels do not
  land on one topic; or, with the ``random`` strategy (:func:`random_selection`), a seeded random draw of the
  other turns. Measured on public sources left out of training (docs: results/active-vs-random): the active part
  beat random labels where few turns need a question (PACIFIC) and lost to them where about half do (CLAQUA):
  near a threshold set at 10% over-asking most turns need one, a gain when they are rare, a bias when they are not.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from clarifier.core.metrics import logit


STRATEGIES = ("active", "random")  # how the part of a queue that is not kept apart is chosen


def _key(seed: int, text: str) -> str:
    return hashlib.sha256(f"{seed}:{text}".encode()).hexdigest()


def margins(scores: Sequence[float], threshold: float) -> list[float]:
    """How far each score sits from the threshold, in log-odds (0: the model cannot tell)."""
    t = logit(threshold)
    return [abs(logit(s) - t) for s in scores]


def kept_apart_slice(ids: Sequence[str], conversations: Sequence[str], scores: Sequence[float], n: int, *,
                     seed: int = 0, strata: int = 4) -> list[int]:
    """Indexes of ``n`` turns drawn at random, stratified by score, at most one per conversation (see the module
    docstring); fewer when there are fewer conversations."""
    import numpy as np

    if n <= 0 or not len(ids):
        return []
    s = np.asarray(scores, dtype=float)
    strata = max(1, min(strata, n))
    edges = np.quantile(s, [i / strata for i in range(1, strata)]) if strata > 1 else []
    stratum = np.searchsorted(edges, s, side="right") if strata > 1 else np.zeros(len(s), dtype=int)
    quota = [n // strata + (1 if i < n % strata else 0) for i in range(strata)]
    order = sorted(range(len(ids)), key=lambda i: (_key(seed, str(conversations[i])), _key(seed, str(ids[i]))))
    used: set[str] = set()
    out: list[int] = []
    for i in order:
        c, b = str(conversations[i]), int(stratum[i])
        if c in used or quota[b] <= 0:
            continue
        out.append(i)
        used.add(c)
        quota[b] -= 1
    if len(out) < n:  # a stratum ran short of conversations: fill from the others, still one per conversation
        for i in order:
            c = str(conversations[i])
            if len(out) >= n:
                break
            if c not in used:
                out.append(i)
                used.add(c)
    return out


def uncertain_pool(ids: Sequence[str], scores: Sequence[float], threshold: float, eligible: Sequence[int], size: int,
                   *, seed: int = 0) -> list[int]:
    """The ``size`` eligible turns whose scores sit nearest the threshold (ties by a seeded hash of the id)."""
    m = margins(scores, threshold)
    return sorted(eligible, key=lambda i: (round(m[i], 9), _key(seed, str(ids[i]))))[:max(0, size)]


def diverse_pick(pool: Sequence[int], pool_margins: Sequence[float], embeddings, n: int, *,
                 seed: int = 0) -> tuple[list[int], list[int]]:
    """``n`` of ``pool`` (indexes into the turns, with their margins and embedding rows in the same order): k-means
    into ``n`` clusters, the smallest-margin turn of each, most uncertain first. Returns ``(turns, their
    cluster)``; the whole pool when it has ``n`` turns or fewer."""
    import numpy as np

    pool = list(pool)
    if n <= 0 or not pool:
        return [], []
    if len(pool) <= n:
        order = sorted(range(len(pool)), key=lambda j: pool_margins[j])
        return [pool[j] for j in order], list(range(len(order)))
    from sklearn.cluster import KMeans

    x = np.asarray(embeddings, dtype=float)
    labels = KMeans(n_clusters=n, n_init=4, random_state=seed).fit_predict(x)
    best: dict[int, int] = {}
    for j, c in enumerate(labels):
        c = int(c)
        if c not in best or pool_margins[j] < pool_margins[best[c]]:
            best[c] = j
    chosen = sorted(best.items(), key=lambda kv: pool_margins[kv[1]])
    return [pool[j] for _, j in chosen], [c for c, _ in chosen]


def active_selection(ids: Sequence[str], scores: Sequence[float], threshold: float, eligible: Sequence[int], n: int,
                     embed, *, seed: int = 0, pool_factor: int = 4) -> tuple[list[int], list[int]]:
    """The active part of a queue: :func:`uncertain_pool` of ``pool_factor x n`` turns, then :func:`diverse_pick`
    of ``n``. ``embed(indexes) -> array``: the embedding rows of those turns (only the pool is embedded)."""
    pool = uncertain_pool(ids, scores, threshold, eligible, pool_factor * n, seed=seed)
    if not pool:
        return [], []
    m = margins([scores[i] for i in pool], threshold)
    emb = embed(pool) if len(pool) > n else None
    return diverse_pick(pool, m, emb, n, seed=seed)


def random_selection(ids: Sequence[str], eligible: Sequence[int], n: int, *, seed: int = 0) -> list[int]:
    """``n`` of the eligible turns drawn at random: their order by a hash of the seed and the turn's id, so the
    same seed gives the same draw whatever order the turns arrive in."""
    return sorted(eligible, key=lambda i: _key(seed, str(ids[i])))[:max(0, n)]


def select_part(strategy: str, ids: Sequence[str], scores: Sequence[float], threshold: float,
                eligible: Sequence[int], n: int, embed, *, seed: int = 0, pool_factor: int = 4
                ) -> tuple[list[int], list[int]]:
    """The part of a queue that is not kept apart, by ``strategy`` (:data:`STRATEGIES`): ``(turns, their
    cluster)``, no clusters for a random draw."""
    if strategy == "random":
        return random_selection(ids, eligible, n, seed=seed), []
    if strategy == "active":
        return active_selection(ids, scores, threshold, eligible, n, embed, seed=seed, pool_factor=pool_factor)
    raise ValueError(f"strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
