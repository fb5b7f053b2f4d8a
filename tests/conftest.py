"""Shared fixtures: a tiny local model, an isolated model cache, real local services."""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
from pathlib import Path

import pytest

from support.paths import PUBLIC

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `src: dataset:<name>` (the recipes) finds the public datasets in ../shared on this machine and in CI;
# where that folder is absent the tests that need the data skip, and nothing is downloaded.
if PUBLIC.is_dir():
    os.environ.setdefault("CLARIFIER_DATA_MIRROR", str(PUBLIC))


# --- two processes (pytest-xdist, `-n 2` in pyproject.toml) ------------------------------------------
# Every test that starts local services (Ray, `mlflow server`, S3, Serve: tests/integration, tests/e2e)
# runs in one worker process, one after another in collection order: two local Ray instances on one
# host would collide on fixed ports, and most of these tests size their load for 2 cores. They keep the
# cores ~75% busy, and the unit tests run in the other worker meanwhile. (A scheduler of our own:
# xdist 3.8's `--dist loadgroup` renames node ids, which pytest 9 no longer lets it do.)
SERVICES = "services"


def _scope(nodeid: str) -> str:
    """The unit of work a worker takes whole: all service tests together; a unit-test module."""
    path = nodeid.split("::", 1)[0]
    return SERVICES if {"integration", "e2e"} & set(path.split("/")[:-1]) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ServicesInOneWorker(LoadScopeScheduling):
        # the largest unit of work goes out first (xdist orders them by size): the service tests
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ServicesInOneWorker(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from support.tinymodel import build_tiny_model

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
    with pytest.MonkeyPatch.context() as mp:  # the session's env, given back at its end
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                     "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url}.items():
            mp.setenv(k, v)
        yield url
        server.stop()


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
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", server.url)
        yield server.url
        server.stop()


@pytest.fixture(scope="module")
def ray_local(request, s3_server, mlflow_server):
    """A local Ray instance of this module's own (``RAY_CPUS`` in the module, default 4 logical CPUs),
    with the worker env the platform forwards.

    It starts after the S3 and MLflow fixtures so that its processes inherit their endpoints and
    credentials from this process's environment.
    """
    from clarifier.runtime.cluster import worker_env
    from support.ray import start_ray

    with start_ray(getattr(request.module, "RAY_CPUS", 4), dashboard=True, env=worker_env(),
                   log_to_driver=True) as ray:
        yield ray


@pytest.fixture(scope="module")
def port() -> int:
    """One HTTP port for a module's Serve deployments: Serve keeps the port it was first started with."""
    from clarifier.runtime.services import free_port

    return free_port()


@pytest.fixture
def ray_own():
    """A local Ray instance of this test's own (3 logical CPUs), for tests that run their own
    servers: list those fixtures before this one, so that its processes inherit their environment."""
    from clarifier.runtime.cluster import worker_env
    from support.ray import start_ray

    with start_ray(3, dashboard=True, env=worker_env(), log_to_driver=True) as ray:
        yield ray


# --- reliability records ----------------------------------------------------------------------
# Fault tests record what they injected and what happened; the table is printed at the end of the
# test session and, when CLARIFIER_RELIABILITY_LOG names a file, appended there as JSON lines
# (benchmarks/reliability/report.py runs the fault tests and renders that file). A record travels in
# the test's report (user_properties), so the table is complete when the tests ran in worker processes.
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
        request.node.user_properties.append(("reliability", rec))
        path = os.environ.get("CLARIFIER_RELIABILITY_LOG")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    return record


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # the last report of a test carries everything it recorded
        _RELIABILITY_RECORDS.extend(v for k, v in report.user_properties if k == "reliability")


def pytest_terminal_summary(terminalreporter):
    if not _RELIABILITY_RECORDS:
        return
    tr = terminalreporter
    tr.section("reliability: faults injected and what was lost")
    for r in _RELIABILITY_RECORDS:
        t = r["time_to_recover_s"]
        tr.write_line(f"{r['fault']}: injected {r['injected']}; at risk {r['at_risk']}; lost {r['lost']}; "
                      f"recovered {r['recovered']}; time to recover {'-' if t is None else f'{t:.1f} s'}")


# --- the session's exit status, not the interpreter's teardown -------------------------------------
# One pytest process loads Ray (started and shut down per module), torch, DeepSpeed, pyarrow, MLflow,
# moto and selenium. CI once reported "706 passed" and then the process died of SIGSEGV (exit 139) while
# the interpreter tore down modules with native threads still alive. The run's verdict is what the tests
# said: once pytest has finished (every fixture torn down, the summary printed, every other atexit hook
# run, Ray's shutdown included: this one is registered first, so it runs last), exit with the session's
# status without finalizing the interpreter. A crash before that point still shows, with every thread's
# stack (faulthandler, re-enabled after pytest's own handler is removed).
_SESSION_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _SESSION_STATUS[:] = [int(exitstatus)]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    faulthandler.enable(file=sys.__stderr__, all_threads=True)


def _exit_with_the_sessions_status() -> None:
    if _SESSION_STATUS:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        os._exit(_SESSION_STATUS[0])


atexit.register(_exit_with_the_sessions_status)
