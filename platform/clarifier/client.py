"""A small typed HTTP client for the Clarifier serving API.

    from clarifier.client import ClarifierClient

    with ClarifierClient("http://127.0.0.1:8000") as c:
        if c.ready():
            r = c.clarify([{"role": "user", "text": "I have a checking and a savings account"}],
                          "how do I close it?")
            print(r.needs_clarification, r.question)

Connect errors and 502/503/504 answers (503 is also what an overloaded server answers) are
retried ``retries`` times with exponential backoff (``backoff * 2**attempt`` seconds, or the
server's ``Retry-After`` when longer, capped at 30 s); other 4xx/5xx answers raise
:class:`ClarifierAPIError` carrying the server's ``detail`` (401: missing/wrong API key). Bodies are
not validated client-side, so the server's 422 (which names the bad field) is what you see.

The API key is sent as ``Authorization: Bearer <key>`` (or ``X-API-Key`` with
``api_key_header="x-api-key"``); it defaults to ``$CLARIFIER_API_KEY``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx
from pydantic import BaseModel

from clarifier.core.schema import ClarifyResponse, Passage, Turn
from clarifier.runtime.retry import RetryPolicy

RETRY_STATUS = frozenset({502, 503, 504})
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
MAX_RETRY_AFTER_S = 30.0


class ClarifierError(Exception):
    """Base class of client errors."""


class ClarifierAPIError(ClarifierError):
    """The server answered with an error status; ``detail`` is its ``detail`` (or body text)."""

    def __init__(self, status: int, detail: Any):
        self.status = status
        self.detail = detail
        super().__init__(f"Clarifier API error {status}: {detail}")


class ClarifierConnectionError(ClarifierError):
    """The server could not be reached (after the configured retries)."""


def _dump(item: Turn | Passage | Mapping[str, Any] | BaseModel) -> Any:
    if isinstance(item, BaseModel):
        return item.model_dump(mode="json")
    if isinstance(item, Mapping):
        return dict(item)
    raise TypeError(f"expected a Turn/Passage model or a mapping, got {type(item).__name__}")


def _retry_after(resp: httpx.Response) -> float:
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(resp.headers.get("retry-after", 0))))
    except ValueError:  # an HTTP date: not worth parsing here
        return 0.0


def _detail(resp: httpx.Response, key: str = "detail") -> Any:
    try:
        body = resp.json()
    except ValueError:
        return resp.text
    return body.get(key, body) if isinstance(body, dict) else body


def clarification_of(completion: Mapping[str, Any]) -> str | None:
    """The question in a chat-completions answer of the clarification contract; None for ``"CLEAR"``."""
    import json

    value = json.loads(completion["choices"][0]["message"]["content"])["clarification"]
    return None if value == "CLEAR" else value


class ClarifierClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 10.0,
                 retries: int = 3, backoff: float = 0.2, transport: httpx.BaseTransport | None = None,
                 api_key_header: str = "authorization", sleep: Callable[[float], Any] = time.sleep):
        if retries < 0:
            raise ValueError("retries must be >= 0")
        if api_key_header.lower() not in ("authorization", "x-api-key"):
            raise ValueError("api_key_header must be 'authorization' (Bearer) or 'x-api-key'")
        self.base_url = base_url.rstrip("/")
        self.retry = RetryPolicy(attempts=retries + 1, min_s=backoff, sleep=sleep)
        headers = {"Accept": "application/json"}
        api_key = api_key if api_key is not None else os.environ.get("CLARIFIER_API_KEY")
        if api_key:
            if api_key_header.lower() == "authorization":
                headers["Authorization"] = f"Bearer {api_key}"
            else:
                headers["X-API-Key"] = api_key
        self._http = httpx.Client(base_url=self.base_url + "/", timeout=timeout, headers=headers,
                                  transport=transport)

    # ---- plumbing -----------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        """Send with retries on connect errors and 502/503/504; return the final response."""
        try:
            return self.retry.call(lambda: self._http.request(method, path.lstrip("/"), **kw), on=CONNECT_ERRORS,
                                   result=lambda resp: resp.status_code in RETRY_STATUS, wait_at_least=_retry_after)
        except CONNECT_ERRORS as exc:  # raised only by the last attempt: the others were retried
            raise ClarifierConnectionError(
                f"cannot reach Clarifier at {self.base_url} after {self.retry.attempts} attempt(s): {exc}"
            ) from exc

    # ---- API ----------------------------------------------------------------------------------

    def clarify(self, history: Iterable[Turn | Mapping[str, Any]], query: str,
                passages: Iterable[Passage | Mapping[str, Any]] = (),
                conversation_id: str | None = None) -> ClarifyResponse:
        """``POST /v1/clarify``; raises ClarifierAPIError (e.g. 413, 422) with the server's detail.
        ``conversation_id`` groups a conversation's requests in the server's request log."""
        body = {"history": [_dump(t) for t in history], "query": query, "passages": [_dump(p) for p in passages]}
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        resp = self._request("POST", "/v1/clarify", json=body)
        if resp.status_code != 200:
            raise ClarifierAPIError(resp.status_code, _detail(resp))
        return ClarifyResponse.model_validate(resp.json())

    def clarify_batch(self, requests: Iterable[Mapping[str, Any] | BaseModel]) -> list[ClarifyResponse]:
        """``POST /v1/clarify/batch``: requests as ClarifyRequest models or mappings with ``history``,
        ``query``, ``passages``; answers in the same order (413 over ``max_batch_requests``)."""
        body = [_dump(r) for r in requests]
        resp = self._request("POST", "/v1/clarify/batch", json=body)
        if resp.status_code != 200:
            raise ClarifierAPIError(resp.status_code, _detail(resp))
        return [ClarifyResponse.model_validate(x) for x in resp.json()]

    def chat_completions(self, messages: Iterable[Mapping[str, Any]], documents: Iterable[Mapping[str, Any] | str] = (),
                         model: str | None = None, **params: Any) -> dict:
        """``POST /v1/chat/completions`` (the OpenAI / Granite query-clarification contract): ``messages``
        as OpenAI chat messages (the last one the user's query), ``documents`` as ``{"doc_id", "text"}``.
        Returns the ChatCompletion object as a dict; ``json.loads(r["choices"][0]["message"]["content"])
        ["clarification"]`` is the question or ``"CLEAR"`` (also :func:`clarification_of`). Errors raise
        ClarifierAPIError with OpenAI's ``error`` object as ``detail``."""
        body = {"messages": [dict(m) for m in messages], **params}
        docs = [d if isinstance(d, str) else dict(d) for d in documents]
        if docs:
            body["documents"] = docs
        if model is not None:
            body["model"] = model
        resp = self._request("POST", "/v1/chat/completions", json=body)
        if resp.status_code != 200:
            raise ClarifierAPIError(resp.status_code, _detail(resp, key="error"))
        return resp.json()

    def ready(self) -> bool:
        """True when ``/readyz`` answers 200 (one attempt, never raises)."""
        try:
            return self._http.get("readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def model_version(self) -> str:
        """The served model version (from ``/readyz``); raises ClarifierAPIError when not ready."""
        resp = self._request("GET", "/readyz")
        if resp.status_code != 200:
            raise ClarifierAPIError(resp.status_code, _detail(resp))
        return resp.json()["model_version"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ClarifierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
