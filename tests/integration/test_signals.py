"""`clarifier serve` stopped by SIGTERM (systemd, Kubernetes, kill) or SIGINT (Ctrl-C) stops everything
it started: the local Ray instance (gcs_server, raylet, the Serve proxy, the replicas) and the port, in
bounded time, so a restart finds the port free. A training run stopped by SIGTERM mid-training stops its
Ray instance and training workers too. Run as a user runs it: the `clarifier` executable."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from support.adapters import untrained_adapter

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stops_its_local_ray_on_a_signal(sig, tiny_model_dir, tmp_path):
    folder = untrained_adapter(tiny_model_dir, tmp_path / "adapter", threshold=1.0, seed=1)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CLARIFIER_LOG_DIR"] = str(tmp_path / "logs")
    proc = subprocess.Popen([sys.executable, "-m", "clarifier.cli", "serve", f"serve.model_uri={folder}",
                             f"serve.port={port}", "serve.cpus_per_replica=0.5", "serve.model_refresh_s=0"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out_lines: list[str] = []
    reader = threading.Thread(target=lambda: out_lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 300
        while True:  # ready, and the command has said so on its terminal
            assert proc.poll() is None, proc.communicate()
            try:
                if (httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
                        and any("Clarifier serving model" in ln for ln in out_lines)):
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, f"serve did not become ready: {out_lines}"
            time.sleep(2)
        started = _descendants(proc.pid)
        names = {p.name() for p in started}
        assert any("raylet" in n for n in names) and any("gcs_server" in n for n in names), names
        proc.send_signal(sig)
        err = proc.communicate(timeout=90)[1]  # bounded: the command exits
        reader.join(10)
        out = "".join(out_lines)
        assert proc.returncode in (0, 130, 128 + signal.SIGTERM), (proc.returncode, err[-3000:])
        gone, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, [(p.pid, p.name()) for p in alive]  # nothing it started is left running
        assert not _port_open(port)  # a restart finds the port free
        assert "Clarifier serving model" in out and "INFO" not in out  # its own line only, on the terminal
        assert "Traceback" not in out + err, err[-3000:]
        logs = list((tmp_path / "logs").glob("serve-*.log"))
        assert len(logs) == 1 and "Ray" in logs[0].read_text()  # Ray's logs went to the run's log file
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _descendants(proc.pid):
            p.kill()


@pytest.mark.timeout(600)
def test_training_stops_its_local_ray_and_workers_on_sigterm(tiny_model_dir, tmp_path):
    from clarifier.data.synthetic import write_logs
    from support.config import tiny_lora

    write_logs(str(tmp_path / "logs"), 30, seed=2, shards=1)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(CLARIFIER_LOG_DIR=str(tmp_path / "logs-run"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    args = [f"storage.root={tmp_path / 'store'}", f"data.input={tmp_path / 'logs'}", f"data.output={tmp_path / 'data'}",
            "data.formats=[jsonl]", *tiny_lora(tiny_model_dir), "train.num_workers=1", "train.micro_batch_size=2",
            "train.max_steps=100000", "train.max_minutes=null", "eval.calibration_split=null"]
    proc = subprocess.Popen([sys.executable, "-m", "clarifier.cli", "train", "--prepare", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out_lines: list[str] = []
    reader = threading.Thread(target=lambda: out_lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 400
        while not any(ln.startswith("[train] step ") for ln in out_lines):  # training, not only starting
            assert proc.poll() is None, (out_lines, proc.communicate()[1][-3000:])
            assert time.time() < deadline, f"training did not reach a step: {out_lines}"
            time.sleep(1)
        started = _descendants(proc.pid)
        names = {p.name() for p in started}
        assert any("raylet" in n for n in names) and any("gcs_server" in n for n in names), names
        assert any("TrainWorker" in " ".join(p.cmdline()) or "ray::" in p.name() for p in started), names
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=90)[1]  # bounded: the command exits
        reader.join(10)
        assert proc.returncode in (1, 128 + signal.SIGTERM), (proc.returncode, err[-3000:])
        gone, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, [(p.pid, p.name()) for p in alive]  # no raylet, GCS or training worker left behind
        assert "Traceback" not in "".join(out_lines) + err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _descendants(proc.pid):
            p.kill()
