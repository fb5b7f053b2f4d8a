"""Does the decision head gain from the prompt's mean-pooled states? A paired comparison. JSON out.

    .venv/bin/python benchmarks/recipe/head_pooling.py --data .clarifier/recipe-benchmark/joint-public/recipe/data

The shipped decision head (:mod:`clarifier.engine.decision_head`) reads the hidden states of four layers
at the last prompt position. This refits it on the same model (default ``builtin:clarifier-smollm2-135m``)
twice with the recipe's own procedure (`train.decision_head`: up to 600 train turns per source, half
needing a question, source- and class-balanced weights, strength chosen on the dev split by the mean
within-source AUROC): once on those states (``last``: the shipped head, refitted) and once on them plus
the same layers' states averaged over every prompt token (``last+mean``). Both are scored on the
recipe benchmark's evaluation set (the seeded test sample of `joint-public`: 100 turns per source, 30%
needing a question; its fingerprint is recorded so it can be matched to that report) with the paired
bootstrap of the mean within-source AUROC. The test turns are scored once, after both heads are fixed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the recipe benchmark's data-job output (train, dev and test splits)")
    ap.add_argument("--model", default="builtin:clarifier-smollm2-135m")
    ap.add_argument("--eval-per-source", type=int, default=100)
    ap.add_argument("--eval-clarify-share", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--features", default=None, help="an .npz to keep the features in and reuse on a rerun")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import numpy as np

    from clarifier.core.config import DecisionHeadConfig
    from clarifier.core.metrics import paired_bootstrap, within_source_summary
    from clarifier.core.schema import sample_by_source, source_of
    from clarifier.data.outputs import load_split
    from clarifier.engine.decision_head import resolve_layers
    from clarifier.engine.loading import load_engine
    from clarifier.evaluation.evaluate import fingerprint_examples
    from clarifier.train.decision_head import fit_on_features, hidden_features

    t0 = time.time()
    cfg = DecisionHeadConfig()
    train = sample_by_source(load_split(args.data, "train"), cfg.max_per_source, args.seed, clarify_share=0.5)
    dev = load_split(args.data, "dev")
    test = sample_by_source(load_split(args.data, "test"), args.eval_per_source, args.seed, args.eval_clarify_share)
    engine = load_engine(args.model, decision_head=False)
    layers = resolve_layers(cfg.layers, engine.model.config.num_hidden_layers)
    print(f"[pooling] {args.model} ({engine.precision}), layers {layers}: {len(train)} train, {len(dev)} dev, "
          f"{len(test)} test turns (fingerprint {fingerprint_examples(test)[:12]})", flush=True)
    cache = Path(args.features) if args.features else None
    if cache and cache.is_file():  # the same data, model and seed: the forward passes are the cost
        with np.load(cache) as f:
            feats = {name: (f[f"{name}_last"], f[f"{name}_mean"]) for name in ("train", "dev", "test")}
    else:
        dim = len(layers) * engine.model.config.hidden_size  # the engine's features: every layer's last, then mean
        feats = {}
        for name, rows in (("train", train), ("dev", dev), ("test", test)):
            _, x = hidden_features(engine, rows, layers, cfg.batch_size, name, lambda m: print(m, flush=True),
                                   ("last", "mean"))
            feats[name] = (x[:, :dim], x[:, dim:])
        if cache:
            np.savez(cache, **{f"{n}_{k}": v for n, (last, mean) in feats.items() for k, v in (("last", last), ("mean", mean))})

    def split(name, kind):
        last, mean = feats[name]
        return last if kind == "last" else np.hstack([last, mean])

    gold, src = [e.needs_clarification for e in test], [source_of(e) for e in test]
    heads, systems = {}, {}
    for kind in ("last", "last+mean"):
        fit = fit_on_features(split("train", kind), train, split("dev", kind), dev, cfg.c_grid)
        macro, c = fit["dev_macro_auroc"], fit["c"]
        scores = [float(v) for v in fit["model"].predict_proba(fit["scaler"].transform(split("test", kind)))[:, 1]]
        summary = within_source_summary(gold, scores, src)
        heads[kind] = {"c": c, "dev_macro_auroc": round(macro, 4), "test_within_source": summary}
        systems[kind] = ([s >= 0.5 for s in scores], scores)
        print(f"[pooling] {kind}: C={c:g}, dev within-source AUROC {macro:.3f}, test {summary['macro_auroc']:.3f}",
              flush=True)
    boot = paired_bootstrap(gold, systems, reference="last", sources=src)
    diff = boot["systems"]["last+mean"]["macro_auroc_diff"]
    print(f"[pooling] last+mean minus last, mean within-source AUROC: {diff}", flush=True)
    path = write_result("recipe-head-pooling", {
        "data": args.data, "model": args.model, "precision": engine.precision, "layers": layers,
        "n_train": len(train), "n_dev": len(dev), "n_test": len(test), "eval_fingerprint": fingerprint_examples(test),
        "heads": heads, "bootstrap": boot, "seconds": round(time.time() - t0, 1)}, args.out)
    print(f"[pooling] wrote {path}")


if __name__ == "__main__":
    main()
