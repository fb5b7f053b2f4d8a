"""Local services for the embedded default: a real ``mlflow server`` (sqlite + proxied artifacts)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now: all held open together while chosen (one at a time, the OS may
    hand the same port out twice, e.g. to two of a Ray node's components)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_busy(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (a wildcard host is checked on loopback)."""
    with socket.socket() as s:
        return s.connect_ex((host if host not in ("0.0.0.0", "") else "127.0.0.1", port)) == 0


@dataclass
class MlflowServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)

    def __enter__(self) -> "MlflowServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def mlflow_env() -> dict[str, str]:
    """Variables every MLflow client here needs (telemetry off: it stalls clients without network)."""
    return {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}


def start_mlflow_server(root: str | Path, port: int | None = None, host: str = "127.0.0.1",
                        timeout_s: float = 90.0) -> MlflowServer:
    """Start ``mlflow server`` with a sqlite backend and artifacts under ``root``; wait until healthy."""
    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or shutil.which("mlflow")
    cmd = [exe or sys.executable, *([] if exe else ["-m", "mlflow"]), "server",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts"), "--serve-artifacts",
           "--host", host, "--port", str(port), "--workers", "1"]
    log_path = root / "mlflow-server.log"
    # MLflow's server-side job execution (GenAI jobs; unused here) starts a job runner and seven
    # huey consumer processes: ~1 GiB and twice the start-up time on a small box. Off unless asked for.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ, **mlflow_env()}
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://{host}:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return MlflowServer(url, proc, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    MlflowServer(url, proc, log_path).stop()
    raise TimeoutError(f"mlflow server did not become healthy within {timeout_s:.0f}s; see {log_path}")
