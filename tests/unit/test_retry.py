"""The package's retry policy on its own: delays, attempts, what is retried, what comes out at the end.

A recording sleep stands in for waiting, so nothing here waits.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from clarifier.runtime.retry import RetryPolicy


class Flaky:
    """Raises or returns ``outcomes`` in turn (the last one again once they run out)."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self):
        out = self.outcomes[min(self.calls, len(self.outcomes) - 1)]
        self.calls += 1
        if isinstance(out, BaseException):
            raise out
        return out


def _policy(slept: list, **kw) -> RetryPolicy:
    return RetryPolicy(sleep=slept.append, **kw)


def test_backoff_doubles_from_min_and_is_capped():
    p = RetryPolicy(min_s=0.5, max_s=3.0)
    assert [p.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert list(itertools.islice(p.delays(), 6)) == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert RetryPolicy(min_s=1.0).backoff(4) == 8.0  # no cap by default
    assert RetryPolicy().backoff(3) == 0.0  # no delay by default


def test_backoff_survives_very_long_outages():
    """The thousandth retry of a background loop must not overflow."""
    assert RetryPolicy(min_s=1.0, max_s=10.0).backoff(5000) == 10.0
    assert RetryPolicy(min_s=1.0).backoff(5000) > 1e300  # uncapped: huge, but no OverflowError
    assert RetryPolicy(min_s=0.0, max_s=10.0).backoff(5000) == 0.0


def test_attempts_must_be_positive():
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


def test_retried_errors_until_success_with_the_backoff_delays():
    slept = []
    fn = Flaky(ConnectionError("a"), ConnectionError("b"), "ok")
    assert _policy(slept, attempts=4, min_s=0.1).call(fn, on=ConnectionError) == "ok"
    assert fn.calls == 3 and slept == [0.1, 0.2]


def test_the_last_error_is_raised_itself_after_the_last_attempt():
    slept = []
    last = ConnectionError("third")
    fn = Flaky(ConnectionError("first"), ConnectionError("second"), last)
    with pytest.raises(ConnectionError) as ei:
        _policy(slept, attempts=3, min_s=1.0).call(fn, on=ConnectionError)
    assert ei.value is last and fn.calls == 3 and slept == [1.0, 2.0]  # no wait after the last


def test_errors_not_listed_or_permanent_are_raised_at_once():
    slept = []
    fn = Flaky(ValueError("bad"), "unused")
    with pytest.raises(ValueError):
        _policy(slept, attempts=5).call(fn, on=ConnectionError)
    assert fn.calls == 1

    fn = Flaky(ConnectionError("refused for good"), "unused")
    with pytest.raises(ConnectionError):
        _policy(slept, attempts=5).call(fn, on=Exception, unless=lambda exc: "for good" in str(exc))
    assert fn.calls == 1 and slept == []


def test_retried_results_and_the_last_one_is_returned():
    slept = []
    fn = Flaky(503, 502, 200)
    assert _policy(slept, attempts=3, min_s=0.2).call(fn, result=lambda r: r >= 500) == 200
    assert slept == [0.2, 0.4]
    fn = Flaky(503)
    assert _policy(slept, attempts=2).call(fn, result=lambda r: r >= 500) == 503  # given back, not raised
    assert fn.calls == 2


def test_a_result_may_ask_for_a_longer_wait():
    slept = []
    fn = Flaky(("busy", 2.0), ("busy", 0.0), ("ok", 0.0))
    out = _policy(slept, attempts=3, min_s=0.5).call(fn, result=lambda r: r[0] == "busy",
                                                      wait_at_least=lambda r: r[1])
    assert out == ("ok", 0.0) and slept == [2.0, 1.0]  # max(backoff, asked) each time


def test_on_retry_sees_each_failed_attempt_before_its_wait():
    seen = []
    fn = Flaky(KeyError("x"), KeyError("y"), "ok")
    RetryPolicy(attempts=3, sleep=lambda s: seen.append(("sleep", s))).call(
        fn, on=KeyError, on_retry=lambda st: seen.append((st.attempt_number, type(st.outcome.exception()).__name__)))
    assert seen == [(1, "KeyError"), ("sleep", 0.0), (2, "KeyError"), ("sleep", 0.0)]


def test_acall_retries_awaitables_with_the_async_sleep():
    slept = []

    async def nap(s):
        slept.append(s)

    fn = Flaky(ConnectionError("a"), "ok")

    async def attempt():
        return fn()

    p = RetryPolicy(attempts=2, min_s=0.3, async_sleep=nap)
    assert asyncio.run(p.acall(attempt, on=ConnectionError)) == "ok" and slept == [0.3]

    fn = Flaky(ConnectionError("a"), ConnectionError("b"))
    retried = []
    with pytest.raises(ConnectionError, match="b"):
        asyncio.run(p.acall(attempt, on=ConnectionError, on_retry=lambda st: retried.append(st.attempt_number)))
    assert fn.calls == 2 and retried == [1]
