"""The model card a registered version carries as its MLflow description (pure: no MLflow server)."""

from clarifier.registry.registry import model_card, run_url

TAGS = {"clarifier.run_id": "abc123", "clarifier.base_model": "smollm2-135m-instruct", "clarifier.data": "s3://b/data",
        "clarifier.data_manifest": "runs:/abc123/data/manifest.json", "clarifier.data_manifest_sha256": "f" * 64,
        "eval.f1": "0.6125", "eval.over_asking_rate": "0.0812", "eval.auroc": "", "eval.n": "499.0",
        "eval.data": "test.jsonl", "eval.data_fingerprint": "0123456789abcdef" * 4}
META = {"base_model": "smollm2-135m-instruct", "threshold": 0.58213, "finetune": "lora", "precision": "bf16",
        "calibration": {"rule": "over_asking<=0.1", "split": "dev", "n": 677}}


def test_card_names_model_data_threshold_and_metrics_with_the_eval_set():
    card = model_card(TAGS, META, {"train.variant": "joint", "train.max_steps": "600"},
                      run_url("http://mlflow:5000/", "7", "abc123"))
    assert "| training run | [abc123](http://mlflow:5000/#/experiments/7/runs/abc123) |" in card
    assert "| threshold | 0.582 (over_asking<=0.1, dev split, n=677) |" in card
    assert "| precision | bf16 |" in card and "| recipe | train.variant joint, train.max_steps 600 |" in card
    assert "sha256 ffffffffffff..." in card
    assert "Evaluation on `test.jsonl` (fingerprint `0123456789abcdef`)" in card
    assert "| f1 | 0.6125 |" in card and "| over_asking_rate | 0.0812 |" in card and "| n | 499 |" in card
    assert "auroc" not in card  # an undefined metric is left out, not shown as empty


def test_card_without_an_eval_report_says_how_to_get_one():
    card = model_card({"clarifier.run_id": "r1"}, None, None, None)
    assert "| training run | r1 |" in card and "clarifier eval --run-id" in card
    assert run_url("file:///tmp/mlruns", "1", "r1") is None and run_url(None, "1", "r1") is None
