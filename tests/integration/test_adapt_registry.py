"""An adapted model (`clarifier adapt --experiment`) goes through the registry like a trained one: logged as a
run with its `adapter` artifact, registered, and loaded back by alias (real MLflow server on loopback)."""

from __future__ import annotations

import json
import uuid

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
