"""The request log back into labelled conversations: what happened after each answer is the label.

The serving request log (:mod:`clarifier.serving.request_log`) has one record per answered request: the
history so far, the query (turn ``meta.request_log.turn_index`` of its conversation) and, under the query
turn's ``meta.served``, what Clarifier answered. :func:`assemble` puts a conversation's records back
together: the turns of its longest request, each served user turn carrying its ``served`` meta. Then
:func:`label_served` labels each served user turn by the served decision and what followed it (the
RAG app's next assistant turn ``reply``, the user's next message ``next``), each label naming its rule
in the example's ``meta.labelling_rule`` (:data:`RULES`):

* ``served_question_answered`` -- Clarifier asked, the app showed the question (``reply`` is it) and the
  user answered (``next`` exists): **positive**, the target is the model's own question and grounding
  (``meta.silver_target: true``: a question the user answered, not a question a person wrote);
* ``missed_app_asked`` -- Clarifier stayed silent, but the app's ``reply`` is a clarifying question
  (the data.labelling rules) and the user answered it: **positive**, the target is the app's question
  (a missed clarification);
* ``missed_reformulated`` -- Clarifier stayed silent, the app answered and the user then restated the
  request (``next`` is a reformulation of the query): **positive**, a missed clarification. No question
  was asked, so there is none to learn: the example is ``decision_only`` (trained and scored on the
  decision alone, see ``core.schema.Example``);
* ``served_silent_continued`` -- Clarifier stayed silent, the app answered and the user went on with
  something else (``next`` is not a reformulation of the query): **negative**.

Turns that get no label are counted by reason (:data:`SKIP_REASONS`): ``no_follow_up`` (the conversation
ends there), ``question_not_shown``
(Clarifier asked, the app said something else), ``clarification_unanswered``, ``not_served`` (a user turn
no request of the log answered, e.g. from before logging began), ``text_mismatch`` (a request's query is
not the text at its turn index in the longest request: the client edited history).

A reformulation is lexical: the content words (:func:`clarifier.data.labelling.content_words`) of the
next user message and of the query overlap by at least ``min_overlap`` (Jaccard).

Pure functions: no Ray, no I/O.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from clarifier.core.config import LabellingConfig
from clarifier.core.request_record import META_KEY
from clarifier.core.schema import ConversationLog, Example, Turn
from clarifier.data.labelling import content_words, is_clarifying_question, question_text

RULES = {
    "served_question_answered": "Clarifier asked, the app showed the question and the user answered: positive "
                                "(silver target: the model's own question)",
    "missed_app_asked": "Clarifier stayed silent, the app asked a clarifying question the user answered: positive",
    "missed_reformulated": "Clarifier stayed silent and the user restated the request: positive (a miss), "
                           "decision only (no question to learn)",
    "served_silent_continued": "Clarifier stayed silent, the app answered and the user went on: negative",
}
SKIP_REASONS = {
    "no_follow_up": "the conversation ends after this turn (or after the app's reply): outcome unknown",
    "question_not_shown": "Clarifier asked, but the app's next turn is not that question",
    "clarification_unanswered": "a clarifying question was shown but the user did not reply",
    "not_served": "no request of the log answered this user turn",
    "text_mismatch": "a request's query differs from the text at its turn index in the conversation's longest request",
}


def _norm(text: str | None) -> str:
    return " ".join((text or "").lower().split())


def _turn_index(record: dict) -> int:
    meta = (record.get("meta") or {}).get(META_KEY) or {}
    return int(meta.get("turn_index", len(record.get("turns", [])) - 1))


def assemble(records: list[dict]) -> tuple[ConversationLog, Counter]:
    """One conversation from its request-log records (any order): the longest request's turns, each
    served user turn with its record's ``served`` meta and passages. The counter holds ``text_mismatch``."""
    if not records:
        raise ValueError("assemble: no records")
    ids = {r.get("conversation_id") for r in records}
    if len(ids) != 1:
        raise ValueError(f"assemble: records of several conversations {sorted(map(str, ids))[:3]}")
    skipped: Counter = Counter()
    ordered = sorted(records, key=lambda r: (_turn_index(r), ((r.get("meta") or {}).get(META_KEY) or {}).get("at", "")))
    longest = ordered[-1]
    offset = _turn_index(longest) - (len(longest["turns"]) - 1)  # > 0 when the history was omitted
    turns = [dict(t) for t in longest["turns"]]
    for rec in ordered:
        i = _turn_index(rec) - offset
        query = rec["turns"][-1]
        if not 0 <= i < len(turns) or _norm(turns[i].get("text")) != _norm(query.get("text")):
            skipped["text_mismatch"] += 1
            continue
        turns[i] = {**turns[i], "passages": query.get("passages", turns[i].get("passages")),
                    "meta": {**(turns[i].get("meta") or {}), **(query.get("meta") or {})}}
    log = ConversationLog.model_validate({"conversation_id": longest["conversation_id"], "turns": turns,
                                         "meta": {"source": "request_log", "request_log_offset": offset}})
    return log, skipped


def _next(turns, start: int, role: str) -> int | None:
    for j in range(start, len(turns)):
        if turns[j].role == role:
            return j
        if turns[j].role == "user" and role == "assistant":
            return None  # another user message before any reply
    return None


def is_reformulation(query: str, later: str, min_overlap: float) -> bool:
    a, b = content_words(query), content_words(later)
    if not a or not b:
        return False
    return len(a & b) / len(a | b) >= min_overlap


def label_served(log: ConversationLog, rules: LabellingConfig, min_overlap: float = 0.5) -> tuple[list[Example], Counter]:
    """Examples of the served user turns of an assembled conversation, and the skipped turns by reason."""
    examples: list[Example] = []
    skipped: Counter = Counter()
    turns = log.turns
    offset = int(log.meta.get("request_log_offset", 0))
    for i, turn in enumerate(turns):
        if turn.role != "user":
            continue
        served: dict[str, Any] | None = (turn.meta or {}).get("served")
        if not served:
            skipped["not_served"] += 1
            continue
        j = _next(turns, i + 1, "assistant")
        k = _next(turns, (j if j is not None else i) + 1, "user")
        if j is None:
            skipped["no_follow_up"] += 1
            continue
        reply = turns[j].text
        history = [Turn(role=t.role, text=t.text) for t in turns[:i]]
        meta = log.turn_meta(i)  # holds "served" (and "shadow") from the query turn
        meta.update({"label_source": "request_log", "turn_index": i + offset})
        passages = log.turn_passages(i)
        common = dict(id=f"{log.conversation_id}:{i + offset}", history=history, query=turn.text, passages=passages)
        if served.get("needs_clarification"):
            if _norm(served.get("question")) != _norm(reply) or not served.get("question"):
                skipped["question_not_shown"] += 1
                continue
            if k is None:
                skipped["clarification_unanswered"] += 1
                continue
            grounding = served.get("grounding") or {}
            ids = {p.id for p in passages}
            examples.append(Example(**common, needs_clarification=True, clarifying_question=served["question"],
                                    grounding_turns=[t for t in grounding.get("turns", []) if 0 <= t < len(history)],
                                    grounding_passages=[p for p in grounding.get("passages", []) if p in ids],
                                    meta={**meta, "labelling_rule": "served_question_answered", "silver_target": True}))
        elif is_clarifying_question(reply, rules):
            if k is None:
                skipped["clarification_unanswered"] += 1
                continue
            examples.append(Example(**common, needs_clarification=True, clarifying_question=question_text(reply, rules),
                                    meta={**meta, "labelling_rule": "missed_app_asked"}))
        elif k is None:
            skipped["no_follow_up"] += 1
        elif is_reformulation(turn.text, turns[k].text, min_overlap):
            examples.append(Example(**common, needs_clarification=True, decision_only=True,
                                    meta={**meta, "labelling_rule": "missed_reformulated"}))
        else:
            examples.append(Example(**common, needs_clarification=False,
                                    meta={**meta, "labelling_rule": "served_silent_continued"}))
    return examples, skipped
