"""Decision-threshold calibration on a dev split: the threshold is stored with the model.

Either maximise dev F1 of "clarify" (ties go to the higher threshold: less over-asking), or, with
``max_over_asking``, take the best recall whose over-asking rate on clear dev turns stays within
that budget. The chosen value is written into the model folder's ``clarifier.json`` so evaluation
and serving use it.
"""

from __future__ import annotations

from pathlib import Path

from clarifier.core.metrics import decision_metrics, pick_threshold, threshold_sweep


def best_f1_threshold(gold: list[bool], scores: list[float]) -> float:
    """Threshold maximising F1; placed halfway to the next lower score so it is not fit to one point."""
    rows = threshold_sweep(gold, scores)
    if not rows or not any(gold):
        return 0.5
    best = max(rows, key=lambda r: (r["f1"], r["threshold"]))
    lower = [r["threshold"] for r in rows if r["threshold"] < best["threshold"]]
    return (best["threshold"] + max(lower)) / 2 if lower else best["threshold"]


def choose_threshold(gold: list[bool], scores: list[float], max_over_asking: float | None = None) -> tuple[float, str]:
    """The calibration rule, on scores already computed: ``(threshold, rule name)``."""
    if max_over_asking is None:
        thr, rule = best_f1_threshold(gold, scores), "max_f1"
    else:
        thr, rule = pick_threshold(gold, scores, max_over_asking), f"over_asking<={max_over_asking}"
    return float(min(max(thr, 0.0), 1.0)), rule


def calibrate_model(folder: str | Path, examples, *, max_over_asking: float | None = None, cache_dir=None,
                    batch_size: int = 8, progress=print, precision: str = "auto", split: str = "dev",
                    scores: list[float] | None = None) -> dict:
    """Score ``examples`` with the model in ``folder`` (in ``precision``, as evaluation and serving
    load it) -- or take their ``scores`` when already computed by that model -- choose a threshold,
    store it; returns a summary."""
    from dataclasses import replace

    from clarifier.engine.inference import read_meta, write_meta

    meta = read_meta(folder)
    if scores is None:
        from clarifier.engine.loading import load_engine

        engine = load_engine(folder, cache_dir=cache_dir, precision=precision)
        scores, precision = engine.score_examples(examples, batch_size), engine.precision
    gold = [e.needs_clarification for e in examples]
    thr, rule = choose_threshold(gold, scores, max_over_asking)
    dm = decision_metrics(gold, [s >= thr for s in scores])
    counts = {"split": split, "n": dm["n"], "tp": dm["tp"], "fn": dm["fn"], "tn": dm["tn"], "fp": dm["fp"], "rule": rule}
    write_meta(folder, replace(meta, threshold=thr, calibration=counts))
    decided = "decision head" if meta.decision_head else "decision tokens"
    progress(f"[calibrate] threshold {thr:.3f} ({rule}) from {len(examples)} dev examples "
             f"({sum(gold)} need clarification), scored in {precision} by the {decided}")
    return {"threshold": thr, "rule": rule, "n": len(examples), "positives": sum(gold), "precision": precision,
            "counts": counts}
