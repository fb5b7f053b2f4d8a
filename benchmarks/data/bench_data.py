"""Data-job benchmark: throughput, memory as input grows, packing efficiency. Results as JSON.

    .venv/bin/python benchmarks/data/bench_data.py                    # defaults: 2000 conversations
    .venv/bin/python benchmarks/data/bench_data.py --conversations 500 --skip-memory

1. **Throughput** (conversations/s) of ``clarifier.data.pipeline.prepare`` on a local Ray with 1 and
   2 logical CPUs (as many tokenising actors), against a single-process pandas/json implementation of
   the same transform (load the tokenizer, parse and validate each line, split by conversation,
   deduplicate, tokenise, write Parquet per split) on the same input; ratios in the same run. Ray
   start-up is outside the timed region; the tokenizer is the real SmolLM2-135M-Instruct one, its
   Rust thread pool off everywhere (``TOKENIZERS_PARALLELISM=false``, as the job's workers run), so
   the single process uses one core.
2. **Peak memory** of the driver and of the Ray workers for the input and for 10x the input
   (streaming: both should stay roughly flat).
3. **Packing efficiency**: share of non-padding tokens with packing (blocks of ``--block-length``)
   vs padding to the longest example in micro-batches of ``--micro-batch`` (in shuffled order, as
   training reads them), on the synthetic logs and on each registered public dataset (through the
   importers, found as ``src: dataset:<name>`` is: ``$CLARIFIER_DATA_MIRROR`` -- ``../shared/data/public``
   when unset and present -- or the cache of ``clarifier data fetch``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import PeakMemory, result_file, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data" / "public"


def baseline_transform(files: list[Path], out: Path, tokenizer_path: str, cfg) -> dict:
    """The data job's transform in one process with json + pandas (no Ray)."""
    import pandas as pd

    from clarifier.engine.models import load_tokenizer

    from clarifier.data.stages import dedup_key
    from clarifier.data.split import assign_split
    from clarifier.data.validate import parse_line
    from clarifier.core.prompt import PromptOptions
    from clarifier.core.objective import SegmentWeights, encode_examples

    tokenizer = load_tokenizer(tokenizer_path)
    d = cfg.data
    rows, quarantined = [], 0
    for f in files:
        for line_no, raw in enumerate(f.read_bytes().split(b"\n"), start=1):
            if not raw.strip():
                continue
            examples, q = parse_line(raw, str(f), line_no, d.max_turn_chars)
            if q is not None:
                quarantined += 1
                continue
            for ex in examples:
                rows.append({"source": str(f), "line": line_no, "ex": ex, "key": dedup_key(ex),
                             "split": assign_split(ex.conversation_id, d.seed, d.split)})
    df = pd.DataFrame(rows)
    df = df.sort_values(["source", "line"]).drop_duplicates("key", keep="first")
    weights = SegmentWeights(**cfg.train.loss_weights.model_dump())
    opts = PromptOptions(max_prompt_tokens=cfg.model.max_prompt_tokens)
    exs = list(df["ex"])  # the same batched encoder as the job's actors (256 examples a call)
    enc = [e for s in range(0, len(exs), 256) for e in encode_examples(exs[s:s + 256], tokenizer, weights, opts, d.max_length)]
    df["input_ids"] = [e["input_ids"] for e in enc]
    df["labels"] = [e["labels"] for e in enc]
    df["loss_weights"] = [e["loss_weights"] for e in enc]
    df["segment_ids"] = [e["segment_ids"] for e in enc]
    df["truncated"] = [e["truncated"] for e in enc]
    df["example_json"] = [ex.model_dump_json() for ex in df["ex"]]
    df = df[~df["truncated"]].drop(columns=["ex", "truncated"])
    for split, part in df.groupby("split"):
        (out / split).mkdir(parents=True, exist_ok=True)
        part.to_parquet(out / split / "part-0.parquet", index=False)
    return {"examples": int(len(df)), "quarantined": quarantined}


def _time_pipeline(cfg, num_cpus: int) -> dict:
    import ray

    from clarifier.data.pipeline import prepare

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            manifest = prepare(cfg, progress=lambda s: None)
            seconds = time.perf_counter() - t0
    finally:
        ray.shutdown()
    return {"seconds": round(seconds, 2), "examples": manifest["counts"]["kept"], **mem.result()}


def _config(logs: Path, out: Path, base_model: str):
    from clarifier.core.config import build_config

    return build_config({}, [f"data.input={logs}", f"data.output={out}", f"model.base_model={base_model}",
                             "data.max_length=768"])


def throughput_and_memory(n: int, base_model: str, tmp: Path, skip_memory: bool, say) -> dict:
    from clarifier.data.synthetic import write_logs
    from clarifier.engine.models import resolve_base_model

    logs = tmp / f"logs-{n}"
    write_logs(str(logs), n, seed=1, shards=8)
    files = sorted(logs.glob("*.jsonl"))
    cfg = _config(logs, tmp / "out-ray", base_model)
    resolved = resolve_base_model(base_model)
    say(f"baseline (single process) on {n} conversations")
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        base = baseline_transform(files, tmp / "out-baseline", resolved, cfg)
        base_s = time.perf_counter() - t0
    result = {"conversations": n, "baseline": {"seconds": round(base_s, 2), **base, **mem.result()}}
    # "N workers": a Ray instance with N logical CPUs; the job parses with N tasks at a time, then
    # tokenises and writes with N actors (data.encode_actors defaults to the usable CPUs).
    for workers in (1, 2):
        say(f"Ray data job with {workers} worker(s) ({workers} logical CPUs)")
        result[f"ray_{workers}w"] = {"logical_cpus": workers, **_time_pipeline(cfg, workers)}
    for k in ("baseline", "ray_1w", "ray_2w"):
        result[k]["conversations_per_s"] = round(n / result[k]["seconds"], 1)
    rate = {k: result[k]["conversations_per_s"] for k in ("baseline", "ray_1w", "ray_2w")}
    result["ratios"] = {
        "ray_1w_vs_baseline": round(rate["ray_1w"] / rate["baseline"], 3),
        "ray_2w_vs_baseline": round(rate["ray_2w"] / rate["baseline"], 3),
        "ray_2w_vs_1w": round(rate["ray_2w"] / rate["ray_1w"], 3),
    }
    if not skip_memory:
        big = logs.parent / f"logs-{10 * n}"
        write_logs(str(big), 10 * n, seed=2, shards=80)
        say(f"Ray data job with 2 CPUs on 10x the input ({10 * n} conversations)")
        r10 = _time_pipeline(_config(big, tmp / "out-10x", base_model), 2)
        result["memory_10x"] = {
            "input_x1": {k: result["ray_2w"][k] for k in ("driver_peak_mib", "workers_peak_mib", "worker_max_mib")},
            "input_x10": {k: r10[k] for k in ("driver_peak_mib", "workers_peak_mib", "worker_max_mib")},
            "driver_peak_ratio_x10_vs_x1": round(r10["driver_peak_mib"] / max(result["ray_2w"]["driver_peak_mib"], 1e-9), 3),
            "workers_peak_ratio_x10_vs_x1": round(r10["workers_peak_mib"] / max(result["ray_2w"]["workers_peak_mib"], 1e-9), 3),
            "seconds_x10": r10["seconds"],
        }
    return result


def _packing(examples, tokenizer, cfg, block_length: int, micro_batch: int, seed: int = 0) -> dict:
    from clarifier.data.packing import efficiency, pack_sequences, padding_slots
    from clarifier.core.prompt import PromptOptions
    from clarifier.core.objective import SegmentWeights, encode_example

    opts = PromptOptions(max_prompt_tokens=cfg.model.max_prompt_tokens)
    encs = [encode_example(ex, tokenizer, SegmentWeights(), opts, block_length) for ex in examples]
    encs = [dict(e, id=str(k)) for k, e in enumerate(encs) if not e["truncated"]]
    random.Random(seed).shuffle(encs)
    lengths = [len(e["input_ids"]) for e in encs]
    tokens = sum(lengths)
    blocks = []
    for s in range(0, len(encs), 1024):  # the data job packs per batch of 1024 rows
        blocks += pack_sequences(encs[s : s + 1024], block_length, pad_id=0)
    return {
        "examples": len(encs),
        "mean_tokens": round(tokens / max(len(encs), 1), 1),
        "padding_efficiency": round(efficiency(tokens, padding_slots(lengths, micro_batch)), 4),
        "packing_efficiency": round(efficiency(tokens, len(blocks) * block_length), 4),
        "blocks": len(blocks),
    }


def packing_efficiency(base_model: str, block_length: int, micro_batch: int, say, max_examples: int) -> dict:
    from clarifier.core.config import build_config
    from clarifier.data.synthetic import generate_conversations
    from clarifier.engine.models import load_tokenizer, resolve_base_model
    from clarifier.core.schema import ConversationLog

    cfg = build_config({})
    tok = load_tokenizer(resolve_base_model(base_model))
    out: dict = {"block_length": block_length, "micro_batch_size": micro_batch, "datasets": {}}
    synth = [e for c in generate_conversations(600, seed=3) for e in ConversationLog.model_validate(c).explode()]
    out["datasets"]["synthetic"] = _packing(synth[:max_examples], tok, cfg, block_length, micro_batch)
    try:
        from clarifier.data import importers
    except ImportError:
        out["public"] = "skipped: clarifier.data.importers not available"
        return out
    from clarifier.data.datasets import REGISTRY, resolve_dataset

    mirror = os.environ.get("CLARIFIER_DATA_MIRROR") or (str(SHARED) if SHARED.is_dir() else None)
    for name in sorted(REGISTRY):
        say(f"packing efficiency on {name}")
        try:
            result = importers.import_dataset(name, resolve_dataset(name, mirror))
        except Exception as exc:  # report, keep going
            out["datasets"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        exs = list(result.examples)[:max_examples]
        out["datasets"][name] = _packing(exs, tok, cfg, block_length, micro_batch)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--base-model", default="smollm2-135m-instruct")
    ap.add_argument("--block-length", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--max-packing-examples", type=int, default=3000)
    ap.add_argument("--skip-memory", action="store_true", help="Skip the 10x-input memory run.")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", default=None, help="Result file (default benchmarks/results/data.json).")
    args = ap.parse_args()
    result_file("data", args.out)  # refused now, not after the run, when that file is already there

    def say(msg: str) -> None:
        print(f"[bench-data] {msg}", flush=True)

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core for the single process, as in the job's workers

    result: dict = {"params": vars(args)}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        if not args.skip_throughput:
            result["throughput"] = throughput_and_memory(args.conversations, args.base_model, Path(tmp),
                                                         args.skip_memory, say)
    result["packing"] = packing_efficiency(args.base_model, args.block_length, args.micro_batch, say,
                                           args.max_packing_examples)
    path = write_result("data", result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "params"}, indent=2))
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
