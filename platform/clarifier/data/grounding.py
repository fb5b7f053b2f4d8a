"""Silver grounding: which prior turns a clarifying question refers to, from sentence similarity.

Many sources (raw logs, ClariQ, CLAQUA) give a clarifying question but not the turns it is about.
The labeller embeds the question and every eligible prior turn with all-MiniLM-L6-v2
(:mod:`clarifier.engine.similarity`) and picks the turns that are both similar enough in absolute terms
and close to the best match:

    chosen = top ``max_turns`` of { i : sim_i >= min_similarity and sim_i >= max(sim) - margin }

Examples that already carry gold grounding keep it; the labeller still scores them so the job can
report how well silver agrees with gold (exact match, precision, recall, F1), which is how the
thresholds below were chosen on the synthetic logs (see README "Silver grounding").

The selection and agreement functions are pure; :class:`SilverGrounder` is the stateful Ray Data
actor (one encoder per actor) that the data job runs over its deduplicated examples.
"""

from __future__ import annotations

from typing import Sequence

import pyarrow as pa

from clarifier.core.schema import Example

# Columns the grounder adds to each row (the data job aggregates them into the manifest).
GROUNDING_COLUMNS = [
    ("grounding_source", pa.string()),  # "gold" | "silver" | "none" (silver found nothing) | "" (not applicable)
    ("agree_compared", pa.int64()),     # 1 when gold exists and silver was computed for comparison
    ("agree_exact", pa.int64()),
    ("agree_tp", pa.int64()),
    ("agree_pred", pa.int64()),
    ("agree_gold", pa.int64()),
]
AGREE_COLUMNS = [name for name, _ in GROUNDING_COLUMNS if name.startswith("agree_")]  # summed into the manifest


def select_turns(sims: Sequence[float], eligible: Sequence[bool], *, min_similarity: float, margin: float,
                 max_turns: int) -> list[int]:
    """Indexes of the chosen turns (ascending), given each turn's similarity to the question."""
    if len(sims) != len(eligible):
        raise ValueError(f"sims and eligible differ in length ({len(sims)} vs {len(eligible)})")
    cands = [(s, i) for i, (s, ok) in enumerate(zip(sims, eligible)) if ok and s >= min_similarity]
    if not cands or max_turns <= 0:
        return []
    best = max(s for s, _ in cands)
    close = sorted((c for c in cands if c[0] >= best - margin), key=lambda c: (-c[0], c[1]))[:max_turns]
    return sorted(i for _, i in close)


def agreement(pred: Sequence[int], gold: Sequence[int]) -> dict[str, int]:
    """Counts for micro precision/recall and exact match of one example."""
    p, g = set(pred), set(gold)
    return {"agree_exact": int(p == g), "agree_tp": len(p & g), "agree_pred": len(p), "agree_gold": len(g)}


def summarize_agreement(compared: int, exact: int, tp: int, pred: int, gold: int) -> dict[str, float | int]:
    """Micro-averaged agreement of silver with gold grounding."""
    precision = tp / pred if pred else 0.0
    recall = tp / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "examples_compared": compared,
        "exact_match": exact / compared if compared else 0.0,
        "precision": precision,
        "recall": recall,
        "f1": f1,
    }


def eligible_turns(ex: Example, roles: Sequence[str]) -> list[bool]:
    return [t.role in roles and bool(t.text.strip()) for t in ex.history]


class SilverGrounder:
    """``map_batches`` callable: fills empty grounding of clarify examples; scores gold ones too."""

    def __init__(self, encoder: str | None, min_similarity: float, margin: float, max_turns: int,
                 roles: Sequence[str], compare_with_gold: bool = True, cpus: float = 1):
        from clarifier.engine.precision import set_threads
        from clarifier.engine.similarity import SentenceEncoder

        set_threads(cpus)  # the actor's reserved CPUs, not a thread per core of the node
        self.encoder = SentenceEncoder(encoder)
        self.kw = {"min_similarity": min_similarity, "margin": margin, "max_turns": max_turns}
        self.roles = tuple(roles)
        self.compare = compare_with_gold

    def ground(self, examples: list[Example]) -> list[list[int] | None]:
        """Silver turns for each example (None where not applicable: clear turn, no question, no history)."""
        jobs = [(k, ex) for k, ex in enumerate(examples) if ex.needs_clarification and not ex.decision_only and ex.history]
        texts: list[str] = []
        for _, ex in jobs:
            texts.append(ex.clarifying_question or "")
            texts.extend(t.text for t in ex.history)
        emb = self.encoder.encode(texts) if texts else None
        out: list[list[int] | None] = [None] * len(examples)
        pos = 0
        for k, ex in jobs:
            q = emb[pos]
            turns = emb[pos + 1 : pos + 1 + len(ex.history)]
            pos += 1 + len(ex.history)
            sims = (turns @ q).tolist()
            out[k] = select_turns(sims, eligible_turns(ex, self.roles), **self.kw)
        return out

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        examples = [Example.model_validate_json(r["example_json"]) for r in rows]
        todo = [
            k for k, (r, ex) in enumerate(zip(rows, examples))
            if r.get("status", "ok") == "ok" and ex.needs_clarification and not ex.decision_only and ex.history
            and (not ex.grounding_turns or self.compare)
        ]
        silver = self.ground([examples[k] for k in todo])
        for r in rows:
            r.update(grounding_source="", agree_compared=0, agree_exact=0, agree_tp=0, agree_pred=0, agree_gold=0)
        for k, turns in zip(todo, silver):
            r, ex = rows[k], examples[k]
            if ex.grounding_turns:
                r["grounding_source"] = "gold"
                r.update(agree_compared=1, **agreement(turns or [], ex.grounding_turns))
            else:
                r["grounding_source"] = "silver" if turns else "none"
                if turns:
                    ex.grounding_turns = list(turns)
                    ex.meta = {**ex.meta, "grounding_source": "silver"}
                    r["example_json"] = ex.model_dump_json()
        schema = pa.schema(list(batch.schema) + [pa.field(n, t) for n, t in GROUNDING_COLUMNS
                                                  if n not in batch.schema.names])
        return pa.Table.from_pylist(rows, schema=schema)
