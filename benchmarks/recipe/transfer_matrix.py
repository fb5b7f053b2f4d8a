"""Do the training sources agree on what needs a question? A transfer matrix. JSON out.

    .venv/bin/python benchmarks/recipe/transfer_matrix.py --data .clarifier/recipe-benchmark/joint-public/data

The cheapest "when to ask" model that reads the LM's states (the recipe's decision-head probe: the
untrained base, a logistic regression on its hidden states at the decision position, the same layers)
is fitted on one source's train turns and scored on every other source's train turns (within-source
AUROC: the other source's turns were never seen); the diagonal is 5-fold cross-validation inside the
source. Each source contributes a seeded, class-balanced sample of its train split (``--per-source``),
so no test turn is read. Rows near 0.5 off the diagonal say that what one dataset calls "needs a
question" does not predict the other's labels; rows below 0.5 say it predicts the opposite.

It also scores each source's turns by a few surface cues alone (``cues``: within-source AUROC with the
cue as the score, no model), which say what each dataset's labels follow: a short query, a pronoun or
deictic in it (the lexical rule's words), a first turn, and whether the assistant's previous turn was
*not* a question (after a clarifying question the user's reply is usually clear).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import result_file, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-job output with a train split (e.g. a recipe benchmark's data)")
    ap.add_argument("--base-model", default="smollm2-135m-instruct")
    ap.add_argument("--per-source", type=int, default=240, help="train turns per source (half need a question where possible)")
    ap.add_argument("--c", type=float, default=1e-3, help="inverse L2 strength of the logistic regression")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result_file("recipe-transfer-matrix", args.out)  # refused now, not after the run, when that file is already there

    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from clarifier.core.config import DecisionHeadConfig
    from clarifier.core.schema import sample_by_source, source_of
    from clarifier.data.outputs import load_split
    from clarifier.engine.decision_head import resolve_layers
    from clarifier.engine.inference import ClarifierEngine
    from clarifier.train.decision_head import hidden_features

    t0 = time.time()
    examples = sample_by_source(load_split(args.data, "train"), args.per_source, args.seed, clarify_share=0.5)
    engine = ClarifierEngine.from_base(args.base_model)
    layers = resolve_layers(DecisionHeadConfig().layers, engine.model.config.num_hidden_layers)
    print(f"[transfer] {len(examples)} train turns, {args.base_model} ({engine.precision}), layers {layers}", flush=True)
    _, x = hidden_features(engine, examples, layers, 8, "features", lambda m: print(m, flush=True))
    src = np.array([source_of(e) for e in examples])
    y = np.array([e.needs_clarification for e in examples])
    names = [n for n in sorted(set(src)) if len(set(y[src == n])) == 2]

    def head():
        return make_pipeline(StandardScaler(), LogisticRegression(C=args.c, max_iter=3000, class_weight="balanced"))

    matrix: dict[str, dict[str, float]] = {}
    for a in names:
        xa, ya = x[src == a], y[src == a]
        fitted = head().fit(xa, ya)
        row = {}
        for b in names:
            if a == b:
                scores = np.zeros(len(ya))
                for tr, te in StratifiedKFold(5, shuffle=True, random_state=args.seed).split(xa, ya):
                    scores[te] = head().fit(xa[tr], ya[tr]).predict_proba(xa[te])[:, 1]
                row[b] = round(float(roc_auc_score(ya, scores)), 4)
            else:
                row[b] = round(float(roc_auc_score(y[src == b], fitted.predict_proba(x[src == b])[:, 1])), 4)
        matrix[a] = row
    counts = {n: {"n": int((src == n).sum()), "clarify": int(y[src == n].sum())} for n in names}
    cues = surface_cues(examples, src, y, names)
    print("| trained on \\ scored on | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for a in names:
        print(f"| {a} | " + " | ".join(f"{matrix[a][b]:.2f}" for b in names) + " |")
    print("| cue (scored as 'needs a question') | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for cue, row in cues.items():
        print(f"| {cue} | " + " | ".join("n/a" if row[n] is None else f"{row[n]:.2f}" for n in names) + " |")
    path = write_result("recipe-transfer-matrix", {
        "data": args.data, "base_model": args.base_model, "precision": engine.precision, "layers": layers,
        "per_source": args.per_source, "c": args.c, "seed": args.seed, "sources": counts,
        "matrix_auroc": matrix, "cues_auroc": cues, "seconds": round(time.time() - t0, 1)}, args.out)
    print(f"[transfer] wrote {path}")


def surface_cues(examples, src, y, names) -> dict[str, dict[str, float | None]]:
    """Within-source AUROC of each cue taken as the score (None where a source has one class or one value)."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    from clarifier.evaluation.baselines import PRONOUNS

    def prev_not_question(e):
        prev = next((t.text for t in reversed(e.history) if t.role == "assistant"), "")
        return 0.0 if prev.rstrip().endswith("?") else 1.0

    cues = {
        "shorter query (fewer words)": lambda e: -len(e.query.split()),
        "pronoun or deictic in the query": lambda e: float(bool(
            {w.strip("?.,!;:'\"").lower() for w in e.query.split()} & PRONOUNS)),
        "fewer earlier turns": lambda e: -len(e.history),
        "previous assistant turn not a question": prev_not_question,
    }
    out: dict[str, dict[str, float | None]] = {}
    for cue, fn in cues.items():
        score = np.array([fn(e) for e in examples], dtype=float)
        out[cue] = {}
        for n in names:
            m = src == n
            ok = len(set(y[m])) == 2 and len(set(score[m])) > 1
            out[cue][n] = round(float(roc_auc_score(y[m], score[m])), 4) if ok else None
    return out


if __name__ == "__main__":
    main()
