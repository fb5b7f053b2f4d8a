"""A command's own lines on the terminal, everything else in a log file.

Ray, Ray Data, Serve, DeepSpeed, transformers and MLflow write to the process's stdout and stderr
from Python, from C++ (Ray's core worker), from the Ray workers whose output the driver relays, and
from the child processes a command starts (raylet, ``mlflow server``, the S3 server).
:func:`redirect` points file descriptors 1 and 2, ``sys.stdout`` and ``sys.stderr`` at the log file,
so all of that lands there, and returns a handle on the real terminal: the CLI writes Clarifier's
own lines (and machine-readable output such as ``clarifier config`` or a submitted job's JSON line)
to it, and nothing else reaches it.

Only the ``clarifier`` executable does this (:func:`clarifier.cli.main`), never an import: tests and
library users keep their streams. ``-v/--verbose`` or ``CLARIFIER_VERBOSE=1`` turn it off, and so does
running as a Ray job's driver, whose output *is* the job's log.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

LOG_DIR_ENV = "CLARIFIER_LOG_DIR"
VERBOSE_ENV = "CLARIFIER_VERBOSE"
DEFAULT_LOG_DIR = Path(".clarifier") / "logs"


@dataclass
class RunLog:
    """Where this run's full log is (``None``: not redirected) and the terminal's streams."""

    path: Optional[Path]
    terminal_out: IO[str]
    terminal_err: IO[str]

    @property
    def redirected(self) -> bool:
        return self.path is not None


def should_redirect(argv: list[str], environ=os.environ) -> bool:
    if any(a in ("-v", "--verbose") for a in argv) or environ.get(VERBOSE_ENV, "").lower() in ("1", "true", "yes"):
        return False
    if environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # the driver of a Ray job: its output is the job log
        return False
    return not any(a in ("--help", "-h") for a in argv) and bool(argv)


def command_words(argv: list[str]) -> list[str]:
    """The subcommand (``["data", "prepare"]``): the leading words before the first option."""
    words: list[str] = []
    for a in argv:
        if a.startswith("-") and not words:  # root options (-v) come before the subcommand
            continue
        if a.startswith("-") or "=" in a or not a.replace("-", "").replace("_", "").isalnum():
            break
        words.append(a)
    return words[:2]


def log_path(command: list[str], environ=os.environ, now: Optional[_dt.datetime] = None) -> Path:
    """``.clarifier/logs/<command>-<UTC time>.log`` (``$CLARIFIER_LOG_DIR`` overrides the folder)."""
    words = command_words(command) or ["clarifier"]
    stamp = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    name = "-".join(words)
    base = Path(environ.get(LOG_DIR_ENV) or DEFAULT_LOG_DIR)
    path = base / f"{name}-{stamp}.log"
    k = 1
    while path.exists():  # two commands started in the same second
        k += 1
        path = base / f"{name}-{stamp}-{k}.log"
    return path


def redirect(path: Path) -> RunLog:
    """Point fds 1 and 2, ``sys.stdout`` and ``sys.stderr`` at ``path``; return the terminal's streams."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    term_out = os.fdopen(os.dup(1), "w", buffering=1, encoding=sys.stdout.encoding or "utf-8", errors="replace")
    term_err = os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding or "utf-8", errors="replace")
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    return RunLog(path=path, terminal_out=term_out, terminal_err=term_err)


def passthrough() -> RunLog:
    return RunLog(path=None, terminal_out=sys.stdout, terminal_err=sys.stderr)

