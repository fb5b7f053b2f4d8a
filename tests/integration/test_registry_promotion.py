"""Registry lineage tags, the promotion gate, rollback, list and diff against a real `mlflow server`.

Versions are registered from runs whose evaluation report (``eval/report.json``) carries given
metrics, so no model is trained; one test evaluates two tiny adapters on an evaluation file.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.integration

FP = "f" * 64  # fingerprint of "the" evaluation set the logged reports were made on
runner = CliRunner()


def _metrics(f1, oa, validity=1.0):
    return {"n": 40, "decision": {"f1": f1, "precision": f1, "recall": f1, "over_asking_rate": oa,
                                  "under_asking_rate": 1 - f1}, "auroc": 0.8, "ece": 0.1, "validity": validity,
            "question": {"rougeL_f": 0.5, "semantic_similarity": 0.7}, "grounding": {"exact_match": 0.6}}


def _run_with_report(tmp_path, f1, oa, validity=1.0, fingerprint=FP, adapter: Path | None = None) -> str:
    """An MLflow run like training + `clarifier eval --run-id` leave it: adapter, manifest, eval report."""
    import mlflow

    mlflow.set_experiment("registry-tests")
    d = tmp_path / uuid.uuid4().hex[:8]
    (d / "adapter").mkdir(parents=True)
    if adapter is None:
        (d / "adapter" / "clarifier.json").write_text(json.dumps({"base_model": "tiny"}))
    (d / "data").mkdir()
    (d / "data" / "manifest.json").write_text(json.dumps({"kind": "clarifier.data", "output": "s3://b/data"}))
    (d / "eval").mkdir()
    report = {"data_name": "eval.jsonl", "data_fingerprint": fingerprint, "n": 40,
              "models": {"model": {"metrics": _metrics(f1, oa, validity)}, "always_ask": {"metrics": _metrics(0.6, 1.0)}}}
    (d / "eval" / "report.json").write_text(json.dumps(report))
    with mlflow.start_run() as run:
        mlflow.set_tags({"clarifier.base_model": "smollm2-135m-instruct", "clarifier.data": "s3://b/data"})
        mlflow.log_artifacts(str(adapter or d / "adapter"), "adapter")
        mlflow.log_artifacts(str(d / "data"), "data")
        mlflow.log_artifacts(str(d / "eval"), "eval")
    return run.info.run_id


def _cfg(tmp_path, *extra):
    from clarifier.core.config import build_config

    return build_config({}, [f"storage.root={tmp_path / 'store'}", *extra])


def _audit(tmp_path, name):
    from clarifier.registry.audit import AuditLog

    return AuditLog(str(tmp_path / "store" / "registry" / "audit.jsonl")).records(model=name)


def test_registration_tags_lineage_and_eval_metrics(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from clarifier.registry.registry import logged_eval_sets, register_adapter

    run_id = _run_with_report(tmp_path, 0.75, 0.2)
    mv = register_adapter(run_id, f"lineage-{uuid.uuid4().hex[:6]}", alias="challenger")
    tags = MlflowClient().get_model_version(mv.name, mv.version).tags
    manifest_text = (next(tmp_path.glob("*/data/manifest.json"))).read_text()
    assert tags["clarifier.run_id"] == run_id
    assert tags["clarifier.base_model"] == "smollm2-135m-instruct"
    assert tags["clarifier.data"] == "s3://b/data"
    assert tags["clarifier.data_manifest_sha256"] == hashlib.sha256(manifest_text.encode()).hexdigest()
    assert float(tags["eval.f1"]) == 0.75 and float(tags["eval.over_asking_rate"]) == 0.2
    assert float(tags["eval.semantic_similarity"]) == 0.7
    assert tags["eval.data_fingerprint"] == FP
    assert logged_eval_sets(tags)[FP]["metrics"]["validity"] == 1.0
    # the version's description is its model card, linking to the training run in the MLflow UI
    card = MlflowClient().get_model_version(mv.name, mv.version).description
    assert "| base model | smollm2-135m-instruct |" in card and "| f1 | 0.7500 |" in card
    assert f"(fingerprint `{FP[:16]}`)" in card and f"/runs/{run_id})" in card


def test_gate_refuses_worse_promotes_better_and_rollback_restores(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from clarifier.cli import app
    from clarifier.registry.registry import register_adapter, set_alias

    client = MlflowClient()
    name = f"gate-{uuid.uuid4().hex[:6]}"
    store = f"storage.root={tmp_path / 'store'}"
    v1 = register_adapter(_run_with_report(tmp_path, 0.75, 0.20), name, alias="challenger").version

    # 1. no champion yet: only the absolute criteria apply -> promoted
    res = runner.invoke(app, ["models", "promote", name, "--from", "challenger", "--to", "champion", store])
    assert res.exit_code == 0, res.output
    assert client.get_model_version_by_alias(name, "champion").version == v1
    (rec,) = _audit(tmp_path, name)
    assert rec["decision"] == "promoted" and rec["champion"] is None and rec["previous_version"] is None
    crit = {c["name"]: c for c in rec["criteria"]}
    assert crit["max_f1_drop"]["skipped"] and crit["max_over_asking"]["passed"]

    # 2. a worse challenger (F1 drops by 0.15) is refused; the alias stays; the log and tags say why
    v2 = register_adapter(_run_with_report(tmp_path, 0.60, 0.20), name, alias="challenger").version
    res = runner.invoke(app, ["models", "promote", name, "--from", "challenger", "--to", "champion", store])
    assert res.exit_code == 1, res.output
    assert "refused" in res.output and "max_f1_drop" in res.output
    assert client.get_model_version_by_alias(name, "champion").version == v1
    rec = _audit(tmp_path, name)[-1]
    assert rec["decision"] == "refused" and rec["challenger"]["version"] == v2 and rec["champion"]["version"] == v1
    assert rec["challenger"]["metrics"]["f1"] == 0.6 and rec["champion"]["metrics"]["f1"] == 0.75
    failed = [c["name"] for c in rec["criteria"] if not c["passed"]]
    assert failed == ["max_f1_drop"] and "max_f1_drop" in rec["reason"]
    assert rec["eval_set"]["fingerprint"] == FP and rec["user"]
    tags = client.get_model_version(name, v2).tags
    assert tags["gate.champion.decision"] == "refused" and tags["gate.champion.against"] == v1
    assert "max_f1_drop" in json.loads(tags["gate.champion.evidence"])["criteria"][0]["name"]

    # 3. a better challenger is promoted: the alias moves, the old champion is marked replaced
    v3 = register_adapter(_run_with_report(tmp_path, 0.80, 0.18), name, alias="challenger").version
    res = runner.invoke(app, ["models", "promote", name, "--from", "challenger", "--to", "champion", store])
    assert res.exit_code == 0, res.output
    assert client.get_model_version_by_alias(name, "champion").version == v3
    rec = _audit(tmp_path, name)[-1]
    assert (rec["decision"], rec["from_version"], rec["to_version"]) == ("promoted", v1, v3)
    assert all(c["passed"] for c in rec["criteria"])
    assert client.get_model_version(name, v1).tags["gate.champion.replaced_by"] == v3

    # list / diff show the versions and their metrics
    res = runner.invoke(app, ["models", "list", name])
    assert res.exit_code == 0, res.output
    assert "champion" in res.output and "challenger" in res.output and "0.800" in res.output and "0.600" in res.output
    res = runner.invoke(app, ["models", "diff", name, v1, v3])
    assert res.exit_code == 0, res.output
    f1_row = next(line for line in res.output.splitlines() if " f1 " in f" {line} ")
    assert "0.7500" in f1_row and "0.8000" in f1_row and "+0.0500" in f1_row

    # 4. rollback restores the previous champion (audited)
    res = runner.invoke(app, ["models", "rollback", name, "--alias", "champion", "--reason", "bad canary", store])
    assert res.exit_code == 0, res.output
    assert client.get_model_version_by_alias(name, "champion").version == v1
    rec = _audit(tmp_path, name)[-1]
    assert (rec["action"], rec["decision"], rec["from_version"], rec["to_version"], rec["reason"]) == (
        "rollback", "rolled_back", v3, v1, "bad canary")
    assert len(_audit(tmp_path, name)) == 4  # append-only: every decision is still there

    # 5. nothing earlier than v1 -> a clear error, alias untouched
    res = runner.invoke(app, ["models", "rollback", name, store])
    assert res.exit_code == 2 and "nothing to roll back" in res.output
    assert client.get_model_version_by_alias(name, "champion").version == v1

    # an alias moved outside the gate is not silently "rolled back" over
    set_alias(name, "champion", v2)
    res = runner.invoke(app, ["models", "rollback", name, store])
    assert res.exit_code == 2 and "outside the gate" in res.output


def test_gate_needs_a_common_evaluation_set(mlflow_server, tmp_path):
    from clarifier.registry.promotion import PromotionError, promote
    from clarifier.registry.registry import register_adapter

    name = f"sets-{uuid.uuid4().hex[:6]}"
    register_adapter(_run_with_report(tmp_path, 0.7, 0.2, fingerprint="a" * 64), name, alias="champion")
    register_adapter(_run_with_report(tmp_path, 0.9, 0.1, fingerprint="b" * 64), name, alias="challenger")
    with pytest.raises(PromotionError, match="pass --data"):
        promote(_cfg(tmp_path), name, from_alias="challenger", to_alias="champion", progress=lambda m: None)
    assert _audit(tmp_path, name) == []  # no decision, no record
    with pytest.raises(PromotionError, match="no alias 'canary'"):
        promote(_cfg(tmp_path), name, from_alias="canary", progress=lambda m: None)


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory, tiny_model_dir):
    """Two adapters on the tiny model that differ only in their threshold: never asks vs always asks."""
    from support.adapters import untrained_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {label: untrained_adapter(tiny_model_dir, root / label, threshold=thr, r=2)
            for label, thr in (("never", 1.0), ("always", 0.0))}


def _eval_file(path: Path) -> Path:
    hist = [{"role": "user", "text": "I have a router and a modem."}, {"role": "assistant", "text": "OK."}]
    rows = [{"id": f"q{i}", "history": hist, "query": "how do I reset it?" if i % 2 == 0 else "how do I reset the modem?",
             "needs_clarification": i % 2 == 0,
             "clarifying_question": "The router or the modem?" if i % 2 == 0 else None,
             "grounding_turns": [0] if i % 2 == 0 else []} for i in range(6)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, '{"id": "broken", "query": ')  # malformed: reported and skipped
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(600)
def test_gate_evaluates_both_on_the_same_file(mlflow_server, tmp_path, tiny_adapters):
    import mlflow
    from mlflow import MlflowClient

    from clarifier.registry.promotion import promote
    from clarifier.registry.registry import logged_eval_sets, register_adapter

    name = f"tiny-{uuid.uuid4().hex[:6]}"
    data = str(_eval_file(tmp_path / "eval.jsonl"))
    versions = {}
    for label in ("never", "always"):
        mlflow.set_experiment("registry-tests")
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(tiny_adapters[label]), "adapter")
        versions[label] = register_adapter(run.info.run_id, name).version
    client = MlflowClient()
    client.set_registered_model_alias(name, "champion", versions["never"])
    client.set_registered_model_alias(name, "challenger", versions["always"])
    cfg = _cfg(tmp_path, "eval.batch_size=4", "eval.max_new_tokens=6")

    msgs: list[str] = []
    d = promote(cfg, name, from_alias="challenger", to_alias="champion", data=data, progress=msgs.append)
    # threshold 0 decodes every turn; the untrained tiny model's generations never parse, so every
    # output is invalid (validity 0 < 0.95) -> refused. The champion never decodes: validity 1, F1 0.
    assert d.decision == "refused"
    assert d.challenger_metrics["validity"] == 0.0 and d.challenger_metrics["n"] == 6
    assert d.champion_metrics["validity"] == 1.0 and d.champion_metrics["f1"] == 0.0
    assert "min_validity" in [c.name for c in d.gate.failed]
    assert d.eval_set["n"] == 6 and d.eval_set["skipped_lines"] == 1
    assert any(":4:" in m and "skipped" in m for m in msgs)  # the malformed line, by number
    assert d.record["challenger"]["metrics_source"] == "evaluated"
    assert client.get_model_version_by_alias(name, "champion").version == versions["never"]
    # the metrics on this set are tagged on both versions and reused by the next decision
    for v in versions.values():
        assert d.eval_set["fingerprint"] in logged_eval_sets(client.get_model_version(name, v).tags)
    d2 = promote(cfg, name, from_alias="challenger", to_alias="champion", data=data, progress=lambda m: None)
    assert d2.record["challenger"]["metrics_source"] == "logged" and d2.challenger_metrics == d.challenger_metrics
    assert [r["decision"] for r in _audit(tmp_path, name)] == ["refused", "refused"]
