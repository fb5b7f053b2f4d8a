"""The test tree itself: pytest's default (rootdir) import mode imports every test module by its
basename, so two test files with the same name in different folders break collection of the
whole suite ("import file mismatch"), which only shows when all folders are collected together."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test files sharing a basename (rename one): {clashes}"
