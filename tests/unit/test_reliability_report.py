"""benchmarks/reliability/report.py renders whatever records the fault tests appended."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report():
    spec = importlib.util.spec_from_file_location("reliability_report", ROOT / "benchmarks" / "reliability" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_records_become_a_markdown_table(tmp_path):
    report = _report()
    recs = [{"fault": "a | b", "injected": "x", "at_risk": "3 steps", "lost": "0 steps", "recovered": "3 steps",
             "time_to_recover_s": 2.345, "test": "tests/integration/test_x.py::test_y[p1]", "at": "t"},
            {"fault": "c", "injected": "y", "at_risk": "1 row", "lost": "", "recovered": "1 row",
             "time_to_recover_s": None, "test": "tests/integration/test_z.py::test_w", "at": "t"}]
    log = tmp_path / "r.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs) + "\n")
    assert report.read_records(log) == recs and report.read_records(tmp_path / "none.jsonl") == []
    lines = report.markdown_table(recs).splitlines()
    assert lines[0] == "| fault | injected | at risk | lost | recovered | time to recover | test |"
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[2] == "| a \\| b | x | 3 steps | 0 steps | 3 steps | 2.3 s | `tests/integration/test_x.py::test_y` |"
    assert lines[3] == "| c | y | 1 row | - | 1 row | - | `tests/integration/test_z.py::test_w` |"
