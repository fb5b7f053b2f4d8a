"""The quiet console: other programs' output goes to a per-run log file, errors are one message."""

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

from clarifier.runtime import runlog

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_when_output_is_redirected():
    assert runlog.should_redirect(["data", "prepare"], {})
    assert not runlog.should_redirect(["-v", "data", "prepare"], {})
    assert not runlog.should_redirect(["data", "prepare", "--verbose"], {})
    assert not runlog.should_redirect(["train"], {"CLARIFIER_VERBOSE": "1"})
    assert not runlog.should_redirect(["train"], {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"})  # a Ray job's driver
    assert not runlog.should_redirect(["--help"], {}) and not runlog.should_redirect([], {})


def test_log_file_is_named_after_the_command_and_never_reused(tmp_path):
    now = dt.datetime(2026, 12, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    env = {runlog.LOG_DIR_ENV: str(tmp_path)}
    p = runlog.log_path(["data", "prepare", "-c", "x.yaml", "data.input=s3://b/x"], env, now)
    assert p == tmp_path / "data-prepare-20261202-030405.log"
    p.write_text("x")
    assert runlog.log_path(["data", "prepare"], env, now) == tmp_path / "data-prepare-20261202-030405-2.log"
    assert runlog.log_path(["eval", "--model", "builtin:x"], env, now).name == "eval-20261202-030405.log"
    assert runlog.log_path([], {}, now).parent == runlog.DEFAULT_LOG_DIR


def test_redirect_keeps_only_our_lines_on_the_terminal(tmp_path):
    log = tmp_path / "run.log"
    script = (
        "import os, subprocess, sys, warnings\n"
        "from pathlib import Path\n"
        "from clarifier.runtime.runlog import redirect\n"
        f"run = redirect(Path({str(log)!r}))\n"
        "print('python stdout')\n"
        "print('python stderr', file=sys.stderr)\n"
        "warnings.warn('a library warning')\n"
        "os.write(1, b'fd 1 from C\\n'); os.write(2, b'fd 2 from C\\n')\n"
        "subprocess.run(['echo', 'a child process'])\n"
        "run.terminal_out.write('our line\\n'); run.terminal_err.write('our error\\n')\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "our line\n" and res.stderr == "our error\n"
    text = log.read_text()
    for line in ("python stdout", "python stderr", "a library warning", "fd 1 from C", "fd 2 from C", "a child process"):
        assert line in text, (line, text)


def _cli(args, cwd, env_extra=None):
    return subprocess.run([sys.executable, "-m", "clarifier.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**ENV, **(env_extra or {})}, timeout=120)


def test_an_error_is_one_message_naming_the_stage_and_the_log(tmp_path):
    res = _cli(["eval", "--model", "builtin:nope", "--data", str(tmp_path / "missing.jsonl")], tmp_path,
               {runlog.LOG_DIR_ENV: str(tmp_path / "logs")})
    assert res.returncode == 1
    out = res.stdout + res.stderr
    assert "Traceback" not in out, out
    assert "error in clarifier eval: FileNotFoundError:" in res.stderr and "missing.jsonl does not exist" in res.stderr
    assert "what to do: check the path" in res.stderr
    logs = list((tmp_path / "logs").glob("eval-*.log"))
    assert len(logs) == 1 and f"full log: {logs[0]}" in res.stderr
    assert "Traceback" in logs[0].read_text()  # the details are kept, in the file


def test_verbose_shows_the_traceback_and_writes_no_log(tmp_path):
    res = _cli(["-v", "eval", "--model", "builtin:nope", "--data", str(tmp_path / "missing.jsonl")], tmp_path,
               {runlog.LOG_DIR_ENV: str(tmp_path / "logs")})
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "error in clarifier eval" in res.stderr
    assert not (tmp_path / "logs").exists()


def test_machine_readable_output_stays_on_stdout_and_empty_logs_are_removed(tmp_path):
    import yaml

    res = _cli(["config", "train.max_steps=3"], tmp_path, {runlog.LOG_DIR_ENV: str(tmp_path / "logs")})
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout)["train"]["max_steps"] == 3  # nothing else mixed into stdout
    assert not list((tmp_path / "logs").glob("*.log"))  # nothing was logged: no file left behind
    bad = _cli(["config", "train.max_stepz=3"], tmp_path, {runlog.LOG_DIR_ENV: str(tmp_path / "logs")})
    assert bad.returncode == 2 and "unknown config key 'train.max_stepz'" in bad.stderr and not bad.stdout
    usage = _cli(["evall"], tmp_path, {runlog.LOG_DIR_ENV: str(tmp_path / "logs")})
    assert usage.returncode == 2 and "No such command 'evall'" in usage.stderr and "Traceback" not in usage.stderr


def _booted_seconds_ago(monkeypatch, seconds: float = 5.0) -> None:
    """time.monotonic() counts from boot: a fresh CI machine or pod is up for less than every_s."""
    import types

    from clarifier import cli

    monkeypatch.setattr(cli, "time", types.SimpleNamespace(monotonic=lambda: seconds))


def test_step_lines_are_thinned_when_not_on_a_terminal(capsys, monkeypatch):
    from clarifier.cli import _Lines

    _booted_seconds_ago(monkeypatch)
    say = _Lines(every_s=3600)
    say("[train] starting")
    for k in range(1, 101):
        say(f"[train] step {k}/200 loss 0.5 lr 1e-4 300 tok/s eta 10s")
    say("[train] done: 100 steps")
    for k in range(1, 4):
        say(f"[encoder] step {k * 10}: loss 0.3")
    say(f"[train] step 200/200 loss 0.1 lr 1e-4 300 tok/s eta 0s")  # the final step is always shown
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[train] starting", "[train] step 1/200 loss 0.5 lr 1e-4 300 tok/s eta 10s",
                     "[train] step 100/200 loss 0.5 lr 1e-4 300 tok/s eta 10s", "[train] done: 100 steps",
                     "[encoder] step 10: loss 0.3", "[train] step 200/200 loss 0.1 lr 1e-4 300 tok/s eta 0s"]


def test_eval_progress_lines_are_thinned_too_and_each_rows_last_one_stays(capsys, monkeypatch):
    from clarifier.cli import _Lines

    _booted_seconds_ago(monkeypatch)
    say = _Lines(every_s=3600)
    for name in ("model", "base_model"):
        for k in range(32, 129, 32):
            say(f"[eval] {name}: {k}/128")
    say("[eval] report written")
    for k in (64, 128, 130):  # the decision head's feature passes: "[head] <part>: k/N (rate)"
        say(f"[head] train: {k}/130 (4.2 examples/s)")
    say("[head] kept C=0.001")
    assert capsys.readouterr().out.splitlines() == [
        "[eval] model: 32/128", "[eval] model: 128/128", "[eval] base_model: 128/128", "[eval] report written",
        "[head] train: 130/130 (4.2 examples/s)", "[head] kept C=0.001"]


def test_the_live_step_line_leaves_the_streams_in_the_log_file(monkeypatch):
    """While the live line runs, what Ray prints for its workers (to sys.stdout) and warnings or
    progress bars (sys.stderr) stay in the run's log file instead of reaching the terminal."""
    import io
    import sys

    from rich.console import Console

    from clarifier import cli

    terminal, log = io.StringIO(), io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=terminal, force_terminal=True, width=120))
    monkeypatch.setattr(sys, "stdout", log)
    monkeypatch.setattr(sys, "stderr", log)
    say = cli._Lines()
    say.streams_to_log = True
    say("[train] step 1/10 loss 0.5")
    print("(RayTrainWorker pid=1) Checkpoint successfully created")
    print("FutureWarning: deprecated", file=sys.stderr)
    say("[train] step 10/10 loss 0.1")
    assert sys.stdout is log and sys.stderr is log
    assert "RayTrainWorker" in log.getvalue() and "FutureWarning" in log.getvalue()
    assert "RayTrainWorker" not in terminal.getvalue() and "FutureWarning" not in terminal.getvalue()
    assert "step 10/10 loss 0.1" in terminal.getvalue()
