"""End to end: synthetic logs -> Ray Data -> Ray Train (DeepSpeed ZeRO-2, LoRA) -> evaluation ->
MLflow registry alias -> Ray Serve loading models:/name@alias -> HTTP answers. Tiny local model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


RAY_CPUS = 4  # ray_local: 2 train workers + room for the Ray Data tasks feeding them


@pytest.mark.timeout(900)
def test_logs_to_served_model(tiny_model_dir, mlflow_server, ray_local, tmp_path):
    import httpx
    from mlflow import MlflowClient

    from clarifier.core.config import build_config
    from clarifier.data.pipeline import prepare
    from clarifier.data.synthetic import write_logs
    from clarifier.evaluation.evaluate import evaluate
    from clarifier.registry.registry import register_adapter
    from clarifier.serving.app import run_local
    from clarifier.runtime.services import free_port
    from clarifier.train.trainer import train
    from support.config import tiny_lora

    logs, data = tmp_path / "logs", tmp_path / "data"
    write_logs(str(logs), 60, seed=3, shards=2)
    (logs / "broken.jsonl").write_text('{"conversation_id": "x", "turns": []}\nnot json\n')
    cfg = build_config({}, [
        f"storage.root={tmp_path / 'store'}", f"data.input={logs}", f"data.output={data}",
        *tiny_lora(tiny_model_dir),
        "train.num_workers=2", "train.zero_stage=2", "train.max_steps=4", "train.micro_batch_size=2",
        "train.learning_rate=0.001", "train.warmup_steps=1", "train.experiment=e2e",
        "eval.max_examples=12", "eval.max_new_tokens=8", "eval.batch_size=4",
        "serve.cpus_per_replica=0.5", f"serve.port={free_port()}",
    ])

    manifest = prepare(cfg, progress=lambda m: None)
    c = manifest["counts"]
    assert c["quarantined"] == 2 and c["splits"]["train"]["examples"] > 0

    tr = train(cfg, progress=lambda m: None)
    assert tr.steps == 4
    folder = Path(tr.model_dir)
    assert (folder / "adapter_model.safetensors").is_file() and (folder / "clarifier.json").is_file()
    assert not list(folder.glob("*.bin"))
    meta = json.loads((folder / "clarifier.json").read_text())
    assert 0.0 <= meta["threshold"] <= 1.0 and meta["base_model"] == str(tiny_model_dir)

    client = MlflowClient()
    run = client.get_run(tr.run_id)
    assert run.data.params["train.zero_stage"] == "2" and run.data.params["model.lora.r"] == "4"
    loss_hist = client.get_metric_history(tr.run_id, "train/loss")
    assert [m.step for m in loss_hist] == [1, 2, 3, 4]
    assert client.get_metric_history(tr.run_id, "train/loss_decision")
    assert run.data.metrics["calibration/threshold"] == meta["threshold"]

    report = evaluate(cfg, str(folder), run_id=tr.run_id, out_dir=str(tmp_path / "eval"), progress=lambda m: None)
    assert set(report["models"]) == {"model", "always_ask", "never_ask", "lexical", "base_model", "surface_control"}
    # the surface control is fitted on the data job's train split, and the report leads with the model's margin
    assert report["models"]["surface_control"]["control"]["fitted_on"].startswith("the train split")
    assert report["skill"]["verdict"] and report["skill"]["mixed"]["control_auroc"] is not None
    assert report["models"]["always_ask"]["metrics"]["decision"]["recall"] == 1.0
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["n"] == report["n"]
    run = client.get_run(tr.run_id)
    assert "eval/decision/f1" in run.data.metrics and "eval/skill/mixed" in run.data.metrics
    assert run.data.tags["eval.beats_surface_control"] in ("true", "false")
    assert any(a.path == "eval" for a in client.list_artifacts(tr.run_id))

    mv = register_adapter(tr.run_id, "e2e-clarifier", alias="champion", tags={"eval.f1": 0.5})
    assert client.get_model_version_by_alias("e2e-clarifier", "champion").version == mv.version

    serve_cfg = cfg.serve.model_copy(update={"model_uri": "models:/e2e-clarifier@champion"})
    url = run_local(serve_cfg, tracking_uri=mlflow_server)
    r = httpx.post(f"{url}/v1/clarify", json={"history": [{"role": "user", "text": "I have a router and a modem."}],
                                             "query": "how do I reset it?"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_version"] == f"e2e-clarifier/{mv.version}"
    assert 0.0 <= body["confidence"] <= 1.0 and isinstance(body["needs_clarification"], bool)
    bad = httpx.post(f"{url}/v1/clarify", json={"history": []}, timeout=30)
    assert bad.status_code == 422 and "query" in bad.text
