"""Outcome signals: did the assistant's answer to a user turn fail? (``audit.signals``)

Each signal is optional and reported separately; a turn *failed* when any enabled signal fires:

* ``feedback`` -- explicit feedback on the answer is negative: a string in
  ``negative_values`` (thumbs down, ...), ``false``, or a rating at or below ``rating_at_most``.
  A value that is neither negative nor positive is counted as ``feedback_unknown``;
* ``no_answer`` -- the answer matches one of the ``no_answer`` patterns ("I couldn't find ...");
* ``escalation`` -- the log marks a hand-off (``escalated`` / ``handoff``) or the answer matches an
  ``escalation`` pattern ("let me transfer you to a human agent");
* ``reformulation`` -- the user's next message restates this one (MiniLM cosine similarity at or
  above ``min_similarity``); computed by :class:`ReformulationScorer` in the audit's actor pool.

:func:`text_signals` computes the first three from an :class:`~clarifier.data.chatlog.AuditTurn`
(pure Python, in the readers); the reformulation similarity needs the encoder.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from clarifier.core.config import AuditSignalsConfig, FeedbackSignalConfig

SIGNALS = ("feedback", "no_answer", "escalation", "reformulation")


def feedback_polarity(value: Any, cfg: FeedbackSignalConfig) -> bool | None:
    """True = negative (a failure), False = positive, None = not understood."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return float(value) <= cfg.rating_at_most
    if isinstance(value, str):
        s = value.strip().lower()
        if s in {v.lower() for v in cfg.negative_values}:
            return True
        if s in {v.lower() for v in cfg.positive_values}:
            return False
        try:
            return float(s) <= cfg.rating_at_most
        except ValueError:
            return None
    if isinstance(value, dict):
        for key in ("thumbs", "rating", "value", "score", "label", "feedback"):
            if key in value and value[key] is not None:
                return feedback_polarity(value[key], cfg)
    return None


@lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> list[re.Pattern]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p, re.IGNORECASE))
        except re.error as exc:
            raise ValueError(f"audit signal pattern {p!r} is not a valid regular expression: {exc}") from None
    return out


def matches(text: str | None, patterns: list[str]) -> bool:
    return bool(text) and any(p.search(text) for p in _compiled(tuple(patterns)))


def text_signals(turn, cfg: AuditSignalsConfig) -> dict[str, bool | None]:
    """``feedback`` (None: no feedback value on the answer), ``feedback_unknown``, ``no_answer``,
    ``escalation`` of one turn; disabled signals are None."""
    out: dict[str, bool | None] = {"feedback": None, "feedback_unknown": False, "no_answer": None, "escalation": None}
    if cfg.feedback.enabled and turn.feedback:
        pol = [feedback_polarity(v, cfg.feedback) for v in turn.feedback]
        known = [p for p in pol if p is not None]
        out["feedback"] = any(known) if known else None
        out["feedback_unknown"] = not known
    if cfg.no_answer.enabled:
        out["no_answer"] = matches(turn.answer, cfg.no_answer.patterns)
    if cfg.escalation.enabled:
        out["escalation"] = bool(turn.escalated) or matches(turn.answer, cfg.escalation.patterns)
    return out


class ReformulationScorer:
    """``reformulation_sim`` and ``reformulation`` of each row of an Arrow batch from its ``query`` and
    ``next_user`` columns (no next user turn: similarity NaN, reformulation False). Held by the audit's
    scorer actors beside the clarifier model."""

    def __init__(self, encoder: str | None, min_similarity: float, cpus: float = 1):
        from clarifier.engine.precision import set_threads
        from clarifier.engine.similarity import SentenceEncoder

        set_threads(cpus)
        self.encoder = SentenceEncoder(encoder, device="cpu")
        self.min_similarity = float(min_similarity)

    def __call__(self, batch):
        import numpy as np
        import pyarrow as pa

        queries = batch.column("query").to_pylist()
        nexts = batch.column("next_user").to_pylist()
        pos = [i for i, n in enumerate(nexts) if n]
        sims = np.full(len(queries), np.nan, dtype=np.float32)
        if pos:
            sims[pos] = self.encoder.similarity([queries[i] for i in pos], [nexts[i] for i in pos])
        reform = [bool(s >= self.min_similarity) if np.isfinite(s) else False for s in sims]
        batch = batch.append_column("reformulation_sim", pa.array(sims, pa.float32()))
        return batch.append_column("reformulation", pa.array(reform, pa.bool_()))
