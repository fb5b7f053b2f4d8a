"""Error analysis: wrong decisions and generated questions, sampled and put in categories.

Categories (rule-based, so the same predictions always get the same ones; meant as a first sort
that a person then reads, the samples are in the report next to their category):

* decisions -- ``asks what is already clear`` (asked about a clear turn), ``missed ambiguity``
  (answered a turn that needed a question), ``format error`` (the turn needed a question and the
  model wanted to ask, but its output did not parse, so the service answered without one);
* generated questions on turns that needed one -- ``format error`` (no parsable question),
  ``too vague`` (fewer than two content words, or a generic "what do you mean?" with at most two
  that names nothing from the conversation), ``wrong aspect`` (specific, but far from the reference question:
  semantic similarity below the threshold, or, without an encoder, no content word in common),
  ``ok``.

Pure functions: no model, no I/O.
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from clarifier.data.labelling import STOPWORDS, content_words
from clarifier.core.schema import Example
from clarifier.core.metrics import Prediction

ASKS_CLEAR = "asks what is already clear"
MISSED = "missed ambiguity"
FORMAT = "format error"
VAGUE = "too vague"
WRONG_ASPECT = "wrong aspect"
OK = "ok"
DECISION_CATEGORIES = (ASKS_CLEAR, MISSED, FORMAT)
QUESTION_CATEGORIES = (FORMAT, VAGUE, WRONG_ASPECT, OK)

GENERIC_QUESTION = re.compile(
    r"\b(what do you mean|what exactly|can you (please )?(clarify|explain|elaborate|be more specific)|"
    r"could you (please )?(clarify|explain|elaborate|be more specific)|more (details|specific|information)|"
    r"which one)\b", re.IGNORECASE)
# Question words carry no content of their own.
_QUESTION_WORDS = frozenset({"what", "which", "who", "whom", "whose", "when", "where", "why", "how", "do", "does",
                             "did", "are", "is", "was", "were", "can", "could", "would", "should", "will", "you",
                             "your", "mean", "want", "like", "referring", "talking", "about", "asking", "clarify",
                             "explain", "elaborate", "specific", "details", "detail", "information", "more",
                             "exactly", "please", "tell"})
_STOP = STOPWORDS | _QUESTION_WORDS


def _words(text: str) -> set[str]:
    return content_words(text or "", 3, _STOP)


def decision_error(gold: bool, pred: Prediction) -> str | None:
    """The category of a wrong final decision, or None when it is right (as the decision metrics count it).

    A malformed generation is served as "no clarification": on a turn that needed one that is a
    ``format error`` (the model did want to ask), on a clear turn it is no error.
    """
    if gold and not pred.needs_clarification:
        return MISSED if pred.valid else FORMAT
    if not gold and pred.needs_clarification:
        return ASKS_CLEAR
    return None


def question_category(example: Example, pred: Prediction, similarity: float | None = None,
                      min_similarity: float = 0.5) -> str:
    """Category of the question generated for an example that needed clarification."""
    q = (pred.question or "").strip()
    if not pred.valid or not q:
        return FORMAT
    words = _words(q)
    context = _words(" ".join([example.query, *(t.text for t in example.history), *(p.text for p in example.passages)]))
    if len(words) < 2 or (GENERIC_QUESTION.search(q) and not words & context and len(words) < 3):
        return VAGUE
    if similarity is not None:
        return WRONG_ASPECT if similarity < min_similarity else OK
    ref = _words(example.clarifying_question or "")
    if ref and not words & ref:
        return WRONG_ASPECT
    return OK


def _sample(indices: list[int], n: int, seed: int) -> list[int]:
    if len(indices) <= n:
        return indices
    return sorted(random.Random(seed).sample(indices, n))


def analyse(examples: Sequence[Example], preds: Sequence[Prediction], *, n_decisions: int = 30, n_questions: int = 30,
            seed: int = 0, similarity_fn=None, min_similarity: float = 0.5) -> dict:
    """Counts per category over *all* errors, plus seeded samples of ``n_decisions`` wrong decisions
    and ``n_questions`` generated questions (on turns that needed one) with their categories."""
    if len(examples) != len(preds):
        raise ValueError(f"{len(examples)} examples but {len(preds)} predictions")
    wrong = [(i, decision_error(e.needs_clarification, p)) for i, (e, p) in enumerate(zip(examples, preds))]
    wrong = [(i, c) for i, c in wrong if c]
    dec_counts = {c: sum(1 for _, c2 in wrong if c2 == c) for c in DECISION_CATEGORIES}
    dec_sample = _sample([i for i, _ in wrong], n_decisions, seed)
    cat_of = dict(wrong)

    asked = [i for i, (e, p) in enumerate(zip(examples, preds)) if e.needs_clarification and (p.needs_clarification or not p.valid)]
    sims: dict[int, float] = {}
    with_q = [i for i in asked if (preds[i].question or "").strip() and examples[i].clarifying_question]
    if similarity_fn and with_q:
        vals = similarity_fn([examples[i].clarifying_question for i in with_q], [preds[i].question for i in with_q])
        sims = {i: float(v) for i, v in zip(with_q, vals)}
    q_cats = {i: question_category(examples[i], preds[i], sims.get(i), min_similarity) for i in asked}
    q_counts = {c: sum(1 for v in q_cats.values() if v == c) for c in QUESTION_CATEGORIES}
    q_sample = _sample(asked, n_questions, seed + 1)

    def row(i: int, category: str) -> dict:
        e, p = examples[i], preds[i]
        return {"id": e.id, "category": category, "query": e.query, "history_turns": len(e.history),
                "gold": e.needs_clarification, "pred": p.needs_clarification, "confidence": round(p.confidence, 4),
                "gold_question": e.clarifying_question, "question": p.question,
                **({"similarity": round(sims[i], 3)} if i in sims else {})}

    return {
        "n": len(examples),
        "decision_errors": len(wrong), "decision_categories": dec_counts,
        "decision_samples": [row(i, cat_of[i]) for i in dec_sample],
        "questions": len(asked), "question_categories": q_counts,
        "question_samples": [row(i, q_cats[i]) for i in q_sample],
    }
