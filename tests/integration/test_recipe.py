"""The recipe benchmark end to end on a tiny model: public-dataset sources -> data jobs -> Ray Train
runs (variant, ablation, leave-one-out) -> one evaluation set -> JSON + Markdown report."""

from __future__ import annotations

import json

import pytest
import yaml

from support.paths import PUBLIC

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(900)
@pytest.mark.skipif(not (PUBLIC / "clariq").is_dir() or not (PUBLIC / "pacific").is_dir(),
                    reason="needs ../shared/data/public (not part of a user's clone)")
def test_recipe_benchmark_tiny(tiny_model_dir, ray_local, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from clarifier.recipes.benchmark import run_benchmark
    from support.tinymodel import build_tiny_bert

    tiny_bert = build_tiny_bert(tmp_path / "tiny-bert")

    recipe = {
        "data": {
            "sources": [
                {"importer": "clariq", "src": str(PUBLIC / "clariq"), "max_examples": 30},
                {"importer": "pacific", "src": str(PUBLIC / "pacific"), "max_examples": 30},
                {"importer": "synthetic", "options": {"conversations": 24}},
            ],
            "split": {"train": 0.6, "dev": 0.15, "test": 0.25},
            "max_length": 640,
        },
        "model": {"base_model": str(tiny_model_dir), "max_prompt_tokens": 512,
                  "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}},
        "train": {"num_workers": 1, "zero_stage": 2, "max_steps": 2, "micro_batch_size": 2, "warmup_steps": 1,
                  "decision_loss": {"kind": "weighted", "clarify_weight": "auto"}, "experiment": "recipe-test",
                  "balance": "source_class", "learning_curve": {"every": 1, "examples_per_source": 4},
                  "decision_head": {"enabled": True, "max_per_source": 8, "c_grid": [0.01, 1.0]}},
        "eval": {"batch_size": 4, "max_new_tokens": 8, "semantic_encoder": None},
    }
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(recipe))
    plan = {
        "recipe": str(tmp_path / "tiny.yaml"),
        "eval_per_source": 5,
        "zero_shot": {"zero_shot_tiny": str(tiny_model_dir)},
        "probes": {"probe_tiny": str(tiny_model_dir)},
        "variants": {"joint": [], "joint_no_class_weighting": ["train.decision_loss.kind=ce"]},
        "encoders": {"encoder_tiny": {"base_model": str(tiny_bert), "max_steps": 3, "batch_size": 4, "max_length": 128,
                                      "leave_one_out_max_minutes": 5}},
        "leave_one_out": {"sources": ["clariq"], "overrides": ["train.max_steps=1"]},
        "error_analysis": {"row": "joint", "decisions": 3, "questions": 3},
    }
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    messages: list[str] = []
    result = run_benchmark(str(tmp_path / "plan.yaml"), out=tmp_path / "out" / "report", workdir=tmp_path / "work",
                           progress=messages.append)

    # every row, scored on the same evaluation set, overall and per source
    assert list(result["rows"]) == ["never_ask", "always_ask", "lexical", "source_only", "surface_control",
                                    "zero_shot_tiny", "joint",
                                    "joint_tokens", "joint_no_class_weighting", "joint_no_class_weighting_tokens",
                                    "probe_tiny", "encoder_tiny"]
    by_source = result["eval_set"]["by_source"]
    assert set(by_source) == {"clariq", "pacific", "synthetic"} and all(v["n"] <= 5 for v in by_source.values())
    n = result["eval_set"]["n"]
    for name, row in result["rows"].items():
        m = row["metrics"]
        assert m["all"]["n"] == n, name
        assert set(m) >= {"all", "clariq", "pacific", "synthetic"}
        assert set(m["all"]["recall_at_over_asking"]) == {"0.05", "0.1"}
        assert set(m["all"]["within_source"]["by_source"]) == set(by_source), name
    # the source-only control knows the source and nothing else: at chance inside every source
    ctrl = result["rows"]["source_only"]["metrics"]["all"]["within_source"]
    assert all(v["auroc"] in (0.5, None) for v in ctrl["by_source"].values())
    # ... and the balanced training mix leaves it nothing to learn
    assert result["train_mix"]["balance"] == "source_class" and result["train_mix"]["source_only_auroc"] == pytest.approx(0.5, abs=0.02)
    assert result["train_mix"]["source_only_auroc_natural"] > 0.55
    # the surface control is fitted on the train split; every scored row states its margin over it
    surface = result["rows"]["surface_control"]
    assert surface["kind"] == "control" and surface["fitted_on"].startswith("the train split")
    skill = result["skill_over_surface_control"]
    assert set(skill) == {"zero_shot_tiny", "joint", "joint_tokens", "joint_no_class_weighting",
                          "joint_no_class_weighting_tokens", "probe_tiny", "encoder_tiny"}
    assert skill["joint"]["headline"] == "within_source" and skill["joint"]["verdict"].startswith("joint ")
    assert any(m.startswith("[recipe] joint ") and "surface control" in m for m in messages)
    assert "## Skill over the surface control" in (tmp_path / "out" / "report.md").read_text()
    assert result["rows"]["always_ask"]["metrics"]["all"]["decision"]["recall"] == 1.0
    zs = result["rows"]["zero_shot_tiny"]  # thresholded by the trained rows' calibration rule, on dev
    assert zs["threshold"] == zs["calibration"]["threshold"] and 0.0 <= zs["threshold"] <= 1.0
    assert zs["calibration"]["rule"] == "over_asking<=0.1" and zs["calibration"]["n"] > 0  # the product's default
    joint = result["rows"]["joint"]
    assert joint["steps"] == 2 and 0.0 <= joint["threshold"] <= 1.0
    # the joint model decides from its decision head; the same model deciding from its decision tokens is a row too
    assert joint["decided_by"] == "decision head" and joint["decision_head"]["n_train"] > 0
    tokens = result["rows"]["joint_tokens"]
    assert tokens["kind"] == "tokens" and tokens["run_id"] == joint["run_id"] and tokens["decided_by"] == "decision tokens"
    assert tokens["calibration"]["rule"] == "over_asking<=0.1"
    assert tokens["calibration"]["n"] == result["data"]["counts"]["splits"]["dev"]["examples"]
    # per-example scores and decisions are kept (in eval_set.ids order) for later analyses; the bootstrap
    # resamples inside every source and gives the within-source mean AUROC its interval
    assert len(joint["scores"]) == len(joint["decisions"]) == n == len(result["eval_set"]["ids"])
    assert result["uncertainty"]["stratified_by_source"] and "macro_auroc_diff" in result["uncertainty"]["systems"]["joint_tokens"]
    probe = result["rows"]["probe_tiny"]  # the untrained base + a head fitted on the train split
    assert probe["kind"] == "probe" and probe["decision_head"]["layers"] == [1, 2] and "dev_scores" not in probe["decision_head"]
    enc = result["rows"]["encoder_tiny"]  # trained on the train split, calibrated on dev, saved under the work folder
    assert enc["kind"] == "encoder" and enc["steps"] == 3 and enc["threshold"] == enc["calibration"]["threshold"]
    assert enc["calibration"]["rule"] == "over_asking<=0.1" and enc["train_examples"] == result["data"]["counts"]["splits"]["train"]["examples"]
    assert set(enc["sources"]) == {"clariq", "pacific", "synthetic"}
    from clarifier.train.encoder_classifier import EncoderClassifier

    assert EncoderClassifier.load(enc["model_dir"]).threshold == enc["threshold"]
    assert any(k.startswith("encoder encoder_tiny") for k in result["stages_seconds"])
    client = MlflowClient()
    assert client.get_run(joint["run_id"]).data.params["train.decision_loss.kind"] == "weighted"
    # the joint row's model folder is kept for `clarifier models package` (plan keep_models); the other
    # variants' temporary folders are gone after evaluation: their rows point at the run's logged copy
    assert joint["model_dir"] == str(tmp_path / "work" / "models" / "joint")
    assert (tmp_path / "work" / "models" / "joint" / "clarifier.json").is_file()
    ablation = result["rows"]["joint_no_class_weighting"]
    assert "model_dir" not in ablation and ablation["model_uri"] == f"runs:/{ablation['run_id']}/adapter"
    assert not (tmp_path / "work" / "models" / "joint_no_class_weighting").exists()
    assert result["eval_set"]["fingerprint"] and len(result["eval_set"]["fingerprint"]) == 64
    assert "adapter/clarifier.json" in {f.path for f in client.list_artifacts(joint["run_id"], "adapter")}
    assert client.get_run(result["rows"]["joint_no_class_weighting"]["run_id"]).data.params["train.decision_loss.kind"] == "ce"

    # the data job imported every source, counting what max_examples dropped
    src = result["data"]["sources"]
    assert src["pacific"]["kept"] <= 30 and src["pacific"]["kept"] + src["pacific"]["dropped_by_cap"] == src["pacific"]["imported"]
    assert src["synthetic"]["conversations"] == 24

    # leave-one-out: trained without clariq, scored on the clariq evaluation examples only
    loo = result["leave_one_out"]["clariq"]
    assert loo["n"] == by_source["clariq"]["n"] == loo["left_out"]["n"] and loo["steps"] == 1
    assert set(loo["in_distribution"]) == set(result["rows"])
    loo_enc = loo["encoders"]["encoder_tiny"]  # the encoder trained without clariq, on the clariq examples
    assert loo_enc["left_out"]["n"] == loo["n"] and loo_enc["steps"] == 3
    assert loo_enc["train_examples"] == enc["train_examples"] - enc["sources"]["clariq"]["n"]
    manifest = json.loads((tmp_path / "work" / "loo-clariq" / "data" / "manifest.json").read_text())
    assert "clariq" not in manifest["sources"] and set(manifest["sources"]) == {"pacific", "synthetic"}

    # error analysis per source, samples capped
    ea = result["error_analysis"]
    assert set(ea) == set(by_source)
    for a in ea.values():
        assert len(a["decision_samples"]) <= 3 and a["decision_errors"] == sum(a["decision_categories"].values())

    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written["rows"].keys() == result["rows"].keys() and written["machine"]["cpus"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.index("## Headline: inside each source") < md.index("## Mixed evaluation set")
    assert "### At 10% over-asking" in md and "### Leave one dataset out" in md and "joint without clariq" in md
    assert "Source-only control on the training mix (train.balance=source_class)" in md
    # the learning curve: within-source dev AUROC logged at every step, tabled and plotted
    curve = joint["learning_curve"]
    assert [p["step"] for p in curve] == [1, 2] and all("dev/macro_auroc" in p for p in curve)
    assert "## Learning curve" in md and (tmp_path / "out" / "report-learning-curve.png").stat().st_size > 1000
    assert "| zero_shot_tiny | zero-shot |" in md
    assert "| encoder_tiny | encoder |" in md
    assert "## Decision heads" in md and "| probe_tiny | probe | 1, 2 |" in md
    assert "within-source AUROC - joint" in md
    assert "| clariq | encoder_tiny without clariq |" in md and "## Encoder rows" in md
    assert result["benchmark"] == "recipe-plan" and md.startswith(f"# Recipe benchmark: plan (recipe {tmp_path / 'tiny.yaml'})")
    assert any("data job" in m for m in messages)
