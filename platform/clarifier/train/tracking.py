"""MLflow logging that never kills training: every call is retried, failures are counted and reported."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class SafeTracker:
    """Logs metrics/params to one existing MLflow run; a tracking outage costs metrics, not the job."""

    def __init__(self, run_id: str | None, tracking_uri: str | None, retries: int = 3, backoff_s: float = 0.5):
        self.run_id = run_id
        self.retries = retries
        self.backoff_s = backoff_s
        self.failed_calls = 0
        self.lost_metrics = 0
        self._client = None
        if run_id:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=tracking_uri)

    def _call(self, what: str, fn, n_items: int = 1) -> bool:
        if self._client is None:
            return False
        for attempt in range(self.retries):
            try:
                fn()
                return True
            except Exception as exc:  # tracking must never break training
                if attempt == self.retries - 1:
                    self.failed_calls += 1
                    self.lost_metrics += n_items
                    log.warning("MLflow %s failed after %d tries (%s); continuing", what, self.retries, exc)
                    return False
                time.sleep(self.backoff_s * (2 ** attempt))
        return False

    def log_metrics(self, metrics: dict[str, float], step: int) -> bool:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
        return self._call("log_metrics", lambda: self._client.log_batch(self.run_id, metrics=ms), len(ms))

    def last_step(self, key: str) -> int:
        """The highest step already logged for ``key`` in this run (0 when none or unreachable).

        A resumed worker recomputes the steps after its checkpoint; it skips logging those the run
        already has, so a crash after logging a step never duplicates it."""
        out: list[int] = []

        def fetch():
            out[:] = [m.step for m in self._client.get_metric_history(self.run_id, key)]

        if not self._call("get_metric_history", fetch, 0):
            return 0
        return max(out, default=0)

    def set_tags(self, tags: dict[str, str]) -> bool:
        from mlflow.entities import RunTag

        ts = [RunTag(k, str(v)) for k, v in tags.items()]
        return self._call("set_tags", lambda: self._client.log_batch(self.run_id, tags=ts), len(ts))
