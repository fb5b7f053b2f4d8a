"""The test command's exit status is the session's, even when the interpreter's teardown crashes.

CI once printed "706 passed" and exited 139: the process died of SIGSEGV while Python finalized modules
with native threads still running (tests/conftest.py, "the session's exit status"). A module-level object
whose finalizer raises SIGSEGV reproduces that teardown crash in a small pytest run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

PROBE = '''
import os, signal


class _CrashAtTeardown:
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGSEGV):
        kill(pid, sig)


KEEP = _CrashAtTeardown()


def test_passes():
    assert True


def test_maybe_fails():
    assert os.environ.get("PROBE_FAIL") != "1"
'''


def _run(tmp_path: Path, *plugin: str, fail: bool = False) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PROBE_FAIL": "1" if fail else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
                           "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          capture_output=True, text=True, env=env, timeout=120)


def test_the_probe_does_crash_at_teardown_without_the_projects_conftest(tmp_path):
    res = _run(tmp_path)
    assert "2 passed" in res.stdout and res.returncode == -11, (res.returncode, res.stdout[-500:])


@pytest.mark.parametrize("fail, status, summary", [(False, 0, "2 passed"), (True, 1, "1 failed, 1 passed")])
def test_the_exit_status_is_the_sessions(tmp_path, fail, status, summary):
    res = _run(tmp_path, "-p", "conftest", fail=fail)
    assert summary in res.stdout and res.returncode == status, (res.returncode, res.stdout[-500:], res.stderr[-500:])
