"""Serving faults on a real local Ray Serve deployment of a tiny model (issue 8):

* a model replica's process is SIGKILLed while clients send steady load: Serve starts a
  replacement (2 of 2 replicas RUNNING again) and no request fails -- the ingress sends requests
  that were in flight on the dead replica again, to the live one; the clients (``ClarifierClient``,
  as a user would call it, with its retries) see no error, and every HTTP attempt is counted too;
* overload at 3x the measured capacity, open loop: accepted requests keep a bounded latency, the
  rest get fast JSON 503s (no timeouts, no connection errors), and over 10,000 requests the RSS of
  the model replica, the ingress replica and Serve's HTTP proxy stays flat.

Both record what happened with the ``reliability`` fixture. The replica pids come from Ray's state
API of this module's own Ray instance (``address=local``, its own dashboard port), so nothing of
another Ray instance on the machine is touched.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from clarifier.core.config import ServeConfig
from clarifier.runtime.services import free_port
from support.metrics import metric_value

pytestmark = [pytest.mark.integration, pytest.mark.reliability, pytest.mark.slow]

HISTORY = [{"role": "user", "text": "I have a router and a modem."},
           {"role": "assistant", "text": "Which one is acting up?"}]
MODEL_CLASS = "ServeReplica:clarifier:ClarifierModel"
INGRESS_CLASS = "ServeReplica:clarifier:ClarifierIngress"
PROXY_CLASS = "ProxyActor"


# ---- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_serve():
    """This module's own Ray instance, with a dashboard (Ray's state API needs it) on a free port."""
    from support.ray import start_ray

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CLARIFIER_API_KEYS", raising=False)  # these deployments run without API keys
        with start_ray(4, dashboard=True, dashboard_port=free_port()) as ray:
            yield ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def generating_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """Threshold 0: every request takes the generation path (tens of ms on the tiny model)."""
    from support.adapters import untrained_adapter

    return untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("faults") / "adapter", seed=11, threshold=0.0)


def alive_actors(gcs_address: str, class_name: str) -> dict[str, int]:
    """{actor_id: pid} of this Ray instance's ALIVE actors of ``class_name`` (Ray's state API)."""
    from ray.util.state import list_actors

    actors = list_actors(address=gcs_address, filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
                         raise_on_missing_output=False)
    return {a.actor_id: a.pid for a in actors}


def settled_actors(gcs_address: str, class_name: str, n: int, timeout_s: float = 120) -> dict[str, int]:
    """The ``n`` ALIVE actors of ``class_name``, once replicas of an earlier deployment are gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        actors = alive_actors(gcs_address, class_name)
        if len(actors) == n:
            return actors
        assert time.monotonic() < deadline, f"{class_name}: {len(actors)} ALIVE actors, expected {n}"
        time.sleep(0.5)


def model_status():
    from ray import serve

    return serve.status().applications["clarifier"].deployments["ClarifierModel"]


def running_replicas() -> int:
    st = model_status()
    return sum(n for state, n in st.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")


def fully_running(n: int) -> bool:
    st = model_status()
    states = {str(getattr(s, "value", s)): k for s, k in st.replica_states.items() if k}
    return states == {"RUNNING": n} and str(getattr(st.status, "value", st.status)) == "HEALTHY"


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank."""
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * len(v) + 0.5)) - 1))]


class AttemptLog(httpx.HTTPTransport):
    """An httpx transport that records every HTTP attempt (status code, or the exception)."""

    def __init__(self, sink: list, lock: threading.Lock):
        super().__init__()
        self.sink, self.lock = sink, lock

    def handle_request(self, request):
        t = time.monotonic()
        try:
            resp = super().handle_request(request)
        except Exception as exc:
            with self.lock:
                self.sink.append((t, repr(exc)))
            raise
        with self.lock:
            self.sink.append((t, resp.status_code))
        return resp


# ---- 1. a model replica killed under steady load -----------------------------------------------


@pytest.mark.timeout(480)
def test_model_replica_killed_under_steady_load(generating_adapter, ray_serve, port, reliability):
    from clarifier.client import ClarifierClient
    from clarifier.serving.app import run_local

    cfg = ServeConfig(model_uri=str(generating_adapter), port=port, num_replicas=2, cpus_per_replica=0.5,
                      max_new_tokens=32)
    url = run_local(cfg, ready_timeout_s=240)
    replicas = settled_actors(ray_serve, MODEL_CLASS, 2)
    assert running_replicas() == 2, model_status()
    n_clients = 8
    lock = threading.Lock()
    attempts: list = []  # (monotonic time, status code or exception repr), every HTTP attempt
    answers: list = []  # (monotonic time, "ok" or the final error), one per clarify() call
    stop = threading.Event()

    def client(i: int):
        # the user's view: the typed client with its retries (3, honouring Retry-After)
        with ClarifierClient(url, timeout=60, retries=3, backoff=0.2, transport=AttemptLog(attempts, lock)) as c:
            n = 0
            while not stop.is_set():
                n += 1
                t = time.monotonic()
                try:
                    c.clarify(HISTORY, f"how do I reset it? {i}.{n}")
                    out = "ok"
                except Exception as exc:  # an API error, a timeout, a dropped connection: a lost request
                    out = f"{type(exc).__name__}: {exc}"
                with lock:
                    answers.append((t, out))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n_clients)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while len(answers) < 100:  # steady state first
            assert time.monotonic() < deadline, f"only {len(answers)} answers before the kill"
            time.sleep(0.1)
        victim, pid = sorted(replicas.items())[0]
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        # recovered: the killed actor is gone, two live replicas, Serve reports 2/2 RUNNING (HEALTHY)
        deadline = t_kill + 240
        while True:
            alive = alive_actors(ray_serve, MODEL_CLASS)
            if victim not in alive and len(alive) == 2 and fully_running(2):
                break
            assert time.monotonic() < deadline, f"no replacement replica after 240 s: {alive}, {model_status()}"
            time.sleep(0.25)
        t_recovered = time.monotonic()
        new = sorted(set(alive) - set(replicas))  # the replacement (more if Serve's controller restarted)
        # keep the load on a while with both replicas, so answers after recovery are counted too
        n_at_recovery = len(answers)
        deadline = time.monotonic() + 60
        while len(answers) < n_at_recovery + 100:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    retried = metric_value(metrics, "clarifier_replica_lost_total", outcome="retried")
    unavailable = metric_value(metrics, "clarifier_replica_lost_total", outcome="unavailable")

    lost = [a for a in answers if a[1] != "ok"]
    raw_failed = [a for a in attempts if a[1] != 200]
    during = [a for a in answers if t_kill <= a[0] <= t_recovered]
    ttr = t_recovered - t_kill
    print(f"\nreplica kill: {len(answers)} requests ({len(during)} between kill and recovery), "
          f"{len(attempts)} HTTP attempts, {len(raw_failed)} failed attempts, {len(lost)} lost; "
          f"{retried:.0f} model calls retried by the ingress, {unavailable:.0f} answered 503; "
          f"recovered in {ttr:.1f} s (new replicas {[a[:8] for a in new]})")
    reliability(fault="Serve model replica SIGKILLed under steady load",
                injected=f"SIGKILL to 1 of 2 ClarifierModel replicas (pid {pid}) with {n_clients} clients sending",
                at_risk=f"{retried:.0f} requests in flight on the killed replica; {len(during)} sent "
                        f"before the replacement ran; {len(answers)} in the test",
                lost=f"{len(lost)} requests ({len(raw_failed)} failed HTTP attempts before client retries)",
                recovered=f"{retried:.0f} in-flight requests re-sent to the live replica and answered; "
                          "replacement replica RUNNING (2/2)",
                time_to_recover_s=round(ttr, 1))
    assert not lost, lost[:5]
    # The ingress re-sends what the dead replica held, so not even one HTTP attempt fails.
    assert not raw_failed, raw_failed[:5]
    assert unavailable == 0
    assert new and pid not in alive.values()


# ---- 2. 3x capacity, open loop; memory flat over 10,000 requests --------------------------------


async def _send(http: httpx.AsyncClient, url: str, i: int, out: list) -> None:
    """Appends (status code or the exception, latency, response, time sent)."""
    t0 = time.perf_counter()
    try:
        r = await http.post(f"{url}/v1/clarify", json={"history": HISTORY, "query": f"how do I reset it? {i}"})
        out.append((r.status_code, time.perf_counter() - t0, r, t0))
    except httpx.HTTPError as exc:  # a timeout or a connection error: what the test is about
        out.append((repr(exc), time.perf_counter() - t0, None, t0))


def open_loop(url: str, rate: float, n: int, out: list, on_sent=None) -> float:
    """Send ``n`` requests at ``rate``/s whatever the answers (open loop); returns the achieved rate."""

    async def main():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            t0 = time.perf_counter()
            tasks = []
            for k in range(n):
                delay = t0 + k / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_send(http, url, k, out)))
                if on_sent is not None:
                    on_sent()
            sent_s = time.perf_counter() - t0
            await asyncio.gather(*tasks)
        return n / sent_s

    return asyncio.run(main())


def closed_loop(url: str, concurrency: int, seconds: float = 1e9, max_requests: int = 10**9, on_sent=None) -> list:
    """``concurrency`` clients, each sending its next request when the last one is answered,
    for ``seconds`` or until ``max_requests`` were sent."""
    out: list = []
    sent = [0]

    async def worker(http, w):
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and sent[0] < max_requests:
            sent[0] += 1
            if on_sent is not None:
                on_sent()
            await _send(http, url, w * 10**6 + sent[0], out)

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(worker(http, w) for w in range(concurrency)))

    asyncio.run(main())
    return out


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    return {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}


@pytest.mark.timeout(600)
def test_overload_at_3x_capacity_and_memory_flat_over_10k_requests(generating_adapter, ray_serve, port,
                                                                     reliability):
    from clarifier.serving.app import run_local

    # One model replica taking one request at a time (batch size 1) and 2 more waiting: capacity
    # is one generation at a time (128 tokens: ~10 answers/s on 2 cores, so that turning away the
    # other 2/3 at 3x does not starve the replica of CPU), and an accepted request waits behind
    # at most 1 + 2 others.
    ongoing, queued = 1, 2
    overload_s, total, warmup = 30.0, 10_000, 2_000
    cfg = ServeConfig(model_uri=str(generating_adapter), port=port, num_replicas=1, cpus_per_replica=0.5,
                      max_new_tokens=128, max_batch_size=1, max_ongoing_requests=ongoing,
                      max_queued_requests=queued)
    url = run_local(cfg, ready_timeout_s=240)
    pids = {name: next(iter(settled_actors(ray_serve, cls, 1).values()))
            for name, cls in (("model replica", MODEL_CLASS), ("ingress replica", INGRESS_CLASS),
                              ("HTTP proxy", PROXY_CLASS))}
    sent = [0]

    def count():
        sent[0] += 1

    # RSS of the three processes, sampled every second with the number of requests sent so far
    samples: list = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((sent[0], rss_mib(pids)))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # unloaded latency: one request at a time
        unloaded = closed_loop(url, 1, seconds=4.0, on_sent=count)
        assert all(s == 200 for s, *_ in unloaded), [s for s, *_ in unloaded if s != 200][:5]
        l0 = statistics.median(lat for _, lat, *_ in unloaded)
        # capacity: answers/s with the replica saturated (a client always waiting in the queue)
        t = time.perf_counter()
        sat = closed_loop(url, ongoing + 1, seconds=8.0, on_sent=count)
        capacity = sum(1 for s, *_ in sat if s == 200) / (time.perf_counter() - t)
        assert capacity > 0

        # overload: 3x capacity, open loop, for overload_s
        rate = 3 * capacity
        over: list = []
        t = time.perf_counter()
        achieved = open_loop(url, rate, int(rate * overload_s), over, on_sent=count)
        over_s = time.perf_counter() - t
        # soak: the rest of the 10,000 requests from 8 closed-loop clients (overloaded too: mostly 503s)
        soak = closed_loop(url, 8, max_requests=total - sent[0], on_sent=count)
    finally:
        stop.set()
        sampler.join(10)
    time.sleep(1.0)
    end = rss_mib(pids)
    samples.append((sent[0], end))
    base_at, base = next((k, r) for k, r in samples if k >= warmup)
    growth = {name: end[name] - base[name] for name in pids}

    everything = unloaded + sat + over + soak
    errors = [s for s, *_ in everything if not isinstance(s, int)]
    other = [s for s, *_ in everything if isinstance(s, int) and s not in (200, 503)]
    ok = [lat for s, lat, *_ in over if s == 200]
    rejected = [(lat, r) for s, lat, r, _ in over if s == 503]
    rej_lat = [lat for lat, _ in rejected]
    p99_ok, p50_503, p99_503 = pct(ok, 0.99), pct(rej_lat, 0.5), pct(rej_lat, 0.99)
    n_ok_all = sum(1 for s, *_ in everything if s == 200)
    trend = [(k, r) for i, (k, r) in enumerate(samples) if i % max(1, len(samples) // 6) == 0] + [samples[-1]]
    print(f"\noverload: unloaded p50 {1000 * l0:.0f} ms; capacity {capacity:.1f} answers/s; offered "
          f"{rate:.1f}/s (achieved {achieved:.1f}/s) for {over_s:.0f} s: {len(ok)} answered "
          f"(p50 {1000 * pct(ok, 0.5):.0f} ms, p99 {1000 * p99_ok:.0f} ms, {len(ok) / over_s:.1f}/s), "
          f"{len(rejected)} 503 (p50 {1000 * p50_503:.0f} ms, p99 {1000 * p99_503:.0f} ms); soak "
          f"{len(soak)} requests ({sum(1 for s, *_ in soak if s == 200)} answered); "
          f"{len(errors)} errors, {len(other)} other statuses over {len(everything)} requests")
    print("RSS MiB by requests sent: " + "; ".join(
        f"{k}: " + ", ".join(f"{v:.0f}" for v in r.values()) for k, r in trend) + f"  ({', '.join(pids)})")
    reliability(fault="overload at 3x measured capacity (open loop), then 10,000 requests in all",
                injected=f"{rate:.0f} req/s offered ({achieved:.0f}/s achieved) for {over_s:.0f} s against "
                         f"capacity {capacity:.1f} answers/s (1 replica, max_ongoing 1, max_queued 2), then "
                         f"8 closed-loop clients up to {len(everything)} requests",
                at_risk=f"{len(everything)} requests ({len(over)} at 3x)",
                lost=f"{len(errors)} timed out or lost their connection, {len(other)} other errors; at 3x "
                     f"{len(rejected)} got a 503 (p99 {1000 * p99_503:.0f} ms)",
                recovered=f"{n_ok_all} answered; at 3x p99 {1000 * p99_ok:.0f} ms vs unloaded p50 "
                          f"{1000 * l0:.0f} ms; RSS growth after {base_at} requests (MiB): "
                          + ", ".join(f"{k} {v:+.1f}" for k, v in growth.items()),
                time_to_recover_s=None)

    assert not errors, errors[:5]
    assert not other, other[:5]
    assert len(everything) >= total
    # What follows asserts behaviour, or bounds far from the failure they rule out: capacity, the
    # offered rate and every latency here are measured on a 2-core box that other work may load at
    # any moment, so ratios between them (measured minutes apart) would test the box.
    # It was overloaded and turned requests away: 2/3 of them at exactly 3x capacity; a tenth
    # still holds if the capacity measured before was off by 2x.
    assert len(rejected) >= 0.1 * len(over), "the load at 3x capacity was hardly turned away"
    for _, r in rejected[:50]:
        d = r.json()["detail"]
        assert d["limit"] == "max_queued_requests" and d["max"] == queued and r.headers["retry-after"] == "1", d
    # It kept answering throughout (the CPU it loses goes to turning away twice as many requests):
    # requests sent in each third of the overload window were answered.
    first, last = min(t for *_, t in over), max(t for *_, t in over)
    thirds = {min(2, int(3 * (t - first) / (last - first))) for s, *_, t in over if s == 200}
    assert thirds == {0, 1, 2}, f"answers only for requests sent in thirds {sorted(thirds)} of the overload"
    # Accepted latency is bounded by the queue limit, not by the offered load: an accepted request
    # waits behind at most `ongoing` running + `queued` waiting requests and then runs (plus Serve's
    # router re-polling a full replica, backoff capped at 0.5 s): about a second here. An unbounded
    # queue would instead grow with the run: at 3x for 30 s, a backlog of ~60 s. The bound, a third
    # of the overload window, lies far from both.
    assert p99_ok <= overload_s / 3, f"accepted p99 {p99_ok:.3f}s: requests queue beyond the limit"
    # A 503 is decided in the ingress before any model work (no queueing, no generation): compared
    # with the answers of the same window (same load on the box), the typical one takes under half
    # an accepted answer, and even its tail is no slower than theirs (1 s floor: at the tail, a
    # process on 2 cores shared with a replica generating flat out can wait for a CPU that long).
    p50_ok = pct(ok, 0.5)
    assert p50_503 <= 0.5 * p50_ok, f"503 p50 {p50_503:.3f}s > half the accepted p50 {p50_ok:.3f}s"
    assert p99_503 <= max(p99_ok, 1.0), f"503 p99 {p99_503:.3f}s > accepted p99 {p99_ok:.3f}s"
    # Memory flat: from the warm-up point to the end (~8,000 requests) each process grows by less
    # than 5 % or 25 MiB, whichever is larger; a leak of 4 KiB per request would exceed it.
    for name in pids:
        allowed = max(25.0, 0.05 * base[name])
        assert growth[name] <= allowed, f"{name} RSS grew {growth[name]:.1f} MiB (> {allowed:.0f})"
