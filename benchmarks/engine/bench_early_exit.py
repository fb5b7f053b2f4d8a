"""A decision head on the first layers only: what ending the decision pass after them buys, in one run.

    .venv/bin/python benchmarks/engine/bench_early_exit.py      # builtin:clarifier-smollm2-135m, the recipe's dev turns

When every turn of a batch is decided by a head whose deepest layer is not the last, ``ClarifierEngine`` ends the
decision pass after that layer, and the turns that ask go on through the remaining layers before their question is
decoded (``_decision_pass(stop=True)``, ``_finish_cache``). This script times that against the same engine running
every layer, on the same turns, engine and threads, alternating, ``--repeats`` times each:

* heads: ``shipped`` (the model's own head; it reads the last layer, so its passes run every layer) and ``early``
  (the shipped head's weights on its layers up to ``--stop-layer`` only: the speed of such a head, not its quality,
  which ``benchmarks/recipe/head_refit.py --layers`` measures), the latter with the stop (``early``) and without
  (``early-whole``: ``engine.early_stop = False``);
* every head's threshold is set on these turns so that ``--ask-share`` of them ask (the serving mix's share), so the
  heads decode as many questions;
* **scoring** (``score_examples``, batches of ``--batch-size``, length order): turns/s;
* **one request at a time** (``clarify`` of one request: the serving path at concurrency 1): ms per request over
  the mix, p50 of the clear and of the asking turns;
* **agreement** of ``early`` with ``early-whole``: scores, decisions, and the questions token for token.

Results: ``benchmarks/results/engine-early-exit-<date>.json`` (never overwritten; ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import cpu_info, engine_and_turns, engine_turn_options, result_file, timed, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_turn_options(ap, turns=96)
    ap.add_argument("--one-at-a-time", type=int, default=40, help="how many of the turns are also sent one by one")
    ap.add_argument("--stop-layer", type=int, default=15, help="the early head's deepest layer (of 30 in SmolLM2-135M)")
    ap.add_argument("--ask-share", type=float, default=0.2)
    args = ap.parse_args()
    out = result_file(f"engine-early-exit-{dt.date.today().isoformat()}", args.out)

    import numpy as np
    import torch

    from clarifier.core.schema import ClarifyRequest, source_of
    from clarifier.engine.decision_head import DecisionHead
    from clarifier.engine.inference import head_columns

    engine, examples = engine_and_turns(args)
    shipped = engine.decision_head
    n_layers = engine.model.config.num_hidden_layers
    if shipped is None or shipped.clip is not None:
        raise SystemExit(f"{args.model}: needs an unclipped decision head to restrict")
    keep = [i for i in shipped.layers if i <= args.stop_layer]
    if not keep or max(keep) >= n_layers:
        raise SystemExit(f"--stop-layer {args.stop_layer}: the head reads {shipped.layers}; keep some, not the last")
    sub = DecisionHead(keep, None, 0.0, list(shipped.pooling))
    cols = torch.tensor(head_columns(sub, shipped.layers, shipped.pooling, engine.model.config.hidden_size))
    # the shipped weights on the kept layers, rescaled so that its logits on these turns have mean 0 and sd 1 (a sum
    # over fewer layers is not calibrated; for speed only the share asking matters, set by the threshold below)
    _, x = engine.decision_features([(e.history, e.query, e.passages) for e in examples[: 4 * args.batch_size]], keep,
                                    shipped.pooling, token=False)
    z = x @ shipped.weight[cols]
    early = DecisionHead(keep, shipped.weight[cols] / z.std(), -float(z.mean() / z.std()), list(shipped.pooling))
    print(f"[bench] {len(examples)} {args.split} turns of {sorted({source_of(e) for e in examples})}; {engine.precision}, "
          f"{args.threads} threads; shipped head on layers {shipped.layers}, early head on {keep} (pass stops after "
          f"{max(keep)} of {n_layers})", flush=True)
    variants = {"shipped": (shipped, True), "early": (early, True), "early-whole": (early, False)}

    def use(name):
        engine.decision_head, engine.early_stop = variants[name]

    use("shipped")
    engine.score_examples(examples[: args.batch_size], args.batch_size)  # warm-up

    seconds = {n: [] for n in variants}
    scores: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for name in variants:
            use(name)
            s, scores[name] = timed(lambda: engine.score_examples(examples, args.batch_size))
            seconds[name].append(round(s, 2))
            print(f"[bench] score, {name}, repeat {r + 1}: {s:.1f} s", flush=True)
    thresholds = {n: float(np.quantile(scores[n], 1 - args.ask_share)) for n in variants}
    scoring = {n: {"seconds": seconds[n], "turns_per_s": round(len(examples) / min(seconds[n]), 2)} for n in variants}
    scoring["early_over_shipped"] = round(scoring["early"]["turns_per_s"] / scoring["shipped"]["turns_per_s"], 2)
    scoring["early_over_early_whole"] = round(scoring["early"]["turns_per_s"] / scoring["early-whole"]["turns_per_s"], 2)
    print(f"[bench] scoring: early {scoring['early_over_shipped']}x the shipped head", flush=True)

    few = examples[: args.one_at_a_time]
    reqs = [ClarifyRequest(history=e.history, query=e.query, passages=e.passages) for e in few]
    ms = {n: [[] for _ in reqs] for n in variants}
    answers: dict[str, list] = {}
    for r in range(args.repeats):
        for name in variants:
            use(name)
            got = []
            for k, req in enumerate(reqs):
                s, a = timed(lambda: engine.clarify([req], threshold=thresholds[name])[0])
                ms[name][k].append(s * 1000)
                got.append(a)
            answers[name] = got
            print(f"[bench] one at a time, {name}, repeat {r + 1}: {sum(m[-1] for m in ms[name]) / 1000:.1f} s",
                  flush=True)
    one = {}
    for name in variants:
        best = [min(m) for m in ms[name]]  # each request's best repeat
        asked = [b for b, a in zip(best, answers[name]) if a.needs_clarification]
        clear = [b for b, a in zip(best, answers[name]) if not a.needs_clarification]
        one[name] = {"mean_ms": round(statistics.mean(best), 1), "answers_per_s": round(1000 / statistics.mean(best), 2),
                     "clear_p50_ms": round(statistics.median(clear), 1) if clear else None,
                     "ask_p50_ms": round(statistics.median(asked), 1) if asked else None,
                     "asked": len(asked), "of": len(best)}
    one["early_over_shipped"] = round(one["shipped"]["mean_ms"] / one["early"]["mean_ms"], 2)
    if one["shipped"]["clear_p50_ms"] and one["early"]["clear_p50_ms"]:
        one["clear_p50_early_over_shipped"] = round(one["shipped"]["clear_p50_ms"] / one["early"]["clear_p50_ms"], 2)
    print(f"[bench] one at a time: early {one['early_over_shipped']}x the shipped head's answers/s", flush=True)

    a, b = answers["early"], answers["early-whole"]
    asked = [i for i in range(len(a)) if a[i].needs_clarification and b[i].needs_clarification]
    agreement = {
        "max_abs_score_diff": float(np.max(np.abs(np.array(scores["early"]) - np.array(scores["early-whole"])))),
        "decisions_identical": sum(x.needs_clarification == y.needs_clarification for x, y in zip(a, b)),
        "questions_compared": len(asked),
        "questions_identical": sum(a[i].question == b[i].question and a[i].grounding == b[i].grounding for i in asked),
        "of": len(a)}
    print(f"[bench] early vs early-whole: {agreement}", flush=True)
    result = {"model": args.model, "precision": engine.precision, "cpu": cpu_info(), "threads": args.threads,
              "batch_size": args.batch_size, "split": args.split, "turns": len(examples), "seed": args.seed,
              "repeats": args.repeats, "ask_share": args.ask_share, "layers": {"model": n_layers, "shipped": shipped.layers,
                                                                               "early": keep},
              "thresholds": thresholds, "scoring": scoring, "one_at_a_time": one, "agreement": agreement}
    print(f"[bench] wrote {write_result(out.stem, result, out)}", flush=True)


if __name__ == "__main__":
    main()
