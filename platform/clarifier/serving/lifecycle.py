"""Model lifecycle inside a model replica: load once, watch a registry alias, hot-switch.

A replica serving ``models:/<name>@<alias>`` polls the alias every ``serve.model_refresh_s``
seconds from a background thread. When the alias points at another version, that version is loaded
*beside* the current engine (requests keep being answered by the old one meanwhile), the engine
reference is swapped in one assignment, and the old engine is released: batches already running
keep their own reference to it and finish on it, so no request fails during a switch. Every
answer carries the version of the engine that produced it.

A failed probe (registry unreachable) or a failed load keeps the current engine; a version that
failed to load is retried with exponential backoff (``refresh_s * 2**failures``, at most 1 h).

Replicas switch independently, so across replicas there is a window of up to ``model_refresh_s``
(plus load time) where both versions answer. No Ray, no MLflow here (they come in through
``probe``/``load`` callables), so it is unit-tested with fakes.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any, Callable, Optional

from clarifier.runtime.retry import RetryPolicy

log = logging.getLogger("ray.serve.clarifier")

MAX_RETRY_S = 3600.0


def parse_alias_uri(uri: str) -> Optional[tuple[str, str]]:
    """``models:/name@alias`` -> (name, alias); any other URI -> None (nothing to watch)."""
    if not uri.startswith("models:/"):
        return None
    rest = uri[len("models:/"):].strip("/")
    if "@" not in rest:
        return None
    name, alias = rest.split("@", 1)
    return (name, alias) if name and alias else None


def pinned_uri(version_label: str) -> str:
    """``name/3`` (the label ``resolve_model`` gives registry versions) -> ``models:/name/3``."""
    return f"models:/{version_label}"


def mlflow_alias_probe(name: str, alias: str, tracking_uri: Optional[str]) -> Callable[[], str]:
    """A probe returning the version label (``name/3``) the alias points at now."""

    def probe() -> str:
        from mlflow import MlflowClient

        mv = MlflowClient(tracking_uri=tracking_uri).get_model_version_by_alias(name, alias)
        return f"{name}/{mv.version}"

    return probe


def _free_accelerator_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # pragma: no cover - best effort
        pass


class ModelLifecycle:
    """Holds the current engine (anything with a ``version`` attribute) and switches it."""

    def __init__(self, load: Callable[[str], Any], uri: str, *, probe: Optional[Callable[[], str]] = None,
                 refresh_s: float = 0.0, on_switch: Optional[Callable[[str, str, float], None]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self._load = load
        self.uri = uri
        self._probe = probe
        self.refresh_s = refresh_s
        self._on_switch = on_switch
        self._clock = clock
        # the wait before loading a failed version again: max(refresh_s, 1) * 2**failures
        self._retry = RetryPolicy(min_s=2 * max(refresh_s, 1.0), max_s=MAX_RETRY_S)
        self._engine: Any = None
        self._failures: dict[str, tuple[int, float]] = {}  # version -> (failures, retry_at)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # one poll at a time (thread vs. an explicit poll_once)

    # ---- state --------------------------------------------------------------------------------

    @property
    def engine(self) -> Any:
        """The current engine; read it once per batch and use that reference throughout."""
        if self._engine is None:
            raise RuntimeError(f"model {self.uri} is not loaded")
        return self._engine

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    @property
    def version(self) -> str:
        return self.engine.version

    @property
    def watching(self) -> bool:
        return self._probe is not None and self.refresh_s > 0

    # ---- transitions --------------------------------------------------------------------------

    def load_initial(self) -> Any:
        t0 = time.time()
        self._engine = self._load(self.uri)
        log.info("loaded model %s (%s) in %.1fs", self.uri, self._engine.version, time.time() - t0)
        return self._engine

    def poll_once(self) -> bool:
        """Probe the alias; load and switch when it moved. True when a switch happened."""
        if self._probe is None:
            return False
        with self._lock:
            current = self.engine.version
            try:
                target = self._probe()
            except Exception as exc:
                log.warning("cannot read the version behind %s (%s: %s); keeping %s",
                            self.uri, type(exc).__name__, exc, current)
                return False
            if target == current:
                return False
            failures, retry_at = self._failures.get(target, (0, 0.0))
            if failures and self._clock() < retry_at:
                return False
            log.info("%s moved from %s to %s; loading it beside the current model", self.uri, current, target)
            t0 = time.time()
            try:
                new = self._load(pinned_uri(target))
            except Exception:
                failures += 1
                delay = self._retry.backoff(failures)
                self._failures[target] = (failures, self._clock() + delay)
                log.exception("loading %s failed (attempt %d); keeping %s, retrying in %.0fs",
                              target, failures, current, delay)
                return False
            load_s = time.time() - t0
            old, self._engine = self._engine, new  # the switch: one reference assignment
            self._failures.pop(target, None)
            del old  # running batches hold their own reference and finish on the old engine
            _free_accelerator_memory()
            log.info("switched %s -> %s (loaded in %.1fs)", current, new.version, load_s)
            if self._on_switch is not None:
                try:
                    self._on_switch(current, new.version, load_s)
                except Exception:  # metrics must never break serving
                    log.exception("on_switch callback failed")
            return True

    def start(self) -> None:
        """Start the background watcher (no-op unless a probe and refresh_s > 0 are set)."""
        if not self.watching or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="clarifier-model-watch", daemon=True)
        self._thread.start()
        log.info("watching %s every %.1fs for a new version", self.uri, self.refresh_s)

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.poll_once()
            except Exception:  # never let the watcher die
                log.exception("model watcher iteration failed")

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
