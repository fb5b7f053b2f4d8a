"""Progress lines while a Ray Data pool of scorer actors works (``clarifier audit``, ``clarifier label select``,
``clarifier eval`` with ``eval.engine=ray``, the decision head's states read on actors).

The driver waits inside one Ray Data call (``write_parquet``) for as long as the scoring takes: tens of minutes
on a big log. Ray Data's own progress bars are off (they would interleave with the command's lines, and they count
blocks, not turns), so the actors count what they scored into a :class:`RowCounter` (a zero-CPU actor) and a
thread of the driver prints a line every ``every_s`` seconds::

    [label] scored 640 of 1,348 turns (47%), 1.9 turns/s, about 6 min left

The rate is measured from the first count seen (the actors' model loading is not in it), and the line is printed
only when the count moved, so a stalled pool is visible as silence plus the last line's age, not as a stream
of identical lines.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator


@functools.cache
def _counter_class():
    import ray

    @ray.remote(num_cpus=0)
    class RowCounter:
        """Rows done so far, added to by the actors (fire and forget) and read by the driver."""

        def __init__(self) -> None:
            self.rows = 0

        def add(self, n: int) -> None:
            self.rows += int(n)

        def value(self) -> int:
            return self.rows

    return RowCounter


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class ProgressLines:
    """The lines of one long step: :meth:`tick` with the count done so far returns the line to print, or None
    when there is nothing new. Pure (the clock is passed in), so its arithmetic is tested without waiting."""

    def __init__(self, prefix: str, total: int, what: str = "turns", verb: str = "scored"):
        self.prefix, self.total, self.what, self.verb = prefix, int(total), what, verb
        self._first: tuple[float, int] | None = None  # (time, count) at the first count seen
        self._last = 0

    def tick(self, done: int, now: float) -> str | None:
        done = min(int(done), self.total)
        if done <= self._last:
            return None
        if self._first is None:
            self._first = (now, done)
            self._last = done
            return (f"{self.prefix} {self.verb} {done:,} of {self.total:,} {self.what} "
                    f"({100 * done / max(1, self.total):.0f}%)")
        self._last = done
        t0, n0 = self._first
        rate = (done - n0) / max(now - t0, 1e-9)
        line = (f"{self.prefix} {self.verb} {done:,} of {self.total:,} {self.what} "
                f"({100 * done / max(1, self.total):.0f}%), {rate:.1f} {self.what}/s")
        if done < self.total and rate > 0:
            line += f", about {_minutes((self.total - done) / rate)} left"
        return line


EVERY_S = 30.0  # seconds between two lines


@contextmanager
def counted(ray, prefix: str, total: int, emit: Callable[[str], None], every_s: float | None = None,
            what: str = "turns") -> Iterator[object]:
    """A :class:`RowCounter` actor handle to give the actors (``counter.add.remote(n)`` per batch), with a thread
    printing :class:`ProgressLines` every ``every_s`` seconds until the block ends. The counter actor is killed at
    the end; a failure to read it (the cluster going away) ends the lines, never the job."""
    counter = _counter_class().remote()
    lines = ProgressLines(prefix, total, what)
    stop = threading.Event()
    every_s = EVERY_S if every_s is None else every_s

    def watch() -> None:
        while not stop.wait(every_s):
            try:
                done = ray.get(counter.value.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - progress is a courtesy; the job's own errors surface elsewhere
                return
            line = lines.tick(done, time.monotonic())
            if line:
                emit(line)

    thread = threading.Thread(target=watch, name=f"progress {prefix}", daemon=True)
    thread.start()
    try:
        yield counter
    finally:
        stop.set()
        thread.join(timeout=15)
        try:
            ray.kill(counter)
        except Exception:  # noqa: BLE001
            pass
