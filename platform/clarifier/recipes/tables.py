"""The recipe benchmark's report: JSON as measured, Markdown tables for the README. Pure apart from writing."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

from clarifier.evaluation.report import fmt_metric as fmt
from clarifier.evaluation.report import metric_at as _get

# (header, path into one row's metrics)
MAIN_COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("F1", ("decision", "f1")),
    ("P", ("decision", "precision")),
    ("R", ("decision", "recall")),
    ("over-ask", ("decision", "over_asking_rate")),
    ("AUROC", ("auroc",)),
    ("R@5% OA", ("recall_at_over_asking", "0.05")),
    ("R@10% OA", ("recall_at_over_asking", "0.1")),
    ("ROUGE-L", ("question", "rougeL_f")),
    ("SemSim", ("question", "semantic_similarity")),
    ("valid", ("validity",)),
]
GROUNDING_COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("ground EM", ("grounding", "exact_match")),
    ("ground F1", ("grounding", "f1")),
]
# Rows that predict the decision only (no question, no grounding): their grounding columns read n/a.
# "tokens": a trained model with a decision head, deciding from its decision tokens instead; "probe": an untrained
# base model with a decision head.
DECISION_ONLY_KINDS = ("zero-shot", "encoder", "tokens", "probe")
TRAINED_KINDS = ("trained", "encoder", "tokens", "probe")  # rows fitted on the train split
SOURCE_COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("F1", ("decision", "f1")),
    ("over-ask", ("decision", "over_asking_rate")),
    ("AUROC", ("auroc",)),
    ("R@10% OA", ("recall_at_over_asking", "0.1")),
]


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in lines]


def main_table(result: dict) -> list[str]:
    gsrc = None
    lines = []
    for name, row in result["rows"].items():
        m = row["metrics"]
        gsrc = m.get("grounding_source")
        g = m.get(gsrc) if gsrc and row["kind"] not in DECISION_ONLY_KINDS else None
        thr = row.get("threshold")
        lines.append([f"{name}", row["kind"], *(fmt(_get(m["all"], p)) for _, p in MAIN_COLUMNS),
                      *(fmt(_get(g, p)) for _, p in GROUNDING_COLUMNS), fmt(thr)])
    header = ["row", "kind", *(h for h, _ in MAIN_COLUMNS), *(f"{h} ({gsrc})" for h, _ in GROUNDING_COLUMNS), "threshold"]
    return _table(header, lines)


def source_table(result: dict) -> list[str]:
    sources = list(result["eval_set"]["by_source"])
    header = ["row", *(f"{s} {h}" for s in sources for h, _ in SOURCE_COLUMNS[:1] + SOURCE_COLUMNS[2:3])]
    lines = []
    for name, row in result["rows"].items():
        m = row["metrics"]
        lines.append([name, *(fmt(_get(m.get(s), p)) for s in sources for _, p in SOURCE_COLUMNS[:1] + SOURCE_COLUMNS[2:3])])
    return _table(header, lines)


def loo_table(result: dict, compare: tuple[str, ...] = ("joint", "lexical")) -> list[str]:
    lines = []
    for src, r in result.get("leave_one_out", {}).items():
        lines.append([src, f"joint without {src}", *(fmt(_get(r["left_out"], p)) for _, p in SOURCE_COLUMNS)])
        for name, e in (r.get("encoders") or {}).items():
            lines.append([src, f"{name} without {src}", *(fmt(_get(e["left_out"], p)) for _, p in SOURCE_COLUMNS)])
        for name, m in r["in_distribution"].items():
            kind = result["rows"][name]["kind"]
            if name in compare or kind in DECISION_ONLY_KINDS:
                label = f"{name} (trained with {src})" if kind in TRAINED_KINDS else name
                lines.append([src, label, *(fmt(_get(m, p)) for _, p in SOURCE_COLUMNS)])
    return _table(["left out", "row", *(h for h, _ in SOURCE_COLUMNS)], lines)


# Published zero-shot ask-vs-answer on Abg-CoQA (CollabLLM, ICML 2025, Table 2): accuracy on
# ambiguous turns, accuracy on non-ambiguous turns, macro-F1 (x100).
PUBLISHED_ABGCOQA = {"GPT-4o (zero-shot, published)": (15.4, 95.6, 56.6),
                     "Llama-3.1-8B (zero-shot, published)": (16.3, 90.4, 53.3)}
ANCHOR_SOURCE = "abgcoqa"


def _within(m: dict | None, src: str) -> dict:
    """One source's within-source figures of a metrics dict (a row's ``all``, or a leave-one-out run)."""
    return (((m or {}).get("within_source") or {}).get("by_source") or {}).get(src) or {}


def backfill_within_source(result: dict) -> dict:
    """Reports written before ``within_source`` existed: derive it from the per-source metrics they
    have (AUROC, recall at 10% over-asking; F1 at the budget is not recoverable). In place."""
    from statistics import mean

    sources = list(result["eval_set"]["by_source"])
    for row in result["rows"].values():
        m = row["metrics"]
        if "within_source" in m["all"]:
            continue
        by = {s: {"auroc": (m.get(s) or {}).get("auroc"),
                  "recall_at_budget": ((m.get(s) or {}).get("recall_at_over_asking") or {}).get("0.1"),
                  "f1_at_budget": None} for s in sources}
        aur = [v["auroc"] for v in by.values() if v["auroc"] is not None]
        rec = [v["recall_at_budget"] for v in by.values() if v["recall_at_budget"] is not None]
        m["all"]["within_source"] = {"budget": 0.1, "by_source": by, "macro_auroc": mean(aur) if aur else None,
                                     "min_auroc": min(aur) if aur else None,
                                     "macro_recall_at_budget": mean(rec) if rec else None, "macro_f1_at_budget": None}
    for src, r in (result.get("leave_one_out") or {}).items():
        lo = r["left_out"]
        if "within_source" not in lo:
            lo["within_source"] = {"by_source": {src: {"auroc": lo.get("auroc"), "f1_at_budget": None,
                                                       "recall_at_budget": (lo.get("recall_at_over_asking") or {}).get("0.1")}}}
    return result


def within_source_table(result: dict) -> list[str]:
    """Headline 1: AUROC inside each source and their mean -- what telling sources apart cannot reach."""
    sources = list(result["eval_set"]["by_source"])
    lines = []
    for name, row in result["rows"].items():
        w = row["metrics"]["all"].get("within_source") or {}
        lines.append([name, row["kind"], fmt(w.get("macro_auroc")), fmt(w.get("min_auroc")),
                      *(fmt(_within(row["metrics"]["all"], s).get("auroc")) for s in sources)])
    return _table(["row", "kind", "mean AUROC", "min AUROC", *(f"{s}" for s in sources)], lines)


def budget_table(result: dict) -> list[str]:
    """Headline 2: recall / F1 at the over-asking budget, inside each source."""
    sources = list(result["eval_set"]["by_source"])
    lines = []
    for name, row in result["rows"].items():
        w = row["metrics"]["all"].get("within_source") or {}
        lines.append([name, fmt(w.get("macro_recall_at_budget")), fmt(w.get("macro_f1_at_budget")),
                      *(f"{fmt(_within(row['metrics']['all'], s).get('recall_at_budget'))} / "
                        f"{fmt(_within(row['metrics']['all'], s).get('f1_at_budget'))}" for s in sources)])
    return _table(["row", "mean R", "mean F1", *(f"{s} R / F1" for s in sources)], lines)


def loo_headline_table(result: dict) -> list[str]:
    """Headline 3: each source scored by models trained without it, beside the recipe trained with it."""
    lines = []
    for src, r in (result.get("leave_one_out") or {}).items():
        w = _within(r["left_out"], src)
        joint_in = _within((result["rows"].get("joint") or {}).get("metrics", {}).get("all"), src)
        enc = next(iter((r.get("encoders") or {}).values()), {}).get("left_out")
        we = _within(enc, src) if enc else {}
        lines.append([src, fmt(w.get("auroc")), fmt(w.get("recall_at_budget")), fmt(w.get("f1_at_budget")),
                      fmt(we.get("auroc")) if enc else "n/a", fmt(joint_in.get("auroc"))])
    return _table(["left out", "joint without it: AUROC", "R@10% OA", "F1@10% OA", "encoder without it: AUROC",
                   "joint trained with it: AUROC"], lines)


def _anchor_cells(d: dict | None) -> list[str]:
    if not d:
        return ["n/a"] * 3
    macro = d.get("macro_f1")
    if macro is None:  # reports written before decision_metrics had it
        tn, fn, fp = d["tn"], d["fn"], d["fp"]
        macro = (d["f1"] + (2 * tn / (2 * tn + fn + fp) if tn + fn + fp else 0.0)) / 2
    return [f"{100 * d['recall']:.1f}", f"{100 * (1 - d['over_asking_rate']):.1f}", f"{100 * macro:.1f}"]


def anchor_table(result: dict, src: str = ANCHOR_SOURCE) -> list[str]:
    """Ask-vs-answer on Abg-CoQA at each row's operating threshold, beside the published zero-shot figures."""
    if src not in result["eval_set"]["by_source"]:
        return []
    lines = [[name, *(f"{v:.1f}" for v in vals)] for name, vals in PUBLISHED_ABGCOQA.items()]
    loo = (result.get("leave_one_out") or {}).get(src)
    if loo:
        lines.append([f"joint trained without {src}", *_anchor_cells(loo["left_out"].get("decision"))])
        for name, e in (loo.get("encoders") or {}).items():
            lines.append([f"{name} trained without {src}", *_anchor_cells(e["left_out"].get("decision"))])
    for name, row in result["rows"].items():
        if row["kind"] in (*TRAINED_KINDS, "zero-shot", "control") or name == "lexical":
            label = f"{name} (trained with {src})" if row["kind"] in TRAINED_KINDS else name
            lines.append([label, *_anchor_cells((row["metrics"].get(src) or {}).get("decision"))])
    return _table(["row", "accuracy on ambiguous turns", "accuracy on clear turns", "macro-F1"], lines)


def learning_curve_table(result: dict) -> list[str]:
    """Within-source dev AUROC against optimizer steps, for every trained row that logged a curve."""
    lines = []
    for name, row in result["rows"].items():
        for pt in row.get("learning_curve") or []:
            per = {k.removeprefix("dev/auroc/"): v for k, v in pt.items() if k.startswith("dev/auroc/")}
            lines.append([name, str(pt["step"]), fmt(pt.get("dev/macro_auroc")), fmt(pt.get("dev/min_auroc")),
                          ", ".join(f"{s} {v:.2f}" for s, v in sorted(per.items()))])
    return _table(["row", "step", "dev mean AUROC", "dev min AUROC", "per source"], lines) if lines else []


def plot_learning_curves(result: dict, path: Path) -> Path | None:
    """The learning curves as a PNG (mean and per-source dev AUROC against steps); None without any."""
    curves = {n: r["learning_curve"] for n, r in result["rows"].items() if r.get("learning_curve")}
    if not curves:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, pts in curves.items():
        steps = [p["step"] for p in pts]
        (line,) = ax.plot(steps, [p.get("dev/macro_auroc") for p in pts], marker="o", linewidth=2, label=f"{name}: mean")
        for key in sorted({k for p in pts for k in p if k.startswith("dev/auroc/")}):
            ax.plot(steps, [p.get(key) for p in pts], linestyle=":", alpha=0.6, color=line.get_color(),
                    label=f"{name}: {key.removeprefix('dev/auroc/')}" if len(curves) == 1 else None)
    ax.axhline(0.5, color="grey", linewidth=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("dev AUROC inside each source")
    ax.set_ylim(0.3, 1.0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def encoder_table(result: dict) -> list[str]:
    """How each encoder row was trained and calibrated (and its leave-one-out runs, when there are any)."""
    lines = []
    runs = [(name, row) for name, row in result["rows"].items() if row["kind"] == "encoder"]
    for src, r in result.get("leave_one_out", {}).items():
        runs += [(f"{name} without {src}", e) for name, e in (r.get("encoders") or {}).items()]
    for name, row in runs:
        calib = row.get("calibration") or {}
        lines.append([name, str(row.get("base_model")), str(row.get("steps")), f"{(row.get('train_seconds') or 0) / 60:.1f}",
                      str(row.get("examples_seen")), str(row.get("precision")), fmt(row.get("loss_first")),
                      fmt(row.get("loss_last_tenth")), f"{fmt(row.get('threshold'))} ({calib.get('rule', '?')})"])
    if not lines:
        return []
    return _table(["encoder", "base", "steps", "train min", "examples seen", "precision", "loss (step 1)",
                   "loss (last tenth)", "threshold (rule)"], lines)


def _ci(iv) -> str:
    return "n/a" if not iv else f"[{iv[0]:.3f}, {iv[1]:.3f}]"


def uncertainty_table(result: dict) -> list[str]:
    u = result.get("uncertainty") or {}
    if not u.get("systems"):
        return []
    ref = u.get("reference")
    by_source = bool(u.get("stratified_by_source"))
    header = ["row", *(["mean within-source AUROC", "95% CI"] if by_source else []), "F1", "F1 95% CI", "AUROC",
              "AUROC 95% CI"]
    if ref:
        header += [*([f"within-source AUROC - {ref}"] if by_source else []), f"F1 - {ref}", f"AUROC - {ref}"]
    lines = []
    for name, iv in u["systems"].items():
        m = result["rows"][name]["metrics"]["all"]
        macro = [fmt(_get(m, ("within_source", "macro_auroc"))), _ci(iv.get("macro_auroc"))] if by_source else []
        line = [name, *macro, fmt(_get(m, ("decision", "f1"))), _ci(iv["f1"]), fmt(_get(m, ("auroc",))), _ci(iv["auroc"])]
        if ref:
            diffs = ["macro_auroc_diff"] if by_source else []
            line += (["(reference)"] * (len(diffs) + 2) if name == ref
                     else [_ci(iv.get(k)) for k in (*diffs, "f1_diff", "auroc_diff")])
        lines.append(line)
    return _table(header, lines)


def error_tables(result: dict) -> list[str]:
    from clarifier.evaluation.error_analysis import DECISION_CATEGORIES, QUESTION_CATEGORIES

    ea = result.get("error_analysis") or {}
    if not ea:
        return []
    out = _table(["source", "n", "wrong decisions", *DECISION_CATEGORIES, "questions", *QUESTION_CATEGORIES],
                 [[s, str(a["n"]), str(a["decision_errors"]), *(str(a["decision_categories"][c]) for c in DECISION_CATEGORIES),
                   str(a["questions"]), *(str(a["question_categories"][c]) for c in QUESTION_CATEGORIES)] for s, a in ea.items()])
    for s, a in ea.items():
        out += ["", f"<details><summary>{s}: {len(a['decision_samples'])} sampled wrong decisions, "
                    f"{len(a['question_samples'])} sampled questions</summary>", ""]
        out += _table(["category", "query", "gold", "P(clarify)", "reference question", "generated question"],
                      [[r["category"], _cell(r["query"]), "clarify" if r["gold"] else "answer", fmt(r["confidence"]),
                        _cell(r["gold_question"]), _cell(r["question"])] for r in a["decision_samples"] + a["question_samples"]])
        out += ["", "</details>"]
    return out


def _cell(text: Any, limit: int = 140) -> str:
    t = " ".join(str(text or "").split()).replace("|", "\\|")
    return t if len(t) <= limit else t[: limit - 1] + "…"


def machine() -> dict:
    info = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # pragma: no cover
        pass
    return info


def head_table(result: dict) -> list[str]:
    lines = []
    for name, row in result["rows"].items():
        h = row.get("decision_head")
        if not h:
            continue
        lines.append([name, row["kind"], ", ".join(map(str, h.get("layers") or [])), "+".join(h.get("pooling") or ["last"]),
                      fmt(h.get("c")), str(h.get("n_train")),
                      fmt(h.get("dev_macro_auroc")), fmt(h.get("dev_macro_auroc_token")), fmt(h.get("seconds"))])
    if not lines:
        return []
    return _table(["row", "kind", "layers", "pooling", "C", "train examples", "dev within-source AUROC (head)",
                   "dev within-source AUROC (decision tokens)", "fit seconds"], lines)


def headline(result: dict) -> list[str]:
    op = result.get("operating_point") or {}
    mix = result.get("train_mix") or {}
    out = ["## Headline: inside each source", "",
           "AUROC inside each source of the evaluation set and their mean; a model cannot reach these by telling "
           "datasets apart (the source-only control is 0.5 here by construction).", "", *within_source_table(result), ""]
    if mix.get("source_only_auroc") is not None:
        out += [f"Source-only control on the training mix (train.balance={mix.get('balance')}): AUROC "
                f"{fmt(mix['source_only_auroc'])} (the train split as it is: {fmt(mix.get('source_only_auroc_natural'))}).", ""]
    out += ["### At 10% over-asking", "",
            "Best recall (and its F1) asking about at most 10% of each source's clear turns, threshold-free (chosen on "
            "the scores themselves, like AUROC). The rows' own operating thresholds are chosen on dev by the product's "
            f"rule: {op.get('rule', 'n/a')}.", "", *budget_table(result), ""]
    if result.get("leave_one_out"):
        out += ["### Leave one dataset out", "", *loo_headline_table(result), ""]
    anchor = anchor_table(result)
    if anchor:
        out += [f"### Ask vs answer on {ANCHOR_SOURCE}, against published zero-shot LLMs", "",
                "Accuracy on ambiguous / clear turns and macro-F1 (x100) at each row's operating threshold, the "
                "figures CollabLLM (ICML 2025, Table 2) reports for GPT-4o and Llama-3.1-8B on Abg-CoQA; ours are on "
                "this evaluation set's Abg-CoQA sample (validation split), theirs on the test split.", "", *anchor, ""]
    return out


def skill_lines(result: dict) -> list[str]:
    """Each scored row's margin over the surface control (position and length only), first: its skill."""
    skill = result.get("skill_over_surface_control") or {}
    if not skill:
        return []
    rows = []
    for name, s in skill.items():
        f = s.get(s.get("headline", "within_source")) or {}
        iv = f.get("interval")
        rows.append(f"| {name} | {fmt(f.get('model_auroc'))} | {fmt(f.get('control_auroc'))} | "
                    f"{'n/a' if f.get('skill') is None else format(f['skill'], '+.3f')} | "
                    f"{f'[{iv[0]:+.3f}, {iv[1]:+.3f}]' if iv else 'n/a'} | {'yes' if s.get('beats_control') else '**no**'} |")
    return ["## Skill over the surface control", "",
            "Mean within-source AUROC of each row minus the surface control's (a logistic regression on position and "
            "length only, fitted on the train split), with the paired bootstrap interval: a row whose interval "
            "reaches 0 shows no skill beyond where turns sit and how long they are.", "",
            "| row | mean within-source AUROC | surface control | skill | 95% interval | beats it |",
            "|---|---:|---:|---:|---|---|", *rows, ""]


def markdown(result: dict) -> str:
    m = result.get("machine", {})
    plan = str(result.get("benchmark", "")).removeprefix("recipe-") or result["plan"]["recipe"]
    title = plan if plan == result["plan"]["recipe"] else f"{plan} (recipe {result['plan']['recipe']})"
    lines = [f"# Recipe benchmark: {title}", "",
             f"Measured {m.get('date', '?')} on {m.get('cpus', '?')} CPUs ({m.get('platform', '?')}, GPU: {m.get('gpu')}); "
             f"git {(result.get('code') or {}).get('git_commit')}; total {result.get('seconds_total', 0) / 60:.1f} min.", "",
             f"Evaluation set: {result['eval_set']['n']} examples of the recipe's {result['eval_set']['split']} split, at most "
             f"{result['eval_set']['per_source_cap']} per source"
             + (f", {result['eval_set']['clarify_share']:.0%} of them needing clarification where the split has enough"
                if result["eval_set"].get("clarify_share") else "") + ": "
             + ", ".join(f"{s} {v['n']} ({v['clarify']} clarify)" for s, v in result["eval_set"]["by_source"].items()) + ".",
             "", *headline(result), *skill_lines(result),
             "## Mixed evaluation set: all rows, all sources together", "",
             "These figures mix sources whose share of turns needing a question differs widely; the source-only "
             "control row shows how much of them knowing the source alone reaches.", "", *main_table(result), "",
             "Decision columns at each row's operating threshold (trained, zero-shot and encoder rows: chosen on the dev split by "
             "the same calibration rule; zero-shot scores are P(clarify) / (P(clarify) + P(answer))); AUROC and R@x% OA (best recall asking about at most x% of clear turns) are "
             "threshold-free; question columns on true positives; grounding on the "
             f"{result['plan'].get('grounding_source')} examples (gold grounding). Zero-shot, encoder, probe and tokens "
             "rows score the decision only.",
             ""]
    if head_table(result):
        lines += ["## Decision heads", "",
                  "Rows deciding from a decision head: a logistic regression on the hidden states of several layers at "
                  "the decision position, fitted after training on a class-balanced sample of the train split, its "
                  "strength chosen on dev by the mean within-source AUROC (clarifier.train.decision_head). `<row>_tokens` "
                  "is the same trained model deciding from its two decision-token logits; a `probe` row is the untrained "
                  "base model with a head.", "", *head_table(result), ""]
    if encoder_table(result):
        lines += ["## Encoder rows", "",
                  "Rows of kind `encoder`: a small encoder (e.g. all-MiniLM-L6-v2) with a linear head, fine-tuned on the "
                  "recipe's train split for the decision alone (clarifier.train.encoder_classifier; source- and "
                  "class-balanced draws), threshold chosen on the dev split by the same rule; no question, no grounding.",
                  "", *encoder_table(result), ""]
    if result.get("uncertainty"):
        u = result["uncertainty"]
        lines += ["## How sure: bootstrap intervals", "",
                  f"{u['level']:.0%} percentile intervals over {u['n_resamples']} resamples of the evaluation set, paired: "
                  "every resample scores all rows on the same examples, so a difference whose interval contains 0 "
                  "is not a measured difference"
                  + (" (each resample draws inside every source, keeping its size)." if u.get("stratified_by_source")
                     else "."), "", *uncertainty_table(result), ""]
    lines += ["## Per source (F1 / AUROC)", "", *source_table(result), ""]
    curve = learning_curve_table(result)
    if curve:
        lines += ["## Learning curve", "",
                  "Within-source AUROC on a fixed dev sample during training (train.learning_curve): whether more "
                  f"steps would still help. Plot: {result.get('learning_curve_plot', 'n/a')}.", "", *curve, ""]
    if result.get("leave_one_out"):
        lines += ["## Leave one dataset out", "",
                  "Each left-out source's evaluation examples, scored by the recipe trained without that source, "
                  "beside the rows that saw it in training (or need no training).", "", *loo_table(result), ""]
    if result.get("error_analysis"):
        lines += [f"## Error analysis ({result['plan']['error_analysis']['row']})", "",
                  "Rule-based categories (clarifier.evaluation.error_analysis) over all errors; samples below.", "",
                  *error_tables(result), ""]
    lines += ["## Stages", "", *_table(["stage", "seconds"], [[k, fmt(v)] for k, v in result.get("stages_seconds", {}).items()]), ""]
    return "\n".join(lines)


# ---- result files are never overwritten ------------------------------------------------------


class ResultExists(FileExistsError):
    """A result file that is already there: a new run gets a new name, an earlier run's file stays as measured."""


def suggest_new_name(path: str | Path) -> Path:
    """A free name beside ``path`` for a new run: the next ``-vN`` where the name (or a sibling) is versioned
    (``recipe-joint-public-v3.json`` -> ``-v4``), else today's date (``data.json`` -> ``data-2026-12-07.json``)."""
    path = Path(path)
    suffix = path.suffix if path.suffix in (".json", ".md", ".png") else ""
    stem = path.name[: len(path.name) - len(suffix)] if suffix else path.name
    m = re.fullmatch(r"(.*)-v(\d+)", stem)
    base, n = (m.group(1), int(m.group(2))) if m else (stem, None)
    if n is None:
        seen = [int(x.group(1)) for q in path.parent.glob(f"{stem}-v*")
                if (x := re.fullmatch(re.escape(stem) + r"-v(\d+)(?:\.[a-z]+)?", q.name))]
        n = max(seen) if seen else None
    if n is not None:
        names = (f"{base}-v{k}{suffix}" for k in range(n + 1, n + 1000))
    else:
        day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
        stem = re.sub(r"-\d{4}-\d\d-\d\d(?:-\d+)?$", "", stem)  # data-2026-12-04-2.json -> data-<today>.json
        names = (f"{stem}-{day}{suffix}" if k == 1 else f"{stem}-{day}-{k}{suffix}" for k in range(1, 1000))
    return next(path.with_name(name) for name in names if not path.with_name(name).exists())


def refuse_existing(paths, option: str = "--out", written=()) -> None:
    """Raise ResultExists, one line naming the file and a new name to pass, when a result file is already there
    (``written``: files this process wrote itself, which it may write again as it goes)."""
    done = {Path(w).resolve() for w in written}

    def shown(p: Path) -> Path:  # relative to the working directory where it lies inside it
        try:
            return p.resolve().relative_to(Path.cwd().resolve()) if p.is_absolute() else p
        except ValueError:
            return p

    for path in map(Path, paths):
        if path.exists() and path.resolve() not in done:
            raise ResultExists(f"{shown(path)} exists and result files are never overwritten: pass a new name, "
                               f"e.g. {option} {shown(suggest_new_name(path))}")


def output_paths(out: str | Path) -> dict[str, Path]:
    """The recipe benchmark's files for ``out`` (a path without suffix; a ``.json`` or ``.md`` suffix is dropped,
    a dot in a version such as ``-v3.2`` is kept)."""
    out = Path(out)
    if out.suffix in (".json", ".md"):
        out = out.with_name(out.name[: -len(out.suffix)])
    return {"json": out.with_name(out.name + ".json"), "md": out.with_name(out.name + ".md"),
            "png": out.with_name(out.name + "-learning-curve.png")}


def write_outputs(result: dict, out: str | Path) -> dict[str, Path]:
    paths = output_paths(out)
    refuse_existing(paths.values())
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    result.setdefault("machine", machine())
    js, md = paths["json"], paths["md"]
    png = plot_learning_curves(result, paths["png"])
    if png:
        result["learning_curve_plot"] = png.name
    js.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md.write_text(markdown(result))
    return {"json": js, "md": md}
