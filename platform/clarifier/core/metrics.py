"""Evaluation metrics for the clarification decision, the question and its grounding.

Pure Python (plus ``rouge-score`` and ``sacrebleu`` for the question metrics): no Ray, no MLflow,
no torch, so it runs anywhere the evaluation set can be read.

Conventions used throughout:

* The positive class is "clarify" (``needs_clarification`` true).
* **0/0 is 0.0.** A ratio whose denominator is zero (precision with no predicted clarifications,
  recall with no gold clarifications, over-asking with no gold-clear turns, ...) is reported as
  ``0.0`` rather than NaN, so reports stay JSON-serialisable and comparable. Look at the counts
  (``tp``/``fp``/``fn``/``tn``/``n``) to tell "0 because empty" from "0 because wrong".
* Metrics that are *undefined* rather than zero -- AUROC with a single gold class, question or
  grounding metrics over zero rows -- are ``None``.
* ``rougeL_f`` is on a 0-1 scale; ``bleu`` and ``chrf`` keep sacrebleu's 0-100 scale;
  ``semantic_similarity`` is a mean cosine similarity (-1..1) from a caller-supplied sentence
  encoder (``clarifier.engine.similarity.SentenceEncoder().similarity``), None when none is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from clarifier.core.schema import Example

SimilarityFn = Callable[[list, list], Sequence[float]]


@dataclass
class Prediction:
    """What a model (or baseline) said about one example."""

    needs_clarification: bool
    confidence: float  # P(clarify)
    question: str | None = None
    grounding_turns: tuple[int, ...] = ()
    grounding_passages: tuple[str, ...] = ()
    valid: bool = True  # output parsed into the target format


def _ratio(num: float, den: float) -> float:
    """``num / den`` with the module's 0/0 = 0.0 convention."""
    return float(num) / float(den) if den else 0.0


def _check_same_length(a: Sequence, b: Sequence, what_a: str, what_b: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"{what_a} and {what_b} differ in length ({len(a)} != {len(b)})")


def _scores(scores: Sequence[float]) -> list[float]:
    out = [float(s) for s in scores]
    bad = [s for s in out if math.isnan(s)]
    if bad:
        raise ValueError("scores contain NaN")
    return out


# ---- decision --------------------------------------------------------------------------------


def decision_metrics(gold: Sequence[bool], pred: Sequence[bool]) -> dict:
    """Precision/recall/F1 of the "clarify" class, accuracy, over- and under-asking rates.

    * ``over_asking_rate`` = fp / (fp + tn): share of gold-clear turns the model asked about.
    * ``under_asking_rate`` = fn / (fn + tp): share of gold-clarify turns it answered directly
      (``1 - recall`` whenever there is a gold-clarify turn).
    * ``macro_f1`` = mean of the F1 of "clarify" and of "answer" (the ask-vs-answer figure published
      papers report, e.g. CollabLLM on Abg-CoQA; their "accuracy on ambiguous / non-ambiguous turns"
      is ``recall`` / ``1 - over_asking_rate``).

    Every ratio with a zero denominator is 0.0 (see module docstring); ``n == 0`` gives all zeros.
    """
    _check_same_length(gold, pred, "gold", "pred")
    tp = fp = fn = tn = 0
    for g, p in zip(gold, pred):
        g, p = bool(g), bool(p)
        if g and p:
            tp += 1
        elif p:
            fp += 1
        elif g:
            fn += 1
        else:
            tn += 1
    precision = _ratio(tp, tp + fp)
    recall = _ratio(tp, tp + fn)
    f1 = _ratio(2 * precision * recall, precision + recall)
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "macro_f1": (f1 + _ratio(2 * tn, 2 * tn + fn + fp)) / 2,
        "accuracy": _ratio(tp + tn, tp + fp + fn + tn),
        "over_asking_rate": _ratio(fp, fp + tn),
        "under_asking_rate": _ratio(fn, fn + tp),
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "tn": tn,
        "n": tp + fp + fn + tn,
    }


def logit(p: float, eps: float = 1e-6) -> float:
    """Log-odds of a probability, clipped to ``[eps, 1 - eps]`` (scores stacked with other features, distances
    from a threshold)."""
    p = min(max(float(p), eps), 1 - eps)
    return math.log(p / (1 - p))


def auroc(gold: Sequence[bool], scores: Sequence[float]) -> float | None:
    """Area under the ROC curve of ``scores`` for the clarify class; None with a single gold class.

    Computed as the Mann-Whitney U statistic with average ranks, so tied scores count one half.
    """
    _check_same_length(gold, scores, "gold", "scores")
    s = _scores(scores)
    n_pos = sum(1 for g in gold if g)
    n_neg = len(s) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = sorted(range(len(s)), key=lambda i: s[i])
    ranks = [0.0] * len(s)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and s[order[j + 1]] == s[order[i]]:
            j += 1
        avg = (i + j) / 2.0 + 1.0  # 1-based average rank of the tie group
        for k in range(i, j + 1):
            ranks[order[k]] = avg
        i = j + 1
    rank_sum = sum(r for r, g in zip(ranks, gold) if g)
    u = rank_sum - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


def calibration_bins(gold: Sequence[bool], scores: Sequence[float], bins: int = 10) -> list[dict]:
    """Equal-width confidence bins over [0, 1] for a reliability plot.

    Bin ``b`` holds scores in ``[b/bins, (b+1)/bins)``; the last bin also holds 1.0. Each row has
    ``lower``, ``upper``, ``count``, ``mean_confidence`` and ``observed_rate`` (share of gold
    clarify); the two means are None for an empty bin. Scores must lie in [0, 1].
    """
    _check_same_length(gold, scores, "gold", "scores")
    if bins < 1:
        raise ValueError("bins must be >= 1")
    s = _scores(scores)
    out_of_range = [x for x in s if x < 0.0 or x > 1.0]
    if out_of_range:
        raise ValueError(f"calibration needs probabilities in [0, 1], got {out_of_range[0]}")
    counts = [0] * bins
    conf_sum = [0.0] * bins
    pos_sum = [0] * bins
    for g, x in zip(gold, s):
        b = min(int(x * bins), bins - 1)
        counts[b] += 1
        conf_sum[b] += x
        pos_sum[b] += 1 if g else 0
    return [
        {
            "lower": b / bins,
            "upper": (b + 1) / bins,
            "count": counts[b],
            "mean_confidence": conf_sum[b] / counts[b] if counts[b] else None,
            "observed_rate": pos_sum[b] / counts[b] if counts[b] else None,
        }
        for b in range(bins)
    ]


def expected_calibration_error(gold: Sequence[bool], scores: Sequence[float], bins: int = 10) -> float:
    """ECE: sum over equal-width bins of ``|bin| / n * |mean confidence - observed clarify rate|``.

    Uses the bins of :func:`calibration_bins`; 0.0 for empty input (0/0 convention).
    """
    rows = calibration_bins(gold, scores, bins)
    n = sum(r["count"] for r in rows)
    if n == 0:
        return 0.0
    return sum(
        r["count"] / n * abs(r["mean_confidence"] - r["observed_rate"]) for r in rows if r["count"]
    )


def threshold_sweep(gold: Sequence[bool], scores: Sequence[float]) -> list[dict]:
    """Decision metrics at every distinct score used as threshold (clarify iff score >= t).

    Rows are sorted by ascending threshold and carry ``threshold``, ``precision``, ``recall``,
    ``f1``, ``over_asking_rate`` and the ``tp``/``fp`` counts: the points of a precision-recall
    curve and of an over-asking-vs-recall curve. Empty input gives an empty list.
    """
    _check_same_length(gold, scores, "gold", "scores")
    s = _scores(scores)
    n_pos = sum(1 for g in gold if g)
    n_neg = len(s) - n_pos
    pairs = sorted(zip(s, (bool(g) for g in gold)), key=lambda p: -p[0])
    rows: list[dict] = []
    tp = fp = 0
    i = 0
    while i < len(pairs):
        t = pairs[i][0]
        while i < len(pairs) and pairs[i][0] == t:
            if pairs[i][1]:
                tp += 1
            else:
                fp += 1
            i += 1
        precision = _ratio(tp, tp + fp)
        recall = _ratio(tp, n_pos)
        rows.append(
            {
                "threshold": t,
                "precision": precision,
                "recall": recall,
                "f1": _ratio(2 * precision * recall, precision + recall),
                "over_asking_rate": _ratio(fp, n_neg),
                "tp": tp,
                "fp": fp,
            }
        )
    rows.reverse()
    return rows


def pick_threshold(gold: Sequence[bool], scores: Sequence[float], max_over_asking: float) -> float:
    """The operating threshold with the highest recall whose over-asking rate is within budget.

    Candidates are the distinct scores (clarify iff score >= threshold). Over-asking and recall
    both fall as the threshold rises, so this is the lowest threshold within the budget -- except
    that among thresholds with the same (maximal) recall the one with the least over-asking (the
    highest) is returned, since lowering further only adds over-asking. When even the highest
    score over-asks beyond the budget, a threshold just above the highest score is returned
    (never clarify: over-asking 0). Raises ValueError on empty input or a negative budget.
    """
    if max_over_asking < 0:
        raise ValueError("max_over_asking must be >= 0")
    rows = threshold_sweep(gold, scores)
    if not rows:
        raise ValueError("cannot pick a threshold without scores")
    ok = [r for r in rows if r["over_asking_rate"] <= max_over_asking]
    if not ok:
        return math.nextafter(rows[-1]["threshold"], math.inf)
    best_recall = max(r["recall"] for r in ok)
    best = [r for r in ok if r["recall"] == best_recall]
    return max(best, key=lambda r: (-r["over_asking_rate"], r["threshold"]))["threshold"]


OVER_ASKING_BUDGETS = (0.05, 0.10)


def recall_at_over_asking(gold: Sequence[bool], scores: Sequence[float], budget: float) -> float | None:
    """The best recall of any threshold whose over-asking rate (FP / clear turns) is <= ``budget``.

    Threshold-free (an operating point on the test set itself, like AUROC): "if we may bother at
    most 5% of clear turns, how many ambiguous turns can this score catch?". 0.0 when even the
    highest score over-asks beyond the budget; None without both classes.
    """
    if budget < 0:
        raise ValueError("budget must be >= 0")
    if not any(gold) or all(gold):
        return None
    ok = [r["recall"] for r in threshold_sweep(gold, scores) if r["over_asking_rate"] <= budget]
    return max(ok, default=0.0)


def operating_point_at_over_asking(gold: Sequence[bool], scores: Sequence[float], budget: float) -> dict | None:
    """Decision metrics at the best-recall threshold whose over-asking stays within ``budget``, chosen
    on these very scores (threshold-free, like :func:`recall_at_over_asking`): ``threshold``,
    ``recall``, ``precision``, ``f1``, ``over_asking_rate``. None without both classes."""
    if not any(gold) or all(gold):
        return None
    t = pick_threshold(gold, scores, budget)
    d = decision_metrics(gold, [float(s) >= t for s in scores])
    return {"threshold": t, **{k: d[k] for k in ("recall", "precision", "f1", "over_asking_rate")}}


def source_only_scores(train_sources: Sequence[str], train_gold: Sequence[bool], sources: Sequence[str]) -> list[float]:
    """The *source-only control*: each turn scored by the clarify share of its source in the training
    data (a source unseen there gets the overall share). Its AUROC on a mixed set is how much a
    mixed figure can come from knowing which dataset a turn belongs to; within one source it is 0.5."""
    _check_same_length(train_sources, train_gold, "train_sources", "train_gold")
    pos: dict[str, int] = {}
    tot: dict[str, int] = {}
    for s, g in zip(train_sources, train_gold):
        tot[s] = tot.get(s, 0) + 1
        pos[s] = pos.get(s, 0) + (1 if g else 0)
    overall = _ratio(sum(pos.values()), sum(tot.values()))
    return [_ratio(pos[s], tot[s]) if s in tot else overall for s in sources]


def source_only_auroc(sources: Sequence[str], gold: Sequence[bool]) -> float | None:
    """AUROC of the source-only control fitted and scored on the same mix: 0.5 when every source has
    the same clarify share (the source predicts nothing), higher the more the share differs."""
    return auroc(gold, source_only_scores(sources, gold, sources))


def source_only_auroc_from_counts(by_source: dict[str, dict]) -> float | None:
    """:func:`source_only_auroc` from per-source counts ``{source: {"examples": n, "clarify": k}}``
    (a data manifest's ``counts.splits.<split>.by_source``), without expanding them into rows."""
    cells = [(_ratio(int(c["clarify"]), int(c["examples"])), int(c["clarify"]), int(c["examples"]) - int(c["clarify"]))
             for c in by_source.values() if int(c["examples"])]
    n_pos, n_neg = sum(c[1] for c in cells), sum(c[2] for c in cells)
    if not n_pos or not n_neg:
        return None
    wins = sum(pi * nj * (1.0 if si > sj else 0.5 if si == sj else 0.0)
               for si, pi, _ in cells for sj, _, nj in cells)
    return wins / (n_pos * n_neg)


def within_source_summary(gold: Sequence[bool], scores: Sequence[float], sources: Sequence[str],
                          budget: float = 0.10) -> dict:
    """The headline figures: AUROC, recall and F1 at an over-asking ``budget`` *inside each source*
    and their unweighted means (``macro``) -- figures a model cannot reach by telling sources apart.

    ``by_source[s]`` has ``n``, ``clarify``, ``auroc``, ``recall_at_budget``, ``f1_at_budget`` (both
    at the best-recall threshold within the budget, chosen on that source's own scores); a source
    with a single gold class has None there and is left out of the means (``sources_scored``).
    """
    _check_same_length(gold, scores, "gold", "scores")
    _check_same_length(gold, sources, "gold", "sources")
    by: dict[str, dict] = {}
    for src in sorted(set(sources)):
        idx = [i for i, s in enumerate(sources) if s == src]
        g, sc = [bool(gold[i]) for i in idx], [float(scores[i]) for i in idx]
        op = operating_point_at_over_asking(g, sc, budget)
        by[src] = {"n": len(idx), "clarify": sum(g), "auroc": auroc(g, sc),
                   "recall_at_budget": op["recall"] if op else None, "f1_at_budget": op["f1"] if op else None}

    def mean(key: str) -> float | None:
        vals = [v[key] for v in by.values() if v[key] is not None]
        return sum(vals) / len(vals) if vals else None

    return {"budget": budget, "by_source": by, "macro_auroc": mean("auroc"),
            "macro_recall_at_budget": mean("recall_at_budget"), "macro_f1_at_budget": mean("f1_at_budget"),
            "min_auroc": min((v["auroc"] for v in by.values() if v["auroc"] is not None), default=None),
            "sources_scored": sorted(s for s, v in by.items() if v["auroc"] is not None)}


def decisions_by_source(gold: Sequence[bool], decided: Sequence[bool], sources: Sequence[str]) -> dict[str, dict]:
    """:func:`decision_metrics` of the decisions as made (one threshold for all) inside each source.

    Where :func:`within_source_summary` asks how well a model *ranks* inside a source, this says
    what its operating point does there: a source with an over-asking of 0.6 is one whose clear
    turns the model mostly asks about, whatever its mixed-set figure.
    """
    _check_same_length(gold, decided, "gold", "decided")
    _check_same_length(gold, sources, "gold", "sources")
    out: dict[str, dict] = {}
    for src in sorted(set(sources)):
        idx = [i for i, s in enumerate(sources) if s == src]
        out[src] = decision_metrics([gold[i] for i in idx], [decided[i] for i in idx])
    return out


# ---- question --------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _rouge():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def question_metrics(refs: Sequence[str], hyps: Sequence[str]) -> dict:
    """ROUGE-L F (mean over pairs, 0-1), corpus BLEU and chrF (sacrebleu, 0-100) of questions.

    The caller restricts the pairs to true positives (gold and model both ask). With no pairs the
    metrics are None and ``n`` is 0.
    """
    _check_same_length(refs, hyps, "refs", "hyps")
    n = len(refs)
    if n == 0:
        return {"rougeL_f": None, "bleu": None, "chrf": None, "n": 0}
    import sacrebleu

    refs = [str(r) for r in refs]
    hyps = [str(h) for h in hyps]
    scorer = _rouge()
    rouge = sum(scorer.score(r, h)["rougeL"].fmeasure for r, h in zip(refs, hyps)) / n
    return {
        "rougeL_f": rouge,
        "bleu": float(sacrebleu.corpus_bleu(hyps, [refs]).score),
        "chrf": float(sacrebleu.corpus_chrf(hyps, [refs]).score),
        "n": n,
    }


def semantic_similarity(refs: Sequence[str], hyps: Sequence[str], similarity_fn: SimilarityFn | None) -> float | None:
    """Mean of ``similarity_fn(refs, hyps)`` (pairwise cosine similarities); None with no pairs or no fn."""
    _check_same_length(refs, hyps, "refs", "hyps")
    if similarity_fn is None or not refs:
        return None
    sims = [float(x) for x in similarity_fn([str(r) for r in refs], [str(h) for h in hyps])]
    if len(sims) != len(refs):
        raise ValueError(f"similarity_fn returned {len(sims)} values for {len(refs)} pairs")
    return sum(sims) / len(sims)


# ---- grounding -------------------------------------------------------------------------------


def grounding_metrics(gold_sets: Sequence[Iterable], pred_sets: Sequence[Iterable]) -> dict:
    """Exact set match and mean set-F1 of grounding references (turn indexes or passage ids).

    Only rows whose gold grounding is annotated (non-empty) are scored; ``skipped`` counts the
    others. Set-F1 of a row with an empty prediction is 0.0. With no scored rows the metrics are
    None.
    """
    _check_same_length(gold_sets, pred_sets, "gold_sets", "pred_sets")
    em = f1 = 0.0
    n = skipped = 0
    for g, p in zip(gold_sets, pred_sets):
        g, p = set(g or ()), set(p or ())
        if not g:
            skipped += 1
            continue
        n += 1
        inter = len(g & p)
        precision = _ratio(inter, len(p))
        recall = _ratio(inter, len(g))
        f1 += _ratio(2 * precision * recall, precision + recall)
        em += 1.0 if g == p else 0.0
    return {
        "exact_match": em / n if n else None,
        "f1": f1 / n if n else None,
        "n": n,
        "skipped": skipped,
    }


# ---- all together ----------------------------------------------------------------------------


def evaluate_predictions(
    examples: Sequence["Example"], preds: Sequence[Prediction], threshold: float | None = None,
    similarity_fn: SimilarityFn | None = None,
) -> dict:
    """All metrics of one model (or baseline) on an evaluation set.

    Decisions are ``confidence >= threshold`` when ``threshold`` is given, else each prediction's
    ``needs_clarification``. Question and grounding metrics are computed on the true positives
    (gold clarify and predicted clarify) that have a gold question (not ``decision_only``); the question metrics additionally need a non-empty
    predicted question (``question.missing`` counts true positives without one). With
    ``similarity_fn`` (pairwise cosine similarity of two equal-length string lists) the mean
    ``question.semantic_similarity`` of those same pairs is added (None without it). Grounding of
    turns is under ``grounding``, of passages under ``grounding_passages``.

    ``within_source`` (:func:`within_source_summary`, sources by ``core.schema.source_of``) holds the
    figures a model cannot reach by telling datasets apart: report them first on a mixed set;
    ``decision_by_source`` (:func:`decisions_by_source`) what the decisions as made do inside each.

    Raises ValueError when ``examples`` and ``preds`` differ in length.
    """
    _check_same_length(examples, preds, "examples", "preds")
    gold = [bool(ex.needs_clarification) for ex in examples]
    scores = [float(p.confidence) for p in preds]
    if threshold is None:
        decided = [bool(p.needs_clarification) for p in preds]
    else:
        decided = [s >= threshold for s in scores]

    tp_idx = [i for i, (g, d) in enumerate(zip(gold, decided)) if g and d]
    # Decision-only positives have no gold question or grounding: they count for the decision only.
    tp_idx = [i for i in tp_idx if not getattr(examples[i], "decision_only", False)]
    q_idx = [i for i in tp_idx if (preds[i].question or "").strip()]
    question = question_metrics(
        [examples[i].clarifying_question or "" for i in q_idx],
        [preds[i].question or "" for i in q_idx],
    )
    question["semantic_similarity"] = semantic_similarity(
        [examples[i].clarifying_question or "" for i in q_idx], [preds[i].question or "" for i in q_idx], similarity_fn
    )
    question["missing"] = len(tp_idx) - len(q_idx)

    n = len(preds)
    n_valid = sum(1 for p in preds if p.valid)
    from clarifier.core.schema import source_of

    sources = [source_of(e) for e in examples]

    return {
        "n": n,
        "threshold": threshold,
        "decision": decision_metrics(gold, decided),
        "auroc": auroc(gold, scores),
        "within_source": within_source_summary(gold, scores, sources),
        "decision_by_source": decisions_by_source(gold, decided, sources),
        "recall_at_over_asking": {f"{b:g}": recall_at_over_asking(gold, scores, b) for b in OVER_ASKING_BUDGETS},
        "ece": expected_calibration_error(gold, scores),
        "question": question,
        "grounding": grounding_metrics(
            [examples[i].grounding_turns for i in tp_idx], [preds[i].grounding_turns for i in tp_idx]
        ),
        "grounding_passages": grounding_metrics(
            [examples[i].grounding_passages for i in tp_idx],
            [preds[i].grounding_passages for i in tp_idx],
        ),
        "validity": _ratio(n_valid, n),
        "n_invalid": n - n_valid,
    }


# ---- uncertainty -----------------------------------------------------------------------------


def paired_bootstrap(
    gold: Sequence[bool], systems: dict[str, tuple[Sequence[bool], Sequence[float]]], reference: str | None = None,
    n_resamples: int = 1000, seed: int = 0, level: float = 0.95, sources: Sequence[str] | None = None,
) -> dict[str, dict]:
    """Percentile bootstrap intervals of decision F1 and AUROC, paired across systems.

    Every resample draws the same example indexes for all systems, so the interval of a
    *difference* (``f1_diff`` / ``auroc_diff``: system minus ``reference``) accounts for the
    examples being shared; a difference whose interval contains 0 is not a measured difference.
    ``systems`` maps a name to ``(decisions, scores)``. Resamples with a single gold class have no
    AUROC and are left out of its interval. With ``sources`` (one per example) every resample draws
    inside each source (each keeps its size) and the mean within-source AUROC is resampled too
    (``macro_auroc`` / ``macro_auroc_diff``): the headline figure, with its interval. Deterministic
    for a given ``seed``.
    """
    import random

    n = len(gold)
    for name, (dec, sc) in systems.items():
        _check_same_length(gold, dec, "gold", f"{name} decisions")
        _check_same_length(gold, sc, "gold", f"{name} scores")
    if sources is not None:
        _check_same_length(gold, sources, "gold", "sources")
    if reference is not None and reference not in systems:
        raise ValueError(f"reference {reference!r} is not among the systems {sorted(systems)}")
    rng = random.Random(seed)
    strata = ([[i for i, s in enumerate(sources) if s == src] for src in sorted(set(sources))] if sources is not None
              else [list(range(n))])
    keys = ("f1", "auroc", "f1_diff", "auroc_diff") + (("macro_auroc", "macro_auroc_diff") if sources is not None else ())
    draws: dict[str, dict[str, list[float]]] = {k: {key: [] for key in keys} for k in systems}
    for _ in range(n_resamples if n else 0):
        parts = [[group[rng.randrange(len(group))] for _ in group] for group in strata]
        idx = [i for part in parts for i in part]
        g = [gold[i] for i in idx]
        vals = {}
        for name, (dec, sc) in systems.items():
            f1 = decision_metrics(g, [dec[i] for i in idx])["f1"]
            au = auroc(g, [sc[i] for i in idx])
            macro = None
            if sources is not None:
                per = [auroc([gold[i] for i in part], [sc[i] for i in part]) for part in parts]
                per = [a for a in per if a is not None]
                macro = sum(per) / len(per) if per else None
                if macro is not None:
                    draws[name]["macro_auroc"].append(macro)
            vals[name] = (f1, au, macro)
            draws[name]["f1"].append(f1)
            if au is not None:
                draws[name]["auroc"].append(au)
        if reference is not None:
            rf, ra, rm = vals[reference]
            for name, (f1, au, macro) in vals.items():
                draws[name]["f1_diff"].append(f1 - rf)
                if au is not None and ra is not None:
                    draws[name]["auroc_diff"].append(au - ra)
                if macro is not None and rm is not None:
                    draws[name]["macro_auroc_diff"].append(macro - rm)

    def interval(xs: list[float]) -> list[float] | None:
        if not xs:
            return None
        xs = sorted(xs)
        lo = xs[int((1 - level) / 2 * (len(xs) - 1))]
        hi = xs[int(round((1 + level) / 2 * (len(xs) - 1)))]
        return [round(lo, 4), round(hi, 4)]

    out = {}
    for name, d in draws.items():
        out[name] = {"f1": interval(d["f1"]), "auroc": interval(d["auroc"])}
        if sources is not None:
            out[name]["macro_auroc"] = interval(d["macro_auroc"])
        if reference is not None and name != reference:
            out[name]["f1_diff"] = interval(d["f1_diff"])
            out[name]["auroc_diff"] = interval(d["auroc_diff"])
            if sources is not None:
                out[name]["macro_auroc_diff"] = interval(d["macro_auroc_diff"])
    return {"reference": reference, "n_resamples": n_resamples, "level": level, "seed": seed,
            "stratified_by_source": sources is not None, "systems": out}
