"""The request log (``serve.request_log``): every answered request, written off the request path.

One record per answered request, in the platform's conversation-log format (a
:class:`~clarifier.core.schema.ConversationLog` the data job reads like any other log)::

    {"conversation_id": "c-17",                      # the client's (ClarifyRequest.conversation_id, or
                                                     # metadata.conversation_id on chat completions), else
                                                     # "request-<request_id>" (a conversation of its own)
     "turns": [{"role": "user", "text": "I have a router and a modem"},     # the request's history...
               {"role": "assistant", "text": "OK"},
               {"role": "user", "text": "how do I reset it?",             # ...and its query, with what was
                "passages": [{"id": "kb-3", "text": "..."}],               # retrieved for it and what the
                "meta": {"served": {"needs_clarification": true, "confidence": 0.91, "threshold": 0.5,
                                    "question": "The router or the modem?",
                                    "grounding": {"turns": [0], "passages": []},
                                    "model_version": "clarifier/3", "valid_output": true}}}],
     # with serve.shadow_model_uri, the query turn's meta also has "shadow": the challenger's answer (same
     # fields as "served"), or {"error": "timeout" | "failed"}
     "meta": {"request_log": {"version": 1, "request_id": "5f0c...", "route": "clarify",
                              "at": "2026-12-02T15:20:01.123Z", "turn_index": 2,
                              "client_conversation_id": true, "history_omitted": false}}}

``turn_index`` is the query's position in its conversation (the history's length), so the data job can
put a conversation's requests back in order. API keys and headers are never part of a record;
``serve.request_log.omit`` drops the history or the passages (or only their text), and
``serve.request_log.redact`` regexes replace matches in every text with ``[redacted]`` (in the writer
thread, before anything leaves the process).

How records are written (:class:`RequestLog`): ``append`` (on the request path) only adds the record to
the open shard, under a lock. A writer thread seals the shard when it holds ``shard_records`` records or
its first record is ``shard_age_s`` old, and writes each sealed shard as one object
``<uri>/<YYYY-MM-DD>/<writer>-<opened ms>-<seq>.jsonl[.gz]`` (local folders: a hidden temp file, then a
rename, so a reader never sees half a shard). While the store fails, sealed shards wait in memory and
are retried with backoff; at most ``max_buffered`` records are held (open + sealed), and a record beyond
that is dropped and counted (``clarifier_request_log_records_total{outcome="dropped_overflow"}`` and a
log line), while requests keep being answered. A clean shutdown (Serve calls the replica's
``__del__``) seals and writes what is held, for up to ``flush_timeout_s``; what still could not be
written is counted as ``dropped_shutdown`` and logged.

What a fault can cost: a store outage, nothing until ``max_buffered`` records wait (then the overflow,
counted); a killed replica (SIGKILL, OOM), the records it held: the open shard (at most
``shard_records`` records, at most ``shard_age_s`` seconds of its traffic) plus any sealed shards the
store had not taken yet.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from clarifier.core.config import RequestLogConfig
from clarifier.core.request_record import redact
from clarifier.runtime import storage
from clarifier.runtime.retry import RetryPolicy

log = logging.getLogger("ray.serve.clarifier")

# The wait before retrying a shard the store refused: 0.5 s, doubling, at most 30 s.
STORE_RETRY = RetryPolicy(min_s=0.5, max_s=30.0)
POLL_S = 0.25  # how often the writer looks at the open shard's age


def resolved_uri(uri: str) -> str:
    """``serve.request_log.uri`` as replicas need it: a local folder made absolute (replicas do not share
    the driver's working directory); for ``s3://`` the bucket must exist (ValueError naming it, else)."""
    if not storage.is_s3(uri):
        return str(Path(uri).expanduser().resolve())
    fs, _ = storage.filesystem(uri)
    missing = storage.missing_bucket(fs, uri)
    if missing:
        raise ValueError(f"serve.request_log.uri {uri!r}{missing}")
    return uri.rstrip("/")


@dataclass
class _Shard:
    seq: int
    opened_at: float
    records: list[dict] = field(default_factory=list)


class RequestLog:
    """Append records on the request path; a writer thread writes them in shards (module docstring).

    ``on_count(outcome, n)`` is told ``written`` / ``dropped_overflow`` / ``dropped_shutdown`` counts (the
    ingress turns them into metrics); ``clock`` and ``start=False`` are for tests.
    """

    def __init__(self, cfg: RequestLogConfig, *, writer_id: Optional[str] = None,
                 on_count: Optional[Callable[[str, int], None]] = None,
                 on_buffered: Optional[Callable[[int], None]] = None,
                 clock: Callable[[], float] = time.time, start: bool = True):
        if not cfg.uri:
            raise ValueError("serve.request_log.uri is not set: the request log is off")
        self.cfg = cfg
        self.uri = cfg.uri.rstrip("/")
        self.writer_id = re.sub(r"[^A-Za-z0-9_.-]", "-", writer_id or uuid.uuid4().hex[:12])
        self._patterns = [re.compile(p) for p in cfg.redact]
        self._on_count = on_count or (lambda outcome, n: None)
        self._on_buffered = on_buffered or (lambda n: None)
        self._clock = clock
        self._lock = threading.Lock()
        self._draining = threading.Lock()  # one writer at a time (the thread, or a flush): no shard twice
        self._open: Optional[_Shard] = None
        self._sealed: deque[_Shard] = deque()
        self._seq = 0
        self.buffered = 0
        self.counts = {"written": 0, "dropped_overflow": 0, "dropped_shutdown": 0, "shards": 0, "write_errors": 0}
        self._failures = 0  # consecutive failed writes
        self._next_try = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        if start:
            self._thread = threading.Thread(target=self._run, name="clarifier-request-log", daemon=True)
            self._thread.start()

    # ---- the request path -----------------------------------------------------------------------

    def append(self, record: dict) -> bool:
        """Hold ``record`` for writing; False (and counted) when ``max_buffered`` records already wait."""
        with self._lock:
            if self._closed:  # after shutdown began (e.g. a late shadow answer): counted, not kept
                self._count("dropped_shutdown")
                return False
            if self.buffered >= self.cfg.max_buffered:
                self._count("dropped_overflow")
                dropped = self.counts["dropped_overflow"]
                if dropped == 1 or dropped % 1000 == 0:
                    log.warning("request log %s: %d record(s) dropped so far: %d are waiting for the store "
                                "(serve.request_log.max_buffered=%d)", self.uri, dropped, self.buffered,
                                self.cfg.max_buffered)
                return False
            if self._open is None:
                self._seq += 1
                self._open = _Shard(self._seq, self._clock())
            self._open.records.append(record)
            self.buffered += 1
            full = len(self._open.records) >= self.cfg.shard_records
            if full:
                self._seal_locked()
        if full:
            self._wake.set()
        self._on_buffered(self.buffered)
        return True

    def _count(self, outcome: str, n: int = 1) -> None:
        self.counts[outcome] += n
        self._on_count(outcome, n)

    # ---- the writer -------------------------------------------------------------------------------

    def _seal_locked(self) -> None:
        if self._open is not None and self._open.records:
            self._sealed.append(self._open)
        self._open = None

    def _seal_if_old(self) -> None:
        with self._lock:
            if self._open is not None and self._clock() - self._open.opened_at >= self.cfg.shard_age_s:
                self._seal_locked()

    def shard_uri(self, shard: _Shard) -> str:
        day = datetime.fromtimestamp(shard.opened_at, tz=timezone.utc).strftime("%Y-%m-%d")
        name = f"{self.writer_id}-{int(shard.opened_at * 1000)}-{shard.seq:06d}.jsonl"
        return storage.join(self.uri, day, name + (".gz" if self.cfg.compress else ""))

    def _encode(self, shard: _Shard) -> bytes:
        text = "".join(json.dumps(redact(r, self._patterns), ensure_ascii=False) + "\n" for r in shard.records)
        data = text.encode("utf-8")
        return gzip.compress(data, mtime=0) if self.cfg.compress else data

    def _write(self, shard: _Shard) -> None:
        uri = self.shard_uri(shard)
        fs, path = storage.filesystem(uri)
        data = self._encode(shard)
        parent, name = path.rsplit("/", 1)
        if storage.is_s3(uri):  # an object appears whole, on close (and S3 needs no folders: no marker objects)
            with fs.open_output_stream(path, compression=None) as f:
                f.write(data)
            return
        fs.create_dir(parent, recursive=True)
        tmp = f"{parent}/.{name}.tmp"
        with fs.open_output_stream(tmp, compression=None) as f:
            f.write(data)
        fs.move(tmp, path)

    def _drain(self, deadline: Optional[float] = None) -> None:
        """Write sealed shards in order until none is left or the store fails (then back off); with a
        ``deadline`` (flush), retry until then."""
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._draining.acquire(timeout=wait):
            return
        try:
            self._drain_locked(deadline)
        finally:
            self._draining.release()

    def _drain_locked(self, deadline: Optional[float]) -> None:
        while True:
            with self._lock:
                if not self._sealed:
                    return
                shard = self._sealed[0]
            now = time.monotonic()
            if deadline is None and now < self._next_try:
                return
            try:
                self._write(shard)
            except Exception as exc:
                self._failures += 1
                self.counts["write_errors"] += 1
                self._next_try = time.monotonic() + STORE_RETRY.backoff(self._failures)
                if self._failures == 1:
                    log.warning("request log: writing %s failed (%s: %s); %d record(s) wait in memory (at most "
                                "%d), retrying with backoff", self.shard_uri(shard), type(exc).__name__,
                                str(exc).splitlines()[0][:300] if str(exc) else "", self.buffered,
                                self.cfg.max_buffered)
                if deadline is None or time.monotonic() >= deadline:
                    return
                time.sleep(min(STORE_RETRY.backoff(self._failures), max(0.0, deadline - time.monotonic())))
                continue
            if self._failures:
                log.info("request log: the store %s takes shards again after %d failed write(s)", self.uri,
                         self._failures)
            self._failures = 0
            n = len(shard.records)
            with self._lock:
                self._sealed.popleft()
                self.buffered -= n
            self._count("written", n)
            self.counts["shards"] += 1
            self._on_buffered(self.buffered)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            try:
                self._seal_if_old()
                self._drain()
            except Exception:  # the writer never dies: it is the only way records get out
                log.exception("request log writer: unexpected error")

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Seal the open shard and write everything held, retrying until ``timeout_s`` (tests, shutdown)."""
        with self._lock:
            self._seal_locked()
        self._drain(deadline=time.monotonic() + (self.cfg.flush_timeout_s if timeout_s is None else timeout_s))

    def close(self, timeout_s: Optional[float] = None) -> dict:
        """Stop taking records, write what is held (up to ``timeout_s``, default ``flush_timeout_s``);
        what could not be written is counted as ``dropped_shutdown`` and logged. Returns the counts."""
        with self._lock:
            if self._closed:
                return dict(self.counts)
            self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        timeout_s = self.cfg.flush_timeout_s if timeout_s is None else timeout_s
        self.flush(timeout_s)
        with self._lock:
            lost = self.buffered
            self._sealed.clear()
            self._open = None
            self.buffered = 0
        if lost:
            self._count("dropped_shutdown", lost)
            log.error("request log: %d record(s) could not be written to %s before shutdown (the store kept "
                      "failing for serve.request_log.flush_timeout_s=%gs)", lost, self.uri, timeout_s)
        log.info("request log %s closed: %s", self.uri, self.counts)
        return dict(self.counts)
