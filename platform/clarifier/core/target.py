"""The joint target: one string carrying the three decisions in a fixed order.

    decision: clarify
    grounding: turns=0,2 passages=p1
    question: Which of the two routers do you mean?

or, when the turn needs no clarification, just::

    decision: answer

The decision comes first so that it is read from the probability of a single token after the
fixed prefix ``decision:`` (one forward pass, no decoding); grounding comes before the question so
the question is generated conditioned on what it refers to. The question is plain text: one line,
at least ``MIN_QUESTION_CHARS`` non-space characters, none of the target's own syntax
(``QUESTION_SYNTAX``); the parser rejects other questions as malformed, and the engine's decoding
constraint (``clarifier.engine.target_constraint``) never writes them. Pure: no torch, no Ray.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DECISION_PREFIX = "decision:"
CLARIFY = "clarify"
ANSWER = "answer"
GROUNDING_HEAD = "grounding: turns="
PASSAGES_SEP = " passages="
QUESTION_HEAD = "question:"
# Pieces of the target format that a question must not contain (matched case-insensitively):
# they are how grounding syntax leaks into questions (``are you asking about the user?||none``).
QUESTION_SYNTAX = ("|", "turns=", "passages=", "decision:", "grounding:", "question:")
MIN_QUESTION_CHARS = 3  # non-space characters
SEGMENTS = ("decision", "grounding", "question", "format")


class TargetParseError(ValueError):
    """Model output that does not follow the target format; the message says what is wrong."""


@dataclass(frozen=True)
class JointTarget:
    needs_clarification: bool
    question: str | None = None
    grounding_turns: tuple[int, ...] = field(default_factory=tuple)
    grounding_passages: tuple[str, ...] = field(default_factory=tuple)


def _ids(values) -> str:
    vals = [str(v) for v in values]
    return ",".join(vals) if vals else "none"


def render_segments(t: JointTarget) -> list[tuple[str, str]]:
    """The target as ``(segment, text)`` pieces; concatenated they give ``render_target(t)``.

    Segments are tokenised separately by the training objective to weight each decision's tokens.
    The fixed ``decision:`` prefix is its own ``format`` segment, so the ``decision`` segment is
    exactly the token(s) that carry the decision.
    """
    if not t.needs_clarification:
        return [("format", DECISION_PREFIX), ("decision", f" {ANSWER}")]
    question = _one_line(t.question or "")
    if not question:
        raise ValueError("a clarify target needs a non-empty question")
    for p in t.grounding_passages:
        if not re.fullmatch(r"[^\s,]+", p):
            raise ValueError(f"passage id {p!r} must not contain spaces or commas")
    return [
        ("format", DECISION_PREFIX),
        ("decision", f" {CLARIFY}\n"),
        ("grounding", f"{GROUNDING_HEAD}{_ids(t.grounding_turns)}{PASSAGES_SEP}{_ids(t.grounding_passages)}\n"),
        ("question", f"{QUESTION_HEAD} {question}"),
    ]


def render_target(t: JointTarget) -> str:
    return "".join(text for _, text in render_segments(t))


def _one_line(s: str) -> str:
    return " ".join(s.split())


def syntax_in_question(question: str) -> str | None:
    """The first piece of ``QUESTION_SYNTAX`` that ``question`` contains (any case), else None."""
    low = question.lower()
    return next((piece for piece in QUESTION_SYNTAX if piece in low), None)


def nonspace_chars(text: str) -> int:
    return sum(not c.isspace() for c in text)


def question_problem(question: str) -> str | None:
    """Why ``question`` is not a servable question (target syntax in it, or too short), else None."""
    piece = syntax_in_question(question)
    if piece is not None:
        return f"the question contains the target syntax {piece!r}: {question[:80]!r}"
    n = nonspace_chars(question)
    if n < MIN_QUESTION_CHARS:
        return f"the question has {n} non-space characters (at least {MIN_QUESTION_CHARS}): {question!r}"
    return None


_DECISION_RE = re.compile(r"decision:\s*(\w+)\s*$")
_GROUNDING_RE = re.compile(r"grounding:\s*turns=(\S+)\s+passages=(\S+)\s*$")
_QUESTION_RE = re.compile(r"question:\s*(.+?)\s*$")


def _parse_list(raw: str, what: str, as_int: bool):
    if raw == "none":
        return ()
    items = raw.split(",")
    if any(not x for x in items):
        raise TargetParseError(f"{what} list {raw!r} has an empty item")
    if as_int:
        if not all(x.isdigit() for x in items):
            raise TargetParseError(f"{what} list {raw!r} must hold turn indexes (integers)")
        return tuple(int(x) for x in items)
    return tuple(items)


def parse_target(text: str, *, history_len: int | None = None, passage_ids=None) -> JointTarget:
    """Parse model output into a JointTarget, or raise TargetParseError saying what is wrong.

    With ``history_len``/``passage_ids`` the grounding is also checked against the request, so a
    reference to a turn or passage that does not exist is reported rather than passed on.
    """
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        raise TargetParseError("empty output")
    m = _DECISION_RE.fullmatch(lines[0])
    if not m:
        raise TargetParseError(f"line 1 must be 'decision: clarify|answer', got {lines[0][:80]!r}")
    decision = m.group(1)
    if decision == ANSWER:
        if len(lines) > 1:
            raise TargetParseError("text after 'decision: answer'")
        return JointTarget(needs_clarification=False)
    if decision != CLARIFY:
        raise TargetParseError(f"unknown decision {decision!r} (expected 'clarify' or 'answer')")
    if len(lines) < 3:
        raise TargetParseError("a clarify decision must be followed by a grounding line and a question line")
    if len(lines) > 3:
        raise TargetParseError(f"unexpected text after the question line: {lines[3][:80]!r}")
    g = _GROUNDING_RE.fullmatch(lines[1])
    if not g:
        raise TargetParseError(f"line 2 must be 'grounding: turns=... passages=...', got {lines[1][:80]!r}")
    turns = _parse_list(g.group(1), "turns", as_int=True)
    passages = _parse_list(g.group(2), "passages", as_int=False)
    q = _QUESTION_RE.fullmatch(lines[2])
    if not q:
        raise TargetParseError(f"line 3 must be 'question: ...', got {lines[2][:80]!r}")
    problem = question_problem(q.group(1))
    if problem:
        raise TargetParseError(problem)
    if history_len is not None:
        bad = [i for i in turns if i >= history_len]
        if bad:
            raise TargetParseError(f"grounding turns {list(bad)} do not exist (history has {history_len} turns)")
    if passage_ids is not None:
        known = set(passage_ids)
        bad_p = [p for p in passages if p not in known]
        if bad_p:
            raise TargetParseError(f"grounding passages {bad_p} are not among the request's passages")
    return JointTarget(True, q.group(1), turns, passages)


def try_parse_target(text: str, **kw) -> tuple[JointTarget | None, str | None]:
    """``(target, None)`` on success, ``(None, reason)`` on malformed output. Never raises."""
    try:
        return parse_target(text, **kw), None
    except TargetParseError as exc:
        return None, str(exc)


def example_segments(ex, first_turn: int = 0) -> list[tuple[str, str]]:
    """The gold target of a ``schema.Example`` as :func:`render_segments` pieces; a ``decision_only``
    positive (no question known) is only ``decision: clarify`` and its newline. ``first_turn``: the first
    history turn the prompt shows; the grounding names none before it."""
    if getattr(ex, "decision_only", False):
        return [("format", DECISION_PREFIX), ("decision", f" {CLARIFY}\n")]
    return render_segments(target_from_example(ex, first_turn))


def target_from_example(ex, first_turn: int = 0) -> JointTarget:
    """The gold JointTarget of a ``schema.Example`` (grounding: only turns from ``first_turn`` on, the ones a
    prompt that dropped older turns still shows)."""
    return JointTarget(
        needs_clarification=ex.needs_clarification,
        question=ex.clarifying_question,
        grounding_turns=tuple(i for i in ex.grounding_turns if i >= first_turn),
        grounding_passages=tuple(ex.grounding_passages),
    )
