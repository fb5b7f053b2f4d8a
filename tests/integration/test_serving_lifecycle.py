"""Serving under change and under load, on a real MLflow registry and local Ray:

* alias hot-switch: two registered versions of a tiny adapter, ``champion`` -> v1 served, requests
  sent continuously from threads while the alias moves to v2: zero failed requests, and every
  client sees v1 answers, then only v2 answers;
* backpressure: max_ongoing_requests=1, max_queued_requests=1 and a slow generation path; a burst
  of concurrent requests gets JSON 503s naming the limit (quickly, no timeouts), the rest 200.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from clarifier.core.config import ServeConfig
from support.adapters import untrained_adapter
from support.metrics import metric_value

pytestmark = pytest.mark.integration

NAME = "lifecycle-clarifier"
HISTORY = [{"role": "user", "text": "I have a router and a modem."},
           {"role": "assistant", "text": "Which one is acting up?"}]


@pytest.fixture(scope="module")
def registered(tiny_model_dir, mlflow_server, tmp_path_factory):
    """Two registered versions of NAME; champion -> version 1."""
    import mlflow

    from clarifier.registry.registry import register_adapter

    root = tmp_path_factory.mktemp("lifecycle")
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("serving-lifecycle")
    versions = []
    for i in (1, 2):
        # threshold 1.0: every request takes the fast path (decision pass only) -- quick answers
        folder = untrained_adapter(tiny_model_dir, root / f"adapter-v{i}", seed=i, threshold=1.0)
        with mlflow.start_run(run_name=f"v{i}") as run:
            mlflow.log_artifacts(str(folder), "adapter")
        mv = register_adapter(run.info.run_id, NAME, alias="champion" if i == 1 else None, tracking_uri=mlflow_server)
        versions.append(str(mv.version))
    return versions


@pytest.fixture(scope="module")
def ray_serve(tmp_path_factory):
    from support.ray import start_ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLARIFIER_CACHE", str(tmp_path_factory.mktemp("cache")))  # forwarded to the replicas
        with start_ray(4):
            yield


@pytest.mark.timeout(420)
def test_alias_switch_without_failed_requests(registered, mlflow_server, ray_serve, port):
    from clarifier.registry.registry import set_alias
    from clarifier.serving.app import run_local

    v1, v2 = (f"{NAME}/{v}" for v in registered)
    cfg = ServeConfig(model_uri=f"models:/{NAME}@champion", port=port, model_refresh_s=0.5,
                      cpus_per_replica=0.5, max_new_tokens=4)
    url = run_local(cfg, tracking_uri=mlflow_server, ready_timeout_s=180)
    assert httpx.get(f"{url}/readyz", timeout=30).json()["model_version"] == v1

    stop = threading.Event()
    results: dict[int, list] = {0: [], 1: []}

    def client(i: int):
        with httpx.Client(timeout=60) as http:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    r = http.post(f"{url}/v1/clarify", json={"history": HISTORY, "query": f"how do I reset it? {i}.{n}"})
                    results[i].append((r.status_code, r.json().get("model_version") if r.status_code == 200 else r.text))
                except Exception as exc:  # a timeout or a dropped connection is a failure too
                    results[i].append((None, repr(exc)))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in results]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while sum(len(r) for r in results.values()) < 10:
            assert time.monotonic() < deadline, "no answers before the switch"
            time.sleep(0.1)
        set_alias(NAME, "champion", registered[1], tracking_uri=mlflow_server)
        deadline = time.monotonic() + 180
        while not all(any(v == v2 for _, v in r) for r in results.values()):
            assert time.monotonic() < deadline, "clients never saw the new version"
            time.sleep(0.2)
        seen = {i: len(r) for i, r in results.items()}
        deadline = time.monotonic() + 60
        while not all(len(results[i]) >= seen[i] + 5 for i in results):  # some answers after the switch
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(90)

    failures = [x for r in results.values() for x in r if x[0] != 200]
    assert not failures, failures[:5]
    for i, r in results.items():
        versions = [v for _, v in r]
        assert set(versions) == {v1, v2}, set(versions)
        first_v2 = versions.index(v2)
        assert all(v == v1 for v in versions[:first_v2]) and all(v == v2 for v in versions[first_v2:]), \
            f"client {i} saw {versions}"
    assert httpx.get(f"{url}/readyz", timeout=30).json()["model_version"] == v2


@pytest.mark.timeout(420)
def test_overload_gives_503_naming_the_limit_not_timeouts(tiny_model_dir, tmp_path, ray_serve, port):
    from clarifier.serving.app import run_local

    # threshold 0 and a long generation: every request holds the single model slot for a while
    folder = untrained_adapter(tiny_model_dir, tmp_path / "slow-adapter", seed=3, threshold=0.0)
    cfg = ServeConfig(model_uri=str(folder), port=port, max_new_tokens=160, max_ongoing_requests=1,
                      max_batch_size=1, max_queued_requests=1, cpus_per_replica=0.5)
    url = run_local(cfg, ready_timeout_s=180)

    def post(i):
        try:
            return httpx.post(f"{url}/v1/clarify", json={"history": HISTORY, "query": f"reset it? {i}"}, timeout=180)
        except httpx.HTTPError as exc:  # a timeout would be the failure this test is about
            return exc

    with ThreadPoolExecutor(12) as pool:
        out = list(pool.map(post, range(12)))
    errors = [r for r in out if not isinstance(r, httpx.Response)]
    assert not errors, errors
    codes = [r.status_code for r in out]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) >= 1 and codes.count(200) >= 1, codes
    for r in out:
        if r.status_code == 503:
            d = r.json()["detail"]
            assert d["error"] == "overloaded" and d["limit"] == "max_queued_requests" and d["max"] == 1, d
            assert r.headers.get("retry-after") == "1"
    # the ingress counted them
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric_value(metrics, "clarifier_rejected_total", reason="backpressure") >= 1
    assert metric_value(metrics, "clarifier_requests_total", route="clarify", status="503") >= 1


@pytest.mark.timeout(420)
def test_default_queue_policy_sheds_by_the_latency_budget(tiny_model_dir, tmp_path, ray_serve, port):
    """serve.max_queued_requests left at null: after the ingress has measured the model side's
    throughput, a burst beyond what it answers within serve.latency_budget_s gets fast JSON 503s
    naming latency_budget_s with a Retry-After; what is admitted is answered (200), nothing times out."""
    from clarifier.serving.app import run_local

    folder = untrained_adapter(tiny_model_dir, tmp_path / "budget-adapter", seed=4, threshold=0.0)
    cfg = ServeConfig(model_uri=str(folder), port=port, max_new_tokens=64, max_ongoing_requests=1,
                      max_batch_size=1, cpus_per_replica=0.5, latency_budget_s=0.5)
    assert cfg.max_queued_requests is None  # the default: admission from the latency budget
    url = run_local(cfg, ready_timeout_s=180)

    def post(i):
        try:
            return httpx.post(f"{url}/v1/clarify", json={"history": HISTORY, "query": f"reset it? {i}"}, timeout=180)
        except httpx.HTTPError as exc:
            return exc

    warm = [post(i) for i in range(34)]  # one at a time (always admitted): the ingress measures the rate
    assert [getattr(r, "status_code", None) for r in warm] == [200] * 34, warm
    with ThreadPoolExecutor(40) as pool:  # then a burst of 40 at once
        out = list(pool.map(post, range(40, 80)))
    errors = [r for r in out if not isinstance(r, httpx.Response)]
    assert not errors, errors
    codes = [r.status_code for r in out]
    assert set(codes) <= {200, 503} and codes.count(503) >= 20 and codes.count(200) >= 1, codes
    for r in out:
        if r.status_code == 503:
            d = r.json()["detail"]
            assert d["error"] == "overloaded" and d["limit"] == "latency_budget_s" and d["max"] == 0.5, d
            assert int(r.headers["retry-after"]) >= 1 and d["admitted_at_once"] >= 1
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric_value(metrics, "clarifier_rejected_total", reason="latency_budget") >= 1
    assert "clarifier_measured_throughput" in metrics and "clarifier_admission_limit" in metrics
