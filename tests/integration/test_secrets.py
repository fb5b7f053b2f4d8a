"""Secrets (S3 credentials, API keys) never reach logs, MLflow params/tags, manifests or error messages.

A data job on S3 and a one-step training run with distinctive credentials in the environment;
then every place the platform writes to is scanned for them: this process's output, Ray's session
logs (runtime_env included: Ray logs it verbatim), the data manifest, the MLflow run's params and
tags, and the message of a failing job.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from clarifier.runtime import storage

pytestmark = pytest.mark.integration

SECRET_KEY = "scrt" + uuid.uuid4().hex
ACCESS_KEY = "AKIA" + uuid.uuid4().hex[:16].upper()
API_KEY = "key-" + uuid.uuid4().hex
SECRETS = (SECRET_KEY, ACCESS_KEY, API_KEY)


@pytest.fixture
def secret_env(monkeypatch, mlflow_server):
    """A moto S3 server reached with distinctive credentials, and a Ray started after they are set."""
    import ray
    from moto.server import ThreadedMotoServer

    from clarifier.runtime.cluster import init_ray
    from clarifier.runtime.services import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    for k, v in {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url, "CLARIFIER_API_KEYS": API_KEY}.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=4)
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    yield {"url": url, "session": session}
    ray.shutdown()
    server.stop()


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


@pytest.mark.timeout(600)
def test_no_secret_in_logs_params_manifest_or_errors(secret_env, tiny_model_dir, tmp_path, capfd):
    import boto3
    from mlflow import MlflowClient

    from clarifier.core.config import build_config
    from clarifier.data.pipeline import DataJobError, prepare
    from clarifier.data.synthetic import write_logs
    from clarifier.train.trainer import train

    boto3.client("s3", endpoint_url=secret_env["url"]).create_bucket(Bucket="secrets")
    write_logs("s3://secrets/logs", 16, seed=3, shards=2)
    base = [f"storage.root={tmp_path / 'store'}", "data.input=s3://secrets/logs", "data.output=s3://secrets/data",
            f"model.base_model={tiny_model_dir}", "model.lora.r=2", "model.lora.target_modules=[q_proj]",
            "train.num_workers=1", "train.micro_batch_size=2", "train.max_steps=1", "train.experiment=secrets",
            "eval.calibration_split=null"]
    manifest = prepare(build_config({}, base), progress=print)
    result = train(build_config({}, base), progress=print)

    # A failing job's message names what failed, not the credentials it used.
    with pytest.raises((DataJobError, FileNotFoundError, OSError)) as info:
        prepare(build_config({}, [*base, "data.input=s3://no-such-bucket/logs"]), progress=print)
    assert not _leaks(str(info.value)) and not _leaks(repr(info.value))

    out, err = capfd.readouterr()
    assert not _leaks(out + err)
    assert not _leaks(storage.read_text("s3://secrets/data/manifest.json")) and manifest["counts"]["kept"] > 0

    run = MlflowClient().get_run(result.run_id)
    assert not _leaks(repr(run.data.params)) and not _leaks(repr(run.data.tags))

    leaked = []
    for f in secret_env["session"].rglob("*"):
        if f.is_file() and f.stat().st_size < 50_000_000:
            try:
                text = f.read_text(errors="ignore")
            except OSError:
                continue
            if _leaks(text):
                leaked.append(str(f.relative_to(secret_env["session"])))
    assert not leaked, f"secrets found in Ray session files: {leaked}"
