"""Tenants: many assistants' clarifiers served by one deployment (``serve.tenants_file``). Pure: no Ray, no HTTP.

A tenants file (YAML or JSON, a local path or ``s3://``) is data, not code; the serving app reads it again every
``serve.tenants_refresh_s`` seconds, so a tenant is added, removed or re-pointed while serving::

    default: support             # optional: the tenant of an unscoped request that names no model
    tenants:
      - name: support            # the model id clients send (OpenAI ``model``, /v1/clarify ``model``)
        model_uri: models:/clarifier-support@champion
        keys_sha256: [9f86d08...] # keys scoped to this tenant (SHA-256 digests: the file holds no secret)
        latency_budget_s: 2.0     # optional: this tenant's own admission budget
        rate_limit_per_s: 20      # optional: requests per second (a token bucket of rate_burst)
        shadow_model_uri: models:/clarifier-support@challenger   # optional: scored beside it, logged, never returned
      - name: hr
        model_uri: s3://models/clarifier-hr

``clarifier tenants key <name> --file F`` makes a key, writes its digest into the file and prints the key once.

Who may call what (:meth:`TenantDirectory.resolve`):

* a key scoped to a tenant reaches that tenant only: naming another model is 403, whether that model exists or not
  (a scoped key learns nothing of the others); naming none means its own;
* an operator key (``$CLARIFIER_API_KEYS`` / ``serve.api_keys_file``) reaches every tenant and must name one (or
  the ``default``);
* with no key configured anywhere, auth is off and a request names its tenant (or gets the ``default``);
* an unknown model is 404 naming the served ones (to callers allowed to see them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


class TenantError(Exception):
    """A request the tenants refuse: HTTP ``status``, a short ``code`` and a message naming what and why."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message names the file and the entry."""


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The tenant and the model id its clients send: lowercase letters, digits, . _ -.")
    model_uri: str = Field(description="Its model: models:/name@alias (followed), models:/name/3, runs:/, s3://, "
                                       "builtin: or a folder. Models that share base and adapter share one copy.")
    keys_sha256: list[str] = Field(default_factory=list, description="SHA-256 hex digests of the API keys scoped "
                                                                     "to this tenant.")
    latency_budget_s: Optional[float] = Field(None, gt=0, description="This tenant's admission budget (default: "
                                                                      "serve.latency_budget_s).")
    rate_limit_per_s: Optional[float] = Field(None, gt=0, description="Most requests per second (token bucket); "
                                                                      "beyond, 429 with Retry-After. null: none.")
    rate_burst: Optional[int] = Field(None, ge=1, description="Token bucket size (default: one second's worth, "
                                                              "at least 1).")
    shadow_model_uri: Optional[str] = Field(None, description="This tenant's challenger (e.g. models:/clarifier-hr"
                                            "@challenger): it also scores a share of the tenant's answered requests, "
                                            "off the response path, into the tenant's request log (meta.shadow), for "
                                            "`clarifier models promote --shadow-log <log>/<tenant>`.")
    shadow_share: float = Field(1.0, ge=0, le=1, description="Share of the tenant's answered requests its shadow "
                                                             "scores.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"tenant name {v!r} must match {NAME_RE.pattern} (it is a URL and log-folder part)")
        return v

    @field_validator("keys_sha256")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        bad = [d for d in v if not DIGEST_RE.match(d)]
        if bad:
            raise ValueError(f"keys_sha256 holds {len(bad)} value(s) that are not 64 lowercase hex digits (a SHA-256 "
                             "digest, never the key itself: `clarifier tenants key` writes it)")
        return v

    @property
    def mux_id(self) -> str:
        """Serve's multiplexed model id: the tenant and its URI (a re-pointed tenant is a new model to a replica)."""
        return f"{self.name}::{self.model_uri}"

    @property
    def shadow_mux_id(self) -> str:
        """The challenger's multiplexed model id (``~`` is in no tenant name, so it is nobody's model)."""
        return f"{self.name}~shadow::{self.shadow_model_uri}"


class TenantsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: list[TenantSpec] = Field(min_length=1)
    default: Optional[str] = None

    @model_validator(mode="after")
    def _unique(self) -> "TenantsSpec":
        seen: dict[str, int] = {}
        for i, t in enumerate(self.tenants):
            if t.name in seen:
                raise ValueError(f"tenants[{i}]: name {t.name!r} is already tenants[{seen[t.name]}]'s")
            seen[t.name] = i
        owner: dict[str, str] = {}
        for t in self.tenants:
            for d in t.keys_sha256:
                if d in owner and owner[d] != t.name:
                    raise ValueError(f"a key digest is scoped to both {owner[d]!r} and {t.name!r}: a key reaches one "
                                     "tenant")
                owner[d] = t.name
        if self.default is not None and self.default not in seen:
            raise ValueError(f"default {self.default!r} is not a tenant (tenants: {', '.join(seen)})")
        return self


def parse_tenants(text: str, where: str = "tenants file") -> TenantsSpec:
    """A tenants file's text (YAML or JSON) -> TenantsSpec; a TenantsFileError names ``where`` and the entry."""
    import yaml

    try:
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise TenantsFileError(f"{where}: not valid YAML or JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise TenantsFileError(f"{where}: expected a mapping with a 'tenants' list, got {type(data).__name__}")
    try:
        return TenantsSpec.model_validate(data)
    except ValidationError as exc:
        # Not core.config.validation_messages: it names the value it got, and a key pasted where its digest belongs
        # must not be printed.
        msgs = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e["loc"])
            msgs.append(f"{loc + ': ' if loc else ''}{e['msg'].removeprefix('Value error, ')}")
        raise TenantsFileError(f"{where}: " + "; ".join(msgs)) from None


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``tenant`` a key is scoped to (None: an operator key, or auth off)."""

    tenant: Optional[str] = None


class TenantDirectory:
    """The tenants of one tenants file, and who may call which (:meth:`resolve`)."""

    def __init__(self, spec: TenantsSpec):
        self.spec = spec
        self.by_name = {t.name: t for t in spec.tenants}
        self._scoped = {d: t.name for t in spec.tenants for d in t.keys_sha256}

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def scoped_tenant(self, digest: str) -> Optional[str]:
        """The tenant a key digest is scoped to, if any."""
        return self._scoped.get(digest)

    @property
    def has_keys(self) -> bool:
        return bool(self._scoped)

    def visible(self, caller: Caller) -> list[TenantSpec]:
        """The tenants ``caller`` may see (GET /v1/models)."""
        if caller.tenant is not None:
            return [self.by_name[caller.tenant]] if caller.tenant in self.by_name else []
        return list(self.spec.tenants)

    def resolve(self, caller: Caller, requested: Optional[str]) -> TenantSpec:
        """The tenant that answers ``caller``'s request naming ``requested`` (None: named none)."""
        requested = (requested or "").strip() or None
        if caller.tenant is not None:
            if caller.tenant not in self.by_name:  # its tenant was removed while serving
                raise TenantError(403, "tenant_removed", f"this API key's tenant {caller.tenant!r} is no longer served")
            if requested is not None and requested != caller.tenant:
                raise TenantError(403, "model_not_allowed",
                                  f"this API key is scoped to model {caller.tenant!r}; it may not call {requested!r}")
            return self.by_name[caller.tenant]
        if requested is None:
            if self.spec.default is None:
                raise TenantError(400, "model_required",
                                  f"name a model (one of: {', '.join(self.names)}): the 'model' field, or the "
                                  "X-Clarifier-Model header on /v1/clarify")
            return self.by_name[self.spec.default]
        if requested not in self.by_name:
            raise TenantError(404, "model_not_found",
                              f"model {requested!r} is not served here (served: {', '.join(self.names)})")
        return self.by_name[requested]

    def changes(self, other: "TenantDirectory") -> dict:
        """What ``other`` adds, removes and re-points compared with this one (for the reload's log line)."""
        a, b = self.by_name, other.by_name
        return {"added": sorted(set(b) - set(a)), "removed": sorted(set(a) - set(b)),
                "changed": sorted(n for n in set(a) & set(b) if a[n] != b[n])}


def add_key_digest(spec_data: dict, tenant: str, digest: str) -> dict:
    """The tenants file's mapping with ``digest`` scoped to ``tenant`` (for ``clarifier tenants key``)."""
    tenants: Iterable[dict] = spec_data.get("tenants") or []
    for t in tenants:
        if t.get("name") == tenant:
            t.setdefault("keys_sha256", []).append(digest)
            return spec_data
    raise TenantsFileError(f"no tenant {tenant!r} in the file (tenants: "
                           f"{', '.join(str(t.get('name')) for t in tenants)})")
