"""Ray for tests: a local instance in this process (``start_ray``), or a cluster of ``ray start``
processes of our own (``start_cluster``). Both stop exactly what they started: never ``ray stop``,
which would kill every Ray instance on the machine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

BIN = Path(sys.executable).parent
MARKER = "CLARIFIER_TEST_CLUSTER"  # in our nodes' environment; every process they start inherits it


@contextmanager
def start_ray(num_cpus: int, *, dashboard: bool = False, env: dict[str, str] | None = None, **init) -> Iterator:
    """A fresh local Ray instance (``address="local"``: never a ``ray start`` head that another
    test left running), shut down afterwards together with Serve if the test started it.

    Its processes inherit this process's environment as it is now, so start it after the fixtures
    that put service endpoints and credentials there. ``env`` goes to the job's runtime_env
    (``clarifier.runtime.cluster.worker_env()`` for what the platform itself forwards); the dashboard
    also serves Ray's State API (Ray Train's placement-group cleaner and actor lookups use it).
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    init = {"log_to_driver": False, **init}
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard,
             runtime_env={"env_vars": env} if env else None, **init)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray
    finally:
        try:
            if "ray.serve" in sys.modules:
                from ray import serve

                serve.shutdown()  # a no-op when no Serve application runs
        finally:
            ray.shutdown()


def own_pids(tag: str) -> list[int]:
    """Processes of our cluster only: their environment carries ``MARKER=tag`` (the raylets, GCS,
    dashboard, job drivers and every worker inherit it from ``ray start``; a worker's command line,
    rewritten to ``ray::...``, does not name our temp dirs)."""
    needle = f"{MARKER}={tag}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


NODE_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
              "runtime-env-agent-port", "metrics-export-port")


def _ports(extra: int = 0) -> tuple[list[str], list[int]]:
    """Every port a node opens that has a fixed default (two nodes, or another test's head, on one
    host would otherwise collide on e.g. the dashboard agent's 52365), and ``extra`` more: all distinct
    (chosen one at a time, a head once got the same port for its raylet and its client server)."""
    from clarifier.runtime.services import free_ports

    ports = free_ports(len(NODE_PORTS) + extra)
    return [f"--{name}={p}" for name, p in zip(NODE_PORTS, ports)], ports[len(NODE_PORTS):]


@dataclass
class Cluster:
    url: str  # the head's dashboard: Job Submission and State APIs
    tag: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)

    head_port: int = 0
    num_cpus: int = 1
    node_args: tuple[str, ...] = ()

    def log(self, i: int) -> str:
        """What node ``i``'s ``ray start`` printed, and the ends of its raylet's logs (why a node did not start)."""
        temp = Path(self.temps[i])
        parts = [(temp / "node.log").read_text()[-2000:]]
        for name in ("raylet.out", "raylet.err"):
            f = temp / "session_latest" / "logs" / name
            if f.is_file():
                parts.append(f"--- {name} (end) ---\n" + f.read_text(errors="replace")[-1500:])
        return "\n".join(parts)

    def join(self, resources: dict) -> subprocess.Popen:
        """One more node (custom ``resources``), joining the head; returns its ``ray start`` process."""
        import json

        return _start_node(self, [f"--address=127.0.0.1:{self.head_port}", f"--resources={json.dumps(resources)}"],
                           self.num_cpus, self.node_args)

    def stop(self) -> None:
        """Our process groups, then any process still carrying our tag. (``ray start --block``
        takes about a minute to exit on SIGTERM; 3 s of grace for its processes
        to stop, then SIGKILL: a test cluster keeps nothing worth a clean shutdown.)"""
        procs = list(reversed(self.procs))
        for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 30)):
            for proc in procs:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + grace
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    pass
            for pid in own_pids(self.tag):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(2)
            if all(p.poll() is not None for p in procs) and not own_pids(self.tag):
                break
        for temp in self.temps:
            shutil.rmtree(temp, ignore_errors=True)


def _node_env(tag: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env[MARKER] = tag
    # Ray turns token auth on for a new head when ~/.ray/auth_token exists (machine-wide state);
    # these test nodes are explicitly without it, so the tests do not depend on that file.
    env["RAY_AUTH_MODE"] = "disabled"
    # As if started from an activated virtualenv: job entrypoints run `python` from the node's PATH.
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _start_node(cluster: Cluster, args: list[str], num_cpus: int, node_args: tuple[str, ...],
                ports: list[str] | None = None) -> subprocess.Popen:
    ports = ports if ports is not None else _ports()[0]
    temp = tempfile.mkdtemp(prefix="clrn-", dir="/tmp")  # short: Ray's socket paths have a length limit
    cluster.temps.append(temp)
    proc = subprocess.Popen([str(BIN / "ray"), "start", *args, *ports, f"--temp-dir={temp}", "--block",
                             "--disable-usage-stats", f"--num-cpus={num_cpus}", *node_args],
                            stdout=open(Path(temp) / "node.log", "ab"), stderr=subprocess.STDOUT,
                            env=_node_env(cluster.tag), start_new_session=True)
    cluster.procs.append(proc)
    return proc


@contextmanager
def start_cluster(num_cpus: int, resources: tuple[dict, ...] = ({},), node_args: tuple[str, ...] = (),
                  timeout_s: float = 180) -> Iterator[Cluster]:
    """A head and one more node per further entry of ``resources`` (custom resources of each node),
    each a ``ray start --block`` process of our own with ``num_cpus`` CPUs, its own raylet, object
    store, temp dir and ports. Started in this process's environment (service endpoints and
    credentials, as a cluster's pods get them from their ConfigMap and Secrets); yields once the
    head's Job Submission API answers (further nodes are still joining)."""
    import json

    from ray.job_submission import JobSubmissionClient

    node_ports, (port, dash, client_port) = _ports(extra=3)
    cluster = Cluster(url=f"http://127.0.0.1:{dash}", tag=uuid.uuid4().hex, head_port=port, num_cpus=num_cpus,
                      node_args=node_args)
    try:
        head = _start_node(cluster, ["--head", f"--port={port}", f"--dashboard-port={dash}",
                                     "--dashboard-host=127.0.0.1", "--include-dashboard=true",
                                     f"--ray-client-server-port={client_port}",
                                     f"--resources={json.dumps(resources[0])}"], num_cpus, node_args, node_ports)
        deadline = time.time() + timeout_s
        while True:
            if head.poll() is not None:
                raise RuntimeError(f"ray start --head exited with {head.returncode}: {cluster.log(0)}")
            try:
                JobSubmissionClient(cluster.url).list_jobs()
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(2)
        for res in resources[1:]:
            cluster.join(res)
        yield cluster
    finally:
        cluster.stop()
