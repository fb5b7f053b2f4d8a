"""The MLflow tracking URI, resolved in one place for every stage.

``tracking.tracking_uri`` if set, else ``$MLFLOW_TRACKING_URI``, else MLflow's default (a local
``sqlite:///mlflow.db``) -- made absolute: Ray workers and Serve replicas run in their own working
directories, and a relative store would be a different, empty database there (the bug that once
lost training metrics: "run not found").
"""

from __future__ import annotations

import os
from pathlib import Path

from clarifier.runtime.retry import RetryPolicy


def tracking_uri(setting: str | None = None) -> str:
    """The tracking URI every process of a stage uses (see the module docstring)."""
    uri = setting or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        import mlflow

        uri = mlflow.get_tracking_uri()
    return absolute_tracking_uri(uri)


def absolute_tracking_uri(uri: str, cwd: str | Path | None = None) -> str:
    """``sqlite:///rel.db`` / ``file:rel`` / ``rel/mlruns`` -> absolute, against ``cwd``; servers unchanged."""
    base = Path(cwd or os.getcwd())
    if uri.split(":")[0] in ("databricks", "databricks-uc", "uc"):
        return uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(base / uri[len("sqlite:///"):])
    if "://" not in uri:
        path = uri[len("file:"):] if uri.startswith("file:") else uri
        return str(path if Path(path).is_absolute() else base / path)
    return uri


class TrackingServerUnreachable(ConnectionError):
    """The MLflow tracking server named by the tracking URI does not answer (the message names it)."""


_REACHABLE: set[str] = set()
PROBE_POLICY = RetryPolicy(attempts=3, min_s=1.0)  # waits 1 s, 2 s


def check_reachable(uri: str, *, timeout_s: float = 5.0, policy=None) -> None:
    """Fail fast, naming the server, when an ``http(s)://`` tracking server does not answer.

    MLflow's own client retries a refused connection for about four minutes (7 retries, backoff 2)
    before it raises, and some callers read its error as "not found"; this asks ``<uri>/health``
    (a few tries, ~3 s) first. Any HTTP answer counts as reachable (an auth proxy's 401 too); only
    a connection that fails or times out does not. Other stores (sqlite, files, Databricks) pass.
    Checked once per process and URI."""
    import urllib.error
    import urllib.request

    if not uri.startswith(("http://", "https://")) or uri in _REACHABLE:
        return

    def probe() -> None:
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
        except urllib.error.HTTPError:  # the server answered
            pass

    try:
        (policy or PROBE_POLICY).call(probe, on=(OSError,))
    except OSError as exc:
        reason = getattr(exc, "reason", None) or exc
        raise TrackingServerUnreachable(
            f"MLflow tracking server {uri} is not reachable ({reason}): start it, or point tracking.tracking_uri / "
            f"$MLFLOW_TRACKING_URI at a running server (unset both for a local sqlite store)") from None
    _REACHABLE.add(uri)
