"""``clarifier ... --submit``: real Ray jobs on a real local head started by this test (and only
its own processes stopped: never ``ray stop``, which would kill every Ray instance on the machine)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def ray_head(s3_server):
    """A real `ray start --head`; like a cluster node it has its own S3 endpoint and credentials
    (from the environment it was started in), which submitted jobs use without shipping them."""
    from support.ray import start_cluster

    with start_cluster(num_cpus=4) as cluster:
        yield cluster.url


@pytest.mark.timeout(600)
def test_submitted_data_job_runs_this_checkout_and_reports_success(ray_head, tiny_model_dir, tmp_path, monkeypatch):
    from ray.job_submission import JobSubmissionClient

    from clarifier.core.config import build_config
    from clarifier.data.synthetic import write_logs
    from clarifier.runtime.submit import submit_stage

    write_logs(str(tmp_path / "logs"), 20, seed=1, shards=1)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # a non-secret setting: forwarded
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-ship-me")  # a secret: never forwarded or printed
    monkeypatch.chdir(tmp_path)  # relative paths in the config are made absolute for the job
    cfg = build_config({}, ["data.input=logs", "data.output=data", "data.formats=[jsonl]",
                            f"model.base_model={tiny_model_dir}", "data.split={train: 0.8, dev: 0.2}"])
    said, logs = [], []
    sub = submit_stage(ray_head, ["data", "prepare"], cfg, progress=said.append, write=logs.append)
    out = "".join(logs)
    assert sub.status == "SUCCEEDED" and sub.exit_code == 0 and sub.job_id.startswith("raysubmit_"), out[-4000:]
    assert "[data] wrote" in out  # the job's own output was streamed
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["counts"]["splits"]["train"]["examples"] > 0
    info = JobSubmissionClient(ray_head).get_job_info(sub.job_id)
    env = info.runtime_env["env_vars"]
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:9" and "AWS_SECRET_ACCESS_KEY" not in env
    assert "py_modules" in info.runtime_env  # this checkout's package travels with the job
    assert not any("do-not-ship-me" in line for line in [*said, out])
    assert any(sub.job_id in line for line in said)


@pytest.mark.timeout(300)
def test_cli_submit_exits_with_the_failed_jobs_status(ray_head, tmp_path):
    from typer.testing import CliRunner

    from clarifier.cli import app

    res = CliRunner().invoke(app, ["train", "--submit", ray_head, f"data.output={tmp_path / 'missing'}",
                                   f"storage.root={tmp_path / 'store'}"])
    assert res.exit_code == 1, res.output
    last = json.loads(res.output.strip().splitlines()[-1])
    assert last["status"] == "FAILED" and last["job_id"].startswith("raysubmit_")
    assert "has no manifest.json" in res.output  # the job's error, streamed back


def test_submit_refuses_a_ray_client_address_and_bad_config_before_submitting(tmp_path):
    from typer.testing import CliRunner

    from clarifier.cli import app

    res = CliRunner().invoke(app, ["train", "--submit", "ray://127.0.0.1:10001"])
    assert res.exit_code == 2 and "dashboard address" in res.output
    res = CliRunner().invoke(app, ["train", "--submit", "http://127.0.0.1:9", "train.max_stepz=3"])
    assert res.exit_code == 2 and "train.max_stepz" in res.output


@pytest.mark.timeout(600)
def test_jobs_entrypoint_under_ray_job_submit_on_s3(ray_head, tiny_model_dir, s3_bucket):
    """The documented `ray job submit --working-dir . -- python jobs/prepare_data.py ...` on s3:// paths."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from clarifier.runtime import storage
    from clarifier.data.synthetic import write_logs

    repo = Path(__file__).resolve().parents[2]
    base = f"s3://{s3_bucket}"
    write_logs(f"{base}/logs", 16, seed=2, shards=2)
    client = JobSubmissionClient(ray_head)
    job = client.submit_job(
        entrypoint=(f"python jobs/prepare_data.py -c platform/clarifier/quickstart.yaml data.input={base}/logs "
                    f"data.output={base}/data model.base_model={tiny_model_dir}"),
        runtime_env={"working_dir": str(repo), "excludes": [".venv", ".git", ".clarifier", "benchmarks/results"]},
    )
    deadline = time.time() + 540
    while client.get_job_status(job) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.time() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(2)
    logs = client.get_job_logs(job)
    assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs[-3000:]
    manifest = json.loads(storage.read_text(f"{base}/data/manifest.json"))
    assert manifest["counts"]["rows_read"] == 16 and all(manifest["invariants"].values())
    assert all(i.startswith(f"{base}/logs/") for i in manifest["inputs"])
    assert "[data] wrote" in logs


@pytest.mark.timeout(600)
def test_submitted_audit_runs_on_the_cluster(ray_head, tiny_model_dir, tmp_path, monkeypatch):
    """`clarifier audit --submit`: the config travels with relative paths made absolute (logs, output,
    model folder); the job scores the turns on the cluster and writes the report."""
    from clarifier.core.config import build_config
    from clarifier.runtime.submit import submit_stage
    from support.adapters import untrained_adapter

    untrained_adapter(tiny_model_dir, tmp_path / "model", threshold=0.5, r=2)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.jsonl").write_text("".join(json.dumps(
        {"id": f"c{i}", "messages": [{"role": "user", "content": "how do I reset it?"},
                                     {"role": "assistant", "content": "I couldn't find that."}]}) + "\n" for i in range(6)))
    monkeypatch.chdir(tmp_path)
    cfg = build_config({}, ["audit.logs=logs", "audit.output=audit", "audit.model_uri=model",
                            "audit.signals.reformulation.enabled=false", "audit.sample_questions=0", "audit.bootstrap=100"])
    logs: list[str] = []
    sub = submit_stage(ray_head, ["audit"], cfg, progress=lambda m: None, write=logs.append)
    out = "".join(logs)
    assert sub.status == "SUCCEEDED", out[-4000:]
    assert "== Audit: is a clarifier worth it for these logs?" in out
    report = json.loads((tmp_path / "audit" / "report.json").read_text())
    assert report["counts"]["turns"] == 6 and report["counts"]["failed_turns"] == 6
    assert report["model_uri"] == str(tmp_path / "model")


@pytest.mark.timeout(600)
def test_submitted_adapt_writes_the_adapted_model_on_the_cluster(ray_head, tiny_model_dir, tmp_path, monkeypatch):
    """`clarifier adapt --submit`: model folder, labelled turns and --out given as relative paths travel as
    absolute ones; the job fits the head on the cluster and writes the adapted folder there (here: this host)."""
    from typer.testing import CliRunner

    from clarifier.cli import app
    from clarifier.engine.loading import load_engine
    from support.adapters import untrained_adapter
    from support.turns import labelled_turns

    untrained_adapter(tiny_model_dir, tmp_path / "model", threshold=0.5, r=2)
    (tmp_path / "mine.jsonl").write_text("".join(e.model_dump_json() + "\n" for e in labelled_turns(20, "u")))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["adapt", "--submit", ray_head, "--model", "model", "--data", "mine.jsonl",
                                   "--out", "adapted", "--start", "scratch", "model.precision=fp32"])
    assert res.exit_code == 0, res.output[-4000:]
    assert f"written to {tmp_path / 'adapted'} on the cluster's driver; add --experiment" in res.output
    assert "[adapt] kept: threshold" in res.output and '"status": "SUCCEEDED"' in res.output
    meta = json.loads((tmp_path / "adapted" / "adapt.json").read_text())
    assert meta["kept"] == "scratch" and meta["n"] == 20
    eng = load_engine(tmp_path / "adapted", precision="fp32")
    assert eng.threshold == pytest.approx(meta["threshold"])
