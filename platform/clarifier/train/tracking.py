"""MLflow logging from the training loop that never stalls or kills training.

``log_metrics`` only appends to a bounded in-memory buffer; a daemon thread sends the buffer in
order, in batches of at most 1000 values (MLflow's ``log_batch`` limit). While the tracking server
is unreachable (refused, timed out, 5xx, 429) the values stay buffered and the thread retries with
capped exponential backoff (1 s doubling to ``retry_max_s``: the package's ``RetryPolicy``); when
the server is back the buffer is flushed, so a short outage leaves no gap in the curves (each value
keeps the timestamp of its step).

Losses are counted, never silent: a step whose values do not fit in the buffer (``max_buffered``
values) is dropped whole, so is a batch the server refuses (4xx: it would never be accepted), and
so is whatever is still buffered when :meth:`SafeTracker.close` gives up waiting (``flush_timeout_s``).
``lost_steps`` / ``lost_values`` say what is missing from the run; ``failed_calls`` counts failed
requests (an outage that was fully recovered has failed calls and no lost steps).

MLflow's own HTTP retries (7, with backoff up to minutes) are turned off in the process that logs
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0``) and each request gets ``request_timeout_s``: this tracker
retries itself, and a dead server must cost the sending thread seconds, not the job minutes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import replace

from clarifier.runtime.retry import RetryPolicy

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # MLflow's limit on metrics in one log_batch request
MAX_TAGS = 100  # ... and on tags


def step_ranges(steps) -> str:
    """``[1, 2, 3, 7, 9, 10]`` -> ``"1-3,7,9-10"`` (sorted, deduplicated)."""
    out: list[str] = []
    s = sorted(set(int(x) for x in steps))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def parse_step_ranges(text: str | None) -> set[int]:
    """Inverse of :func:`step_ranges`."""
    steps: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        a, _, b = part.partition("-")
        steps.update(range(int(a), int(b or a) + 1))
    return steps


def _permanent(exc: Exception) -> bool:
    """A refusal that retrying cannot fix (4xx other than 429); connection errors, timeouts and 5xx
    are transient (MLflow wraps connection errors as INTERNAL_ERROR, i.e. 500)."""
    get = getattr(exc, "get_http_status_code", None)
    if get is None:
        return False
    try:
        code = int(get())
    except Exception:
        return False
    return 400 <= code < 500 and code != 429


def limit_mlflow_http(request_timeout_s: int) -> None:
    """No MLflow-internal retries and a short per-request timeout in this process (the tracker's)."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, int(request_timeout_s)))


class SafeTracker:
    """Logs metrics/tags to one existing MLflow run through a bounded buffer (see the module doc).

    ``client``: anything with MLflow's ``log_batch(run_id, metrics=, tags=)`` and
    ``get_metric_history(run_id, key)`` (default: an ``MlflowClient`` for ``tracking_uri``).
    ``lost_steps``: steps already lost before this tracker (restored from a checkpoint).
    ``sleep``: how :meth:`last_step` waits between its tries (a test passes a recorder).
    """

    def __init__(self, run_id: str | None, tracking_uri: str | None, *, max_buffered: int = 50_000,
                 request_timeout_s: int = 10, retry_min_s: float = 1.0, retry_max_s: float = 10.0,
                 client=None, lost_steps=(), sleep=time.sleep):
        self.run_id = run_id
        self.max_buffered = max(1, int(max_buffered))
        self.retry = RetryPolicy(min_s=retry_min_s, max_s=max(retry_min_s, retry_max_s), sleep=sleep)
        self.request_timeout_s = request_timeout_s
        self.failed_calls = 0
        self.lost_values = 0
        self.lost_steps: set[int] = set(int(s) for s in lost_steps)
        self.peak_buffered = 0
        self.outages = 0  # runs of consecutive failed requests
        self.recovered_at: float | None = None  # when the buffer was last drained after an outage
        self._buf: deque = deque()  # (step, Metric), in logging order
        self._tags: dict[str, str] = {}
        self._up = True  # the last request succeeded
        self._streak = 0  # requests failed in a row
        self._draining = False  # an outage happened and its buffer is not yet drained
        self._cv = threading.Condition()
        self._closed = False
        self._stop = False
        self._sending = False
        self._thread: threading.Thread | None = None
        self._client = client
        if run_id and client is None:
            limit_mlflow_http(request_timeout_s)
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=tracking_uri)
        if self._client is not None:
            self._thread = threading.Thread(target=self._run, name="clarifier-tracker", daemon=True)
            self._thread.start()

    # ---- producer side (the training loop) ---------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._client is not None

    @property
    def buffered(self) -> int:
        with self._cv:
            return len(self._buf)

    def log_metrics(self, metrics: dict[str, float], step: int) -> bool:
        """Buffer one step's values; False when there is no run or the step was dropped (counted)."""
        if self._client is None:
            return False
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, int(step)) for k, v in metrics.items() if v is not None]
        with self._cv:
            if self._closed:
                self._lose([(step, m) for m in ms], "the tracker is closed")
                return False
            if len(self._buf) + len(ms) > self.max_buffered:
                self._lose([(step, m) for m in ms], f"the buffer is full ({self.max_buffered} values)")
                return False
            self._buf.extend((int(step), m) for m in ms)
            self.peak_buffered = max(self.peak_buffered, len(self._buf))
            self._cv.notify_all()
        return True

    def set_tags(self, tags: dict[str, str]) -> bool:
        if self._client is None:
            return False
        with self._cv:
            self._tags.update({k: str(v) for k, v in tags.items()})
            self._cv.notify_all()
        return True

    def note_lost_steps(self, steps) -> None:
        """Steps known to be missing from the run for reasons outside this tracker (e.g. a crashed
        attempt's buffer)."""
        with self._cv:
            self.lost_steps.update(int(s) for s in steps)

    def flush(self, timeout_s: float, only_if_up: bool = False) -> bool:
        """Wait up to ``timeout_s`` until everything buffered is sent; True when nothing is left.
        ``only_if_up``: return at once while the server is known to be down (a checkpoint must not
        wait for an outage)."""
        if self._client is None:
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cv:
            self._cv.notify_all()
            while self._pending_locked() or self._sending:
                if only_if_up and not self._up:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(timeout=min(left, 0.5))
            return True

    def close(self, timeout_s: float) -> dict:
        """Flush (waiting up to ``timeout_s`` for the server), stop the thread, count what is left
        as lost; returns :meth:`stats`. Idempotent."""
        if self._client is not None and not self._closed:
            self.flush(timeout_s)
            with self._cv:
                self._closed = True
                self._stop = True
                self._cv.notify_all()
            self._thread.join(timeout=self.request_timeout_s + 1.0)  # an in-flight request ends by then
            with self._cv:
                left = list(self._buf)
                self._buf.clear()
                if left:
                    self._lose(left, f"the tracking server was still unreachable after waiting {timeout_s:g}s")
                self._tags.clear()
        return self.stats()

    def stats(self) -> dict:
        with self._cv:
            return {"lost_steps": len(self.lost_steps), "lost_step_ranges": step_ranges(self.lost_steps),
                    "lost_values": self.lost_values, "failed_calls": self.failed_calls,
                    "outages": self.outages, "peak_buffered": self.peak_buffered, "buffered": len(self._buf)}

    # ---- synchronous reads -------------------------------------------------------------------

    def last_step(self, key: str, tries: int = 4) -> int | None:
        """The highest step already logged for ``key`` in this run (0 when none; None when the
        server could not be asked).

        A resumed worker recomputes the steps after its checkpoint; it skips logging those the run
        already has, so a crash after logging a step never duplicates it."""
        if self._client is None:
            return None

        def ask() -> int:
            try:
                return max((m.step for m in self._client.get_metric_history(self.run_id, key)), default=0)
            except Exception:
                self._count_failure()
                raise

        try:
            return replace(self.retry, attempts=tries).call(ask, on=Exception, unless=_permanent)
        except Exception as exc:
            log.warning("MLflow get_metric_history(%s) failed (%s); steps already logged are unknown", key, exc)
            return None

    # ---- the sending side --------------------------------------------------------------------

    def _pending_locked(self) -> bool:
        return bool(self._buf) or bool(self._tags)

    def _lose(self, items: list, why: str) -> None:
        """Count dropped (step, Metric) pairs; the caller holds the lock."""
        if not items:
            return
        steps = {s for s, _ in items}
        self.lost_values += len(items)
        self.lost_steps.update(steps)
        log.warning("MLflow: dropped %d metric values of steps %s: %s", len(items), step_ranges(steps), why)

    def _count_failure(self) -> int:
        """Count a failed request; returns how many requests in a row have failed."""
        with self._cv:
            self.failed_calls += 1
            if self._up:
                self.outages += 1
                self._streak = 0
            self._streak += 1
            self._up = False
            self._draining = True
            return self._streak

    def _send_once(self) -> bool:
        """Send the oldest batch; True on success (or when nothing was pending)."""
        from mlflow.entities import RunTag

        with self._cv:
            batch = [m for _, m in list(self._buf)[:MAX_BATCH]] if self._buf else []
            n = len(batch)
            tags = dict(list(self._tags.items())[:MAX_TAGS])
            if not n and not tags:
                return True
            self._sending = True
        try:
            self._client.log_batch(self.run_id, metrics=batch, tags=[RunTag(k, v) for k, v in tags.items()])
        except Exception as exc:  # tracking must never break training
            permanent = _permanent(exc)
            streak = self._count_failure()
            with self._cv:
                self._sending = False
                if permanent:  # the server refuses this batch: retrying cannot help
                    refused = [self._buf.popleft() for _ in range(min(n, len(self._buf)))]
                    self._lose(refused, f"refused by the server ({exc})")
                    for k, v in tags.items():
                        if self._tags.get(k) == v:
                            del self._tags[k]
                    if tags:
                        log.warning("MLflow refused tags %s (%s)", sorted(tags), exc)
                elif streak == 1 or streak % 20 == 0:
                    log.warning("MLflow log_batch failed (%s); %d values buffered, retrying", exc, len(self._buf))
                self._cv.notify_all()
            return permanent
        with self._cv:
            for _ in range(min(n, len(self._buf))):  # (close() may have given up on them meanwhile)
                self._buf.popleft()
            for k, v in tags.items():
                if self._tags.get(k) == v:
                    del self._tags[k]
            self._sending = False
            if not self._up:
                self._up = True
                log.warning("MLflow reachable again; sending %d buffered values", len(self._buf) + n)
            if self._draining and not self._buf:
                self._draining = False
                self.recovered_at = time.time()
            self._cv.notify_all()
        return True

    def _run(self) -> None:
        delays = None  # the backoff of the outage under way, if any
        while True:
            with self._cv:
                while not self._pending_locked() and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
            if self._send_once():
                delays = None
                continue
            if delays is None:
                delays = self.retry.delays()
            with self._cv:  # a wait that close() cuts short, so not the policy's sleep
                self._cv.wait_for(lambda: self._stop, timeout=next(delays))
                if self._stop:
                    return
