"""Behaviour probes: a model on the hand-written checks shipped as ``builtin:probes``, per capability. JSON + plot.

    .venv/bin/python benchmarks/recipe/probes.py                          # the built-in model
    .venv/bin/python benchmarks/recipe/probes.py --model DIR --name mine --compare v3=OTHER_DIR

``builtin:probes`` (``clarifier/evaluation/sets/probes.jsonl``) holds ~90 hand-written turns in domains and
phrasings that none of the training sources use, grouped by the capability they check (``meta.source``):
``standalone`` (no history, no passages: fully specified questions vs ones naming nothing), ``history_reference``
(a reference to earlier turns that name one or two candidates), ``rag_passages`` (retrieved passages on one or on
two readings of a vague query), ``clarification_reply`` (the user has just answered a clarifying question),
``ill_formed`` (misspelt or terse but clear vs fragments), ``small_talk`` (greetings, then a clear or a vague
question) and ``long_rag`` (8-12-turn conversations with passages).
Every case says in ``meta.why`` why its label holds. The same evaluation a user runs
(``clarifier eval --model M --data builtin:probes``) is run here for each model: decisions at the model's own
threshold per capability, AUROC inside each, and the wrong decisions.

Then the history-length sweep: each ``long_rag`` case is scored again with only its last k history turns shown
(k = 0, 2, 4, 6, 8; every case has at least 8), passages kept. A model whose P(clarify) climbs with k on clear and
ambiguous turns alike has learnt "long conversation -> ask", which over-asks on exactly the long conversations
real assistants have. Written to ``results/recipe-probes.json`` and ``results/recipe-probes-history.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, result_file, write_result  # noqa: E402

SWEEP_CAPABILITY = "probe:long_rag"
SWEEP_K = (0, 2, 4, 6, 8)  # every long_rag case has at least 8 history turns: each point averages the same cases


def capability_table(m: dict) -> dict:
    """Per capability (from one row's metrics): n, clarify, asked, accuracy, over-asking, recall at the row's
    threshold, AUROC inside (the eval report's by-source breakdown)."""
    from clarifier.evaluation.report import source_breakdown

    return {src: {k: v for k, v in r.items() if k != "recall_at_budget"} for src, r in source_breakdown(m).items()}


def history_sweep(model_uri: str, examples) -> dict:
    """Mean P(clarify) of clear and of ambiguous sweep cases with the last k history turns shown."""
    from clarifier.core.schema import source_of
    from clarifier.engine.loading import load_engine

    cases = [e for e in examples if source_of(e) == SWEEP_CAPABILITY]
    if any(len(e.history) < max(SWEEP_K) for e in cases):
        raise SystemExit(f"every {SWEEP_CAPABILITY} case needs at least {max(SWEEP_K)} history turns")
    engine = load_engine(model_uri)
    items, keys = [], []
    for e in cases:
        for k in SWEEP_K:
            items.append((e.history[len(e.history) - k:] if k else [], e.query, e.passages))
            keys.append((e.id, k, e.needs_clarification))
    scores = engine.score(items)
    per_case: dict[str, dict] = {}
    for (cid, k, gold), s in zip(keys, scores):
        per_case.setdefault(cid, {"gold": gold, "scores": {}})["scores"][str(k)] = round(float(s), 4)
    mean = {}
    for label, gold in (("clear", False), ("ambiguous", True)):
        mean[label] = {}
        for k in SWEEP_K:
            vals = [c["scores"][str(k)] for c in per_case.values() if c["gold"] == gold]  # every case has every k
            mean[label][str(k)] = {"n": len(vals), "mean_p_clarify": round(sum(vals) / len(vals), 4)}
    return {"k": list(SWEEP_K), "threshold": engine.threshold, "mean": mean, "cases": per_case}


def plot_sweep(sweeps: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, sw) in enumerate(sweeps.items()):
        color = f"C{i}"
        for label, style in (("ambiguous", "-"), ("clear", "--")):
            pts = sorted((int(k), v["mean_p_clarify"]) for k, v in sw["mean"][label].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=color,
                    label=f"{name}: {label} turns")
        ax.axhline(sw["threshold"], color=color, linewidth=0.8, alpha=0.6, linestyle=":")
    ax.set_xlabel("history turns shown (the last k; passages kept)")
    ax.set_ylabel("mean P(clarify)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Probes: P(clarify) vs history shown (dotted: threshold)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:clarifier-smollm2-135m")
    ap.add_argument("--name", default="shipped", help="the --model's name in the result and the plot")
    ap.add_argument("--compare", action="append", default=[], help="NAME=URI: another model, measured the same way")
    ap.add_argument("--data", default="builtin:probes")
    ap.add_argument("--out", default=None, help="result JSON (default results/recipe-probes.json)")
    args = ap.parse_args()
    result_file("recipe-probes", args.out)  # refused now, not after the run, when that file is already there
    plot = Path(args.out).with_name(Path(args.out).stem + "-history.png") if args.out else RESULTS / "recipe-probes-history.png"
    result_file("recipe-probes-history", plot, ".png")

    from clarifier.core.config import ClarifierConfig
    from clarifier.evaluation.evaluate import evaluate, load_eval_data

    models = {args.name: args.model}
    for item in args.compare:
        name, sep, uri = item.partition("=")
        if not sep:
            raise SystemExit(f"--compare {item!r}: expected NAME=URI")
        models[name] = uri
    ed = load_eval_data(args.data, report=print)
    cfg = ClarifierConfig()
    cfg.eval.baselines = []  # always-ask, never-ask and the lexical rule are always there; no zero-shot row
    out: dict = {"data": args.data, "data_fingerprint": ed.fingerprint, "n": len(ed.examples), "models": {}}
    sweeps = {}
    for name, uri in models.items():
        print(f"[probes] {name}: {uri}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            rep = evaluate(cfg, uri, args.data, out_dir=tmp, progress=print)
        metrics = rep["models"]["model"]["metrics"]
        sweeps[name] = history_sweep(uri, ed.examples)
        out["models"][name] = {
            "model_uri": uri, "threshold": rep["threshold"], "by_capability": capability_table(metrics),
            "overall": {"auroc": metrics["auroc"], "accuracy": metrics["decision"]["accuracy"],
                        "over_asking": metrics["decision"]["over_asking_rate"], "recall": metrics["decision"]["recall"],
                        "validity": metrics["validity"], "macro_auroc": metrics["within_source"]["macro_auroc"]},
            "mistakes": rep["mistakes"], "history_sweep": sweeps[name]}
        if name == args.name:
            out["baselines"] = {b: {"by_capability": capability_table(r["metrics"]), "auroc": r["metrics"]["auroc"],
                                    "accuracy": r["metrics"]["decision"]["accuracy"]}
                                for b, r in rep["models"].items() if b != "model"}
    plot_sweep(sweeps, plot)
    out["plot"] = plot.name
    path = write_result("recipe-probes", out, args.out)
    for name, m in out["models"].items():
        print(f"\n{name} ({m['model_uri']}, threshold {m['threshold']:.3f}): AUROC {m['overall']['auroc']:.3f}, "
              f"accuracy {m['overall']['accuracy']:.3f}")
        for src, r in m["by_capability"].items():
            auroc = "n/a" if r["auroc"] is None else f"{r['auroc']:.3f}"
            print(f"  {src:28s} n={r['n']:3d} clarify={r['clarify']:3d} asked={r['asked']:3d} "
                  f"acc={r['accuracy']:.3f} AUROC={auroc}")
        sw = m["history_sweep"]["mean"]
        print("  history sweep, mean P(clarify) clear / ambiguous by k: "
              + ", ".join(f"{k}: {sw['clear'].get(str(k), {}).get('mean_p_clarify', float('nan')):.2f}/"
                          f"{sw['ambiguous'].get(str(k), {}).get('mean_p_clarify', float('nan')):.2f}" for k in SWEEP_K))
    print(f"\nwrote {path} and {plot}")


if __name__ == "__main__":
    main()
