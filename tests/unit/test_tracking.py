"""The training loop's MLflow tracker: buffering through outages, bounded loss, counted drops.

A fake client stands in for the server here; ``tests/integration/test_fault_tracking.py`` stops a
real ``mlflow server`` mid-training. Nothing asserts elapsed time: retries are checked by the delays
a recording ``sleep`` saw, a stalled server by what the caller got done while it stalled.
"""

from __future__ import annotations

import threading
import time

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from clarifier.train.tracking import SafeTracker, parse_step_ranges, step_ranges


class FakeServer:
    """``log_batch`` / ``get_metric_history`` of one run; ``down`` makes requests fail like a
    refused connection (MLflow's INTERNAL_ERROR), ``refuse`` like a 400; while ``hold`` is set to an
    unset Event each ``log_batch`` waits for it."""

    def __init__(self):
        self.metrics: list = []
        self.tags: dict = {}
        self.down = False
        self.refuse = False
        self.hold: threading.Event | None = None
        self.calls = 0
        self.batch_sizes: list[int] = []
        self.lock = threading.Lock()

    def log_batch(self, run_id, metrics=(), tags=()):
        self.calls += 1
        if self.hold is not None:
            self.hold.wait()
        if self.down:
            raise MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow/runs/log-batch failed "
                                  "with exception ConnectionRefusedError")
        if self.refuse:
            raise MlflowException("invalid metric", error_code=INVALID_PARAMETER_VALUE)
        with self.lock:
            self.metrics.extend(metrics)
            self.tags.update({t.key: t.value for t in tags})
            self.batch_sizes.append(len(metrics))

    def get_metric_history(self, run_id, key):
        if self.down:
            raise MlflowException("connection refused")
        if self.refuse:
            raise MlflowException("invalid key", error_code=INVALID_PARAMETER_VALUE)
        with self.lock:
            return [m for m in self.metrics if m.key == key]

    def steps(self, key="train/loss") -> list[int]:
        with self.lock:
            return sorted(m.step for m in self.metrics if m.key == key)


def _tracker(server, **kw) -> SafeTracker:
    return SafeTracker("run", None, client=server, retry_min_s=0.01, retry_max_s=0.05, **kw)


def _log(tr, steps, n_keys=3):
    for s in steps:
        tr.log_metrics({"train/loss": 1.0 / s, **{f"train/k{i}": float(i) for i in range(1, n_keys)}}, s)


def test_step_ranges_round_trip():
    assert step_ranges([9, 1, 2, 3, 7, 10, 2]) == "1-3,7,9-10"
    assert step_ranges([]) == ""
    assert parse_step_ranges("1-3,7,9-10") == {1, 2, 3, 7, 9, 10}
    assert parse_step_ranges(None) == parse_step_ranges("") == set()


def test_outage_is_buffered_and_flushed_without_gap():
    srv = FakeServer()
    tr = _tracker(srv)
    _log(tr, range(1, 4))
    assert tr.flush(5) and srv.steps() == [1, 2, 3]
    srv.down = True
    _log(tr, range(4, 11))  # logged while the server is down
    time.sleep(0.2)
    assert not tr.flush(0.1) and tr.buffered == 7 * 3 and srv.steps() == [1, 2, 3]
    assert not tr.flush(5, only_if_up=True)  # a checkpoint does not wait for an outage
    srv.down = False
    t_up = time.time()
    assert tr.flush(5)
    assert srv.steps() == list(range(1, 11))
    st = tr.close(1)
    assert st["lost_steps"] == st["lost_values"] == 0 and st["failed_calls"] >= 1 and st["outages"] == 1
    assert st["peak_buffered"] >= 21 and st["buffered"] == 0
    assert tr.recovered_at is not None and tr.recovered_at >= t_up
    # each value keeps the time of its step, not of the flush
    ts = {m.step: m.timestamp for m in srv.metrics if m.key == "train/loss"}
    assert ts[4] <= int(t_up * 1000)


def test_overflow_drops_whole_steps_and_counts_them():
    srv = FakeServer()
    srv.down = True
    tr = _tracker(srv, max_buffered=10)
    _log(tr, range(1, 6))  # 3 values a step: steps 1-3 fit (9 values), 4 and 5 do not
    assert tr.lost_steps == {4, 5} and tr.lost_values == 6
    srv.down = False
    assert tr.flush(5)
    _log(tr, [6])
    st = tr.close(5)
    assert srv.steps() == [1, 2, 3, 6]
    assert st["lost_steps"] == 2 and st["lost_step_ranges"] == "4-5" and st["lost_values"] == 6
    # what the run lacks is exactly what is reported lost
    assert set(range(1, 7)) - set(srv.steps()) == parse_step_ranges(st["lost_step_ranges"])


def test_refused_batch_is_dropped_not_retried_forever():
    srv = FakeServer()
    srv.refuse = True
    tr = _tracker(srv)
    _log(tr, [1, 2])
    assert tr.flush(5)  # dropped (a 4xx cannot succeed on retry), so nothing is left pending
    srv.refuse = False
    _log(tr, [3])
    st = tr.close(5)
    assert srv.steps() == [3] and tr.lost_steps == {1, 2} and st["lost_values"] == 6


def _wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_close_counts_what_an_unreachable_server_never_got():
    srv = FakeServer()
    # an hour of backoff after a failure: close() must cut that wait short, not sit it out
    tr = SafeTracker("run", None, client=srv, retry_min_s=3600, retry_max_s=3600, request_timeout_s=1)
    _log(tr, [1])
    assert tr.flush(5)
    srv.down = True
    _log(tr, [2, 3])
    _wait_for(lambda: srv.calls >= 2)  # the send failed: the sending thread now waits out its backoff
    st = tr.close(0.3)
    assert not tr._thread.is_alive()  # it stopped within close's join (request_timeout_s + 1), mid-backoff
    assert srv.calls == 2  # and did not try again
    assert st["lost_step_ranges"] == "2-3" and st["lost_values"] == 6 and st["buffered"] == 0
    assert not tr.log_metrics({"train/loss": 1.0}, 4) and tr.lost_steps == {2, 3, 4}  # closed: counted too


def test_a_hung_server_does_not_stall_the_caller_and_batches_respect_the_limit():
    srv = FakeServer()
    srv.hold = threading.Event()
    tr = _tracker(srv)
    _log(tr, [1], n_keys=5)
    _wait_for(lambda: srv.calls >= 1)  # the sending thread is now stuck in a request
    logger = threading.Thread(target=_log, args=(tr, range(2, 401)), kwargs={"n_keys": 5})  # 2,000 values
    logger.start()
    logger.join(60)  # a guard only: logging that waited for the server would never end
    assert not logger.is_alive(), "log_metrics waited for the hung server"
    assert srv.calls == 1 and tr.buffered == 400 * 5  # all logged while the first request still hangs
    srv.hold.set()
    st = tr.close(10)
    assert srv.steps() == list(range(1, 401)) and st["lost_steps"] == 0
    assert max(srv.batch_sizes) <= 1000


def test_last_step_and_tags():
    srv = FakeServer()
    tr = _tracker(srv)
    assert tr.last_step("train/loss") == 0
    _log(tr, [1, 2])
    tr.set_tags({"a": 1})
    assert tr.flush(5) and tr.last_step("train/loss") == 2 and srv.tags == {"a": "1"}
    srv.down = True
    assert tr.last_step("train/loss", tries=2) is None  # unknown, not 0
    tr.close(0)


def test_last_step_retries_transient_errors_with_backoff_and_not_refusals():
    srv = FakeServer()
    slept = []
    tr = SafeTracker("run", None, client=srv, retry_min_s=1.0, retry_max_s=10.0, sleep=slept.append)
    srv.down = True
    assert tr.last_step("train/loss") is None  # 4 tries by default
    assert slept == [1.0, 2.0, 4.0] and tr.failed_calls == 4 and tr.outages == 1
    slept.clear()
    assert tr.last_step("train/loss", tries=6) is None
    assert slept == [1.0, 2.0, 4.0, 8.0, 10.0] and tr.failed_calls == 10  # capped at retry_max_s
    srv.down, srv.refuse = False, True
    slept.clear()
    assert tr.last_step("train/loss") is None and slept == [] and tr.failed_calls == 11  # a 4xx: asked once
    srv.refuse = False
    assert tr.last_step("train/loss") == 0 and slept == [] and tr.failed_calls == 11
    tr.close(0)


def test_no_run_means_no_tracking():
    tr = SafeTracker(None, None)
    assert not tr.enabled and not tr.log_metrics({"a": 1.0}, 1) and tr.last_step("a") is None
    assert tr.flush(1) and tr.close(1)["lost_steps"] == 0


def test_real_client_turns_off_mlflows_own_retries(monkeypatch):
    import os

    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)  # restored (removed) after the test
    tr = SafeTracker("run", "http://127.0.0.1:9", request_timeout_s=7)
    try:
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"
    finally:
        tr.close(0)


def test_local_tracking_stores_are_made_absolute_for_the_workers(tmp_path):
    """Ray Train workers run in their own working directories: a relative sqlite/file store would be
    a different, empty store there (the default ``sqlite:///mlflow.db`` included)."""
    from clarifier.runtime.mlflow_uri import absolute_tracking_uri

    assert absolute_tracking_uri("sqlite:///mlflow.db", tmp_path) == f"sqlite:///{tmp_path}/mlflow.db"
    assert absolute_tracking_uri("sqlite:////abs/m.db", tmp_path) == "sqlite:////abs/m.db"
    assert absolute_tracking_uri("mlruns", tmp_path) == str(tmp_path / "mlruns")
    assert absolute_tracking_uri("file:runs/x", tmp_path) == str(tmp_path / "runs" / "x")
    assert absolute_tracking_uri("/abs/mlruns", tmp_path) == "/abs/mlruns"
    for remote in ("http://127.0.0.1:5000", "https://mlflow.example.com", "databricks", "file:///abs/mlruns"):
        assert absolute_tracking_uri(remote, tmp_path) == remote
