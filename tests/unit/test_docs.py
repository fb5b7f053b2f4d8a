"""The README and the docs site stay true to the code: the site builds strictly (links and anchors checked), every
documented ``clarifier`` command parses against the real CLI with valid config keys, every repository path written in
backticks exists, the README stays short, and its card equals the result files it is generated from."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200
PAGES = [README, *sorted(DOCS.rglob("*.md"))]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(DOCS))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(DOCS))
    return mod


macros = _load("macros")
gen_reference = _load("gen_reference")

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)[^\n]*\n(.*?)^\1\2\s*$", re.M | re.S)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(3).lower(), m.group(4)) for m in FENCE.finditer(text)]


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a shell block: continuations joined, comments dropped, split at ``&&``, ``||``, ``;``, ``|``."""
    text = re.sub(r"\\\n", " ", block)
    out: list[list[str]] = []
    for line in text.splitlines():
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            tokens = list(lexer)
        except ValueError:
            continue  # not a complete shell line (e.g. a heredoc body)
        cmd: list[str] = []
        for tok in tokens + [";"]:
            if tok and set(tok) <= set(";&|"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    return out


def clarifier_invocations() -> list[tuple[str, list[str]]]:
    """(where, args) of every ``clarifier ...`` (or ``.venv/bin/clarifier ...``) in a fenced shell block."""
    found = []
    for page in PAGES:
        for lang, block in fenced_blocks(page.read_text(encoding="utf-8")):
            if lang not in ("bash", "sh", "shell", "console", "zsh"):
                continue
            for cmd in shell_commands(block):
                words = [w for w in cmd if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w)] if cmd else []
                while words and words[0] in ("$", "time", "nohup", "exec", "sudo"):
                    words = words[1:]
                if words and (words[0] == "clarifier" or words[0].endswith("/clarifier")):
                    found.append((f"{page.relative_to(ROOT)}: {' '.join(cmd)}", words[1:]))
    return found


INVOCATIONS = clarifier_invocations()


def check_invocation(args: list[str]) -> None:
    """Parse ``clarifier ARGS`` as the CLI would, without running it; overrides must build a valid config."""
    from clarifier.core.config import build_config, load_config

    cmd, name = gen_reference.command_tree(), "clarifier"
    args = list(args)
    while gen_reference.is_group(cmd) and args and not args[0].startswith("-"):
        subs = gen_reference.subcommands(cmd)
        assert args[0] in subs, f"no command {name} {args[0]!r} (known: {', '.join(subs)})"
        name, cmd = f"{name} {args[0]}", subs[args[0]]
        args = args[1:]
    if "--help" in args or gen_reference.is_group(cmd):
        return
    try:
        ctx = cmd.make_context(name, args)
    except Exception as exc:  # click's usage errors (its own copy inside Typer)
        raise AssertionError(f"{name}: {exc}") from None
    overrides = ctx.params.get("overrides") or []
    if overrides:
        config = ctx.params.get("config")
        path = ROOT / config if config is not None and (ROOT / config).is_file() else None
        load_config(path, overrides) if path else build_config({}, overrides)


def test_the_documentation_shows_clarifier_commands():
    assert len(INVOCATIONS) >= 30, INVOCATIONS  # the README's stage block alone has a dozen


@pytest.mark.parametrize("where,args", INVOCATIONS, ids=[w for w, _ in INVOCATIONS])
def test_every_documented_command_parses_against_the_cli(where, args):
    check_invocation(args)


def test_the_command_check_catches_what_it_is_for():
    for bad in (["train", "--no-such-option"], ["models", "promote-all"], ["train", "train.no_such_key=3"],
                ["train", "train.max_steps=many"], ["eval"]):
        with pytest.raises(Exception):
            check_invocation(bad)
    check_invocation(["train", "-c", "platform/clarifier/quickstart.yaml", "train.max_steps=20"])


PATH_PREFIXES = ("platform/", "jobs/", "serve/", "infra/", "tests/", "benchmarks/", "docs/", ".ci/")
PATH_FILES = ("pyproject.toml", "README.md", "mkdocs.yml")


def backticked_paths(text: str) -> list[str]:
    prose = FENCE.sub("", text)
    out = []
    for m in re.finditer(r"`([^`\n]+)`", prose):
        tok = m.group(1).strip()
        if " " in tok or not (tok.startswith(PATH_PREFIXES) or tok in PATH_FILES):
            continue
        tok = re.split(r"::|:(?=\d)|#", tok)[0].rstrip("/.,")
        out.append(tok)
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_repository_path_in_backticks_exists(page):
    missing = []
    for tok in backticked_paths(page.read_text(encoding="utf-8")):
        if any(c in tok for c in "<>{}"):
            continue  # a pattern, not a path (benchmarks/results/recipe-<plan>.json)
        if any(c in tok for c in "*?[") and list(ROOT.glob(tok)):
            continue
        if not (ROOT / tok).exists():
            missing.append(tok)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_readme_stays_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the budget is {README_MAX_LINES}: move detail into docs/"


def test_the_readme_card_and_quickstart_lines_equal_their_result_files():
    text = README.read_text(encoding="utf-8")
    assert macros.readme_with_blocks(text) == text, "README.md's generated blocks differ from card.json / " \
                                                    "benchmarks/results: run .venv/bin/python docs/macros.py"
    card = macros.readme_card()
    assert f"**{macros.fig('card', 'metrics.within_source.macro_auroc')}**" in card


def test_a_figure_that_is_not_in_its_file_fails_naming_file_and_path():
    assert macros.fig("card", "metrics.within_source.macro_auroc", 2) == \
        f"{macros.load('card')['metrics']['within_source']['macro_auroc']:.2f}"
    with pytest.raises(macros.FigureError, match=r"card.*no 'macro_aurok'.*metrics.within_source"):
        macros.fig("card", "metrics.within_source.macro_aurok")
    with pytest.raises(macros.FigureError, match="no-such.json does not exist"):
        macros.fig("no-such.json", "a")


def test_the_config_reference_lists_every_key():
    from clarifier.core.config import ClarifierConfig, flatten

    text = gen_reference.config_reference()
    keys = [k for k in flatten(ClarifierConfig()) if "." in k]
    missing = [k for k in keys if f"`{k}`" not in text and not any(f"`{k.rsplit('.', i)[0]}`" in text
                                                                     for i in range(1, k.count(".") + 1))]
    assert not missing, missing


def test_every_config_key_has_a_description():
    """The configuration reference says what each key does: a field's description, or its section's docstring."""
    missing = [f"{prefix}{name}" for prefix, model in gen_reference.config_sections()
               for name, field in model.model_fields.items() if not gen_reference.field_description(field)]
    assert not missing, f"config keys without a description (Field(description=...) in core/config.py): {missing}"


def test_the_site_builds_strictly(tmp_path):
    """Every page renders, every macro finds its figure, every internal link and anchor resolves."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "clarifier adapt" in cli and "--submit" in cli
