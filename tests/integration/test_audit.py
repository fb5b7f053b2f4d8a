"""The audit job on a local Ray cluster: chat transcripts from a folder and from loopback S3 -> turns
Parquet, quarantine, a report with a verdict, an MLflow run; the command line as a user runs it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
RAY_CPUS = 2


def _logs(n: int, labelled: bool = False) -> list[dict]:
    """n transcripts, two user turns each: an ambiguous-looking first turn whose answer fails every
    third conversation (no-answer reply) or gets a thumbs-down every fourth, then a follow-up."""
    out = []
    for i in range(n):
        first = {"role": "user", "content": "how do I reset it?" if i % 2 else f"how do I reset router model {i}?"}
        if labelled:
            first["needs_clarification"] = bool(i % 2)
        out.append({"id": f"c{i}", "metadata": {"domain": ["bank", "router", "phone"][i % 3]}, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "I have a router and a modem."},
            {"role": "assistant", "content": "Sure, what do you need?"},
            first,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
            {"role": "tool", "tool_call_id": "t", "content": json.dumps([{"doc_id": "kb1", "text": "Reset the router."},
                                                                         {"doc_id": "kb2", "text": "Reset the modem."}])},
            {"role": "assistant", "content": "I couldn't find that." if i % 3 == 0 else "Hold the button.",
             "feedback": "down" if i % 4 == 0 else "up"},
        ]})
    return out


def _write(path: Path, records: list[dict], bad: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + (["{not json", json.dumps({"messages": [{"role": "bot", "content": "x"}]})] if bad else [])
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model_dir):
    """An untrained adapter on the tiny model with calibration counts stored (recall 0.7, FPR 0.1)."""
    from clarifier.engine.inference import read_meta, write_meta
    from support.adapters import untrained_adapter

    folder = untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("audit") / "model", threshold=0.5, r=2)
    write_meta(folder, replace(read_meta(folder), calibration={"split": "dev", "n": 200, "tp": 70, "fn": 30, "tn": 90,
                                                                "fp": 10, "rule": "test"}))
    return folder


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from support.tinymodel import build_tiny_bert

    return build_tiny_bert(tmp_path_factory.mktemp("audit-bert") / "bert")


@pytest.mark.timeout(600)
def test_audit_command_on_a_folder(tmp_path, model, encoder, ray_local, mlflow_server):
    import mlflow
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from clarifier.cli import app

    logs = _write(tmp_path / "logs" / "part-0.jsonl", _logs(30))
    out = tmp_path / "audit"
    res = CliRunner().invoke(app, ["audit", "--logs", str(logs.parent), "--model", str(model), "--out", str(out),
                                   f"audit.signals.reformulation.encoder={encoder}", "audit.bootstrap=200",
                                   "audit.sample_questions=4", "audit.batch_size=4"])
    assert res.exit_code == 0, res.output
    assert "== Audit: is a clarifier worth it for these logs?" in res.output and "verdict:" in res.output
    report = json.loads((out / "report.json").read_text())
    c = report["counts"]
    assert (c["records"], c["quarantined"], c["turns"]) == (32, 2, 60)
    assert report["error_rates"]["source"].startswith("the model's calibration split")
    assert report["verdict"]["decision"] in ("worth_it", "not_worth_it", "inconclusive", "undetermined")  # a tiny random model
    # failures: thumbs-down on i % 4 == 0 or a no-answer reply on i % 3 == 0 (15 of 30); reformulation only adds
    assert c["failed_turns"] >= 15 and report["signals_present"]["feedback"] == 8 and report["signals_present"]["no_answer"] == 10
    turns = pq.read_table(out / "turns").to_pylist()
    assert len(turns) == 60 and {t["id"] for t in turns} == {f"c{i}:{j}" for i in range(30) for j in (1, 3)}
    assert all(0.0 <= t["score"] <= 1.0 and t["flagged"] == (t["score"] >= 0.5) for t in turns)
    assert sum(t["failed"] for t in turns) == c["failed_turns"]
    q = pq.read_table(out / "quarantine").to_pylist()
    assert sorted(r["line"] for r in q) == [31, 32] and "'bot' is not one of" in q[1]["reason"]
    by_domain = {r["value"]: r["turns"]["n"] for r in report["breakdowns"]["segment:domain"]}
    assert by_domain == {"bank": 20, "router": 20, "phone": 20}
    assert sum(b["failed"] + b["ok"] for b in report["histogram"]["bins"]) == 60
    assert len(report["sample"]) == min(4, sum(t["flagged"] for t in turns))
    for name in ("report.md", "report.html", "audit-score-histogram.png"):
        assert (out / name).stat().st_size > 0
    assert "data:image/png;base64," in (out / "report.html").read_text()
    runs = mlflow.search_runs(experiment_names=["clarifier-audit"], filter_string="tags.`clarifier.stage` = 'audit'",
                              output_format="list")
    assert runs and runs[0].data.metrics["audit/turns"] == 60
    assert runs[0].data.tags["audit.verdict"] == report["verdict"]["decision"]


@pytest.mark.timeout(600)
def test_audit_on_loopback_s3_with_labelled_turns(model, ray_local, s3_bucket, tmp_path):
    """Logs and output in S3; enough labelled turns in the logs -> the in-domain error rates are used."""
    from clarifier.core.config import load_config
    from clarifier.evaluation.audit import run_audit
    from clarifier.runtime import storage

    local = _write(tmp_path / "logs.jsonl", _logs(80, labelled=True), bad=False)
    storage.write_text(f"s3://{s3_bucket}/logs/part-0.jsonl", local.read_text())
    cfg = load_config(None, [f"audit.logs=s3://{s3_bucket}/logs/", f"audit.output=s3://{s3_bucket}/audit",
                             f"audit.model_uri={model}", "audit.signals.reformulation.enabled=false",
                             "audit.sample_questions=0", "audit.bootstrap=200", "audit.min_labelled=30"])
    summary = run_audit(cfg, progress=lambda m: None)
    assert summary["counts"]["turns"] == 160 and summary["counts"]["quarantined"] == 0
    rates = summary["error_rates"]
    assert rates["source"].startswith("80 labelled turns in these logs") and rates["tp"] + rates["fn"] == 40
    # the model against position and length alone on those labelled turns, said in the report
    skill = summary["skill_on_labelled_turns"]
    assert skill["n"] == 80 and skill["clarify"] == 40 and skill["mixed"]["control_auroc"] is not None
    assert "surface control" in skill["verdict"]
    assert "labelled turns: the model" in storage.read_text(f"s3://{s3_bucket}/audit/report.md")
    assert storage.exists(f"s3://{s3_bucket}/audit/report.html")
    assert json.loads(storage.read_text(f"s3://{s3_bucket}/audit/report.json"))["counts"]["turns"] == 160
    scored = storage.list_files(f"s3://{s3_bucket}/audit/turns", (".parquet",))
    assert scored

    # Estimate again from the same scores with other error rates: nothing is scored, the turns stay.
    again = run_audit(cfg.model_copy(update={"audit": cfg.audit.model_copy(
        update={"reuse_scores": True, "error_rates": "calibration"})}), progress=lambda m: None)
    assert again["reused_scores"] and again["seconds_read_and_score"] == 0
    assert again["counts"]["turns"] == 160 and again["error_rates"]["source"].startswith("the model's calibration split")
    assert any("reused" in n for n in again["notes"])
    assert storage.list_files(f"s3://{s3_bucket}/audit/turns", (".parquet",)) == scored
    # ... refused once the logs changed (one more conversation), naming what changed
    storage.write_text(f"s3://{s3_bucket}/logs/part-0.jsonl", local.read_text() + json.dumps(_logs(1)[0]) + "\n")
    with pytest.raises(ValueError, match=r"reuse_scores: the turns in .* were scored from other inputs \(files"):
        run_audit(cfg.model_copy(update={"audit": cfg.audit.model_copy(update={"reuse_scores": True})}),
                  progress=lambda m: None)
    # ... and where nothing was scored yet
    with pytest.raises(ValueError, match="no scored turns to reuse"):
        run_audit(cfg.model_copy(update={"audit": cfg.audit.model_copy(
            update={"reuse_scores": True, "output": f"s3://{s3_bucket}/elsewhere"})}), progress=lambda m: None)


@pytest.mark.timeout(300)
def test_audit_with_every_cpu_held_by_scorer_actors(tmp_path, model, ray_local):
    """audit.actors x cpus_per_actor = all the cluster's CPUs: the stages around the pool take no CPU, so
    the job still finishes (it used to wait forever for a CPU for the filter before the pool)."""
    from clarifier.core.config import load_config
    from clarifier.evaluation.audit import run_audit

    logs = _write(tmp_path / "logs" / "part-0.jsonl", _logs(12), bad=False)
    cfg = load_config(None, [f"audit.logs={logs.parent}", f"audit.output={tmp_path / 'out'}", f"audit.model_uri={model}",
                             f"audit.actors={RAY_CPUS}", "audit.cpus_per_actor=1", "audit.signals.reformulation.enabled=false",
                             "audit.sample_questions=0", "audit.bootstrap=100"])
    summary = run_audit(cfg, progress=lambda m: None)
    assert summary["counts"]["turns"] == 24 and summary["actors"] == RAY_CPUS
