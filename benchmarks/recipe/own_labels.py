"""How many labelled turns of their own does a user need? A model trained without one source, its decision head
refitted with k labelled turns of that source, scored on the source's test turns. JSON out.

    # the model: recipe joint-public trained without PACIFIC (its data.sources less the pacific line; the head is
    # fitted here, so the training run need not fit one):
    #   clarifier train --config loo-pacific.yaml --prepare --no-eval train.decision_head.enabled=false
    .venv/bin/python benchmarks/recipe/own_labels.py --data .clarifier/recipes/joint-public/data \
        --model .clarifier/recipes/loo-pacific/models/<run id> --source pacific \
        --in-domain plain=results/recipe-retrain-plain.json:retrained-plain

The leave-one-dataset-out rows of the recipe report sit at or below chance: the public sets disagree about what
makes a turn need a question, so a model trained on some of them carries to none of the others. A user's
assistant is such an unseen source. This measures the remedy the product can offer: label k of your own turns and
refit the decision head (seconds; the adapter stays as trained), for k from 0 (the leave-one-out figure) up to
every train turn of the source. Heads, each by the recipe's procedure
(:func:`clarifier.train.decision_head.fit_on_features`: the states of four layers at the decision position and
averaged over the prompt, standardised, a logistic regression in which every source and class weighs the same):

* ``mixed``: the other sources' train turns (the model's own training data) plus the k labelled turns, which weigh
  as one source among them;
* ``own``: the k labelled turns alone (standardised on themselves, classes weighing the same);
* ``prior``: the leave-one-out head moved towards the k labelled turns: a logistic regression whose penalty pulls
  it to that head's weights (``0.5 |w - w0|^2 + C * loss``, on features standardised on the labelled turns), so
  that few labels adjust it and many can override it. It needs only a saved head and the user's turns;
* ``adapt``: what ``clarifier adapt`` keeps (:func:`clarifier.train.decision_head.fit_on_labels`, the same fits):
  the best of the leave-one-out head as it is, ``prior`` and ``own`` by their AUROC on the labelled turns (out of
  fold for the fitted two).

``mixed`` keeps the recipe's strength, chosen on the dev split of the *other* sources; ``own`` and ``prior`` choose
theirs by 5-fold cross-validation on the k labelled turns (AUROC of the out-of-fold scores), as a user would: a
user has no dev split beyond the turns they labelled, and the source's dev turns are never read. The k turns are drawn at random from the source's train
split, ``--draws`` times per k (each draw its own seed; a draw holds both classes). Scored on every test turn of the
source: AUROC and recall / F1 at 10% over-asking (each draw, and their mean), and the paired bootstrap of the
draws' mean AUROC minus the leave-one-out head's (1,000 resamples of the test turns). ``--in-domain
NAME=RESULT.json:MODEL`` adds a model trained *with* the source, by its scores kept in a ``paired.py`` result on
the same test split (refused unless the split's fingerprint matches): the figure the labels are chasing.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import KeptStates, result_file, write_result  # noqa: E402


def parse_labels(text: str) -> list[int | None]:
    """``0,25,100,all`` -> ``[0, 25, 100, None]`` (None: every train turn of the source)."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "all":
            out.append(None)
            continue
        try:
            k = int(part)
        except ValueError:
            k = -1
        if k < 0:
            raise SystemExit(f"--labels: {part!r} is not a count of turns (a number >= 0, or all)")
        out.append(k)
    if not out:
        raise SystemExit("--labels: name at least one count, e.g. 0,50,200,all")
    return out


def parse_in_domain(items: list[str]) -> list[tuple[str, str, str]]:
    """``--in-domain NAME=RESULT.json:MODEL`` options -> ``(name, result file, model key)``."""
    out = []
    for item in items:
        name, _, rest = item.partition("=")
        path, _, key = rest.rpartition(":")
        if not (name and path and key):
            raise SystemExit(f"--in-domain {item!r}: expected NAME=RESULT.json:MODEL")
        out.append((name, path, key))
    return out


def draw_labelled(pool: list, k: int, seed: int) -> list:
    """``k`` turns drawn at random from ``pool``, holding at least two of each class (redrawn up to 100 times)."""
    if k < 4:
        raise SystemExit(f"--labels {k}: a labelled sample needs at least 4 turns (two of each class)")
    rng = random.Random(seed)
    for _ in range(100):
        sample = rng.sample(pool, k)
        clarify = sum(bool(e.needs_clarification) for e in sample)
        if 2 <= clarify <= k - 2:
            return sample
    raise SystemExit(f"no draw of {k} turns holds two of each class (the source's train turns are nearly all one class)")


def bootstrap_diff(gold: list, reference: list | None, draws: list[list], n_resamples: int = 1000, seed: int = 0,
                   references: list[list] | None = None) -> dict:
    """Percentile interval (95%) of mean-over-draws AUROC minus the reference's, resampling the turns (paired);
    ``references`` (one per draw, in place of ``reference``): each draw minus its own reference."""
    from clarifier.core.metrics import auroc

    rng, n, diffs = random.Random(seed), len(gold), []
    refs = references if references is not None else [reference] * len(draws)
    for _ in range(n_resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        g = [gold[i] for i in idx]
        base = [auroc(g, [r[i] for i in idx]) for r in refs]
        vals = [auroc(g, [d[i] for i in idx]) for d in draws]
        if any(v is None for v in base + vals):
            continue
        diffs.append(sum(v - r for v, r in zip(vals, base)) / len(vals))
    diffs.sort()
    if not diffs:
        return {"mean": None, "interval": None}
    lo, hi = diffs[int(0.025 * (len(diffs) - 1))], diffs[int(0.975 * (len(diffs) - 1))]
    return {"mean": round(sum(diffs) / len(diffs), 4), "interval": [round(lo, 4), round(hi, 4)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-job output holding the source's train and test turns "
                                                  "and the other sources' train and dev turns")
    ap.add_argument("--model", required=True, help="a model trained without --source (folder or URI)")
    ap.add_argument("--source", required=True, help="the source left out of the model's training")
    ap.add_argument("--labels", default="0,25,50,100,200,400,all",
                    help="counts of the source's labelled train turns to refit with (comma-separated; all: every one)")
    ap.add_argument("--draws", type=int, default=3, help="random draws per count below all")
    ap.add_argument("--heads", default="prior,own,adapt,mixed",
                    help="which heads (comma-separated): prior, own, adapt, mixed")
    ap.add_argument("--in-domain", action="append", default=[], metavar="NAME=RESULT.json:MODEL",
                    help="a model trained with the source, by its scores in a paired.py result on the same test split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--features", default=None, help="an .npz to keep the states in and reuse on a rerun")
    ap.add_argument("--c-grid", default=None, help="strengths the own and prior heads cross-validate over (comma-"
                                                   "separated; default clarifier adapt's, LABEL_C_GRID)")
    ap.add_argument("--c-grid-b", default=None,
                    help="a second grid: the own, prior and adapt heads fitted again with it on the same draws "
                         "(rows <head>_b), and adapt_b minus adapt by the paired bootstrap")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result_file(f"recipe-own-labels-{args.source}", args.out)  # refused now, not after the run, when that file is already there
    labels = parse_labels(args.labels)
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    if not heads or set(heads) - {"mixed", "own", "prior", "adapt"}:
        raise SystemExit(f"--heads {args.heads!r}: name one or more of prior, own, adapt, mixed")
    if args.c_grid_b:
        heads += [h + "_b" for h in heads if h != "mixed"]
    if args.draws < 1:
        raise SystemExit("--draws: at least 1")
    in_domain = parse_in_domain(args.in_domain)

    import numpy as np

    from clarifier.core.config import DecisionHeadConfig
    from clarifier.core.metrics import within_source_summary
    from clarifier.core.schema import source_of
    from clarifier.data.outputs import load_split
    from clarifier.engine.decision_head import resolve_layers
    from clarifier.engine.loading import load_engine
    from clarifier.evaluation.evaluate import fingerprint_examples
    from clarifier.train.decision_head import LABEL_C_GRID, fit_on_features, fit_on_labels, head_scores, hidden_features

    t0 = time.time()
    cfg = DecisionHeadConfig()
    def grid(text: str | None, flag: str):
        try:
            return tuple(float(c) for c in text.split(",")) if text else None
        except ValueError:
            raise SystemExit(f"{flag} {text!r}: expected comma-separated numbers") from None

    grids = {"": grid(args.c_grid, "--c-grid") or LABEL_C_GRID}
    if args.c_grid_b:
        grids["_b"] = grid(args.c_grid_b, "--c-grid-b")
    splits = {name: load_split(args.data, name) for name in ("train", "dev", "test")}
    src = args.source
    pool = [e for e in splits["train"] if source_of(e) == src]
    test = [e for e in splits["test"] if source_of(e) == src]
    present = sorted({source_of(e) for e in splits["train"]})
    if not pool or not test:
        raise SystemExit(f"--source {src!r}: {args.data} has {len(pool)} train and {len(test)} test turns of it "
                         f"(its sources: {present})")
    too_many = [k for k in labels if k is not None and k > len(pool)]
    if too_many:
        raise SystemExit(f"--labels {too_many}: the source has {len(pool)} train turns")
    others = [e for e in splits["train"] if source_of(e) != src]
    dev = [e for e in splits["dev"] if source_of(e) != src]  # the source's own dev turns are never read

    engine = load_engine(args.model, decision_head=False)
    layers = resolve_layers(cfg.layers, engine.model.config.num_hidden_layers)
    print(f"[own] {args.model} ({engine.precision}), layers {layers}; {src}: {len(pool)} train turns to label from, "
          f"{len(test)} test turns; other sources: {len(others)} train, {len(dev)} dev turns", flush=True)

    kept = KeptStates(args.features)

    def states(key: str, rows: list):
        return kept.get(key, rows, lambda r: hidden_features(engine, r, layers, cfg.batch_size, key,
                                                             lambda m: print(m, flush=True), ("last", "mean"))[1])

    x_others, x_pool = states("train_others", others), states(f"train_{src}", pool)
    x_dev, x_test = states("dev_others", dev), states(f"test_{src}", test)
    row_of = {e.id: i for i, e in enumerate(pool)}
    gold = [bool(e.needs_clarification) for e in test]

    def scored(fit) -> dict:
        scores = [float(v) for v in head_scores(fit, x_test)]
        s = within_source_summary(gold, scores, [src] * len(test))["by_source"][src]
        return {"c": fit["c"], **({"cv_auroc": fit["cv_auroc"]} if "cv_auroc" in fit else {}), "auroc": s["auroc"], "recall_at_budget": s["recall_at_budget"],
                "f1_at_budget": s["f1_at_budget"], "scores": scores}

    loo_map = None

    def fit(kind: str, labelled: list) -> dict:
        x_lab = x_pool[[row_of[e.id] for e in labelled]] if labelled else x_pool[:0]
        if kind == "mixed":
            return fit_on_features(np.vstack([x_others, x_lab]), others + labelled, x_dev, dev, cfg.c_grid)
        tag = "_b" if kind.endswith("_b") else ""
        base = kind[: len(kind) - len(tag)]
        y = np.array([bool(e.needs_clarification) for e in labelled])
        return fit_on_labels(x_lab, y, loo_map if base == "prior" else None, seed=args.seed, c_grid=grids[tag])

    loo_fit = fit("mixed", [])
    loo = scored(loo_fit)
    w = loo_fit["model"].coef_[0] / loo_fit["scaler"].scale_  # the leave-one-out head as saved: one map on the states
    loo_map = (w, float(loo_fit["model"].intercept_[0]) - float(w @ loo_fit["scaler"].mean_))
    print(f"[own] leave-one-out head (k=0): AUROC {loo['auroc']:.3f}, C={loo['c']:g}", flush=True)
    memo: dict[tuple, dict] = {}

    def run(kind: str, k, seed, labelled: list) -> dict:  # each (head, k, draw) fitted once
        if (kind, k, seed) not in memo:
            memo[kind, k, seed] = scored(fit(kind, labelled))
        return memo[kind, k, seed]

    def adapted(k, seed, labelled: list, tag: str = "") -> dict:
        """What `clarifier adapt` keeps: the best of the leave-one-out head as it is (its AUROC on the labelled
        turns), ``prior`` and ``own`` (out of fold; ``tag`` "_b": fitted with the second grid); a tie keeps it as
        it is."""
        from clarifier.core.metrics import auroc

        y = [bool(e.needs_clarification) for e in labelled]
        as_is = auroc(y, [float(v) for v in head_scores(loo_fit, x_pool[[row_of[e.id] for e in labelled]])])
        options = {"as_is": ({**loo, "cv_auroc": as_is}, 1), "prior": (run("prior" + tag, k, seed, labelled), 0),
                   "own": (run("own" + tag, k, seed, labelled), 0)}
        kept = max(options, key=lambda name: (options[name][0]["cv_auroc"] or 0.0, options[name][1]))
        return {**options[kept][0], "kept": kept}
    references = {}
    if in_domain:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from paired import stored_scores

        whole = splits["test"]
        fingerprint, ids = fingerprint_examples(whole), [e.id for e in whole]
        for name, path, key in in_domain:
            scores, kept = stored_scores(path, key, split="test", fingerprint=fingerprint, ids=ids)
            by_id = dict(zip(ids, scores))
            s = within_source_summary(gold, [by_id[e.id] for e in test], [src] * len(test))["by_source"][src]
            references[name] = {**kept, "auroc": s["auroc"], "recall_at_budget": s["recall_at_budget"],
                                "f1_at_budget": s["f1_at_budget"],
                                "diff_vs_leave_one_out": bootstrap_diff(gold, loo["scores"],
                                                                        [[by_id[e.id] for e in test]], seed=args.seed)}
            print(f"[own] in-domain {name} (trained with {src}): AUROC {s['auroc']:.3f}", flush=True)

    results: dict[str, dict] = {}
    adapt_scores: dict = {}  # k -> the adapt head's test scores per draw (for adapt_b's paired difference)

    def save() -> Path:  # after every head, so that a run cut short keeps what it measured
        return write_result(f"recipe-own-labels-{src}", {
            "data": args.data, "model": args.model, "source": src, "precision": engine.precision, "layers": layers,
            "n": {"labelled_pool": len(pool), "test": len(test), "test_clarify": sum(gold), "other_train": len(others),
                  "other_dev": len(dev)},
            "test_fingerprint": fingerprint_examples(splits["test"]),
            "source_test_fingerprint": fingerprint_examples(test), "draws": args.draws,
            "c_grid": {"mixed": list(cfg.c_grid), "own_prior_cv": list(grids[""]),
                       **({"own_prior_cv_b": list(grids["_b"])} if "_b" in grids else {})},
            "leave_one_out": {k: v for k, v in loo.items() if k != "scores"}, "heads": results,
            "in_domain": references, "seconds": round(time.time() - t0, 1)}, args.out)

    for kind in heads:
        results[kind] = {}
        for k in labels:
            if k == 0:
                if kind == "mixed":
                    results[kind]["0"] = {"k": 0, "draws": [{k2: v for k2, v in loo.items() if k2 != "scores"}],
                                          "auroc_mean": loo["auroc"]}
                continue
            n = len(pool) if k is None else k
            samples = [(None, pool)] if k is None else [
                (args.seed + d, draw_labelled(pool, k, args.seed + d)) for d in range(args.draws)]
            draws = []
            for seed, labelled in samples:
                r = (adapted(k, seed, labelled, kind[5:]) if kind.startswith("adapt")
                     else run(kind, k, seed, labelled))
                draws.append({"seed": seed, "clarify": sum(bool(e.needs_clarification) for e in labelled), **r})
            mean = lambda key: (sum(d[key] for d in draws if d[key] is not None)  # noqa: E731
                                / max(1, sum(d[key] is not None for d in draws)))
            row = {"k": n, "auroc_mean": mean("auroc"), "auroc_min": min(d["auroc"] for d in draws),
                   "auroc_max": max(d["auroc"] for d in draws), "recall_at_budget_mean": mean("recall_at_budget"),
                   "f1_at_budget_mean": mean("f1_at_budget"),
                   "diff_vs_leave_one_out": bootstrap_diff(gold, loo["scores"], [d["scores"] for d in draws],
                                                           seed=args.seed),
                   "draws": [{key: v for key, v in d.items() if key != "scores"} for d in draws]}
            if kind == "adapt":
                adapt_scores[k] = [d["scores"] for d in draws]
            if kind == "adapt_b" and k in adapt_scores:  # the same draws, the first grid: paired per draw
                row["diff_vs_adapt"] = bootstrap_diff(gold, None, [d["scores"] for d in draws], seed=args.seed,
                                                      references=adapt_scores[k])
            results[kind][str("all" if k is None else k)] = row
            print(f"[own] {kind} k={n}: AUROC {row['auroc_mean']:.3f} (draws {row['auroc_min']:.3f}-"
                  f"{row['auroc_max']:.3f}), R@10%OA {row['recall_at_budget_mean']:.3f}; minus leave-one-out "
                  f"{row['diff_vs_leave_one_out']['interval']}", flush=True)
        save()

    print(f"[own] wrote {save()}")


if __name__ == "__main__":
    main()
