"""Training on packed blocks (data.packing) with the class-weighted decision loss, on Ray Train + DeepSpeed."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(600)
def test_training_on_packed_blocks(tiny_model_dir, ray_local, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from clarifier.core.config import build_config
    from clarifier.data.pipeline import prepare
    from clarifier.data.synthetic import write_logs
    from clarifier.train.trainer import train
    from support.config import tiny_lora

    write_logs(str(tmp_path / "logs"), 40, seed=8, shards=1)
    base = [f"storage.root={tmp_path / 'store'}", f"data.input={tmp_path / 'logs'}", f"data.output={tmp_path / 'data'}",
            *tiny_lora(tiny_model_dir), "data.packing.enabled=true", "data.packing.block_length=1024",
            "train.num_workers=2", "train.micro_batch_size=1", "train.max_steps=3", "train.warmup_steps=1",
            "train.decision_loss.kind=weighted", "train.experiment=packed", "eval.calibration_split=null"]
    manifest = prepare(build_config({}, base), progress=lambda m: None)
    assert manifest["packing"]["blocks"] >= 2
    assert 0.5 < manifest["packing"]["efficiency"] <= 1.0

    result = train(build_config({}, base), progress=print)
    assert result.steps == 3
    client = MlflowClient()
    losses = [m.value for m in client.get_metric_history(result.run_id, "train/loss")]
    assert len(losses) == 3 and all(v == v and v > 0 for v in losses)  # finite, positive
    tps = client.get_metric_history(result.run_id, "train/tokens_per_s")
    assert tps and all(m.value > 0 for m in tps)


@pytest.mark.timeout(120)
def test_packing_refuses_a_data_job_without_blocks(tiny_model_dir, ray_local, tmp_path):
    from clarifier.core.config import build_config
    from clarifier.data.pipeline import prepare
    from clarifier.data.synthetic import write_logs
    from clarifier.train.trainer import train

    write_logs(str(tmp_path / "logs"), 12, seed=8, shards=1)
    base = [f"data.input={tmp_path / 'logs'}", f"data.output={tmp_path / 'data'}", f"model.base_model={tiny_model_dir}"]
    prepare(build_config({}, base), progress=lambda m: None)
    with pytest.raises(ValueError, match="no packed blocks"):
        train(build_config({}, [*base, "data.packing.enabled=true"]), progress=print)
