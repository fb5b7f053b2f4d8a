"""Checkpoints in an S3-compatible store (moto's server on loopback): a killed worker resumes from
the checkpoint that every rank uploaded to s3://, in the same MLflow run."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(900)
def test_checkpoints_go_to_s3_and_a_killed_worker_resumes_from_there(ray_local, s3_server, s3_bucket, tiny_model_dir,
                                                                      tmp_path):
    import boto3
    from mlflow import MlflowClient

    from clarifier.core.config import build_config
    from clarifier.data.pipeline import prepare
    from clarifier.data.synthetic import write_logs
    from clarifier.train.trainer import train
    from support.config import tiny_lora
    from support.faults import ExitOnceAt

    write_logs(str(tmp_path / "logs"), 30, seed=5, shards=1)
    cfg = build_config({}, [
        f"storage.root=s3://{s3_bucket}/store", f"data.input={tmp_path / 'logs'}", f"data.output=s3://{s3_bucket}/data",
        "data.formats=[jsonl]", *tiny_lora(tiny_model_dir), "train.num_workers=2", "train.micro_batch_size=2",
        "train.max_steps=4", "train.checkpoint_every=2", "train.max_failures=1",
        "train.run_name=s3run", "train.experiment=resume-s3", "eval.calibration_split=null"])
    prepare(cfg, progress=lambda m: None)
    res = train(cfg, progress=print, callbacks=[ExitOnceAt(3)])
    assert res.steps == 4
    client = MlflowClient()
    assert [m.step for m in client.get_metric_history(res.run_id, "train/loss")] == [1, 2, 3, 4]
    assert [(m.step, m.value) for m in client.get_metric_history(res.run_id, "train/resumed_at_step")] == [(2, 2.0)]

    s3 = boto3.client("s3", endpoint_url=s3_server)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket, Prefix="store/ray_results/train-s3run/")
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    final = [k for k in keys if "/checkpoint_step00000004/" in k and not k.endswith("/")]  # no dir markers
    assert any(k.endswith("adapter_model.safetensors") for k in final)
    assert sum(k.endswith("optim_states.pt") for k in final) == 2  # both ranks' ZeRO shards uploaded
    assert {k.rsplit("/", 1)[1] for k in final if "/rank_state/" in k} == {"rank0.pt", "rank1.pt"}
    state = json.loads(s3.get_object(Bucket=s3_bucket, Key=next(k for k in final if k.endswith("train_state.json")))
                       ["Body"].read())
    assert state["step"] == 4 and state["mlflow_run_id"] == res.run_id

