"""Label raw (unlabelled) conversation logs by rules. Pure functions: no Ray, no I/O.

Production logs are conversations without labels. What the assistant did next tells us what the
user turn needed:

* a **positive** (needs clarification): user turn ``i`` is followed by an assistant turn that is a
  *clarifying question* (see below) **and** that question is followed by a user reply. The example
  is user turn ``i`` with history ``turns[:i]``; its target question is that assistant turn.
* a **negative** (answer directly): user turn ``i`` is followed by an assistant turn that is not a
  clarifying question (the assistant answered).
* **filtered** (outcome unknown), each with a reason code (:data:`FILTER_REASONS`):
  ``no_reply`` (the conversation ends after the user turn), ``next_turn_is_user`` (another user
  message follows before any assistant turn), ``clarification_unanswered`` (the assistant asked a
  clarifying question but no user reply follows it), ``empty_query`` / ``empty_reply``.

System turns are kept in the history but are skipped when looking for "the next turn".

**Clarifying question** (:func:`is_clarifying_question`, all configurable in
``data.labelling`` = :class:`clarifier.core.config.LabellingConfig`): a non-empty assistant turn of at
most ``max_question_chars`` characters that (if ``require_question_mark``) ends with ``?``, matches
none of ``exclude_patterns`` ("anything else?", "does that help?" -- answers that end with a
courtesy question) and at least one of ``patterns`` ("do you mean", "which one/of", "could you
clarify", "are you asking about", "do you want X or Y"...; an empty list accepts any turn ending
with ``?``). Patterns are case-insensitive regexes searched anywhere in the turn.

**Grounding** (:func:`lexical_grounding`): the question's *content words* that are not in the
query (a question that only echoes the query points at no earlier turn) are looked up in the prior
turns (user or assistant, not system). ``grounding: first_mention`` (default) keeps, for each such
word, the turn that mentions it first -- the turn that introduced the candidate, not every later
echo of it; ``all_mentions`` keeps every turn sharing such a word. Content words: lower-cased alphanumeric tokens, not in the stopword
list (:data:`STOPWORDS` + ``extra_stopwords``), at least ``min_word_chars`` long unless they hold a
digit ("2019", "A4"), with a trailing plural ``s`` removed ("routers" = "router"). With
``max_grounding_turns`` only the most recent ones are kept. On the synthetic logs (gold labels
turned into assistant replies) ``first_mention`` reproduces the gold grounding exactly on 210 of the
221 clarify turns (95%), ``all_mentions`` on 89 (40%). ``grounding: none`` leaves it empty
(silver grounding by embeddings, :mod:`clarifier.data.grounding`, can fill it later).

    result = label_conversation(ConversationLog.model_validate(record), LabellingConfig())
    result.examples   # list[Example], ids "<conversation_id>:<turn index>"
    result.filtered   # list[FilteredTurn(turn_index, reason, text)]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from clarifier.core.config import LabellingConfig
from clarifier.core.schema import ConversationLog, Example, Turn

FILTER_REASONS: dict[str, str] = {
    "no_reply": "the conversation ends after this user turn: outcome unknown",
    "next_turn_is_user": "another user message follows before any assistant turn: outcome unknown",
    "clarification_unanswered": "the assistant asked a clarifying question but no user reply follows it",
    "empty_query": "the user turn is empty",
    "empty_reply": "the assistant reply to this user turn is empty",
}

STOPWORDS = frozenset("""
a about above after again against all also am an and any are aren as at be because been before being
below between both but by can cannot could couldn did didn do does doesn doing don down during each
either else few for from further get got had has have having he her here hers herself him himself his
how i if in into is isn it its itself just let like me more most my myself need no nor not now of off
on once one ones only or other ought our ours ourselves out over own please same she should so some
such than thank thanks that the their theirs them themselves then there these they this those through
to too under until up upon very want was wasn way we were weren what when where whether which while who
whom whose why will with would wouldn yes yet you your yours yourself yourselves
mean meant meaning asking ask referring refer talking talk thinking think clarify specify specific
sure okay ok exactly kind sort type prefer looking look know tell help
""".split())

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_TRAILING = "\"')]}»” \t\r\n"


@dataclass(frozen=True)
class FilteredTurn:
    """A user turn that did not become an example: ``reason`` is a key of :data:`FILTER_REASONS`."""

    turn_index: int
    reason: str
    text: str


@dataclass
class LabelledConversation:
    examples: list[Example] = field(default_factory=list)
    filtered: list[FilteredTurn] = field(default_factory=list)


def _search_any(patterns: list[str], text: str) -> bool:
    return any(re.search(p, text, re.IGNORECASE) for p in patterns)


def is_clarifying_question(text: str, rules: LabellingConfig) -> bool:
    """Whether an assistant turn is a clarifying question under ``rules`` (module docstring)."""
    t = (text or "").strip()
    if not t or len(t) > rules.max_question_chars:
        return False
    if rules.require_question_mark and not t.rstrip(_TRAILING).endswith("?"):
        return False
    if _search_any(rules.exclude_patterns, t):
        return False
    return not rules.patterns or _search_any(rules.patterns, t)


def question_text(text: str, rules: LabellingConfig) -> str:
    """The target question from a clarifying turn: all of it, or from its first sentence ending in '?'."""
    t = " ".join(text.split())
    if rules.question_text == "full":
        return t
    sentences = _SENTENCE_END.split(t)
    for k, s in enumerate(sentences):
        if s.rstrip(_TRAILING).endswith("?"):
            return " ".join(sentences[k:])
    return t


def content_words(text: str, min_chars: int = 3, stopwords: frozenset[str] | set[str] = STOPWORDS) -> set[str]:
    """Content words of ``text`` (see the module docstring), plural ``s`` removed."""
    out = set()
    for w in _WORD.findall(text.lower()):
        if w in stopwords:
            continue
        if len(w) < min_chars and not any(c.isdigit() for c in w):
            continue
        if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        if w in stopwords:
            continue
        out.add(w)
    return out


def lexical_grounding(question: str, query: str, history: list[Turn], rules: LabellingConfig) -> list[int]:
    """Indexes of prior non-system turns sharing a content word with the question but not the query."""
    if rules.grounding == "none":
        return []
    stop = STOPWORDS | {w.lower() for w in rules.extra_stopwords}
    wanted = content_words(question, rules.min_word_chars, stop) - content_words(query, rules.min_word_chars, stop)
    if not wanted:
        return []
    words = [content_words(t.text, rules.min_word_chars, stop) if t.role != "system" else set() for t in history]
    if rules.grounding == "all_mentions":
        hits = [i for i, w in enumerate(words) if w & wanted]
    else:  # first_mention: the turn that introduced each word, not every later echo of it
        firsts = {next((i for i, w in enumerate(words) if word in w), None) for word in wanted}
        hits = sorted(i for i in firsts if i is not None)
    if rules.max_grounding_turns is not None:
        hits = hits[-rules.max_grounding_turns:]
    return hits


def _next_non_system(turns, start: int) -> int | None:
    for j in range(start, len(turns)):
        if turns[j].role != "system":
            return j
    return None


def label_conversation(log: ConversationLog, rules: LabellingConfig) -> LabelledConversation:
    """Examples (positives and negatives) and filtered user turns of one unlabelled conversation.

    Gold labels on the turns, if any, are ignored here: the data job only calls this for logs
    without any label. Raises nothing for well-formed logs; an example that fails validation
    (it cannot: history and grounding are built consistently) would raise ``ValueError``.
    """
    out = LabelledConversation()
    turns = log.turns
    for i, turn in enumerate(turns):
        if turn.role != "user":
            continue
        if not turn.text.strip():
            out.filtered.append(FilteredTurn(i, "empty_query", turn.text))
            continue
        j = _next_non_system(turns, i + 1)
        if j is None:
            out.filtered.append(FilteredTurn(i, "no_reply", turn.text))
            continue
        reply = turns[j]
        if reply.role == "user":
            out.filtered.append(FilteredTurn(i, "next_turn_is_user", turn.text))
            continue
        if not reply.text.strip():
            out.filtered.append(FilteredTurn(i, "empty_reply", turn.text))
            continue
        history = [Turn(role=t.role, text=t.text) for t in turns[:i]]
        meta = log.turn_meta(i)
        meta["label_source"] = "rules"
        if is_clarifying_question(reply.text, rules):
            k = _next_non_system(turns, j + 1)
            if k is None or turns[k].role != "user":
                out.filtered.append(FilteredTurn(i, "clarification_unanswered", turn.text))
                continue
            question = question_text(reply.text, rules)
            meta.update({"labelling_rule": "clarifying_question_answered", "question_turn": j,
                         "grounding_source": rules.grounding})
            ex = Example(id=f"{log.conversation_id}:{i}", history=history, query=turn.text,
                         needs_clarification=True, clarifying_question=question,
                         grounding_turns=lexical_grounding(question, turn.text, history, rules),
                         passages=log.turn_passages(i), meta=meta)
        else:
            meta["labelling_rule"] = "direct_answer"
            ex = Example(id=f"{log.conversation_id}:{i}", history=history, query=turn.text,
                         needs_clarification=False, passages=log.turn_passages(i), meta=meta)
        out.examples.append(ex)
    return out
