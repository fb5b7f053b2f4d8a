"""Refit a trained model's decision head under other settings and compare, paired. JSON out.

    .venv/bin/python benchmarks/recipe/head_refit.py --data .clarifier/recipe-benchmark/joint-public/recipe/data
    # recipe v3's head (last, 600 per source) against the same states plus their prompt mean over every train turn
    # (v3.1's):  --head v3=last:600 --head v3.1=last+mean:all   (the defaults)
    # and write the last head's model (a copy of --model with that head and a threshold calibrated on dev), plus a
    # recipe-benchmark result whose row "joint" is that model on the recipe's evaluation set, to package it:
    #   --save-model DIR --recipe-result benchmarks/results/recipe-joint-public-v3.json
    # v3.2's head: the same states with the prompt showing only the latest 4 history turns (model.max_history_turns;
    # the saved model records it):  --head v3.1=last+mean:all --head v3.2=last+mean:all:4
    # v3.3's: v3.2's states, standardised features clipped at 1 sd (train.decision_head.clip), strengths up to 0.1:
    #   --head v3.2=last+mean:all:4 --head v3.3=last+mean:all:4:1 --c-grid 1e-4,3e-4,1e-3,3e-3,1e-2,3e-2,0.1
    # passages focused on the conversation (model.passage_focus; the saved model records it):
    #   --head v3.2=last+mean:all:4 --head focus=last+mean:all:4+focus
    # heads on the first half of the layers only (the decision pass could stop there): states of more layers, each
    # head reading some of them:  --layers 4,8,12,15,22,30 --head v3.2=last+mean/8,15,22,30:all
    #   --head half=last+mean/4,8,12,15:all

The decision head (:mod:`clarifier.engine.decision_head`) is a logistic regression on hidden states of four
layers; the recipe (`train.decision_head`) fits it on up to ``max_per_source`` train turns per source (half
needing a question), source- and class-balanced, its strength chosen on the dev split. This script computes
the model's states once (every train turn, the dev split, the whole test split; at the last position and
averaged over the prompt; once per prompt variant the heads name: history window, passage focus) and fits every
``--head NAME=POOLING[/LAYERS]:MAX_PER_SOURCE[:WINDOW[+focus][:CLIP]]`` with that same procedure
(:func:`clarifier.train.decision_head.fit_on_features`); the first head is the reference. Only then are the
test turns scored: on the recipe benchmark's evaluation set (the seeded test sample of ``joint-public``: 100
turns per source, 30% needing a question; fingerprint recorded) and on the whole test split, each with the
paired bootstrap of the mean within-source AUROC against the reference. ``--dev-only`` stops before that: the
heads on the dev split they were chosen on (the same paired bootstrap), for exploring without reading the test
turns; the test split's states are not computed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import KeptStates, result_file, write_result  # noqa: E402


def parse_head(spec: str) -> tuple[str, list[str], int | None, tuple[int | None, bool], float | None, list[int] | None]:
    """``NAME=POOLING[/LAYERS]:MAX_PER_SOURCE[:WINDOW[+focus][:CLIP]]`` (``v3.3=last+mean:all:4:1``) -> ``(name,
    pooling, cap or None, (window or None, focus), clip or None, layers or None)``; LAYERS: comma-separated hidden-state
    indexes, some of ``--layers`` (without: all of them); WINDOW: the prompt shows the latest WINDOW history turns
    (``model.max_history_turns``; ``all``: the model's own prompt); ``+focus``: long passages show the sentences
    the conversation is about (``model.passage_focus``; without it: the model's own setting); CLIP: standardised
    features limited to [-CLIP, CLIP] (``train.decision_head.clip``)."""
    try:
        name, rest = spec.split("=", 1)
        pooling, cap, *more = rest.split(":")
        pooling, _, head_layers = pooling.partition("/")
        head_layers = sorted({int(i) for i in head_layers.split(",")}) if head_layers else None
        if len(more) > 2:
            raise ValueError(spec)
        window, clip = more + ["all", "none"][len(more):]
        window, *flags = window.split("+")
        if flags not in ([], ["focus"]):
            raise ValueError(spec)
        clip = None if clip == "none" else float(clip)
        if clip is not None and not clip > 0:
            raise ValueError(spec)
        return (name, pooling.split("+"), None if cap == "all" else int(cap),
                (None if window == "all" else int(window), bool(flags)), clip, head_layers)
    except ValueError:
        raise SystemExit(f"--head {spec!r}: expected NAME=POOLING[/LAYERS]:MAX_PER_SOURCE[:WINDOW[+focus][:CLIP]], "
                         "e.g. v3.1=last+mean:all, v3.2=last+mean:all:4, v3.3=last+mean:all:4:1, "
                         "focus=last+mean:all:4+focus or half=last+mean/4,8,12,15:all") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the recipe benchmark's data-job output (train, dev and test splits)")
    ap.add_argument("--model", default="builtin:clarifier-smollm2-135m")
    ap.add_argument("--layers", default=None,
                    help="comma-separated hidden-state indexes whose states are computed (default: the recipe's "
                         "train.decision_head.layers for this model); a head reads all of them or those after its /")
    ap.add_argument("--head", action="append", default=None,
                    help="NAME=POOLING[/LAYERS]:MAX_PER_SOURCE[:WINDOW[+focus][:CLIP]] (POOLING last, mean or last+mean; "
                         "LAYERS: some of --layers, comma-separated; "
                         "MAX_PER_SOURCE a number or all; WINDOW: the prompt shows only the latest WINDOW history turns, "
                         "all (default): the model's own; +focus: long passages show the sentences the conversation is "
                         "about (model.passage_focus); CLIP: standardised features limited to [-CLIP, CLIP], none (default): no "
                         "limit); repeatable, the first is the reference (default: v3=last:600 v3.1=last+mean:all)")
    ap.add_argument("--c-grid", default=None,
                    help="comma-separated inverse L2 strengths tried for every head (default: the config's c_grid)")
    ap.add_argument("--eval-per-source", type=int, default=100)
    ap.add_argument("--eval-clarify-share", type=float, default=0.3)
    ap.add_argument("--max-over-asking", type=float, default=0.1, help="the threshold rule, on dev")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--features", default=None, help="an .npz to keep the states in and reuse on a rerun")
    ap.add_argument("--save-model", default=None, help="write the last head's model folder here")
    ap.add_argument("--recipe-result", default=None,
                    help="with --save-model: the recipe benchmark JSON the model's row came from; writes a copy whose "
                         "row 'joint' is the saved model measured on the same evaluation set (to package it)")
    ap.add_argument("--recipe-result-out", default=None,
                    help="where that copy goes (default: results/<its benchmark>-head-refit.json)")
    ap.add_argument("--dev-only", action="store_true",
                    help="compare the heads on the dev split only (their strengths were chosen there); the test turns "
                         "are not read")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.dev_only and args.save_model:
        raise SystemExit("--save-model needs the test evaluation: leave out --dev-only")
    result_file("recipe-head-refit", args.out)  # refused now, not after the run, when that file is already there
    if args.save_model and args.recipe_result:  # and so is the copy of the recipe result, named after its benchmark
        result_file(json.loads(Path(args.recipe_result).read_text())["benchmark"] + "-head-refit",
                    args.recipe_result_out, option="--recipe-result-out")
    heads = [parse_head(h) for h in (args.head or ["v3=last:600", "v3.1=last+mean:all"])]

    import numpy as np

    from clarifier.core.config import DecisionHeadConfig
    from clarifier.core.metrics import paired_bootstrap, within_source_summary
    from clarifier.core.schema import sample_by_source, source_of
    from clarifier.data.outputs import load_split
    from clarifier.engine.decision_head import check_pooling, resolve_layers
    from clarifier.engine.loading import load_engine
    from clarifier.evaluation.evaluate import fingerprint_examples
    from clarifier.train.decision_head import fit_on_features, head_scores, hidden_features

    t0 = time.time()
    cfg = DecisionHeadConfig(**({} if args.c_grid is None else
                                 {"c_grid": [float(c) for c in args.c_grid.split(",") if c.strip()]}))
    for _, pooling, _, _, _, _ in heads:
        check_pooling(pooling)
    splits = {name: load_split(args.data, name) for name in ("train", "dev") + (() if args.dev_only else ("test",))}
    eval_set = [] if args.dev_only else sample_by_source(splits["test"], args.eval_per_source, args.seed,
                                                          args.eval_clarify_share)
    engine = load_engine(args.model, decision_head=False)
    own_opts = engine.opts
    n_layers = engine.model.config.num_hidden_layers
    layers = (resolve_layers(cfg.layers, n_layers) if args.layers is None else
              sorted({int(i) for i in args.layers.split(",") if i.strip()}))
    if not layers or not all(1 <= i <= n_layers for i in layers):
        raise SystemExit(f"--layers {args.layers}: hidden-state indexes from 1 to {n_layers}")
    for head_name, *_, head_layers in heads:
        if head_layers and not set(head_layers) <= set(layers):
            raise SystemExit(f"--head {head_name}: layers {head_layers} are not all among the computed {layers} (--layers)")
    print(f"[refit] {args.model} ({engine.precision}), layers {layers}: {len(splits['train'])} train, "
          f"{len(splits['dev'])} dev turns" + ("; dev only, the test split is not read" if args.dev_only else
                                                f", {len(splits['test'])} test turns; evaluation set {len(eval_set)} "
                                                f"(fingerprint {fingerprint_examples(eval_set)[:12]})"), flush=True)
    # keys: the split's name ("train"; the whole history) or "train@w4" (a window of 4 history turns), "train@w4+focus"
    kept = KeptStates(args.features)
    cached = kept.kept  # states a previous run of the same data computed
    for key in cached:  # checked before any state is computed
        name = key.split("@")[0]
        if name in splits:  # --dev-only: the test split's states stay unread
            kept.check(key, splits[name], f"{args.data}'s {name} split")

    def prompt_of(variant):
        window, focus = variant
        return replace(own_opts, max_history_turns=own_opts.max_history_turns if window is None else window,
                       passage_focus=own_opts.passage_focus or focus)

    def states(name, variant=(None, False)):
        opts = prompt_of(variant)  # the key names the prompt it was rendered with, and other layers than the default
        window, focus = opts.max_history_turns, opts.passage_focus
        key = name if window is None and not focus else (
            f"{name}@" + ("" if window is None else f"w{window}") + ("+focus" if focus else ""))
        if args.layers is not None:
            key += "@L" + "-".join(map(str, layers))

        def compute(rows):
            engine.opts = opts
            try:
                return hidden_features(engine, rows, layers, cfg.batch_size, key, lambda m: print(m, flush=True),
                                       ("last", "mean"))[1]
            finally:
                engine.opts = own_opts

        return kept.get(key, splits[name], compute, f"{args.data}'s {name} split")

    hidden = engine.model.config.hidden_size

    def columns(x, pooling, head_layers=None):  # the engine's layout: every layer's last, then every layer's mean
        blocks = [(0 if p == "last" else len(layers)) + layers.index(i) for p in pooling for i in (head_layers or layers)]
        return np.hstack([x[:, b * hidden:(b + 1) * hidden] for b in blocks])

    row_of = {name: {e.id: i for i, e in enumerate(rows)} for name, rows in splits.items()}
    fits = {}
    for head_name, pooling, cap, variant, clip, head_layers in heads:  # every head is fixed before the test split is read
        train = splits["train"] if cap is None else sample_by_source(splits["train"], cap, args.seed, clarify_share=0.5)
        x_train = columns(states("train", variant)[[row_of["train"][e.id] for e in train]], pooling, head_layers)
        fit = fit_on_features(x_train, train, columns(states("dev", variant), pooling, head_layers), splits["dev"],
                              cfg.c_grid, clip)
        fits[head_name] = {**fit, "pooling": pooling, "n_train": len(train), "variant": variant,
                           "layers": head_layers or layers}
        shown = f", layers {head_layers or layers}" + ("" if variant[0] is None else f", latest {variant[0]} history turns") + (
            ", passages focused" if variant[1] else "") + ("" if clip is None else f", clipped at {clip:g} sd")
        print(f"[refit] {head_name} ({'+'.join(pooling)}, {len(train)} train turns{shown}): C={fit['c']:g}, "
              f"dev within-source AUROC {fit['dev_macro_auroc']:.3f}", flush=True)

    def described(fit) -> dict:  # what the result records of a head
        return {"pooling": fit["pooling"], "layers": fit["layers"], "n_train": fit["n_train"], "c": fit["c"], "max_history_turns": fit["variant"][0],
                "passage_focus": fit["variant"][1], "clip": fit["clip"], "dev_macro_auroc": round(fit["dev_macro_auroc"], 4),
                "tried": fit["tried"]}

    reference = heads[0][0]
    if args.dev_only:
        dev, src = splits["dev"], [source_of(e) for e in splits["dev"]]
        gold = [e.needs_clarification for e in dev]
        results = {}
        for head_name, fit in fits.items():
            scores = [float(v) for v in fit["dev_scores"]]
            results[head_name] = {**described(fit), "dev_split": within_source_summary(gold, scores, src)}
        boot = paired_bootstrap(gold, {n: ([float(v) >= 0.5 for v in f["dev_scores"]], [float(v) for v in f["dev_scores"]])
                                       for n, f in fits.items()}, reference=reference, sources=src, seed=args.seed)
        for head_name in fits:
            if head_name != reference:
                print(f"[refit] {head_name} minus {reference} on the dev split: "
                      f"{boot['systems'][head_name]['macro_auroc_diff']}", flush=True)
        path = write_result("recipe-head-refit", {
            "data": args.data, "model": args.model, "precision": engine.precision, "layers": layers,
            "dev_only": True, "heads": results, "reference": reference, "n": {k: len(v) for k, v in splits.items()},
            "dev_fingerprint": fingerprint_examples(dev), "bootstrap": {"dev_split": boot},
            "states_from_cache": cached, "seconds": round(time.time() - t0, 1)}, args.out)
        print(f"[refit] wrote {path} (dev split only; the test turns were not read)")
        return

    results, systems = {}, {}
    for set_name, rows in (("evaluation_set", eval_set), ("test_split", splits["test"])):
        gold, src = [e.needs_clarification for e in rows], [source_of(e) for e in rows]
        systems[set_name] = {}
        for head_name, fit in fits.items():
            x = states("test", fit["variant"])[[row_of["test"][e.id] for e in rows]]
            scores = [float(v) for v in head_scores(fit, columns(x, fit["pooling"], fit["layers"]))]
            systems[set_name][head_name] = ([s >= 0.5 for s in scores], scores)
            summary = within_source_summary(gold, scores, src)
            results.setdefault(head_name, described(fit))
            results[head_name][set_name] = summary
            print(f"[refit] {head_name} on the {set_name.replace('_', ' ')} ({len(rows)} turns): mean within-source "
                  f"AUROC {summary['macro_auroc']:.3f}", flush=True)
    boots = {}
    for set_name, rows in (("evaluation_set", eval_set), ("test_split", splits["test"])):
        boots[set_name] = paired_bootstrap([e.needs_clarification for e in rows], systems[set_name],
                                           reference=reference, sources=[source_of(e) for e in rows], seed=args.seed)
        for head_name in fits:
            if head_name != reference:
                print(f"[refit] {head_name} minus {reference} on the {set_name.replace('_', ' ')}: "
                      f"{boots[set_name]['systems'][head_name]['macro_auroc_diff']}", flush=True)

    saved = None
    if args.save_model:
        head_name = heads[-1][0]
        saved = save_model(args, engine, fits[head_name], fits[head_name]["layers"], cfg, splits, eval_set, head_name)
    path = write_result("recipe-head-refit", {
        "data": args.data, "model": args.model, "precision": engine.precision, "layers": layers,
        "heads": results, "reference": reference, "n": {k: len(v) for k, v in splits.items()},
        "eval_fingerprint": fingerprint_examples(eval_set), "test_fingerprint": fingerprint_examples(splits["test"]),
        "bootstrap": boots, "saved": saved, "states_from_cache": cached, "seconds": round(time.time() - t0, 1)},
        args.out)
    print(f"[refit] wrote {path}")


def save_model(args, engine, fit, layers, cfg, splits, eval_set, head_name) -> dict:
    """A copy of ``--model`` deciding with ``fit``'s head, its threshold chosen on the dev scores by the
    recipe's rule; with ``--recipe-result``, a copy of that result whose row ``joint`` is this model on the
    same evaluation set (decisions, questions, grounding: the engine's full predict)."""
    from clarifier.engine.builtin import resolve_builtin_uri
    from clarifier.engine.inference import read_meta, write_meta
    from clarifier.engine.loading import load_engine
    from clarifier.core.config import load_config
    from clarifier.evaluation.evaluate import fingerprint_examples, similarity_fn_for
    from clarifier.recipes import recipe_path
    from clarifier.recipes.benchmark import row_metrics
    from clarifier.runtime.cluster import git_commit
    from clarifier.train.calibrate import calibrate_model
    from clarifier.train.decision_head import fitted_head

    src = Path(resolve_builtin_uri(args.model).folder if args.model.startswith("builtin:") else args.model)
    dst = Path(args.save_model)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("MODEL_CARD.md", "card.json"))
    fitted_head(fit, layers, fit["pooling"]).save(dst)
    meta = read_meta(dst)
    refit = {"script": "benchmarks/recipe/head_refit.py", "head": head_name, "git": git_commit(),
             "date": time.strftime("%Y-%m-%d")}
    window, focus = fit["variant"]
    prompt = {**(meta.prompt or {}), **({} if window is None else {"max_history_turns": window}),
              **({"passage_focus": True} if focus else {})}
    write_meta(dst, replace(meta, prompt=prompt, decision_head={
        "layers": layers, "layer_fractions": [round(i / engine.model.config.num_hidden_layers, 4) for i in layers], "pooling": fit["pooling"], "clip": fit["clip"], "c": fit["c"],
        "n_train": fit["n_train"], "n_dev": len(splits["dev"]), "dev_macro_auroc": fit["dev_macro_auroc"],
        # the same model's decision tokens on the same dev split: unchanged by a refit
        "dev_macro_auroc_token": (meta.decision_head or {}).get("dev_macro_auroc_token"),
        "tried": fit["tried"], "precision": engine.precision, "refit": refit}))
    cal = calibrate_model(dst, splits["dev"], max_over_asking=args.max_over_asking,
                          scores=[float(v) for v in fit["dev_scores"]], precision=engine.precision, progress=print)
    thr, rule = cal["threshold"], cal["rule"]
    print(f"[refit] saved {dst}: {head_name}'s head, threshold {thr:.3f} ({rule})", flush=True)
    out = {"folder": str(dst), "threshold": float(thr), "rule": rule}
    if args.recipe_result:
        result = json.loads(Path(args.recipe_result).read_text())
        if result["eval_set"]["fingerprint"] != fingerprint_examples(eval_set):
            raise SystemExit(f"{args.recipe_result} was measured on another evaluation set "
                             f"({result['eval_set']['fingerprint'][:12]} vs {fingerprint_examples(eval_set)[:12]})")
        rcfg = load_config(recipe_path(result["plan"]["recipe"]), result["plan"].get("overrides") or [])
        sim_fn, _ = similarity_fn_for(rcfg, print)
        saved_engine = load_engine(str(dst), max_new_tokens=rcfg.eval.max_new_tokens, precision=rcfg.model.precision)
        t0 = time.time()
        preds = saved_engine.predict(eval_set, batch_size=rcfg.eval.batch_size,
                                     progress=lambda d, n: print(f"[eval] {d}/{n}", flush=True) if d == n or d % 64 == 0 else None)
        old = result["rows"]["joint"]
        row = {**{k: old.get(k) for k in ("kind", "overrides", "run_id", "steps", "decided_by")},
               "threshold": float(thr), "eval_seconds": round(time.time() - t0, 1), "head_refit": refit,
               "decision_head": {k: v for k, v in read_meta(dst).decision_head.items() if k != "tried"},
               "metrics": row_metrics(eval_set, preds, sim_fn, result["plan"]["grounding_source"]),
               "scores": [round(float(p.confidence), 6) for p in preds],
               "decisions": [bool(p.needs_clarification) for p in preds]}
        derived = {**{k: v for k, v in result.items()
                      if k not in ("machine", "command", "rows", "uncertainty", "error_analysis")},
                   "benchmark": result["benchmark"] + "-head-refit", "derived_from": args.recipe_result,
                   "rows": {"joint": row}}
        path = write_result(derived["benchmark"], derived, args.recipe_result_out, option="--recipe-result-out")
        out["recipe_result"] = str(path)
        print(f"[refit] wrote {path} (row joint: the saved model on the recipe's evaluation set)", flush=True)
    return out


if __name__ == "__main__":
    main()
