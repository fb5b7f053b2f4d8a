"""Batching turns by length against batching them as they come: what scoring and evaluation cost, in one run.

    .venv/bin/python benchmarks/engine/bench_batch_order.py      # builtin:clarifier-smollm2-135m, the recipe's dev turns

On a CPU a batch of prompts costs about its longest prompt times its rows: a short turn batched with a long one is
padded to the long one's length. ``ClarifierEngine.score_examples`` and ``predict`` (what ``clarifier eval``, the
calibration, the audit's and ``label select``'s scorer actors and the Ray scorer pools run) batch neighbours by
rendered length (``clarifier.core.prompt.length_order``) and put every result back in place; ``order="given"`` is the
way they batched before. Both are timed here on the same turns, engine and threads, alternating, ``--repeats``
times each:

* **scoring** (decision only, ``score_examples``): ``--turns`` turns of the data-job output's ``--split`` (default
  dev: no test turn is used), a seeded sample over every source, ``--batch-size`` per pass; and batches of one
  turn as the reference with no padding at all;
* **evaluation** (``predict``: the decision, then a question for the turns at or above the threshold): the first
  ``--predict-turns`` of the same sample.

Per order: turns/s (the best repeat), the padded prompt tokens per real token, and the results' agreement (largest
score difference, decisions and questions identical). Results: ``benchmarks/results/engine-batch-order-<date>.json``
(never overwritten; ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import cpu_info, engine_and_turns, engine_turn_options, result_file, timed, write_result  # noqa: E402

ORDERS = ("given", "length")


def padded_per_real(engine, examples, batches) -> float:
    """Prompt tokens a pass computes (each batch padded to its longest) per real prompt token."""
    lengths = [len(ids) for ids in engine.tok([engine._prompt(e.history, e.query, e.passages) + "decision:"
                                              for e in examples], add_special_tokens=False)["input_ids"]]
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return round(padded / sum(lengths), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_turn_options(ap, turns=192)
    ap.add_argument("--predict-turns", type=int, default=64)
    args = ap.parse_args()
    out = result_file(f"engine-batch-order-{dt.date.today().isoformat()}", args.out)

    import numpy as np

    from clarifier.core.schema import source_of

    engine, examples = engine_and_turns(args)
    print(f"[bench] {len(examples)} {args.split} turns of {sorted({source_of(e) for e in examples})}; "
          f"{engine.precision}, {args.threads} threads, batch {args.batch_size}", flush=True)
    engine.score_examples(examples[: args.batch_size], args.batch_size)  # warm-up

    score = {o: {"seconds": [], "padded_per_real": padded_per_real(engine, examples, engine.batches(
        examples, args.batch_size, o))} for o in ORDERS}
    scores: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for o in ORDERS:
            s, scores[o] = timed(lambda: engine.score_examples(examples, args.batch_size, order=o))
            score[o]["seconds"].append(round(s, 2))
            print(f"[bench] score, {o} order, repeat {r + 1}: {s:.1f} s", flush=True)
    s1, one = timed(lambda: engine.score_examples(examples, 1))
    print(f"[bench] score, batches of one: {s1:.1f} s", flush=True)
    for o in ORDERS:
        score[o]["turns_per_s"] = round(len(examples) / min(score[o]["seconds"]), 2)
    thr = engine.threshold
    scoring = {
        **score, "batches_of_one": {"seconds": round(s1, 2), "turns_per_s": round(len(examples) / s1, 2),
                                    "padded_per_real": 1.0},
        "length_over_given": round(score["length"]["turns_per_s"] / score["given"]["turns_per_s"], 2),
        "length_over_batches_of_one": round(score["length"]["turns_per_s"] * s1 / len(examples), 2),
        "agreement": {"max_abs_score_diff": float(np.max(np.abs(np.array(scores["length"]) - np.array(scores["given"])))),
                      "max_abs_score_diff_vs_one": float(np.max(np.abs(np.array(scores["length"]) - np.array(one)))),
                      "decisions_identical": sum((a >= thr) == (b >= thr) for a, b in zip(scores["length"],
                                                                                            scores["given"])),
                      "of": len(examples)}}
    print(f"[bench] scoring: {scoring['length_over_given']}x", flush=True)

    few = examples[: args.predict_turns]
    predict = {o: {"seconds": []} for o in ORDERS}
    preds: dict[str, list] = {}
    for r in range(args.repeats):
        for o in ORDERS:
            s, preds[o] = timed(lambda: engine.predict(few, args.batch_size, order=o))
            predict[o]["seconds"].append(round(s, 2))
            print(f"[bench] predict, {o} order, repeat {r + 1}: {s:.1f} s", flush=True)
    for o in ORDERS:
        predict[o]["turns_per_s"] = round(len(few) / min(predict[o]["seconds"]), 2)
    asked = [i for i, p in enumerate(preds["given"]) if p.needs_clarification]
    evaluation = {
        **predict, "asked": len(asked),
        "length_over_given": round(predict["length"]["turns_per_s"] / predict["given"]["turns_per_s"], 2),
        "agreement": {"decisions_identical": sum(a.needs_clarification == b.needs_clarification
                                                 for a, b in zip(preds["length"], preds["given"])),
                      "questions_identical": sum(preds["length"][i].question == preds["given"][i].question
                                                 for i in asked),
                      "of": len(few)}}
    print(f"[bench] evaluation: {evaluation['length_over_given']}x", flush=True)
    result = {"model": args.model, "precision": engine.precision, "cpu": cpu_info(), "threads": args.threads,
              "batch_size": args.batch_size, "split": args.split, "turns": len(examples), "seed": args.seed,
              "repeats": args.repeats, "scoring": scoring, "evaluation": evaluation}
    print(f"[bench] wrote {write_result(out.stem, result, out)}", flush=True)


if __name__ == "__main__":
    main()
