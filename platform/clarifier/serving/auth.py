"""API keys for the Clarifier HTTP API (no Ray, no FastAPI: pure and unit-tested).

Keys come from ``$CLARIFIER_API_KEYS`` (comma separated) and/or ``serve.api_keys_file`` (one key
per line, blank lines and ``#`` comments ignored). Both sources are merged. Clients send either
``Authorization: Bearer <key>`` or ``X-API-Key: <key>``.

Only SHA-256 digests of the keys leave :func:`load_api_keys`' caller (the app builder): the ingress
deployment is given digests, so plain keys are never part of a deployment's arguments, never
logged and never echoed in an answer. A presented key is hashed and compared with
``hmac.compare_digest`` against *every* configured digest (no early exit), so the time taken does
not depend on which key matched or how much of it was right.

Auth is off only when no key is configured at all; an ``api_keys_file`` that is missing or holds no
key is an error (a typo must not silently disable authentication).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from clarifier.core.config import ConfigError

ENV_VAR = "CLARIFIER_API_KEYS"
HEADER = "X-API-Key"


def key_digest(key: str) -> str:
    """The SHA-256 hex digest a key is configured and compared by (also a tenant's ``keys_sha256``)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _parse_env(raw: str) -> list[str]:
    return [k.strip() for k in raw.split(",") if k.strip()]


def _parse_file(path: str) -> list[str]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"serve.api_keys_file {path} does not exist or is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"serve.api_keys_file {path} cannot be read ({type(exc).__name__})") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"serve.api_keys_file {path} holds no API key (one key per line expected)")
    return keys


def load_api_keys(api_keys_file: str | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """All configured keys (env + file, de-duplicated, in order); [] means auth is off."""
    env = os.environ if environ is None else environ
    keys = _parse_env(env.get(ENV_VAR, ""))
    if api_keys_file:
        keys += _parse_file(api_keys_file)
    for k in keys:
        if any(c.isspace() for c in k):
            raise ConfigError(f"an API key from ${ENV_VAR} or serve.api_keys_file contains whitespace")
    return list(dict.fromkeys(keys))


def key_digests(keys: Iterable[str]) -> tuple[str, ...]:
    return tuple(key_digest(k) for k in keys)


class ApiKeyAuth:
    """Checks a presented key against configured digests in constant time per configured key."""

    def __init__(self, digests: Iterable[str]):
        self._digests = tuple(d.encode("ascii") for d in digests)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def n_keys(self) -> int:
        return len(self._digests)

    def check(self, presented: str | None) -> bool:
        """True when auth is off, or ``presented`` is one of the configured keys."""
        if not self._digests:
            return True
        if not presented:
            return False
        candidate = key_digest(presented).encode("ascii")
        ok = False
        for d in self._digests:  # every digest is compared, whatever matched before
            ok |= hmac.compare_digest(d, candidate)
        return ok


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key sent as ``Authorization: Bearer <key>`` (preferred) or ``X-API-Key: <key>``."""
    auth = headers.get("authorization") or ""
    scheme, _, value = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    key = (headers.get("x-api-key") or "").strip()
    return key or None
