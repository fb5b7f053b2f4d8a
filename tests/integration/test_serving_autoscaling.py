"""Autoscaling from config: under sustained load the ClarifierModel deployment grows from 1 to 2
replicas (read from ``serve.status()``), and shrinks back to 1 once the load stops. Tiny model,
small delays; every request still succeeds. Marked ``slow`` (a minute or two on 2 cores)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from clarifier.core.config import ServeConfig
from clarifier.runtime.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def running_replicas(app: str, deployment: str = "ClarifierModel") -> int:
    from ray import serve

    status = serve.status().applications[app].deployments[deployment]
    return sum(n for state, n in status.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")


def wait_for(pred, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


@pytest.mark.timeout(600)
def test_replicas_scale_up_under_load_and_back_down(tiny_model_dir, tmp_path):
    from clarifier.serving.app import APP_NAME, run_local
    from support.adapters import untrained_adapter
    from support.ray import start_ray

    folder = untrained_adapter(tiny_model_dir, tmp_path / "adapter", seed=5, threshold=0.0)  # generation path: slow-ish
    cfg = ServeConfig.model_validate({
        "model_uri": str(folder), "port": free_port(), "max_new_tokens": 48, "cpus_per_replica": 0.5,
        "max_ongoing_requests": 2, "max_batch_size": 2, "max_queued_requests": -1,
        "autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                        "upscale_delay_s": 1, "downscale_delay_s": 4, "look_back_period_s": 2,
                        "metrics_interval_s": 0.5},
    })
    stop = threading.Event()
    codes: list = []
    with start_ray(4):
        try:
            url = run_local(cfg, ready_timeout_s=180)
            assert running_replicas(APP_NAME) == 1

            def client(i):
                with httpx.Client(timeout=120) as http:
                    while not stop.is_set():
                        try:
                            codes.append(http.post(f"{url}/v1/clarify", json={"query": f"which one? {i}"}).status_code)
                        except httpx.HTTPError as exc:
                            codes.append(repr(exc))

            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(6)]
            for t in threads:
                t.start()
            wait_for(lambda: running_replicas(APP_NAME) == 2, 240, "a second ClarifierModel replica under load")
            stop.set()
            for t in threads:
                t.join(120)
            wait_for(lambda: running_replicas(APP_NAME) == 1, 240, "scale-down to 1 replica after the load")
            assert codes and all(c == 200 for c in codes), [c for c in codes if c != 200][:5]
        finally:
            stop.set()
