"""Many assistants, one deployment: what each added tenant costs a model replica, in one run.

    .venv/bin/python benchmarks/serving/bench_tenants.py                      # the shipped model, ~15 min on 2 CPUs
    .venv/bin/python benchmarks/serving/bench_tenants.py --tiny --requests 16 # smoke run (tiny test model)

Tenants are made from one model (``--model``, default ``builtin:clarifier-smollm2-135m``) the way teams get them:

* **head tenants**: ``clarifier adapt`` copies: the same adapter, the decision head nudged (each weight times
  ``1 + 0.05 N(0, 1)``, its own seed) and a threshold of 2 so every request takes the fast path (the decision pass
  alone: the path four requests in five take, and the one a head changes);
* **adapter tenants**: a LoRA adapter of their own (the model's adapter with ``1e-3`` relative noise: other weights,
  the same size), each its own trunk.

One Ray instance; each application has one model replica of ``--cpus`` CPUs:

* ``single`` (at ``/single``): the model alone (``serve.model_uri``), deployed beside each of the following;
* ``heads_<n>`` for n in ``--tenants`` (default 1,10,50): a tenants file of n head tenants (at ``/tenants``). Each of
  ``--requests`` workload turns is sent once to ``single`` and once to a tenant (round-robin over the n), one at a
  time, the two in random order, so drift and noise hit both alike: the p50 ratio comes with a paired bootstrap
  interval. Memory: RSS of the tenants replica after its first tenant answered and after every tenant answered (the
  same process): the share the other n - 1 tenants added, and per tenant;
* ``adapters``: ``--adapters`` (default 5) adapter tenants with ``serve.max_adapters_per_replica=2``: latency of a
  request whose adapter is held (hit) and of one whose adapter must be loaded, evicting another (miss = the swap);
* ``swap``: five head tenants, one followed through a registry alias (a local MLflow server) with
  ``serve.model_refresh_s=--swap-refresh-s``; all five called one request at a time each while the alias moves:
  seconds from the move to the first answer of the new version, requests failed (any tenant), the others' latency
  before and after;
* ``burst``: 10 head tenants, one of them sent ``--burst-concurrency`` requests at once for ``--burst-s`` seconds (each
  of its workers waits what a refusal's Retry-After says, as ClarifierClient does) while the others are called at
  concurrency 2; each tenant has ``latency_budget_s=--budget``, batches of ``--burst-batch-size``. Recorded: the
  others' p50/p99 against the budget, and how much of the burster's load was shed (503s).

``--sections`` runs some of them (default all). Results go to
``benchmarks/results/serving-tenants[-<sections>]_<tag>-<date>.json`` (never overwritten).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
from common import cpu_info, result_file, write_result  # noqa: E402
from bench_serving import _percentile, build_workload, tiny_model  # noqa: E402


SECTIONS = ("heads", "adapters", "burst", "swap")


def _lat(xs: list[float]) -> dict:
    ms = [x * 1000 for x in xs]
    return {"n": len(ms), "p50": round(_percentile(ms, 0.5), 2), "p99": round(_percentile(ms, 0.99), 2),
            "mean": round(statistics.fmean(ms), 2) if ms else None}


def linked_copy(src: Path, out: Path, skip: tuple = ()) -> Path:
    """``out`` with every file of ``src`` symlinked but ``skip`` (the model's weights are read, never copied)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            (out / f.name).symlink_to(f.resolve())
    return out


def head_tenant(src: Path, out: Path, seed: int) -> Path:
    """An ``adapt``-like copy: the adapter shared, the decision head nudged, threshold 2 (always the fast path)."""
    import torch

    from clarifier.engine.decision_head import DecisionHead
    from clarifier.engine.inference import read_meta, write_meta

    linked_copy(src, out, skip=("decision_head.safetensors", "clarifier.json", "MODEL_CARD.md", "card.json"))
    head = DecisionHead.load(src)
    if head is None:
        raise SystemExit(f"{src} has no decision head: head tenants need one")
    g = torch.Generator().manual_seed(seed)
    head.weight = head.weight * (1 + 0.05 * torch.randn(head.weight.shape, generator=g))
    head.save(out)
    meta = read_meta(src)
    meta.threshold = 2.0
    write_meta(out, meta)
    return out


def adapter_tenant(src: Path, out: Path, seed: int) -> Path:
    """A tenant with its own adapter: the model's LoRA weights with 1e-3 relative noise (another trunk)."""
    import torch
    from safetensors.torch import load_file, save_file

    linked_copy(src, out, skip=("adapter_model.safetensors", "clarifier.json", "MODEL_CARD.md", "card.json"))
    g = torch.Generator().manual_seed(1000 + seed)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    noisy = {k: (v.float() * (1 + 1e-3 * torch.randn(v.shape, generator=g))).to(v.dtype) for k, v in tensors.items()}
    save_file(noisy, str(out / "adapter_model.safetensors"))
    from clarifier.engine.inference import read_meta, write_meta

    meta = read_meta(src)
    meta.threshold = 2.0
    write_meta(out, meta)
    return out


def replica_rss_mib(app: str) -> float:
    """Resident memory of application ``app``'s model replica (this machine's: Ray titles it
    ``ray::ServeReplica:<app>:ClarifierModel``)."""
    import psutil

    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if f"ServeReplica:{app}:ClarifierModel" in cmd:
            procs.append(proc)
    if len(procs) != 1:
        raise RuntimeError(f"expected one model replica process, found {len(procs)}")
    return procs[0].memory_info().rss / 2**20


async def _send(url: str, bodies: list[dict], concurrency: int, headers_for=None, stop_at: float | None = None,
                timeout: float = 600, retry_after: bool = False) -> list[tuple]:
    """Each body once (or round-robin until ``stop_at``), ``concurrency`` at a time: [(status, seconds, model)].
    ``retry_after``: after a refusal, a worker waits the seconds its Retry-After says (as ClarifierClient does)."""
    import httpx

    out: list = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        it = iter(range(10**9))

        async def worker():
            while True:
                i = next(it)
                if stop_at is None and i >= len(bodies):
                    return
                if stop_at is not None and time.perf_counter() >= stop_at:
                    return
                body = bodies[i % len(bodies)]
                t0 = time.perf_counter()
                try:
                    r = await client.post(f"{url}/v1/clarify", json=body)
                    out.append((r.status_code, time.perf_counter() - t0, body.get("model")))
                    if retry_after and r.status_code in (429, 503) and "retry-after" in r.headers:
                        wait = float(r.headers["retry-after"])
                        if stop_at is not None:
                            wait = min(wait, max(0.0, stop_at - time.perf_counter()))
                        await asyncio.sleep(wait)
                except httpx.HTTPError as exc:
                    out.append((type(exc).__name__, time.perf_counter() - t0, body.get("model")))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def send(url, bodies, concurrency=1, stop_at=None):
    return asyncio.run(_send(url, bodies, concurrency, stop_at=stop_at))


def paired_p50_ratio(a: list[float], b: list[float], n_boot: int = 2000, seed: int = 0) -> tuple:
    """median(a) / median(b) over paired samples, with a 95% paired bootstrap interval (pairs resampled)."""
    import numpy as np

    x, y = np.asarray(a), np.asarray(b)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    boots = np.median(x[idx], axis=1) / np.median(y[idx], axis=1)
    return (round(float(np.median(x) / np.median(y)), 4), round(float(np.quantile(boots, 0.025)), 4),
            round(float(np.quantile(boots, 0.975)), 4))


def ok_latencies(results: list[tuple]) -> list[float]:
    bad = [r for r in results if r[0] != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed: {bad[:3]}")
    return [dt for _, dt, _ in results]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default="builtin:clarifier-smollm2-135m", help="the model the tenants are made from")
    src.add_argument("--tiny", action="store_true", help="the tiny test model with a random head (smoke runs)")
    ap.add_argument("--tenants", default="1,10,50", help="head-tenant counts")
    ap.add_argument("--adapters", type=int, default=5)
    ap.add_argument("--requests", type=int, default=48, help="timed requests per deployment at concurrency 1")
    ap.add_argument("--cpus", type=float, default=2)
    ap.add_argument("--budget", type=float, default=3.0, help="each tenant's latency_budget_s in the burst")
    ap.add_argument("--burst-concurrency", type=int, default=32)
    ap.add_argument("--burst-s", type=float, default=40)
    ap.add_argument("--burst-batch-size", type=int, default=2,
                    help="max_batch_size (= max_ongoing_requests) of the burst deployment: on a 2-core CPU a batch of "
                         "8 fast-path requests takes longer than the budget by itself")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--swap-refresh-s", type=float, default=2.0, help="serve.model_refresh_s of the swap deployment")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"which to run (default all: {','.join(SECTIONS)})")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sections = [x for x in a.sections.split(",") if x]
    if set(sections) - set(SECTIONS):
        raise SystemExit(f"--sections: unknown {sorted(set(sections) - set(SECTIONS))}; known {','.join(SECTIONS)}")
    tag = "tiny-cpu" if a.tiny else "model-cpu"
    part = "" if set(sections) == set(SECTIONS) else "-" + "-".join(sections)
    out_path = result_file(f"serving-tenants{part}_{tag}-{time.strftime('%Y-%m-%d')}", a.out)
    counts = [int(x) for x in a.tenants.split(",") if x]

    import logging

    import ray
    import yaml
    from ray import serve

    logging.getLogger("clarifier.engine.inference").setLevel(logging.ERROR)
    from clarifier.core.config import ServeConfig
    from clarifier.engine.loading import resolve_model
    from clarifier.runtime.services import free_port
    from clarifier.serving.app import base_url, build_app, wait_ready

    work = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    if a.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from support.adapters import with_head

        model = with_head(tiny_model(work), work / "tiny-head", threshold=2.0, seed=0)
    else:
        model = resolve_model(a.model).folder
    heads = [head_tenant(model, work / f"head-{i}", seed=i) for i in range(max(counts + [10]))]
    adapters = [adapter_tenant(model, work / f"adapter-{i}", seed=i) for i in range(a.adapters)]
    workload = build_workload(max(a.requests, 64), clear_share=0.8, seed=0)
    print(f"[bench_tenants] {len(heads)} head tenants and {len(adapters)} adapter tenants from {model} in {work}",
          flush=True)

    os.environ.pop("CLARIFIER_API_KEYS", None)
    ray.init(num_cpus=int(2 * a.cpus) + 2, include_dashboard=False, log_to_driver=False)  # two replicas at once
    port = free_port()
    base = dict(port=port, cpus_per_replica=a.cpus, max_new_tokens=a.max_new_tokens, model_refresh_s=0,
                tenants_refresh_s=0)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_info(),
                    "model": str(a.model if not a.tiny else "tiny"), "cpus_per_replica": a.cpus,
                    "requests": a.requests, "args": vars(a), "deployments": {}}

    def deploy(app: str = "tenants", tracking_uri: str | None = None, **cfg) -> str:
        """Deploy (or replace) application ``app`` at ``/<app>`` and wait until it answers; its base URL."""
        if app in serve.status().applications:
            serve.delete(app)
        c = ServeConfig(**{**base, **cfg, "route_prefix": f"/{app}"})
        serve.start(http_options={"host": c.host, "port": c.port})
        serve.run(build_app(c, tracking_uri), name=app, route_prefix=f"/{app}")
        wait_ready(base_url(c), timeout_s=600)
        return base_url(c)

    def tenants_file(name: str, specs: list[dict], default: str | None = None) -> str:
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"tenants": specs, **({"default": default} if default else {})}))
        return str(path)

    def timed(url: str, models: list[str | None]) -> dict:
        bodies = [{**workload[i % len(workload)], **({"model": m} if m else {})}
                  for i, m in zip(range(len(models)), models)]
        send(url, bodies[:8])  # warm-up
        t0 = time.perf_counter()
        lat = ok_latencies(send(url, bodies))
        return {"latency": _lat(lat), "wall_s": round(time.perf_counter() - t0, 2)}

    def one(url: str, body: dict) -> float:
        return ok_latencies(send(url, [body]))[0]

    if "heads" in sections:
        heads_section(a, counts, heads, workload, deploy, tenants_file, one, send, result)
    if "adapters" in sections:
        adapters_section(a, adapters, workload, deploy, tenants_file, result)
    if "burst" in sections:
        burst_section(a, heads, workload, deploy, tenants_file, timed, result)
    if "swap" in sections:
        swap_section(a, heads, work, deploy, tenants_file, result)
    serve.shutdown()
    ray.shutdown()
    result["ratios"] = ratios(result["deployments"], a, counts)
    print(json.dumps(result["ratios"], indent=2))
    print(f"[bench_tenants] wrote {write_result(out_path.stem, result, out_path)}")
    shutil.rmtree(work, ignore_errors=True)


def heads_section(a, counts, heads, workload, deploy, tenants_file, one, send, result) -> None:
    """The single model beside n head tenants: paired requests, same bodies; memory in the same replica."""
    from ray import serve

    single_url = deploy("single", model_uri=str(heads[0]))
    send(single_url, workload[:8])
    result["deployments"]["single"] = {"rss_mib": round(replica_rss_mib("single"), 1)}
    print(f"[bench_tenants] single: replica {result['deployments']['single']['rss_mib']} MiB", flush=True)
    rng = random.Random(0)
    for n in counts:
        names = [f"t{i:02d}" for i in range(n)]
        f = tenants_file(f"heads-{n}", [{"name": nm, "model_uri": str(heads[i])} for i, nm in enumerate(names)])
        url = deploy(tenants_file=f)
        one(url, {**workload[0], "model": names[0]})
        rss_first = replica_rss_mib("tenants")
        t0 = time.perf_counter()
        ok_latencies(send(url, [{**workload[i % len(workload)], "model": nm} for i, nm in enumerate(names)]))
        first = time.perf_counter() - t0
        rss_all = replica_rss_mib("tenants")
        send(url, [{**workload[i], "model": names[i % n]} for i in range(8)])  # warm-up of both, same bodies
        send(single_url, workload[:8])
        lat_single, lat_tenants = [], []
        for i in range(a.requests):  # one request to each, in random order: drift and noise hit both alike
            body = workload[i % len(workload)]
            pair = [("s", single_url, body), ("t", url, {**body, "model": names[i % n]})]
            rng.shuffle(pair)
            got = {k: one(u, b) for k, u, b in pair}
            lat_single.append(got["s"])
            lat_tenants.append(got["t"])
        ratio, lo, hi = paired_p50_ratio(lat_tenants, lat_single)
        row = {"tenants": n, "single": _lat(lat_single), "latency": _lat(lat_tenants),
               "p50_over_single": ratio, "p50_over_single_ci95": [lo, hi],
               "first_request_each_s": round(first, 2), "rss_mib_first_tenant": round(rss_first, 1),
               "rss_mib": round(rss_all, 1), "rss_added_share": round(rss_all / rss_first - 1, 4),
               "rss_over_single": round(rss_all / result["deployments"]["single"]["rss_mib"], 4),
               "mib_per_added_tenant": round((rss_all - rss_first) / (n - 1), 3) if n > 1 else None}
        result["deployments"][f"heads_{n}"] = row
        print(f"[bench_tenants] {n} head tenants: p50 {row['latency']['p50']} ms vs single {row['single']['p50']} "
              f"({ratio:.3f}x [{lo:.3f}, {hi:.3f}]), replica {rss_first:.0f} -> {rss_all:.0f} MiB", flush=True)
    serve.delete("single")


def adapters_section(a, adapters, workload, deploy, tenants_file, result) -> None:
    """Adapter tenants: hits and misses (a swap)."""
    names = [f"a{i}" for i in range(len(adapters))]
    f = tenants_file("adapters", [{"name": nm, "model_uri": str(adapters[i])} for i, nm in enumerate(names)])
    url = deploy(tenants_file=f, max_adapters_per_replica=2)
    hits, misses = [], []
    held: list[str] = []  # what the replica should hold, most recent last (the preloaded first tenant)
    held.append(names[0])
    order = [names[0], names[0]] + [nm for k in range(3) for nm in names[1:] + [names[0]]][:3 * len(names)]
    for i, nm in enumerate(order):
        r = send(url, [{**workload[i % len(workload)], "model": nm}])
        (hits if nm in held else misses).append(ok_latencies(r)[0])
        if nm in held:
            held.remove(nm)
        held.append(nm)
        held = held[-2:]
        r = send(url, [{**workload[(i + 1) % len(workload)], "model": nm}])  # held now
        hits.append(ok_latencies(r)[0])
    result["deployments"]["adapters"] = {"tenants": len(adapters), "max_adapters_per_replica": 2,
                                         "hit": _lat(hits), "miss": _lat(misses),
                                         "rss_mib": round(replica_rss_mib("tenants"), 1)}
    print(f"[bench_tenants] adapters: hit p50 {_lat(hits)['p50']} ms, miss (swap) p50 {_lat(misses)['p50']} ms",
          flush=True)


def burst_section(a, heads, workload, deploy, tenants_file, timed, result) -> None:
    """A bursting tenant against the others' budget."""
    names = [f"t{i:02d}" for i in range(10)]
    f = tenants_file("burst", [{"name": nm, "model_uri": str(heads[i]), "latency_budget_s": a.budget}
                               for i, nm in enumerate(names)])
    url = deploy(tenants_file=f, max_queued_requests=None, latency_budget_s=a.budget,
                 max_batch_size=a.burst_batch_size, max_ongoing_requests=a.burst_batch_size)
    ok_latencies(send(url, [{**workload[i], "model": nm} for i, nm in enumerate(names)]))
    quiet = timed(url, [names[1 + i % 9] for i in range(a.requests)])
    import threading

    stop_at = time.perf_counter() + a.burst_s
    burst_out: list = []
    t = threading.Thread(target=lambda: burst_out.extend(asyncio.run(_send(
        url, [{**workload[i % len(workload)], "model": names[0]} for i in range(64)], a.burst_concurrency,
        stop_at=stop_at, retry_after=True))))
    t.start()
    time.sleep(2)
    others = send(url, [{**workload[i % len(workload)], "model": names[1 + i % 9]} for i in range(64)], 2,
                  stop_at=stop_at)
    t.join()
    other_lat = [dt for code, dt, _ in others if code == 200]
    codes: dict = {}
    for code, _, _ in burst_out:
        codes[str(code)] = codes.get(str(code), 0) + 1
    other_codes: dict = {}
    for code, _, _ in others:
        other_codes[str(code)] = other_codes.get(str(code), 0) + 1
    burst_ok = [dt for code, dt, _ in burst_out if code == 200]
    result["deployments"]["burst"] = {
        "tenants": 10, "budget_s": a.budget, "burst_concurrency": a.burst_concurrency, "burst_s": a.burst_s,
        "max_batch_size": a.burst_batch_size, "burster_honours_retry_after": True,
        "others_quiet": quiet["latency"], "others_during_burst": _lat(other_lat), "others_codes": other_codes,
        "burster_codes": codes, "burster_latency": _lat(burst_ok),
        "burster_shed_share": round(1 - codes.get("200", 0) / max(1, len(burst_out)), 3),
        "others_p99_within_budget": _percentile(other_lat, 0.99) <= a.budget if other_lat else None,
        "others_failed": sum(v for k, v in other_codes.items() if k != "200"),
    }
    print(f"[bench_tenants] burst: others p99 {_lat(other_lat)['p99']} ms (budget {a.budget * 1000:.0f}), burster "
          f"codes {codes}", flush=True)


def swap_section(a, heads, work, deploy, tenants_file, result) -> None:
    """One tenant's registry alias moved while five tenants are called: how long until it answers with the new
    version, and whether any request of any tenant failed meanwhile."""
    import threading

    import httpx
    import mlflow

    from clarifier.registry.registry import register_adapter, set_alias
    from clarifier.runtime.services import start_mlflow_server

    server = start_mlflow_server(work / "mlflow")
    try:
        mlflow.set_tracking_uri(server.url)
        mlflow.set_experiment("bench-tenants-swap")
        name, versions = "bench-tenant-swap", []
        for i in (0, 1):
            with mlflow.start_run(run_name=f"v{i}") as run:
                mlflow.log_artifacts(str(heads[i]), "adapter")
            mv = register_adapter(run.info.run_id, name, alias="champion" if i == 0 else None, tracking_uri=server.url)
            versions.append(f"{name}/{mv.version}")
        names = ["swap", "t1", "t2", "t3", "t4"]
        specs = [{"name": "swap", "model_uri": f"models:/{name}@champion"}] + [
            {"name": nm, "model_uri": str(heads[i + 1])} for i, nm in enumerate(names[1:])]
        url = deploy(tenants_file=tenants_file("swap", specs), model_refresh_s=a.swap_refresh_s,
                     tracking_uri=server.url)
        events: list = []  # (sent, answered, tenant, status, version)
        stop = threading.Event()
        body = {"history": [], "query": "how do I reset it?"}

        def client(tenant: str) -> None:
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    r = http.post(f"{url}/v1/clarify", json={**body, "model": tenant})
                    version = r.json().get("model_version") if r.status_code == 200 else None
                    events.append((t0, time.perf_counter(), tenant, r.status_code, version))

        threads = [threading.Thread(target=client, args=(nm,), daemon=True) for nm in names]
        for t in threads:
            t.start()
        time.sleep(10)
        moved = time.perf_counter()
        set_alias(name, "champion", versions[1].split("/")[1], tracking_uri=server.url)
        deadline = moved + 120
        while time.perf_counter() < deadline and not any(e[4] == versions[1] for e in list(events)):
            time.sleep(0.1)
        time.sleep(10)
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        server.stop()
    mine = [e for e in events if e[2] == "swap"]
    first_new = min((e[1] for e in mine if e[4] == versions[1]), default=None)
    old_after = [e for e in mine if e[4] == versions[0] and e[0] > (first_new or float("inf"))]
    swap_lat = [e[1] - e[0] for e in mine if e[3] == 200]
    others = [e for e in events if e[2] != "swap"]
    result["deployments"]["swap"] = {
        "tenants": len(names), "model_refresh_s": a.swap_refresh_s, "versions": versions,
        "requests": len(events), "failed": sum(1 for e in events if e[3] != 200),
        "failed_by_tenant": {nm: sum(1 for e in events if e[2] == nm and e[3] != 200) for nm in names},
        "seconds_to_new_version": round(first_new - moved, 3) if first_new else None,
        "old_version_after_switch": len(old_after),
        "swap_tenant_latency": _lat(swap_lat),
        "others_latency_before": _lat([e[1] - e[0] for e in others if e[1] < moved and e[3] == 200]),
        "others_latency_after": _lat([e[1] - e[0] for e in others if e[0] >= moved and e[3] == 200]),
        "others_versions_changed": sorted({e[4] for e in others if e[3] == 200}) != sorted(
            {e[4] for e in others if e[3] == 200 and e[1] < moved}),
    }
    row = result["deployments"]["swap"]
    print(f"[bench_tenants] swap: new version answered {row['seconds_to_new_version']} s after the alias moved "
          f"(refresh {a.swap_refresh_s} s), {row['failed']} of {row['requests']} requests failed", flush=True)


def ratios(d: dict, a, counts: list[int]) -> dict:
    r: dict = {}
    if "heads_1" in d:
        for n in counts:
            r[f"p50_heads_{n}_over_single"] = d[f"heads_{n}"]["p50_over_single"]
            r[f"rss_added_share_heads_{n}"] = d[f"heads_{n}"]["rss_added_share"]
    if "adapters" in d:
        r["adapter_miss_over_hit_p50"] = round(d["adapters"]["miss"]["p50"] / d["adapters"]["hit"]["p50"], 2)
    if "burst" in d:
        r["others_p99_during_burst_over_budget"] = round(d["burst"]["others_during_burst"]["p99"] / (a.budget * 1000), 3)
    if "swap" in d and d["swap"]["seconds_to_new_version"] is not None:
        r["swap_seconds_over_refresh"] = round(d["swap"]["seconds_to_new_version"] / a.swap_refresh_s, 3)
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
