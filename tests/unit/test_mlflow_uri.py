"""Fail fast and clearly when the MLflow tracking server is down (MLflow's own client retries ~4 minutes)."""

from __future__ import annotations

import contextlib
import http.server
import io
import threading

import pytest

from clarifier.runtime import mlflow_uri
from clarifier.runtime.mlflow_uri import TrackingServerUnreachable, check_reachable
from clarifier.runtime.retry import RetryPolicy
from clarifier.runtime.services import free_port


def test_a_refused_server_is_named_after_the_policys_tries():
    waits: list[float] = []
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingServerUnreachable) as info:
        check_reachable(uri, policy=RetryPolicy(attempts=3, min_s=1.0, sleep=waits.append))
    assert uri in str(info.value) and "MLFLOW_TRACKING_URI" in str(info.value)
    assert waits == [1.0, 2.0]
    assert isinstance(info.value, ConnectionError)


def test_any_http_answer_is_reachable_and_other_stores_are_not_probed(monkeypatch):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # an auth proxy in front of MLflow: 401 still means the server is up
            self.send_response(401)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        check_reachable(f"http://127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
    monkeypatch.setattr(mlflow_uri, "_REACHABLE", set())
    check_reachable("sqlite:////nowhere/mlflow.db")  # not a server: nothing to probe
    check_reachable("databricks")


def test_models_list_against_a_down_server_says_so_not_no_model(monkeypatch):
    from clarifier.cli import main

    uri = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("CLARIFIER_VERBOSE", "1")
    monkeypatch.setattr(mlflow_uri, "PROBE_POLICY", RetryPolicy(attempts=1))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["models", "list", "clarifier"])
    assert code == 1
    text = err.getvalue()
    assert "TrackingServerUnreachable" in text and uri in text and "no registered model" not in text


def test_free_ports_are_distinct_and_bindable():
    import socket

    from clarifier.runtime.services import free_ports

    ports = free_ports(24)
    assert len(set(ports)) == 24  # one at a time, the OS may hand the same port out twice
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
