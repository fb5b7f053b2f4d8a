"""ClarifierClient without a server: closed ports, retry counting, error details."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from clarifier.client import ClarifierAPIError, ClarifierClient, ClarifierConnectionError


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # released on exit: nothing listens there


def test_closed_port_raises_after_retries_quickly():
    c = ClarifierClient(f"http://127.0.0.1:{_closed_port()}", retries=2, backoff=0.05, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(ClarifierConnectionError, match="after 3 attempt"):
        c.clarify([], "hello?")
    assert time.monotonic() - t0 < 5  # 0.05 + 0.1 s of backoff plus refused connects
    assert c.ready() is False


def _mock(responses):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return responses[min(len(calls), len(responses)) - 1]

    return httpx.MockTransport(handler), calls


OK = {"needs_clarification": False, "confidence": 0.1, "model_version": "m/1"}


def test_retries_on_503_then_succeeds_and_sends_api_key():
    transport, calls = _mock([httpx.Response(503), httpx.Response(502), httpx.Response(200, json=OK)])
    c = ClarifierClient("http://clarifier.test/prefix", api_key="k", retries=3, backoff=0.001, transport=transport)
    r = c.clarify([{"role": "user", "text": "hi"}], "and it?")
    assert r.model_version == "m/1" and len(calls) == 3
    assert calls[-1].url.path == "/prefix/v1/clarify"
    assert calls[-1].headers["authorization"] == "Bearer k"


def test_gives_up_after_retries_with_status():
    transport, calls = _mock([httpx.Response(503, json={"detail": "busy"})])
    c = ClarifierClient("http://clarifier.test", retries=2, backoff=0.001, transport=transport)
    with pytest.raises(ClarifierAPIError) as ei:
        c.clarify([], "q")
    assert ei.value.status == 503 and ei.value.detail == "busy" and len(calls) == 3


def test_4xx_is_not_retried_and_carries_detail():
    detail = {"limit": "max_chars", "value": 9, "max": 5}
    transport, calls = _mock([httpx.Response(413, json={"detail": detail})])
    c = ClarifierClient("http://clarifier.test", retries=3, backoff=0.001, transport=transport)
    with pytest.raises(ClarifierAPIError) as ei:
        c.clarify([], "q")
    assert ei.value.status == 413 and ei.value.detail == detail and len(calls) == 1


def test_rejects_non_mapping_turns():
    c = ClarifierClient("http://clarifier.test", transport=_mock([httpx.Response(200, json=OK)])[0])
    with pytest.raises(TypeError):
        c.clarify(["just text"], "q")


def test_batch_posts_a_list_and_parses_answers_in_order():
    transport, calls = _mock([httpx.Response(200, json=[OK, {**OK, "model_version": "m/2"}])])
    c = ClarifierClient("http://clarifier.test", transport=transport)
    out = c.clarify_batch([{"query": "a?"}, {"history": [{"role": "user", "text": "x"}], "query": "b?"}])
    assert [r.model_version for r in out] == ["m/1", "m/2"]
    import json

    assert calls[0].url.path == "/v1/clarify/batch"
    assert json.loads(calls[0].content)[1]["query"] == "b?"


def test_x_api_key_header_and_env_default(monkeypatch):
    transport, calls = _mock([httpx.Response(200, json=OK)])
    ClarifierClient("http://clarifier.test", api_key="k2", api_key_header="X-API-Key", transport=transport).clarify([], "q")
    assert calls[-1].headers["x-api-key"] == "k2" and "authorization" not in calls[-1].headers
    monkeypatch.setenv("CLARIFIER_API_KEY", "from-env")
    ClarifierClient("http://clarifier.test", transport=transport).clarify([], "q")
    assert calls[-1].headers["authorization"] == "Bearer from-env"
    with pytest.raises(ValueError, match="api_key_header"):
        ClarifierClient("http://clarifier.test", api_key_header="cookie")


def test_401_is_not_retried():
    transport, calls = _mock([httpx.Response(401, json={"detail": {"error": "unauthorized"}})])
    c = ClarifierClient("http://clarifier.test", api_key="bad", retries=3, backoff=0.001, transport=transport)
    with pytest.raises(ClarifierAPIError) as ei:
        c.clarify([], "q")
    assert ei.value.status == 401 and len(calls) == 1


def test_503_retry_honours_retry_after(monkeypatch):
    import clarifier.client as client_mod

    slept = []
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: slept.append(s))
    overloaded = httpx.Response(503, headers={"Retry-After": "2"}, json={"detail": {"limit": "max_queued_requests"}})
    transport, calls = _mock([overloaded, httpx.Response(200, json=OK)])
    c = ClarifierClient("http://clarifier.test", retries=2, backoff=0.001, transport=transport)
    assert c.clarify([], "q").model_version == "m/1"
    assert slept == [2.0] and len(calls) == 2
