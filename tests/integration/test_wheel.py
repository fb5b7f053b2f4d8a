"""The package works when installed as a wheel: recipes, plans, the quickstart config, the built-in evaluation
sets and the serving playground page are package data, and the model URI schemes are registered entry points (nothing is
found through the checkout)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_wheel_ships_package_data_and_entry_points(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT),
                    "-w", str(tmp_path)], check=True, timeout=280, capture_output=True)
    (wheel,) = tmp_path.glob("clarifier-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    shipped = {p.relative_to(ROOT / "platform").as_posix()
               for pattern in ("*.yaml", "*.html", "*.jsonl") for p in (ROOT / "platform" / "clarifier").rglob(pattern)}
    assert shipped and shipped <= names, f"data files missing from the wheel: {sorted(shipped - names)}"
    assert {"clarifier/quickstart.yaml", "clarifier/serving/playground.html", "clarifier/evaluation/sets/probes.jsonl"} <= shipped
    assert "[clarifier.model_uri_schemes]" in entry_points
    assert "models = clarifier.registry.registry:resolve_registry_uri" in entry_points
