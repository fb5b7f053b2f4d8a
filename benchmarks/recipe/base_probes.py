"""Which base model's states say more about "needs a question"? Untrained bases, the recipe's decision head. JSON out.

    .venv/bin/python benchmarks/recipe/base_probes.py --data .clarifier/recipes/joint-public/data \
        --base smollm2-135m-instruct --base gemma3-270m

Before spending a retrain (or a GPU) on a larger base model: each ``--base`` is loaded untrained, prompted with
the recipe's prompt (``model.max_prompt_tokens``, ``model.max_history_turns``), and the recipe's decision head
(:func:`clarifier.train.decision_head.fit_on_features`: the layers at 1/4, 1/2, 3/4 and the top, at the decision
position and averaged over the prompt, source- and class-balanced, strength chosen on dev) is fitted on the same
seeded train sample (``--per-source`` turns per source, half needing a question where a source has them) and scored
on the whole dev split: mean within-source AUROC per base, and the paired bootstrap of each base minus the first.
The test split is not read. States are kept in ``--features-dir`` (one .npz per base) and reused on a rerun of
the same turns.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import KeptStates, result_file, write_result  # noqa: E402

C_GRID = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the recipe's data-job output (train and dev splits)")
    ap.add_argument("--base", action="append", required=True,
                    help="a base model (built-in name, folder or hub id); repeatable, the first is the reference")
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "platform/clarifier/recipes/configs/joint-public.yaml"),
                    help="the recipe whose prompt and head layers are used")
    ap.add_argument("--per-source", type=int, default=300, help="train turns per source (half need a question)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--features-dir", default=None, help="keep each base's states here and reuse them")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result_file("recipe-base-probes", args.out)  # refused now, not after the run, when that file is already there

    from clarifier.core.config import load_config
    from clarifier.core.metrics import paired_bootstrap, within_source_summary
    from clarifier.core.schema import sample_by_source, source_of
    from clarifier.data.outputs import load_split
    from clarifier.engine.decision_head import resolve_layers
    from clarifier.engine.inference import ClarifierEngine
    from clarifier.evaluation.evaluate import fingerprint_examples
    from clarifier.train.decision_head import fit_on_features, hidden_features

    t_all = time.time()
    cfg = load_config(args.config)
    train = sample_by_source(load_split(args.data, "train"), args.per_source, args.seed, clarify_share=0.5)
    dev = load_split(args.data, "dev")
    gold, src = [e.needs_clarification for e in dev], [source_of(e) for e in dev]
    print(f"[probes] {len(train)} train turns ({args.per_source} per source at most), {len(dev)} dev turns; "
          f"the test split is not read", flush=True)
    rows, scores = {}, {}
    for base in args.base:
        t0 = time.time()
        engine = ClarifierEngine.from_base(base, cache_dir=cfg.model.cache_dir, prompt_opts=cfg.model.prompt_options(),
                                           precision=cfg.model.precision)
        layers = resolve_layers(cfg.train.decision_head.layers, engine.model.config.num_hidden_layers)
        kept = KeptStates(Path(args.features_dir) / f"{base.replace('/', '_')}.npz" if args.features_dir else None,
                          "--features-dir")

        def states(rows, name):
            return hidden_features(engine, rows, layers, cfg.eval.batch_size, f"{base} {name}",
                                   lambda m: print(m, flush=True), ("last", "mean"))[1]

        x_train = kept.get("train", train, lambda rows: states(rows, "train"), f"{args.data}'s train sample")
        x_dev = kept.get("dev", dev, lambda rows: states(rows, "dev"), f"{args.data}'s dev split")
        fit = fit_on_features(x_train, train, x_dev, dev, C_GRID)
        scores[base] = [float(x) for x in fit["dev_scores"]]
        summary = within_source_summary(gold, scores[base], src)
        rows[base] = {"layers": layers, "hidden_size": engine.model.config.hidden_size,
                      "parameters": sum(p.numel() for p in engine.model.parameters()), "precision": engine.precision,
                      "c": fit["c"], "tried": fit["tried"], "dev_split": summary, "seconds": round(time.time() - t0, 1)}
        print(f"[probes] {base}: layers {layers}, C={fit['c']:g}, dev within-source AUROC {summary['macro_auroc']:.3f} "
              f"(min {summary['min_auroc']:.3f}), " + ", ".join(f"{k} {v['auroc']:.3f}" for k, v in summary["by_source"].items()),
              flush=True)
        del engine
    reference = args.base[0]
    boot = paired_bootstrap(gold, {n: ([x >= 0.5 for x in s], s) for n, s in scores.items()}, reference=reference,
                            sources=src, seed=args.seed)
    for base in args.base[1:]:
        print(f"[probes] {base} minus {reference} on dev: {boot['systems'][base]['macro_auroc_diff']}", flush=True)
    path = write_result("recipe-base-probes", {
        "data": args.data, "config": args.config, "per_source": args.per_source, "seed": args.seed,
        "n": {"train": len(train), "dev": len(dev)}, "dev_fingerprint": fingerprint_examples(dev),
        "reference": reference, "bases": rows, "bootstrap": {"dev_split": boot}, "dev_scores": scores,
        "seconds": round(time.time() - t_all, 1)}, args.out)
    print(f"[probes] wrote {path}")


if __name__ == "__main__":
    main()
