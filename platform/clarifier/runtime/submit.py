"""Submit a stage (``data prepare``, ``train``, ``eval``, ``audit``) as a Ray job to a running cluster.

    clarifier train --submit http://head:8265 -c jobs/configs/cluster-gpu.yaml train.max_steps=100

What travels with the job (``runtime_env``):

* ``working_dir``: a small staging folder holding ``clarifier-job.yaml`` -- the config resolved
  *here* (file + overrides, validated, so a wrong key fails before anything is submitted);
* ``py_modules``: this checkout's ``clarifier`` package, so the job runs the code you have, not
  whatever version the cluster image holds (``ship_code=False`` / ``--installed-code`` uses the
  cluster's installed package instead). Third-party dependencies (torch, Ray, DeepSpeed, ...) are
  never shipped: they must be installed on the cluster (the images in ``infra/docker``);
* ``env_vars``: the non-secret settings in :data:`FORWARDED_ENV` that are set here (MLflow URI,
  S3 endpoint, region, model cache, offline flags). Credentials are never forwarded and never
  printed: the cluster supplies its own (IAM role, pod secrets, or the environment ``ray start``
  ran in).

The entrypoint is ``python -m clarifier.cli <stage> -c clarifier-job.yaml ...``; inside the job
``RAY_ADDRESS`` is set, so the stage joins that cluster. Local relative paths in the config are
made absolute (the job runs in another directory); on a remote cluster use ``s3://`` paths.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from clarifier.runtime import storage
from clarifier.core.config import ClarifierConfig, dump_config
from clarifier.runtime.cluster import FORWARDED

JOB_CONFIG = "clarifier-job.yaml"
FORWARDED_ENV = FORWARDED  # non-secret settings only (see clarifier.runtime.cluster)
_SECRET_WORDS = ("SECRET", "PASSWORD", "TOKEN", "ACCESS_KEY", "CREDENTIAL")
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


@dataclass
class Submission:
    job_id: str
    status: str  # SUCCEEDED | FAILED | STOPPED | RUNNING (when not waited for)
    address: str

    @property
    def exit_code(self) -> int:
        return 0 if self.status == "SUCCEEDED" else 1


def dashboard_url(address: str) -> str:
    """``host:port`` or ``http(s)://host:port`` of the head's dashboard (job API, default port 8265)."""
    a = address.strip().rstrip("/")
    if a.startswith("ray://"):
        raise ValueError(f"--submit takes the dashboard address (http://<head>:8265), not a Ray client address ({a})")
    return a if a.startswith(("http://", "https://")) else f"http://{a}"


def forwarded_env(environ: dict | None = None) -> dict[str, str]:
    """The env vars a submitted job gets from here: the non-secret settings only."""
    from clarifier.runtime.services import mlflow_env

    environ = os.environ if environ is None else environ
    env = dict(mlflow_env())
    env.update({k: environ[k] for k in FORWARDED_ENV if environ.get(k)})
    assert not any(w in k for k in env for w in _SECRET_WORDS)
    return env


def absolute_path(p: str) -> str:
    """A local path made absolute (a job runs in its own working directory); URIs unchanged."""
    return p if (not p or storage.is_s3(p) or "://" in p) else str(Path(p).expanduser().resolve())


def existing_path(p: str) -> str:
    """A model or data argument for a job: an existing local path made absolute, anything else (a URI, a
    ``builtin:`` name, a path only the cluster has) as it is."""
    return absolute_path(p) if Path(p).exists() else p


def portable_config(cfg: ClarifierConfig, progress: Callable[[str], None] = print) -> ClarifierConfig:
    """The config with local relative paths made absolute (the job runs in its own working dir)."""
    upd = {}
    for section, key in (("storage", "root"), ("data", "input"), ("data", "output"), ("data", "mirror"), ("model", "cache_dir"),
                         ("audit", "logs"), ("audit", "output"), ("audit", "eval_report")):
        v = getattr(getattr(cfg, section), key)
        if v and absolute_path(v) != v:
            upd.setdefault(section, {})[key] = absolute_path(v)
    for section, key in (("audit", "model_uri"), ("model", "init_from")):  # a folder, or a URI left as it is
        v = getattr(getattr(cfg, section), key)
        if v and Path(v).expanduser().exists() and absolute_path(v) != v:
            upd.setdefault(section, {})[key] = absolute_path(v)
    bm = cfg.model.base_model
    if Path(bm).expanduser().exists() and absolute_path(bm) != bm:
        upd.setdefault("model", {})["base_model"] = absolute_path(bm)
    srcs = [s.model_dump() for s in cfg.data.sources]
    for s, source in zip(srcs, cfg.data.sources):
        if s["src"] and not source.dataset and absolute_path(s["src"]) != s["src"]:  # dataset:<name> is no path
            s["src"] = absolute_path(s["src"])
            upd.setdefault("data", {})["sources"] = srcs
    if not upd:
        return cfg
    progress("[submit] local paths made absolute for the job: "
             + ", ".join(f"{s}.{k}={v}" for s, kv in upd.items() for k, v in kv.items()))
    data = cfg.model_dump(mode="json")
    for s, kv in upd.items():
        data[s].update(kv)
    return ClarifierConfig.model_validate(data)


def submit_stage(address: str, stage: list[str], cfg: ClarifierConfig, extra_args: list[str] | None = None, *,
                 ship_code: bool = True, wait: bool = True, progress: Callable[[str], None] = print,
                 write: Callable[[str], None] | None = None, submission_id: str | None = None) -> Submission:
    """Submit ``python -m clarifier.cli <stage...> -c clarifier-job.yaml <extra_args>`` and (by
    default) stream its logs until it ends. Returns the job id and its final status."""
    from ray.job_submission import JobSubmissionClient

    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    url = dashboard_url(address)
    cfg = portable_config(cfg, progress)
    staging = Path(tempfile.mkdtemp(prefix="clarifier-submit-"))
    try:
        (staging / JOB_CONFIG).write_text(dump_config(cfg))
        env = forwarded_env()
        runtime_env: dict = {"working_dir": str(staging), "env_vars": env}
        if ship_code:
            runtime_env["py_modules"] = [str(Path(__file__).resolve().parents[1])]  # the clarifier package
            runtime_env["excludes"] = ["__pycache__", "*.pyc"]
        entry = ["python", "-m", "clarifier.cli", *stage, "-c", JOB_CONFIG, *(extra_args or [])]
        entrypoint = " ".join(_quote(a) for a in entry)
        client = JobSubmissionClient(url)
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id,
                                   metadata={"clarifier.stage": " ".join(stage)})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"[submit] job {job_id} submitted to {url}: {entrypoint}")
    progress(f"[submit] env: {', '.join(sorted(env))} (values not shown; credentials come from the cluster); "
             f"code: {'this checkout (py_modules)' if ship_code else 'the package installed on the cluster'}")
    if not wait:
        return Submission(job_id, str(client.get_job_status(job_id).value), url)
    try:
        asyncio.run(_tail(client, job_id, write))
    except KeyboardInterrupt:
        progress(f"[submit] stopped following; job {job_id} keeps running (ray job stop --address {url} {job_id})")
        return Submission(job_id, str(client.get_job_status(job_id).value), url)
    status = _final_status(client, job_id)
    progress(f"[submit] job {job_id} {status}")
    return Submission(job_id, status, url)


async def _tail(client, job_id: str, write) -> None:
    async for lines in client.tail_job_logs(job_id):
        write(lines)


def _final_status(client, job_id: str, timeout_s: float = 60.0) -> str:
    deadline = time.time() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL or time.time() > deadline:
            return status
        time.sleep(0.5)


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
