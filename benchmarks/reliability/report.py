"""Reliability report: run the fault-injection tests, collect what each recorded, render a table.

    .venv/bin/python benchmarks/reliability/report.py                       # every `reliability` test
    .venv/bin/python benchmarks/reliability/report.py -k tracking_outage    # a subset (pytest -k)
    .venv/bin/python benchmarks/reliability/report.py --markdown table.md -- -x   # after --: more pytest args

Runs ``pytest -m reliability`` with ``CLARIFIER_RELIABILITY_LOG`` naming a temporary file; each
marked test appends one JSON record there through the ``reliability`` fixture of
``tests/conftest.py`` (fault, injected, at_risk, lost, recovered, time_to_recover_s, test). Writes
``benchmarks/results/reliability.json`` (machine info, the pytest command and exit code, the
records) and prints a markdown table for the README ("Reliability and security"). Exits with
pytest's exit code (a failed fault test still leaves the records of the others).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import result_file, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("fault", "injected", "at risk", "lost", "recovered", "time to recover", "test")


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ").strip() or "-"


def _test_path(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    return f"`{path}::{name.split('[')[0]}`" if name else f"`{path}`"


def markdown_table(records: list[dict]) -> str:
    """One row per record, in the order the tests ran."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in records:
        t = r.get("time_to_recover_s")
        ttr = "-" if t is None else f"{float(t):.1f} s"
        cells = [r.get("fault"), r.get("injected"), r.get("at_risk"), r.get("lost"), r.get("recovered"), ttr,
                 _test_path(r.get("test", ""))]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            out.append(json.loads(line))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("-k", dest="keyword", help="pytest -k expression: run only the matching reliability tests")
    ap.add_argument("--markdown", type=Path, help="also write the markdown table to this file")
    ap.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/reliability.json)")
    ap.add_argument("pytest_args", nargs="*", help="further pytest arguments (after --)")
    a = ap.parse_args(argv)
    result_file("reliability", a.out)  # refused now, not after the run, when that file is already there

    with tempfile.TemporaryDirectory(prefix="clarifier-reliability-") as tmp:
        log = Path(tmp) / "records.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-m", "reliability", "-p", "no:cacheprovider", "-q", "-rfE",
               *(["-k", a.keyword] if a.keyword else []), *a.pytest_args]
        env = {**os.environ, "CLARIFIER_RELIABILITY_LOG": str(log), "MLFLOW_DISABLE_TELEMETRY": "true",
               "DO_NOT_TRACK": "true"}
        print("$ " + " ".join(cmd[1:]), flush=True)
        t0 = time.time()
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        seconds = time.time() - t0
        records = read_records(log)

    pytest_info = {"args": cmd[3:], "exit_code": rc, "seconds": round(seconds, 1)}
    path = write_result("reliability", {"pytest": pytest_info, "records": records}, a.out)
    table = markdown_table(records)
    print(f"\n{len(records)} reliability records from pytest (exit code {rc}, {seconds:.0f} s); wrote {path}\n")
    print(table)
    if a.markdown:
        a.markdown.parent.mkdir(parents=True, exist_ok=True)
        a.markdown.write_text(table, encoding="utf-8")
        print(f"wrote {a.markdown}")
    if not records:
        print("no test recorded anything: are the fault tests marked `reliability` and selected?", file=sys.stderr)
        return rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
