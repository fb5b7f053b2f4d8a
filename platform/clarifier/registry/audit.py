"""The append-only audit log of registry decisions (promotions, refusals, rollbacks).

One JSON record per decision. Where it lives (``registry.audit_log``; default
``<storage.root>/registry/audit.jsonl``):

* a **local path** is one JSONL file; a record is appended as one line under an exclusive
  ``flock`` and fsynced; nothing is ever rewritten;
* an **s3:// URI** is a prefix (S3 has no append): each record is its own one-line JSONL object
  ``<uri>/<UTC time>-<random>.jsonl``, never overwritten; reading concatenates them in name (time)
  order.

Reading refuses a corrupt record with its location and line instead of guessing.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import os
import uuid
from pathlib import Path

from clarifier.runtime import storage


class AuditLogError(RuntimeError):
    """The audit log cannot be read or written; the message names the location (and line)."""


def current_user() -> str:
    """Who is deciding: ``$CLARIFIER_USER``, else the login name, else "unknown"."""
    if os.environ.get("CLARIFIER_USER"):
        return os.environ["CLARIFIER_USER"]
    try:
        return getpass.getuser()
    except Exception:  # no login name (some containers)
        return "unknown"


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def default_location(storage_root: str) -> str:
    return storage.join(storage_root, "registry", "audit.jsonl")


class AuditLog:
    """Append and read decision records at ``location`` (local JSONL file or ``s3://`` prefix)."""

    def __init__(self, location: str):
        if not location:
            raise AuditLogError("audit log location is empty (set registry.audit_log or storage.root)")
        self.location = str(location)

    def __repr__(self) -> str:
        return f"AuditLog({self.location!r})"

    # ---- writing ------------------------------------------------------------------------------

    def append(self, record: dict) -> dict:
        """Append one record (``id`` and ``time`` are added when missing); returns it as written."""
        rec = {"id": uuid.uuid4().hex, "time": utc_now(), **record}
        line = json.dumps(rec, sort_keys=False, default=str)
        if "\n" in line:  # cannot happen with json.dumps, but a record must stay one line
            raise AuditLogError("audit record serialises to more than one line")
        try:
            if storage.is_s3(self.location):
                stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
                storage.write_text(storage.join(self.location, f"{stamp}-{uuid.uuid4().hex[:12]}.jsonl"), line + "\n")
            else:
                self._append_local(line)
        except AuditLogError:
            raise
        except Exception as exc:
            raise AuditLogError(f"cannot append to the audit log {self.location}: {exc}") from exc
        return rec

    def _append_local(self, line: str) -> None:
        import fcntl

        path = Path(self.location).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # ---- reading ------------------------------------------------------------------------------

    def _texts(self) -> list[tuple[str, str]]:
        if storage.is_s3(self.location):
            try:
                files = storage.list_files(self.location, (".jsonl",))
            except FileNotFoundError:
                return []
            return [(f, storage.read_text(f)) for f in files]
        path = Path(self.location).expanduser()
        if not path.exists():
            return []
        if not path.is_file():
            raise AuditLogError(f"audit log {path} is not a file")
        return [(str(path), path.read_text())]

    def records(self, model: str | None = None, alias: str | None = None) -> list[dict]:
        """All records in order (optionally only of ``model`` and ``alias``)."""
        out = []
        for source, text in self._texts():
            for i, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise AuditLogError(f"audit log {source}:{i} is not valid JSON ({exc.msg}); "
                                        "fix or remove that line by hand") from None
                if not isinstance(rec, dict):
                    raise AuditLogError(f"audit log {source}:{i} is not a JSON object")
                if model is not None and rec.get("model") != model:
                    continue
                if alias is not None and rec.get("alias") != alias:
                    continue
                out.append(rec)
        return out


def alias_history(records: list[dict]) -> list[str]:
    """Versions an alias held, oldest first, as the audit records tell it (promotions push, rollbacks pop).

    A promotion whose ``previous_version`` is not the top of the stack (the alias had been set
    outside the gate, e.g. by ``models register --alias``) pushes that previous version first.
    """
    stack: list[str] = []
    for rec in records:
        if rec.get("decision") == "promoted":
            prev, new = rec.get("previous_version"), rec.get("to_version")
            if prev is not None and (not stack or stack[-1] != str(prev)):
                stack.append(str(prev))
            if new is not None:
                stack.append(str(new))
        elif rec.get("decision") == "rolled_back":
            if stack and stack[-1] == str(rec.get("from_version")):
                stack.pop()
            if rec.get("to_version") is not None and (not stack or stack[-1] != str(rec["to_version"])):
                stack.append(str(rec["to_version"]))
    return stack
