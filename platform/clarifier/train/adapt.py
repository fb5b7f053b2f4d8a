"""Fit a model's decision head to one's own labelled turns: ``clarifier adapt``.

The public clarification sets disagree about what makes a turn need a question (README, leave-one-dataset-out):
a model trained on them ranks an assistant whose conversations look like none of them near chance. The decision
(:mod:`clarifier.engine.decision_head`) is a logistic regression on the model's hidden states; refitting it on a
few hundred labelled turns of one's own takes one forward pass per turn and seconds of fitting, and leaves the
adapter (questions, grounding) as trained.

With ``--train`` (:func:`continue_adapter`) the model's LoRA adapter is first trained further on the labelled
turns (Ray Train, ``model.init_from``), then the head is fitted on the continued model's states as below. Its
out-of-fold figures then read states trained on the same turns, so only the queue's kept-apart slice judges it: a
continuation needs ``MIN_TRAIN_LABELS`` labelled turns and ``MIN_TRAIN_KEPT_APART`` kept-apart ones, and the report
sets it beside the head refit alone on those turns.

Two heads are fitted (:func:`clarifier.train.decision_head.fit_on_labels`), each by stratified cross-validation on
the labelled turns: ``head``, the model's own head moved towards the labels (a penalty pulls it to the shipped
weights, so few labels adjust it and many can override it), and ``scratch``, a head on the labels alone. The one
with the better out-of-fold AUROC is kept (or the one asked for), its threshold chosen on its out-of-fold scores by
the product's rule (best recall asking about at most ``max_over_asking`` of clear turns). The model's decision
before adapting is scored on the same turns (no fitting), so the report says what the labels bought.

The kept head's out-of-fold figures chose its strength (and the head) on the same folds they score, so they are
optimistic; the figure to quote is the *estimate* (:func:`honest_estimate`): nested cross-validation by
conversation, every choice made again inside each fold, beside the surface control (position and length only)
cross-fitted on the same folds and the margin over it. Confirm on turns kept apart with ``clarifier eval``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

MIN_PER_CLASS = 5  # labelled turns of each class below which adapting is refused
MIN_TRAIN_LABELS = 200  # labelled turns (outside the kept-apart slice) below which a LoRA continuation is refused
MIN_TRAIN_KEPT_APART = 20  # kept-apart turns a LoRA continuation is judged on: its only honest figure
STARTS = ("auto", "head", "scratch")


class AdaptError(ValueError):
    """The labelled turns or the model cannot be adapted (says which and why)."""


def adapt_head(model_uri: str, examples: list, out: str | Path, *, start: str = "auto", max_over_asking: float | None = 0.1,
               data_name: str = "", data_fingerprint: str = "", cache_dir=None, tracking_uri: str | None = None,
               precision: str = "auto", batch_size: int = 8, seed: int = 0, ray_pool: dict | None = None,
               progress: Callable[[str], None] = print) -> dict:
    """Write to ``out`` a copy of the model at ``model_uri`` whose decision head is fitted on ``examples`` (labelled
    turns: ``needs_clarification`` set), with its threshold; returns the summary ``clarifier.json`` records under
    ``decision_head.adapted``. ``ray_pool`` (``{"actors", "cpus_per_actor", "gpus_per_actor"}``: ``eval.engine=ray``):
    the forward passes run on Ray scorer actors (:class:`~clarifier.train.decision_head.RayFeatures`) and this
    process never loads the model; Ray must be initialised."""
    import numpy as np

    from clarifier.core.config import DecisionHeadConfig
    from clarifier.core.metrics import auroc
    from clarifier.engine.decision_head import DecisionHead, check_pooling, resolve_layers
    from clarifier.engine.inference import read_meta, write_meta
    from clarifier.engine.loading import load_engine, resolve_model
    from clarifier.engine.pipeline import is_pipeline_folder
    from clarifier.train.calibrate import choose_threshold
    from clarifier.train.decision_head import LocalFeatures, RayFeatures, fitted_head, head_scores

    if start not in STARTS:
        raise AdaptError(f"start {start!r}: one of {', '.join(STARTS)}")
    held = [e for e in examples if is_kept_apart(e)]
    if held:
        examples = [e for e in examples if not is_kept_apart(e)]
        progress(f"[adapt] {len(held)} labelled turns are a queue's kept-apart slice: never fitted on, scored at the "
                 f"end; fitting on the other {len(examples)}")
    y = np.array([bool(e.needs_clarification) for e in examples])
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if min(n_pos, n_neg) < MIN_PER_CLASS:
        raise AdaptError(f"labelled turns{f' in {data_name}' if data_name else ''}: {n_pos} need a question and "
                         f"{n_neg} do not; adapting needs at least {MIN_PER_CLASS} of each (a few hundred turns, "
                         "labelled as they come, is what the README's measurement used)")
    t0 = time.time()
    resolved = resolve_model(model_uri, tracking_uri=tracking_uri)
    dst = Path(out).expanduser().resolve()
    if dst == resolved.folder.resolve():
        raise AdaptError(f"--out {dst} is the model's own folder; name a new one")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not (dst / "adapt.json").is_file():
        raise AdaptError(f"--out {dst} exists and is not an earlier `clarifier adapt` output (no adapt.json); "
                         "name a new folder, or remove it first")
    if is_pipeline_folder(resolved.folder):
        raise AdaptError(f"{model_uri} is a pipeline model (three adapters); adapting fits the decision head of a "
                         "joint model")
    if ray_pool:  # the model's states from Ray actors; its head and threshold read from the folder
        features = RayFeatures(resolved.folder, cache_dir=cache_dir, precision=precision, **ray_pool)
        head, threshold = DecisionHead.load(resolved.folder), read_meta(resolved.folder).threshold
    else:
        engine = load_engine(resolved.folder, version=resolved.version, cache_dir=cache_dir, precision=precision)
        features, head, threshold = LocalFeatures(engine), engine.decision_head, engine.threshold
    n_layers = features.n_layers
    if head is not None:
        layers, pooling = list(head.layers), list(head.pooling)
    else:
        defaults = DecisionHeadConfig()
        layers, pooling = resolve_layers(defaults.layers, n_layers), check_pooling(defaults.pooling)
    where = f"on {ray_pool['actors']} Ray actor(s)" if ray_pool else features.precision
    progress(f"[adapt] {model_uri}: {len(examples)} labelled turns ({n_pos} need a question); its decision: "
             + (f"decision head on layers {layers} ({'+'.join(pooling)})" if head is not None else "decision tokens")
             + f"; reading its states ({where})")
    token, x = features(examples, layers, pooling, batch_size, "labelled", progress)

    def as_shipped(token_scores, states) -> list[float]:
        """P(clarify) by the model's decision as it is: its head on the states, else its decision tokens."""
        if head is None:
            return [float(v) for v in token_scores]
        import torch

        return [float(v) for v in head.probability(torch.as_tensor(states, dtype=torch.float32))]

    before_scores = as_shipped(token, x)
    before = {"decided_by": "decision head" if head is not None else "decision tokens",
              "auroc": auroc(list(y), before_scores), "threshold": threshold,
              "at_threshold": _at(y, before_scores, threshold)}

    prior = None
    if head is not None and head.clip is None:
        prior = (head.weight.double().numpy(), head.bias)
    elif start == "head":
        raise AdaptError("start 'head': the model has no unclipped decision head to start from "
                         + ("(its head clips its features)" if head is not None else "(it decides by its tokens)")
                         + "; use start 'scratch'")
    fits, kept = select_head(x, y, before_scores, prior, start, seed)
    for name, f in fits.items():
        if name != "shipped":
            progress(f"[adapt] {name}: C={f['c']:g}, out-of-fold AUROC {f['cv_auroc']:.3f}")
    fit = fits[kept]
    thr, rule = choose_threshold(list(y), fit["oof"], max_over_asking)
    at = _at(y, fit["oof"], thr)
    progress("[adapt] the honest estimate: the whole choice (head, strength) made again inside each of 5 folds by "
             "conversation, scored on the fold it never saw; and the surface control on the same folds")
    estimate = honest_estimate(examples, x, y, before_scores, prior, start, seed, max_over_asking)
    kept_apart = None
    if held:
        held_token, xh = features(held, layers, pooling, batch_size, "kept apart", progress)
        held_before = as_shipped(held_token, xh)
        held_scores = held_before if kept == "shipped" else [float(v) for v in head_scores(fit, xh)]
        kept_apart = kept_apart_figures(held, held_scores, held_before, thr, examples, seed, max_over_asking)
        kept_apart["turns"] = {e.id: round(float(v), 6) for e, v in zip(held, held_scores)}  # to compare models on
    held_eval = (xh, [bool(e.needs_clarification) for e in held], held_before) if held else None
    curve = label_curve(examples, x, y, before_scores, prior, start, seed, held_eval, whole=estimate["auroc"])
    if curve.get("verdict"):
        progress(f"[adapt] {curve['verdict']}")
    summary = {
        "data": data_name, "data_fingerprint": data_fingerprint, "n": len(examples), "clarify": n_pos,
        "kept": kept, "start": start, "before": before,
        "heads": {k: {"c": f["c"], "cv_auroc": f["cv_auroc"], "tried": f["tried"]} for k, f in fits.items()
                  if k != "shipped"},
        "threshold": thr, "rule": rule, "at_threshold": at, "estimate": estimate, "kept_apart": kept_apart,
        "label_curve": curve,
        "from": str(model_uri), "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0, 1),
    }

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(resolved.folder, dst, ignore=shutil.ignore_patterns("MODEL_CARD.md", "card.json"))
    meta = read_meta(dst)
    old = meta.decision_head or {}
    if kept == "shipped":
        head_meta = {**old, "adapted": summary} if head is not None else None
    else:
        fitted_head(fit, layers, pooling).save(dst)
        head_meta = {"layers": layers, "layer_fractions": old.get("layer_fractions"), "pooling": pooling, "clip": None,
                     "c": fit["c"], "n_train": len(examples), "precision": features.precision, "adapted": summary}
    write_meta(dst, replace(meta, threshold=thr, decision_head=head_meta, calibration={
        "split": "adapt" + ("" if kept == "shipped" else " (out of fold)"), "n": at["n"], "tp": at["tp"],
        "fn": at["fn"], "tn": at["tn"], "fp": at["fp"], "rule": rule}))
    (dst / "adapt.json").write_text(json.dumps(summary, indent=2) + "\n")
    return {**summary, "folder": str(dst)}


def compare_kept_apart(held: list, trained: dict, head_only: dict, seed: int = 0) -> dict:
    """The LoRA continuation against the head refit alone on the same kept-apart turns (their ``kept_apart``
    summaries): each one's AUROC and the paired bootstrap interval of the difference, with a verdict."""
    from clarifier.core.metrics import auroc, paired_bootstrap

    ids = [e.id for e in held]
    gold = [bool(e.needs_clarification) for e in held]
    a, b = (trained.get("turns") or {}), (head_only.get("turns") or {})
    if not ids or any(i not in a or i not in b for i in ids):
        return {"verdict": "no comparison: the two models were not scored on the same kept-apart turns"}
    sa, sb = [a[i] for i in ids], [b[i] for i in ids]
    boot = paired_bootstrap(gold, {"lora": ([False] * len(ids), sa), "head": ([False] * len(ids), sb)},
                            reference="head", seed=seed)["systems"]["lora"]
    iv = boot.get("auroc_diff")
    diff = None if auroc(gold, sa) is None or auroc(gold, sb) is None else auroc(gold, sa) - auroc(gold, sb)
    if iv is None or diff is None:
        verdict = "no comparison: the kept-apart turns need both classes"
    elif iv[0] > 0:
        verdict = f"the LoRA continuation ranks the kept-apart turns better: {diff:+.3f} AUROC [{iv[0]:+.3f}, {iv[1]:+.3f}]"
    elif iv[1] < 0:
        verdict = (f"the LoRA continuation ranks the kept-apart turns worse than the head refit alone: {diff:+.3f} "
                   f"AUROC [{iv[0]:+.3f}, {iv[1]:+.3f}]; serve the head refit (clarifier adapt without --train)")
    else:
        verdict = (f"no measured difference from the head refit alone on {len(ids)} kept-apart turns: {diff:+.3f} "
                   f"AUROC [{iv[0]:+.3f}, {iv[1]:+.3f}]; the head refit is cheaper to make and to keep")
    return {"n": len(ids), "lora_auroc": auroc(gold, sa), "head_only_auroc": auroc(gold, sb), "auroc_diff": diff,
            "auroc_diff_interval": iv, "verdict": verdict}


def check_train_labels(examples: list) -> tuple[int, int]:
    """``(fitted, kept apart)`` labelled turns, or :class:`AdaptError` when a LoRA continuation has too few."""
    held = sum(1 for e in examples if is_kept_apart(e))
    fitted = len(examples) - held
    if fitted < MIN_TRAIN_LABELS or held < MIN_TRAIN_KEPT_APART:
        raise AdaptError(
            f"--train: {fitted} labelled turns to train on and {held} kept apart; a LoRA continuation needs at least "
            f"{MIN_TRAIN_LABELS} and {MIN_TRAIN_KEPT_APART} (the kept-apart slice of a `clarifier label select` queue "
            "is the only honest figure for a model trained on the labels). Refit the head alone (no --train) and see "
            "the label curve for how many more labels to get")
    return fitted, held


def continue_adapter(cfg, model_uri: str, examples: list, name: str, *, minutes: float,
                     progress: Callable[[str], None] = print) -> dict:
    """Train the LoRA adapter of ``model_uri`` further on the labelled turns ``examples`` (the kept-apart slice
    left out): the data job over them (train and dev splits by conversation) and the training job of ``cfg``
    (Ray Train, DeepSpeed, MLflow) from that adapter (``model.init_from``), on the model's own base and prompt, for
    ``minutes``, no head fitted (:func:`adapt_head` fits it next). The labels and the data job's output go under
    ``<storage.root>/adapt-train/<name>/`` (a prefix every node reads, on a cluster). Returns ``{model_dir, run_id,
    steps, seconds, data_input, ...}``. Ray must be initialised."""
    from clarifier.data.pipeline import prepare
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import resolve_model
    from clarifier.runtime import storage
    from clarifier.runtime.mlflow_uri import tracking_uri as resolve_tracking_uri
    from clarifier.train.trainer import train as run_train

    fitted = [e for e in examples if not is_kept_apart(e)]
    resolved = resolve_model(model_uri, cfg.model.cache_dir, resolve_tracking_uri(cfg.tracking.tracking_uri))
    meta = read_meta(resolved.folder)
    root = cfg.storage.root if storage.is_s3(cfg.storage.root) else str(Path(cfg.storage.root).expanduser().resolve())
    base = storage.join(root, "adapt-train", name)
    data_input = storage.join(base, "input")
    storage.delete_dir(data_input)
    storage.write_text(storage.join(data_input, "labels.jsonl"), "".join(e.model_dump_json() + "\n" for e in fitted))
    prompt = {k: v for k, v in (meta.prompt or {}).items() if k in type(cfg.model).model_fields}
    c = cfg.model_copy(deep=True)
    c.data = c.data.model_copy(update={"input": data_input, "output": storage.join(base, "data"), "sources": [],
                                       "split": {"train": 0.9, "dev": 0.1, "test": 0.0}})
    c.model = c.model.model_copy(update={"base_model": meta.base_model, "init_from": str(resolved.folder),
                                         "finetune": "lora", **prompt})
    c.train = c.train.model_copy(update={
        "max_minutes": minutes, "run_name": None,
        "decision_head": c.train.decision_head.model_copy(update={"enabled": False}),
        "learning_curve": c.train.learning_curve.model_copy(update={"every": 0})})
    progress(f"[adapt] LoRA continuation of {model_uri} on {len(fitted)} labelled turns for up to {minutes:g} min: "
             f"the data job ({base}), then Ray Train from its adapter")
    t0 = time.time()
    prepare(c, progress=progress)
    res = run_train(c, progress=progress)
    return {"model_dir": res.model_dir, "run_id": res.run_id, "steps": res.steps, "minutes": minutes,
            "seconds": round(time.time() - t0, 1), "labelled_turns": len(fitted), "data_input": data_input}


def select_head(x, y, before_scores, prior, start: str, seed: int) -> tuple[dict, str]:
    """The candidates fitted on labelled turns ``x``/``y`` and the one kept: ``shipped`` (the decision as it is, only
    its threshold set: nothing fitted, so its AUROC is as fair as the others' out-of-fold figures), ``head`` (the
    model's head moved to the labels; needs ``prior``) and ``scratch`` (a head on the labels alone), each with its
    strength chosen by cross-validation; ``auto`` keeps the best out-of-fold AUROC (a tie keeps it as shipped)."""
    from clarifier.core.metrics import auroc
    from clarifier.train.decision_head import fit_on_labels

    fits = {"shipped": {"c": None, "cv_auroc": auroc(list(y), list(before_scores)), "oof": list(before_scores),
                        "tried": []}}
    if start in ("auto", "head") and prior is not None:
        fits["head"] = fit_on_labels(x, y, prior, seed=seed)
    if start in ("auto", "scratch"):
        fits["scratch"] = fit_on_labels(x, y, seed=seed)
    if start == "auto":
        return fits, max(fits, key=lambda k: (fits[k]["cv_auroc"] or 0.0, k == "shipped"))
    return fits, start


def honest_estimate(examples: list, x, y, before_scores, prior, start: str, seed: int,
                    max_over_asking: float | None, folds: int = 5) -> dict:
    """What the adapted model will score on turns like these that it never saw: nested cross-validation, the whole
    of :func:`select_head` (which head, which strength) run again on each outer fold's other turns, folds split by
    conversation; the fold's scores come from a fit that never saw the fold. (The out-of-fold figures of the kept
    head chose its strength on the same folds they score: optimistic.) Beside it the surface control
    (:mod:`clarifier.core.surface`: position and length only) cross-fitted on the same folds, and the margin over
    it with its paired bootstrap interval; where the turns carry the retriever's scores, what they add to the
    estimate's scores (:func:`clarifier.core.retrieval.retriever_score_check`, ``retriever_scores``)."""
    import numpy as np
    from sklearn.model_selection import StratifiedGroupKFold

    from clarifier.core.metrics import auroc, operating_point_at_over_asking
    from clarifier.core.retrieval import retriever_score_check
    from clarifier.core.schema import source_of
    from clarifier.core.surface import cross_fitted_scores, skill_over_control
    from clarifier.train.decision_head import head_scores

    y = np.asarray(y, dtype=bool)
    groups = [str(getattr(e, "conversation_id", None) or e.id) for e in examples]
    sources = [source_of(e) for e in examples]
    k = min(folds, int(y.sum()), int((~y).sum()))
    nested = np.zeros(len(y))
    before = np.asarray(before_scores, dtype=float)
    for tr, te in StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed).split(x, y, groups):
        if len(set(y[tr].tolist())) < 2 or min(int(y[tr].sum()), int((~y[tr]).sum())) < 2:
            nested[te] = before[te]  # too few of a class to fit on: the decision as it is
        else:
            fits, kept = select_head(x[tr], y[tr], before[tr], prior, start, seed)
            nested[te] = before[te] if kept == "shipped" else head_scores(fits[kept], x[te])
    gold = [bool(v) for v in y]
    # the same folds: StratifiedGroupKFold with this seed, labels and groups splits alike whatever the features
    control = cross_fitted_scores(examples, gold, sources, groups, folds=k, seed=seed)
    budget = 0.1 if max_over_asking is None else max_over_asking
    op = operating_point_at_over_asking(gold, list(nested), budget)
    skill = skill_over_control(gold, list(nested), list(control), sources if len(set(sources)) > 1 else None,
                               model="the adapted model", seed=seed)
    retriever = retriever_score_check(examples, gold, list(nested), sources, groups, folds=k, seed=seed)
    return {"method": f"nested cross-validation, {k} folds by conversation", "auroc": auroc(gold, list(nested)),
            "budget": budget, "recall_at_budget": op["recall"] if op else None, "f1_at_budget": op["f1"] if op else None,
            "surface_control_auroc": auroc(gold, list(control)), "skill": skill, "retriever_scores": retriever}


CURVE_FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # with a kept-apart slice: a head fit per point, 3 draws each
NESTED_FRACTIONS = (1 / 3, 2 / 3, 1.0)  # without: a nested estimate per point (the whole set's is the estimate's)


def label_curve(examples: list, x, y, before_scores, prior, start: str, seed: int, held=None,
                whole: float | None = None, repeats: int = 3) -> dict:
    """How the figure grows with the number of labels, and what more labels would buy: the whole choice
    (:func:`select_head`) made on a share of the labelled conversations, scored on the kept-apart turns (``held`` =
    their features, labels and scores before adapting; ``repeats`` seeded draws per share) or, without them, by the
    nested estimate on one draw per share (``whole``: the estimate already made on all of them); then
    AUROC ~ a + b ln(labels) fitted to the points, and the gain that doubling the labels would give by that fit."""
    import math

    import numpy as np

    from clarifier.core.metrics import auroc
    from clarifier.train.decision_head import head_scores

    y = np.asarray(y, dtype=bool)
    convs = sorted({str(getattr(e, "conversation_id", None) or e.id) for e in examples})
    conv_of = [str(getattr(e, "conversation_id", None) or e.id) for e in examples]
    before = np.asarray(before_scores, dtype=float)
    points = []
    fractions = CURVE_FRACTIONS if held is not None else NESTED_FRACTIONS
    for frac in fractions:
        vals, sizes = [], []
        if held is None and frac >= 1 and whole is not None:
            points.append({"labels": len(examples), "auroc": round(float(whole), 4), "draws": 1})
            continue
        for r in range(1 if frac >= 1 or held is None else repeats):
            rng = np.random.default_rng(seed + 1000 * r + int(frac * 100))
            chosen = set(convs) if frac >= 1 else set(rng.choice(convs, max(1, int(round(frac * len(convs)))),
                                                                 replace=False).tolist())
            idx = [i for i, c in enumerate(conv_of) if c in chosen]
            ys = y[idx]
            if min(int(ys.sum()), int((~ys).sum())) < MIN_PER_CLASS:
                continue
            if held is not None:
                xh, gh, bh = held
                fits, kept = select_head(x[idx], ys, before[idx], prior, start, seed)
                sc = bh if kept == "shipped" else [float(v) for v in head_scores(fits[kept], xh)]
                a = auroc(gh, sc)
            else:
                a = honest_estimate([examples[i] for i in idx], x[idx], ys, before[idx], prior, start, seed,
                                    None)["auroc"]
            if a is not None:
                vals.append(a)
                sizes.append(len(idx))
        if vals:
            points.append({"labels": int(round(float(np.mean(sizes)))), "auroc": round(float(np.mean(vals)), 4),
                           "draws": len(vals)})
    out: dict = {"scored_on": "kept-apart turns" if held is not None else "nested cross-validation",
                 "points": points, "doubling_gain": None, "verdict": None}
    if len(points) >= 3:
        lx = np.log([p["labels"] for p in points])
        b, a = np.polyfit(lx, [p["auroc"] for p in points], 1)
        gain = float(b * math.log(2))
        out["doubling_gain"] = round(gain, 4)
        n = points[-1]["labels"]
        curve = ", ".join(f"{p['labels']} labels {p['auroc']:.3f}" for p in points)
        advice = ("label more: the curve is still rising" if gain >= 0.02 else
                  "more labels would buy little by this curve; look at what the labels disagree on instead")
        out["verdict"] = (f"AUROC against labels ({out['scored_on']}): {curve}; doubling to {2 * n} labels would add "
                          f"about {gain:+.3f} by a log fit to this curve: {advice}")
    return out


def is_kept_apart(example) -> bool:
    """A turn a labelling queue kept apart for the honest estimate (``meta.queue.part``)."""
    return ((getattr(example, "meta", None) or {}).get("queue") or {}).get("part") == "kept_apart"


def kept_apart_figures(held: list, scores: list[float], before: list[float], threshold: float, fitted: list,
                       seed: int, max_over_asking: float | None) -> dict:
    """The adapted model on a queue's kept-apart turns (never fitted on, nor used to choose anything): AUROC with
    its bootstrap interval, recall/F1 at the kept threshold and at the over-asking budget, the model before
    adapting on the same turns, and the surface control fitted on the turns the head was fitted on."""
    from clarifier.core.metrics import auroc, operating_point_at_over_asking, paired_bootstrap
    from clarifier.core.schema import source_of
    from clarifier.core.surface import fit_surface_control, skill_over_control

    gold = [bool(e.needs_clarification) for e in held]
    n_pos = sum(gold)
    out: dict = {"n": len(held), "clarify": n_pos, "auroc": None}
    if min(n_pos, len(gold) - n_pos) < 2:
        out["note"] = (f"{n_pos} of the {len(held)} kept-apart turns need a question: both classes are needed for "
                       "a figure; label more of the queue")
        return out
    budget = 0.1 if max_over_asking is None else max_over_asking
    op = operating_point_at_over_asking(gold, scores, budget)
    ctl = fit_surface_control(fitted, [bool(e.needs_clarification) for e in fitted],
                              [source_of(e) for e in fitted], seed=seed)
    control = ctl.scores(held, [source_of(e) for e in held])
    boot = paired_bootstrap(gold, {"adapted": ([v >= threshold for v in scores], scores)},
                            seed=seed)["systems"]["adapted"]
    out.update({
        "auroc": auroc(gold, scores), "auroc_interval": boot["auroc"], "f1_interval_at_threshold": boot["f1"],
        "before_auroc": auroc(gold, before), "at_threshold": _at(gold, scores, threshold), "budget": budget,
        "recall_at_budget": op["recall"] if op else None, "f1_at_budget": op["f1"] if op else None,
        "surface_control_auroc": auroc(gold, control),
        "skill": skill_over_control(gold, scores, control, model="the adapted model", seed=seed)})
    return out


def log_adapted(folder: str | Path, summary: dict, experiment: str, tracking_uri: str | None = None) -> str:
    """Log an adapted model folder as an MLflow run of ``experiment`` (its files as the ``adapter`` artifact, as a
    training run logs them; the labelled set, the kept head and its figures as params and metrics), so that
    ``clarifier models register --run-id`` and the promotion gate take it like a trained model. Returns the run id."""
    import mlflow

    from clarifier.runtime.mlflow_uri import check_reachable

    if tracking_uri:
        check_reachable(tracking_uri)
        mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment)
    meta = json.loads((Path(folder) / "clarifier.json").read_text())
    with mlflow.start_run(run_name=f"adapt-{Path(folder).name}") as run:
        mlflow.set_tags({"clarifier.stage": "adapt", "clarifier.adapted_from": summary["from"],
                         "clarifier.base_model": meta.get("base_model", ""), "clarifier.data": summary["data"],
                         "clarifier.data_fingerprint": summary["data_fingerprint"]})
        mlflow.log_params({"adapt.kept": summary["kept"], "adapt.start": summary["start"], "adapt.n": summary["n"],
                           "adapt.clarify": summary["clarify"], "adapt.threshold_rule": summary["rule"]})
        est = summary.get("estimate") or {}
        metrics = {"adapt/threshold": summary["threshold"], "adapt/before_auroc": summary["before"]["auroc"],
                   "adapt/estimate_auroc": est.get("auroc"), "adapt/surface_control_auroc": est.get("surface_control_auroc"),
                   "adapt/estimate_recall_at_budget": est.get("recall_at_budget"),
                   "adapt/retriever_scores_added_auroc": (est.get("retriever_scores") or {}).get("added"),
                   "adapt/kept_apart_auroc": (summary.get("kept_apart") or {}).get("auroc"),
                   "adapt/label_curve_doubling_gain": (summary.get("label_curve") or {}).get("doubling_gain"),
                   **{f"adapt/{k}_cv_auroc": h["cv_auroc"] for k, h in summary["heads"].items()},
                   **{f"adapt/kept_{k}": v for k, v in summary["at_threshold"].items()
                      if k in ("recall", "precision", "f1", "over_asking_rate")}}
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None})
        mlflow.log_artifacts(str(folder), artifact_path="adapter")
        return run.info.run_id


def _at(y, scores, threshold) -> dict:
    """Decision figures of ``scores`` at ``threshold`` (None: no threshold to apply)."""
    from clarifier.core.metrics import decision_metrics

    if threshold is None:
        return {}
    at = decision_metrics(list(y), [s >= threshold for s in scores])
    return {k: at[k] for k in ("recall", "precision", "f1", "over_asking_rate", "n", "tp", "fn", "tn", "fp")}
