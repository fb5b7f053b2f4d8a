"""Ray Serve application end to end: a tiny model + LoRA adapter served locally over HTTP.

The adapter's threshold is 0 so every request takes the generation path; the tiny random model
writes noise, which the decoding constraint keeps to a target that parses (the malformed-output
fallback, valid_output=False, is covered without Ray in tests/unit/test_prompt_injection.py).
The server requires an API key (two keys configured through $CLARIFIER_API_KEYS). What needs no
Ray (deploy configs, app_builder's arguments, Serve options) is tests/unit/test_serving_config.py.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from clarifier.core.config import ServeConfig
from clarifier.core.schema import ClarifyResponse
from clarifier.runtime.services import free_port

pytestmark = pytest.mark.integration

MAX_HISTORY = 5
MAX_CHARS = 3000
MAX_BATCH = 4
KEY, OTHER_KEY = "test-key-4f9a0c", "second-key-77b1"
AUTH = {"Authorization": f"Bearer {KEY}"}
RAY_METRICS: dict = {}  # Ray's Prometheus endpoint of the test cluster (port set by the fixture)

HISTORY = [
    {"role": "user", "text": "I have a checking account and a savings account."},
    {"role": "assistant", "text": "Got it, how can I help with them?"},
]
PASSAGES = [{"id": "p1", "text": "To close an account, visit the branch."}, {"id": "p2", "text": "Savings accounts earn interest."}]


@pytest.fixture(scope="module")
def model_folder(tiny_model_dir, tmp_path_factory) -> Path:
    from support.adapters import untrained_adapter

    return untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("serving") / "adapter", threshold=0.0)


@pytest.fixture(scope="module")
def server(model_folder):
    from clarifier.serving.app import run_local
    from support.ray import start_ray

    RAY_METRICS["port"] = free_port()
    with pytest.MonkeyPatch.context() as mp, start_ray(4, _metrics_export_port=RAY_METRICS["port"]):
        mp.setenv("CLARIFIER_API_KEYS", f"{KEY}, {OTHER_KEY}")  # read by build_app, in this process
        cfg = ServeConfig(model_uri=str(model_folder), port=free_port(), max_new_tokens=12,
                          max_history_turns=MAX_HISTORY, max_chars=MAX_CHARS, max_batch_size=8,
                          batch_wait_timeout_s=0.05, max_batch_requests=MAX_BATCH, cpus_per_replica=0.5)
        yield run_local(cfg, ready_timeout_s=120)


def _post(url, body, timeout=60, headers=AUTH, path="/v1/clarify"):
    return httpx.post(f"{url}{path}", json=body, timeout=timeout, headers=headers)


@pytest.mark.timeout(300)
def test_clarify_returns_full_response(server, model_folder):
    r = _post(server, {"history": HISTORY, "query": "how do I close it?", "passages": PASSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == set(ClarifyResponse.model_fields)
    resp = ClarifyResponse.model_validate(body)
    assert resp.model_version == str(model_folder)
    assert isinstance(resp.needs_clarification, bool)
    assert 0.0 <= resp.confidence <= 1.0
    if not resp.valid_output:  # an output that did not parse -> fallback, never an error
        assert resp.needs_clarification is False and resp.question is None
    else:
        assert resp.needs_clarification is True and resp.question


@pytest.mark.timeout(300)
def test_invalid_bodies_are_422_naming_the_field(server):
    r = _post(server, {"history": HISTORY})
    assert r.status_code == 422
    assert any(e["loc"][-1] == "query" for e in r.json()["detail"]), r.text
    r = _post(server, {"query": "x", "history": [{"role": "robot", "text": "hi"}]})
    assert r.status_code == 422 and "role" in r.text
    r = _post(server, {"query": "x", "unexpected": 1})
    assert r.status_code == 422 and "unexpected" in r.text


@pytest.mark.timeout(300)
def test_limits_are_413_naming_the_limit(server):
    turns = [{"role": "user", "text": f"turn {i}"} for i in range(MAX_HISTORY + 1)]
    r = _post(server, {"history": turns, "query": "which one?"})
    assert r.status_code == 413, r.text
    d = r.json()["detail"]
    assert d["limit"] == "max_history_turns" and d["value"] == MAX_HISTORY + 1 and d["max"] == MAX_HISTORY
    r = _post(server, {"query": "why?", "passages": [{"id": "p", "text": "x" * MAX_CHARS}]})
    assert r.status_code == 413
    d = r.json()["detail"]
    assert d["limit"] == "max_chars" and d["value"] == MAX_CHARS + 4


@pytest.mark.timeout(300)
def test_health_ready_and_docs(server, model_folder):
    assert httpx.get(f"{server}/healthz").status_code == 200
    r = httpx.get(f"{server}/readyz", timeout=30)
    assert r.status_code == 200 and r.json()["model_version"] == str(model_folder)
    spec = httpx.get(f"{server}/openapi.json").json()
    assert "/v1/clarify" in spec["paths"] and "post" in spec["paths"]["/v1/clarify"]
    assert httpx.get(f"{server}/docs").status_code == 200


@pytest.mark.timeout(300)
def test_concurrent_requests_are_batched_and_all_succeed(server):
    bodies = [{"history": HISTORY, "query": f"how do I close it? ({i})", "passages": PASSAGES} for i in range(8)]
    # Each request has its own 120 s timeout; no wall-clock bound on the whole burst (on a loaded
    # 2-core box that measures the box). What matters: all 8 at once are answered, each in full.
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: _post(server, b, timeout=120), bodies))
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results if r.status_code != 200]
    for r in results:
        ClarifyResponse.model_validate(r.json())


@pytest.mark.timeout(300)
def test_client_against_server(server, model_folder):
    from clarifier.client import ClarifierAPIError, ClarifierClient
    from clarifier.core.schema import Passage, Turn

    with ClarifierClient(server, api_key=KEY, timeout=60) as c:
        assert c.ready()
        assert c.model_version() == str(model_folder)
        resp = c.clarify([Turn(**HISTORY[0]), HISTORY[1]], "how do I close it?", [Passage(**PASSAGES[0])])
        assert isinstance(resp, ClarifyResponse) and resp.model_version == str(model_folder)
        with pytest.raises(ClarifierAPIError) as ei:
            c.clarify(HISTORY, "")
        assert ei.value.status == 422 and "query" in str(ei.value.detail)
        with pytest.raises(ClarifierAPIError) as ei:
            c.clarify([{"role": "user", "text": "t"}] * (MAX_HISTORY + 1), "which?")
        assert ei.value.status == 413 and ei.value.detail["limit"] == "max_history_turns"


@pytest.mark.timeout(300)
def test_engine_errors_are_500_without_internals_and_slow_model_is_not_ready(server):
    import asyncio

    from ray import serve

    from clarifier.serving.ingress import ClarifierIngress

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class BrokenModel:  # defined in the test so it is pickled by value
        async def clarify(self, request):
            raise RuntimeError("SECRET /internal/path exploded")

        async def version(self):
            await asyncio.sleep(5)
            return "never"

    app = ClarifierIngress.options(ray_actor_options={"num_cpus": 0}).bind(BrokenModel.bind(), ready_timeout_s=0.5)
    serve.run(app, name="broken", route_prefix="/broken")
    try:
        r = _post(server + "/broken", {"query": "close it"}, headers={})  # no keys given to this app
        assert r.status_code == 500
        assert "SECRET" not in r.text and "Traceback" not in r.text and "RuntimeError" not in r.text
        assert r.json()["detail"]["error"] == "internal error"
        assert httpx.get(f"{server}/broken/healthz").status_code == 200
        assert httpx.get(f"{server}/broken/readyz", timeout=30).status_code == 503
        assert httpx.get(f"{server}/readyz", timeout=30).status_code == 200  # the real app is unaffected
    finally:
        serve.delete("broken")


# ---- API keys, batch endpoint, metrics ------------------------------------------------------------


@pytest.mark.timeout(300)
def test_api_keys_are_required_and_never_echoed(server):
    body = {"history": HISTORY, "query": "how do I close it?"}
    r = _post(server, body, headers={})
    assert r.status_code == 401 and r.json()["detail"]["error"] == "unauthorized"
    assert "missing API key" in r.json()["detail"]["message"] and r.headers["www-authenticate"] == "Bearer"
    wrong = "wrong-" + KEY
    for headers in ({"Authorization": f"Bearer {wrong}"}, {"X-API-Key": wrong}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY[:-1]}"}):
        r = _post(server, body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert wrong not in r.text and KEY not in r.text
    # auth comes before body validation: an unauthenticated bad body learns nothing about the schema
    r = _post(server, {"unexpected": 1}, headers={"X-API-Key": wrong})
    assert r.status_code == 401 and "unexpected" not in r.text
    for headers in (AUTH, {"X-API-Key": KEY}, {"Authorization": f"bearer {OTHER_KEY}"}):
        r = _post(server, body, headers=headers)
        assert r.status_code == 200, (headers, r.text)
        assert KEY not in r.text and OTHER_KEY not in r.text
    r = _post(server, [body], headers={}, path="/v1/clarify/batch")
    assert r.status_code == 401
    assert httpx.get(f"{server}/metrics").status_code == 401
    assert httpx.get(f"{server}/healthz").status_code == 200  # probes stay open
    assert httpx.get(f"{server}/readyz", timeout=30).status_code == 200


@pytest.mark.timeout(300)
def test_batch_endpoint(server, model_folder):
    bodies = [{"history": HISTORY, "query": "how do I close it?", "passages": PASSAGES},
              {"query": "what is the weather like?"},
              {"history": HISTORY[:1], "query": "and the other one?"}]
    r = _post(server, bodies, path="/v1/clarify/batch", timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 3
    for item in out:
        assert set(item) == set(ClarifyResponse.model_fields)
        assert ClarifyResponse.model_validate(item).model_version == str(model_folder)
    # same answers as one by one (greedy decoding, same engine): order is kept
    single = _post(server, bodies[1]).json()
    assert out[1]["confidence"] == pytest.approx(single["confidence"], abs=1e-4)

    r = _post(server, [{"query": "q"}] * (MAX_BATCH + 1), path="/v1/clarify/batch")
    assert r.status_code == 413
    d = r.json()["detail"]
    assert (d["limit"], d["max"], d["value"]) == ("max_batch_requests", MAX_BATCH, MAX_BATCH + 1)
    too_long = [{"query": "ok"}, {"query": "q", "history": [{"role": "user", "text": "t"}] * (MAX_HISTORY + 1)}]
    r = _post(server, too_long, path="/v1/clarify/batch")
    assert r.status_code == 413
    d = r.json()["detail"]
    assert d["limit"] == "max_history_turns" and d["index"] == 1 and "requests[1]" in d["message"]
    r = _post(server, [{"query": "ok"}, {"history": []}], path="/v1/clarify/batch")
    assert r.status_code == 422
    assert any(e["loc"][-2:] == [1, "query"] for e in r.json()["detail"]), r.text
    r = _post(server, [], path="/v1/clarify/batch")
    assert r.status_code == 422 and "empty" in r.text
    r = _post(server, {"query": "not a list"}, path="/v1/clarify/batch")
    assert r.status_code == 422


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (the model label is left out here)."""
    return sum(v for (n, have), v in samples.items() if n == name and set(labels.items()) <= set(have))


@pytest.mark.timeout(300)
def test_metrics_counters_move(server):
    before = _samples(httpx.get(f"{server}/metrics", headers=AUTH).text)
    r = _post(server, {"history": HISTORY, "query": "how do I close it?"})
    assert r.status_code == 200
    body = r.json()
    assert _post(server, [{"query": "a?"}, {"query": "b?"}], path="/v1/clarify/batch").status_code == 200
    assert _post(server, {"query": "x"}, headers={}).status_code == 401
    assert _post(server, {"query": ""}).status_code == 422
    r = httpx.get(f"{server}/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = _samples(r.text)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("clarifier_requests_total", route="clarify", status="200") == 1
    assert delta("clarifier_requests_total", route="clarify_batch", status="200") == 1
    assert delta("clarifier_requests_total", route="clarify", status="401") == 1
    assert delta("clarifier_requests_total", route="clarify", status="422") == 1
    assert delta("clarifier_rejected_total", reason="auth") == 1
    assert delta("clarifier_request_latency_seconds_count", route="clarify") == 3
    decisions = delta("clarifier_decisions_total", decision="clarify") + delta("clarifier_decisions_total", decision="answer")
    paths = delta("clarifier_path_total", path="fast") + delta("clarifier_path_total", path="generate")
    assert decisions == 3 and paths == 3
    # threshold 0: every answer took the generation path; an output that did not parse is counted
    assert delta("clarifier_path_total", path="generate") == 3
    if not body["valid_output"]:
        assert delta("clarifier_invalid_outputs_total") >= 1


@pytest.mark.timeout(300)
def test_client_batch_and_auth(server, model_folder):
    from clarifier.client import ClarifierAPIError, ClarifierClient

    with ClarifierClient(server, api_key=KEY, timeout=60) as c:
        out = c.clarify_batch([{"history": HISTORY, "query": "close it?"}, {"query": "hello?"}])
        assert [r.model_version for r in out] == [str(model_folder)] * 2
    with ClarifierClient(server, api_key="nope", timeout=60) as c:
        with pytest.raises(ClarifierAPIError) as ei:
            c.clarify([], "hello?")
        assert ei.value.status == 401 and "nope" not in str(ei.value)
    with ClarifierClient(server, api_key=KEY, api_key_header="x-api-key", timeout=60) as c:
        assert c.clarify([], "hello?").model_version == str(model_folder)


@pytest.mark.timeout(300)
def test_ray_metrics_endpoint_exports_clarifier_metrics(server):
    """The cluster-wide view: Ray's metrics agent exports both deployments' clarifier_* metrics."""
    assert _post(server, [{"query": "a?"}, {"query": "b?"}], path="/v1/clarify/batch").status_code == 200
    want = {"ray_clarifier_requests_total": "ClarifierIngress", "ray_clarifier_decisions_total": "ClarifierIngress",
            "ray_clarifier_batch_size_count": "ClarifierModel", "ray_clarifier_model_info": "ClarifierModel"}
    deadline = time.monotonic() + 120
    found: dict = {}
    while True:
        try:
            text = httpx.get(f"http://127.0.0.1:{RAY_METRICS['port']}/metrics", timeout=10).text
        except httpx.HTTPError:
            text = ""
        found = {}
        for (name, labels), value in _samples(text).items():
            if name in want and dict(labels).get("deployment") == want[name] and value > 0:
                found[name] = dict(labels)
        if set(found) == set(want) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert set(found) == set(want), f"missing from Ray's metrics endpoint: {sorted(set(want) - set(found))}"
    assert found["ray_clarifier_model_info"]["version"]
