"""Every command that starts local services stops them on SIGTERM (systemd, Kubernetes, kill) and on
SIGINT (Ctrl-C), in bounded time: `clarifier serve` (the local Ray instance: gcs_server, raylet, the
Serve proxy, the replicas; and the port, so a restart finds it free), a training run (Ray and its
training workers) and `clarifier quickstart` (the MLflow server, Ray, the training workers). Run as a
user runs them: the `clarifier` executable, signalled while it works."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from support.adapters import untrained_adapter

SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
# One signal per command where one stands for both: every command turns SIGTERM into SystemExit (the
# handler `init_ray` puts back after Ray's core replaced it) and SIGINT into KeyboardInterrupt, and stops
# in the same `finally` blocks. `clarifier serve` gets both (the service Kubernetes stops with SIGTERM and
# a developer with Ctrl-C); a training run gets SIGTERM (`ray job stop`, a pod evicted), the quickstart,
# stopped while it trains, Ctrl-C (a user at a terminal): both signals reach a training run's workers.
# Each of these tests takes 1-2 minutes of a 2-core box.
SIGTERM_ONLY = pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
SIGINT_ONLY = pytest.mark.parametrize("sig", [signal.SIGINT], ids=["SIGINT"])
# what the command may exit with: 130 (Ctrl-C), 128 + 15 (SIGTERM), 1 (a stage failed because it was stopped)
EXIT_CODES = (0, 1, 130, 128 + signal.SIGTERM)


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


class Cli:
    """``python -m clarifier.cli ARGS`` with its stdout read line by line as it runs."""

    def __init__(self, args: list[str], cwd, env_update: dict):
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
        env.update(env_update)
        self.proc = subprocess.Popen([sys.executable, "-m", "clarifier.cli", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                       daemon=True)
        self.reader.start()

    def wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.time() + timeout_s
        while not ready():
            assert self.proc.poll() is None, (self.lines, self.proc.communicate()[1][-3000:])
            assert time.time() < deadline, f"{what} did not happen: {self.lines}"
            time.sleep(1)

    def stop(self, sig) -> tuple[list[str], str, str]:
        """Signal the command; it must exit within 90 s and leave nothing it started running.
        Returns the command lines of what it had started, its stdout and its stderr."""
        started = _descendants(self.proc.pid)
        seen = []
        for p in started:
            try:
                seen.append(f"{p.name()} {' '.join(p.cmdline())}")
            except psutil.NoSuchProcess:
                pass
        assert any("raylet" in n for n in seen) and any("gcs_server" in n for n in seen), seen
        self.proc.send_signal(sig)
        err = self.proc.communicate(timeout=90)[1]  # bounded: the command exits
        self.reader.join(10)
        assert self.proc.returncode in EXIT_CODES, (self.proc.returncode, err[-3000:])
        gone, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, [(p.pid, p.name()) for p in alive]  # nothing it started is left running
        out = "".join(self.lines)
        assert "Traceback" not in out + err, err[-3000:]
        return seen, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for p in _descendants(self.proc.pid):
            p.kill()


@pytest.mark.timeout(600)
@SIGNALS
def test_serve_stops_its_local_ray_on_a_signal(sig, tiny_model_dir, tmp_path):
    folder = untrained_adapter(tiny_model_dir, tmp_path / "adapter", threshold=1.0, seed=1)
    port = _free_port()
    cli = Cli(["serve", f"serve.model_uri={folder}", f"serve.port={port}", "serve.cpus_per_replica=0.5",
               "serve.model_refresh_s=0"], tmp_path, {"CLARIFIER_LOG_DIR": str(tmp_path / "logs")})

    def ready() -> bool:  # ready, and the command has said so on its terminal
        try:
            return (httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
                    and any("Clarifier serving model" in ln for ln in cli.lines))
        except httpx.HTTPError:
            return False

    try:
        cli.wait_for(ready, 300, "serve becoming ready")
        _, out, _ = cli.stop(sig)
        assert not _port_open(port)  # a restart finds the port free
        assert "Clarifier serving model" in out and "INFO" not in out  # its own line only, on the terminal
        logs = list((tmp_path / "logs").glob("serve-*.log"))
        assert len(logs) == 1 and "Ray" in logs[0].read_text()  # Ray's logs went to the run's log file
    finally:
        cli.kill()


def _training(cli: Cli) -> None:
    cli.wait_for(lambda: any(ln.startswith("[train] step ") for ln in cli.lines), 400, "a training step")


@pytest.mark.timeout(600)
@SIGTERM_ONLY
def test_training_stops_its_local_ray_and_workers_on_a_signal(sig, tiny_model_dir, tmp_path):
    from clarifier.data.synthetic import write_logs
    from support.config import tiny_lora

    write_logs(str(tmp_path / "logs"), 30, seed=2, shards=1)
    args = [f"storage.root={tmp_path / 'store'}", f"data.input={tmp_path / 'logs'}", f"data.output={tmp_path / 'data'}",
            "data.formats=[jsonl]", *tiny_lora(tiny_model_dir), "train.num_workers=1", "train.micro_batch_size=2",
            "train.max_steps=100000", "train.max_minutes=null", "eval.calibration_split=null"]
    cli = Cli(["train", "--prepare", *args], tmp_path, {"CLARIFIER_LOG_DIR": str(tmp_path / "logs-run"),
                                                       "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    try:
        _training(cli)
        started, _, _ = cli.stop(sig)
        assert any("TrainWorker" in c or "ray::" in c for c in started), started
    finally:
        cli.kill()


@pytest.mark.timeout(600)
@SIGINT_ONLY
def test_quickstart_stops_mlflow_ray_and_training_on_a_signal(sig, tiny_model_dir, tmp_path):
    from support.config import tiny_lora

    cli = Cli(["quickstart", "--workdir", str(tmp_path / "qs"), *tiny_lora(tiny_model_dir),
               "data.synthetic_conversations=40", "train.num_workers=1", "train.max_steps=100000",
               "train.max_minutes=null", "train.warmup_steps=0"],
              tmp_path, {"CLARIFIER_LOG_DIR": str(tmp_path / "logs")})
    try:
        _training(cli)
        mlflow = next(m for ln in cli.lines if (m := re.search(r"MLflow: http://127\.0\.0\.1:(\d+)", ln)))
        assert _port_open(int(mlflow.group(1)))
        started, out, err = cli.stop(sig)
        assert any("mlflow" in c for c in started), started  # the tracking server it started
        assert not _port_open(int(mlflow.group(1)))
        assert "== [4/7]" in out and "== [5/7]" not in out  # stopped in training, not after it
    finally:
        cli.kill()
