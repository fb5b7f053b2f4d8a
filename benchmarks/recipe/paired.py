"""Two or more trained models on the same split, paired: within-source AUROC and its bootstrap interval. JSON out.

    .venv/bin/python benchmarks/recipe/paired.py --data .clarifier/recipes/joint-public/data \
        --model shipped=builtin:clarifier-smollm2-135m --model retrained=/path/to/model_dir

Answers "is this model the same as that one, or better?" the way the recipe counts a change: each model's
P(clarify) on every turn of the split (decision only: the engine's ``score``, with the model's own decision
head), the headline figures inside each source (AUROC, recall and F1 at 10% over-asking, and their means), and
the paired bootstrap of the difference of mean within-source AUROC against the first model (1,000 resamples
of the split's turns; a difference counts when its interval leaves out 0), and of each source's AUROC difference
(resampling that source's turns). Every model's scores are kept in the result, in the split's order (``ids``),
so a model whose folder is gone can still be compared: ``--scores NAME=earlier-result.json[:MODEL]`` reads its
scores from that result (refused unless it was on the same split with the same examples).
Used to check that ``clarifier train --recipe joint-public`` reproduces the shipped model
(``results/recipe-retrain.json``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import result_file, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-job output folder")
    ap.add_argument("--split", default="test")
    ap.add_argument("--model", action="append", default=[],
                    help="NAME=URI (repeatable; the first, else the first --scores, is the reference)")
    ap.add_argument("--scores", action="append", default=[], metavar="NAME=RESULT.json[:MODEL]",
                    help="a model's scores kept in an earlier result of this script on the same split (its ids and "
                         "fingerprint must match), for a model whose folder is gone; MODEL defaults to NAME")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="result JSON (default results/recipe-paired.json)")
    args = ap.parse_args()
    result_file("recipe-paired", args.out)  # refused now, not after the run, when that file is already there
    models = {}
    for item in args.model:
        name, sep, uri = item.partition("=")
        if not sep or not name or not uri:
            raise SystemExit(f"--model {item!r}: expected NAME=URI")
        models[name] = uri
    stored = {}
    for item in args.scores:
        name, sep, ref = item.partition("=")
        path, _, key = ref.partition(":")
        if not sep or not name or not path:
            raise SystemExit(f"--scores {item!r}: expected NAME=RESULT.json[:MODEL]")
        stored[name] = (path, key or name)
    if set(models) & set(stored):
        raise SystemExit(f"--model and --scores both name {sorted(set(models) & set(stored))}")
    if len(models) + len(stored) < 2:
        raise SystemExit("--model/--scores: name at least two models to compare")

    from clarifier.core.metrics import paired_bootstrap, within_source_summary
    from clarifier.core.schema import source_of
    from clarifier.data.outputs import load_split
    from clarifier.engine.loading import load_engine
    from clarifier.evaluation.evaluate import fingerprint_examples

    t0 = time.time()
    examples = load_split(args.data, args.split)
    gold, sources = [e.needs_clarification for e in examples], [source_of(e) for e in examples]
    print(f"[paired] {len(examples)} {args.split} turns of {args.data} ({sum(gold)} need a question)", flush=True)
    fingerprint, ids = fingerprint_examples(examples), [e.id for e in examples]
    systems, rows = {}, {}
    for name in [*models, *stored]:
        if name in models:
            uri = models[name]
            engine = load_engine(uri)
            scores = engine.score_examples(examples, batch_size=8, progress=lambda d, n: print(
                f"[paired] {name}: {d}/{n}", flush=True) if d == n or d % 256 == 0 else None)
            row = {"model_uri": uri, "threshold": engine.threshold, "decision_head": engine.decision_head is not None}
        else:
            scores, row = stored_scores(*stored[name], split=args.split, fingerprint=fingerprint, ids=ids)
        thr = row["threshold"]
        systems[name] = ([s >= thr for s in scores], scores)
        summary = within_source_summary(gold, scores, sources)
        # unrounded: rounded scores tie where a model saturates (results written before keep 6 digits)
        rows[name] = {**row, "within_source": summary, "scores": [float(s) for s in scores]}
        print(f"[paired] {name}: mean within-source AUROC {summary['macro_auroc']:.3f}, min {summary['min_auroc']:.3f}, "
              f"R@10%OA {summary['macro_recall_at_budget']:.3f}", flush=True)
    reference = next(iter(rows))
    boot = paired_bootstrap(gold, systems, reference=reference, sources=sources, seed=args.seed)
    by_source = {}  # each source's AUROC difference against the reference, its own turns resampled
    for src in sorted(set(sources)):
        idx = [i for i, s in enumerate(sources) if s == src]
        sub = {name: ([dec[i] for i in idx], [sc[i] for i in idx]) for name, (dec, sc) in systems.items()}
        b = paired_bootstrap([gold[i] for i in idx], sub, reference=reference, seed=args.seed)
        by_source[src] = {name: b["systems"][name]["auroc_diff"] for name in rows if name != reference}
    for name in rows:
        if name != reference:
            print(f"[paired] {name} minus {reference}: mean within-source AUROC "
                  f"{boot['systems'][name]['macro_auroc_diff']}; by source: "
                  + ", ".join(f"{src} {by_source[src][name]}" for src in by_source), flush=True)
    path = write_result("recipe-paired", {
        "data": args.data, "split": args.split, "n": len(examples), "fingerprint": fingerprint,
        "ids": ids, "reference": reference, "models": rows, "bootstrap": boot,
        "auroc_diff_by_source": by_source, "seconds": round(time.time() - t0, 1)}, args.out)
    print(f"[paired] wrote {path}")


def stored_scores(path: str, key: str, *, split: str, fingerprint: str, ids: list) -> tuple[list, dict]:
    """A model's scores from an earlier result of this script, in this split's order: refused unless that result was
    on the same split, with the same examples (fingerprint), and holds that model's scores."""
    import json

    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--scores {path}: cannot read it as JSON ({e})")
    if old.get("split") != split or old.get("fingerprint") != fingerprint:
        raise SystemExit(f"--scores {path}: it scored split {old.get('split')!r} with fingerprint "
                         f"{str(old.get('fingerprint'))[:12]}, this run's {split!r} split has {fingerprint[:12]}")
    row = old.get("models", {}).get(key)
    if row is None or "scores" not in row or sorted(old.get("ids", [])) != sorted(ids):
        raise SystemExit(f"--scores {path}: no scores for model {key!r} with this split's ids "
                         f"(it has {sorted(old.get('models', {}))})")
    by_id = dict(zip(old["ids"], row["scores"]))
    kept = {k: row[k] for k in ("model_uri", "threshold", "decision_head") if k in row}
    return [by_id[i] for i in ids], {**kept, "scores_from": f"{path}:{key}"}


if __name__ == "__main__":
    main()
