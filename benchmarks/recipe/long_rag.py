"""Output validity on long multi-turn RAG conversations (issue 19's goal: >= 99.5%). JSON out.

    .venv/bin/python benchmarks/recipe/long_rag.py                       # the built-in model
    .venv/bin/python benchmarks/recipe/long_rag.py --model DIR --out results/recipe-long-rag-mine.json

Synthetic RAG conversations (``clarifier.data.synthetic_rag``, every one long: ``long_history_share=1``; a seed the
recipe does not train on), every labelled turn with at least ``--min-history`` turns before it. The model answers
each turn twice through the engine that serves it (``ClarifierEngine.predict``, as ``clarifier eval`` does):
at its own threshold (what a user gets: decision, and grounding + question where it asks), and with every turn
forced to ask (threshold 0), so that the target grammar is exercised on every long prompt, not only on those the
model chose. Counted: outputs that do not parse (``valid``), and questions that leak the target's syntax or the
prompt's role names (``||``, ``grounding:``, ``decision:``, "the user", "the assistant", "the system") -- a
question is plain text about the conversation's content. Decision quality on these turns is reported too, but the
turns come from the same generator family as the recipe's ``synthetic_rag`` source, so it is not a figure for
conversations the model has never seen (``benchmarks/recipe/probes.py`` and the public sets are).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import result_file, write_result  # noqa: E402

LEAKS = re.compile(r"\|\||grounding:|decision:|\bthe (user|assistant|system)\b|\bturn \d", re.IGNORECASE)


def long_turns(conversations: int, seed: int, min_history: int):
    from clarifier.core.schema import ConversationLog
    from clarifier.data.synthetic_rag import generate_conversations

    examples = [e for c in generate_conversations(conversations, seed=seed, long_history_share=1.0)
                for e in ConversationLog.model_validate(c).explode()]
    return [e for e in examples if len(e.history) >= min_history]


def outputs(examples, preds) -> dict:
    asked = [(e, p) for e, p in zip(examples, preds) if p.needs_clarification or not p.valid]
    invalid = [(e, p) for e, p in zip(examples, preds) if not p.valid]
    leaks = [(e, p) for e, p in asked if p.valid and p.question and LEAKS.search(p.question)]
    return {"asked": len(asked), "invalid": len(invalid),
            "validity_of_asked": round(1 - len(invalid) / len(asked), 4) if asked else None,
            "questions_leaking_syntax_or_roles": len(leaks),
            "invalid_samples": [{"id": e.id, "history_turns": len(e.history)} for e, _ in invalid[:10]],
            "leak_samples": [{"id": e.id, "question": p.question} for e, p in leaks[:10]],
            "question_samples": [{"id": e.id, "query": e.query, "question": p.question,
                                  "grounding_turns": list(p.grounding_turns)} for e, p in asked[:8]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:clarifier-smollm2-135m")
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=11, help="generator seed (the recipe's synthetic_rag source uses 0)")
    ap.add_argument("--min-history", type=int, default=8)
    ap.add_argument("--out", default=None, help="result JSON (default results/recipe-long-rag.json)")
    args = ap.parse_args()
    result_file("recipe-long-rag", args.out)  # refused now, not after the run, when that file is already there

    from clarifier.core.config import ClarifierConfig
    from clarifier.core.metrics import evaluate_predictions
    from clarifier.engine.loading import load_engine

    examples = long_turns(args.conversations, args.seed, args.min_history)
    hist = [len(e.history) for e in examples]
    print(f"[long-rag] {len(examples)} turns with {args.min_history}+ history turns "
          f"(median {statistics.median(hist)}, max {max(hist)}); {sum(e.needs_clarification for e in examples)} "
          f"need a question", flush=True)
    engine = load_engine(args.model, max_new_tokens=ClarifierConfig().eval.max_new_tokens)  # as clarifier eval
    t0 = time.time()
    own = engine.predict(examples, progress=lambda i, n: print(f"[long-rag] own threshold {i}/{n}", flush=True)
                         if i % 64 == 0 or i == n else None)
    t_own = time.time() - t0
    forced = engine.predict(examples, threshold=0.0,
                            progress=lambda i, n: print(f"[long-rag] every turn asked {i}/{n}", flush=True)
                            if i % 64 == 0 or i == n else None)
    t_forced = time.time() - t0 - t_own
    m = evaluate_predictions(examples, own)
    out = {
        "model": args.model, "threshold": engine.threshold,
        "data": {"generator": "synthetic_rag", "conversations": args.conversations, "seed": args.seed,
                 "long_history_share": 1.0, "min_history": args.min_history, "turns": len(examples),
                 "need_a_question": sum(e.needs_clarification for e in examples),
                 "history_turns": {"median": statistics.median(hist), "min": min(hist), "max": max(hist)},
                 "passages_per_turn_median": statistics.median(len(e.passages) for e in examples)},
        "own_threshold": {**outputs(examples, own), "validity_all_outputs": m["validity"], "auroc": m["auroc"],
                          "precision": m["decision"]["precision"], "recall": m["decision"]["recall"],
                          "over_asking": m["decision"]["over_asking_rate"], "seconds": round(t_own, 1)},
        "every_turn_asked": {**outputs(examples, forced), "seconds": round(t_forced, 1)},
    }
    path = write_result("recipe-long-rag", out, args.out)
    o, f = out["own_threshold"], out["every_turn_asked"]
    print(f"[long-rag] own threshold {engine.threshold:.3f}: asked {o['asked']}, invalid {o['invalid']}, "
          f"leaking {o['questions_leaking_syntax_or_roles']}; AUROC {o['auroc']:.3f}, over-asking {o['over_asking']:.3f}")
    print(f"[long-rag] every turn asked: {f['asked']} outputs, invalid {f['invalid']} "
          f"(validity {f['validity_of_asked']}), leaking {f['questions_leaking_syntax_or_roles']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
