"""The model deployment of a multi-tenant app (``serve.tenants_file``): many tenants' models, one copy per weights.

A tenant's model is a Clarifier model folder; what a replica loads for it splits in two:

* the **trunk**: the language model (base + adapter, tokenizer, prompt), one :class:`ClarifierEngine` per
  :func:`~clarifier.engine.inference.weights_key`. Models adapted from one (``clarifier adapt``: a new decision head
  and threshold over the same adapter) share a trunk, so fifty such tenants hold one copy of the weights. Trunks are
  kept in an LRU of ``serve.max_adapters_per_replica`` (:class:`TrunkPool`); a tenant with its own LoRA adapter has a
  trunk of its own, loaded on its first request and evicted when least recently used.
* the tenant's **decider**: its head, threshold and version (:class:`~clarifier.engine.inference.Decider`), a few
  kilobytes, behind a :class:`~clarifier.serving.lifecycle.ModelLifecycle` that follows ``models:/name@alias`` and
  hot-switches that tenant alone.

Requests reach a replica through Serve's model multiplexing: the ingress sends each with
``multiplexed_model_id = <tenant>::<model_uri>`` (:attr:`~clarifier.core.tenants.TenantSpec.mux_id`), so Serve routes it
to a replica that already holds that tenant, and ``@serve.multiplexed`` loads tenants on demand and evicts them LRU
(``serve.max_models_per_replica``). A dynamic batch mixes tenants (Serve would split it by model id; see
:func:`_across_tenants`): it is grouped by trunk, and each group is one forward pass with every request read by its
own head (no pass per tenant).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Union

from ray import serve

from clarifier.core.schema import ClarifyRequest, ClarifyResponse
from clarifier.serving.lifecycle import ModelLifecycle, mlflow_alias_probe, parse_alias_uri
from clarifier.serving.metrics import ModelMetrics
from clarifier.serving.model import _Failed, answer_batch, replica_engine

log = logging.getLogger("ray.serve.clarifier")


class TrunkPool:
    """Loaded engines by weights key, least recently used evicted beyond ``max_trunks`` (thread-safe: the
    batches' threads and the tenants' alias watchers share it)."""

    def __init__(self, load: Callable[[Path, str], Any], max_trunks: int,
                 on_load: Optional[Callable[[str, float], None]] = None):
        if max_trunks < 1:
            raise ValueError("max_trunks must be >= 1")
        self._load = load
        self.max_trunks = max_trunks
        self._on_load = on_load
        self._engines: "OrderedDict[str, Any]" = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}  # key -> held while that key loads
        # One engine call at a time in a replica: the engines are not thread-safe (their decision pass hooks the
        # shared model's modules) and the replica's CPUs are its torch threads' anyway.
        self.compute = threading.Lock()
        self.loads = 0
        self.evictions = 0

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._engines)

    def get(self, key: str, folder: Path, version: str) -> Any:
        """The engine of ``key`` (loaded from ``folder`` when not held); it becomes the most recently used. A load
        holds only its own key's lock: batches of the trunks already held go on meanwhile."""
        with self._lock:
            engine = self._engines.get(key)
            if engine is not None:
                self._engines.move_to_end(key)
                return engine
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:  # loaded by another thread while this one waited
                engine = self._engines.get(key)
                if engine is not None:
                    self._engines.move_to_end(key)
                    return engine
            t0 = time.perf_counter()
            engine = self._load(folder, version)
            seconds = time.perf_counter() - t0
            with self._lock:
                self.loads += 1
                self._engines[key] = engine
                self._loading.pop(key, None)
                while len(self._engines) > self.max_trunks:
                    old, _ = self._engines.popitem(last=False)
                    self.evictions += 1
                    log.info("trunk %s evicted (max_adapters_per_replica=%d)", old, self.max_trunks)
        log.info("trunk %s loaded from %s in %.1f s", key, folder, seconds)
        if self._on_load is not None:
            self._on_load(key, seconds)
        return engine


@dataclass(frozen=True)
class Served:
    """One version of a tenant's model as a replica serves it: its trunk's key and folder, and its decider."""

    tenant: str
    key: str
    folder: Path
    decider: Any  # clarifier.engine.inference.Decider

    @property
    def version(self) -> str:
        return self.decider.version


def served_loader(pool: TrunkPool, tenant: str, resolve: Callable[[str], Any]) -> Callable[[str], Served]:
    """``load(uri) -> Served`` for a tenant's lifecycle: resolve the folder, find (or load) its trunk, read its head."""
    from clarifier.engine.decision_head import DecisionHead
    from clarifier.engine.inference import Decider, read_meta, weights_key

    def load(uri: str) -> Served:
        resolved = resolve(uri)
        folder = Path(resolved.folder)
        key = weights_key(folder)
        engine = pool.get(key, folder, resolved.version)
        decider = Decider(DecisionHead.load(folder), read_meta(folder).threshold, resolved.version)
        engine.check_decider(decider)
        return Served(tenant, key, folder, decider)

    return load


class TenantModel:
    """A tenant held by a replica: its lifecycle (alias watch, hot switch) over the shared pool."""

    def __init__(self, tenant: str, uri: str, pool: TrunkPool, resolve: Callable[[str], Any], *,
                 probe: Optional[Callable[[], str]] = None, refresh_s: float = 0.0,
                 on_switch: Optional[Callable[[str, str, float], None]] = None,
                 on_close: Optional[Callable[[], None]] = None):
        self.tenant = tenant
        self.on_close = on_close
        self.lifecycle = ModelLifecycle(served_loader(pool, tenant, resolve), uri, probe=probe, refresh_s=refresh_s,
                                        on_switch=on_switch)
        self.lifecycle.load_initial()
        self.lifecycle.start()

    @property
    def served(self) -> Served:
        return self.lifecycle.engine

    def __del__(self):  # Serve's multiplexer calls it when it evicts this tenant
        lifecycle = getattr(self, "lifecycle", None)
        if lifecycle is not None:
            lifecycle.stop(timeout=1.0)
        on_close = getattr(self, "on_close", None)
        if on_close is not None:
            self.on_close = None
            on_close()


def split_mux_id(mux_id: str) -> tuple[str, str]:
    """``<tenant>::<model_uri>`` -> (tenant, uri); a tenant name has no ``:``."""
    tenant, sep, uri = mux_id.partition("::")
    if not sep or not tenant or not uri:
        raise ValueError(f"multiplexed model id {mux_id!r} is not <tenant>::<model_uri>")
    return tenant, uri


def clarify_grouped(pool: TrunkPool, items: list) -> List[ClarifyResponse]:
    """Answer ``(Served, ClarifyRequest)`` items in order: one engine call per trunk, each request read by its own
    decider."""
    groups: "OrderedDict[str, list[int]]" = OrderedDict()
    for i, (served, _) in enumerate(items):
        groups.setdefault(served.key, []).append(i)
    out: list = [None] * len(items)
    with pool.compute:
        for key, rows in groups.items():
            first = items[rows[0]][0]
            engine = pool.get(key, first.folder, first.version)  # loaded again if evicted since
            answers = engine.clarify([items[r][1] for r in rows], deciders=[items[r][0].decider for r in rows])
            for r, a in zip(rows, answers):
                out[r] = a
    return out


def _across_tenants() -> None:
    """In the current context: no multiplexed model id. Serve's ``@serve.batch`` splits a batch by that id into
    sub-batches run concurrently (one forward pass per tenant); the batch function here reads each request's tenant
    from the request itself, so the id is cleared where a request joins the batch queue and a batch mixes tenants.
    (Serve's private request context: Ray is pinned; were it to change, the pool's compute lock keeps every call
    correct, only no longer one pass per batch -- ``batch_stats`` shows which.)"""
    from ray.serve import context as serve_context

    current = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(current, multiplexed_model_id=""))


@serve.deployment(name="ClarifierModel")
class ClarifierTenantModel:
    """Every tenant's model this replica holds; requests are batched across tenants (see the module)."""

    def __init__(self, preload: Optional[List[str]] = None, max_new_tokens: int = 48,
                 tracking_uri: Optional[str] = None, max_batch_size: int = 8, batch_wait_timeout_s: float = 0.05,
                 cache_dir: Optional[str] = None, model_refresh_s: float = 0.0, use_gpu: bool = False,
                 ray_metrics: bool = True, precision: str = "auto", cpus: float = 1, decode: str = "auto",
                 max_models_per_replica: int = 64, max_adapters_per_replica: int = 4):
        from clarifier.engine.loading import resolve_model
        from clarifier.engine.precision import set_threads

        self.metrics = ModelMetrics(ray=ray_metrics)
        threads = set_threads(cpus)
        self.tracking_uri = tracking_uri
        self.model_refresh_s = model_refresh_s
        load = functools.partial(replica_engine, max_new_tokens=max_new_tokens, tracking_uri=tracking_uri,
                                 cache_dir=cache_dir, use_gpu=use_gpu, precision=precision, decode=decode)
        self.pool = TrunkPool(lambda folder, version: load(str(folder)), max_adapters_per_replica,
                              on_load=lambda _key, s: self.metrics.load_s.observe(s))
        self._resolve = functools.partial(resolve_model, cache_dir=cache_dir, tracking_uri=tracking_uri)
        self._held: dict[str, TenantModel] = {}  # what the multiplexer holds now, by mux id (for versions())
        self._stats = {"batches": 0, "mixed": 0, "most_tenants": 0}
        async def open_tenant(mux_id: str) -> TenantModel:  # a function: Serve keeps its LRU on it (not on a method)
            return await self._open(mux_id)

        self.get_tenant = serve.multiplexed(max_num_models_per_replica=max_models_per_replica)(open_tenant)
        t0 = time.time()
        self._preloaded: dict[str, TenantModel] = {}
        for mux_id in (preload or [])[:max_adapters_per_replica]:
            self._preloaded[mux_id] = self._open_sync(mux_id)
        log.info("tenant replica ready in %.1f s: %d tenant(s) preloaded over %d trunk(s), %d torch thread(s), "
                 "max %d tenants / %d adapters per replica", time.time() - t0, len(self._preloaded),
                 len(self.pool.keys()), threads, max_models_per_replica, max_adapters_per_replica)
        self._clarify_batch.set_max_batch_size(max_batch_size)
        self._clarify_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    def _open_sync(self, mux_id: str) -> TenantModel:
        tenant, uri = split_mux_id(mux_id)
        alias = parse_alias_uri(uri)
        probe = mlflow_alias_probe(alias[0], alias[1], self.tracking_uri) if alias and self.model_refresh_s > 0 else None

        def switched(old: str, new: str, load_s: float) -> None:
            self.metrics.switches.inc()
            log.info("tenant %s switched %s -> %s in %.1f s", tenant, old, new, load_s)

        return TenantModel(tenant, uri, self.pool, self._resolve, probe=probe, refresh_s=self.model_refresh_s,
                           on_switch=switched, on_close=lambda: self._held.pop(mux_id, None))

    async def _open(self, mux_id: str) -> TenantModel:
        held = self._preloaded.pop(mux_id, None)
        if held is None:
            held = await asyncio.to_thread(self._open_sync, mux_id)
        self._held[mux_id] = held
        return held

    def __del__(self):
        for held in list(getattr(self, "_held", {}).values()) + list(getattr(self, "_preloaded", {}).values()):
            held.__del__()

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def _clarify_batch(self, items: list) -> List[Union[ClarifyResponse, _Failed]]:
        tenants = len({served.tenant for served, _ in items})
        self._stats["batches"] += 1
        self._stats["mixed"] += tenants > 1
        self._stats["most_tenants"] = max(self._stats["most_tenants"], tenants)
        return await answer_batch(functools.partial(clarify_grouped, self.pool), list(items), self.metrics)

    async def _batched(self, item: tuple):
        """``item`` through the dynamic batches, which mix tenants (see :func:`_across_tenants`)."""
        ctx = contextvars.copy_context()
        ctx.run(_across_tenants)
        return await asyncio.get_running_loop().create_task(self._clarify_batch(item), context=ctx)

    def batch_stats(self) -> dict:
        """Batches answered by this replica, how many mixed tenants, the most tenants in one."""
        return dict(self._stats)

    async def _served(self) -> Served:
        mux_id = serve.get_multiplexed_model_id()
        if not mux_id:
            raise RuntimeError("a multi-tenant model replica was called without a multiplexed model id")
        return (await self.get_tenant(mux_id)).served

    async def clarify(self, request: ClarifyRequest) -> ClarifyResponse:
        result = await self._batched((await self._served(), request))
        if isinstance(result, _Failed):
            raise RuntimeError(result.message)
        return result

    async def clarify_many(self, requests: List[ClarifyRequest]) -> List[ClarifyResponse]:
        served = await self._served()
        results = await asyncio.gather(*(self._batched((served, r)) for r in requests))
        failed = [i for i, r in enumerate(results) if isinstance(r, _Failed)]
        if failed:
            raise RuntimeError(f"clarify failed for batch items {failed}")
        return list(results)

    def version(self) -> str:
        """Readiness: the replica answers; the version of the tenant it answers for (or a summary)."""
        mux_id = serve.get_multiplexed_model_id()
        for held in (self._held.get(mux_id), self._preloaded.get(mux_id)):
            if held is not None:
                return held.served.version
        return f"{len(self._held) + len(self._preloaded)} tenant(s) over {len(self.pool.keys())} trunk(s)"

    def versions(self) -> dict:
        """Version per tenant this replica holds (GET /v1/models)."""
        out = {}
        for held in list(self._preloaded.values()) + list(self._held.values()):
            out[held.tenant] = held.served.version
        return out
