"""Starting (or joining) Ray with the environment every worker needs; the code version it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from clarifier.runtime.services import mlflow_env

# Non-secret settings that workers need, passed in the job's runtime_env. Credentials are *not*
# among them: Ray writes runtime_env (env_vars included) to its logs. A local Ray started here
# inherits this process's environment (credentials included) without that; on a cluster the
# nodes have their own (IAM role, Kubernetes secret, the environment of `ray start`).
# The one list: Ray workers (here), submitted jobs (submit.py) and Serve replicas (serving/app.py).
FORWARDED = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL",
             "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "CLARIFIER_CACHE", "CLARIFIER_S3_MAX_ATTEMPTS",
             "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def worker_env() -> dict[str, str]:
    env = dict(mlflow_env())
    env.update({k: os.environ[k] for k in FORWARDED if k in os.environ})
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def local_cpus() -> int:
    """Logical CPUs for a local Ray instance: the cores plus two.

    Training workers each hold a whole CPU for the job's lifetime; without spare logical CPUs, Ray
    Data's read tasks feeding them could never be scheduled on a 2-core box and training would wait
    forever. Reading Parquet is light, so a little logical oversubscription is the right trade.
    """
    return (os.cpu_count() or 2) + 2


def _job_env_vars() -> set[str]:
    """Env var names set by the runtime_env of the Ray job this driver runs in (empty outside one)."""
    import json

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return set()
    try:
        return set(((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {}))
    except (ValueError, AttributeError):
        return set()


_SIGTERM_HANDLER = None


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM (``kill``, Kubernetes, ``ray job stop``) into SystemExit, so that ``finally`` blocks run
    and the services a command started (MLflow server, S3 server, local Ray) are stopped, not orphaned.
    :func:`init_ray` puts it back after ``ray.init``, whose C++ core installs a SIGTERM handler of its own
    (it prints a stack trace and kills the process, leaving the local Ray instance running)."""
    global _SIGTERM_HANDLER
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        _SIGTERM_HANDLER = lambda signum, _frame: sys.exit(128 + signum)  # noqa: E731
        signal.signal(signal.SIGTERM, _SIGTERM_HANDLER)


def _restore_sigterm() -> None:
    if _SIGTERM_HANDLER is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _SIGTERM_HANDLER)


def local_instance() -> bool:
    """Whether :func:`init_ray` starts a Ray instance of its own here (no ``RAY_ADDRESS`` to join)."""
    return not os.environ.get("RAY_ADDRESS")


def usable_cpus(ray) -> int:
    """CPUs that CPU-bound actors (the data job's tokenisers) can use without oversubscribing cores:
    the cluster's CPUs, except on a local instance of our own (no ``RAY_ADDRESS``), whose logical CPUs
    are the cores plus two (:func:`local_cpus`): there, the machine's cores."""
    cpus = int(ray.cluster_resources().get("CPU", 1))
    if local_instance():
        cpus = min(cpus, os.cpu_count() or cpus)
    return max(1, cpus)


def pool_size(ray, actors: int | str, *, cpus_per_actor: float, gpus_per_actor: float = 0, rows: int,
              rows_per_block: int) -> int:
    """Actors for a pool of model-holding actors (``audit.actors``): a number as it is; ``auto`` = as many as the
    CPUs hold at ``cpus_per_actor`` each (:func:`usable_cpus`: the cores of a local instance, the cluster's CPUs
    now) or, with ``gpus_per_actor``, as many as its GPUs hold, and no more than there are blocks of
    ``rows_per_block`` rows to hand them (each actor loads the model: a small job gets one)."""
    if actors != "auto":
        return int(actors)
    if gpus_per_actor:
        fit = int(ray.cluster_resources().get("GPU", 0) // gpus_per_actor)
    else:
        fit = int(usable_cpus(ray) // cpus_per_actor)
    return max(1, min(fit, -(-rows // max(1, rows_per_block))))


def init_ray(num_cpus: int | None = None, quiet: bool = True):
    """Join the cluster in ``RAY_ADDRESS`` (e.g. inside ``ray job submit``) or start a local one."""
    import ray

    for k, v in mlflow_env().items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return ray
    env = worker_env()
    # Inside a submitted Ray job (clarifier ... --submit, ray job submit) the job's runtime_env is
    # merged with ours, and Ray refuses the same env var in both: keep only what the job lacks.
    env = {k: v for k, v in env.items() if k not in _job_env_vars()}
    kw = {"runtime_env": {"env_vars": env}, "log_to_driver": True}
    if not local_instance():
        ray.init(address=os.environ["RAY_ADDRESS"], **kw)
    else:
        # address="local": always a fresh instance of our own, never a cluster that some other
        # `ray start --head` on this machine happens to have left behind.
        # The dashboard also serves Ray's State API, which Ray Train V2's placement-group cleaner
        # polls every second (without it: a warning a second for the whole training run).
        ray.init(address="local", num_cpus=num_cpus or local_cpus(), include_dashboard=True, **kw)
    _restore_sigterm()
    if quiet:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
    return ray


def git_commit() -> str | None:
    """The git commit of this checkout (recorded in manifests and benchmark results), or None."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:
        return None
