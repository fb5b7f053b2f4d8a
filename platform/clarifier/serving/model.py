"""The model deployment (``ClarifierModel``): one engine per replica, dynamic batches, model hot-switch.

It resolves a model URI (``models:/name@alias``, ``models:/name/3``, ``runs:/...``, ``s3://...`` or a
folder) through :func:`clarifier.engine.loading.load_engine`, loads it once per replica (the replica
takes no traffic before that) and answers in ``@serve.batch`` batches; for ``models:/name@alias`` it
polls the alias and hot-switches versions (:mod:`clarifier.serving.lifecycle`).
"""

import asyncio
import functools
import logging
import time
from typing import List, Optional, Union

from ray import serve

from clarifier.core.schema import ClarifyRequest, ClarifyResponse
from clarifier.serving.lifecycle import ModelLifecycle, mlflow_alias_probe, parse_alias_uri
from clarifier.serving.metrics import ModelMetrics


# A child of Serve's logger, so replica logs carry these lines (with replica and request ids).
log = logging.getLogger("ray.serve.clarifier")


class ServingError(RuntimeError):
    """The application could not be built or did not become ready; the message says why."""


# ---- model deployment ------------------------------------------------------------------------


class _Failed:
    """A per-request failure inside a batch (so one bad request does not fail its neighbours)."""

    def __init__(self, message: str):
        self.message = message


def replica_engine(uri: str, *, max_new_tokens: int = 48, tracking_uri: Optional[str] = None,
                   cache_dir: Optional[str] = None, use_gpu: bool = False, precision: str = "auto",
                   decode: str = "auto"):
    """The replica's engine for ``uri`` in ``precision`` (on CUDA when ``use_gpu``); ``cache_dir``
    caches downloaded model folders."""
    from clarifier.engine.loading import load_engine
    from clarifier.engine.models import ModelResolutionError

    try:
        engine = load_engine(uri, download_dir=cache_dir, tracking_uri=tracking_uri, max_new_tokens=max_new_tokens,
                             precision=precision, device="cuda" if use_gpu else "cpu", decode=decode)
        engine.decoder  # noqa: B018 -- its weights prepared once per replica, at load, not by the first request that asks
        return engine
    except ModelResolutionError as exc:
        if use_gpu and "CUDA" in str(exc):
            raise ServingError("gpus_per_replica > 0 but CUDA is not available in the model replica") from exc
        raise


async def answer_batch(clarify, items: list, metrics: ModelMetrics) -> List[Union[ClarifyResponse, _Failed]]:
    """``clarify(items)`` in a thread (the engine is synchronous and CPU/GPU-bound: the event loop stays free for
    health checks and queueing; one batch at a time, max_concurrent_batches=1); when the batch fails, each item again
    alone, so one bad request does not fail its neighbours (it gets a :class:`_Failed`)."""
    metrics.batch_size.observe(len(items))
    t0 = time.perf_counter()
    try:
        out = list(await asyncio.to_thread(clarify, items))
        metrics.batch_latency.observe(time.perf_counter() - t0)
        return out
    except Exception:
        if len(items) == 1:
            log.exception("clarify failed")
            return [_Failed("clarify failed")]
    log.warning("batch of %d failed; retrying one by one", len(items))
    out: List[Union[ClarifyResponse, _Failed]] = []
    for item in items:
        try:
            out.extend(await asyncio.to_thread(clarify, [item]))
        except Exception:
            log.exception("clarify failed")
            out.append(_Failed("clarify failed"))
    return out


@serve.deployment(name="ClarifierModel")
class ClarifierModel:
    """The current :class:`ClarifierEngine` of this replica; requests are batched dynamically."""

    def __init__(self, model_uri: str, max_new_tokens: int = 48, tracking_uri: Optional[str] = None,
                 max_batch_size: int = 8, batch_wait_timeout_s: float = 0.05,
                 cache_dir: Optional[str] = None, model_refresh_s: float = 0.0, use_gpu: bool = False,
                 ray_metrics: bool = True, precision: str = "auto", cpus: float = 1, decode: str = "auto"):
        from clarifier.engine.precision import set_threads

        self.metrics = ModelMetrics(ray=ray_metrics)
        # Exactly the CPUs this replica reserved, so replicas on one node do not oversubscribe it.
        threads = set_threads(cpus)
        load = functools.partial(replica_engine, max_new_tokens=max_new_tokens, tracking_uri=tracking_uri,
                                 cache_dir=cache_dir, use_gpu=use_gpu, precision=precision, decode=decode)
        alias = parse_alias_uri(model_uri)
        probe = mlflow_alias_probe(alias[0], alias[1], tracking_uri) if alias and model_refresh_s > 0 else None
        self.lifecycle = ModelLifecycle(load, model_uri, probe=probe, refresh_s=model_refresh_s,
                                        on_switch=self._on_switch)
        t0 = time.time()
        self.lifecycle.load_initial()
        self.metrics.load_s.observe(time.time() - t0)
        self.metrics.info.set(1, version=self.lifecycle.version)
        log.info("model %s loaded in %.1f s: precision %s, decode %s, %d torch thread(s), %s, max batch %d",
                 self.lifecycle.version, time.time() - t0, self.lifecycle.engine.precision,
                 self.lifecycle.engine.decode_path, threads,
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
        return await answer_batch(self.lifecycle.engine.clarify, list(requests), self.metrics)

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


