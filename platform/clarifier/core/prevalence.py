"""How many turns really needed clarification, from an imperfect model's flags: the audit's statistics.

A model that flags turns has a recall (sensitivity) below 1 and a false-positive rate above 0, so
the share it flags is biased: with true share ``pi`` it flags ``pi * sens + (1 - pi) * (1 - spec)``.
The Rogan-Gladen estimator inverts that::

    pi = (flagged_share + spec - 1) / (sens + spec - 1)        clipped to [0, 1]

It needs the model to be better than chance (``sens + spec > 1``). Its interval here has two
sources of uncertainty, drawn together in one bootstrap:

* **the logs**: turns of one conversation are not independent, so conversations (hashed into
  ``buckets`` on the cluster side) are resampled with replacement, not turns;
* **the model's error rates**: ``sens`` and ``spec`` were measured on a finite labelled set
  (an evaluation report, labelled turns in the logs, or the model's calibration split), so each
  replicate draws them from their Beta(count + 1/2) posteriors (Jeffreys) instead of using the
  point values. The interval is therefore wider than the raw flagged share's, as it must be.

The correction assumes the model's error rates on the audited turns are those it was measured
with; on logs unlike its evaluation set that is the weakest link (see the report's wording), and
labelled turns from the same logs are the remedy. Pure numpy: no Ray, no MLflow.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class ErrorRates:
    """The model's confusion counts at its decision threshold on a labelled set, and where they come from."""

    tp: int
    fn: int
    tn: int
    fp: int
    source: str = ""

    def __post_init__(self):
        for k in ("tp", "fn", "tn", "fp"):
            if int(getattr(self, k)) < 0:
                raise ValueError(f"error-rate count {k} is negative ({getattr(self, k)})")

    @property
    def sensitivity(self) -> float | None:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else None

    @property
    def specificity(self) -> float | None:
        return self.tn / (self.tn + self.fp) if self.tn + self.fp else None

    @property
    def youden_j(self) -> float | None:
        """recall - false-positive rate: how much the flags tell the classes apart (0 = chance)."""
        s, p = self.sensitivity, self.specificity
        return None if s is None or p is None else s + p - 1

    @property
    def usable(self) -> bool:
        """Both classes were measured and the point estimates are better than chance."""
        s, p = self.sensitivity, self.specificity
        return s is not None and p is not None and s + p > 1

    def as_dict(self) -> dict:
        return {**asdict(self), "recall": self.sensitivity, "false_positive_rate":
                None if self.specificity is None else 1 - self.specificity}


def confusion_at(scores, gold, threshold: float, source: str = "") -> ErrorRates:
    """The confusion counts of ``score >= threshold`` against boolean ``gold`` labels."""
    s, g = np.asarray(scores, dtype=float), np.asarray(gold, dtype=bool)
    flag = s >= threshold
    return ErrorRates(tp=int(np.sum(flag & g)), fn=int(np.sum(~flag & g)), tn=int(np.sum(~flag & ~g)),
                      fp=int(np.sum(flag & ~g)), source=source)


def youden_threshold(scores, gold) -> tuple[float, float]:
    """``(threshold, J)``: the threshold maximising ``recall - false-positive rate`` (Youden's J) of
    ``score >= threshold``; the midpoint between neighbouring scores, so it does not sit on a turn.
    Needs both classes."""
    s, g = np.asarray(scores, dtype=float), np.asarray(gold, dtype=bool)
    pos, neg = int(g.sum()), int((~g).sum())
    if not pos or not neg:
        raise ValueError(f"Youden's J needs both classes ({pos} positive, {neg} negative labels)")
    order = np.argsort(-s, kind="stable")
    s, g = s[order], g[order]
    tp, fp = np.cumsum(g), np.cumsum(~g)  # flagging the top i+1 scores
    last = np.r_[s[1:] != s[:-1], True]  # cut only between distinct scores
    j = tp / pos - fp / neg
    j = np.where(last, j, -np.inf)
    i = int(np.argmax(j))
    if j[i] <= 0:
        return float(np.nextafter(s[0], np.inf)), 0.0  # nothing separates: flag nothing
    thr = (s[i] + s[i + 1]) / 2 if i + 1 < s.size else float(np.nextafter(s[i], -np.inf))
    return float(thr), float(j[i])


def rogan_gladen(observed, sensitivity, specificity):
    """The true share from the observed (flagged) share; NaN where ``sens + spec <= 1`` (not identifiable).

    Works on scalars and numpy arrays alike; results are clipped to [0, 1].
    """
    obs, sens, spec = (np.asarray(x, dtype=float) for x in (observed, sensitivity, specificity))
    den = sens + spec - 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        est = np.where(den > 0, (obs + spec - 1.0) / np.where(den > 0, den, 1.0), np.nan)
    est = np.clip(est, 0.0, 1.0)
    return float(est) if est.ndim == 0 else est


def _interval(values: np.ndarray, confidence: float) -> list[float] | None:
    v = values[np.isfinite(values)]
    if not v.size:
        return None
    a = (1.0 - confidence) / 2.0
    return [float(np.quantile(v, a)), float(np.quantile(v, 1.0 - a))]


def share_estimate(flagged, turns, rates: ErrorRates | None = None, *, bootstrap: int = 1000,
                   confidence: float = 0.95, seed: int = 0) -> dict:
    """The flagged share of ``turns`` with its interval, and (with usable ``rates``) the corrected share.

    ``flagged[i]`` / ``turns[i]`` are the counts of bucket ``i`` (a hash bucket of conversations;
    empty buckets are ignored). Returns ``n``, ``flagged``, ``raw``, ``raw_ci``, ``corrected``,
    ``corrected_ci`` (None without usable rates), ``unidentifiable_share`` (replicates whose drawn
    error rates were no better than chance; the interval is of the others) and ``buckets``.
    """
    k = np.asarray(flagged, dtype=float)
    n = np.asarray(turns, dtype=float)
    if k.shape != n.shape:
        raise ValueError(f"flagged and turns differ in length ({k.shape} vs {n.shape})")
    if np.any(k < 0) or np.any(k > n):
        raise ValueError("every bucket needs 0 <= flagged <= turns")
    keep = n > 0
    k, n = k[keep], n[keep]
    out = {"n": int(n.sum()), "flagged": int(k.sum()), "raw": None, "raw_ci": None, "corrected": None,
           "corrected_ci": None, "unidentifiable_share": None, "buckets": int(n.size), "confidence": confidence}
    if not n.size:
        return out
    raw = float(k.sum() / n.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n.size, size=(bootstrap, n.size))
    kb, nb = k[idx].sum(axis=1), n[idx].sum(axis=1)
    raw_b = np.divide(kb, nb, out=np.full(bootstrap, np.nan), where=nb > 0)
    out.update(raw=raw, raw_ci=_interval(raw_b, confidence))
    if rates is not None and rates.usable:
        sens_b = rng.beta(rates.tp + 0.5, rates.fn + 0.5, size=bootstrap)
        spec_b = rng.beta(rates.tn + 0.5, rates.fp + 0.5, size=bootstrap)
        corr_b = rogan_gladen(raw_b, sens_b, spec_b)
        out.update(corrected=rogan_gladen(raw, rates.sensitivity, rates.specificity),
                   corrected_ci=_interval(corr_b, confidence),
                   unidentifiable_share=float(np.mean(~np.isfinite(corr_b))))
    return out


def best_estimate(est: dict) -> tuple[float | None, list[float] | None, bool]:
    """``(value, interval, corrected?)``: the corrected share when there is one, else the raw share."""
    if est.get("corrected") is not None and est.get("corrected_ci"):
        return est["corrected"], est["corrected_ci"], True
    return est.get("raw"), est.get("raw_ci"), False


def verdict(est: dict, rule: float, *, what: str = "of failed turns needed clarification",
            rates: ErrorRates | None = None, min_j: float = 0.1, require_correction: bool = False) -> dict:
    """The rule's answer for one estimate: ``worth_it`` (interval above ``rule``), ``not_worth_it``
    (below), ``inconclusive`` (it contains ``rule``), ``undetermined`` (the model's measured error
    rates tell the classes apart by less than ``min_j`` = recall - false-positive rate: its flags say
    next to nothing about the share, and the corrected interval, clipped at 0 and 1, would understate
    that; with ``require_correction``, also when there are no error rates at all) or ``no_data``, and
    the sentence saying so."""
    value, ci, corrected = best_estimate(est)
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    if value is None or ci is None:
        return {"decision": "no_data", "rule": rule, "corrected": corrected,
                "sentence": f"No turns to estimate the share {what}: the verdict needs turns with a failure signal."}
    if rates is None and require_correction and not corrected:
        return {"decision": "undetermined", "rule": rule, "corrected": False, "value": value, "interval": ci,
                "sentence": f"Undetermined: there are no error rates for this model (no labelled turns in the logs, "
                            f"no evaluation report, no calibration counts stored with it), so its raw flagged share "
                            f"({pct(value)}) cannot be corrected. Pass --eval-report (a `clarifier eval` report.json "
                            "of this model) or label some turns; audit.error_rates=none accepts the raw share."}
    if rates is not None and (rates.youden_j is None or rates.youden_j < min_j):
        s, p = rates.sensitivity, rates.specificity
        measured = (f"recall {s:.2f}, false-positive rate {1 - p:.2f}" if s is not None and p is not None
                    else "one class has no labelled turns")
        return {"decision": "undetermined", "rule": rule, "corrected": corrected, "value": value, "interval": ci,
                "sentence": f"Undetermined: the model's measured error rates ({rates.source or 'labelled turns'}: "
                            f"{measured}) hardly tell the classes apart (recall - false-positive rate < {min_j:g}), "
                            f"so its flags ({pct(est.get('raw') or 0.0)} of these turns) say next to nothing about how "
                            f"many turns {what.removeprefix('of ')}. Audit with a model that separates the classes on "
                            "these logs (audit.threshold=youden with labelled turns picks the threshold that "
                            "separates them best), or label more turns."}
    level = f"{round(100 * est.get('confidence', 0.95))}%"
    basis = "corrected for the model's error rates" if corrected else "raw flagged share, NOT corrected for the model's error rates"
    head = f"An estimated {pct(value)} ({level} interval {pct(ci[0])}-{pct(ci[1])}; {basis}) {what}"
    if ci[0] > rule:
        decision, tail = "worth_it", f"above the {pct(rule)} rule: a dedicated clarification model is likely worth it."
    elif ci[1] < rule:
        decision, tail = "not_worth_it", f"below the {pct(rule)} rule: a dedicated clarification model is unlikely to pay off."
    else:
        decision, tail = "inconclusive", (f"the interval contains the {pct(rule)} rule: audit more turns, or label a "
                                          "sample of these logs to measure the model's error rates on them.")
    return {"decision": decision, "rule": rule, "corrected": corrected, "value": value, "interval": ci,
            "sentence": f"{head}; {tail}"}
