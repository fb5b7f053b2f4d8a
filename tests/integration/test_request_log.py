"""The request log (``serve.request_log``) on a real local Ray Serve deployment writing to a loopback S3
(moto's server, stopped and restarted by the test), with a tiny model:

* under load, through a store outage and a clean shutdown, every answered request is in the log once,
  each record a parseable conversation log, answers never fail while the store is down;
* the ingress replica SIGKILLed under load: the records it held are lost, at most the documented bound
  (its open shard: ``shard_records`` records / ``shard_age_s`` seconds), the rest are there.

Both record what happened with the ``reliability`` fixture.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import threading
import time

import httpx
import pytest

from clarifier.core.config import ServeConfig
from clarifier.core.schema import ConversationLog
from clarifier.runtime.services import free_port
from support.adapters import untrained_adapter
from support.metrics import metric_value

pytestmark = [pytest.mark.integration, pytest.mark.reliability, pytest.mark.slow]

HISTORY = [{"role": "user", "text": "I have a router and a modem."}, {"role": "assistant", "text": "OK."}]
INGRESS_CLASS = "ServeReplica:clarifier:ClarifierIngress"
BUCKET = "reqlog"


@pytest.fixture(scope="module")
def own_s3():
    """A moto S3 server of this module's own, which the test stops and restarts on the same port."""
    from support.s3 import RestartableS3

    s3 = RestartableS3()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3.env(CLARIFIER_S3_MAX_ATTEMPTS="2").items():
            mp.setenv(k, v)
        mp.delenv("CLARIFIER_API_KEYS", raising=False)
        _s3(s3.url).create_bucket(Bucket=BUCKET)
        yield {"url": s3.url, "stop": s3.stop, "start": s3.start}
        s3.stop()


def _s3(url: str):
    import boto3

    return boto3.client("s3", endpoint_url=url)


@pytest.fixture(scope="module")
def ray_serve(own_s3):
    """Started after the S3 endpoint is in the environment: the replicas inherit it."""
    from support.ray import start_ray

    with start_ray(4, dashboard=True, dashboard_port=free_port()) as ray:
        yield ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("reqlog") / "adapter", threshold=1.0)


def stored(url: str, prefix: str) -> list[dict]:
    """Every record under ``s3://reqlog/<prefix>`` (gzip JSONL shards), each checked as a ConversationLog."""
    s3 = _s3(url)
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            assert obj["Key"].endswith(".jsonl.gz"), obj["Key"]
            data = gzip.decompress(s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read())
            for line in data.decode().splitlines():
                rec = json.loads(line)
                ConversationLog.model_validate(rec)
                out.append(rec)
    return out


def metric(url: str, name: str, **labels) -> float:
    return metric_value(httpx.get(f"{url}/metrics", timeout=30).text, name, **labels)


class Load:
    """``n`` threads sending /v1/clarify (a unique conversation id each), batches and chat completions."""

    def __init__(self, url: str, threads: int = 4):
        self.url, self.lock, self.stop = url, threading.Lock(), threading.Event()
        self.answered: list[tuple[float, str]] = []  # (monotonic time answered, conversation id)
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        from clarifier.client import ClarifierClient

        with ClarifierClient(self.url, timeout=60, retries=5, backoff=0.2) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                ids = [f"t{i}-{n}"]
                try:
                    if n % 10 == 0:
                        ids = [f"t{i}-{n}-b{k}" for k in range(3)]
                        c.clarify_batch([{"history": HISTORY, "query": "and now?", "conversation_id": cid}
                                         for cid in ids])
                    elif n % 10 == 5:
                        c.chat_completions([{"role": "user", "content": "reset it"}],
                                           metadata={"conversation_id": ids[0]})
                    else:
                        c.clarify(HISTORY, f"how do I reset it? {n}", conversation_id=ids[0])
                except Exception as exc:
                    with self.lock:
                        self.failed.append(f"{type(exc).__name__}: {exc}")
                    continue
                with self.lock:
                    self.answered.extend((time.monotonic(), cid) for cid in ids)

    def wait_for(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answered) < n:
            assert time.monotonic() < deadline, f"only {len(self.answered)} answers"
            time.sleep(0.05)

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def ids_of(records: list[dict]) -> list[str]:
    return [r["conversation_id"] for r in records]


@pytest.mark.timeout(600)
def test_every_answer_is_logged_through_a_store_outage_and_a_clean_shutdown(own_s3, ray_serve, port, adapter, reliability):
    from ray import serve

    from clarifier.serving.app import run_local

    url_s3 = own_s3["url"]
    cfg = ServeConfig(model_uri=str(adapter), port=port, cpus_per_replica=0.5, max_new_tokens=4,
                      request_log={"uri": f"s3://{BUCKET}/outage", "shard_records": 25, "shard_age_s": 1})
    url = run_local(cfg, ready_timeout_s=240)
    load = Load(url)
    try:
        load.wait_for(150)
        time.sleep(2.5)  # shards older than shard_age_s are in the store
        before = stored(url_s3, "outage/")
        own_s3["stop"]()
        t_down = time.monotonic()
        n_down = len(load.answered)
        load.wait_for(n_down + 100)  # answers go on while the store is down
        time.sleep(3)
        buffered_while_down = metric(url, "clarifier_request_log_buffered")
        own_s3["start"]()
        t_up = time.monotonic()
        load.wait_for(len(load.answered) + 50)
    finally:
        load.end()
    answered_during = sum(1 for t, _ in load.answered if t_down <= t <= t_up)
    serve.delete("clarifier")  # graceful: the ingress's __del__ writes what it holds
    after = stored(url_s3, "outage/")
    logged = ids_of(after)
    answered = [cid for _, cid in load.answered]

    assert not load.failed, load.failed[:5]
    assert before and buffered_while_down > 0
    missing = sorted(set(answered) - set(logged))
    assert not missing, f"{len(missing)} answered requests not in the log: {missing[:5]}"
    assert len(logged) == len(set(logged)) == len(answered)
    routes = {r["meta"]["request_log"]["route"] for r in after}
    assert routes == {"clarify", "clarify_batch", "chat_completions"}
    assert all(r["turns"][-1]["meta"]["served"]["model_version"] for r in after)
    reliability(fault="request-log store (S3) down while serving",
                injected=f"S3 server (moto) stopped for {t_up - t_down:.0f} s under load (4 clients), then "
                         "restarted; then a graceful shutdown",
                at_risk=f"{answered_during} requests answered while the store was down "
                        f"({buffered_while_down:.0f} records buffered at the peak check); {len(answered)} in the test",
                lost=f"{len(missing)} records (0 requests failed)",
                recovered=f"{len(answered)} records, each once: buffered ones written when the store came back, "
                          "the last ones at shutdown",
                time_to_recover_s=None)


def _ingress_pid(gcs: str) -> tuple[str, int]:
    from ray.util.state import list_actors

    alive = [a for a in list_actors(address=gcs, filters=[("class_name", "=", INGRESS_CLASS), ("state", "=", "ALIVE")])]
    assert len(alive) == 1, alive
    return alive[0].actor_id, alive[0].pid


@pytest.mark.timeout(600)
def test_a_killed_ingress_loses_at_most_its_open_shard(own_s3, ray_serve, port, adapter, reliability):
    from ray import serve

    from clarifier.serving.app import run_local

    shard_records, shard_age_s = 20, 2.0
    cfg = ServeConfig(model_uri=str(adapter), port=port, cpus_per_replica=0.5, max_new_tokens=4,
                      request_log={"uri": f"s3://{BUCKET}/kill", "shard_records": shard_records,
                                   "shard_age_s": shard_age_s})
    url = run_local(cfg, ready_timeout_s=240)
    victim, pid = _ingress_pid(ray_serve)
    load = Load(url)
    try:
        load.wait_for(120)
        t_kill = time.monotonic()
        before_kill = {cid for t, cid in load.answered if t < t_kill}
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:  # a new ingress replica answers
            try:
                new = _ingress_pid(ray_serve)
                if new[0] != victim and httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except (AssertionError, httpx.HTTPError):
                pass
            assert time.monotonic() < deadline, "no new ingress replica after 180 s"
            time.sleep(0.5)
        t_back = time.monotonic()
        load.wait_for(len(load.answered) + 60)
    finally:
        load.end()
    serve.delete("clarifier")
    logged = set(ids_of(stored(own_s3["url"], "kill/")))
    lost = sorted(before_kill - logged)
    in_last_window = sum(1 for t, _ in load.answered if t_kill - shard_age_s - 1 <= t < t_kill)
    after_back = {cid for t, cid in load.answered if t > t_back + 0.5}
    print(f"\ningress SIGKILL: {len(before_kill)} answered before the kill, {len(lost)} of them not logged; "
          f"{in_last_window} answered in the last {shard_age_s + 1:.0f} s before it; back in {t_back - t_kill:.1f} s")
    reliability(fault="request-log writer (ingress replica) SIGKILLed under load",
                injected=f"SIGKILL to the ClarifierIngress replica (pid {pid}) with 4 clients sending; "
                         f"shard_records {shard_records}, shard_age_s {shard_age_s:g}",
                at_risk=f"{len(before_kill)} records of requests answered before the kill",
                lost=f"{len(lost)} records (bound: its open shard, <= {shard_records} records / "
                     f"{shard_age_s:g} s of traffic, here {in_last_window} answered in the last "
                     f"{shard_age_s + 1:g} s)",
                recovered=f"a new ingress replica logs every later request ({len(load.failed)} requests in flight "
                          "on the killed replica failed at the client)",
                time_to_recover_s=round(t_back - t_kill, 1))
    assert len(load.failed) <= 4, load.failed[:5]  # at most the requests in flight on the killed ingress
    # the documented bound: the open shard, plus a sealed one the store had not taken yet (written within
    # moments of sealing while the store is up); measured 0 and 20 in two runs
    assert len(lost) <= 2 * shard_records
    assert after_back <= logged, sorted(after_back - logged)[:5]


@pytest.mark.timeout(600)
def test_a_shadow_scores_requests_off_the_response_path(own_s3, ray_serve, port, adapter, tiny_model_dir,
                                                         tmp_path, reliability):
    """The champion never asks (threshold 1.0), the shadow always does (threshold 0.0): every shadowed request
    is a disagreement, answers are the champion's alone, the log holds both. The latency overhead is measured
    (sequential requests, one deployment without a shadow, then one with it), not asserted."""
    import statistics

    from ray import serve

    from clarifier.client import ClarifierClient
    from clarifier.serving.app import run_local

    challenger = untrained_adapter(tiny_model_dir, tmp_path / "challenger", threshold=0.0, seed=3)
    n = 40
    p50 = {}
    for label, shadow in (("without", None), ("with", str(challenger))):
        cfg = ServeConfig(model_uri=str(adapter), port=port, cpus_per_replica=0.5, max_new_tokens=4,
                          shadow_model_uri=shadow,
                          request_log={"uri": f"s3://{BUCKET}/shadow-{label}", "shard_records": 10, "shard_age_s": 1})
        url = run_local(cfg, ready_timeout_s=240)
        took = []
        with ClarifierClient(url, timeout=60) as c:
            for i in range(5):  # warm-up, not measured
                c.clarify(HISTORY, f"warm {i}")
            for i in range(n):
                t0 = time.perf_counter()
                r = c.clarify(HISTORY, f"how do I reset it? {i}", conversation_id=f"{label}-{i}")
                took.append(time.perf_counter() - t0)
                assert not r.needs_clarification and r.model_version == str(adapter)  # the champion's answer
        p50[label] = statistics.median(took)
        if shadow:
            deadline = time.monotonic() + 120
            while metric(url, "clarifier_shadow_total") < n + 5:  # the shadow answers arrive after the responses
                assert time.monotonic() < deadline, "shadow answers missing"
                time.sleep(0.5)
            disagree = metric(url, "clarifier_shadow_total", outcome="disagree")
        serve.delete("clarifier")
    records = stored(own_s3["url"], "shadow-with/")  # the n measured requests and the 5 warm-ups
    assert len(records) == n + 5
    for r in records:
        q = r["turns"][-1]["meta"]
        assert q["served"]["needs_clarification"] is False and q["served"]["model_version"] == str(adapter)
        assert "error" not in q["shadow"] and q["shadow"]["model_version"] == str(challenger)
    # the shadow generates (threshold 0.0); it asks whenever its untrained generation parses as a question
    assert disagree == sum(r["turns"][-1]["meta"]["shadow"]["needs_clarification"] for r in records)
    assert not any("shadow" in r["turns"][-1]["meta"] for r in stored(own_s3["url"], "shadow-without/"))
    ratio = p50["with"] / p50["without"]
    print(f"\nshadow: p50 {p50['without'] * 1000:.0f} ms without, {p50['with'] * 1000:.0f} ms with ({ratio:.2f}x)")
    reliability(fault="shadow model scoring every request (always generating, on the same 2 CPUs)",
                injected=f"serve.shadow_model_uri with shadow_share 1.0; {n} sequential requests with and without it",
                at_risk=f"{n} answers (latency, content)",
                lost=f"0 answers changed (all the champion's); {n + 5} shadow answers logged and counted",
                recovered=f"p50 latency {p50['without'] * 1000:.0f} ms without the shadow, {p50['with'] * 1000:.0f} ms "
                          f"with it ({ratio:.2f}x: the shadow runs after each response, on the same CPUs)",
                time_to_recover_s=None)
