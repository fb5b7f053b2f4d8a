"""The Clarifier Ray Serve application: a batched model deployment behind a FastAPI ingress.

Two deployments:

* ``ClarifierModel`` -- resolves a model URI (``models:/name@alias``, ``models:/name/3``,
  ``runs:/...``, ``s3://...`` or a local model folder), loads :class:`ClarifierEngine` once per
  replica (the replica takes no traffic before that) and answers requests in dynamic batches
  (``@serve.batch``; size and wait time from :class:`ServeConfig`). For ``models:/name@alias`` a
  background thread polls the alias every ``model_refresh_s`` seconds and hot-switches to a new
  version (loaded beside the old one, swapped atomically, old one freed; see ``lifecycle``).
  Autoscaling, replica resources, ``max_ongoing_requests`` and ``max_queued_requests`` come from
  the config (:func:`deployment_options`).
* ``ClarifierIngress`` -- the HTTP API (FastAPI):

  ``POST /v1/clarify``        ClarifyRequest -> ClarifyResponse
  ``POST /v1/clarify/batch``  [ClarifyRequest, ...] -> [ClarifyResponse, ...] (max_batch_requests)
  ``GET /metrics``            Prometheus text of this ingress replica (see ``metrics``)
  ``GET /healthz``            the process is up (no key needed)
  ``GET /readyz``             200 + model version once a model replica answers, else 503 (no key)
  ``/docs``, ``/openapi.json``

  Status codes: 400 body not UTF-8 (FastAPI cannot decode it), 401 missing/wrong API key (when
  keys are configured), 413 over a size limit (the body names it), 422 bad body (names the
  field), 503 overloaded (``max_queued_requests`` requests already wait for a model replica; JSON
  body names the limit, ``Retry-After`` set) or no replica could answer, 500 without internals on
  unexpected errors (an error id points into the server log).

  A model replica that dies (or becomes unreachable) while it holds a request does not fail that
  request: answering is idempotent, so the ingress sends it again, to another replica (Serve's
  router has dropped the dead one), up to ``REPLICA_LOSS_RETRIES`` times; after that the answer is
  a 503 with ``Retry-After`` (``"error": "unavailable"``), which clients retry -- never a 500.

Entry points::

    serve run clarifier.serving.app:app_builder model_uri=models:/clarifier@champion
    serve deploy serve/serve_config.yaml
    run_local(ServeConfig(model_uri="/path/to/model_folder"))   # from Python; returns base URL

Environment of the driver does not reach replicas on a remote cluster, so the MLflow tracking URI
is passed explicitly as a deployment argument, and a few non-secret settings (S3 endpoint, region,
cache folder) are forwarded through the replicas' ``runtime_env``. API keys are read where the
app is built and only their SHA-256 digests are passed to the ingress (see ``auth``).
"""

import asyncio
import functools
import logging
import os
import time
import uuid
from typing import Any, List, Optional, Tuple, Union

from fastapi import Depends, FastAPI, HTTPException, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPBearer
from pydantic import ValidationError
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from clarifier.core.config import ConfigError, ServeConfig, set_dotted, validation_messages
from clarifier.core.schema import ClarifyRequest, ClarifyResponse
from clarifier.runtime.cluster import FORWARDED
from clarifier.runtime.mlflow_uri import tracking_uri as resolve_tracking_uri
from clarifier.runtime.retry import RetryPolicy
from clarifier.serving.auth import ENV_VAR as API_KEYS_ENV
from clarifier.serving.auth import HEADER as API_KEY_HEADER
from clarifier.serving.auth import ApiKeyAuth, key_digests, load_api_keys, presented_key
from clarifier.serving.admission import LatencyBudget
from clarifier.serving.lifecycle import ModelLifecycle, mlflow_alias_probe, parse_alias_uri
from clarifier.serving.metrics import IngressMetrics, ModelMetrics

# A child of Serve's logger, so replica logs carry these lines (with replica and request ids).
log = logging.getLogger("ray.serve.clarifier")

APP_NAME = "clarifier"
API_TITLE = "Clarifier"
RETRY_AFTER_S = 1
# A model call whose replica died mid-request is sent again this many times (to another replica).
REPLICA_LOSS_RETRIES = 2
# Errors meaning "the replica holding the request is gone", not "the model failed on it".
REPLICA_LOST = (ActorDiedError, ActorUnavailableError)
# Their resends: at once, no backoff (see ClarifierIngress._call_model).
REPLICA_LOSS = RetryPolicy(attempts=REPLICA_LOSS_RETRIES + 1)

# Non-secret variables forwarded to replicas when set on the driver (credentials are not: they
# belong to the cluster's own environment / instance profile; API keys never leave the builder).
FORWARDED_ENV = FORWARDED  # the one list of non-secret settings, see clarifier.runtime.cluster


class ServingError(RuntimeError):
    """The application could not be built or did not become ready; the message says why."""


# ---- model deployment ------------------------------------------------------------------------


class _Failed:
    """A per-request failure inside a batch (so one bad request does not fail its neighbours)."""

    def __init__(self, message: str):
        self.message = message


def replica_engine(uri: str, *, max_new_tokens: int = 48, tracking_uri: Optional[str] = None,
                   cache_dir: Optional[str] = None, use_gpu: bool = False, precision: str = "auto"):
    """The replica's engine for ``uri`` in ``precision`` (on CUDA when ``use_gpu``); ``cache_dir``
    caches downloaded model folders."""
    from clarifier.engine.loading import load_engine
    from clarifier.engine.models import ModelResolutionError

    try:
        return load_engine(uri, download_dir=cache_dir, tracking_uri=tracking_uri, max_new_tokens=max_new_tokens,
                           precision=precision, device="cuda" if use_gpu else "cpu")
    except ModelResolutionError as exc:
        if use_gpu and "CUDA" in str(exc):
            raise ServingError("gpus_per_replica > 0 but CUDA is not available in the model replica") from exc
        raise


@serve.deployment(name="ClarifierModel")
class ClarifierModel:
    """The current :class:`ClarifierEngine` of this replica; requests are batched dynamically."""

    def __init__(self, model_uri: str, max_new_tokens: int = 48, tracking_uri: Optional[str] = None,
                 max_batch_size: int = 8, batch_wait_timeout_s: float = 0.05,
                 cache_dir: Optional[str] = None, model_refresh_s: float = 0.0, use_gpu: bool = False,
                 ray_metrics: bool = True, precision: str = "auto", cpus: float = 1):
        from clarifier.engine.precision import set_threads

        self.metrics = ModelMetrics(ray=ray_metrics)
        # Exactly the CPUs this replica reserved, so replicas on one node do not oversubscribe it.
        threads = set_threads(cpus)
        load = functools.partial(replica_engine, max_new_tokens=max_new_tokens, tracking_uri=tracking_uri,
                                 cache_dir=cache_dir, use_gpu=use_gpu, precision=precision)
        alias = parse_alias_uri(model_uri)
        probe = mlflow_alias_probe(alias[0], alias[1], tracking_uri) if alias and model_refresh_s > 0 else None
        self.lifecycle = ModelLifecycle(load, model_uri, probe=probe, refresh_s=model_refresh_s,
                                        on_switch=self._on_switch)
        t0 = time.time()
        self.lifecycle.load_initial()
        self.metrics.load_s.observe(time.time() - t0)
        self.metrics.info.set(1, version=self.lifecycle.version)
        log.info("model %s loaded in %.1f s: precision %s, %d torch thread(s), %s, max batch %d",
                 self.lifecycle.version, time.time() - t0, self.lifecycle.engine.precision, threads,
                 "cuda" if use_gpu else "cpu", max_batch_size)
        self._clarify_batch.set_max_batch_size(max_batch_size)
        self._clarify_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.lifecycle.start()

    def _on_switch(self, old: str, new: str, load_s: float) -> None:
        self.metrics.switches.inc()
        self.metrics.load_s.observe(load_s)
        self.metrics.info.set(0, version=old)
        self.metrics.info.set(1, version=new)

    def __del__(self):
        lifecycle = getattr(self, "lifecycle", None)
        if lifecycle is not None:
            lifecycle.stop(timeout=1.0)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def _clarify_batch(self, requests: List[ClarifyRequest]) -> List[Union[ClarifyResponse, _Failed]]:
        # One engine for the whole batch: a hot switch in the middle does not affect it (it keeps
        # its reference to the old engine until it finishes).
        engine = self.lifecycle.engine
        self.metrics.batch_size.observe(len(requests))
        t0 = time.perf_counter()
        # The engine is synchronous and CPU/GPU-bound: run it off the event loop so health checks
        # and queueing stay responsive. One batch at a time (max_concurrent_batches=1).
        try:
            out = list(await asyncio.to_thread(engine.clarify, list(requests)))
            self.metrics.batch_latency.observe(time.perf_counter() - t0)
            return out
        except Exception:
            if len(requests) == 1:
                log.exception("clarify failed")
                return [_Failed("clarify failed")]
        log.warning("batch of %d failed; retrying one by one", len(requests))
        out: List[Union[ClarifyResponse, _Failed]] = []
        for r in requests:
            try:
                out.extend(await asyncio.to_thread(engine.clarify, [r]))
            except Exception:
                log.exception("clarify failed")
                out.append(_Failed("clarify failed"))
        return out

    async def clarify(self, request: ClarifyRequest) -> ClarifyResponse:
        result = await self._clarify_batch(request)
        if isinstance(result, _Failed):
            raise RuntimeError(result.message)
        return result

    async def clarify_many(self, requests: List[ClarifyRequest]) -> List[ClarifyResponse]:
        """Answer a list in order; its items join this replica's dynamic batches."""
        results = await asyncio.gather(*(self._clarify_batch(r) for r in requests))
        failed = [i for i, r in enumerate(results) if isinstance(r, _Failed)]
        if failed:
            raise RuntimeError(f"clarify failed for batch items {failed}")
        return list(results)

    def version(self) -> str:
        return self.lifecycle.version


# ---- HTTP ingress ----------------------------------------------------------------------------

fastapi_app = FastAPI(
    title=API_TITLE,
    description="Decides whether the latest user turn of a RAG conversation needs a clarifying "
                "question, and if so asks it, grounded on earlier turns and passages. Send the API "
                f"key as `Authorization: Bearer <key>` or `{API_KEY_HEADER}: <key>`.",
    version="1",
)

ROUTES = {"/v1/clarify": "clarify", "/v1/clarify/batch": "clarify_batch", "/healthz": "healthz",
          "/readyz": "readyz", "/metrics": "metrics", "/docs": "docs", "/openapi.json": "openapi"}


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
    path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return ROUTES.get(path.rstrip("/") or "/", "other")


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


# The batch body is checked in the handler (an empty list is a 422 saying so); the document says it too.
BATCH_BODY_DOC = {"requestBody": {"content": {"application/json": {"schema": {"minItems": 1}}}}}


@serve.deployment(name="ClarifierIngress")
@serve.ingress(fastapi_app)
class ClarifierIngress:
    def __init__(self, model: Any, max_history_turns: int = 50, max_chars: int = 20000,
                 ready_timeout_s: float = 5.0, api_key_digests: Tuple[str, ...] = (),
                 max_batch_requests: int = 32, max_queued_requests: int = -1, ray_metrics: bool = True,
                 latency_budget_s: Optional[float] = None, initial_limit: int = 8):
        self.model = model  # DeploymentHandle to ClarifierModel
        # max_queued_requests null: admission from the latency budget (see serving.admission).
        self.admission = LatencyBudget(latency_budget_s, initial_limit) if latency_budget_s else None
        self.max_history_turns = max_history_turns
        self.max_chars = max_chars
        self.ready_timeout_s = ready_timeout_s
        self.max_batch_requests = max_batch_requests
        self.max_queued_requests = max_queued_requests
        self.auth = ApiKeyAuth(api_key_digests)
        self.metrics = IngressMetrics(ray=ray_metrics)
        if self.auth.enabled:
            log.info("API key authentication is ON (%d key(s) configured)", self.auth.n_keys)
        else:
            log.warning("API key authentication is OFF: no keys configured ($%s / serve.api_keys_file); "
                        "every client is accepted", API_KEYS_ENV)

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

    # ---- routes ------------------------------------------------------------------------------

    @fastapi_app.post("/v1/clarify", response_model=ClarifyResponse, dependencies=AUTH, responses=ERRORS)
    async def clarify(self, body: ClarifyRequest) -> ClarifyResponse:
        """Decide whether the latest turn needs clarification; ask the question if it does."""
        check_limits(body, self.max_history_turns, self.max_chars)
        try:
            resp, refused = await self._admitted("clarify", body, 1)
            if refused is not None:
                return refused
        except (BackPressureError, DeploymentUnavailableError, *REPLICA_LOST) as exc:
            return self._unavailable(exc)
        except Exception:
            return self._internal_error()
        self.metrics.observe_answer(resp)
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
        try:
            resps, refused = await self._admitted("clarify_many", list(body), len(body))
            if refused is not None:
                return refused
        except (BackPressureError, DeploymentUnavailableError, *REPLICA_LOST) as exc:
            return self._unavailable(exc)
        except Exception:
            return self._internal_error()
        for r in resps:
            self.metrics.observe_answer(r)
        return resps

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


# ---- building and running ----------------------------------------------------------------------


def _forwarded_env(tracking_uri: Optional[str]) -> dict:
    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


def autoscaling_config(cfg: ServeConfig) -> Optional[dict]:
    """Serve ``autoscaling_config`` of the ClarifierModel deployment (None when disabled)."""
    a = cfg.autoscaling
    if not a.enabled:
        return None
    out = {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
           "target_ongoing_requests": a.target_ongoing_requests, "upscale_delay_s": a.upscale_delay_s,
           "downscale_delay_s": a.downscale_delay_s, "look_back_period_s": a.look_back_period_s,
           "metrics_interval_s": a.metrics_interval_s}
    if a.initial_replicas is not None:
        out["initial_replicas"] = a.initial_replicas
    return out


def deployment_options(cfg: ServeConfig, env: Optional[dict] = None) -> Tuple[dict, dict]:
    """``.options()`` of (ClarifierModel, ClarifierIngress) for ``cfg``.

    * model: ``max_ongoing_requests`` (raised to ``max_batch_size`` so a replica can fill a batch),
      ``max_queued_requests`` (beyond it the ingress answers 503), CPUs/GPUs per replica, and
      either ``autoscaling_config`` or a fixed ``num_replicas``.
    * ingress (no CPU reserved; it only parses and forwards): holds everything the model replicas
      and their queue can take, twice over, at least 100; beyond as many queued again, Serve's
      proxy answers a plain-text 503. With autoscaling, it scales 1..max_replicas when its
      replicas average half their ``max_ongoing_requests``, with the model's delays.
    """
    model_ongoing = max(cfg.max_ongoing_requests, cfg.max_batch_size)
    model_actor: dict = {"num_cpus": cfg.cpus_per_replica}
    if cfg.gpus_per_replica > 0:
        model_actor["num_gpus"] = cfg.gpus_per_replica
    ingress_actor: dict = {"num_cpus": 0}
    if env:
        model_actor["runtime_env"] = {"env_vars": dict(env)}
        ingress_actor["runtime_env"] = {"env_vars": dict(env)}
    # max_queued_requests null: the ingress admits by the latency budget, Serve's queue is unbounded.
    queued = -1 if cfg.max_queued_requests is None else cfg.max_queued_requests
    model: dict = {"max_ongoing_requests": model_ongoing, "max_queued_requests": queued,
                   "ray_actor_options": model_actor}
    auto = autoscaling_config(cfg)
    max_model_replicas = cfg.autoscaling.max_replicas if auto else cfg.num_replicas
    ingress_ongoing = max(100, 2 * (model_ongoing * max_model_replicas + max(queued, 0)))
    ingress: dict = {"max_ongoing_requests": ingress_ongoing, "max_queued_requests": ingress_ongoing,
                     "ray_actor_options": ingress_actor}
    if auto:
        model["autoscaling_config"] = auto
        ingress["autoscaling_config"] = {
            "min_replicas": 1, "max_replicas": cfg.autoscaling.max_replicas,
            "target_ongoing_requests": ingress_ongoing / 2, "upscale_delay_s": cfg.autoscaling.upscale_delay_s,
            "downscale_delay_s": cfg.autoscaling.downscale_delay_s}
    else:
        model["num_replicas"] = cfg.num_replicas
        ingress["num_replicas"] = 1
    return model, ingress


def build_app(cfg: ServeConfig, tracking_uri: Optional[str] = None) -> serve.Application:
    """The bound Serve application for ``cfg`` (tracking URI defaults to $MLFLOW_TRACKING_URI).

    API keys are read here ($CLARIFIER_API_KEYS, ``cfg.api_keys_file``); a missing or empty key
    file is a ConfigError."""
    tracking_uri = resolve_tracking_uri(tracking_uri)
    if cfg.autoscaling.enabled and "num_replicas" in cfg.model_fields_set and cfg.num_replicas != 1:
        log.warning("serve.autoscaling.enabled: serve.num_replicas=%d is ignored (replicas %d..%d)",
                    cfg.num_replicas, cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas)
    digests = key_digests(load_api_keys(cfg.api_keys_file))
    model_opts, ingress_opts = deployment_options(cfg, _forwarded_env(tracking_uri))
    model = ClarifierModel.options(**model_opts).bind(
        cfg.model_uri, max_new_tokens=cfg.max_new_tokens, tracking_uri=tracking_uri,
        max_batch_size=cfg.max_batch_size, batch_wait_timeout_s=cfg.batch_wait_timeout_s,
        model_refresh_s=cfg.model_refresh_s, use_gpu=cfg.gpus_per_replica > 0, precision=cfg.precision,
        cpus=cfg.cpus_per_replica,
    )
    budget = cfg.latency_budget_s if cfg.max_queued_requests is None else None
    first_replicas = (cfg.autoscaling.initial_replicas or cfg.autoscaling.min_replicas) if cfg.autoscaling.enabled \
        else cfg.num_replicas
    return ClarifierIngress.options(**ingress_opts).bind(
        model, max_history_turns=cfg.max_history_turns, max_chars=cfg.max_chars, api_key_digests=digests,
        max_batch_requests=cfg.max_batch_requests, max_queued_requests=model_opts["max_queued_requests"],
        latency_budget_s=budget, initial_limit=2 * model_opts["max_ongoing_requests"] * first_replicas,
    )


def _nest_dotted(args: dict) -> dict:
    """``{"autoscaling.max_replicas": "2"}`` (as ``serve run k=v`` passes it) -> nested dicts."""
    out: dict = {}
    for key, value in args.items():
        set_dotted(out, str(key), value, what="Clarifier serve argument")
    return out


def parse_app_args(args: Optional[dict]) -> "tuple[ServeConfig, Optional[str]]":
    """``serve run``/config-file args -> (ServeConfig, tracking_uri); a bad key is a ConfigError.

    Every ServeConfig field is accepted (values may be strings, as ``serve run k=v`` passes them;
    nested fields as a mapping or dotted, ``autoscaling.max_replicas=2``), plus ``tracking_uri``.
    """
    args = _nest_dotted(dict(args or {}))
    tracking_uri = args.pop("tracking_uri", None) or None
    unknown = sorted(k for k in args if k not in ServeConfig.model_fields)
    if unknown:
        raise ConfigError(
            f"unknown Clarifier serve argument(s) {unknown}; known: "
            f"{', '.join(sorted([*ServeConfig.model_fields, 'tracking_uri']))}"
        )
    try:
        cfg = ServeConfig.model_validate(args)
    except ValidationError as exc:
        raise ConfigError("invalid Clarifier serve arguments: " + "; ".join(validation_messages(exc))) from None
    return cfg, tracking_uri


def app_builder(args: dict) -> serve.Application:
    """Application builder for ``serve run clarifier.serving.app:app_builder model_uri=...`` and
    Serve config files (``import_path: clarifier.serving.app:app_builder`` with ``args:``)."""
    cfg, tracking_uri = parse_app_args(args)
    return build_app(cfg, tracking_uri)


def base_url(cfg: ServeConfig) -> str:
    host = cfg.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    prefix = "/" + cfg.route_prefix.strip("/") if cfg.route_prefix.strip("/") else ""
    return f"http://{host}:{cfg.port}{prefix}"


def wait_ready(url: str, timeout_s: float = 300.0, interval_s: float = 0.5) -> dict:
    """Poll ``{url}/readyz`` until it is 200; return its body, or raise ServingError on timeout."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            r = httpx.get(f"{url}/readyz", timeout=10.0)
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise ServingError(f"Clarifier at {url} was not ready after {timeout_s:.0f}s (last /readyz: {last})")
        time.sleep(interval_s)


def run_local(cfg: ServeConfig, tracking_uri: Optional[str] = None, blocking: bool = False,
              ready_timeout_s: float = 300.0) -> str:
    """Start Serve on ``cfg.host:cfg.port`` (Ray is started if needed), deploy the app as
    ``clarifier`` and wait for ``/readyz``; returns the base URL. ``blocking`` then serves until
    Ctrl-C (and shuts Serve down)."""
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    try:
        serve.run(build_app(cfg, tracking_uri), name=APP_NAME, route_prefix=cfg.route_prefix)
    except Exception as exc:
        raise ServingError(f"deploying Clarifier (model {cfg.model_uri}) failed: {exc}") from exc
    url = base_url(cfg)
    info = wait_ready(url, timeout_s=ready_timeout_s)
    log.info("Clarifier serving %s at %s (docs: %s/docs)", info.get("model_version"), url, url)
    if blocking:
        auth = "on" if load_api_keys(cfg.api_keys_file) else f"OFF (no ${API_KEYS_ENV} / serve.api_keys_file)"
        print(f"Clarifier serving model {info.get('model_version')} at {url} (docs {url}/docs, API keys {auth}); "
              "Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            serve.shutdown()
    return url
