"""The Clarifier Ray Serve application: a batched model deployment behind a FastAPI ingress.

Two deployments:

* ``ClarifierModel`` -- resolves a model URI (``models:/name@alias``, ``models:/name/3``,
  ``runs:/...``, ``s3://...`` or a local model folder), loads :class:`ClarifierEngine` once per
  replica and answers requests in dynamic batches (``@serve.batch``; size and wait time from
  :class:`ServeConfig`).
* ``ClarifierIngress`` -- the HTTP API (FastAPI):

  ``POST /v1/clarify``  ClarifyRequest -> ClarifyResponse (413 over limits, 422 bad body,
  500 without internals on unexpected errors); ``GET /healthz`` (process is up);
  ``GET /readyz`` (200 + model version once the model replica answers, else 503); ``/docs``.

Entry points::

    serve run clarifier.serving.app:app_builder model_uri=models:/clarifier@champion
    serve deploy serve/serve_config.yaml
    run_local(ServeConfig(model_uri="/path/to/model_folder"))   # from Python; returns base URL

Environment of the driver does not reach replicas on a remote cluster, so the MLflow tracking URI
is passed explicitly as a deployment argument, and a few non-secret settings (S3 endpoint, region,
cache folder) are forwarded through the replicas' ``runtime_env``.
"""

import asyncio
import logging
import os
import time
import uuid
from typing import Any, List, Optional, Union

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve

from ..config import ConfigError, ServeConfig
from ..schema import ClarifyRequest, ClarifyResponse

# A child of Serve's logger, so replica logs carry these lines (with replica and request ids).
log = logging.getLogger("ray.serve.clarifier")

APP_NAME = "clarifier"
API_TITLE = "Clarifier"

# Non-secret variables forwarded to replicas when set on the driver (credentials are not: they
# belong to the cluster's own environment / instance profile).
FORWARDED_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_S3_ENDPOINT_URL",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "CLARIFIER_CACHE",
    "HF_HOME",
)


class ServingError(RuntimeError):
    """The application could not be built or did not become ready; the message says why."""


# ---- model deployment ------------------------------------------------------------------------


class _Failed:
    """A per-request failure inside a batch (so one bad request does not fail its neighbours)."""

    def __init__(self, message: str):
        self.message = message


@serve.deployment(name="ClarifierModel")
class ClarifierModel:
    """One loaded :class:`ClarifierEngine` per replica; requests are batched dynamically."""

    def __init__(self, model_uri: str, max_new_tokens: int = 48, tracking_uri: Optional[str] = None,
                 max_batch_size: int = 8, batch_wait_timeout_s: float = 0.05,
                 cache_dir: Optional[str] = None):
        from ..inference import ClarifierEngine
        from ..registry.registry import resolve_model_uri

        t0 = time.time()
        resolved = resolve_model_uri(model_uri, cache_dir=cache_dir, tracking_uri=tracking_uri)
        self.engine = ClarifierEngine.from_folder(resolved.folder, version=resolved.version,
                                                  max_new_tokens=max_new_tokens)
        self._version = resolved.version
        self._clarify_batch.set_max_batch_size(max_batch_size)
        self._clarify_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        log.info("loaded model %s (%s) in %.1fs", model_uri, resolved.version, time.time() - t0)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def _clarify_batch(self, requests: List[ClarifyRequest]) -> List[Union[ClarifyResponse, _Failed]]:
        # The engine is synchronous and CPU/GPU-bound: run it off the event loop so health checks
        # and queueing stay responsive. One batch at a time (max_concurrent_batches=1).
        try:
            return list(await asyncio.to_thread(self.engine.clarify, list(requests)))
        except Exception:
            if len(requests) == 1:
                log.exception("clarify failed")
                return [_Failed("clarify failed")]
        log.warning("batch of %d failed; retrying one by one", len(requests))
        out: List[Union[ClarifyResponse, _Failed]] = []
        for r in requests:
            try:
                out.extend(await asyncio.to_thread(self.engine.clarify, [r]))
            except Exception:
                log.exception("clarify failed")
                out.append(_Failed("clarify failed"))
        return out

    async def clarify(self, request: ClarifyRequest) -> ClarifyResponse:
        result = await self._clarify_batch(request)
        if isinstance(result, _Failed):
            raise RuntimeError(result.message)
        return result

    def version(self) -> str:
        return self._version


# ---- HTTP ingress ----------------------------------------------------------------------------

fastapi_app = FastAPI(
    title=API_TITLE,
    description="Decides whether the latest user turn of a RAG conversation needs a clarifying "
                "question, and if so asks it, grounded on earlier turns and passages.",
    version="1",
)


def request_size(req: ClarifyRequest) -> int:
    """Characters counted against ``max_chars``: history texts + query + passage texts."""
    return sum(len(t.text) for t in req.history) + len(req.query) + sum(len(p.text) for p in req.passages)


def check_limits(req: ClarifyRequest, max_history_turns: int, max_chars: int) -> None:
    """Raise HTTP 413 naming the limit and the value when a request is too large."""
    if len(req.history) > max_history_turns:
        raise HTTPException(413, detail={
            "error": "request too large", "limit": "max_history_turns", "max": max_history_turns,
            "value": len(req.history),
            "message": f"history has {len(req.history)} turns; max_history_turns is {max_history_turns}",
        })
    size = request_size(req)
    if size > max_chars:
        raise HTTPException(413, detail={
            "error": "request too large", "limit": "max_chars", "max": max_chars, "value": size,
            "message": f"history + query + passages have {size} characters; max_chars is {max_chars}",
        })


@serve.deployment(name="ClarifierIngress")
@serve.ingress(fastapi_app)
class ClarifierIngress:
    def __init__(self, model: Any, max_history_turns: int = 50, max_chars: int = 20000,
                 ready_timeout_s: float = 5.0):
        self.model = model  # DeploymentHandle to ClarifierModel
        self.max_history_turns = max_history_turns
        self.max_chars = max_chars
        self.ready_timeout_s = ready_timeout_s

    @fastapi_app.post("/v1/clarify", response_model=ClarifyResponse,
                      responses={413: {"description": "history or total text over the configured limits"},
                                 500: {"description": "internal error (details only in the server log)"}})
    async def clarify(self, body: ClarifyRequest) -> ClarifyResponse:
        """Decide whether the latest turn needs clarification; ask the question if it does."""
        check_limits(body, self.max_history_turns, self.max_chars)
        try:
            return await self.model.clarify.remote(body)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("clarify request failed (error_id=%s)", error_id)
            return JSONResponse(status_code=500, content={"detail": {
                "error": "internal error", "error_id": error_id,
                "message": "the model failed on this request; see the server log for the error id"}})

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


def build_app(cfg: ServeConfig, tracking_uri: Optional[str] = None) -> serve.Application:
    """The bound Serve application for ``cfg`` (tracking URI defaults to $MLFLOW_TRACKING_URI)."""
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    env = _forwarded_env(tracking_uri)
    model_actor: dict = {"num_cpus": cfg.cpus_per_replica}
    ingress_actor: dict = {"num_cpus": 0}
    if env:
        model_actor["runtime_env"] = {"env_vars": env}
        ingress_actor["runtime_env"] = {"env_vars": env}
    model = ClarifierModel.options(
        num_replicas=cfg.num_replicas,
        max_ongoing_requests=max(cfg.max_ongoing_requests, cfg.max_batch_size),
        ray_actor_options=model_actor,
    ).bind(
        cfg.model_uri, max_new_tokens=cfg.max_new_tokens, tracking_uri=tracking_uri,
        max_batch_size=cfg.max_batch_size, batch_wait_timeout_s=cfg.batch_wait_timeout_s,
    )
    return ClarifierIngress.options(
        num_replicas=1,
        # The ingress only parses and forwards; let it hold everything the model replicas can take.
        max_ongoing_requests=max(100, cfg.max_ongoing_requests * cfg.num_replicas * 2),
        ray_actor_options=ingress_actor,
    ).bind(model, max_history_turns=cfg.max_history_turns, max_chars=cfg.max_chars)


def parse_app_args(args: Optional[dict]) -> "tuple[ServeConfig, Optional[str]]":
    """``serve run``/config-file args -> (ServeConfig, tracking_uri); a bad key is a ConfigError.

    Every ServeConfig field is accepted (values may be strings, as ``serve run k=v`` passes them),
    plus ``tracking_uri``.
    """
    args = dict(args or {})
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
        msgs = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors()]
        raise ConfigError("invalid Clarifier serve arguments: " + "; ".join(msgs)) from None
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
        print(f"Clarifier serving model {info.get('model_version')} at {url} (docs {url}/docs); Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            serve.shutdown()
    return url
