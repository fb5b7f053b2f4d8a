"""Audit benchmark: does the corrected estimate find a planted rate, how fast, how much memory. JSON out.

    .venv/bin/python benchmarks/audit/bench_audit.py --model .clarifier/recipe-benchmark/joint-public/models/joint

1. **Planted rates** (the proof): synthetic RAG chat logs in the OpenAI format
   (:mod:`clarifier.data.synthetic_chatlogs`) with a planted share of failed turns that needed
   clarification (5%, 15%, 30% by default) and noisy feedback signals. ``--labelled`` of the user
   turns carry a gold label (the hand-labelled sample a team would make), so the audit corrects with
   in-domain error rates. For each rate: the raw flagged share among failed turns, the corrected
   estimate and its interval, whether the interval contains the realised planted share, and the
   verdict against the 15% rule. The same runs without the labels (``audit.error_rates=calibration``:
   the model's own dev-split counts) show what an out-of-domain correction does; they re-estimate
   from the first run's scores (``audit.reuse_scores``) instead of scoring the turns again.
2. **Throughput** (turns/s, read + score + write) with 1 and 2 scorer actors on this machine, the
   same input, in one run; the ratio.
3. **Peak memory** of the driver and the Ray workers for the input and for 10x the input
   (streaming: both should stay roughly flat).
4. **Public sets as logs** (``--public-data``: a data-job output, e.g. the recipe benchmark's, whose
   test split the model never trained on): each source's test turns rewritten as OpenAI transcripts
   (history + the turn, its passages as ``documents``), a seeded ``--labelled`` share keeping its gold
   label; no failure signals exist there, so this measures the corrected share of turns needing
   clarification against the labelled truth, with the in-domain labels and with the calibration counts.
   The transcripts' earlier user turns are audited too but have no truth: the comparison is on the
   examples' own turns (the ``example_turn=query`` segment, with its own corrected interval).

Everything runs on one local Ray (``--cpus``, default all); the model is any Clarifier model URI.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import PeakMemory, result_file, write_result  # noqa: E402


OVERRIDES: list[str] = []  # from the command line, applied to every audit run


def _audit(logs: Path, out: Path, model: str, *extra: str) -> dict:
    from clarifier.core.config import load_config
    from clarifier.evaluation.audit import run_audit

    cfg = load_config(None, [f"audit.logs={logs}", f"audit.output={out}", f"audit.model_uri={model}", *OVERRIDES, *extra])
    return run_audit(cfg, progress=lambda m: print(m, flush=True) if m.startswith("[audit] scor") else None)


def _row(summary: dict, planted: dict) -> dict:
    f = summary["failed_needing_clarification"]
    share = planted["share"]
    ci = f.get("corrected_ci")
    return {
        "planted_share": share, "failed_turns": f["n"], "turns": summary["counts"]["turns"],
        "raw": f["raw"], "raw_ci": f["raw_ci"], "corrected": f.get("corrected"), "corrected_ci": ci,
        "covered": bool(ci and ci[0] <= share <= ci[1]),
        "raw_covered": bool(f["raw_ci"] and f["raw_ci"][0] <= share <= f["raw_ci"][1]),
        "verdict": summary["verdict"]["decision"], "error_rates": summary["error_rates"],
        "seconds": summary["seconds"],
    }


MODES = {"with_labels": "audit.error_rates=auto", "without_labels": "audit.error_rates=calibration"}


def planted_rates(model: str, tmp: Path, n: int, rates: list[float], labelled: float, seed: int, say,
                  modes: list[str] = list(MODES)) -> dict:
    from clarifier.data.synthetic_chatlogs import generate_chatlogs, planted_summary, write_chatlogs

    out: dict = {"conversations": n, "labelled_share": labelled, **{m: [] for m in modes}}
    for rate in rates:
        logs = tmp / f"logs-{rate}"
        write_chatlogs(str(logs), n, seed=seed, planted_share=rate, labelled_share=labelled)
        planted = planted_summary(generate_chatlogs(n, seed=seed, planted_share=rate, labelled_share=labelled))
        for i, key in enumerate(modes):  # scored once; the other mode re-estimates from the same scores
            s = _audit(logs, tmp / f"audit-{rate}", model, "audit.sample_questions=0", MODES[key],
                       f"audit.reuse_scores={str(i > 0).lower()}")
            row = _row(s, planted)
            out[key].append(row)
            say(f"planted {row['planted_share']:.3f} ({key}): raw {row['raw']:.3f}, corrected {row['corrected']} "
                f"{row['corrected_ci']}, covered {row['covered']}, verdict {row['verdict']}")
    return out


def throughput(model: str, tmp: Path, n: int, seed: int, say) -> dict:
    from clarifier.data.synthetic_chatlogs import write_chatlogs

    logs = tmp / "logs-throughput"
    write_chatlogs(str(logs), n, seed=seed, shards=1)  # one file: the scorers must still share its turns
    out: dict = {"conversations": n, "files": 1}
    for actors in (1, 2):
        s = _audit(logs, tmp / f"audit-tp-{actors}", model, f"audit.actors={actors}", "audit.cpus_per_actor=1",
                   "audit.sample_questions=0")
        secs = s["seconds_read_and_score"]
        out[f"actors_{actors}"] = {"turns": s["counts"]["turns"], "seconds": secs,
                                   "turns_per_s": round(s["counts"]["turns"] / secs, 2)}
        say(f"{actors} actor(s): {out[f'actors_{actors}']}")
    out["ratio_2_vs_1"] = round(out["actors_2"]["turns_per_s"] / out["actors_1"]["turns_per_s"], 2)
    return out


def memory(model: str, tmp: Path, n: int, seed: int, say) -> dict:
    from clarifier.data.synthetic_chatlogs import write_chatlogs

    out: dict = {}
    for scale in (1, 10):
        logs = tmp / f"logs-mem-{scale}"
        write_chatlogs(str(logs), n * scale, seed=seed, shards=4 * scale)
        with PeakMemory() as mem:
            s = _audit(logs, tmp / f"audit-mem-{scale}", model, "audit.sample_questions=0")
        out[f"x{scale}"] = {"conversations": n * scale, "turns": s["counts"]["turns"], **mem.result()}
        say(f"x{scale}: {out[f'x{scale}']}")
    out["driver_ratio_10x"] = round(out["x10"]["driver_peak_mib"] / out["x1"]["driver_peak_mib"], 2)
    out["workers_ratio_10x"] = round(out["x10"]["workers_peak_mib"] / out["x1"]["workers_peak_mib"], 2)
    return out


SEGMENT = "example_turn"  # "query": the example's own turn (its label is the truth); "history": an earlier user turn


def _as_transcript(ex, labelled: bool) -> dict:
    msgs = [{"role": t.role, "content": t.text, **({"metadata": {SEGMENT: "history"}} if t.role == "user" else {})}
            for t in ex.history if t.role in ("user", "assistant")]
    last = {"role": "user", "content": ex.query, "documents": [{"doc_id": p.id, "text": p.text} for p in ex.passages],
            "metadata": {SEGMENT: "query"}}
    if labelled:
        last["needs_clarification"] = ex.needs_clarification
    return {"id": ex.id.replace(":", "_"), "messages": [*msgs, last], "metadata": {"source": ex.meta.get("source") or
                                                                                   ex.meta.get("dataset")}}


def public_sets(model: str, tmp: Path, data: str, labelled: float, seed: int, say) -> dict:
    import json
    import random

    from clarifier.core.schema import source_of
    from clarifier.data.outputs import load_split

    by: dict[str, list] = {}
    for ex in load_split(data, "test"):
        by.setdefault(source_of(ex), []).append(ex)
    out: dict = {"data": data, "labelled_share": labelled, "sources": {}}
    for src, exs in sorted(by.items()):
        rng = random.Random(f"{seed}:{src}")
        logs = tmp / f"public-{src}"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "part-0.jsonl").write_text("".join(json.dumps(_as_transcript(e, rng.random() < labelled)) + "\n" for e in exs))
        truth = sum(e.needs_clarification for e in exs) / len(exs)
        row: dict = {"turns": len(exs), "true_share": truth}
        for i, (key, extra) in enumerate((("with_labels", "audit.error_rates=auto"),
                                          ("calibration", "audit.error_rates=calibration"))):
            s = _audit(logs, tmp / f"audit-public-{src}", model, "audit.sample_questions=0",
                       "audit.signals.reformulation.enabled=false", "audit.min_labelled=10", extra,
                       f"audit.segments=[{SEGMENT}]", f"audit.reuse_scores={str(i > 0).lower()}")
            # The transcripts' earlier user turns are audited too (as in real logs) but have no truth:
            # compare the truth with the share among the examples' own turns (the segment).
            t = next(r["turns"] for r in s["breakdowns"][f"segment:{SEGMENT}"] if r["value"] == "query")
            ci = t.get("corrected_ci")
            rates = s["error_rates"] or {}
            row[key] = {"raw": t["raw"], "corrected": t.get("corrected"), "corrected_ci": ci, "turns": t["n"],
                        "all_user_turns": s["counts"]["turns"], "covered": bool(ci and ci[0] <= truth <= ci[1]),
                        "youden_j": (None if rates.get("recall") is None or rates.get("false_positive_rate") is None
                                     else round(rates["recall"] - rates["false_positive_rate"], 3)),
                        "estimation_threshold": s["estimation_threshold"], "error_rates": s["error_rates"]}
        out["sources"][src] = row
        say(f"public {src}: true {truth:.3f}, raw {row['with_labels']['raw']:.3f}, corrected (labels) "
            f"{row['with_labels']['corrected']} {row['with_labels']['corrected_ci']}, corrected (calibration) "
            f"{row['calibration']['corrected']} {row['calibration']['corrected_ci']}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Clarifier model URI (folder, models:/, runs:/, s3://, builtin:).")
    p.add_argument("--conversations", type=int, default=300, help="Conversations per planted-rate run.")
    p.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    p.add_argument("--labelled", type=float, default=0.3, help="Share of user turns with a gold label.")
    p.add_argument("--throughput-conversations", type=int, default=150)
    p.add_argument("--memory-conversations", type=int, default=60, help="x1 of the memory test (x10 is 10 times it).")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="Error rates of the planted-rate runs: the logs' labelled sample and/or the model's calibration counts.")
    p.add_argument("--public-data", default=None, help="A data-job output whose test split becomes logs (part 4).")
    p.add_argument("--skip", nargs="*", default=[], choices=["planted", "throughput", "memory", "public"])
    p.add_argument("--cpus", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="Result JSON (default benchmarks/results/audit.json).")
    p.add_argument("overrides", nargs="*", help="Config overrides for every audit run, e.g. audit.batch_size=16")
    args = p.parse_args()
    result_file("audit", args.out)  # refused now, not after the run, when that file is already there
    OVERRIDES[:] = args.overrides

    import ray

    def say(msg: str) -> None:
        print(f"[bench] {msg}", flush=True)

    ray.init(num_cpus=args.cpus, log_to_driver=False)
    t0 = time.time()
    result: dict = {"model": args.model, "overrides": args.overrides}
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as d:
        tmp = Path(d)
        parts = {  # throughput first: the part most sensitive to anything else on the machine
            "throughput": lambda: throughput(args.model, tmp, args.throughput_conversations, args.seed, say),
            "planted": lambda: planted_rates(args.model, tmp, args.conversations, args.rates, args.labelled, args.seed,
                                             say, args.modes),
            "memory": lambda: memory(args.model, tmp, args.memory_conversations, args.seed, say),
            "public": lambda: public_sets(args.model, tmp, args.public_data, args.labelled, args.seed, say),
        }
        for name, run in parts.items():
            if name in args.skip or (name == "public" and not args.public_data):
                continue
            result[name] = run()
            result["seconds"] = round(time.time() - t0, 1)
            result["complete"] = False
            write_result("audit", result, args.out)  # after each part: a stopped run keeps what it measured
    result["complete"] = True
    result["seconds"] = round(time.time() - t0, 1)
    say(f"wrote {write_result('audit', result, args.out)}")


if __name__ == "__main__":
    main()
