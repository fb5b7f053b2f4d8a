"""Fit a model folder's decision head (:mod:`clarifier.engine.decision_head`) after training.

The model is loaded as evaluation and serving load it (merged adapter, same precision, same prompt);
one forward pass per example gives its hidden states at the decision position (and, with pooling
``mean``, averaged over the prompt) for a seeded sample of the train split
(``train.decision_head.max_per_source`` per source, half needing a question where the source has
enough; null: the whole split) and for the whole calibration split. A logistic regression (scikit-learn) is fitted
on the standardised states, every source and class weighing the same (as ``train.balance:
source_class`` draws them), once per strength in ``c_grid``; the strength with the best mean
within-source AUROC on the calibration split is kept. With ``clip`` the standardised features are first
limited to ``[-clip, clip]`` (in training and when the engine applies the head). Its dev scores are returned so the threshold is
calibrated on them without scoring the split again. The forward passes run where the model is loaded:
in this process (:class:`LocalFeatures`), or on a pool of Ray scorer actors with the folder shipped to them
(:class:`RayFeatures`, what a training run uses with ``eval.engine=ray``); the regression is fitted here either way.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from clarifier.core.config import DecisionHeadConfig
from clarifier.core.metrics import within_source_summary
from clarifier.core.schema import sample_by_source, source_of


def balanced_weights(sources: list[str], gold: list[bool]) -> list[float]:
    """Sample weights under which every (source, class) cell present weighs the same in total (mean 1)."""
    from collections import Counter

    cells = Counter(zip(sources, gold))
    raw = [1.0 / cells[(s, g)] for s, g in zip(sources, gold)]
    scale = len(raw) / sum(raw)
    return [w * scale for w in raw]


def hidden_features(engine, examples, layers, batch_size: int, label: str, progress: Callable[[str], None],
                    pooling=("last",), token: bool = True):
    """``(decision-token P(clarify), features)`` of ``examples``, in their order; batched by length (the
    rendered conversation's characters), so a batch pads little. ``token=False``: each pass stops after the
    deepest of ``layers`` and the decision tokens' P(clarify) are NaN (a head on early layers costs part of a pass)."""
    import numpy as np
    import torch

    batches = engine.batches(examples, batch_size)
    probs, feats, done, t0 = [0.0] * len(examples), [], 0, time.time()
    for rows in batches:
        p, f = engine.decision_features([(examples[i].history, examples[i].query, examples[i].passages) for i in rows],
                                        layers, pooling, token=token)
        for i, v in zip(rows, p):
            probs[i] = v
        feats.append(f)
        done += len(rows)
        if done % 64 < len(rows) or done == len(examples):  # the CLI shows these as one live line
            progress(f"[head] {label}: {done}/{len(examples)} ({done / max(time.time() - t0, 1e-9):.1f} examples/s)")
    x = np.empty((len(examples), feats[0].shape[1]), dtype=np.float32)
    x[sum(batches, [])] = torch.cat(feats).numpy()
    return probs, x


class LocalFeatures:
    """A decision head's features from an engine loaded in this process (:func:`hidden_features`)."""

    def __init__(self, engine):
        self.engine = engine
        self.n_layers = engine.model.config.num_hidden_layers
        self.precision = engine.precision

    def __call__(self, examples, layers, pooling, batch_size: int, label: str, progress: Callable[[str], None],
                 token: bool = True):
        return hidden_features(self.engine, examples, layers, batch_size, label, progress, pooling, token)


class RayFeatures:
    """A decision head's features computed by a pool of Ray scorer actors (``eval.engine=ray``: ``eval.ray_actors``
    actors with ``eval.ray_cpus_per_actor`` / ``eval.ray_gpus_per_actor`` each), so the process that fits the head
    (a training job's driver, on a cluster's head node) never loads the model. The same batches as
    :func:`hidden_features` (length order), so CPU actors give the same features."""

    def __init__(self, folder: str | Path, *, cache_dir=None, precision: str = "auto", actors: int = 1,
                 cpus_per_actor: float = 1, gpus_per_actor: float = 0):
        from clarifier.engine.inference import num_layers, read_meta
        from clarifier.engine.ray_pool import ship_folder

        self.spec = {**ship_folder(folder), "cache_dir": cache_dir, "precision": precision, "decision_head": False}
        self.opts = read_meta(folder).prompt_options()
        self.n_layers = num_layers(folder, cache_dir)
        self.precision = precision  # until the actors say what they resolved it to
        self.pool = {"actors": actors, "cpus_per_actor": cpus_per_actor, "gpus_per_actor": gpus_per_actor}

    def __call__(self, examples, layers, pooling, batch_size: int, label: str, progress: Callable[[str], None],
                 token: bool = True):
        from clarifier.engine.ray_pool import ray_features

        t0 = time.time()
        probs, x, self.precision = ray_features(examples, self.spec, layers, pooling, opts=self.opts,
                                                batch_size=batch_size, progress=progress, label=f"[head] {label}:",
                                                token=token, **self.pool)
        progress(f"[head] {label}: {len(examples)}/{len(examples)} on {self.pool['actors']} Ray actor(s) "
                 f"({len(examples) / max(time.time() - t0, 1e-9):.1f} examples/s)")
        return probs, x


def standardised(fit: dict, x):
    """``x``'s features as :func:`fit_on_features`' regression reads them (standardised, clipped when the
    fit clips)."""
    import numpy as np

    z = fit["scaler"].transform(x)
    return z if fit.get("clip") is None else np.clip(z, -fit["clip"], fit["clip"])


def head_scores(fit: dict, x):
    """P(clarify) of a :func:`fit_on_features` result for features ``x``."""
    return fit["model"].predict_proba(standardised(fit, x))[:, 1]


def fit_on_features(x_train, train: list, x_dev, dev: list, c_grid, clip: float | None = None) -> dict:
    """The head's regression on features already computed (rows in ``train`` / ``dev`` order): standardised
    (and clipped to ``[-clip, clip]`` when ``clip`` is set), every source and class weighing the same, one fit
    per strength in ``c_grid``; the one with the best mean within-source AUROC on ``dev`` is kept. Returns
    ``model``, ``scaler``, ``clip``, ``c``, ``dev_macro_auroc``, ``dev_scores`` and every strength ``tried``."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    y = np.array([e.needs_clarification for e in train])
    weights = balanced_weights([source_of(e) for e in train], list(y))
    scaler = StandardScaler().fit(x_train)
    xs_train, xs_dev = (standardised({"scaler": scaler, "clip": clip}, x) for x in (x_train, x_dev))
    dev_gold, dev_sources = [e.needs_clarification for e in dev], [source_of(e) for e in dev]
    tried, best = [], None
    for c in c_grid:
        lr = LogisticRegression(C=c, max_iter=3000).fit(xs_train, y, sample_weight=weights)
        scores = lr.predict_proba(xs_dev)[:, 1]
        macro = within_source_summary(dev_gold, list(scores), dev_sources)["macro_auroc"]
        tried.append({"c": c, "dev_macro_auroc": macro})
        if best is None or (macro or 0.0) > (best[0] or 0.0):
            best = (macro, c, lr, scores)
    macro, c, lr, scores = best
    return {"model": lr, "scaler": scaler, "clip": clip, "c": c, "dev_macro_auroc": macro, "dev_scores": scores,
            "tried": tried}


LABEL_C_GRID = (1e-4, 1e-3, 1e-2, 0.1, 1.0)  # strengths tried on labelled turns alone (cross-validated)


def fit_on_labels(x, y, prior: tuple | None = None, *, seed: int = 0, c_grid=LABEL_C_GRID) -> dict:
    """The head's regression on one set of labelled turns' features ``x`` (``y``: needs a question), standardised
    on them, the two classes weighing the same: alone, or moved from ``prior = (weight, bias)`` -- a head on the
    raw features, as a saved unclipped head holds it -- whose penalty pulls it to that head re-expressed on these
    standardised features (``0.5 |w - w0|^2 + C * loss``: few labels adjust it, many can override it). The
    strength is chosen by stratified 5-fold cross-validation (fewer folds when a class has fewer than 5 turns) on
    the AUROC of the out-of-fold scores. Returns what :func:`head_scores` and :func:`fitted_head` read, plus
    ``c``, ``cv_auroc``, the out-of-fold P(clarify) ``oof`` (in ``x``'s order) and every strength ``tried``."""
    import numpy as np
    from sklearn.model_selection import StratifiedKFold
    from sklearn.preprocessing import StandardScaler

    from clarifier.core.metrics import auroc

    y = np.asarray(y, dtype=bool)
    folds = min(5, int(y.sum()), int((~y).sum()))
    if folds < 2:
        raise ValueError(f"labelled turns: {int(y.sum())} need a question and {int((~y).sum())} do not; "
                         "cross-validation needs at least 2 of each")
    scaler = StandardScaler().fit(x)
    z = scaler.transform(x)
    w0 = None
    if prior is not None:
        w, b = np.asarray(prior[0], dtype=np.float64), float(prior[1])
        w0 = (w * scaler.scale_, b + float(w @ scaler.mean_))  # the same map on z = (x - mean) / scale
    tried, best = [], None
    for c in c_grid:
        oof = np.zeros(len(y))
        for tr, te in StratifiedKFold(folds, shuffle=True, random_state=seed).split(z, y):
            oof[te] = _logistic(z[tr], y[tr], c, w0).predict_proba(z[te])[:, 1]
        score = auroc(list(y), list(oof))
        tried.append({"c": c, "cv_auroc": score})
        if best is None or (score or 0.0) > (best[0] or 0.0):
            best = (score, c, oof)
    score, c, oof = best
    return {"model": _logistic(z, y, c, w0), "scaler": scaler, "clip": None, "c": c, "cv_auroc": score,
            "oof": [float(v) for v in oof], "tried": tried}


def _logistic(z, y, c: float, w0: tuple | None = None):
    """Class-balanced logistic regression on ``z`` (scikit-learn's ``C``); with ``w0 = (coef, intercept)`` the
    penalty is ``0.5 |w - coef|^2`` and the intercept is free (fitted by L-BFGS from ``w0``)."""
    import numpy as np
    from scipy.optimize import minimize
    from sklearn.linear_model import LogisticRegression

    weights = np.asarray(balanced_weights(["labelled"] * len(y), list(y)))  # one source: the classes weigh the same
    if w0 is None:
        return LogisticRegression(C=c, max_iter=3000).fit(z, y, sample_weight=weights)
    coef0, b0 = w0
    t = y.astype(float)

    def loss(params):
        w, b = params[:-1], params[-1]
        m = z @ w + b
        d = w - coef0
        g = weights * (1.0 / (1.0 + np.exp(-m)) - t)
        return 0.5 * d @ d + c * np.sum(weights * (np.logaddexp(0.0, m) - t * m)), np.append(d + c * (z.T @ g), c * g.sum())

    res = minimize(loss, np.append(coef0, b0), jac=True, method="L-BFGS-B", options={"maxiter": 500})
    lr = LogisticRegression(C=c)
    lr.classes_, lr.coef_, lr.intercept_, lr.n_features_in_ = np.array([False, True]), res.x[None, :-1], res.x[-1:], z.shape[1]
    return lr


def fitted_head(fit: dict, layers: list[int], pooling):
    """The :class:`~clarifier.engine.decision_head.DecisionHead` of a :func:`fit_on_features` result."""
    from clarifier.engine.decision_head import DecisionHead

    lr, scaler = fit["model"], fit["scaler"]
    return DecisionHead.from_standardised(layers, lr.coef_[0], float(lr.intercept_[0]), scaler.mean_, scaler.scale_,
                                          pooling, fit.get("clip"))


def fit_head(features, train_examples: list, dev_examples: list, cfg: DecisionHeadConfig, *, seed: int = 0,
             progress: Callable[[str], None] = print):
    """``(DecisionHead, summary)`` fitted on the hidden states ``features`` computes (:class:`LocalFeatures` of any
    engine: a trained model's, or a base model's for a head on the untrained base; or :class:`RayFeatures`).
    The summary has the dev scores (``dev_scores``, in ``dev_examples`` order) and both decisions' dev
    within-source AUROC."""
    from clarifier.engine.decision_head import check_pooling, resolve_layers

    t0 = time.time()
    train = (list(train_examples) if cfg.max_per_source is None
             else sample_by_source(train_examples, cfg.max_per_source, seed, clarify_share=0.5))
    for name, rows in (("train sample", train), ("calibration split", dev_examples)):
        if len({e.needs_clarification for e in rows}) < 2:
            raise ValueError(f"decision head: the {name} needs turns of both classes ({len(rows)} examples)")
    layers, pooling = resolve_layers(cfg.layers, features.n_layers), check_pooling(cfg.pooling)
    clipped = "" if cfg.clip is None else f", features clipped at {cfg.clip:g} sd"
    progress(f"[head] fitting a decision head on layers {layers} ({'+'.join(pooling)}{clipped}): {len(train)} train examples "
             f"({sum(e.needs_clarification for e in train)} need a question), {len(dev_examples)} to choose it")
    # the train turns' decision tokens are not used: their passes stop after the head's deepest layer; the dev turns'
    # are reported beside the head (the whole pass)
    _, x_train = features(train, layers, pooling, cfg.batch_size, "train", progress, token=False)
    dev_token, x_dev = features(dev_examples, layers, pooling, cfg.batch_size, "dev", progress)

    dev_gold, dev_sources = [e.needs_clarification for e in dev_examples], [source_of(e) for e in dev_examples]
    fit = fit_on_features(x_train, train, x_dev, dev_examples, cfg.c_grid, cfg.clip)
    macro, c, tried, scores = fit["dev_macro_auroc"], fit["c"], fit["tried"], fit["dev_scores"]
    head = fitted_head(fit, layers, pooling)
    token_macro = within_source_summary(dev_gold, dev_token, dev_sources)["macro_auroc"]
    summary = {"layers": layers, "layer_fractions": list(cfg.layers), "pooling": pooling, "clip": cfg.clip, "c": c, "n_train": len(train),
               "n_dev": len(dev_examples), "dev_macro_auroc": macro, "dev_macro_auroc_token": token_macro,
               "tried": tried, "precision": features.precision, "seconds": round(time.time() - t0, 1),
               "dev_scores": [float(s) for s in scores]}
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    progress(f"[head] kept C={c:g}: dev within-source AUROC {fmt(macro)} (decision tokens: {fmt(token_macro)}) "
             f"in {summary['seconds']:.0f}s")
    return head, summary


def fit_decision_head(folder: str | Path, train_examples: list, dev_examples: list, cfg: DecisionHeadConfig, *,
                      seed: int = 0, cache_dir=None, precision: str = "auto",
                      progress: Callable[[str], None] = print, features=None) -> dict:
    """Fit the decision head of the model in ``folder`` (loaded as evaluation and serving load it), save it
    there and record how in its ``clarifier.json``; returns :func:`fit_head`'s summary. ``features``: where its
    hidden states are computed (default: the model loaded in this process; :class:`RayFeatures`: Ray actors)."""
    from clarifier.engine.inference import read_meta, write_meta

    if features is None:
        from clarifier.engine.loading import load_engine

        features = LocalFeatures(load_engine(folder, cache_dir=cache_dir, precision=precision, decision_head=False))
    head, summary = fit_head(features, train_examples, dev_examples, cfg, seed=seed, progress=progress)
    head.save(folder)
    write_meta(folder, replace(read_meta(folder), decision_head={k: v for k, v in summary.items() if k != "dev_scores"}))
    return summary
