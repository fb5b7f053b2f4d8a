"""An adapted model (`clarifier adapt --experiment`) goes through the registry like a trained one: logged as a
run with its `adapter` artifact, registered, and loaded back by alias (real MLflow server on loopback)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest


@pytest.mark.timeout(600)
def test_adapted_model_is_logged_registered_and_served_by_alias(mlflow_server, tiny_model_dir, tmp_path):
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from clarifier.cli import app
    from clarifier.core.config import DecisionHeadConfig
    from clarifier.engine.loading import load_engine
    from clarifier.train.decision_head import fit_decision_head
    from support.adapters import untrained_adapter
    from support.turns import labelled_turns as _turns

    folder = untrained_adapter(tiny_model_dir, tmp_path / "m", threshold=0.5)
    fit_decision_head(folder, _turns(24, "t"), _turns(12, "d"), DecisionHeadConfig(layers=[0.5, 1.0], c_grid=[1.0]),
                      precision="fp32", progress=lambda _: None)
    labelled = tmp_path / "theirs.jsonl"
    labelled.write_text("".join(e.model_dump_json() + "\n" for e in _turns(30, "u", flip=True)))
    name = f"adapted-{uuid.uuid4().hex[:6]}"
    res = CliRunner().invoke(app, ["adapt", "--model", str(folder), "--data", str(labelled), "--out",
                                   str(tmp_path / "adapted"), "--experiment", "adapt-tests", "model.precision=fp32",
                                   f"registry.model_name={name}"])
    assert res.exit_code == 0, res.output
    run_id = res.output.split("logged as MLflow run ")[1].split()[0]
    assert f"clarifier models register --run-id {run_id} --name {name} --alias challenger" in res.output

    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.data.tags["clarifier.stage"] == "adapt" and run.data.params["adapt.n"] == "30"
    assert run.data.metrics["adapt/before_auroc"] < 0.1  # the shipped head ranked this user's turns backwards
    res = CliRunner().invoke(app, ["models", "register", "--run-id", run_id, "--name", name, "--alias", "challenger"])
    assert res.exit_code == 0, res.output
    served = load_engine(f"models:/{name}@challenger", precision="fp32")
    local = load_engine(tmp_path / "adapted", precision="fp32")
    items = [(e.history, e.query, e.passages) for e in _turns(30, "u", flip=True)]
    assert served.score(items) == pytest.approx(local.score(items), abs=1e-6)
    assert served.threshold == pytest.approx(json.loads((tmp_path / "adapted" / "adapt.json").read_text())["threshold"])


@pytest.mark.timeout(600)
def test_adapt_train_continues_the_adapter_and_is_judged_on_the_kept_apart_slice(mlflow_server, ray_local,
                                                                                 tiny_model_dir, tmp_path):
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from clarifier.cli import app
    from clarifier.engine.inference import read_meta
    from support.adapters import untrained_adapter
    from support.turns import labelled_turns as _turns

    folder = untrained_adapter(tiny_model_dir, tmp_path / "m", threshold=0.5, r=2)
    turns = _turns(230, "u", flip=True)
    for e in turns[:24]:  # a labelling queue's kept-apart slice: never trained or fitted on
        e.meta["queue"] = {"part": "kept_apart"}
    labelled = tmp_path / "theirs.jsonl"
    labelled.write_text("".join(e.model_dump_json() + "\n" for e in turns))
    common = ["adapt", "--model", str(folder), "--data", str(labelled), "--train", "model.precision=fp32",
              f"storage.root={tmp_path / 'store'}",
              "train.num_workers=1", "train.micro_batch_size=2", "train.max_steps=3", "train.warmup_steps=1",
              "train.experiment=adapt-train-tests", "data.encode_actors=1"]
    few = labelled.with_name("few.jsonl")
    few.write_text("".join(e.model_dump_json() + "\n" for e in turns[:150]))
    res = CliRunner().invoke(app, [*common[:4], str(few), "--train", "--out", str(tmp_path / "no")])
    assert res.exit_code == 2 and "126 labelled turns to train on and 24 kept apart" in res.output
    assert not (tmp_path / "no").exists()

    res = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "adapted")])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "adapted" / "adapt.json").read_text())
    lc = summary["lora_continuation"]
    assert lc["steps"] == 3 and lc["labelled_turns"] == 206 and lc["from"] == str(folder)
    assert summary["kept_apart"]["n"] == 24 and summary["n"] == 206  # the slice scored, never fitted on
    head_only = json.loads((tmp_path / "adapted.head-only" / "adapt.json").read_text())
    assert set(head_only["kept_apart"]["turns"]) == set(summary["kept_apart"]["turns"]) == {e.id for e in turns[:24]}
    cmp = lc["comparison"]
    assert cmp["n"] == 24 and cmp["auroc_diff_interval"] is not None and "kept-apart turns" in cmp["verdict"]
    assert cmp["verdict"] in res.output.replace("\n", " ") or "LoRA continuation" in res.output
    trained = MlflowClient().get_run(lc["run_id"])
    assert trained.data.tags["clarifier.init_from"].startswith(str(folder))  # continued, not a fresh adapter
    data_input = (Path(lc["data_input"]) / "labels.jsonl").read_text()
    assert "u-0\"" not in data_input and len(data_input.splitlines()) == 206  # the slice never reached training
    assert read_meta(tmp_path / "adapted").threshold == pytest.approx(summary["threshold"])
