"""Reading and watching a tenants file (``serve.tenants_file``: a local path or ``s3://``); the rules are
:mod:`clarifier.core.tenants`'.

The app builder reads the file once (a bad file fails the deployment, naming the file and the entry); the ingress
then reads it again every ``serve.tenants_refresh_s`` seconds (:class:`TenantsWatch`) and applies a changed file
while serving. A changed file that cannot be used (unreadable, invalid) is refused: the tenants served now stay, the
error is logged and counted (``clarifier_tenants_reloads_total{outcome="refused"}``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from clarifier.core.tenants import TenantDirectory, TenantsFileError, TenantsSpec, parse_tenants
from clarifier.runtime import storage

log = logging.getLogger("ray.serve.clarifier")


def read_tenants(uri: str) -> tuple[TenantsSpec, str]:
    """The tenants file at ``uri`` and its text; a TenantsFileError names the file and what is wrong."""
    try:
        text = storage.read_text(uri)
    except (OSError, ValueError) as exc:
        raise TenantsFileError(f"serve.tenants_file {uri} cannot be read ({type(exc).__name__}: {exc})") from None
    return parse_tenants(text, where=f"serve.tenants_file {uri}"), text


class TenantsWatch:
    """Reads ``uri`` every ``refresh_s`` seconds in a daemon thread; calls ``on_change(directory, None)`` when its
    text changed and is valid, ``on_change(None, error)`` when it changed and is not (once per distinct text)."""

    def __init__(self, uri: str, refresh_s: float, on_change: Callable[[Optional[TenantDirectory], Optional[str]], None],
                 initial_text: Optional[str] = None):
        self.uri = uri
        self.refresh_s = refresh_s
        self._on_change = on_change
        self._text = initial_text
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.refresh_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="clarifier-tenants-watch", daemon=True)
        self._thread.start()

    def poll_once(self) -> bool:
        """Read the file; True when a changed text was applied."""
        try:
            text = storage.read_text(self.uri)
        except Exception as exc:  # unreachable for now: keep serving what we have, say so once per kind
            if self._text != f"<error {type(exc).__name__}>":
                self._text = f"<error {type(exc).__name__}>"
                self._on_change(None, f"cannot read {self.uri} ({type(exc).__name__}: {exc})")
            return False
        if text == self._text:
            return False
        self._text = text
        try:
            spec = parse_tenants(text, where=f"serve.tenants_file {self.uri}")
        except TenantsFileError as exc:
            self._on_change(None, str(exc))
            return False
        self._on_change(TenantDirectory(spec), None)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.poll_once()
            except Exception:  # the watcher never dies
                log.exception("tenants watcher iteration failed")

    def stop(self) -> None:
        self._stop.set()
