"""ClarifierClient without a server: closed ports, retry counting, error details.

Clients get a recording ``sleep``: the waits between attempts are asserted, never waited for.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from clarifier.client import ClarifierAPIError, ClarifierClient, ClarifierConnectionError


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # released on exit: nothing listens there


def test_closed_port_raises_after_retries():
    slept = []
    c = ClarifierClient(f"http://127.0.0.1:{_closed_port()}", retries=2, backoff=0.05, timeout=2, sleep=slept.append)
    with pytest.raises(ClarifierConnectionError, match="after 3 attempt") as ei:
        c.clarify([], "hello?")
    assert isinstance(ei.value.__cause__, httpx.ConnectError)
    assert slept == [0.05, 0.1]  # backoff * 2**attempt, and no wait after the last attempt
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
    slept = []
    c = ClarifierClient("http://clarifier.test/prefix", api_key="k", retries=3, backoff=0.001, transport=transport,
                        sleep=slept.append)
    r = c.clarify([{"role": "user", "text": "hi"}], "and it?")
    assert r.model_version == "m/1" and len(calls) == 3 and slept == [0.001, 0.002]
    assert calls[-1].url.path == "/prefix/v1/clarify"
    assert calls[-1].headers["authorization"] == "Bearer k"


def test_gives_up_after_retries_with_status():
    transport, calls = _mock([httpx.Response(503, json={"detail": "busy"})])
    slept = []
    c = ClarifierClient("http://clarifier.test", retries=2, backoff=0.001, transport=transport, sleep=slept.append)
    with pytest.raises(ClarifierAPIError) as ei:
        c.clarify([], "q")
    assert ei.value.status == 503 and ei.value.detail == "busy" and len(calls) == 3
    assert slept == [0.001, 0.002]


def test_4xx_is_not_retried_and_carries_detail():
    detail = {"limit": "max_chars", "value": 9, "max": 5}
    transport, calls = _mock([httpx.Response(413, json={"detail": detail})])
    slept = []
    c = ClarifierClient("http://clarifier.test", retries=3, backoff=0.001, transport=transport, sleep=slept.append)
    with pytest.raises(ClarifierAPIError) as ei:
        c.clarify([], "q")
    assert ei.value.status == 413 and ei.value.detail == detail and len(calls) == 1 and slept == []


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


def test_503_retry_honours_retry_after():
    slept = []
    overloaded = httpx.Response(503, headers={"Retry-After": "2"}, json={"detail": {"limit": "max_queued_requests"}})
    transport, calls = _mock([overloaded, httpx.Response(200, json=OK)])
    c = ClarifierClient("http://clarifier.test", retries=2, backoff=0.001, transport=transport, sleep=slept.append)
    assert c.clarify([], "q").model_version == "m/1"
    assert slept == [2.0] and len(calls) == 2


def test_retry_after_is_capped_ignored_as_a_date_and_never_shortens_the_backoff():
    slept = []
    answers = [httpx.Response(503, headers={"Retry-After": "3600"}),
               httpx.Response(504, headers={"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}),
               httpx.Response(502, headers={"Retry-After": "0"}), httpx.Response(200, json=OK)]
    transport, calls = _mock(answers)
    c = ClarifierClient("http://clarifier.test", retries=3, backoff=1.0, transport=transport, sleep=slept.append)
    assert c.clarify([], "q").model_version == "m/1"
    assert slept == [30.0, 2.0, 4.0] and len(calls) == 4


def test_connect_errors_and_retryable_answers_share_the_attempts():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 2:
            return httpx.Response(503)
        raise httpx.ConnectError("refused", request=request)

    slept = []
    c = ClarifierClient("http://clarifier.test", retries=2, backoff=0.5, transport=httpx.MockTransport(handler),
                        sleep=slept.append)
    with pytest.raises(ClarifierConnectionError, match="after 3 attempt"):
        c.clarify([], "q")
    assert len(calls) == 3 and slept == [0.5, 1.0]


def test_other_transport_errors_are_not_retried():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    slept = []
    c = ClarifierClient("http://clarifier.test", retries=3, transport=httpx.MockTransport(handler), sleep=slept.append)
    with pytest.raises(httpx.ReadTimeout):
        c.clarify([], "q")
    assert slept == []
