"""Write an evaluation report: JSON metrics, per-example scores, a Markdown table and plots.

The input is one dict::

    {
      "models": {
        "<name>": {"metrics": <evaluate_predictions output>, "scores": [...], "gold": [...]},
        ...                       # baselines are models too; "scores"/"gold" are optional
      },
      "model_uri": ..., "data": ..., "n": ...   # any other top-level info, copied as is
    }

No Ray, no MLflow; matplotlib is imported only to draw, on the Agg canvas (no display needed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from clarifier.core.metrics import calibration_bins, threshold_sweep

# (header, path into the metrics dict)
COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("P", ("decision", "precision")),
    ("R", ("decision", "recall")),
    ("F1", ("decision", "f1")),
    ("Over-ask", ("decision", "over_asking_rate")),
    ("Under-ask", ("decision", "under_asking_rate")),
    ("AUROC", ("auroc",)),
    ("R@5%OA", ("recall_at_over_asking", "0.05")),
    ("R@10%OA", ("recall_at_over_asking", "0.1")),
    ("ROUGE-L", ("question", "rougeL_f")),
    ("SemSim", ("question", "semantic_similarity")),
    ("Ground EM", ("grounding", "exact_match")),
    ("Valid", ("validity",)),
]

PLOT_FILES = {
    "pr_curve": "pr_curve.png",
    "over_asking": "over_asking_vs_recall.png",
    "calibration": "calibration.png",
}


def metric_at(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def fmt_metric(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float)):
        if isinstance(v, float) and math.isnan(v):
            return "n/a"
        return f"{v:.3f}"
    return str(v)


def _models(report: dict) -> dict[str, dict]:
    models = report.get("models")
    if not isinstance(models, dict):
        raise ValueError("report needs a 'models' dict: {name: {'metrics': ..., 'scores': ..., 'gold': ...}}")
    return models


# Rows whose name alone would mislead: clarifier eval's zero-shot row decides at P(clarify) > 0.5,
# unlike the recipe benchmark's zero-shot rows, whose threshold is calibrated on dev.
ROW_LABELS = {"base_model": "base_model (zero-shot, threshold 0.5, uncalibrated)",
              "surface_control": "surface_control (position and length only)"}


def _rows(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["Model"] + [h for h, _ in COLUMNS]
    rows = []
    for name, entry in _models(report).items():
        metrics = (entry or {}).get("metrics") or {}
        rows.append([ROW_LABELS.get(str(name), str(name))] + [fmt_metric(metric_at(metrics, path)) for _, path in COLUMNS])
    return header, rows


def format_table(report: dict) -> str:
    """The per-model metrics table as aligned plain text (one row per model/baseline)."""
    return _aligned(*_rows(report))


def _aligned(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def _md(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def _markdown_table(report: dict) -> str:
    return _md(*_rows(report))


def source_breakdown(metrics: dict) -> dict[str, dict]:
    """Per source of one row's metrics (:func:`clarifier.core.metrics.evaluate_predictions`): n, clarify,
    asked, accuracy, over-asking (None without clear turns) and recall (None without turns needing a
    question) of the decisions as made, AUROC and recall at the over-asking budget inside the source."""
    ws, dec = metrics.get("within_source") or {}, metrics.get("decision_by_source") or {}
    out = {}
    for src, w in (ws.get("by_source") or {}).items():
        d = dec.get(src) or {}
        out[src] = {"n": w["n"], "clarify": w["clarify"], "asked": d["tp"] + d["fp"] if d else None,
                    "accuracy": d.get("accuracy"),
                    "over_asking": d.get("over_asking_rate") if w["n"] > w["clarify"] else None,
                    "recall": d.get("recall") if w["clarify"] else None,
                    "auroc": w.get("auroc"), "recall_at_budget": w.get("recall_at_budget")}
    return out


def source_rows(report: dict, model: str = "model") -> tuple[list[str], list[list[str]]] | None:
    """One row per source of the evaluation set for ``model`` (:func:`source_breakdown`): its decisions
    at the model's own threshold (asked, accuracy, over-asking, recall) and its ranking inside the source
    (AUROC, recall at the over-asking budget), then their means over the sources; None with one source."""
    metrics = (_models(report).get(model) or {}).get("metrics") or {}
    ws = metrics.get("within_source") or {}
    by = source_breakdown(metrics)
    if len(by) < 2:
        return None
    budget = f"R@{ws.get('budget', 0.1) * 100:g}%OA"
    header = ["Source", "n", "Clarify", "Asked", "Acc", "Over-ask", "Recall", "AUROC", budget]
    rows = [[src, str(r["n"]), str(r["clarify"]), "n/a" if r["asked"] is None else str(r["asked"])]
            + [fmt_metric(r[k]) for k in ("accuracy", "over_asking", "recall", "auroc", "recall_at_budget")]
            for src, r in by.items()]
    rows.append([f"mean of {len(ws.get('sources_scored') or [])} sources with both classes", "", "", "", "", "", "",
                 fmt_metric(ws.get("macro_auroc")), fmt_metric(ws.get("macro_recall_at_budget"))])
    return header, rows


def format_source_table(report: dict, model: str = "model") -> str:
    """:func:`source_rows` as aligned plain text ("" for a set with one source)."""
    rows = source_rows(report, model)
    return _aligned(*rows) if rows else ""


def _mistakes_markdown(report: dict) -> list[str]:
    wrong = report.get("mistakes")
    if not wrong:
        return []
    out = [f"## Wrong decisions (model; {len(wrong)} shown of {report.get('n_mistakes', len(wrong))})", "",
           "| id | source | query | gold | confidence | why the gold label |", "|---|---|---|---|---:|---|"]
    for m in wrong:
        cells = [m["id"], m["source"], m["query"], "clarify" if m["gold"] else "answer", f"{m['confidence']:.3f}",
                 m.get("why") or ""]
        out.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return out + [""]


def _skipped_line(report: dict) -> str:
    parts = []
    for name, entry in _models(report).items():
        g = metric_at((entry or {}).get("metrics") or {}, ("grounding",)) or {}
        parts.append(f"{name}: {g.get('skipped', 'n/a')} skipped of {_fmt_count(g)} true positives")
    return (
        "Grounding EM is scored on true positives with annotated gold grounding turns; rows "
        "without gold grounding are skipped (" + "; ".join(parts) + ")."
    )


def _fmt_count(g: dict) -> str:
    n, s = g.get("n"), g.get("skipped")
    return str(n + s) if isinstance(n, int) and isinstance(s, int) else "n/a"


def _default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def _dump(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, default=_default, sort_keys=False) + "\n")


def _scored(report: dict) -> dict[str, tuple[list[bool], list[float]]]:
    """Models that carry per-example gold and scores of equal, non-zero length."""
    out = {}
    for name, entry in _models(report).items():
        entry = entry or {}
        scores, gold = entry.get("scores"), entry.get("gold")
        if scores is None or gold is None or len(scores) == 0 or len(scores) != len(gold):
            continue
        out[str(name)] = ([bool(g) for g in gold], [float(s) for s in scores])
    return out


def _plot(report: dict, out_dir: Path) -> dict[str, Path]:
    scored = _scored(report)
    if not scored:
        return {}
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = _models(report)
    paths: dict[str, Path] = {}

    def new(title: str, xlabel: str, ylabel: str):
        fig = Figure(figsize=(6, 5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        return fig, ax

    def save(fig, ax, key: str) -> None:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        path = out_dir / PLOT_FILES[key]
        fig.savefig(path, format="png")
        paths[key] = path

    # Precision-recall and over-asking-vs-recall: one curve per model, the operating point marked.
    fig_pr, ax_pr = new("Precision-recall (clarify class)", "Recall", "Precision")
    fig_oa, ax_oa = new("Over-asking vs recall", "Recall", "Over-asking rate (clear turns asked)")
    for name, (gold, scores) in scored.items():
        if not any(gold):  # no gold clarify: recall is undefined, no curve to draw
            continue
        sweep = threshold_sweep(gold, scores)  # ascending threshold = descending recall
        rec = [r["recall"] for r in sweep]
        (line,) = ax_pr.plot(rec, [r["precision"] for r in sweep], marker=".", label=name)
        ax_oa.plot([0.0] + rec[::-1], [0.0] + [r["over_asking_rate"] for r in sweep][::-1], marker=".", label=name)
        dec = metric_at((models.get(name) or {}).get("metrics") or {}, ("decision",)) or {}
        if "recall" in dec and "precision" in dec:
            ax_pr.plot([dec["recall"]], [dec["precision"]], marker="o", markersize=9, color=line.get_color(),
                       markerfacecolor="none")
        if "recall" in dec and "over_asking_rate" in dec:
            ax_oa.plot([dec["recall"]], [dec["over_asking_rate"]], marker="o", markersize=9,
                       color=line.get_color(), markerfacecolor="none")
    save(fig_pr, ax_pr, "pr_curve")
    save(fig_oa, ax_oa, "over_asking")

    # Reliability diagram.
    fig_c, ax_c = new("Calibration (reliability)", "Mean predicted P(clarify)", "Observed clarify rate")
    ax_c.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect")
    for name, (gold, scores) in scored.items():
        try:
            bins = [b for b in calibration_bins(gold, scores) if b["count"]]
        except ValueError:  # scores that are not probabilities cannot be drawn here
            continue
        ece = metric_at((models.get(name) or {}).get("metrics") or {}, ("ece",))
        label = name if ece is None else f"{name} (ECE {fmt_metric(ece)})"
        ax_c.plot([b["mean_confidence"] for b in bins], [b["observed_rate"] for b in bins], marker="o", label=label)
    save(fig_c, ax_c, "calibration")
    return paths


def _markdown(report: dict, plots: dict[str, Path]) -> str:
    out = ["# Clarifier evaluation report", ""]
    out += _skill_markdown(report.get("skill"))
    info = {k: v for k, v in report.items() if k not in ("models", "mistakes", "skill")}
    for k, v in info.items():
        if isinstance(v, (dict, list)):
            v = json.dumps(v, default=_default)
        out.append(f"- **{k}**: {v}")
    if info:
        out.append("")
    out += [_markdown_table(report), "", _skipped_line(report), ""]
    if "skipped_lines" in report:
        out += [f"Malformed evaluation-set lines skipped: {report['skipped_lines']}"
                + (" (see `skipped` above for source, line and reason)." if report["skipped_lines"] else "."), ""]
    out.append(
        "P/R/F1 are for the *clarify* class; over-ask = share of clear turns the model asked about; "
        "under-ask = share of turns needing clarification it answered directly; R@5%OA / R@10%OA = the best "
        "recall of any threshold that asks about at most 5% / 10% of clear turns; ROUGE-L and SemSim "
        "(mean cosine similarity of all-MiniLM-L6-v2 embeddings of generated vs reference question) are "
        "on true positives; Valid = share of outputs that parsed. n/a = undefined."
    )
    by_source = source_rows(report)
    if by_source:
        out += ["", "## By source (model)", "",
                "Decisions at the model's threshold inside each source; AUROC and recall at the over-asking "
                "budget rank inside each source (figures a model cannot reach by telling sources apart).", "",
                _md(*by_source)]
    wrong = _mistakes_markdown(report)
    if wrong:
        out += [""] + wrong
    titles = {"pr_curve": "Precision-recall", "over_asking": "Over-asking vs recall", "calibration": "Calibration"}
    if plots:
        out.append("")
        for key, path in plots.items():
            out += [f"## {titles[key]}", "", f"![{titles[key]}]({path.name})", ""]
    return "\n".join(out).rstrip() + "\n"


def _skill_markdown(skill: dict | None) -> list[str]:
    """The headline: the model's AUROC minus the surface control's (position and length only), with its interval."""
    if not skill:
        return []
    rows = []
    for key, what in (("within_source", "mean within-source AUROC"), ("mixed", "AUROC on the whole set")):
        f = skill.get(key)
        if f:
            iv = f.get("interval")
            rows.append([what, fmt_metric(f.get("model_auroc")), fmt_metric(f.get("control_auroc")),
                         "n/a" if f.get("skill") is None else f"{f['skill']:+.3f}",
                         f"[{iv[0]:+.3f}, {iv[1]:+.3f}]" if iv else "n/a"])
    level = int(round(100 * skill.get("level", 0.95)))
    return ["## Skill over the surface control", "", f"**{skill['verdict']}.**", "",
            _md(["", "model", "surface control", "skill", f"{level}% paired bootstrap"], rows), "",
            "The surface control is a logistic regression on position and length only (turn index, history "
            "length in turns and characters, query and passage lengths, punctuation), fitted on the same training "
            "turns (row `surface_control` below says how): the model's skill is its margin over it.", ""]


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write the report into ``out_dir`` (created if needed) and return the written paths.

    * ``report.json`` (key ``json``): the report without per-example ``scores``/``gold``;
    * ``scores.json`` (key ``scores``): ``{model: {"gold": [...], "scores": [...]}}``;
    * ``report.md`` (key ``markdown``): top-level info, the metrics table, the skipped-grounding
      line and the plots;
    * PNG plots (keys ``pr_curve``, ``over_asking``, ``calibration``) when at least one model has
      per-example scores.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    models = _models(report)

    slim = {k: v for k, v in report.items() if k != "models"}
    slim_models: dict[str, Any] = {}
    per_example: dict[str, Any] = {}
    for name, entry in models.items():
        entry = dict(entry or {})
        kept = {k: entry.pop(k) for k in ("scores", "gold") if k in entry}
        slim_models[name] = entry
        if kept:
            per_example[name] = kept
    slim["models"] = slim_models

    paths = {"json": out / "report.json", "scores": out / "scores.json", "markdown": out / "report.md"}
    _dump(slim, paths["json"])
    _dump(per_example, paths["scores"])
    plots = _plot(report, out)
    paths["markdown"].write_text(_markdown(report, plots))
    paths.update(plots)
    return paths
