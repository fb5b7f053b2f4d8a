"""The Clarifier Ray Serve application: a batched model deployment behind a FastAPI ingress.

Two deployments (:mod:`clarifier.serving.model`, :mod:`clarifier.serving.ingress`); this module builds,
configures and runs them:

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
  ``POST /v1/chat/completions`` OpenAI chat completions in the query-clarification contract of IBM's
                              RAG intrinsics (``clarifier.core.chat_completions``); errors in OpenAI's shape
  ``GET /v1/models``          the served model, as OpenAI lists models
  ``GET /metrics``            Prometheus text of this ingress replica (see ``metrics``)
  ``GET /healthz``            the process is up (no key needed)
  ``GET /readyz``             200 + model version once a model replica answers, else 503 (no key)
  ``/docs``, ``/openapi.json``
  ``GET /``, ``GET /playground`` the playground: a self-contained HTML page (no key to load it, not in
                              the OpenAPI document) whose form calls ``POST v1/clarify``

  Status codes: 400 body not UTF-8 (FastAPI cannot decode it), 401 missing/wrong API key (when
  keys are configured), 413 over a size limit (the body names it), 422 bad body (names the
  field), 503 overloaded (``max_queued_requests`` requests already wait for a model replica; JSON
  body names the limit, ``Retry-After`` set) or no replica could answer, 500 without internals on
  unexpected errors (an error id points into the server log).

  With ``serve.request_log.uri`` set, every answered request is also written, off the request path,
  to a rotated JSONL request log (:mod:`clarifier.serving.request_log`). With
  ``serve.shadow_model_uri`` a third deployment (``ClarifierShadow``, one replica) scores a share of the
  answered requests after the answer is sent; its answers go to the log and the metrics, never to a client.

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

import logging
import os
import time
from typing import Callable, Optional, Tuple

from pydantic import ValidationError
from ray import serve

from clarifier.core.config import ConfigError, ServeConfig, set_dotted, validation_messages
from clarifier.runtime.cluster import FORWARDED
from clarifier.runtime.mlflow_uri import tracking_uri as resolve_tracking_uri
from clarifier.serving.auth import ENV_VAR as API_KEYS_ENV
from clarifier.serving.auth import key_digests, load_api_keys

from clarifier.serving.ingress import ClarifierIngress
from clarifier.serving.model import ClarifierModel, ServingError
from clarifier.serving.request_log import resolved_uri

# A child of Serve's logger, so replica logs carry these lines (with replica and request ids).
log = logging.getLogger("ray.serve.clarifier")

APP_NAME = "clarifier"
SHADOW_DEPLOYMENT = "ClarifierShadow"  # serve.shadow_model_uri: the challenger's deployment

# Non-secret variables forwarded to replicas when set on the driver (credentials are not: they
# belong to the cluster's own environment / instance profile; API keys never leave the builder).
FORWARDED_ENV = FORWARDED  # the one list of non-secret settings, see clarifier.runtime.cluster



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
    engine_args = dict(max_new_tokens=cfg.max_new_tokens, tracking_uri=tracking_uri, max_batch_size=cfg.max_batch_size,
                       batch_wait_timeout_s=cfg.batch_wait_timeout_s, model_refresh_s=cfg.model_refresh_s,
                       use_gpu=cfg.gpus_per_replica > 0, precision=cfg.precision, cpus=cfg.cpus_per_replica,
                       decode=cfg.decode)
    tenants = None
    if cfg.tenants_file:
        if cfg.shadow_model_uri:
            raise ConfigError("serve.shadow_model_uri is a single-model deployment's; with serve.tenants_file, give "
                              "the tenant its challenger in the tenants file (shadow_model_uri, shadow_share)")
        tenants, model = _tenant_model(cfg, model_opts, engine_args)
    else:
        model = ClarifierModel.options(**model_opts).bind(cfg.model_uri, **engine_args)
    shadow = None
    if cfg.shadow_model_uri:
        # The challenger: one replica of the same deployment class, its own name, its own bounded queue (a slow
        # shadow refuses work instead of queueing it; the ingress counts that as a failed shadow call).
        shadow_opts = {**{k: v for k, v in model_opts.items() if k != "autoscaling_config"}, "num_replicas": 1,
                       "max_queued_requests": max(1, cfg.shadow_max_inflight)}
        shadow = ClarifierModel.options(name=SHADOW_DEPLOYMENT, **shadow_opts).bind(cfg.shadow_model_uri, **engine_args)
    budget = cfg.latency_budget_s if cfg.max_queued_requests is None else None
    first_replicas = (cfg.autoscaling.initial_replicas or cfg.autoscaling.min_replicas) if cfg.autoscaling.enabled \
        else cfg.num_replicas
    request_log = None
    if cfg.request_log.uri:
        try:
            uri = resolved_uri(cfg.request_log.uri)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        request_log = cfg.request_log.model_copy(update={"uri": uri}).model_dump()
    return ClarifierIngress.options(**ingress_opts).bind(
        model, model_id=served_model_id(cfg), max_history_turns=cfg.max_history_turns, max_chars=cfg.max_chars,
        request_log=request_log, shadow=shadow, shadow_share=cfg.shadow_share,
        shadow_max_inflight=cfg.shadow_max_inflight, shadow_timeout_s=cfg.shadow_timeout_s,
        api_key_digests=digests,
        max_batch_requests=cfg.max_batch_requests, max_queued_requests=model_opts["max_queued_requests"],
        latency_budget_s=budget, initial_limit=2 * model_opts["max_ongoing_requests"] * first_replicas,
        tenants=tenants,
        fair_slots=model_opts["max_ongoing_requests"] * (cfg.autoscaling.max_replicas if cfg.autoscaling.enabled
                                                         else cfg.num_replicas),
    )


def _tenant_model(cfg: ServeConfig, model_opts: dict, engine_args: dict):
    """``(the ingress's tenants argument, the bound ClarifierTenantModel)`` for ``serve.tenants_file``; a file that
    cannot be used is a ConfigError naming it."""
    from clarifier.core.tenants import TenantsFileError
    from clarifier.serving.tenant_model import ClarifierTenantModel
    from clarifier.serving.tenants import read_tenants

    try:
        spec, text = read_tenants(cfg.tenants_file)
    except TenantsFileError as exc:
        raise ConfigError(str(exc)) from None
    default = next((t for t in spec.tenants if t.name == spec.default), None)
    # Each replica loads the default tenant's (else the first tenant's) weights before it takes traffic.
    preload = [(default or spec.tenants[0]).mux_id]
    model = ClarifierTenantModel.options(**model_opts).bind(
        preload=preload, max_models_per_replica=cfg.max_models_per_replica,
        max_adapters_per_replica=cfg.max_adapters_per_replica, **engine_args)
    log.info("serving %d tenant(s) from %s: %s", len(spec.tenants), cfg.tenants_file,
             ", ".join(t.name for t in spec.tenants))
    return {"file": cfg.tenants_file, "refresh_s": cfg.tenants_refresh_s, "spec": spec.model_dump(), "text": text}, model


def served_model_id(cfg: ServeConfig) -> str:
    """The id OpenAI-compatible clients see (``serve.model_name``, else the registered model's name,
    else the model folder's or object's last path part)."""
    if cfg.model_name:
        return cfg.model_name
    uri = cfg.model_uri.rstrip("/")
    if uri.startswith("models:/"):
        return uri[len("models:/"):].split("@")[0].split("/")[0] or "clarifier"
    if uri.startswith(("runs:/", "builtin:")):
        return uri.split(":", 1)[1].strip("/").replace("/", "-") or "clarifier"
    return uri.rsplit("/", 1)[-1] or "clarifier"


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
              ready_timeout_s: float = 300.0, say: Callable[[str], None] = print) -> str:
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
        operator = len(load_api_keys(cfg.api_keys_file))
        what, scoped = f"model {info.get('model_version')}", 0
        if cfg.tenants_file:
            from clarifier.serving.tenants import read_tenants

            spec, _ = read_tenants(cfg.tenants_file)
            scoped = sum(len(t.keys_sha256) for t in spec.tenants)
            what = (f"{len(spec.tenants)} tenant(s) from {cfg.tenants_file} ({', '.join(t.name for t in spec.tenants)}"
                    + (f"; default {spec.default}" if spec.default else "") + ")")
        auth = (f"on ({operator} operator, {scoped} tenant-scoped)" if cfg.tenants_file else "on") \
            if operator or scoped else f"OFF (no ${API_KEYS_ENV} / serve.api_keys_file)"
        extra = (f", request log {cfg.request_log.uri}" if cfg.request_log.uri else "") + \
            (f", shadow {cfg.shadow_model_uri}" if cfg.shadow_model_uri else "")
        say(f"Clarifier serving {what} at {url} (playground {url}/playground, docs "
            f"{url}/docs, OpenAI-compatible base_url {url}/v1, API keys {auth}{extra}); Ctrl-C to stop")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            serve.shutdown()
    return url
