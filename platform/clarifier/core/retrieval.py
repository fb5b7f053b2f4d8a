"""What the retrieval itself says about a turn, as numbers a decision can read beside the model.

Two families, both measured against the surface control by ``benchmarks/recipe/rag_signal.py`` (results:
``docs/results/rag-signal.md``), neither part of the shipped decision unless that page says so:

* the **score profile** (:data:`PROFILE`, :func:`score_profile`) of the retriever's own scores for the turn's
  passages -- the best score, the gap between the top two, how many passages sit near the top, their spread and
  how many there are. Flat scores over passages that disagree are what an ambiguous query looks like to a
  retriever. Requests carry these scores as an optional ``score`` per passage (``/v1/clarify``) or per document
  (chat completions); where none are given, a sentence encoder's query-to-passage cosine stands in for them.
* the **geometry** (:data:`GEOMETRY`, :func:`geometry`) of the turn in an embedding space: passage-to-passage
  similarity (min, mean, spread), query-to-passage similarity (max, top-two gap, near-top count), the number of
  passages and the query's largest similarity to an earlier user turn.

Pure: numpy only; the embeddings come from the caller (``clarifier.engine.similarity.SentenceEncoder``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

PROFILE = ("score_max", "score_gap", "score_near_top", "score_std", "passages_log")
GEOMETRY = ("pp_min", "pp_mean", "pp_std", "qp_max", "qp_gap", "qp_near_top", "passages_log", "q_history_max")
NEAR_TOP = 0.05


def passage_scores(passages: Sequence[Any]) -> list[float] | None:
    """The retriever's scores of ``passages`` (objects or dicts with ``score``), or None unless every one has one:
    a profile over some of a turn's passages would describe another retrieval."""
    out = []
    for p in passages:
        s = p.get("score") if isinstance(p, dict) else getattr(p, "score", None)
        if s is None:
            return None
        out.append(float(s))
    return out if out else None


def score_profile(scores: Sequence[float], near: float = NEAR_TOP) -> list[float]:
    """:data:`PROFILE` of one turn's passage scores (any scale; higher is more relevant). ``near``: how far below
    the best score a passage still counts as near the top, as a share of the scores' range (cosine-like scores
    whose range is under 1 use it as an absolute margin)."""
    s = sorted((float(v) for v in scores), reverse=True)
    if not s:
        return [0.0, 0.0, 0.0, 0.0, 0.0]
    if any(not math.isfinite(v) for v in s):
        raise ValueError(f"passage scores must be finite numbers, got {list(scores)}")
    span = s[0] - s[-1]
    margin = near * span if span > 1.0 else near
    mean = sum(s) / len(s)
    std = math.sqrt(sum((v - mean) ** 2 for v in s) / len(s))
    return [s[0], s[0] - s[1] if len(s) > 1 else 1.0, float(sum(1 for v in s if v >= s[0] - margin)), std,
            math.log1p(len(s))]


def geometry(query, passages, history=None, near: float = NEAR_TOP) -> list[float]:
    """:data:`GEOMETRY` of one turn from unit-norm embeddings: ``query`` (dim,), ``passages`` (k, dim) in the
    retriever's order, ``history`` (h, dim) of the earlier user turns."""
    import numpy as np

    q = np.asarray(query, dtype=float)
    p = np.asarray(passages, dtype=float).reshape(-1, q.shape[0]) if len(passages) else np.zeros((0, q.shape[0]))
    k = p.shape[0]
    if k >= 2:
        upper = (p @ p.T)[np.triu_indices(k, 1)]
        pp = [float(upper.min()), float(upper.mean()), float(upper.std())]
    else:
        pp = [1.0, 1.0, 0.0]  # one passage (or none) cannot disagree with itself
    if k:
        qp = np.sort(p @ q)[::-1]
        qpf = [float(qp[0]), float(qp[0] - qp[1]) if k > 1 else 1.0, float(np.sum(qp >= qp[0] - near))]
    else:
        qpf = [0.0, 0.0, 0.0]
    h = np.asarray(history, dtype=float).reshape(-1, q.shape[0]) if history is not None and len(history) else None
    qh = float((h @ q).max()) if h is not None else 0.0
    return [*pp, *qpf, math.log1p(k), qh]


def scored_share(examples: Sequence[Any]) -> tuple[int, int]:
    """``(turns whose every passage has a retriever score, turns with passages)`` of ``examples``."""
    with_passages = [e for e in examples if (e.get("passages") if isinstance(e, dict) else e.passages)]
    scored = sum(1 for e in with_passages
                 if passage_scores(e.get("passages") if isinstance(e, dict) else e.passages) is not None)
    return scored, len(with_passages)


def retriever_score_check(examples: Sequence[Any], gold: Sequence[bool], model_scores: Sequence[float],
                          sources: Sequence[str] | None = None, groups: Sequence[str] | None = None, *,
                          folds: int = 5, seed: int = 0, min_share: float = 0.9, min_turns: int = 20) -> dict | None:
    """Do the retriever's own scores on a team's labelled turns say something the model does not? None unless at
    least ``min_share`` of the turns with passages (and ``min_turns``) carry a score on every passage. Otherwise
    the score profile alone, and the model's logit stacked with it, each cross-fitted on the same folds as the
    surface control (:func:`clarifier.core.surface.cross_fitted_scores`), and what stacking adds over the model
    (paired bootstrap interval): the evidence for feeding the scores to the decision, measured on the team's own
    turns."""
    from clarifier.core.metrics import auroc, logit, paired_bootstrap
    from clarifier.core.surface import cross_fitted_scores

    scored, with_passages = scored_share(examples)
    if with_passages < min_turns or scored < max(min_turns, min_share * with_passages):
        return None
    prof = [score_profile(passage_scores(e.get("passages") if isinstance(e, dict) else e.passages) or [])
            for e in examples]

    gold = [bool(g) for g in gold]
    alone = cross_fitted_scores(examples, gold, sources, groups, folds=folds, seed=seed, features=prof)
    stacked = cross_fitted_scores(examples, gold, sources, groups, folds=folds, seed=seed,
                                  features=[[logit(m)] + p for m, p in zip(model_scores, prof)])
    boot = paired_bootstrap(gold, {"model": ([False] * len(gold), list(model_scores)),
                                   "stacked": ([False] * len(gold), stacked)}, reference="model", seed=seed)
    iv = boot["systems"]["stacked"].get("auroc_diff")
    m, s = auroc(gold, list(model_scores)), auroc(gold, stacked)
    added = s - m if m is not None and s is not None else None
    if added is None:
        line = "the retriever's scores: not measurable here (a single class)"
    elif iv and iv[0] > 0:
        line = (f"the retriever's scores add {added:+.3f} [{iv[0]:+.3f}, {iv[1]:+.3f}] AUROC to the model on these "
                f"turns ({m:.3f} -> {s:.3f}): worth feeding to the decision")
    else:
        span = f"[{iv[0]:+.3f}, {iv[1]:+.3f}]" if iv else "[no interval]"
        line = (f"the retriever's scores add nothing measurable to the model on these turns: {added:+.3f} {span} "
                f"({m:.3f} -> {s:.3f})")
    return {"turns_with_scores": scored, "turns_with_passages": with_passages, "features": list(PROFILE),
            "profile_auroc": auroc(gold, alone), "model_auroc": m, "stacked_auroc": s, "added": added,
            "interval": iv, "adds_to_model": bool(iv and iv[0] > 0), "verdict": line}
