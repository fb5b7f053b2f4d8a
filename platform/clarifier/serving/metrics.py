"""Prometheus metrics of the Clarifier service.

Every metric is recorded twice from the replica that owns it:

* through ``ray.serve.metrics`` (Counter / Histogram / Gauge) -- exported by Ray's metrics agent
  on every node (``ray start --metrics-export-port=8080``; KubeRay pods expose it as the
  ``metrics`` port) with the ``ray_`` prefix and Serve's ``deployment``/``replica``/``application``
  tags. This is the cluster-wide view: scrape every node.
* into a private ``prometheus_client`` registry of the *ingress* replica, rendered by
  ``GET /metrics`` on the HTTP API (only that ingress replica's counts; behind a load balancer with
  several ingress replicas, scrape Ray's endpoint instead).

Ingress (per HTTP request / answer; ``model`` is the model id that answered: the tenant with ``serve.tenants_file``,
empty where a request was refused before its model was known):
  ``clarifier_requests_total{model,route,status}``, ``clarifier_request_latency_seconds{model,route}``,
  ``clarifier_decisions_total{model,decision=clarify|answer}``, ``clarifier_path_total{model,path=fast|generate}``
  (fast path = decided in the single scoring pass, no decoding; share = fast / total),
  ``clarifier_invalid_outputs_total{model}``,
  ``clarifier_rejected_total{model,reason=backpressure|latency_budget|rate_limit|auth|tenant}``,
  ``clarifier_tenants``, ``clarifier_tenants_reloads_total{outcome=applied|refused}`` (``serve.tenants_file``),
  ``clarifier_admission_limit``, ``clarifier_measured_throughput`` (latency-budget admission, see ``admission``),
  ``clarifier_replica_lost_total{outcome=retried|unavailable}`` (model calls whose replica died or
  became unreachable mid-request: retried on another replica, or answered 503 once retries ran out),
  ``clarifier_request_log_records_total{outcome=written|dropped_overflow|dropped_shutdown}``,
  ``clarifier_request_log_buffered`` (the request log, see ``request_log``),
  ``clarifier_shadow_total{model,outcome=agree|disagree|failed|skipped}``,
  ``clarifier_shadow_confidence_abs_diff{model}`` (the shadow model: ``serve.shadow_model_uri``, or a tenant's
  ``shadow_model_uri``).
Model replica (Ray metrics only):
  ``clarifier_batch_size`` (requests per engine call), ``clarifier_batch_latency_seconds``,
  ``clarifier_model_switches_total``, ``clarifier_model_load_seconds``, ``clarifier_model_info{version}``.
"""

from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("ray.serve.clarifier")

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
LOAD_BUCKETS = [1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0]
SHADOW_DIFF_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


class _Dual:
    """One metric in a prometheus_client registry and/or as a Ray Serve metric."""

    def __init__(self, kind: str, name: str, doc: str, labels: tuple = (), registry=None, ray: bool = True,
                 buckets: Optional[list] = None):
        self.labels = labels
        self.prom = None
        self.ray = None
        if registry is not None:
            import prometheus_client as pc

            cls = {"counter": pc.Counter, "histogram": pc.Histogram, "gauge": pc.Gauge}[kind]
            kw = {"buckets": buckets} if kind == "histogram" else {}
            self.prom = cls(name, doc, list(labels), registry=registry, **kw)
        if ray:
            try:
                from ray.serve import metrics as rm

                if kind == "counter":
                    self.ray = rm.Counter(name, description=doc, tag_keys=labels)
                elif kind == "histogram":
                    self.ray = rm.Histogram(name, description=doc, boundaries=buckets, tag_keys=labels)
                else:
                    self.ray = rm.Gauge(name, description=doc, tag_keys=labels)
            except Exception as exc:  # e.g. outside a Ray worker; keep serving
                log.warning("Ray metric %s unavailable (%s: %s)", name, type(exc).__name__, exc)
        self.kind = kind

    def _prom(self, tags: dict):
        return self.prom.labels(**tags) if self.labels else self.prom

    def inc(self, value: float = 1.0, **tags) -> None:
        if self.prom is not None:
            self._prom(tags).inc(value)
        if self.ray is not None:
            self.ray.inc(value, tags=tags or None)

    def observe(self, value: float, **tags) -> None:
        if self.prom is not None:
            self._prom(tags).observe(value)
        if self.ray is not None:
            self.ray.observe(value, tags=tags or None)

    def set(self, value: float, **tags) -> None:
        if self.prom is not None:
            self._prom(tags).set(value)
        if self.ray is not None:
            self.ray.set(value, tags=tags or None)


class IngressMetrics:
    """Request-level metrics, kept by the HTTP ingress."""

    def __init__(self, ray: bool = True, registry=None):
        if registry is None:
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry(auto_describe=True)
        self.registry = registry
        kw = dict(registry=registry, ray=ray)
        self.requests = _Dual("counter", "clarifier_requests_total", "HTTP requests by model, route and status code.",
                              ("model", "route", "status"), **kw)
        self.latency = _Dual("histogram", "clarifier_request_latency_seconds",
                             "HTTP request latency (seconds) by model and route.", ("model", "route"),
                             buckets=LATENCY_BUCKETS, **kw)
        self.decisions = _Dual("counter", "clarifier_decisions_total", "Answers by model and decision (clarify/answer).",
                               ("model", "decision"), **kw)
        self.path = _Dual("counter", "clarifier_path_total",
                          "Answers by model and inference path: fast (decision pass only) or generate.",
                          ("model", "path"), **kw)
        self.invalid = _Dual("counter", "clarifier_invalid_outputs_total",
                             "Generations that did not parse (answered as no clarification), by model.", ("model",),
                             **kw)
        self.rejected = _Dual("counter", "clarifier_rejected_total", "Requests rejected before the model, by model "
                              "(empty: not yet known) and reason.", ("model", "reason"), **kw)
        self.tenants = _Dual("gauge", "clarifier_tenants", "Tenants this ingress serves (serve.tenants_file).", **kw)
        self.tenants_reloads = _Dual("counter", "clarifier_tenants_reloads_total",
                                     "Reads of a changed tenants file, by outcome (applied/refused).", ("outcome",),
                                     **kw)
        self.admission_limit = _Dual("gauge", "clarifier_admission_limit",
                                     "Requests this ingress admits at once (latency budget x measured throughput).", **kw)
        self.throughput = _Dual("gauge", "clarifier_measured_throughput",
                                "Answers per second the model side measured while busy (latency-budget admission).", **kw)
        self.replica_lost = _Dual("counter", "clarifier_replica_lost_total",
                                  "Model calls whose replica died mid-request, by outcome (retried/unavailable).",
                                  ("outcome",), **kw)
        self.request_log_records = _Dual(
            "counter", "clarifier_request_log_records_total",
            "Request-log records by outcome: written, dropped_overflow (max_buffered records already waited for "
            "the store), dropped_shutdown (not written within flush_timeout_s at shutdown).", ("outcome",), **kw)
        self.request_log_buffered = _Dual("gauge", "clarifier_request_log_buffered",
                                          "Request-log records held in memory, not yet in the store.", **kw)
        self.shadow = _Dual("counter", "clarifier_shadow_total",
                            "Requests the shadow model also scored, by model and outcome: agree / disagree (its "
                            "decision vs the champion's), failed, skipped (shadow_max_inflight calls already waiting).",
                            ("model", "outcome"), **kw)
        self.shadow_diff = _Dual("histogram", "clarifier_shadow_confidence_abs_diff",
                                 "|shadow confidence - champion confidence| per shadowed request, by model.", ("model",),
                                 buckets=SHADOW_DIFF_BUCKETS, **kw)

    def observe_request(self, route: str, status: int, seconds: float, model: str = "") -> None:
        self.requests.inc(model=model, route=route, status=str(status))
        self.latency.observe(seconds, model=model, route=route)

    def observe_answer(self, resp, model: str = "") -> None:
        """Count one ClarifyResponse of ``model``: decision, path (no generation = fast), validity."""
        self.decisions.inc(model=model, decision="clarify" if resp.needs_clarification else "answer")
        generated = resp.needs_clarification or not resp.valid_output
        self.path.inc(model=model, path="generate" if generated else "fast")
        if not resp.valid_output:
            self.invalid.inc(model=model)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ModelMetrics:
    """Replica-level metrics of the model deployment (Ray metrics only)."""

    def __init__(self, ray: bool = True, registry=None):
        kw = dict(registry=registry, ray=ray)
        self.batch_size = _Dual("histogram", "clarifier_batch_size", "Requests per engine call (dynamic batch).",
                                buckets=BATCH_BUCKETS, **kw)
        self.batch_latency = _Dual("histogram", "clarifier_batch_latency_seconds", "Engine time per batch (seconds).",
                                   buckets=LATENCY_BUCKETS, **kw)
        self.switches = _Dual("counter", "clarifier_model_switches_total", "Hot switches to a new model version.", **kw)
        self.load_s = _Dual("histogram", "clarifier_model_load_seconds", "Model load time (seconds).",
                            buckets=LOAD_BUCKETS, **kw)
        self.info = _Dual("gauge", "clarifier_model_info", "1 for the model version this replica serves.",
                          ("version",), **kw)
