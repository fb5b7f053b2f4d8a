"""Shared fixtures: a tiny local model, an isolated model cache, real local services."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from clarifier.engine.models import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible HTTP server on loopback (moto's server), with credentials in the env."""
    from moto.server import ThreadedMotoServer

    from clarifier.runtime.services import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    url = f"http://127.0.0.1:{port}"
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                                          "AWS_ENDPOINT_URL_S3", "AWS_REGION")}
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url})
    yield url
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server):
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (sqlite + proxied artifacts) on loopback; MLFLOW_TRACKING_URI points at it."""
    from clarifier.runtime.services import start_mlflow_server

    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = server.url
    yield server.url
    server.stop()
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old


@pytest.fixture(scope="module")
def ray_local(request, s3_server, mlflow_server):
    """A local Ray instance of this module's own (``RAY_CPUS`` in the module, default 4 logical CPUs).

    It starts after the S3 and MLflow fixtures so that its processes inherit their endpoints and
    credentials from this process's environment, and always as a fresh instance
    (``address="local"``), never joining a ``ray start`` head that another test left running.
    """
    import ray

    from clarifier.runtime.cluster import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=getattr(request.module, "RAY_CPUS", 4))
    yield ray
    ray.shutdown()


# --- reliability records ----------------------------------------------------------------------
# Fault tests record what they injected and what happened; the table is printed at the end of the
# test session and, when CLARIFIER_RELIABILITY_LOG names a file, appended there as JSON lines
# (benchmarks/reliability/report.py runs the fault tests and renders that file).
RELIABILITY_FIELDS = ("fault", "injected", "at_risk", "lost", "recovered", "time_to_recover_s")
_RELIABILITY_RECORDS: list[dict] = []


@pytest.fixture
def reliability(request):
    """``reliability(fault=..., injected=..., at_risk=..., lost=..., recovered=..., time_to_recover_s=...)``.

    ``at_risk``/``lost``/``recovered`` are counts with their unit in the text (e.g. "120 requests"),
    ``time_to_recover_s`` a float or None when nothing had to recover.
    """
    import json
    import time

    def record(**fields):
        missing = [f for f in RELIABILITY_FIELDS if f not in fields]
        if missing:
            raise TypeError(f"reliability record lacks {missing}")
        rec = {**fields, "test": request.node.nodeid, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _RELIABILITY_RECORDS.append(rec)
        path = os.environ.get("CLARIFIER_RELIABILITY_LOG")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    return record


def pytest_terminal_summary(terminalreporter):
    if not _RELIABILITY_RECORDS:
        return
    tr = terminalreporter
    tr.section("reliability: faults injected and what was lost")
    for r in _RELIABILITY_RECORDS:
        t = r["time_to_recover_s"]
        tr.write_line(f"{r['fault']}: injected {r['injected']}; at risk {r['at_risk']}; lost {r['lost']}; "
                      f"recovered {r['recovered']}; time to recover {'-' if t is None else f'{t:.1f} s'}")
