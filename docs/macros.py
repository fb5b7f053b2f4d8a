"""Figures and generated references for the docs site (an mkdocs-macros module) and the README card.

Every measured figure on the site is read from a result file when the site is built, so it is stated in one place:

* ``{{ fig("recipe-own-labels-pacific.json", "heads.adapt.100.auroc_mean") }}`` -- one number of
  ``benchmarks/results/<file>`` (``"card"`` for the shipped model's ``card.json``), by a dotted path (list items by
  index; a key holding a dot is written ``[0.1]``); ``digits``, ``pct=True`` (as a percentage) and ``signed=True``
  format it. A path that is not in the file fails the build, naming the file and the path.
* ``{{ provenance("recipe-soup-dev.json") }}`` -- the date, commit, command and machine a result file records, with a
  link to the file (for pages under docs/results/, where ``files/`` links to benchmarks/results/).
* ``{{ cli_reference() }}``, ``{{ config_reference() }}``, ``{{ http_reference() }}``, ``{{ python_api() }}`` -- the
  references, generated from the Typer app, the pydantic config models, the FastAPI app's OpenAPI schema and
  ``clarifier.api``.
* ``readme_card()``, ``readme_quickstart()`` -- the README's card of what to expect from the shipped model and the
  lines of a recorded quickstart run; ``python docs/macros.py`` rewrites those blocks of README.md from the files,
  ``python docs/macros.py --check`` fails when they differ (``tests/unit/test_docs.py`` checks the same).

A page renders macros only when its front matter says ``render_macros: true``.
"""

from __future__ import annotations

import json
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CARD = ROOT / "platform" / "clarifier" / "builtin_models" / "clarifier-smollm2-135m" / "card.json"
README = ROOT / "README.md"
QUICKSTART = "quickstart-2026-12-06.json"  # the recorded quickstart run the README shows
BLOCKS = {  # README blocks generated from result files: name -> (begin marker, end marker)
    "quickstart": ("<!-- quickstart: generated from benchmarks/results by `python docs/macros.py`; do not edit -->",
                   "<!-- /quickstart -->"),
    "card": ("<!-- card: generated from card.json and benchmarks/results by `python docs/macros.py`; do not edit -->",
             "<!-- /card -->"),
}


class FigureError(LookupError):
    """A figure a page asks for is not in its result file."""


# ---- figures --------------------------------------------------------------------------------


def result_path(file: str) -> Path:
    return CARD if file == "card" else RESULTS / file


@lru_cache(maxsize=None)
def load(file: str) -> Any:
    path = result_path(file)
    if not path.is_file():
        raise FigureError(f"result file {path.relative_to(ROOT)} does not exist")
    return json.loads(path.read_text(encoding="utf-8"))


def _parts(path: str) -> list[str]:
    """``a.b[0.1].c`` -> ``["a", "b", "0.1", "c"]``."""
    out: list[str] = []
    for m in re.finditer(r"\[([^\]]*)\]|([^.\[\]]+)", path):
        out.append(m.group(1) if m.group(1) is not None else m.group(2))
    return out


def value(file: str, path: str) -> Any:
    """The value at ``path`` in result file ``file``; FigureError names both when it is not there."""
    node = load(file)
    for i, part in enumerate(_parts(path)):
        where = ".".join(_parts(path)[:i]) or "the top level"
        if isinstance(node, list):
            try:
                node = node[int(part)]
                continue
            except (ValueError, IndexError):
                raise FigureError(f"{file}: no item {part!r} in the list at {where} (path {path!r})") from None
        if not isinstance(node, dict) or part not in node:
            keys = ", ".join(list(node)[:12]) if isinstance(node, dict) else type(node).__name__
            raise FigureError(f"{file}: no {part!r} under {where} (path {path!r}; there: {keys})")
        node = node[part]
    return node


def fmt(x: Any, digits: int = 3, pct: bool = False, signed: bool = False) -> str:
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return str(x)
    if isinstance(x, int) and not pct:
        return f"{x:+,}" if signed else f"{x:,}"
    if pct:
        x = 100 * x
    s = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return s + ("%" if pct else "")


def fig(file: str, path: str, digits: int = 3, pct: bool = False, signed: bool = False) -> str:
    """One figure of a result file, formatted."""
    return fmt(value(file, path), digits, pct, signed)


def auroc_range(files: list[str], path: str = "leave_one_out", digits: int = 2) -> str:
    """``lo-hi`` of several figures (e.g. the leave-one-out AUROC of each held-out source)."""
    xs = [float(value(f, p)) for f, p in _pairs(files, path)]
    return f"{min(xs):.{digits}f}-{max(xs):.{digits}f}"


def _pairs(files: list[str], path: str) -> list[tuple[str, str]]:
    return [tuple(f.split(":", 1)) if ":" in f else (f, path) for f in files]  # type: ignore[misc]


def provenance(file: str) -> str:
    """A small table of where a result file comes from: date, commit, command, machine."""
    d = load(file)
    machine = d.get("machine") or {}
    code = d.get("code")
    commit = code.get("git_commit") if isinstance(code, dict) else code
    rows = [("result file", f"[`benchmarks/results/{file}`](files/{file})")]  # docs/results/files -> benchmarks/results
    date = machine.get("date") or d.get("date") or d.get("measured")
    if date:
        rows.append(("date", str(date)[:10]))
    if commit:
        commit = str(commit)
        rows.append(("commit", f"`{commit[:12] if re.fullmatch(r'[0-9a-f]{40}', commit) else commit}`"))
    if d.get("command"):
        rows.append(("command", f"`{d['command']}`"))
    if machine:
        fam = machine.get("cpu_family")
        model = f" (family {fam} model {machine.get('cpu_model')})" if fam else ""
        isa = ", ".join(machine.get("cpu_bf16_isa") or []) or "no bf16 ISA"
        rows.append(("machine", f"{machine.get('cpus', '?')} CPUs, {machine.get('cpu_model_name') or 'CPU'}{model}, "
                                f"{isa}, GPU {machine.get('gpu') or 'none'}"))
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


# ---- the README card ------------------------------------------------------------------------

OWN_LABELS = "recipe-own-labels-pacific.json"
# The newest leave-one-dataset-out measurement of each public source: the recipe trained without it, scored on it.
LOO = {
    "abgcoqa": ("recipe-joint-public-loo-abgcoqa-v3.2.json", "leave_one_out.abgcoqa.left_out.auroc"),
    "clariq": ("recipe-joint-public-loo-clariq.json", "leave_one_out.clariq.left_out.auroc"),
    "claqua": ("recipe-joint-public-loo-pacific-claqua.json", "leave_one_out.claqua.left_out.auroc"),
    "pacific": (OWN_LABELS, "leave_one_out.auroc"),
}


def loo_aurocs() -> dict[str, float]:
    """Leave-one-dataset-out AUROC of each public source (``LOO``)."""
    return {src: float(value(f, path)) for src, (f, path) in LOO.items()}


def readme_card() -> str:
    """The README's one-table card of the shipped model, every figure from card.json and the results files."""
    ws = "metrics.within_source"
    by = value("card", f"{ws}.by_source")
    worst = min(by, key=lambda s: by[s]["auroc"])
    loo = loo_aurocs()
    own = value(OWN_LABELS, "heads.adapt")
    ks = [k for k in ("100", "400") if k in own]
    full = max(own, key=lambda k: own[k]["k"])
    own_txt = ", ".join(f"{fmt(own[k]['auroc_mean'], 2)} with {own[k]['k']:,} labelled turns" for k in ks)
    own_txt += f", {fmt(own[full]['auroc_mean'], 2)} with all {own[full]['k']:,}"
    rows = [
        ("mean within-source AUROC (each public training source's test turns ranked on their own)",
         fmt(value("card", f"{ws}.macro_auroc"), 3), f"min {fmt(by[worst]['auroc'], 3)} ({worst})"),
        ("recall at 10% over-asking (mean over sources)", fmt(value("card", f"{ws}.macro_recall_at_budget"), 3),
         f"F1 {fmt(value('card', f'{ws}.macro_f1_at_budget'), 3)}"),
        ("outputs that parse", fmt(value("card", "metrics.validity"), 3),
         f"{value('card', 'eval_set.n'):,} test turns"),
        ("AUROC on a source left out of training (expect chance on a new kind of conversation)",
         f"{min(loo.values()):.2f}-{max(loo.values()):.2f}", ", ".join(f"{s} {a:.2f}" for s, a in sorted(loo.items()))),
        (f"with your own labels: `clarifier adapt` on {value(OWN_LABELS, 'source')}, a source the model never saw",
         own_txt.split(",")[0].split(" ")[0] + "-" + fmt(own[full]["auroc_mean"], 2),
         own_txt + f" (from {fmt(value(OWN_LABELS, 'leave_one_out.auroc'), 2)} without)"),
    ]
    lines = [f"| `{value('card', 'uri')}` ({value('card', 'date')}) | AUROC / figure | detail |",
             "|---|---:|---|"]
    lines += [f"| {a} | **{b}** | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def readme_quickstart() -> str:
    """The lines a recorded quickstart run ended with, and what it was."""
    d = load(QUICKSTART)
    s, m = d["summary"], d["machine"]
    lines = ["```text", *value(QUICKSTART, "lines"), "```", "",
             f"(`benchmarks/results/{QUICKSTART}`: {m['cpus']}-core {m.get('cpu_model_name') or 'CPU'}, "
             f"{s['seconds'] / 60:.1f} min for the quickstart, {s['n_test']:,} test turns, "
             f"{s['train_steps']:,} LoRA steps in its 6 minutes; the step count, and with it the figures, vary "
             f"with the machine" + (f"; {d['note']}" if d.get("note") else "") + ".)"]
    return "\n".join(lines)


def readme_with_blocks(text: str) -> str:
    """README.md's text with every generated block rendered anew from its result files."""
    render = {"card": readme_card, "quickstart": readme_quickstart}
    for name, (begin, end) in BLOCKS.items():
        if begin not in text or end not in text:
            raise FigureError(f"README.md lacks the {name} block's markers ({begin!r} ... {end!r})")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{render[name]()}\n{end}{tail}"
    return text


# ---- generated references -------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_reference import cli_reference, config_reference, http_reference, python_api  # noqa: E402


def define_env(env) -> None:  # mkdocs-macros entry point
    for f in (fig, provenance, auroc_range, readme_card, readme_quickstart, cli_reference, config_reference, http_reference, python_api):
        env.macro(f)


if __name__ == "__main__":
    text = README.read_text(encoding="utf-8")
    new = readme_with_blocks(text)
    if "--check" in sys.argv:
        if new != text:
            sys.exit("README.md's generated blocks differ from their result files: run python docs/macros.py")
        print("README's generated blocks match their result files")
    else:
        README.write_text(new, encoding="utf-8")
        print("README's generated blocks written")
