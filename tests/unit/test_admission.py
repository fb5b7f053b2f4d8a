"""Latency-budget admission (serving.admission): the bound follows the measured throughput."""

import pytest

from clarifier.serving.admission import LatencyBudget


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _serve_sequentially(lb: LatencyBudget, clock: Clock, n: int, service_s: float) -> None:
    """``n`` requests answered one after another, ``service_s`` each, while ``n`` wait."""
    for _ in range(n):
        assert lb.try_admit().admitted
    for _ in range(n):
        clock.t += service_s
        lb.done()


def test_until_measured_the_bound_is_the_initial_limit():
    lb = LatencyBudget(5.0, initial_limit=8, window=4, clock=Clock())
    assert lb.throughput() is None and lb.limit() == 8
    for _ in range(8):
        assert lb.try_admit().admitted
    d = lb.try_admit()
    assert not d.admitted and d.limit == 8 and d.outstanding == 8 and d.retry_after_s >= 1


def test_bound_is_throughput_times_budget_for_a_sequential_replica():
    clock = Clock()
    lb = LatencyBudget(5.0, initial_limit=8, window=4, clock=clock)
    _serve_sequentially(lb, clock, 4, service_s=0.5)  # 2 answers/s
    assert lb.throughput() == pytest.approx(2.0) and lb.limit() == 10
    admitted = [lb.try_admit().admitted for _ in range(14)]
    assert admitted == [True] * 10 + [False] * 4  # the 11th would wait 5.5 s > 5 s
    refused = lb.try_admit()
    assert refused.retry_after_s == 1  # (10 + 1 - 10) / 2 per s, rounded up to 1 s


def test_a_batch_answered_at_once_counts_each_item():
    """A dynamic batch of 8 that lands together after 2 s is 4 answers/s, not 0.5."""
    clock = Clock()
    lb = LatencyBudget(2.0, initial_limit=8, window=8, clock=clock)
    assert lb.try_admit(8).admitted
    clock.t += 2.0
    lb.done(8)
    assert lb.throughput() == pytest.approx(4.0) and lb.limit() == 8


def test_idle_time_is_not_counted_as_busy():
    clock = Clock()
    lb = LatencyBudget(5.0, initial_limit=4, window=4, clock=clock)
    for _ in range(4):
        clock.t += 60.0  # a minute idle before each request
        assert lb.try_admit().admitted
        clock.t += 0.25
        lb.done()
    assert lb.throughput() == pytest.approx(4.0)


def test_a_slow_model_still_takes_one_request_and_retry_after_grows_with_the_backlog():
    clock = Clock()
    lb = LatencyBudget(1.0, initial_limit=4, window=2, clock=clock)
    _serve_sequentially(lb, clock, 2, service_s=10.0)  # 0.1 answers/s: 1 s budget holds none
    assert lb.limit() == 1
    assert lb.try_admit().admitted  # an idle ingress always admits one
    refused = lb.try_admit(5)
    assert not refused.admitted and refused.retry_after_s == 50  # 5 items over the bound at 0.1/s


def test_the_window_follows_a_faster_model():
    clock = Clock()
    lb = LatencyBudget(5.0, initial_limit=4, window=4, clock=clock)
    _serve_sequentially(lb, clock, 4, service_s=1.0)
    assert lb.limit() == 5
    _serve_sequentially(lb, clock, 4, service_s=0.1)  # replicas were added: 10 answers/s
    assert lb.throughput() == pytest.approx(10.0) and lb.limit() == 50


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        LatencyBudget(0, initial_limit=1)
    with pytest.raises(ValueError):
        LatencyBudget(1.0, initial_limit=0)
