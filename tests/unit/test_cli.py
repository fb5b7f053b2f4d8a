"""The CLI and the jobs/ entrypoints: help, resolved config, config errors (no Ray started)."""

import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from clarifier.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_every_stage_has_a_subcommand():
    out = runner.invoke(app, ["--help"]).output
    for cmd in ("quickstart", "data", "train", "eval", "models", "serve", "config"):
        assert cmd in out
    assert "prepare" in runner.invoke(app, ["data", "--help"]).output
    models = runner.invoke(app, ["models", "--help"]).output
    assert "register" in models and "promote" in models


def test_config_prints_resolved_yaml_with_overrides():
    res = runner.invoke(app, ["config", "-c", str(ROOT / "platform/clarifier/quickstart.yaml"), "train.max_steps=3",
                              "model.lora.r=4"])
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load(res.output)
    assert cfg["train"]["max_steps"] == 3 and cfg["model"]["lora"]["r"] == 4 and cfg["train"]["zero_stage"] == 2


def test_config_error_names_the_key_and_exits_2():
    res = runner.invoke(app, ["train", "-c", str(ROOT / "platform/clarifier/quickstart.yaml"), "train.max_stepz=3"])
    assert res.exit_code == 2 and "train.max_stepz" in res.output
    assert "did you mean 'train.max_steps'?" in " ".join(res.output.split())  # rich wraps long lines
    res = runner.invoke(app, ["config", "-c", str(ROOT / "platform/clarifier/quickstart.yaml"), "train.zzz=3"])
    assert res.exit_code == 2 and "did you mean" not in res.output


def test_data_synth_writes_either_generator(tmp_path):
    res = runner.invoke(app, ["data", "synth", "--out", str(tmp_path / "rag"), "--n", "5", "--shards", "2",
                              "--generator", "synthetic_rag"])
    assert res.exit_code == 0, res.output
    assert "wrote 5 synthetic_rag conversations to 2 files" in res.output
    lines = [line for f in (tmp_path / "rag").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(lines) == 5 and all('"passages"' in line for line in lines)
    res = runner.invoke(app, ["data", "synth", "--out", str(tmp_path / "x"), "--generator", "nope"])
    assert res.exit_code == 2 and "synthetic, synthetic_rag" in res.output


def test_job_entrypoints_run_as_scripts():
    for job, words in [("prepare_data.py", "data.input"), ("train.py", "overrides"), ("evaluate.py", "--model"),
                       ("register.py", "--run-id"), ("quickstart.py", "--workdir"), ("audit.py", "--logs"),
                       ("adapt.py", "--experiment")]:
        res = subprocess.run([sys.executable, str(ROOT / "jobs" / job), "--help"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        assert words in res.stdout, (job, res.stdout)


def test_sigterm_runs_finally_blocks(tmp_path):
    """A killed command still stops what it started: SIGTERM becomes SystemExit(143)."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "cleaned"
    script = (
        "import time, pathlib\n"
        "from clarifier.cli import exit_cleanly_on_sigterm\n"
        "exit_cleanly_on_sigterm()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        f"    pathlib.Path({str(marker)!r}).write_text('stopped')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert marker.read_text() == "stopped"


def test_audit_without_a_model_says_what_to_pass(tmp_path, monkeypatch):
    """No --model, no tracking URI, no quickstart model: one clear line, exit 2, before Ray starts."""
    from typer.testing import CliRunner

    from clarifier.cli import app

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    res = CliRunner().invoke(app, ["audit", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "no model to audit with: pass --model" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["audit", "--out", str(tmp_path / "out"), "--model", "x"])
    assert res.exit_code == 2 and "audit.logs is empty" in res.output


def test_quickstart_says_by_how_much_the_model_beats_each_baseline():
    from clarifier.cli import verdict_lines

    lines = verdict_lines({"decision_f1": {"model": 0.913, "lexical": 0.8, "always_ask": 0.667, "base_model": 0.0},
                           "over_asking_rate": {"model": 0.163, "lexical": 0.326, "always_ask": 1.0, "base_model": 0.0}})
    assert lines[0] == ("the trained model beats lexical by +0.113 F1: 0.913 vs 0.800, over-asking 0.163 vs 0.326", True)
    lost = verdict_lines({"decision_f1": {"model": 0.7, "lexical": 0.8}, "over_asking_rate": {"model": 0.1, "lexical": 0.3}})
    assert lost == [("note: on decision F1 the trained model did NOT beat lexical (-0.100): 0.700 vs 0.800, "
                     "over-asking 0.100 vs 0.300", False)]


def test_quickstart_leads_with_the_margin_over_the_surface_control():
    from clarifier.cli import verdict_lines

    said = "the model does NOT beat its surface control (position and length only): +0.010 [-0.040, +0.060]"
    lines = verdict_lines({"decision_f1": {"model": 0.9, "lexical": 0.8}, "over_asking_rate": {"model": 0.1, "lexical": 0.3},
                           "skill": {"verdict": said, "beats_control": False}})
    assert lines[0] == (said, False) and lines[1][0].startswith("the trained model beats lexical")


def test_quickstart_compares_recall_at_the_rules_over_asking():
    """F1 at each one's own operating point can favour a rule that asks 3x as often; the summary also says what
    the model's scores catch when they may over-ask as often as the rule did."""
    from clarifier.cli import verdict_lines
    from clarifier.quickstart import _at_baseline_over_asking

    gold = [True] * 4 + [False] * 6
    dec = {"over_asking_rate": 2 / 6, "recall": 0.5}
    report = {"models": {"model": {"gold": gold, "scores": [0.9, 0.8, 0.7, 0.05, 0.6, 0.1, 0.1, 0.1, 0.1, 0.1]},
                         "lexical": {"metrics": {"decision": dec}, "gold": gold, "scores": [0.5] * 10}}}
    same = _at_baseline_over_asking(report, ("lexical", "always_ask"))
    assert same == {"lexical": {"over_asking": 2 / 6, "baseline_recall": 0.5, "model_recall": 0.75}}  # 0.05 is below five clear turns
    assert _at_baseline_over_asking({"models": {"model": {"metrics": {}}}}, ("lexical",)) == {}  # no scores: nothing claimed

    lines = verdict_lines({"decision_f1": {"model": 0.5, "lexical": 0.6}, "over_asking_rate": {"model": 0.0, "lexical": 2 / 6},
                           "at_baseline_over_asking": same})
    assert lines[0][1] is False and "did NOT beat lexical" in lines[0][0]
    assert lines[1] == ("  asking as often as lexical (over-asking 0.333), the model's scores catch 0.750 of the turns that "
                        "need a question vs 0.500 (+0.250; threshold picked on the test split: rankings compared at equal "
                        "cost)", True)


def test_quickstart_shows_each_example_answer_on_one_line():
    from clarifier.core.schema import ClarifyResponse
    from clarifier.quickstart import _one_line

    req = {"query": "how do I reset it?", "history": [], "passages": []}
    asked = ClarifyResponse(needs_clarification=True, confidence=0.834, threshold=0.4,
                            question="Which device: the router or the printer?", model_version="3")
    assert _one_line(req, asked, True) == ("'how do I reset it?' -> clarify: 'Which device: the router or the printer?'"
                                           "  [confidence 0.83 vs threshold 0.40; gold clarify]")
    silent = ClarifyResponse(needs_clarification=False, confidence=0.1, model_version="3")
    line = _one_line({**req, "query": "x" * 80}, silent, False)
    assert line.startswith("'" + "x" * 57 + "...' -> answer (no question)") and line.endswith("[confidence 0.10; gold answer]")


def test_serve_on_a_taken_port_names_it_before_starting_ray(monkeypatch, capsys):
    """Without the check, Serve's proxy keeps retrying the bind and /readyz can reach the other process."""
    import socket

    from clarifier.cli import main

    monkeypatch.setenv("CLARIFIER_VERBOSE", "1")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = main(["serve", f"serve.port={port}", "serve.model_uri=/nope"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"port {port} on 127.0.0.1 is taken" in err and "serve.port=<n>" in err
    import ray

    assert not ray.is_initialized()
