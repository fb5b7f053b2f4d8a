"""The package's layers, kept by a test: each layer imports only the layers below it, no module
imports itself in a circle (imports inside functions count: they are still dependencies), and the
pure core loads without torch, Ray, MLflow or DeepSpeed.

    core < runtime < engine < data < train < evaluation < registry < serving < recipes < entry points

Entry points are the top-level modules (``cli``, ``quickstart``, ``client``, ``api``) and the
``integrations`` package (adapters for other frameworks over the client); they may use
each other (the cycle test still applies). Stage packages at one level never import each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


PKG = Path(__file__).resolve().parents[2] / "platform" / "clarifier"
LAYERS = ["core", "runtime", "engine", "data", "train", "evaluation", "registry", "serving", "recipes"]
ENTRY = len(LAYERS)  # top-level modules
ENTRY_PACKAGES = ["integrations"]  # entry points too: adapters for other frameworks, over the client


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every clarifier module ``path`` imports, at module level or inside functions."""
    mod = module_name(path)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")[: len(mod.split(".")) - node.level + (path.name == "__init__.py")]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "clarifier" or target.startswith("clarifier."):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    out.add(sub if _exists(sub) else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("clarifier."))
    out.discard(mod)
    return out


def _exists(mod: str) -> bool:
    rel = Path(*mod.split(".")[1:])
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def layer(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:
        return ENTRY + 1  # the package itself (clarifier/__init__): above everything
    if parts[1] in LAYERS and (len(parts) > 2 or (PKG / parts[1]).is_dir()):
        return LAYERS.index(parts[1])
    return ENTRY  # top-level modules and ENTRY_PACKAGES


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def test_every_package_is_a_known_layer():
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    known = set(LAYERS) | set(ENTRY_PACKAGES)
    assert packages == known, f"packages not in the layer list: {packages ^ known}"


def test_imports_only_go_down():
    upward = []
    for mod, deps in sorted(graph().items()):
        for dep in sorted(deps):
            same_package = mod.split(".")[:2] == dep.split(".")[:2]
            if not same_package and (layer(dep) > layer(mod) or layer(dep) == layer(mod) < ENTRY):
                upward.append(f"{mod} -> {dep}")
    assert not upward, "imports across layers that do not go down:\n  " + "\n  ".join(upward)


def test_no_import_cycles():
    g = graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_layer_check_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: an upward import hidden in a function is found."""
    pkg = tmp_path / "clarifier"
    for d in ("core", "engine"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from ..engine import b\n")
    (pkg / "engine" / "b.py").write_text("from clarifier.core import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    assert imports_of(pkg / "core" / "a.py") == {"clarifier.engine.b"}
    assert layer("clarifier.engine.b") > layer("clarifier.core.a")


def test_core_imports_no_framework():
    code = (
        "import sys, pkgutil, importlib, clarifier.core as c\n"
        "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('clarifier.core.' + m.name)\n"
        "print(' '.join(sorted(n for n in ('torch', 'ray', 'mlflow', 'deepspeed', 'transformers', 'peft') if n in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"clarifier.core imports {out.stdout.strip()} at import time"
