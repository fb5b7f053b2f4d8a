"""clarifier.evaluation.report: files written, plots valid, table content."""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from clarifier.core.metrics import Prediction, evaluate_predictions
from clarifier.evaluation.report import format_table, write_report
from clarifier.core.schema import Example, Turn

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _examples():
    hist = [Turn(role="user", text="my router is broken"), Turn(role="assistant", text="which one?")]
    out = []
    for i in range(8):
        clarify = i % 2 == 0
        out.append(
            Example(
                id=f"e{i}",
                history=hist,
                query="how do I reset it?",
                needs_clarification=clarify,
                clarifying_question="Which router do you mean?" if clarify else None,
                grounding_turns=[0] if clarify and i != 4 else [],
            )
        )
    return out


def _entry(examples, scores, question="Which router do you mean?"):
    preds = [
        Prediction(s >= 0.5, s, question if s >= 0.5 else None, (0,) if s >= 0.5 else ())
        for s in scores
    ]
    gold = [e.needs_clarification for e in examples]
    return {"metrics": evaluate_predictions(examples, preds), "scores": scores, "gold": gold}


@pytest.fixture()
def report():
    ex = _examples()
    model_scores = [0.9, 0.2, 0.8, 0.6, 0.7, 0.1, 0.3, 0.4]
    heuristic_scores = [0.6, 0.6, 0.4, 0.6, 0.6, 0.4, 0.6, 0.4]
    return {
        "model_uri": "models:/clarifier/3",
        "data": "s3://bucket/eval.jsonl",
        "n": len(ex),
        "models": {
            "clarifier-v3": _entry(ex, model_scores),
            "baseline-keyword": _entry(ex, heuristic_scores, question="Can you clarify?"),
            "baseline-never": {"metrics": evaluate_predictions(ex, [Prediction(False, 0.0)] * len(ex))},
        },
    }


def test_write_report_files(tmp_path, report):
    paths = write_report(report, tmp_path / "out")
    for key in ("json", "scores", "markdown", "pr_curve", "over_asking", "calibration"):
        assert key in paths, key
        assert paths[key].exists() and paths[key].parent == tmp_path / "out"
    for key in ("pr_curve", "over_asking", "calibration"):
        data = paths[key].read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 5000  # a real plot, not an empty canvas stub
        img = matplotlib.image.imread(paths[key])  # decodes as a PNG
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert img.std() > 0.01  # something was drawn


def test_report_json_split(tmp_path, report):
    paths = write_report(report, tmp_path)
    rj = json.loads(paths["json"].read_text())
    assert rj["model_uri"] == "models:/clarifier/3" and rj["n"] == 8
    assert set(rj["models"]) == {"clarifier-v3", "baseline-keyword", "baseline-never"}
    for entry in rj["models"].values():
        assert "scores" not in entry and "gold" not in entry
    assert rj["models"]["clarifier-v3"]["metrics"]["decision"]["f1"] == pytest.approx(
        report["models"]["clarifier-v3"]["metrics"]["decision"]["f1"]
    )
    sj = json.loads(paths["scores"].read_text())
    assert set(sj) == {"clarifier-v3", "baseline-keyword"}
    assert sj["clarifier-v3"]["scores"] == report["models"]["clarifier-v3"]["scores"]
    assert sj["clarifier-v3"]["gold"] == report["models"]["clarifier-v3"]["gold"]
    # the input report is not modified
    assert "scores" in report["models"]["clarifier-v3"]


def test_markdown_table(tmp_path, report):
    md = write_report(report, tmp_path)["markdown"].read_text()
    for name, entry in report["models"].items():
        assert name in md
        f1 = entry["metrics"]["decision"]["f1"]
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} |"))
        assert f"{f1:.3f}" in row
    # clarifier-v3: tp 3 (0.9, 0.8, 0.7), fp 1 (0.6), fn 1 -> P = R = F1 = 0.75, over-ask 0.25
    row = next(line for line in md.splitlines() if line.startswith("| clarifier-v3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == ["0.750", "0.750", "0.750", "0.250"]
    # never-asking baseline has no true positives -> ROUGE-L / grounding undefined
    never = next(line for line in md.splitlines() if line.startswith("| baseline-never |"))
    assert "n/a" in never
    # skipped grounding rows are reported (clarifier-v3: TP e4 has no gold grounding)
    assert "skipped" in md
    assert "clarifier-v3: 1 skipped of 3 true positives" in md
    assert "models:/clarifier/3" in md
    assert "![Precision-recall](pr_curve.png)" in md


def test_format_table_plain_text(report):
    text = format_table(report)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["Model", "P", "R", "F1"]
    assert len(lines) == 2 + len(report["models"])
    for name, entry in report["models"].items():
        line = next(ln for ln in lines if ln.startswith(name))
        assert f"{entry['metrics']['decision']['f1']:.3f}" in line.split()
    assert "|" not in text  # plain text, not markdown


def test_no_scores_means_no_plots(tmp_path, report):
    for entry in report["models"].values():
        entry.pop("scores", None)
        entry.pop("gold", None)
    paths = write_report(report, tmp_path)
    assert set(paths) == {"json", "scores", "markdown"}
    assert not list(tmp_path.glob("*.png"))
    assert json.loads(paths["scores"].read_text()) == {}


def test_missing_models_rejected(tmp_path):
    with pytest.raises(ValueError):
        write_report({"n": 3}, tmp_path)


def test_training_runs_evaluation_says_why_it_is_skipped(tmp_path):
    """`clarifier train` ends with evaluate_training_run; without a split to evaluate on it says so, not fails."""
    import json

    from clarifier.core.config import load_config
    from clarifier.evaluation.evaluate import evaluate_training_run

    said: list[str] = []
    cfg = load_config(None, [f"data.output={tmp_path / 'none'}"])
    assert evaluate_training_run(cfg, "unused", "run", progress=said.append) is None
    assert "no data-job output" in said[-1] and "none" in said[-1]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"counts": {"splits": {"train": {"examples": 5},
                                                                                      "test": {"examples": 0}}}}))
    cfg = load_config(None, [f"data.output={tmp_path / 'data'}"])
    assert evaluate_training_run(cfg, "unused", "run", progress=said.append) is None
    assert "split 'test'" in said[-1] and "empty" in said[-1]
