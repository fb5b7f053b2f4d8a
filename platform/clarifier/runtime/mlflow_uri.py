"""The MLflow tracking URI, resolved in one place for every stage.

``tracking.tracking_uri`` if set, else ``$MLFLOW_TRACKING_URI``, else MLflow's default (a local
``sqlite:///mlflow.db``) -- made absolute: Ray workers and Serve replicas run in their own working
directories, and a relative store would be a different, empty database there (the bug that once
lost training metrics: "run not found").
"""

from __future__ import annotations

import os
from pathlib import Path


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
