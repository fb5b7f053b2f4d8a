"""Serving benchmark: Ray Serve + HTTP under load, with same-run ratios.

    # the real adapter (a model folder or a registry URI), CPU:
    .venv/bin/python benchmarks/serving/bench_serving.py --model models:/clarifier@champion \
        --tracking-uri http://127.0.0.1:5000
    # the tiny test model, short smoke run:
    .venv/bin/python benchmarks/serving/bench_serving.py --tiny --levels 1,8 --requests 40
    # GPU variant (one GPU per model replica; the in-process baseline also runs on CUDA):
    .venv/bin/python benchmarks/serving/bench_serving.py --model /path/to/adapter --gpu

What one run measures (all in the same Ray instance, one model replica with ``--cpus`` CPUs, so
ratios compare like with like):

* ``levels``: for each concurrency in ``--levels`` (default 1,8,32), ``--requests`` requests sent
  by a *separate process* (an asyncio + httpx load driver, ``driver`` sub-command) to
  ``POST /v1/clarify``: throughput (answers/s) and latency p50/p95/p99/mean (ms), error counts.
  Variants: ``batched`` (``max_batch_size=--batch-size``) and ``unbatched`` (``max_batch_size=1``)
  in the default precision (``serve.precision=auto``: bf16 on a CPU with AVX512-BF16/AMX), and
  ``fp32_batched`` (``serve.precision=fp32``) at ``--precision-levels``; ``generate_batched`` and
  ``always_generate_generate`` (``serve.decode=generate``: transformers' generate instead of the engine's fast decode
  path; ``--decode-against fast-bf16``: ``fast-bf16_batched`` and ``always_generate_fast-bf16`` instead) at
  ``--decode-levels``.
* ``always_generate``: the batched deployment of the same adapter with its threshold forced to 0,
  so every request decodes a question (no decision fast path), at ``--fast-path-levels``.
* ``burst``: the default queue policy (``serve.max_queued_requests: null``: admission from
  ``serve.latency_budget_s``, ``--budget``) hit by ``--burst`` requests at once: how many were
  answered, how many got a fast 503, and the latency of each kind.
* ``in_process``: the same engine called directly in this process (no HTTP, no Serve): one request
  at a time, and in batches of ``--batch-size``; the clarify path (threshold 0) with one prefill
  (generation continues from the decision pass's KV cache) vs two (the prompt encoded again), and
  whether both decode the same tokens; bf16 vs fp32 decision probabilities on the workload (the
  measured tolerance and the decisions that flip at the threshold).
* ``ratios``: batched/unbatched throughput per level; bf16/fp32 throughput at concurrency 8 and
  p50 at 1; always-generate/fast-path p50 and mean latency; clarify-path p50 two prefills / one;
  HTTP+Serve overhead at concurrency 1 (p50 HTTP - p50 in-process, ms, and their ratio).

Workload: requests built from the synthetic conversation generator, mixed to ``--clear-share``
(default 0.8) clear turns and the rest ambiguous. With ``--tiny`` the random tiny model has no idea
which is which, so its threshold is set to the score quantile that sends the ambiguous share
(20 %) down the generation path, mimicking a calibrated model on that mix; a real adapter keeps
its calibrated threshold. Results go to ``benchmarks/results/serving_<tag>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import cpu_info, result_file  # noqa: E402


# ---- load driver (runs in its own process) ----------------------------------------------------------


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _drive(url: str, payloads: list[dict], concurrency: int, n: int, warmup: int, timeout: float,
                 api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        async def one(i: int):
            t0 = time.perf_counter()
            try:
                r = await client.post(f"{url}/v1/clarify", json=payloads[i % len(payloads)])
                body = r.json() if r.status_code == 200 else None
                return r.status_code, time.perf_counter() - t0, body
            except httpx.HTTPError as exc:
                return type(exc).__name__, time.perf_counter() - t0, None

        await asyncio.gather(*(one(i) for i in range(warmup)))  # connections, first batches
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)
        results: list = []

        async def worker():
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one(i))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [(dt, b) for code, dt, b in results if code == 200]
    lat = [dt * 1000 for dt, _ in ok]
    errors: dict = {}
    for code, _, _ in results:
        if code != 200:
            errors[str(code)] = errors.get(str(code), 0) + 1
    generated = sum(1 for _, b in ok if b["needs_clarification"] or not b["valid_output"])
    shed = [dt * 1000 for code, dt, _ in results if code == 503]
    return {
        "concurrency": concurrency, "requests": n, "ok": len(ok), "errors": errors, "wall_s": round(wall, 3),
        "throughput_rps": round(len(ok) / wall, 3) if wall > 0 else None,
        "latency_ms": {"p50": round(_percentile(lat, 0.5), 2), "p95": round(_percentile(lat, 0.95), 2),
                       "p99": round(_percentile(lat, 0.99), 2),
                       "mean": round(statistics.fmean(lat), 2) if lat else None},
        "generated_share": round(generated / len(ok), 3) if ok else None,
        "rejected_latency_ms": {"p50": round(_percentile(shed, 0.5), 2), "p99": round(_percentile(shed, 0.99), 2)}
        if shed else None,
        "model_versions": sorted({b["model_version"] for _, b in ok}),
    }


def driver_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_serving.py driver")
    ap.add_argument("--url", required=True)
    ap.add_argument("--payloads", required=True, help="JSON file: list of /v1/clarify bodies")
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--requests", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args(argv)
    payloads = json.loads(Path(a.payloads).read_text())
    out = asyncio.run(_drive(a.url, payloads, a.concurrency, a.requests, a.warmup, a.timeout,
                             os.environ.get("CLARIFIER_API_KEY")))
    print(json.dumps(out))


def run_driver(url: str, payload_file: Path, concurrency: int, n: int, warmup: int) -> dict:
    """One load level from a second process (so the load generator does not share our GIL)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "driver", "--url", url, "--payloads", str(payload_file),
           "--concurrency", str(concurrency), "--requests", str(n), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"load driver failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- workload and models --------------------------------------------------------------------------


def build_workload(n: int, clear_share: float, seed: int = 0) -> list[dict]:
    """``n`` request bodies, ``clear_share`` of them clear turns (gold label), the rest ambiguous."""
    from clarifier.data.synthetic import generate_conversations
    from clarifier.core.schema import ConversationLog

    clear, ambiguous = [], []
    for conv in generate_conversations(max(200, n), seed=seed):
        for ex in ConversationLog.model_validate(conv).explode():
            body = {"history": [t.model_dump() for t in ex.history], "query": ex.query,
                    "passages": [p.model_dump() for p in ex.passages]}
            (ambiguous if ex.needs_clarification else clear).append(body)
    rng = random.Random(seed)
    n_clear = round(n * clear_share)
    if len(clear) < n_clear or len(ambiguous) < n - n_clear:
        raise SystemExit(f"synthetic data too small for {n} requests at clear share {clear_share}")
    mix = rng.sample(clear, n_clear) + rng.sample(ambiguous, n - n_clear)
    rng.shuffle(mix)
    return mix


def tiny_model(work: Path) -> Path:
    """The tiny test model + a LoRA adapter (tests/support), threshold set later."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.adapters import untrained_adapter
    from support.tinymodel import build_tiny_model

    base = build_tiny_model(work / "tiny-base")
    return untrained_adapter(base, work / "tiny-adapter", threshold=0.5)


def with_threshold(folder: Path, out: Path, threshold: float) -> Path:
    """A copy of a model folder whose clarifier.json carries ``threshold`` (weights symlinked)."""
    from dataclasses import replace

    from clarifier.engine.inference import read_meta, write_meta

    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.name != "clarifier.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    write_meta(out, replace(read_meta(folder), threshold=threshold))
    return out


def load_engine(folder: Path, max_new_tokens: int, gpu: bool, precision: str = "auto"):
    from clarifier.engine.inference import ClarifierEngine

    return ClarifierEngine.from_folder(folder, version="in-process", max_new_tokens=max_new_tokens,
                                       precision=precision, device="cuda" if gpu else "cpu")


def _lat(xs: list[float]) -> dict:
    return {"p50": round(_percentile(xs, 0.5), 2), "p95": round(_percentile(xs, 0.95), 2),
            "mean": round(statistics.fmean(xs), 2) if xs else None}


def prefill_comparison(engine, payloads: list[dict], n: int) -> dict:
    """The clarify path (threshold 0: every request decodes) one request at a time, with the
    generation continued from the decision pass's KV cache vs a second prefill; same outputs?"""
    from clarifier.core.schema import ClarifyRequest

    reqs = [ClarifyRequest.model_validate(payloads[i % len(payloads)]) for i in range(n)]
    out: dict = {"requests": n}
    answers = {}
    for one in (True, False):
        engine.one_prefill = one
        engine.clarify(reqs[:1], threshold=0.0)  # warm-up
        lat, res = [], []
        for r in reqs:
            t = time.perf_counter()
            res.append(engine.clarify([r], threshold=0.0)[0])
            lat.append((time.perf_counter() - t) * 1000)
        out["one_prefill" if one else "two_prefills"] = {"latency_ms": _lat(lat)}
        answers[one] = [a.model_dump() for a in res]
    engine.one_prefill = True
    out["same_answers"] = sum(a == b for a, b in zip(answers[True], answers[False]))
    return out


def precision_agreement(folder: Path, payloads: list[dict], threshold: float, max_new_tokens: int, gpu: bool,
                        n: int, batch: int) -> dict:
    """bf16 vs fp32 P(clarify) of the same model on the workload: the tolerance, and the decisions
    at the threshold that differ."""
    import math

    from clarifier.core.schema import ClarifyRequest

    items = [(r.history, r.query, r.passages) for r in (ClarifyRequest.model_validate(p) for p in payloads[:n])]
    scores = {}
    for prec in ("fp32", "bf16"):
        eng = load_engine(folder, max_new_tokens, gpu, prec)
        scores[prec] = [s for i in range(0, len(items), batch) for s in eng.score(items[i:i + batch])]
        del eng
    a, b = scores["fp32"], scores["bf16"]
    diffs = sorted(abs(x - y) for x, y in zip(a, b))
    logit = lambda p: math.log(max(p, 1e-7) / max(1 - p, 1e-7))  # noqa: E731
    flips = sum((x >= threshold) != (y >= threshold) for x, y in zip(a, b))
    return {"n": len(items), "threshold": threshold, "max_abs_diff": round(diffs[-1], 5),
            "p99_abs_diff": round(_percentile(diffs, 0.99), 5), "mean_abs_diff": round(statistics.fmean(diffs), 5),
            "max_logit_diff": round(max(abs(logit(x) - logit(y)) for x, y in zip(a, b)), 4),
            "decisions_differ": flips, "decision_agreement": round(1 - flips / len(items), 4),
            "fp32_within_max_diff_of_threshold": sum(abs(x - threshold) <= diffs[-1] for x in a)}


def in_process(engine, payloads: list[dict], n: int, batch_size: int) -> dict:
    from clarifier.core.schema import ClarifyRequest

    reqs = [ClarifyRequest.model_validate(payloads[i % len(payloads)]) for i in range(n)]
    engine.clarify(reqs[:2])  # warm-up
    lat = []
    t0 = time.perf_counter()
    for r in reqs:
        t = time.perf_counter()
        engine.clarify([r])
        lat.append((time.perf_counter() - t) * 1000)
    single_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, n, batch_size):
        engine.clarify(reqs[i:i + batch_size])
    batch_wall = time.perf_counter() - t0
    return {
        "requests": n,
        "single": {"throughput_rps": round(n / single_wall, 3),
                   "latency_ms": {"p50": round(_percentile(lat, 0.5), 2), "p95": round(_percentile(lat, 0.95), 2),
                                  "p99": round(_percentile(lat, 0.99), 2), "mean": round(statistics.fmean(lat), 2)}},
        "batched": {"batch_size": batch_size, "throughput_rps": round(n / batch_wall, 3)},
    }


# ---- the run ---------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model folder or URI (models:/name@alias, models:/name/3, runs:/, s3://)")
    src.add_argument("--tiny", action="store_true", help="the tiny test model (smoke runs)")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"))
    ap.add_argument("--gpu", action="store_true", help="one GPU per model replica; in-process baseline on CUDA")
    ap.add_argument("--levels", default="1,8,32", help="concurrency levels (comma separated)")
    ap.add_argument("--fast-path-levels", default="1,8", help="levels for the always-generate comparison")
    ap.add_argument("--precision-levels", default="1,8", help="levels for the fp32 deployment (empty: skip)")
    ap.add_argument("--decode-levels", default="1,8", help="levels for the serve.decode=generate deployments (empty: "
                                                           "skip)")
    ap.add_argument("--requests", type=int, default=64, help="requests per level (after warm-up)")
    ap.add_argument("--decode-against", default="generate", choices=["generate", "fast", "fast-bf16"],
                    help="the serve.decode the default deployment (auto) is compared with at --decode-levels")
    ap.add_argument("--budget", type=float, default=5.0, help="serve.latency_budget_s of the burst variant")
    ap.add_argument("--burst", type=int, default=64, help="requests sent at once in the burst variant (0: skip)")
    ap.add_argument("--prefill-requests", type=int, default=24, help="in-process clarify-path requests per prefill mode")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8, help="max_batch_size of the batched variant")
    ap.add_argument("--batch-wait-s", type=float, default=0.01)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--clear-share", type=float, default=0.8)
    ap.add_argument("--cpus", type=float, default=2, help="CPUs per model replica")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    ap.add_argument("--skip-unbatched", action="store_true")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/serving_<tag>.json)")
    a = ap.parse_args(argv)
    tag = ("tiny" if a.tiny else "model") + ("-gpu" if a.gpu else "-cpu")
    out_path = result_file(f"serving_{tag}", a.out)  # refused now, not after the run, when that file is already there

    import logging

    import ray
    from ray import serve

    logging.getLogger("clarifier.engine.inference").setLevel(logging.ERROR)  # the tiny model's garbage is expected
    from clarifier.core.config import ServeConfig
    from clarifier.engine.loading import resolve_model
    from clarifier.serving.app import run_local
    from clarifier.runtime.services import free_port

    levels = [int(x) for x in a.levels.split(",") if x.strip()]
    fp_levels = [int(x) for x in a.fast_path_levels.split(",") if x.strip()]
    prec_levels = [int(x) for x in a.precision_levels.split(",") if x.strip()]
    dec_levels = [int(x) for x in a.decode_levels.split(",") if x.strip()]
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    payloads = build_workload(max(a.requests, 100), a.clear_share)
    payload_file = work / "payloads.json"
    payload_file.write_text(json.dumps(payloads))

    if a.tiny:
        folder = tiny_model(work)
        model_label = "tiny test model (tests/support/tinymodel.py) + LoRA"
    else:
        resolved = resolve_model(a.model, tracking_uri=a.tracking_uri)
        folder, model_label = Path(resolved.folder), f"{a.model} ({resolved.version})"

    import torch

    if not a.gpu:  # like a replica: Ray sets OMP_NUM_THREADS to its CPUs (at least 1)
        torch.set_num_threads(max(1, int(a.cpus)))
    print(f"[bench] loading the in-process engine from {folder} (torch threads {torch.get_num_threads()})", flush=True)
    engine = load_engine(folder, a.max_new_tokens, a.gpu)
    if a.tiny:  # mimic a calibrated threshold on this mix: the ambiguous share goes to generation
        from clarifier.core.schema import ClarifyRequest

        scores = engine.score([(r.history, r.query, r.passages)
                               for r in (ClarifyRequest.model_validate(p) for p in payloads)])
        thr = _percentile(scores, a.clear_share)
        folder = with_threshold(folder, work / "tiny-calibrated", thr)
        engine.threshold = thr
    threshold = engine.threshold
    always = with_threshold(folder, work / "always-generate", 0.0)
    print(f"[bench] in-process baseline (threshold {threshold:.4f}, {engine.precision})", flush=True)
    inproc = in_process(engine, payloads, min(a.requests, 100), a.batch_size)
    inproc["precision"] = engine.precision
    print("[bench] in-process clarify path: one prefill vs two", flush=True)
    inproc["prefill"] = prefill_comparison(engine, payloads, a.prefill_requests)
    del engine
    print("[bench] bf16 vs fp32 decision probabilities", flush=True)
    inproc["precision_agreement"] = precision_agreement(folder, payloads, threshold, a.max_new_tokens, a.gpu,
                                                        min(len(payloads), 100), a.batch_size)
    print(f"[bench]   {inproc['precision_agreement']}", flush=True)

    ray.init(address="local", num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    base = dict(port=port, max_new_tokens=a.max_new_tokens, cpus_per_replica=a.cpus,
                gpus_per_replica=1 if a.gpu else 0, max_queued_requests=-1, batch_wait_timeout_s=a.batch_wait_s,
                max_ongoing_requests=2 * a.batch_size, model_refresh_s=0)
    variants = {"batched": (folder, a.batch_size, levels, {}), "always_generate": (always, a.batch_size, fp_levels, {})}
    if not a.skip_unbatched:
        variants["unbatched"] = (folder, 1, levels, {})
    if prec_levels:
        variants["fp32_batched"] = (folder, a.batch_size, prec_levels, {"precision": "fp32"})
    if dec_levels:
        other = a.decode_against
        variants[f"{other}_batched"] = (folder, a.batch_size, dec_levels, {"decode": other})
        variants[f"always_generate_{other}"] = (always, a.batch_size, dec_levels, {"decode": other})
    results: dict = {}
    burst: dict | None = None
    old_keys = os.environ.pop("CLARIFIER_API_KEYS", None)  # benchmark the API without auth
    try:
        for name, (model_folder, bs, lv, extra) in variants.items():
            cfg = ServeConfig(model_uri=str(model_folder), max_batch_size=bs, **{**base, **extra})
            print(f"[bench] deploying {name} (max_batch_size={bs}, precision {cfg.precision}, decode {cfg.decode})",
                  flush=True)
            url = run_local(cfg, tracking_uri=a.tracking_uri, ready_timeout_s=900)
            results[name] = []
            for c in lv:
                r = run_driver(url, payload_file, c, a.requests, a.warmup)
                print(f"[bench] {name:16s} c={c:3d}  {r['throughput_rps']:8.2f} rps  p50 {r['latency_ms']['p50']:8.1f} ms"
                      f"  p95 {r['latency_ms']['p95']:8.1f}  p99 {r['latency_ms']['p99']:8.1f}  errors {r['errors']}",
                      flush=True)
                results[name].append(r)
        if a.burst:
            cfg = ServeConfig(model_uri=str(folder), max_batch_size=a.batch_size,
                              **{**base, "max_queued_requests": None, "latency_budget_s": a.budget})
            print(f"[bench] deploying burst (latency budget {a.budget:g} s), {a.burst} requests at once", flush=True)
            url = run_local(cfg, tracking_uri=a.tracking_uri, ready_timeout_s=900)
            run_driver(url, payload_file, 8, 48, a.warmup)  # the ingress measures the throughput first
            burst = run_driver(url, payload_file, a.burst, a.burst, 0)
            print(f"[bench] burst: {burst['ok']} answered (p99 {burst['latency_ms']['p99']:.0f} ms), "
                  f"errors {burst['errors']}, 503 latency {burst['rejected_latency_ms']}", flush=True)
    finally:
        if old_keys is not None:
            os.environ["CLARIFIER_API_KEYS"] = old_keys
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    def at(name, c):
        return next((r for r in results.get(name, []) if r["concurrency"] == c), None)

    ratios: dict = {"batched_vs_unbatched_throughput": {}, "always_generate_vs_fast_path_latency": {}}
    for c in levels:
        b, u = at("batched", c), at("unbatched", c)
        if b and u and u["throughput_rps"]:
            ratios["batched_vs_unbatched_throughput"][str(c)] = round(b["throughput_rps"] / u["throughput_rps"], 3)
    for c in fp_levels:
        b, g = at("batched", c), at("always_generate", c)
        if b and g:
            ratios["always_generate_vs_fast_path_latency"][str(c)] = {
                "p50": round(g["latency_ms"]["p50"] / b["latency_ms"]["p50"], 3),
                "mean": round(g["latency_ms"]["mean"] / b["latency_ms"]["mean"], 3)}
    b8, f8, b1, f1 = at("batched", 8), at("fp32_batched", 8), at("batched", 1), at("fp32_batched", 1)
    if b8 and f8 and f8["throughput_rps"]:
        ratios["bf16_vs_fp32_throughput_c8"] = round(b8["throughput_rps"] / f8["throughput_rps"], 3)
    if b1 and f1:
        ratios["fp32_vs_bf16_p50_latency_c1"] = round(f1["latency_ms"]["p50"] / b1["latency_ms"]["p50"], 3)
    other = a.decode_against
    for c in dec_levels:  # the default decode path (serve.decode=auto) against --decode-against, same mix
        for fast_name, gen_name in (("batched", f"{other}_batched"), ("always_generate", f"always_generate_{other}")):
            f, g = at(fast_name, c), at(gen_name, c)
            if f and g and g["throughput_rps"]:
                ratios.setdefault(f"fast_decode_vs_{other}", {}).setdefault(fast_name, {})[str(c)] = {
                    "throughput": round(f["throughput_rps"] / g["throughput_rps"], 3),
                    "p50_latency_lower": round(g["latency_ms"]["p50"] / f["latency_ms"]["p50"], 3)}
    pf = inproc["prefill"]
    ratios["clarify_path_p50_two_vs_one_prefill"] = round(
        pf["two_prefills"]["latency_ms"]["p50"] / pf["one_prefill"]["latency_ms"]["p50"], 3)
    if b1:
        http, local = b1["latency_ms"]["p50"], inproc["single"]["latency_ms"]["p50"]
        ratios["http_serve_overhead_c1"] = {"http_p50_ms": http, "in_process_p50_ms": local,
                                            "overhead_ms": round(http - local, 2), "ratio": round(http / local, 3)}

    report = {
        "benchmark": "serving", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": model_label,
        "variant": "gpu" if a.gpu else "cpu", "threshold": threshold, "clear_share": a.clear_share,
        "settings": {k: v for k, v in vars(a).items() if k not in ("out",)},
        "machine": {**cpu_info(), "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads_in_process": torch.get_num_threads(), "cuda": torch.cuda.get_device_name(0) if a.gpu and torch.cuda.is_available() else None,
                    "loadavg_1m": os.getloadavg()[0]},
        "levels": results, "burst": burst, "in_process": inproc, "ratios": ratios,
        "notes": "One model replica; load from a separate asyncio+httpx process; latency is client-side per request.",
    }
    out_path = result_file(f"serving_{tag}", a.out)  # still new
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    print(json.dumps(ratios, indent=2))
    print(f"[bench] wrote {out_path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "driver":
        driver_main(sys.argv[2:])
    else:
        main(sys.argv[1:])
