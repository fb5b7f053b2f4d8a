"""The labels a person gives to a labelling queue (``clarifier label select``), kept so that none is ever lost.

    store = LabelStore("queue/queue.jsonl", "labels.jsonl", labeller="ann")
    store.next_item()                      # the first queued turn without a label or a skip
    store.add("c17:3", "clarify", question="The router or the modem?", grounding_turns=[0])
    store.progress()                       # labelled, left, class balance, the kept-apart estimate

* **Append only, flushed at once.** Every label is one line appended to ``labels.jsonl`` and ``fsync``-ed before
  :meth:`LabelStore.add` returns, so a closed tab or a killed server loses nothing that was acknowledged. Each line
  is an evaluation-set record (``clarifier adapt --data labels.jsonl`` reads the file as it is): the queued turn with
  ``needs_clarification``, the question when one was written (else ``decision_only: true`` for a positive), the
  grounding turns, and ``meta.label`` (who, when, the session; for a turn that carried a pre-label from what
  happened next, ``prelabel_agrees``: whether the person confirmed it). Skips go to ``<labels>.skips.jsonl``
  beside it.
* **Resume.** Opening the store reads both files: the queue continues at the first turn with neither.
* **Two people on one file are detected, not merged.** A store holds a lock file (``<labels>.lock``: labeller, host,
  pid, start) while open; a second store on the same file refuses to open unless ``take_over=True``. And before each
  append the store checks that the file has the size it left it at: lines it did not write (another process) are
  read in and the label is refused with :class:`LabelConflict` when they already label the same turn.

Local files only (appends and ``fsync`` are what make the guarantee); copy the labels to object storage after.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

DECISIONS = ("clarify", "clear", "skip")


class LabelConflict(RuntimeError):
    """The turn was labelled by someone else (another process wrote the same labels file)."""


class LabelStoreLocked(RuntimeError):
    """Another labelling session holds the labels file."""


def jsonl_records(text: str, where: str):
    """``(line number, record)`` of each non-blank line of JSONL ``text``; a line that is not JSON is an error naming
    ``where`` and the line."""
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield no, json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}:{no}: not JSON ({exc})") from None


def read_queue(path: str | Path) -> list[dict]:
    """The queue's turns in order; a line that is not a queued turn is an error naming the file and line."""
    out, seen = [], set()
    for no, rec in jsonl_records(Path(path).read_text(), str(path)):
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or not isinstance(rec.get("query"), str):
            raise ValueError(f"{path}:{no}: a queued turn needs a string 'id' and 'query' (clarifier label select "
                             "writes them)")
        if rec["id"] in seen:
            raise ValueError(f"{path}:{no}: turn {rec['id']!r} is queued twice")
        seen.add(rec["id"])
        out.append(rec)
    if not out:
        raise ValueError(f"{path}: the queue is empty")
    return out


def _read_jsonl(path: Path, start: int = 0) -> tuple[list[dict], int]:
    """Records of ``path`` from byte ``start`` (a partial last line, from a write cut short, is left for later)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    out = []
    for no, line in enumerate(data[start:end].splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}: line {no} after byte {start} is not JSON ({exc})") from None
    return out, end


class LabelStore:
    """A queue and its labels file (see the module docstring). Thread-safe: one lock around every write."""

    def __init__(self, queue: str | Path, labels: str | Path, *, labeller: str = "", take_over: bool = False):
        self.queue = read_queue(queue)
        self.queue_path = str(queue)
        self.path = Path(labels)
        self.skips_path = self.path.with_name(self.path.name.removesuffix(".jsonl") + ".skips.jsonl")
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.labeller = labeller or os.environ.get("USER", "") or "someone"
        self.session = f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}"
        self._mutex = threading.Lock()
        self._by_id = {r["id"]: r for r in self.queue}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._take_lock(take_over)
        self.labels: dict[str, dict] = {}
        self.skipped: dict[str, dict] = {}
        self._size = {self.path: 0, self.skips_path: 0}
        self._read_new(self.path, self.labels)
        self._read_new(self.skips_path, self.skipped)
        self.foreign = 0  # lines another process appended while this store was open

    # ---- the lock ---------------------------------------------------------------------------
    def _take_lock(self, take_over: bool) -> None:
        mine = {"labeller": self.labeller, "session": self.session, "host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if self.lock_path.exists() and not take_over:
            try:
                held = json.loads(self.lock_path.read_text())
            except ValueError:
                held = {}
            if _alive(held):
                raise LabelStoreLocked(
                    f"{self.path} is being labelled by {held.get('labeller', '?')} (pid {held.get('pid')} on "
                    f"{held.get('host')}, since {held.get('since')}); label into another file, or take over with "
                    f"--take-over once that session has stopped")
        self.lock_path.write_text(json.dumps(mine) + "\n")

    def close(self) -> None:
        """Release the lock (labels are already on disk)."""
        try:
            held = json.loads(self.lock_path.read_text())
            if held.get("session") == self.session:
                self.lock_path.unlink()
        except (OSError, ValueError):
            pass

    # ---- reading ----------------------------------------------------------------------------
    def _read_new(self, path: Path, into: dict) -> int:
        recs, end = _read_jsonl(path, self._size[path])
        self._size[path] = end
        for r in recs:
            if isinstance(r, dict) and isinstance(r.get("id"), str):
                into[r["id"]] = r
        return len(recs)

    def _catch_up(self) -> None:
        """Read lines another process appended since this store last wrote (counted in ``foreign``)."""
        for path, into in ((self.path, self.labels), (self.skips_path, self.skipped)):
            if path.exists() and path.stat().st_size != self._size[path]:
                self.foreign += self._read_new(path, into)

    def done(self, turn_id: str) -> bool:
        return turn_id in self.labels or turn_id in self.skipped

    def next_item(self, after: str | None = None) -> dict | None:
        """The first queued turn with no label and no skip (after ``after``'s position when given)."""
        with self._mutex:
            self._catch_up()
            start = 0
            if after is not None and after in self._by_id:
                start = next(i for i, r in enumerate(self.queue) if r["id"] == after) + 1
            for r in self.queue[start:] + self.queue[:start]:
                if not self.done(r["id"]):
                    return r
            return None

    # ---- writing ----------------------------------------------------------------------------
    def add(self, turn_id: str, decision: str, *, question: str | None = None, grounding_turns: list[int] | None = None,
            session: str | None = None) -> dict:
        """Append one label (``decision``: clarify, clear or skip) and return its record, on disk when this returns.
        A turn already labelled or skipped (by this session or another) raises :class:`LabelConflict`."""
        if decision not in DECISIONS:
            raise ValueError(f"decision {decision!r}: one of {', '.join(DECISIONS)}")
        item = self._by_id.get(turn_id)
        if item is None:
            raise ValueError(f"turn {turn_id!r} is not in the queue {self.queue_path}")
        n_hist = len(item.get("history") or [])
        grounding = sorted(set(grounding_turns or []))
        bad = [g for g in grounding if not isinstance(g, int) or not 0 <= g < n_hist]
        if bad:
            raise ValueError(f"grounding_turns {bad}: the turn has {n_hist} earlier turns (0-{n_hist - 1})")
        question = (question or "").strip() or None
        if question and decision != "clarify":
            raise ValueError("a question goes with decision 'clarify'")
        with self._mutex:
            self._catch_up()
            if self.done(turn_id):
                prior = self.labels.get(turn_id) or self.skipped.get(turn_id)
                who = ((prior or {}).get("meta") or {}).get("label") or {}
                raise LabelConflict(f"turn {turn_id!r} is already {'skipped' if turn_id in self.skipped else 'labelled'}"
                                    f" by {who.get('by', '?')} (session {who.get('session', '?')}): not labelled twice")
            meta = {**(item.get("meta") or {}), "label": {
                "by": self.labeller, "session": session or self.session,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "decision": decision}}
            pre = (item.get("meta") or {}).get("prelabel")
            if pre and decision != "skip":  # a pre-label from what happened next: confirmed or overturned
                meta["label"]["prelabel_agrees"] = (decision == "clarify") == bool(pre.get("needs_clarification"))
            if decision == "skip":
                rec: dict[str, Any] = {"id": turn_id, "meta": meta}
                target, into = self.skips_path, self.skipped
            else:
                rec = {"id": turn_id, "history": item.get("history") or [], "query": item["query"],
                       "passages": item.get("passages") or [], "needs_clarification": decision == "clarify",
                       "grounding_turns": grounding, "meta": meta}
                if decision == "clarify":
                    rec.update({"clarifying_question": question} if question else {"decision_only": True})
                target, into = self.path, self.labels
            line = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
            with open(target, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._size[target] += len(line)
            into[turn_id] = rec
            return rec

    # ---- progress ---------------------------------------------------------------------------
    def progress(self) -> dict:
        """Labelled, skipped, left, class balance, and the kept-apart estimate: the queue's model scores against
        the labels of the kept-apart turns (AUROC with a bootstrap interval, once both classes have 3 or more)."""
        with self._mutex:
            self._catch_up()
            labels = dict(self.labels)
            skipped = len(self.skipped)
            foreign = self.foreign
        pos = sum(1 for r in labels.values() if r.get("needs_clarification"))
        kept = [(bool(r["needs_clarification"]), ((self._by_id[i].get("meta") or {}).get("queue") or {}).get("score"))
                for i, r in labels.items() if i in self._by_id
                and ((self._by_id[i].get("meta") or {}).get("queue") or {}).get("part") == "kept_apart"]
        kept = [(g, s) for g, s in kept if s is not None]
        agrees = [r["meta"]["label"]["prelabel_agrees"] for r in labels.values()
                  if "prelabel_agrees" in ((r.get("meta") or {}).get("label") or {})]
        return {"queued": len(self.queue), "labelled": len(labels), "skipped": skipped,
                "prelabels": {"queued": sum(1 for r in self.queue if (r.get("meta") or {}).get("prelabel")),
                              "confirmed": sum(agrees), "overturned": len(agrees) - sum(agrees)},
                "left": len(self.queue) - sum(1 for r in self.queue if self.done(r["id"])),
                "clarify": pos, "clear": len(labels) - pos, "kept_apart": _estimate(kept),
                "other_writers": foreign, "labels": str(self.path)}


def _estimate(pairs: list[tuple[bool, float]], seed: int = 0) -> dict:
    """The model's AUROC on the labelled kept-apart turns, with its percentile bootstrap interval."""
    from clarifier.core.metrics import auroc, paired_bootstrap

    n_pos = sum(1 for g, _ in pairs if g)
    out: dict[str, Any] = {"n": len(pairs), "clarify": n_pos, "auroc": None, "interval": None}
    if min(n_pos, len(pairs) - n_pos) < 3:
        return out
    gold, sc = [g for g, _ in pairs], [s for _, s in pairs]
    out["auroc"] = auroc(gold, sc)
    out["interval"] = paired_bootstrap(gold, {"model": ([False] * len(gold), sc)}, n_resamples=500,
                                       seed=seed)["systems"]["model"]["auroc"]
    return out


def _alive(held: dict) -> bool:
    """Whether the session in a lock file still runs (its pid, on this host; another host's lock counts as alive)."""
    if not held:
        return False
    if held.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(held.get("pid", 0)), 0)
    except (OSError, ValueError):
        return False
    return int(held.get("pid", 0)) != 0
