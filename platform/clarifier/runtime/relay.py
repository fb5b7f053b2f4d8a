"""Progress lines from Ray workers to the driver's ``progress`` callback.

A worker's stdout reaches the driver only through Ray's log relay, mixed with every other library's
output and prefixed ``(RayTrainWorker pid=...)``; with the CLI's quiet console it goes to the run's log
file. Lines that belong on the user's terminal (training steps, loss, tokens/s, ETA) are sent here
instead: a tiny actor (no CPU) holds them until a driver thread hands them to ``progress``. Works the
same on a local Ray and on a cluster (inside ``ray job submit`` the driver's output is the job log).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class _Lines:
        def __init__(self):
            self._lines: list[str] = []
            self._counts: dict[str, int] = {}

        def say(self, line: str) -> None:
            self._lines.append(line)

        def count(self, key: str, n: int, total: int, unit: str) -> None:
            done = self._counts[key] = self._counts.get(key, 0) + n
            self._lines.append(f"{key}: {done}/{total} {unit}")

        def drain(self) -> list[str]:
            out, self._lines = self._lines, []
            return out

    return _Lines


class ProgressRelay:
    """``with ProgressRelay(progress) as relay:`` pass ``relay.handle`` to the workers; they call
    :func:`say`. Lines reach ``progress`` within ``interval`` seconds and, at exit, all of them."""

    def __init__(self, progress: Callable[[str], None], interval: float = 0.5):
        self.progress = progress
        self.interval = interval
        self.handle = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # one drain at a time: lines keep their order

    def __enter__(self) -> "ProgressRelay":
        self.handle = _actor_class().remote()
        self._thread = threading.Thread(target=self._pump, name="clarifier-progress-relay", daemon=True)
        self._thread.start()
        return self

    def flush(self) -> None:
        """Pass on what the workers sent so far (the driver calls it before a line of its own about the same
        stage, so that the workers' last counts come before it, not after)."""
        import ray

        with self._lock:
            for line in ray.get(self.handle.drain.remote(), timeout=30):
                self.progress(line)

    def _pump(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # the driver is shutting down or the actor is gone: nothing to show
                return

    def __exit__(self, *exc) -> None:
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.flush()
        except Exception:
            pass
        try:
            ray.kill(self.handle)
        except Exception:
            pass


def count(handle, key: str, n: int, total: int, unit: str) -> None:
    """From a worker: ``n`` more ``unit`` of ``total`` done under ``key`` (e.g. ``[data] tokenise``); the
    driver gets ``"<key>: <done>/<total> <unit>"`` with the sum over every worker. Nothing without a relay."""
    if handle is not None and n:
        handle.count.remote(key, n, total, unit)


def say(handle, line: str) -> None:
    """From a worker: send ``line`` to the driver (fire and forget); printed if there is no relay."""
    if handle is None:
        import sys

        print(line, file=sys.__stdout__, flush=True)
        return
    handle.say.remote(line)
