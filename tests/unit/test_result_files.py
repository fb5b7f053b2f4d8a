"""A benchmark's result file is never overwritten: every writer refuses an existing file at once, in one line
naming it and a new name to pass (benchmarks/common.py, the recipe benchmark's writer and its command)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clarifier.recipes.tables import ResultExists, output_paths, refuse_existing, suggest_new_name, write_outputs

ROOT = Path(__file__).resolve().parents[2]


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_new_name_is_the_next_version_or_the_date(tmp_path):
    for name in ("recipe-joint-public-v1.json", "recipe-joint-public-v3.json", "recipe-joint-public-v3.md", "data.json"):
        (tmp_path / name).write_text("{}")
    assert suggest_new_name(tmp_path / "recipe-joint-public-v3.json").name == "recipe-joint-public-v4.json"
    assert suggest_new_name(tmp_path / "recipe-joint-public-v3").name == "recipe-joint-public-v4"
    assert suggest_new_name(tmp_path / "recipe-joint-public.json").name == "recipe-joint-public-v4.json"  # siblings
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    assert suggest_new_name(tmp_path / "data.json").name == f"data-{day}.json"
    (tmp_path / f"data-{day}.json").write_text("{}")
    assert suggest_new_name(tmp_path / "data.json").name == f"data-{day}-2.json"
    assert suggest_new_name(tmp_path / "data-2026-11-30.json").name == f"data-{day}-2.json"  # a dated name: today's
    # a dotted version is part of the name, not a suffix
    assert output_paths(tmp_path / "recipe-x-loo-abgcoqa-v3.2")["json"].name == "recipe-x-loo-abgcoqa-v3.2.json"
    assert output_paths(tmp_path / "recipe-x-v4.json")["png"].name == "recipe-x-v4-learning-curve.png"


def test_write_result_refuses_an_existing_file_but_rewrites_its_own(tmp_path, capsys):
    common = _common()
    old = tmp_path / "audit.json"
    old.write_text('{"measured": "before"}')
    with pytest.raises(SystemExit, match=r"audit\.json exists and result files are never overwritten: pass a new "
                                         r"name, e\.g\. --out .*audit-\d{4}-\d\d-\d\d\.json$"):
        common.write_result("audit", {"x": 1}, old)
    assert json.loads(old.read_text()) == {"measured": "before"}
    new = tmp_path / "audit-new.json"
    assert common.result_file("audit", new) == new  # checked when the arguments are parsed
    common.write_result("audit", {"part": 1}, new)
    common.write_result("audit", {"part": 2}, new)  # a script that saves as it goes rewrites its own file
    assert json.loads(new.read_text())["part"] == 2


def test_recipe_benchmark_refuses_before_it_runs(tmp_path):
    from clarifier.cli import app
    from clarifier.recipes.benchmark import run_benchmark

    (tmp_path / "recipe-joint-public-v3.md").write_text("# v3\n")
    with pytest.raises(ResultExists, match=r"recipe-joint-public-v3\.md exists .* --out .*recipe-joint-public-v4\.md"):
        refuse_existing(output_paths(tmp_path / "recipe-joint-public-v3").values())
    with pytest.raises(ResultExists):
        write_outputs({"rows": {}}, tmp_path / "recipe-joint-public-v3")
    with pytest.raises(ResultExists):  # before the work folder, MLflow or Ray
        run_benchmark("joint-public", out=tmp_path / "recipe-joint-public-v3", workdir=tmp_path / "work")
    assert not (tmp_path / "work").exists()
    res = CliRunner().invoke(app, ["recipe", "benchmark", "joint-public", "--out", str(tmp_path / "recipe-joint-public-v3"),
                                   "--workdir", str(tmp_path / "work")])
    assert res.exit_code == 2 and "never overwritten" in res.output and "recipe-joint-public-v4" in res.output
    assert (tmp_path / "recipe-joint-public-v3.md").read_text() == "# v3\n"
