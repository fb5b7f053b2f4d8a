"""Does the labelling queue's active selection buy the same AUROC with fewer labels than labelling at random?

    # the model: recipe joint-public trained without the source: a copy of recipes/configs/joint-public.yaml less
    # that source's line in data.sources, with storage.root, data.input and data.output of its own (the results
    # pages: train.max_minutes=25, train.decision_head.max_per_source=250); then
    #   CLARIFIER_DATA_MIRROR=... clarifier train --config loo-pacific.yaml --prepare --no-eval
    # prints the model's folder (model_dir) at the end
    .venv/bin/python benchmarks/labelling/active_vs_random.py --data .clarifier/recipes/joint-public/data \
        --model <folder of the model trained without pacific> --source pacific \
        --in-domain retrained-plain=benchmarks/results/recipe-retrain-plain.json:retrained-plain

A team's assistant is a source the shipped model never saw. Here one public source plays it: the model was trained
without it, the source's **train** turns are "the team's logs" to label, and its **test** turns, never labelled nor
used for any choice, score every head. For each seed, as the product does it:

* the **kept-apart slice** (``clarifier label select``'s, :func:`clarifier.core.selection.kept_apart_slice`):
  ``--kept-apart`` turns, stratified by the model's score, one per conversation; their conversations leave the
  pool. Labelled, never fitted on: at every count the adapted head's AUROC on them, with its bootstrap interval
  (:func:`clarifier.train.adapt.kept_apart_figures`), is checked against its AUROC on the test turns;
* **random**: the pool's turns in a seeded random order, the first k labelled (the kind of draw
  ``clarifier label select --strategy random`` queues, not the same order);
* **active**: ``--step`` turns at a time, each round chosen by :func:`clarifier.core.selection.active_selection`
  (the scores nearest the threshold, spread over MiniLM k-means clusters of the turn's text) from the scores and
  threshold of the model as it then stands: the model as trained for the first round, then the head ``clarifier
  adapt`` keeps after each round (select -> label -> adapt -> select again).

At every count both are adapted by ``clarifier adapt``'s own choice (:func:`clarifier.train.adapt.select_head`: the
model's head as it is, moved to the labels, or fitted on them alone, by out-of-fold AUROC; the threshold by the
product's rule). With fewer than five turns of a class adapt refuses, and the model stays as it was. Beside them:
the surface control (position and length) fitted on the same labelled turns, the head on every pool turn (``all``),
and ``--in-domain``: a model trained *with* the source, by its scores kept in a ``paired.py`` result on the same
test split. Per count: mean AUROC and recall / F1 at 10% over-asking over the seeds, and active minus random by the
paired bootstrap of the test turns (the same seeds paired). JSON and a PNG of the curves out.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "recipe"))
from common import KeptStates, result_file, write_result  # noqa: E402
from own_labels import bootstrap_diff, parse_in_domain  # noqa: E402


def parse_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise SystemExit(f"--labels {text!r}: comma-separated counts of labelled turns, e.g. 25,50,100,400") from None
    if not counts or counts[0] < 1:
        raise SystemExit(f"--labels {text!r}: counts must be >= 1")
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-job output holding the source's train and test turns")
    ap.add_argument("--model", required=True, help="a model trained without --source (folder or URI), with its "
                                                   "decision head")
    ap.add_argument("--source", required=True, help="the source left out of the model's training")
    ap.add_argument("--labels", default="25,50,100,150,200,300,400",
                    help="counts of labelled turns to score at (comma-separated); the pool's every turn is added")
    ap.add_argument("--step", type=int, default=25, help="turns the active queue adds per round")
    ap.add_argument("--seeds", type=int, default=5, help="seeds (each its own kept-apart slice, order and rounds)")
    ap.add_argument("--kept-apart", type=int, default=60, help="turns of the kept-apart slice per seed")
    ap.add_argument("--pool-factor", type=int, default=4, help="label select's --pool-factor")
    ap.add_argument("--encoder", default="all-minilm-l6-v2", help="the sentence encoder of the diversity clusters")
    ap.add_argument("--in-domain", action="append", default=[], metavar="NAME=RESULT.json:MODEL",
                    help="a model trained with the source, by its scores in a paired.py result on the same test split")
    ap.add_argument("--features", default=None, help="an .npz to keep the model's states in and reuse on a rerun")
    ap.add_argument("--max-over-asking", type=float, default=0.1)
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once, in forked processes (one thread each)")
    ap.add_argument("--max-pool", type=int, default=None, help="a smoke run: this many pool turns (a seeded draw)")
    ap.add_argument("--max-test", type=int, default=None, help="a smoke run: this many test turns (a seeded draw)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = f"labelling-active-vs-random-{args.source}"
    out_path = result_file(name, args.out)
    plot_path = result_file(name, str(out_path.with_suffix(".png")), suffix=".png")
    counts = parse_counts(args.labels)
    if args.step < 1 or args.seeds < 1 or args.kept_apart < 0:
        raise SystemExit("--step and --seeds must be >= 1, --kept-apart >= 0")
    in_domain = parse_in_domain(args.in_domain)

    import numpy as np

    from clarifier.core.metrics import auroc, operating_point_at_over_asking
    from clarifier.core.schema import source_of
    from clarifier.core.selection import active_selection, kept_apart_slice
    from clarifier.core.surface import fit_surface_control
    from clarifier.data.outputs import load_split
    from clarifier.engine.loading import load_engine
    from clarifier.engine.similarity import SentenceEncoder
    from clarifier.evaluation.evaluate import fingerprint_examples
    from clarifier.evaluation.label_queue import turn_text
    from clarifier.train.adapt import MIN_PER_CLASS, kept_apart_figures, select_head
    from clarifier.train.calibrate import choose_threshold
    from clarifier.train.decision_head import LocalFeatures, head_scores

    t0 = time.time()
    src = args.source
    train, test_all = load_split(args.data, "train"), load_split(args.data, "test")
    pool = [e for e in train if source_of(e) == src]
    test = [e for e in test_all if source_of(e) == src]
    if not pool or not test:
        raise SystemExit(f"--source {src!r}: {args.data} has {len(pool)} train and {len(test)} test turns of it "
                         f"(its sources: {sorted({source_of(e) for e in train})})")
    if args.max_pool:
        pool = sorted(random.Random(0).sample(pool, min(args.max_pool, len(pool))), key=lambda e: e.id)
    if args.max_test:
        test = sorted(random.Random(0).sample(test, min(args.max_test, len(test))), key=lambda e: e.id)
    if counts[-1] > len(pool) - args.kept_apart:
        raise SystemExit(f"--labels {counts[-1]}: the pool has {len(pool)} turns, {args.kept_apart} kept apart")

    engine = load_engine(args.model, decision_head=True)
    head = engine.decision_head
    if head is None or head.clip is not None:
        raise SystemExit(f"--model {args.model}: needs an unclipped decision head (clarifier adapt's prior)")
    threshold0 = float(engine.threshold)
    prior = (head.weight.double().numpy(), head.bias)
    print(f"[active] {args.model} ({engine.precision}), head on layers {head.layers} ({'+'.join(head.pooling)}), "
          f"threshold {threshold0:.3f}; {src}: {len(pool)} train turns to label from, {len(test)} test turns "
          f"({sum(bool(e.needs_clarification) for e in test)} need a question)", flush=True)

    kept = KeptStates(args.features)
    features = LocalFeatures(engine)

    def states(key: str, rows: list):
        return kept.get(key, rows, lambda r: features(r, head.layers, head.pooling, 8, key,
                                                      lambda m: print(m, flush=True))[1], what=key)

    x_pool, x_test = states(f"train_{src}", pool), states(f"test_{src}", test)
    precision = engine.precision
    del engine, features  # the states are all this needs from the model

    w_head, b_head = head.weight.double().numpy(), float(head.bias)

    def probability(x):  # the head as it is, in numpy (what head.probability computes)
        return [float(v) for v in 1.0 / (1.0 + np.exp(-(np.asarray(x, dtype=np.float64) @ w_head + b_head)))]

    before_pool, before_test = probability(x_pool), probability(x_test)
    y_pool = np.array([bool(e.needs_clarification) for e in pool])
    gold = [bool(e.needs_clarification) for e in test]
    print(f"[active] embedding the {len(pool)} pool turns with {args.encoder}", flush=True)
    emb = np.asarray(SentenceEncoder(args.encoder).encode([turn_text(e) for e in pool]))
    ids = [e.id for e in pool]
    convs = [str(getattr(e, "conversation_id", None) or e.id) for e in pool]

    def figures(scores: list[float]) -> dict:
        op = operating_point_at_over_asking(gold, scores, args.max_over_asking)
        return {"auroc": auroc(gold, scores), "recall_at_budget": op["recall"] if op else None,
                "f1_at_budget": op["f1"] if op else None}

    def adapt(idx: list[int]):
        """What ``clarifier adapt`` makes of the labelled turns ``idx``: (scorer of states, threshold, kept)."""
        y = y_pool[idx]
        if min(int(y.sum()), int((~y).sum())) < MIN_PER_CLASS:
            return probability, threshold0, "refused"
        before = [before_pool[i] for i in idx]
        fits, kept_name = select_head(x_pool[idx], y, before, prior, "auto", 0)
        thr, _ = choose_threshold([bool(v) for v in y], fits[kept_name]["oof"], args.max_over_asking)
        if kept_name == "shipped":
            return probability, thr, kept_name
        fit = fits[kept_name]
        return (lambda x: [float(v) for v in head_scores(fit, x)]), thr, kept_name

    control_all = fit_surface_control(pool, list(y_pool), seed=0).scores(test)
    all_scores = adapt(list(range(len(pool))))[0](x_test)
    reference = {"before": figures(before_test), "all": {**figures(all_scores), "labels": len(pool)},
                 "surface_control_all": figures(control_all)}
    print(f"[active] before adapting AUROC {reference['before']['auroc']:.3f}; adapted on all {len(pool)} pool turns "
          f"{reference['all']['auroc']:.3f}; surface control on all {reference['surface_control_all']['auroc']:.3f}",
          flush=True)

    def point(idx: list[int], held: list[int]) -> dict:
        scorer, thr, kept_name = adapt(idx)
        scores = scorer(x_test)
        labelled = [pool[i] for i in idx]
        y = [bool(e.needs_clarification) for e in labelled]
        control = (fit_surface_control(labelled, y, seed=0).scores(test)
                   if min(sum(y), len(y) - sum(y)) >= 2 else [0.5] * len(test))
        row = {"labels": len(idx), "clarify": int(sum(y)), "kept": kept_name, "threshold": thr, **figures(scores),
               "surface_control_auroc": auroc(gold, control), "scores": scores}
        if held:
            hs = scorer(x_pool[held])
            ka = kept_apart_figures([pool[i] for i in held], hs, [before_pool[i] for i in held], thr, labelled, 0,
                                    args.max_over_asking)
            iv = ka.get("auroc_interval")
            row["kept_apart"] = {"auroc": ka["auroc"], "interval": iv, "n": ka["n"], "clarify": ka["clarify"],
                                 "covers_test": (iv[0] <= row["auroc"] <= iv[1]) if iv and row["auroc"] is not None
                                 else None}
        return row

    def one_seed(seed: int) -> tuple[dict, dict]:
        held = kept_apart_slice(ids, convs, before_pool, args.kept_apart, seed=seed)
        held_convs = {convs[i] for i in held}
        eligible = [i for i in range(len(pool)) if convs[i] not in held_convs]
        if counts[-1] > len(eligible):
            raise SystemExit(f"--labels {counts[-1]}: seed {seed} leaves {len(eligible)} turns outside the kept-apart "
                             f"conversations; lower --kept-apart or the counts")
        order = eligible[:]
        random.Random(seed).shuffle(order)
        rnd = {"seed": seed, "kept_apart": len(held), "points": []}
        for k in counts:
            rnd["points"].append(point(order[:k], held))
        act = {"seed": seed, "kept_apart": len(held), "points": [], "rounds": []}
        labelled: list[int] = []
        scores_now, thr_now = before_pool, threshold0
        while len(labelled) < counts[-1]:
            left = [i for i in eligible if i not in set(labelled)]
            n = min(args.step, counts[-1] - len(labelled))
            picked, _ = active_selection(ids, scores_now, thr_now, left, n, lambda rows: emb[rows], seed=seed,
                                         pool_factor=args.pool_factor)
            labelled += picked
            scorer, thr_now, kept_name = adapt(labelled)
            scores_now = scorer(x_pool)
            act["rounds"].append({"labels": len(labelled), "kept": kept_name,
                                  "clarify": int(y_pool[labelled].sum())})
            if len(labelled) in counts:
                act["points"].append(point(labelled, held))
        line = lambda r: ", ".join(f"{p['labels']}: {p['auroc']:.3f}" for p in r["points"])  # noqa: E731
        print(f"[active] seed {seed}: random {line(rnd)}", flush=True)
        print(f"[active] seed {seed}: active {line(act)} ({time.time() - t0:.0f}s)", flush=True)
        return rnd, act

    global _ONE_SEED
    _ONE_SEED = one_seed
    if args.jobs > 1:  # seeds in forked processes (numpy and scikit-learn only past this point: fork-safe)
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as workers:
            done = workers.map(_run_seed, range(args.seeds))
    else:
        done = [one_seed(seed) for seed in range(args.seeds)]
    runs: dict[str, list[dict]] = {"random": [d[0] for d in done], "active": [d[1] for d in done]}


    def mean(vals):
        vals = [v for v in vals if v is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    curves: dict[str, list[dict]] = {}
    for strategy, seeds in runs.items():
        curves[strategy] = []
        for j, k in enumerate(counts):
            pts = [s["points"][j] for s in seeds]
            kas = [p.get("kept_apart") or {} for p in pts]
            curves[strategy].append({
                "labels": k, "auroc_mean": mean([p["auroc"] for p in pts]),
                "auroc_min": min(p["auroc"] for p in pts), "auroc_max": max(p["auroc"] for p in pts),
                "recall_at_budget_mean": mean([p["recall_at_budget"] for p in pts]),
                "f1_at_budget_mean": mean([p["f1_at_budget"] for p in pts]),
                "clarify_mean": mean([p["clarify"] for p in pts]),
                "surface_control_auroc_mean": mean([p["surface_control_auroc"] for p in pts]),
                "kept": [p["kept"] for p in pts],
                "kept_apart_auroc_mean": mean([ka.get("auroc") for ka in kas]),
                "kept_apart_covers_test": sum(bool(ka.get("covers_test")) for ka in kas),
                "vs_before": bootstrap_diff(gold, before_test, [p["scores"] for p in pts]),
                "vs_all": bootstrap_diff(gold, all_scores, [p["scores"] for p in pts])})
    for j, row in enumerate(curves["active"]):
        row["minus_random"] = bootstrap_diff(gold, None, [s["points"][j]["scores"] for s in runs["active"]],
                                             references=[s["points"][j]["scores"] for s in runs["random"]])

    target = curves["random"][-1]["auroc_mean"]
    reached = next((r["labels"] for r in curves["active"] if r["auroc_mean"] is not None and r["auroc_mean"] >= target),
                   None)
    references = {}
    if in_domain:
        from paired import stored_scores

        fingerprint, all_ids = fingerprint_examples(test_all), [e.id for e in test_all]
        for key_name, path, key in in_domain:
            scores, meta = stored_scores(path, key, split="test", fingerprint=fingerprint, ids=all_ids)
            by_id = dict(zip(all_ids, scores))
            sc = [by_id[e.id] for e in test]
            references[key_name] = {**meta, **figures(sc)}
    best_in = max([r["auroc"] for r in references.values()] + [reference["all"]["auroc"]])
    within = next((r["labels"] for r in curves["active"] if r["auroc_mean"] is not None
                   and r["auroc_mean"] >= best_in - 0.05), None)
    goals = {
        "random_at_most_labels": {"labels": counts[-1], "auroc_mean": target},
        "active_labels_to_match_it": reached, "goal_active_labels": 150,
        "met_match": reached is not None and reached <= 150,
        "in_domain_best_auroc": best_in, "active_labels_within_0.05_of_it": within,
        "met_within": within is not None and within <= 200,
        "kept_apart_covers_test": {s: f"{sum(r['kept_apart_covers_test'] for r in curves[s])} of "
                                      f"{len(counts) * args.seeds}" for s in curves}}
    strip = {s: [{**seed_run, "points": [{k: v for k, v in p.items() if k != "scores"} for p in seed_run["points"]]}
                 for seed_run in seeds] for s, seeds in runs.items()}
    result = {
        "data": args.data, "model": args.model, "source": src, "precision": precision,
        "n": {"pool": len(pool), "pool_clarify": int(y_pool.sum()), "test": len(test), "test_clarify": sum(gold),
              "pool_conversations": len(set(convs))},
        "test_fingerprint": fingerprint_examples(test_all), "source_test_fingerprint": fingerprint_examples(test),
        "settings": {"labels": counts, "step": args.step, "seeds": args.seeds, "kept_apart": args.kept_apart,
                     "pool_factor": args.pool_factor, "encoder": args.encoder,
                     "max_over_asking": args.max_over_asking, "threshold_before": threshold0,
                     "max_pool": args.max_pool, "max_test": args.max_test, "jobs": args.jobs},
        "reference": reference, "in_domain": references, "curves": curves, "goals": goals, "runs": strip,
        "seconds": round(time.time() - t0, 1), "plot": plot_path.name}
    plot(curves, reference, references, src, plot_path)
    print(f"[active] random with {counts[-1]} labels: AUROC {target:.3f}; active reaches it with "
          f"{reached if reached is not None else 'more than ' + str(counts[-1])} labels; wrote "
          f"{write_result(name, result, out_path)} and {plot_path}", flush=True)


_ONE_SEED = None  # set by main before the seeds fork


def _run_seed(seed: int):
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        return _ONE_SEED(seed)


def plot(curves: dict, reference: dict, references: dict, src: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for strategy, colour in (("random", "tab:gray"), ("active", "tab:blue")):
        rows = curves[strategy]
        x = [r["labels"] for r in rows]
        ax.plot(x, [r["auroc_mean"] for r in rows], marker="o", color=colour, label=f"{strategy} selection (mean)")
        ax.fill_between(x, [r["auroc_min"] for r in rows], [r["auroc_max"] for r in rows], color=colour, alpha=0.15)
    ax.axhline(reference["all"]["auroc"], color="tab:green", ls="--",
               label=f"adapted on all {reference['all']['labels']} pool turns")
    ax.axhline(reference["before"]["auroc"], color="tab:red", ls=":", label="before adapting")
    ax.axhline(reference["surface_control_all"]["auroc"], color="tab:orange", ls="-.",
               label="surface control, all pool turns")
    for name, r in references.items():
        ax.axhline(r["auroc"], color="black", ls="--", lw=0.8, label=f"in-domain: {name}")
    ax.set_xscale("log")
    ticks = [r["labels"] for r in curves["active"]]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("labelled turns")
    ax.set_ylabel(f"AUROC on {src}'s test turns")
    ax.set_title(f"{src}, left out of training: labels chosen at random vs by the queue")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
