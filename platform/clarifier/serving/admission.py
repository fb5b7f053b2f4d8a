"""Admission from a latency budget: shed load at the ingress before a client would wait too long.

A fixed queue bound is wrong for every model but one: 64 queued requests is 2 s of work for a GPU
replica and over a minute for a 1-CPU replica (measured: the 64th request of a burst answered
after 63 s). The rule instead (``serve.max_queued_requests: null``, the default):

    admit a request  iff  outstanding + 1 <= max(1, throughput x latency_budget_s)

``outstanding`` counts the items this ingress replica has sent to the model deployment and not yet
received back; ``throughput`` is what the model side has *measured* to answer per second while
busy (completions over the busy time of the last ``window`` completions, so a dynamic batch of 8
that lands at once counts as 8); by Little's law a request admitted behind ``outstanding`` others
waits about ``(outstanding + 1) / throughput`` seconds. Until ``window`` answers have been seen,
the bound is ``initial_limit`` (the app passes twice what the first model replicas take at once). A refused request gets 503
at once with ``Retry-After`` = the seconds until the backlog fits the budget again; the admitted
ones keep the model replicas' ongoing-request count high, which is the autoscaler's signal to add
replicas -- whose answers raise the measured throughput and so the bound.

Pure: the clock is injectable (tests use a fake one); no Ray, no HTTP.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Decision:
    admitted: bool
    limit: int  # the bound in force when the request arrived
    outstanding: int  # items in flight when it arrived (not counting it)
    retry_after_s: int = 0  # for a refusal: when the backlog should fit the budget again


class LatencyBudget:
    """Admission control of one ingress replica (thread-safe)."""

    def __init__(self, budget_s: float, initial_limit: int, window: int = 32,
                 clock: Callable[[], float] = time.monotonic):
        if budget_s <= 0 or initial_limit < 1 or window < 2:
            raise ValueError("LatencyBudget needs budget_s > 0, initial_limit >= 1 and window >= 2")
        self.budget_s = float(budget_s)
        self.initial_limit = int(initial_limit)
        self.window = int(window)
        self._clock = clock
        self._lock = threading.Lock()
        self.outstanding = 0
        self._busy_since: float | None = None  # start of the current busy period
        self._last_done: float | None = None  # last completion in the current busy period
        self._gaps: deque[tuple[float, int]] = deque()  # (busy seconds, completions) per completion event
        self._done = 0

    # ---- the estimate --------------------------------------------------------------------------

    def throughput(self) -> float | None:
        """Answers per second while busy, over the last ``window`` completions (None until then)."""
        with self._lock:
            return self._throughput()

    def _throughput(self) -> float | None:
        n = sum(k for _, k in self._gaps)
        busy = sum(s for s, _ in self._gaps)
        if n < self.window or busy <= 0:
            return None
        return n / busy

    def limit(self) -> int:
        with self._lock:
            return self._limit()

    def _limit(self) -> int:
        rate = self._throughput()
        if rate is None:
            return self.initial_limit
        return max(1, math.floor(rate * self.budget_s))

    # ---- requests ------------------------------------------------------------------------------

    def try_admit(self, items: int = 1) -> Decision:
        """Admit ``items`` (a batch request counts each) or refuse them, with the reason's numbers."""
        with self._lock:
            limit = self._limit()
            if self.outstanding > 0 and self.outstanding + items > limit:
                rate = self._throughput() or (limit / self.budget_s)
                excess = self.outstanding + items - limit
                return Decision(False, limit, self.outstanding, max(1, math.ceil(excess / rate)))
            if self.outstanding == 0:
                self._busy_since = self._clock()
                self._last_done = None
            before = self.outstanding
            self.outstanding += items
            return Decision(True, limit, before)

    def done(self, items: int = 1) -> None:
        """``items`` admitted earlier were answered (or failed): they leave the backlog."""
        with self._lock:
            now = self._clock()
            start = self._last_done if self._last_done is not None else self._busy_since
            if start is not None:
                self._gaps.append((max(now - start, 0.0), items))
                while sum(k for _, k in self._gaps) - self._gaps[0][1] >= self.window:
                    self._gaps.popleft()
            self._last_done = now
            self.outstanding = max(0, self.outstanding - items)
            if self.outstanding == 0:
                self._busy_since = self._last_done = None


class RateLimit:
    """A token bucket: ``rate_per_s`` requests a second on average, ``burst`` at once (a tenant's
    ``rate_limit_per_s``). :meth:`try_take` returns 0 when the request may go, else the whole seconds until it
    could (the ``Retry-After`` of its 429). Thread-safe; the clock is injectable."""

    def __init__(self, rate_per_s: float, burst: int | None = None, clock: Callable[[], float] = time.monotonic):
        if rate_per_s <= 0:
            raise ValueError("RateLimit needs rate_per_s > 0")
        self.rate = float(rate_per_s)
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate_per_s)))
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()
        self._lock = threading.Lock()

    def try_take(self, n: int = 1) -> int:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= n:
                self._tokens -= n
                return 0
            return max(1, math.ceil((n - self._tokens) / self.rate))


class FairShare:
    """Round-robin dispatch of tenants' requests to the model side, at most ``slots`` items out at once (one ingress
    replica; asyncio, one event loop).

    Without it, every admitted request joins the model replicas' one FIFO queue, so a tenant that bursts puts its
    whole admitted backlog ahead of everybody else's next request. With it, requests beyond ``slots`` wait here, one
    queue per tenant, and each freed slot goes to the next tenant in turn that has one waiting: another tenant's
    request waits for at most about one slot's worth of work, however many the burster has queued. ``slots`` is what
    the model replicas take at once (their ``max_ongoing_requests`` each), so they are kept as busy as before.
    """

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError("FairShare needs slots >= 1")
        self.slots = int(slots)
        self.busy = 0
        self._waiting: "dict[str, deque]" = {}  # tenant -> deque of (future, items), in arrival order
        self._turns: "deque[str]" = deque()  # tenants with a waiter, next to be served first

    @property
    def waiting(self) -> int:
        return sum(n for q in self._waiting.values() for _, n in q)

    async def acquire(self, tenant: str, items: int = 1) -> None:
        """Return once ``items`` may go to the model side (the caller then calls :meth:`release`)."""
        import asyncio

        if not self._turns and self.busy + items <= self.slots:
            self.busy += items
            return
        fut = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant, deque())
        queue.append((fut, items))
        if tenant not in self._turns:
            self._turns.append(tenant)
        self._dispatch()  # a request larger than every slot goes when nothing else is out
        try:
            await fut
        except BaseException:  # cancelled while waiting (the client went away): leave the queue, or give the slot back
            if fut.done() and not fut.cancelled():
                self.release(items)
            else:
                self._forget(tenant, fut)
            raise

    def release(self, items: int = 1) -> None:
        self.busy = max(0, self.busy - items)
        self._dispatch()

    def _forget(self, tenant: str, fut) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None:
            for entry in list(queue):
                if entry[0] is fut:
                    queue.remove(entry)
            if not queue:
                self._waiting.pop(tenant, None)
                if tenant in self._turns:
                    self._turns.remove(tenant)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._turns:
            tenant = self._turns[0]
            queue = self._waiting[tenant]
            fut, items = queue[0]
            if self.busy + items > self.slots and self.busy > 0:
                return
            queue.popleft()
            self._turns.popleft()
            if queue:
                self._turns.append(tenant)  # its next request waits for the others' turns
            else:
                self._waiting.pop(tenant)
            if fut.cancelled():
                continue
            self.busy += items
            fut.set_result(None)
