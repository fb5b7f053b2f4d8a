"""The audit's report: ``report.json`` (everything), ``report.md``, ``report.html`` (a self-contained page
with the plots inline), the plots as PNG files, and the compact summary printed at the end.

No Ray, no MLflow; matplotlib draws on the Agg canvas (no display needed).
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

PLOTS = {"histogram": "audit-score-histogram.png", "segments": "audit-by-segment.png",
         "position": "audit-by-position.png", "signal": "audit-by-signal.png"}


def _records(counts: dict) -> str:
    """What a read record is: a conversation, or one request of a serving request log (its history repeated; then
    the conversations they make up are counted too)."""
    if counts.get("request_log"):
        return f"request-log records of {counts.get('conversations', '?')} conversations"
    return "conversations"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def interval(ci) -> str:
    return "-" if not ci else f"{100 * ci[0]:.1f}-{100 * ci[1]:.1f}%"


def _best(e: dict) -> tuple:
    if e.get("corrected") is not None and e.get("corrected_ci"):
        return e["corrected"], e["corrected_ci"]
    return e.get("raw"), e.get("raw_ci")


def format_summary(s: dict) -> str:
    """The few lines printed at the end of ``clarifier audit``."""
    c, f, t = s["counts"], s["failed_needing_clarification"], s["flagged_share"]
    rates = s.get("error_rates")
    lines = [
        "",
        "== Audit: is a clarifier worth it for these logs?",
        f"  {c['turns']} user turns in {c['records']} {_records(c)} ({c['quarantined']} quarantined), "
        f"{c['failed_turns']} with a failure signal; model {s['model_uri']} at threshold {s['threshold']:.3f}"
        + _estimated_at(s),
        f"  flagged as needing clarification: {pct(t.get('raw'))} of all turns (raw, {interval(t.get('raw_ci'))})"
        + (f", corrected {pct(t.get('corrected'))} ({interval(t.get('corrected_ci'))})" if t.get("corrected") is not None else ""),
        f"  of failed turns: {pct(f.get('raw'))} raw ({interval(f.get('raw_ci'))})"
        + (f", corrected {pct(f.get('corrected'))} ({interval(f.get('corrected_ci'))})" if f.get("corrected") is not None else ""),
        "  error rates: " + (f"recall {rates['recall']:.3f}, false-positive rate {rates['false_positive_rate']:.3f} from "
                             f"{rates['source']}" if rates and rates.get("recall") is not None
                             and rates.get("false_positive_rate") is not None else "none (not corrected)"),
        f"  verdict: {s['verdict']['sentence']}",
    ]
    if s.get("skill_on_labelled_turns"):
        lines.append(f"  on the {s['skill_on_labelled_turns']['n']} labelled turns: "
                     f"{s['skill_on_labelled_turns']['verdict']}")
        if s["skill_on_labelled_turns"].get("retriever_scores"):
            lines.append(f"  on the same turns: {s['skill_on_labelled_turns']['retriever_scores']['verdict']}")
    lines += [f"  note: {n}" for n in s.get("notes", [])]
    if s.get("paths"):
        lines.append(f"  report: {s['paths'].get('html') or s['paths'].get('md')}")
    return "\n".join(lines)


def _rows_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["value", "turns", "flagged (raw)", "flagged (corrected)", "failed turns", "failed: needing clarification (raw)",
            "failed: needing clarification (corrected)"]
    body = []
    for r in rows:
        t, f = r["turns"], r["failed"]
        body.append([r["value"], str(t["n"]), f"{pct(t.get('raw'))} ({interval(t.get('raw_ci'))})",
                     f"{pct(t.get('corrected'))} ({interval(t.get('corrected_ci'))})" if t.get("corrected") is not None else "-",
                     str(f["n"]), f"{pct(f.get('raw'))} ({interval(f.get('raw_ci'))})" if f["n"] else "-",
                     f"{pct(f.get('corrected'))} ({interval(f.get('corrected_ci'))})" if f.get("corrected") is not None else "-"])
    return head, body


def _estimated_at(s: dict) -> str:
    e = s.get("estimation_threshold") or {}
    if e.get("value") is None:
        return ""
    how = (f"chosen on {e['chosen_on']} labelled turns (Youden's J {e['youden_j']:.2f})" if e.get("mode") == "youden"
           else "audit.threshold")
    return f"; shares estimated at {e['value']:.3f} ({how})"


def _md_table(head, body) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    return "\n".join(out)


def _title(dim: str) -> str:
    return {"position": "By user-turn position", "signal": "By failure signal (turns each signal fired on)",
            "answered": "Answered turns vs turns the log ends on", "passages": "With vs without retrieved passages"}.get(
        dim, f"By {dim.split(':', 1)[-1]}" if dim.startswith("segment:") else dim)


def _plots(s: dict, out: Path) -> dict[str, Path]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths: dict[str, Path] = {}
    rule = s["rule_share"]

    def save(fig, key):
        fig.tight_layout()
        p = out / PLOTS[key]
        fig.savefig(p, format="png")
        paths[key] = p

    bins = s["histogram"]["bins"]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = bins[0]["hi"] - bins[0]["lo"]
    tot_f, tot_o = sum(b["failed"] for b in bins) or 1, sum(b["ok"] for b in bins) or 1
    xs = [b["lo"] for b in bins]
    ax.bar(xs, [b["ok"] / tot_o for b in bins], width=width, align="edge", alpha=0.5, label=f"no failure signal ({tot_o})")
    ax.bar(xs, [b["failed"] / tot_f for b in bins], width=width, align="edge", alpha=0.5, label=f"failed ({tot_f})")
    ax.axvline(s["threshold"], color="black", linestyle="--", label=f"model threshold {s['threshold']:.2f}")
    est = (s.get("estimation_threshold") or {}).get("value")
    if est is not None:
        ax.axvline(est, color="tab:red", linestyle=":", label=f"estimated at {est:.2f}")
    ax.set_xlabel("P(clarify)")
    ax.set_ylabel("share of turns")
    ax.set_title("Score of failed vs other turns")
    ax.legend(fontsize="small")
    save(fig, "histogram")

    def bars(key, rows, title):
        rows = [r for r in rows if r["failed"]["n"]]
        if not rows:
            return
        fig = Figure(figsize=(7, max(2.5, 0.45 * len(rows) + 1.5)), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        vals, lo, hi = [], [], []
        for r in rows:
            v, ci = _best(r["failed"])
            v = v or 0.0
            ci = ci or [v, v]
            vals.append(v)
            lo.append(max(0.0, v - ci[0]))
            hi.append(max(0.0, ci[1] - v))
        ys = list(range(len(rows)))
        ax.barh(ys, vals, xerr=[lo, hi], capsize=3, alpha=0.7)
        ax.set_yticks(ys, [f"{r['value']} (n={r['failed']['n']})" for r in rows], fontsize="small")
        ax.axvline(rule, color="red", linestyle="--", label=f"rule {pct(rule)}")
        ax.set_xlim(0, 1)
        ax.invert_yaxis()
        ax.set_xlabel("share of failed turns needing clarification (with interval)")
        ax.set_title(title)
        ax.legend(fontsize="small")
        save(fig, key)

    segs = [r for k, v in s["breakdowns"].items() if k.startswith("segment:") for r in
            [{**x, "value": f"{k.split(':', 1)[1]}={x['value']}"} for x in v]]
    bars("segments", segs, "Failed turns needing clarification, by segment")
    bars("position", s["breakdowns"]["position"], "... by user-turn position")
    bars("signal", s["breakdowns"]["signal"], "... by failure signal")
    return paths


def _markdown(s: dict, plots: dict[str, Path]) -> str:
    c, v = s["counts"], s["verdict"]
    rates = s.get("error_rates")
    lines = [f"# Clarification audit of {s['logs']}", "", f"**Verdict: {v['decision'].replace('_', ' ')}.** {v['sentence']}", "",
             f"- {c['turns']} user turns in {c['records']} {_records(c)} from {c['files']} file(s); "
             f"{c['quarantined']} records quarantined (`quarantine/`), {c['failed_turns']} turns with a failure signal",
             f"- model `{s['model_uri']}` (version {s['model_version'] or '-'}, base {s['base_model']}), threshold "
             f"{s['threshold']:.3f}{_estimated_at(s)}, {s['precision']}",
             "- error rates for the correction: " + (
                 f"recall {rates['recall']:.3f}, false-positive rate {rates['false_positive_rate']:.3f} "
                 f"(tp {rates['tp']}, fn {rates['fn']}, tn {rates['tn']}, fp {rates['fp']}) from {rates['source']}"
                 if rates and rates.get("recall") is not None and rates.get("false_positive_rate") is not None
                 else "none: shares are raw flags"),
             "- failure signals present: " + ", ".join(f"{k} {n}" for k, n in s["signals_present"].items()),
             *([f"- on the {s['skill_on_labelled_turns']['n']} labelled turns: {s['skill_on_labelled_turns']['verdict']} "
                "(surface control: a logistic regression on position and length only, cross-fitted on those turns)"]
               if s.get("skill_on_labelled_turns") else []),
             *([f"- on the same turns: {s['skill_on_labelled_turns']['retriever_scores']['verdict']} (the retriever's "
                "scores as a profile: best, top-two gap, near-top count, spread, count; cross-fitted by conversation)"]
               if (s.get("skill_on_labelled_turns") or {}).get("retriever_scores") else []),
             f"- started {s['started']}, {s['seconds']:.0f} s", ""]
    for n in s.get("notes", []):
        lines.append(f"> note: {n}")
    if s.get("notes"):
        lines.append("")
    lines += ["## Headline", "", _md_table(*_rows_table([{"value": "all turns", "turns": s["flagged_share"],
                                                           "failed": s["failed_needing_clarification"]}])), ""]
    if "histogram" in plots:
        lines += [f"![score histogram]({plots['histogram'].name})", ""]
    for dim, rows in s["breakdowns"].items():
        if not rows:
            continue
        lines += [f"## {_title(dim)}", "", _md_table(*_rows_table(rows)), ""]
        key = "segments" if dim.startswith("segment:") else dim
        if key in plots and (key != "segments" or dim == next(k for k in s["breakdowns"] if k.startswith("segment:"))):
            lines += [f"![{key}]({plots[key].name})", ""]
    if s.get("sample"):
        lines += ["## Flagged turns and the questions the model would ask (a seeded sample)", "",
                  "| turn | P(clarify) | failed | query | question |", "|---|---|---|---|---|"]
        for r in s["sample"]:
            q = (r["question"] or ("(output did not parse)" if not r["valid"] else "-")).replace("|", "\\|")
            lines.append(f"| {r['id']} | {r['score']:.3f} | {'yes' if r['failed'] else 'no'} | "
                         f"{r['query'][:120].replace('|', chr(92) + '|')} | {q[:200]} |")
        lines.append("")
    lines += ["## How to read this", "",
              "A turn is *failed* when its answer carries a failure signal (negative feedback, a no-answer reply, an "
              "escalation, or the user restating the request next). *Flagged* = the model's P(clarify) is at or above "
              "the estimation threshold (the model's own unless `audit.threshold` chose one on half of the labelled "
              "turns: Youden's J, error rates from the other half). The corrected shares invert the model's recall and false-positive rate (Rogan-Gladen); "
              "intervals resample conversations and the error rates' own uncertainty. The rule: a dedicated "
              f"clarification model is worth it when more than {pct(s['rule_share'])} of failures needed clarification.",
              ""]
    return "\n".join(lines)


def _html(s: dict, plots: dict[str, Path]) -> str:
    def img(key):
        if key not in plots:
            return ""
        data = base64.b64encode(plots[key].read_bytes()).decode()
        return f'<img alt="{key}" src="data:image/png;base64,{data}">'

    def table(head, body):
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
        return f"<table><tr>{th}</tr>{trs}</table>"

    v, c = s["verdict"], s["counts"]
    cls = {"worth_it": "yes", "not_worth_it": "no"}.get(v["decision"], "maybe")
    parts = [f"<h1>Clarification audit</h1><p class='sub'>{html.escape(s['logs'])} &middot; model "
             f"{html.escape(s['model_uri'])} &middot; {html.escape(s['started'])}</p>",
             f"<div class='verdict {cls}'><b>{html.escape(v['decision'].replace('_', ' '))}</b>: {html.escape(v['sentence'])}</div>",
             f"<p>{c['turns']} user turns in {c['records']} {_records(c)}; {c['quarantined']} records quarantined; "
             f"{c['failed_turns']} turns with a failure signal.</p>"]
    parts += [f"<p class='note'>note: {html.escape(n)}</p>" for n in s.get("notes", [])]
    parts.append(table(*_rows_table([{"value": "all turns", "turns": s["flagged_share"],
                                      "failed": s["failed_needing_clarification"]}])))
    parts.append(img("histogram"))
    shown = set()
    for dim, rows in s["breakdowns"].items():
        if not rows:
            continue
        parts.append(f"<h2>{html.escape(_title(dim))}</h2>" + table(*_rows_table(rows)))
        key = "segments" if dim.startswith("segment:") else dim
        if key not in shown:
            parts.append(img(key))
            shown.add(key)
    if s.get("sample"):
        body = [[r["id"], f"{r['score']:.3f}", "yes" if r["failed"] else "no",
                 " / ".join(f"{t['role']}: {t['text'][:80]}" for t in r["history"]), r["query"][:200],
                 r["question"] or ("(did not parse)" if not r["valid"] else "-")] for r in s["sample"]]
        parts.append("<h2>Flagged turns and the questions the model would ask</h2>"
                     + table(["turn", "P(clarify)", "failed", "last turns", "query", "question"], body))
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;margin:1em 0;font-size:90%}td,th{border:1px solid #ccc;padding:4px 8px;"
             "text-align:left;vertical-align:top}.verdict{padding:1em;border-radius:6px;margin:1em 0}"
             ".yes{background:#e3f6e3}.no{background:#f6e3e3}.maybe{background:#f6f1e0}.sub,.note{color:#666}"
             "img{max-width:100%;display:block;margin:1em 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Clarification audit</title><style>{style}</style>"
            f"</head><body>{''.join(parts)}</body></html>")


def write_audit_report(summary: dict, out_dir: str | Path) -> dict[str, Path]:
    """Writes report.json / report.md / report.html and the plots into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(summary, out)
    paths = {"json": out / "report.json", "md": out / "report.md", "html": out / "report.html", **plots}
    paths["json"].write_text(json.dumps({k: v for k, v in summary.items() if k != "paths"}, indent=2, default=str))
    paths["md"].write_text(_markdown(summary, plots))
    paths["html"].write_text(_html(summary, plots))
    return paths
