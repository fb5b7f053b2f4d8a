"""The package's one retry policy: how many attempts, and how long to wait between them.

Every retry in the package takes its delays from a :class:`RetryPolicy`: exponential backoff,
``min_s * 2**(n - 1)`` seconds before retry ``n``, at most ``max_s``. A call that is simply tried
again goes through :meth:`RetryPolicy.call` / :meth:`RetryPolicy.acall` (tenacity underneath);
a loop that waits in its own way (the tracker's background sender, the model watcher's next poll)
asks :meth:`RetryPolicy.backoff` or :meth:`RetryPolicy.delays`. After the last attempt ``call``
returns what that attempt returned or raises what it raised (never a wrapper), so callers keep
their own errors. ``sleep`` / ``async_sleep`` are injectable: tests record delays instead of waiting.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")
Errors = type[BaseException] | tuple[type[BaseException], ...]


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts``: tries :meth:`call` makes in all (the first included)."""

    attempts: int = 3
    min_s: float = 0.0
    max_s: float = math.inf
    sleep: Callable[[float], Any] = time.sleep
    async_sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")

    def backoff(self, retry: int) -> float:
        """The wait before retry ``retry`` (1: the first retry)."""
        # 2.0 ** 1024 raises OverflowError: the doubling stops there, far past any cap.
        return min(self.max_s, self.min_s * 2.0 ** min(retry - 1, 1023))

    def delays(self) -> Iterator[float]:
        """The waits before retries 1, 2, ... without end (for loops that retry until stopped)."""
        retry = 0
        while True:
            retry += 1
            yield self.backoff(retry)

    def _controller(self, cls, sleep, on: Errors, unless, result, wait_at_least, on_retry):
        def wait(state: tenacity.RetryCallState) -> float:
            delay = self.backoff(state.attempt_number)
            if wait_at_least is not None and not state.outcome.failed:
                delay = max(delay, wait_at_least(state.outcome.result()))
            return delay

        retry = tenacity.retry_if_exception(lambda exc: isinstance(exc, on) and not (unless and unless(exc)))
        if result is not None:
            retry = retry | tenacity.retry_if_result(result)
        return cls(stop=tenacity.stop_after_attempt(self.attempts), wait=wait, retry=retry, sleep=sleep,
                   before_sleep=on_retry, retry_error_callback=lambda state: state.outcome.result())

    def call(self, fn: Callable[[], T], *, on: Errors = (), unless: Callable[[BaseException], bool] | None = None,
             result: Callable[[T], bool] | None = None, wait_at_least: Callable[[T], float] | None = None,
             on_retry: Callable[[tenacity.RetryCallState], None] | None = None) -> T:
        """``fn()``, tried again after the errors in ``on`` (except those ``unless`` calls
        permanent) and after results for which ``result`` is true; a retried result may ask for a
        longer wait (``wait_at_least``, e.g. a server's Retry-After). ``on_retry`` runs before each
        wait (``state.attempt_number`` is the attempt that just failed)."""
        return self._controller(tenacity.Retrying, self.sleep, on, unless, result, wait_at_least, on_retry)(fn)

    async def acall(self, fn: Callable[[], Awaitable[T]], *, on: Errors = (),
                    unless: Callable[[BaseException], bool] | None = None,
                    on_retry: Callable[[tenacity.RetryCallState], None] | None = None) -> T:
        """:meth:`call` for a coroutine (or any awaitable) ``fn()``; waits with ``async_sleep``."""
        return await self._controller(tenacity.AsyncRetrying, self.async_sleep, on, unless, None, None, on_retry)(fn)
