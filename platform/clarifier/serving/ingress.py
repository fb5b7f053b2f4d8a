"""The HTTP ingress (``ClarifierIngress``, FastAPI through Serve): routes, API-key check, size
limits, admission (latency budget), resends after a lost model replica, and the playground page.
The routes and status codes are listed in :mod:`clarifier.serving.app`."""

import asyncio
import functools
import importlib.resources
import json
import logging
import random
import time
import uuid
from typing import Any, List, Optional, Tuple

from fastapi import Depends, FastAPI, HTTPException, Request, Security
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPBearer
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from clarifier.core.chat_completions import (CHAT_PATHS, ChatCompletionRequest, ChatRequestError, chat_completion,
                                             error_body, error_from_detail, model_list, parse_chat_request)
from clarifier.core.schema import ClarifyRequest, ClarifyResponse
from clarifier.data.chatlog import clarify_request_from_chat
from clarifier.runtime.retry import RetryPolicy
from clarifier.serving.auth import ENV_VAR as API_KEYS_ENV
from clarifier.serving.auth import HEADER as API_KEY_HEADER
from clarifier.serving.auth import ApiKeyAuth, presented_key
from clarifier.serving.admission import LatencyBudget
from clarifier.serving.metrics import IngressMetrics
from clarifier.core.request_record import answer_fields, request_record
from clarifier.serving.request_log import RequestLog


# A child of Serve's logger, so replica logs carry these lines (with replica and request ids).
log = logging.getLogger("ray.serve.clarifier")

API_TITLE = "Clarifier"
RETRY_AFTER_S = 1
# A model call whose replica died mid-request is sent again this many times (to another replica).
REPLICA_LOSS_RETRIES = 2
# Errors meaning "the replica holding the request is gone", not "the model failed on it".
REPLICA_LOST = (ActorDiedError, ActorUnavailableError)
# Their resends: at once, no backoff (see ClarifierIngress._call_model).
REPLICA_LOSS = RetryPolicy(attempts=REPLICA_LOSS_RETRIES + 1)


# ---- HTTP ingress ----------------------------------------------------------------------------

fastapi_app = FastAPI(
    title=API_TITLE,
    description="Decides whether the latest user turn of a RAG conversation needs a clarifying "
                "question, and if so asks it, grounded on earlier turns and passages. Send the API "
                f"key as `Authorization: Bearer <key>` or `{API_KEY_HEADER}: <key>`.",
    version="1",
)

ROUTES = {"/v1/clarify": "clarify", "/v1/clarify/batch": "clarify_batch", "/healthz": "healthz",
          "/readyz": "readyz", "/metrics": "metrics", "/docs": "docs", "/openapi.json": "openapi",
          "/": "playground", "/playground": "playground", "/v1/chat/completions": "chat_completions",
          "/v1/models": "models"}

# The playground: one self-contained HTML page (package data beside this module) that calls
# POST v1/clarify from the browser. The page needs no key (the API calls it makes do) and is not in
# the OpenAPI document. Its CSP allows nothing but this origin, so it never fetches from elsewhere.
PLAYGROUND_FILE = "playground.html"
PLAYGROUND_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@functools.lru_cache(maxsize=1)
def playground_html() -> str:
    """The playground page (read once from the package data)."""
    return importlib.resources.files("clarifier.serving").joinpath(PLAYGROUND_FILE).read_text(encoding="utf-8")


def request_size(req: ClarifyRequest) -> int:
    """Characters counted against ``max_chars``: history texts + query + passage texts."""
    return sum(len(t.text) for t in req.history) + len(req.query) + sum(len(p.text) for p in req.passages)


def check_limits(req: ClarifyRequest, max_history_turns: int, max_chars: int, index: Optional[int] = None) -> None:
    """Raise HTTP 413 naming the limit and the value when a request is too large."""
    where = "" if index is None else f"requests[{index}]: "
    extra = {} if index is None else {"index": index}
    if len(req.history) > max_history_turns:
        raise HTTPException(413, detail={
            "error": "request too large", "limit": "max_history_turns", "max": max_history_turns,
            "value": len(req.history), **extra,
            "message": f"{where}history has {len(req.history)} turns; max_history_turns is {max_history_turns}",
        })
    size = request_size(req)
    if size > max_chars:
        raise HTTPException(413, detail={
            "error": "request too large", "limit": "max_chars", "max": max_chars, "value": size, **extra,
            "message": f"{where}history + query + passages have {size} characters; max_chars is {max_chars}",
        })


def _ingress() -> "ClarifierIngress":
    """The ClarifierIngress instance of this replica (FastAPI dependencies have no ``self``)."""
    return serve.get_replica_context().servable_object


def _route_of(request: Request) -> str:
    return ROUTES.get(_route_path(request), "other")


def _route_path(request: Request) -> str:
    path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
    return (path[len(root):] if root and path.startswith(root) else path).rstrip("/") or "/"


def _openai_route(request: Request) -> bool:
    return _route_path(request) in CHAT_PATHS


# On the OpenAI-compatible routes every error has OpenAI's body ({"error": {"message", "type", "param",
# "code"}}), which the openai client turns into its typed exceptions; elsewhere FastAPI's own.
@fastapi_app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException):
    if not _openai_route(request):
        return await http_exception_handler(request, exc)
    return JSONResponse(status_code=exc.status_code, content=error_from_detail(exc.status_code, exc.detail),
                        headers=getattr(exc, "headers", None))


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    if not _openai_route(request):
        return await request_validation_exception_handler(request, exc)
    return JSONResponse(status_code=400, content=error_from_detail(400, list(exc.errors())))


def openai_error(resp: JSONResponse) -> JSONResponse:
    """A refusal of the Clarifier routes' shape (``{"detail": {...}}``) in OpenAI's, same status and headers."""
    detail = json.loads(resp.body).get("detail")
    headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(status_code=resp.status_code, content=error_from_detail(resp.status_code, detail),
                        headers=headers)


@fastapi_app.middleware("http")
async def _observe(request: Request, call_next):
    t0 = time.perf_counter()
    response = await call_next(request)
    try:
        _ingress().metrics.observe_request(_route_of(request), response.status_code, time.perf_counter() - t0)
    except Exception:  # metrics must never break a request
        log.debug("recording request metrics failed", exc_info=True)
    return response


# Declared so that the OpenAPI document says how to send the key (either scheme will do); the
# check itself is require_api_key's, on the raw headers.
_BEARER = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>`")
_KEY_HEADER = APIKeyHeader(name=API_KEY_HEADER, auto_error=False, description=f"`{API_KEY_HEADER}: <key>`")


async def require_api_key(request: Request, _bearer: Any = Security(_BEARER),
                          _header: Any = Security(_KEY_HEADER)) -> None:
    """401 unless auth is off or the request carries a configured key (never echoed)."""
    ingress = _ingress()
    key = presented_key(request.headers)
    if ingress.auth.check(key):
        return
    ingress.metrics.rejected.inc(reason="auth")
    message = ("missing API key: send 'Authorization: Bearer <key>' or "
               f"'{API_KEY_HEADER}: <key>'") if key is None else "invalid API key"
    raise HTTPException(401, detail={"error": "unauthorized", "message": message},
                        headers={"WWW-Authenticate": "Bearer"})


AUTH = [Depends(require_api_key)]
ERRORS = {400: {"description": "the body could not be decoded (not UTF-8 JSON)"},
          401: {"description": "missing or wrong API key"},
          413: {"description": "over a configured size limit (the body names it)"},
          503: {"description": "overloaded: max_queued_requests requests already wait (the body names it), "
                               "or no model replica could answer; retry after Retry-After seconds"},
          500: {"description": "internal error (details only in the server log)"}}


@fastapi_app.get("/", include_in_schema=False, response_class=HTMLResponse)
@fastapi_app.get("/playground", include_in_schema=False, response_class=HTMLResponse)
async def playground() -> HTMLResponse:
    """The playground page: a form that calls POST v1/clarify and shows the answer."""
    return HTMLResponse(playground_html(), headers=PLAYGROUND_HEADERS)


# The batch body is checked in the handler (an empty list is a 422 saying so); the document says it too.
BATCH_BODY_DOC = {"requestBody": {"content": {"application/json": {"schema": {"minItems": 1}}}}}
# The chat body is parsed in the handler (errors in OpenAI's shape, naming the parameter); documented here.
CHAT_BODY_DOC = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": ChatCompletionRequest.model_json_schema()}}}}
CHAT_ERRORS = {400: {"description": "a parameter is invalid or unsupported (OpenAI's error body names it)"},
               **{k: v for k, v in ERRORS.items() if k != 400}}


@serve.deployment(name="ClarifierIngress")
@serve.ingress(fastapi_app)
class ClarifierIngress:
    def __init__(self, model: Any, model_id: str = "clarifier", max_history_turns: int = 50, max_chars: int = 20000,
                 ready_timeout_s: float = 5.0, api_key_digests: Tuple[str, ...] = (),
                 max_batch_requests: int = 32, max_queued_requests: int = -1, ray_metrics: bool = True,
                 latency_budget_s: Optional[float] = None, initial_limit: int = 8,
                 request_log: Optional[dict] = None, shadow: Any = None, shadow_share: float = 1.0,
                 shadow_max_inflight: int = 16, shadow_timeout_s: float = 30.0):
        self.model = model  # DeploymentHandle to ClarifierModel
        self.model_id = model_id  # what OpenAI-compatible clients see as the model
        self.started = int(time.time())
        # max_queued_requests null: admission from the latency budget (see serving.admission).
        self.admission = LatencyBudget(latency_budget_s, initial_limit) if latency_budget_s else None
        self.max_history_turns = max_history_turns
        self.max_chars = max_chars
        self.ready_timeout_s = ready_timeout_s
        self.max_batch_requests = max_batch_requests
        self.max_queued_requests = max_queued_requests
        self.auth = ApiKeyAuth(api_key_digests)
        self.metrics = IngressMetrics(ray=ray_metrics)
        self.request_log = self._request_log(request_log)
        # The shadow model (serve.shadow_model_uri): a DeploymentHandle scored off the response path.
        self.shadow = shadow
        self.shadow_share = shadow_share
        self.shadow_max_inflight = shadow_max_inflight
        self.shadow_timeout_s = shadow_timeout_s
        self._shadow_tasks: set = set()
        self._rng = random.Random()
        if self.auth.enabled:
            log.info("API key authentication is ON (%d key(s) configured)", self.auth.n_keys)
        else:
            log.warning("API key authentication is OFF: no keys configured ($%s / serve.api_keys_file); "
                        "every client is accepted", API_KEYS_ENV)

    async def __del__(self):
        """Serve awaits it on a graceful shutdown: shadow calls still out get a few seconds to come back,
        then the request log writes what it holds (in a thread: the event loop stays free)."""
        tasks = list(getattr(self, "_shadow_tasks", ()))
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        request_log = getattr(self, "request_log", None)
        if request_log is not None:
            await asyncio.to_thread(request_log.close)

    # ---- the request log ----------------------------------------------------------------------

    def _request_log(self, cfg: Optional[dict]) -> Optional[RequestLog]:
        if not cfg or not cfg.get("uri"):
            return None
        from clarifier.core.config import RequestLogConfig

        try:
            writer = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (tests)
            writer = None
        m = self.metrics
        rl = RequestLog(RequestLogConfig.model_validate(cfg), writer_id=writer,
                        on_count=lambda outcome, n: m.request_log_records.inc(n, outcome=outcome),
                        on_buffered=lambda n: m.request_log_buffered.set(n))
        log.info("request log ON: %s (a shard per %d records or %g s)", rl.uri, rl.cfg.shard_records,
                 rl.cfg.shard_age_s)
        return rl

    def _log_answers(self, route: str, reqs: List[ClarifyRequest], resps: List[ClarifyResponse],
                     shadows: Optional[List[dict]] = None) -> None:
        """Hand each answered request to the request log (never fails or delays the answer)."""
        if self.request_log is None:
            return
        try:
            at = time.time()
            omit = tuple(self.request_log.cfg.omit)
            for k, (req, resp) in enumerate(zip(reqs, resps)):
                self.request_log.append(request_record(req, resp, route=route, request_id=uuid.uuid4().hex,
                                                       at=at, omit=omit, shadow=shadows[k] if shadows else None))
        except Exception:
            log.exception("request log: a record could not be made")

    def _answered(self, route: str, reqs: List[ClarifyRequest], resps: List[ClarifyResponse]) -> None:
        """After an answer is ready: log it, and with a shadow model, also have the shadow score it -- in a
        task of its own (the response does not wait; the log record waits for the shadow's answer)."""
        if self.shadow is None or self._rng.random() >= self.shadow_share:
            return self._log_answers(route, reqs, resps)
        if len(self._shadow_tasks) >= self.shadow_max_inflight:
            self.metrics.shadow.inc(len(reqs), outcome="skipped")
            return self._log_answers(route, reqs, resps)
        task = asyncio.get_running_loop().create_task(self._shadow_score(route, reqs, resps))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow_score(self, route: str, reqs: List[ClarifyRequest], resps: List[ClarifyResponse]) -> None:
        try:
            out = await asyncio.wait_for(self.shadow.clarify_many.remote(list(reqs)), timeout=self.shadow_timeout_s)
            shadows = []
            for champ, sh in zip(resps, out):
                self.metrics.shadow.inc(outcome="agree" if sh.needs_clarification == champ.needs_clarification
                                        else "disagree")
                self.metrics.shadow_diff.observe(abs(sh.confidence - champ.confidence))
                shadows.append(answer_fields(sh))
        except Exception as exc:  # the shadow never affects an answer; it is counted and logged as failed
            self.metrics.shadow.inc(len(reqs), outcome="failed")
            kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "failed"
            log.warning("shadow model call %s (%s)", kind, type(exc).__name__)
            shadows = [{"error": kind}] * len(reqs)
        self._log_answers(route, reqs, resps, shadows)

    # ---- helpers -----------------------------------------------------------------------------

    async def _call_model(self, method: str, arg: Any) -> Any:
        """``self.model.<method>.remote(arg)``, sent again when the replica holding it died.

        Answering is a pure function of the request, so a request lost with its replica is safe to
        repeat; Serve's router has already taken the dead replica out of rotation, so the retry
        goes to a live one (or waits in the queue for the replacement, like any new request).
        """

        def resent(state) -> None:
            self.metrics.replica_lost.inc(outcome="retried")
            log.warning("model replica lost during %s (%s); sending the request again (retry %d of %d)",
                        method, type(state.outcome.exception()).__name__, state.attempt_number, REPLICA_LOSS_RETRIES)

        try:
            return await REPLICA_LOSS.acall(lambda: getattr(self.model, method).remote(arg), on=REPLICA_LOST,
                                            on_retry=resent)
        except REPLICA_LOST:  # raised only by the last attempt: the others were sent again
            self.metrics.replica_lost.inc(outcome="unavailable")
            raise

    def _unavailable(self, exc: Exception) -> JSONResponse:
        if isinstance(exc, REPLICA_LOST):
            return JSONResponse(status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}, content={"detail": {
                "error": "unavailable", "limit": None,
                "message": "the model replica answering this request stopped; retry later"}})
        self.metrics.rejected.inc(reason="backpressure")
        if isinstance(exc, BackPressureError):
            limit = self.max_queued_requests if self.max_queued_requests >= 0 else exc.args[1]
            detail = {"error": "overloaded", "limit": "max_queued_requests", "max": limit,
                      "message": f"all model replicas are busy and max_queued_requests ({limit}) requests "
                                 "are already waiting; retry later"}
        else:
            detail = {"error": "unavailable", "limit": None,
                      "message": "the model deployment is unavailable; retry later"}
        return JSONResponse(status_code=503, content={"detail": detail},
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    def _over_budget(self, d) -> JSONResponse:
        self.metrics.rejected.inc(reason="latency_budget")
        budget = self.admission.budget_s
        return JSONResponse(status_code=503, headers={"Retry-After": str(d.retry_after_s)}, content={"detail": {
            "error": "overloaded", "limit": "latency_budget_s", "max": budget, "admitted_at_once": d.limit,
            "message": f"{d.outstanding} requests are already being answered, as many as the model side answers "
                       f"within serve.latency_budget_s={budget:g}s at its measured rate; retry after "
                       f"{d.retry_after_s}s"}})

    async def _admitted(self, method: str, arg: Any, items: int):
        """``_call_model`` under the latency-budget admission (a refusal is returned, not raised)."""
        if self.admission is None:
            return await self._call_model(method, arg), None
        d = self.admission.try_admit(items)
        self.metrics.admission_limit.set(d.limit)
        if not d.admitted:
            return None, self._over_budget(d)
        try:
            return await self._call_model(method, arg), None
        finally:
            self.admission.done(items)
            rate = self.admission.throughput()
            if rate is not None:
                self.metrics.throughput.set(rate)

    def _internal_error(self) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        log.exception("clarify request failed (error_id=%s)", error_id)
        return JSONResponse(status_code=500, content={"detail": {
            "error": "internal error", "error_id": error_id,
            "message": "the model failed on this request; see the server log for the error id"}})

    async def _answer(self, method: str, arg, n: int):
        """``(answers, None)``, or ``(None, response)`` when the request is refused (latency budget),
        no replica can take it (503) or the model fails on it (500 with an error id)."""
        try:
            return await self._admitted(method, arg, n)
        except (BackPressureError, DeploymentUnavailableError, *REPLICA_LOST) as exc:
            return None, self._unavailable(exc)
        except Exception:
            return None, self._internal_error()

    # ---- routes ------------------------------------------------------------------------------

    @fastapi_app.post("/v1/clarify", response_model=ClarifyResponse, dependencies=AUTH, responses=ERRORS)
    async def clarify(self, body: ClarifyRequest) -> ClarifyResponse:
        """Decide whether the latest turn needs clarification; ask the question if it does."""
        check_limits(body, self.max_history_turns, self.max_chars)
        resp, refused = await self._answer("clarify", body, 1)
        if refused is not None:
            return refused
        self.metrics.observe_answer(resp)
        self._answered("clarify", [body], [resp])
        return resp

    @fastapi_app.post("/v1/clarify/batch", response_model=List[ClarifyResponse], dependencies=AUTH,
                      responses=ERRORS, openapi_extra=BATCH_BODY_DOC)
    async def clarify_batch(self, body: List[ClarifyRequest]) -> List[ClarifyResponse]:
        """Several independent requests in one call; answers in the same order."""
        if len(body) > self.max_batch_requests:
            raise HTTPException(413, detail={
                "error": "request too large", "limit": "max_batch_requests", "max": self.max_batch_requests,
                "value": len(body),
                "message": f"batch has {len(body)} requests; max_batch_requests is {self.max_batch_requests}"})
        if not body:
            raise HTTPException(422, detail=[{"loc": ["body"], "msg": "batch is empty: send at least one request",
                                              "type": "too_short"}])
        for i, req in enumerate(body):
            check_limits(req, self.max_history_turns, self.max_chars, index=i)
        resps, refused = await self._answer("clarify_many", list(body), len(body))
        if refused is not None:
            return refused
        for r in resps:
            self.metrics.observe_answer(r)
        self._answered("clarify_batch", list(body), list(resps))
        return resps

    @fastapi_app.post("/v1/chat/completions", dependencies=AUTH, responses=CHAT_ERRORS, openapi_extra=CHAT_BODY_DOC,
                      tags=["OpenAI-compatible"])
    async def chat_completions(self, request: Request) -> JSONResponse:
        """OpenAI chat completions in the query-clarification contract: ``messages`` (the conversation, the
        last one the user's query) and ``documents`` -> ``choices[0].message.content`` =
        ``{"clarification": "<question>"}`` or ``{"clarification": "CLEAR"}``; Clarifier's own fields
        (confidence, threshold, grounding, model version) under ``clarifier``."""
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(status_code=400, content=error_body(400, "the body is not JSON", code="invalid_json"))
        try:
            chat = parse_chat_request(body)
            req = clarify_request_from_chat(chat.messages, chat.documents)
        except ChatRequestError as exc:
            return JSONResponse(status_code=400, content=error_body(400, exc.message, exc.param, exc.code))
        except ValueError as exc:
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return JSONResponse(status_code=400, content=error_body(400, message, param="messages",
                                                                    code="invalid_value"))
        check_limits(req, self.max_history_turns, self.max_chars)
        resp, refused = await self._answer("clarify", req, 1)
        if refused is not None:
            return openai_error(refused)
        self.metrics.observe_answer(resp)
        conversation = (chat.metadata or {}).get("conversation_id")
        if isinstance(conversation, (str, int)) and str(conversation):
            req = req.model_copy(update={"conversation_id": str(conversation)[:256]})
        self._answered("chat_completions", [req], [resp])
        return JSONResponse(chat_completion(resp, self.model_id))

    @fastapi_app.get("/v1/models", dependencies=AUTH, responses={401: ERRORS[401]}, tags=["OpenAI-compatible"])
    async def models(self) -> dict:
        """The served model, as OpenAI lists models (``id`` is what chat completions answer with)."""
        async def _version():
            return await self.model.version.remote()

        try:
            version = await asyncio.wait_for(_version(), timeout=self.ready_timeout_s)
        except Exception:  # listing the model never fails on a replica that is still loading
            version = None
        return model_list(self.model_id, version, self.started)

    @fastapi_app.get("/metrics", dependencies=AUTH, include_in_schema=False)
    async def metrics(self):
        """Prometheus text format: this ingress replica's request metrics."""
        body, content_type = self.metrics.render()
        return Response(content=body, media_type=content_type)

    @fastapi_app.get("/healthz")
    async def healthz(self) -> dict:
        """Liveness: 200 whenever the HTTP process is up."""
        return {"status": "ok"}

    @fastapi_app.get("/readyz", responses={503: {"description": "model not loaded or not answering"}})
    async def readyz(self):
        """Readiness: 200 with the model version once a model replica answers, else 503."""
        async def _version():
            return await self.model.version.remote()

        try:
            version = await asyncio.wait_for(_version(), timeout=self.ready_timeout_s)
        except Exception as exc:
            return JSONResponse(status_code=503, content={"status": "unavailable",
                                                          "detail": f"model not ready ({type(exc).__name__})"})
        return {"status": "ready", "model_version": version}


