"""The *surface control*: P(clarify) from where a turn sits in its conversation and how long things are, and nothing
else -- no words, no meaning. On some public RAG benchmarks the turns that need a question sit early in
conversations and carry more passages, so a logistic regression on position and length ranks them well (AUROC
0.83 on one), and a model's AUROC alone would credit it with skill it does not have. Every quality report
carries this control, fitted on the same training or labelled turns as the model, and states the model's skill
as its margin over it, with a paired bootstrap interval (:func:`skill_over_control`).

Features (:data:`FEATURES`, :func:`surface_features`): the query's turn index (user turns so far), history length
in turns and characters, query length in words and characters, number of passages and their characters, and
punctuation (a closing ``?``, the number of ``?``). Counts and lengths enter as ``log1p``.

The fit (:class:`SurfaceControl`): standardised features, a logistic regression whose strength is chosen by
stratified cross-validation on the fitting turns; inside every source with enough turns of both classes
(``min_per_class``) a fit of that source's own, elsewhere the pooled fit -- so the control is as strong as
position and length can be inside each source, where the headline figures are measured.

Pure: scikit-learn and numpy only (imported when a control is fitted), no torch, Ray or MLflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

FEATURES = ("user_turn_index", "history_turns", "history_chars", "query_words", "query_chars", "passages",
            "passage_chars", "query_ends_with_question_mark", "query_question_marks")
C_GRID = (0.01, 0.1, 1.0, 10.0)
NAME = "surface_control"


def _get(example: Any, key: str, default=None):
    return example.get(key, default) if isinstance(example, dict) else getattr(example, key, default)


def _text(turn: Any) -> str:
    return str(_get(turn, "text", "") or "")


def surface_features(example: Any) -> list[float]:
    """The control's features of one turn (an Example, a request, or a dict with ``history``/``query``/``passages``)."""
    history = list(_get(example, "history", None) or [])
    passages = list(_get(example, "passages", None) or [])
    query = str(_get(example, "query", "") or "")
    users = sum(1 for t in history if str(getattr(_get(t, "role", ""), "value", _get(t, "role", ""))) == "user")
    q = query.strip()
    return [math.log1p(users), math.log1p(len(history)), math.log1p(sum(len(_text(t)) for t in history)),
            math.log1p(len(q.split())), math.log1p(len(q)), math.log1p(len(passages)),
            math.log1p(sum(len(_text(p)) for p in passages)), 1.0 if q.endswith("?") else 0.0,
            math.log1p(q.count("?"))]


@dataclass
class SurfaceControl:
    """A fitted surface control: the pooled fit and the per-source fits, each ``(pipeline, C)``."""

    pooled: Any
    by_source: dict[str, Any] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def scores(self, examples: Sequence, sources: Sequence[str] | None = None) -> list[float]:
        """P(clarify) of each turn by the control: its source's own fit where there is one, else the pooled fit."""
        return self.scores_of([surface_features(e) for e in examples], sources)

    def scores_of(self, features: Sequence[Sequence[float]], sources: Sequence[str] | None = None) -> list[float]:
        """:meth:`scores` of turns given by their feature rows (those the fit was given)."""
        import numpy as np

        if not len(features):
            return []
        x = np.asarray(features, dtype=float)
        out = _predict(self.pooled, x)
        if sources is not None and self.by_source:
            for src, fit in self.by_source.items():
                idx = [i for i, s in enumerate(sources) if s == src]
                if idx:
                    out[idx] = _predict(fit, x[idx])
        return [float(v) for v in out]


def _predict(fit, x):
    import numpy as np

    if isinstance(fit, float):  # a single class in the fitting turns: its share
        return np.full(len(x), fit)
    return fit.predict_proba(x)[:, 1]


def _fit_one(x, y, seed: int, c_grid: Sequence[float]):
    """(fitted pipeline or constant share, chosen C) on features ``x`` and labels ``y``."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    y = np.asarray(y, dtype=int)
    if len(set(y.tolist())) < 2:
        return float(y.mean()) if len(y) else 0.5, None

    def model(c):
        return make_pipeline(StandardScaler(), LogisticRegression(C=c, class_weight="balanced", max_iter=2000))

    folds = min(5, int(min(np.bincount(y))))
    best = c_grid[len(c_grid) // 2]
    if folds >= 2 and len(c_grid) > 1:
        cv = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
        scores = {c: float(np.mean(cross_val_score(model(c), x, y, cv=cv, scoring="roc_auc"))) for c in c_grid}
        best = max(c_grid, key=lambda c: (scores[c], -abs(math.log10(c))))
    return model(best).fit(x, y), best


def fit_surface_control(examples: Sequence, gold: Sequence[bool], sources: Sequence[str] | None = None, *,
                        seed: int = 0, min_per_class: int = 10, c_grid: Sequence[float] = C_GRID) -> SurfaceControl:
    """Fit the control on ``examples`` with labels ``gold`` (and, with ``sources``, a fit per source that has at
    least ``min_per_class`` turns of each class)."""
    if len(examples) != len(gold):
        raise ValueError(f"{len(examples)} examples but {len(gold)} labels")
    ctl = fit_features([surface_features(e) for e in examples], gold, sources, seed=seed,
                       min_per_class=min_per_class, c_grid=c_grid)
    ctl.info["features"] = list(FEATURES)
    return ctl


def fit_features(features: Sequence[Sequence[float]], gold: Sequence[bool], sources: Sequence[str] | None = None, *,
                 seed: int = 0, min_per_class: int = 10, c_grid: Sequence[float] = C_GRID) -> SurfaceControl:
    """The control's procedure on any feature rows (a benchmark tries other features the same way): standardised
    features, a logistic regression with its strength cross-validated, pooled and per source."""
    import numpy as np

    x = np.asarray(features, dtype=float).reshape(len(gold), -1)
    y = np.array([bool(g) for g in gold], dtype=int)
    pooled, c = _fit_one(x, y, seed, c_grid)
    info: dict = {"n": int(len(y)), "clarify": int(y.sum()), "pooled_c": c,
                  "per_source": {}}
    by: dict[str, Any] = {}
    if sources is not None:
        for src in sorted(set(sources)):
            idx = [i for i, s in enumerate(sources) if s == src]
            ys = y[idx]
            if min(int(ys.sum()), int(len(ys) - ys.sum())) >= min_per_class:
                by[src], cs = _fit_one(x[idx], ys, seed, c_grid)
                info["per_source"][src] = {"n": len(idx), "c": cs}
    return SurfaceControl(pooled, by, info)


def cross_fitted_scores(examples: Sequence, gold: Sequence[bool], sources: Sequence[str] | None = None,
                        groups: Sequence[str] | None = None, *, folds: int = 5, seed: int = 0,
                        min_per_class: int = 10, features=None) -> list[float]:
    """Out-of-fold control scores of turns that have no separate fitting turns (an evaluation set on its own, a
    user's labels): each fold scored by a control fitted on the others, folds split by ``groups`` (conversation)
    and stratified by label where scikit-learn can. ``features``: rows to fit on instead of
    :func:`surface_features` of ``examples`` (another feature set measured the same way, on the same folds)."""
    import numpy as np
    from sklearn.model_selection import StratifiedGroupKFold

    n = len(examples)
    x = [list(r) for r in features] if features is not None else [surface_features(e) for e in examples]
    if len(x) != n:
        raise ValueError(f"{n} examples but {len(x)} feature rows")
    y = np.array([bool(g) for g in gold], dtype=int)
    out = np.full(n, float(y.mean()) if n else 0.5)
    k = min(folds, int(min(np.bincount(y, minlength=2))) if n else 0)
    if k < 2:
        return [float(v) for v in out]
    grp = list(groups) if groups is not None else [str(i) for i in range(n)]
    split = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(n), y, grp)
    for fit_idx, score_idx in split:
        fit_idx, score_idx = fit_idx.tolist(), score_idx.tolist()
        ctl = fit_features([x[i] for i in fit_idx], [bool(y[i]) for i in fit_idx],
                           [sources[i] for i in fit_idx] if sources is not None else None,
                           seed=seed, min_per_class=min_per_class)
        out[score_idx] = ctl.scores_of([x[i] for i in score_idx],
                                       [sources[i] for i in score_idx] if sources is not None else None)
    return [float(v) for v in out]


def skill_over_control(gold: Sequence[bool], model_scores: Sequence[float], control_scores: Sequence[float],
                       sources: Sequence[str] | None = None, *, model: str = "the model", n_resamples: int = 1000,
                       seed: int = 0, level: float = 0.95) -> dict:
    """The model's skill: its AUROC minus the surface control's on the same turns, with the paired bootstrap interval
    (inside each source and their mean where ``sources`` are given: the headline; on the mix beside it), and a
    one-line verdict that says so when the model does not beat its control."""
    from clarifier.core.metrics import auroc, paired_bootstrap, within_source_summary

    gold = [bool(g) for g in gold]
    systems = {"model": ([False] * len(gold), list(model_scores)), NAME: ([False] * len(gold), list(control_scores))}
    boot = paired_bootstrap(gold, systems, reference=NAME, n_resamples=n_resamples, seed=seed, level=level,
                            sources=sources)["systems"]["model"]
    out: dict = {"control": NAME, "level": level, "n_resamples": n_resamples,
                 "mixed": {"model_auroc": auroc(gold, model_scores), "control_auroc": auroc(gold, control_scores),
                           "interval": boot.get("auroc_diff")}}
    m, c = out["mixed"]["model_auroc"], out["mixed"]["control_auroc"]
    out["mixed"]["skill"] = m - c if m is not None and c is not None else None
    head = out["mixed"]
    if sources is not None:
        ms = within_source_summary(gold, model_scores, sources)["macro_auroc"]
        cs = within_source_summary(gold, control_scores, sources)["macro_auroc"]
        out["within_source"] = {"model_auroc": ms, "control_auroc": cs,
                                "skill": ms - cs if ms is not None and cs is not None else None,
                                "interval": boot.get("macro_auroc_diff")}
        head = out["within_source"]
    out["headline"] = "within_source" if sources is not None else "mixed"
    out["verdict"] = verdict(head, model, "mean within-source AUROC" if sources is not None else "AUROC")
    out["beats_control"] = bool(head["interval"] and head["interval"][0] > 0)
    return out


def verdict(fig: dict, model: str, what: str) -> str:
    skill, iv = fig.get("skill"), fig.get("interval")
    if skill is None:
        return f"{model} vs the surface control: not measurable here (a single class)"
    span = f"[{iv[0]:+.3f}, {iv[1]:+.3f}]" if iv else "[no interval]"
    figs = f"{what} {fig['model_auroc']:.3f} vs the surface control's {fig['control_auroc']:.3f}"
    if iv and iv[0] > 0:
        return f"{model} beats its surface control (position and length only) by {skill:+.3f} {span}: {figs}"
    return (f"{model} does NOT beat its surface control (position and length only): {skill:+.3f} {span}, "
            f"{figs}; its figure may come from where turns sit and how long they are")
