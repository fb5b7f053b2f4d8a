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
                                             error_body, error_from_detail, model_list, models_list,
                                             parse_chat_request)
from clarifier.core.schema import ClarifyRequest, ClarifyResponse
from clarifier.data.chatlog import clarify_request_from_chat
from clarifier.runtime.retry import RetryPolicy
from clarifier.serving.auth import ENV_VAR as API_KEYS_ENV
from clarifier.serving.auth import HEADER as API_KEY_HEADER
from clarifier.serving.auth import ApiKeyAuth, key_digest, presented_key
from clarifier.serving.admission import FairShare, LatencyBudget, RateLimit
from clarifier.serving.metrics import IngressMetrics
from clarifier.core.request_record import answer_fields, request_record
from clarifier.core.tenants import Caller, TenantDirectory, TenantError, TenantSpec
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
# A multi-tenant deployment: the header naming the tenant's model on /v1/clarify (the body's ``model`` also does).
MODEL_HEADER = "X-Clarifier-Model"


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
        _ingress().metrics.observe_request(_route_of(request), response.status_code, time.perf_counter() - t0,
                                           model=getattr(request.state, "model", ""))
    except Exception:  # metrics must never break a request
        log.debug("recording request metrics failed", exc_info=True)
    return response


# Declared so that the OpenAPI document says how to send the key (either scheme will do); the
# check itself is require_api_key's, on the raw headers.
_BEARER = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>`")
_KEY_HEADER = APIKeyHeader(name=API_KEY_HEADER, auto_error=False, description=f"`{API_KEY_HEADER}: <key>`")


async def require_api_key(request: Request, _bearer: Any = Security(_BEARER),
                          _header: Any = Security(_KEY_HEADER)) -> Caller:
    """The caller (which tenant its key is scoped to, if any); 401 unless auth is off or the request carries a
    configured key (never echoed)."""
    ingress = _ingress()
    key = presented_key(request.headers)
    caller = ingress.caller(key)
    if caller is not None:
        request.state.caller = caller
        # the metrics' model: the single model, or the tenant a scoped key belongs to (its refusals count there too)
        model = ingress.model_id if ingress.tenants is None else caller.tenant
        if model:
            request.state.model = model
        return caller
    ingress.metrics.rejected.inc(model="", reason="auth")
    message = ("missing API key: send 'Authorization: Bearer <key>' or "
               f"'{API_KEY_HEADER}: <key>'") if key is None else "invalid API key"
    raise HTTPException(401, detail={"error": "unauthorized", "message": message},
                        headers={"WWW-Authenticate": "Bearer"})


AUTH = [Depends(require_api_key)]
ERRORS = {400: {"description": "the body could not be decoded (not UTF-8 JSON), or a multi-tenant deployment needs "
                               "the request to name its model"},
          401: {"description": "missing or wrong API key"},
          403: {"description": "multi-tenant: the API key is scoped to another tenant's model"},
          404: {"description": "multi-tenant: no such model is served"},
          429: {"description": "multi-tenant: the tenant's rate limit is reached; retry after Retry-After seconds"},
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
                 shadow_max_inflight: int = 16, shadow_timeout_s: float = 30.0, tenants: Optional[dict] = None,
                 fair_slots: Optional[int] = None):
        self.model = model  # DeploymentHandle to ClarifierModel (ClarifierTenantModel with tenants)
        self.model_id = model_id  # what OpenAI-compatible clients see as the model
        self.started = int(time.time())
        # max_queued_requests null: admission from the latency budget (see serving.admission).
        self.admission = LatencyBudget(latency_budget_s, initial_limit) if latency_budget_s else None
        self.latency_budget_s = latency_budget_s
        self.initial_limit = initial_limit
        self.max_history_turns = max_history_turns
        self.max_chars = max_chars
        self.ready_timeout_s = ready_timeout_s
        self.max_batch_requests = max_batch_requests
        self.max_queued_requests = max_queued_requests
        self.auth = ApiKeyAuth(api_key_digests)
        self.metrics = IngressMetrics(ray=ray_metrics)
        self._request_log_cfg = request_log
        # Multi-tenant (serve.tenants_file): the tenants, their admission, handles and request logs.
        self.tenants: Optional[TenantDirectory] = None
        self._tenant_state: dict = {}  # tenant -> {"budget": LatencyBudget, "rate": RateLimit, "spec": TenantSpec}
        self._tenant_logs: dict = {}  # tenant -> RequestLog under <request_log.uri>/<tenant>
        self._handles: dict = {}  # mux id -> DeploymentHandle with multiplexed_model_id
        self._tenants_watch = None
        # Tenants' requests go to the model side in turn, fair_slots at once (what the model replicas take at once).
        self.fair = FairShare(fair_slots) if tenants and fair_slots else None
        if tenants:
            from clarifier.core.tenants import TenantsSpec
            from clarifier.serving.tenants import TenantsWatch

            self._set_tenants(TenantDirectory(TenantsSpec.model_validate(tenants["spec"])))
            self._tenants_watch = TenantsWatch(tenants["file"], tenants.get("refresh_s", 0), self._reloaded,
                                               initial_text=tenants.get("text"))
            self._tenants_watch.start()
        self.request_log = None if tenants else self._request_log(request_log)
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
        then the request logs write what they hold (in a thread: the event loop stays free)."""
        tasks = list(getattr(self, "_shadow_tasks", ()))
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        watch = getattr(self, "_tenants_watch", None)
        if watch is not None:
            watch.stop()
        logs = [getattr(self, "request_log", None), *getattr(self, "_tenant_logs", {}).values()]
        for request_log in logs:
            if request_log is not None:
                await asyncio.to_thread(request_log.close)

    # ---- tenants ------------------------------------------------------------------------------

    def caller(self, key: Optional[str]) -> Optional[Caller]:
        """Who ``key`` is (None: refused with 401). Operator keys ($CLARIFIER_API_KEYS / serve.api_keys_file) reach
        every tenant; a tenant's keys (its ``keys_sha256``) reach it alone; no key anywhere: auth is off."""
        tenants = self.tenants
        scoped = tenants is not None and tenants.has_keys
        if not self.auth.enabled and not scoped:
            return Caller()
        if not key:
            return None
        if self.auth.enabled and self.auth.check(key):
            return Caller()
        tenant = tenants.scoped_tenant(key_digest(key)) if scoped else None
        return Caller(tenant) if tenant is not None else None

    def _set_tenants(self, directory: TenantDirectory) -> None:
        state = {}
        for t in directory.spec.tenants:
            old = self._tenant_state.get(t.name)
            if old is not None and old["spec"] == t:
                state[t.name] = old  # unchanged: keeps its measured throughput and its bucket
                continue
            budget_s = t.latency_budget_s or self.latency_budget_s
            state[t.name] = {"spec": t, "budget": LatencyBudget(budget_s, self.initial_limit) if budget_s else None,
                             "rate": RateLimit(t.rate_limit_per_s, t.rate_burst) if t.rate_limit_per_s else None}
        self._tenant_state = state
        self.tenants = directory
        self.metrics.tenants.set(len(directory.names))

    def _reloaded(self, directory: Optional[TenantDirectory], error: Optional[str]) -> None:
        """The tenants file changed: apply it, or keep the tenants served now when it cannot be used."""
        if directory is None:
            self.metrics.tenants_reloads.inc(outcome="refused")
            log.error("tenants file changed but cannot be used; still serving %s: %s",
                      ", ".join(self.tenants.names), error)
            return
        change = self.tenants.changes(directory)
        self._set_tenants(directory)
        self.metrics.tenants_reloads.inc(outcome="applied")
        log.info("tenants reloaded: %d served (added %s, removed %s, changed %s)", len(directory.names),
                 change["added"] or "none", change["removed"] or "none", change["changed"] or "none")

    def _tenant(self, request: Request, caller: Caller, named: Optional[str]) -> Optional[TenantSpec]:
        """The tenant answering this request (None: a single-model deployment); an HTTPException when refused."""
        if self.tenants is None:
            return None
        try:
            tenant = self.tenants.resolve(caller, named)
        except TenantError as exc:
            self.metrics.rejected.inc(model=caller.tenant or "", reason="tenant")
            raise HTTPException(exc.status, detail={"error": exc.code, "message": exc.message}) from None
        request.state.model = tenant.name
        return tenant

    def _handle(self, tenant: TenantSpec):
        """The model deployment's handle routing to replicas that hold ``tenant`` (Serve's model multiplexing)."""
        return self._handle_for(tenant.mux_id)

    def _handle_for(self, mux_id: str):
        handle = self._handles.get(mux_id)
        if handle is None:
            handle = self._handles[mux_id] = self.model.options(multiplexed_model_id=mux_id)
        return handle

    def _model_label(self, tenant: Optional[TenantSpec]) -> str:
        return self.model_id if tenant is None else tenant.name

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

    def _tenant_log(self, tenant: TenantSpec) -> Optional[RequestLog]:
        """The tenant's own request log, under ``<serve.request_log.uri>/<tenant>`` (opened on its first answer)."""
        if not self._request_log_cfg or not self._request_log_cfg.get("uri"):
            return None
        rl = self._tenant_logs.get(tenant.name)
        if rl is None:
            from clarifier.runtime import storage

            cfg = {**self._request_log_cfg, "uri": storage.join(self._request_log_cfg["uri"], tenant.name)}
            rl = self._tenant_logs[tenant.name] = self._request_log(cfg)
        return rl

    def _log_answers(self, route: str, reqs: List[ClarifyRequest], resps: List[ClarifyResponse],
                     shadows: Optional[List[dict]] = None, tenant: Optional[TenantSpec] = None) -> None:
        """Hand each answered request to the request log (never fails or delays the answer)."""
        request_log = self.request_log if tenant is None else self._tenant_log(tenant)
        if request_log is None:
            return
        try:
            at = time.time()
            omit = tuple(request_log.cfg.omit)
            for k, (req, resp) in enumerate(zip(reqs, resps)):
                request_log.append(request_record(req, resp, route=route, request_id=uuid.uuid4().hex,
                                                  at=at, omit=omit, shadow=shadows[k] if shadows else None))
        except Exception:
            log.exception("request log: a record could not be made")

    def _answered(self, route: str, reqs: List[ClarifyRequest], resps: List[ClarifyResponse],
                  tenant: Optional[TenantSpec] = None) -> None:
        """After an answer is ready: count it, log it, and with a shadow model (the deployment's, or the tenant's
        ``shadow_model_uri``), also have the shadow score it -- in a task of its own (the response does not wait; the
        log record waits for the shadow's answer)."""
        model = self._model_label(tenant)
        for r in resps:
            self.metrics.observe_answer(r, model=model)
        if tenant is None:
            shadow, share = self.shadow, self.shadow_share
        else:  # the tenant's challenger: another model of the same multiplexed deployment (one copy if it shares weights)
            shadow = self._handle_for(tenant.shadow_mux_id) if tenant.shadow_model_uri else None
            share = tenant.shadow_share
        if shadow is None or self._rng.random() >= share:
            return self._log_answers(route, reqs, resps, tenant=tenant)
        if len(self._shadow_tasks) >= self.shadow_max_inflight:
            self.metrics.shadow.inc(len(reqs), model=model, outcome="skipped")
            return self._log_answers(route, reqs, resps, tenant=tenant)
        task = asyncio.get_running_loop().create_task(self._shadow_score(route, reqs, resps, shadow, tenant))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow_score(self, route: str, reqs: List[ClarifyRequest], resps: List[ClarifyResponse], shadow: Any,
                            tenant: Optional[TenantSpec] = None) -> None:
        model = self._model_label(tenant)
        try:
            out = await asyncio.wait_for(shadow.clarify_many.remote(list(reqs)), timeout=self.shadow_timeout_s)
            shadows = []
            for champ, sh in zip(resps, out):
                self.metrics.shadow.inc(model=model, outcome="agree" if sh.needs_clarification ==
                                        champ.needs_clarification else "disagree")
                self.metrics.shadow_diff.observe(abs(sh.confidence - champ.confidence), model=model)
                shadows.append(answer_fields(sh))
        except Exception as exc:  # the shadow never affects an answer; it is counted and logged as failed
            self.metrics.shadow.inc(len(reqs), model=model, outcome="failed")
            kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "failed"
            log.warning("shadow model call %s (%s)", kind, type(exc).__name__)
            shadows = [{"error": kind}] * len(reqs)
        self._log_answers(route, reqs, resps, shadows, tenant=tenant)

    # ---- helpers -----------------------------------------------------------------------------

    async def _call_model(self, method: str, arg: Any, tenant: Optional[TenantSpec] = None) -> Any:
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
            handle = self.model if tenant is None else self._handle(tenant)
            return await REPLICA_LOSS.acall(lambda: getattr(handle, method).remote(arg), on=REPLICA_LOST,
                                            on_retry=resent)
        except REPLICA_LOST:  # raised only by the last attempt: the others were sent again
            self.metrics.replica_lost.inc(outcome="unavailable")
            raise

    def _unavailable(self, exc: Exception, model: str = "") -> JSONResponse:
        if isinstance(exc, REPLICA_LOST):
            return JSONResponse(status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}, content={"detail": {
                "error": "unavailable", "limit": None,
                "message": "the model replica answering this request stopped; retry later"}})
        self.metrics.rejected.inc(model=model, reason="backpressure")
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

    def _over_budget(self, d, admission: LatencyBudget, model: str = "") -> JSONResponse:
        self.metrics.rejected.inc(model=model, reason="latency_budget")
        budget = admission.budget_s
        return JSONResponse(status_code=503, headers={"Retry-After": str(d.retry_after_s)}, content={"detail": {
            "error": "overloaded", "limit": "latency_budget_s", "max": budget, "admitted_at_once": d.limit,
            "message": f"{d.outstanding} requests are already being answered, as many as the model side answers "
                       f"within {'its tenant' if model and self.tenants else 'serve'}.latency_budget_s={budget:g}s "
                       f"at its measured rate; retry after {d.retry_after_s}s"}})

    def _rate_limited(self, tenant: TenantSpec, retry_after_s: int) -> JSONResponse:
        self.metrics.rejected.inc(model=tenant.name, reason="rate_limit")
        return JSONResponse(status_code=429, headers={"Retry-After": str(retry_after_s)}, content={"detail": {
            "error": "rate_limited", "limit": "rate_limit_per_s", "max": tenant.rate_limit_per_s,
            "message": f"model {tenant.name!r} is limited to {tenant.rate_limit_per_s:g} requests per second; retry "
                       f"after {retry_after_s}s"}})

    async def _admitted(self, method: str, arg: Any, items: int, tenant: Optional[TenantSpec] = None):
        """``_call_model`` under the latency-budget admission -- the tenant's own budget and rate limit in a
        multi-tenant deployment, so a tenant's burst sheds its own load -- (a refusal is returned, not raised)."""
        admission = self.admission
        if tenant is not None:
            state = self._tenant_state.get(tenant.name) or {}
            admission = state.get("budget")
            rate_limit = state.get("rate")
            if rate_limit is not None:
                wait = rate_limit.try_take(items)
                if wait:
                    return None, self._rate_limited(tenant, wait)
        if admission is None:
            return await self._dispatched(method, arg, items, tenant), None
        d = admission.try_admit(items)
        if tenant is None:
            self.metrics.admission_limit.set(d.limit)
        if not d.admitted:
            return None, self._over_budget(d, admission, self._model_label(tenant))
        try:
            return await self._dispatched(method, arg, items, tenant), None
        finally:
            admission.done(items)
            rate = admission.throughput()
            if rate is not None and tenant is None:
                self.metrics.throughput.set(rate)

    def _internal_error(self) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        log.exception("clarify request failed (error_id=%s)", error_id)
        return JSONResponse(status_code=500, content={"detail": {
            "error": "internal error", "error_id": error_id,
            "message": "the model failed on this request; see the server log for the error id"}})

    async def _dispatched(self, method: str, arg: Any, items: int, tenant: Optional[TenantSpec]):
        """``_call_model``, in a multi-tenant deployment after waiting for the tenant's turn (:class:`FairShare`)."""
        if tenant is None or self.fair is None:
            return await self._call_model(method, arg, tenant)
        await self.fair.acquire(tenant.name, items)
        try:
            return await self._call_model(method, arg, tenant)
        finally:
            self.fair.release(items)

    async def _answer(self, method: str, arg, n: int, tenant: Optional[TenantSpec] = None):
        """``(answers, None)``, or ``(None, response)`` when the request is refused (latency budget, a tenant's rate
        limit), no replica can take it (503) or the model fails on it (500 with an error id)."""
        try:
            return await self._admitted(method, arg, n, tenant)
        except (BackPressureError, DeploymentUnavailableError, *REPLICA_LOST) as exc:
            return None, self._unavailable(exc, self._model_label(tenant))
        except Exception:
            return None, self._internal_error()

    # ---- routes ------------------------------------------------------------------------------

    @fastapi_app.post("/v1/clarify", response_model=ClarifyResponse, responses=ERRORS)
    async def clarify(self, body: ClarifyRequest, request: Request,
                      caller: Caller = Depends(require_api_key)) -> ClarifyResponse:
        """Decide whether the latest turn needs clarification; ask the question if it does."""
        tenant = self._tenant(request, caller, body.model or request.headers.get(MODEL_HEADER))
        check_limits(body, self.max_history_turns, self.max_chars)
        resp, refused = await self._answer("clarify", body, 1, tenant)
        if refused is not None:
            return refused
        self._answered("clarify", [body], [resp], tenant)
        return resp

    @fastapi_app.post("/v1/clarify/batch", response_model=List[ClarifyResponse],
                      responses=ERRORS, openapi_extra=BATCH_BODY_DOC)
    async def clarify_batch(self, body: List[ClarifyRequest], request: Request,
                            caller: Caller = Depends(require_api_key)) -> List[ClarifyResponse]:
        """Several independent requests in one call, of one model; answers in the same order."""
        if len(body) > self.max_batch_requests:
            raise HTTPException(413, detail={
                "error": "request too large", "limit": "max_batch_requests", "max": self.max_batch_requests,
                "value": len(body),
                "message": f"batch has {len(body)} requests; max_batch_requests is {self.max_batch_requests}"})
        if not body:
            raise HTTPException(422, detail=[{"loc": ["body"], "msg": "batch is empty: send at least one request",
                                              "type": "too_short"}])
        named = {r.model for r in body if r.model} | ({request.headers[MODEL_HEADER]} if MODEL_HEADER in request.headers
                                                       else set())
        if len(named) > 1 and self.tenants is not None:
            raise HTTPException(400, detail={"error": "several models", "message": f"one batch is answered by one "
                                             f"model; this one names {sorted(named)}"})
        tenant = self._tenant(request, caller, next(iter(named), None))
        for i, req in enumerate(body):
            check_limits(req, self.max_history_turns, self.max_chars, index=i)
        resps, refused = await self._answer("clarify_many", list(body), len(body), tenant)
        if refused is not None:
            return refused
        self._answered("clarify_batch", list(body), list(resps), tenant)
        return resps

    @fastapi_app.post("/v1/chat/completions", responses=CHAT_ERRORS, openapi_extra=CHAT_BODY_DOC,
                      tags=["OpenAI-compatible"])
    async def chat_completions(self, request: Request, caller: Caller = Depends(require_api_key)) -> JSONResponse:
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
        tenant = self._tenant(request, caller, chat.model)
        check_limits(req, self.max_history_turns, self.max_chars)
        resp, refused = await self._answer("clarify", req, 1, tenant)
        if refused is not None:
            return openai_error(refused)
        conversation = (chat.metadata or {}).get("conversation_id")
        if isinstance(conversation, (str, int)) and str(conversation):
            req = req.model_copy(update={"conversation_id": str(conversation)[:256]})
        self._answered("chat_completions", [req], [resp], tenant)
        return JSONResponse(chat_completion(resp, self._model_label(tenant)))

    @fastapi_app.get("/v1/models", responses={401: ERRORS[401]}, tags=["OpenAI-compatible"])
    async def models(self, caller: Caller = Depends(require_api_key)) -> dict:
        """The served models the caller may call, as OpenAI lists models (``id`` is what chat completions answer
        with; a key scoped to a tenant sees its own only)."""
        if self.tenants is not None:
            visible = self.tenants.visible(caller)
            try:  # the versions one model replica holds now (a tenant no replica has loaded yet: null)
                versions = await asyncio.wait_for(self._versions(), timeout=self.ready_timeout_s)
            except Exception:
                versions = {}
            return models_list([(t.name, versions.get(t.name)) for t in visible], self.started)

        async def _version():
            return await self.model.version.remote()

        try:
            version = await asyncio.wait_for(_version(), timeout=self.ready_timeout_s)
        except Exception:  # listing the model never fails on a replica that is still loading
            version = None
        return model_list(self.model_id, version, self.started)

    async def _versions(self) -> dict:
        return await self.model.versions.remote()

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


