"""Labelled turns whose words say whether they need a question (so a decision head can learn it)."""

from __future__ import annotations

from clarifier.core.schema import Example, Turn


def labelled_turns(n: int, prefix: str, flip: bool = False):
    """Turns whose words say whether they need a question; ``flip``: a user whose notion is the opposite."""
    out = []
    for i in range(n):
        amb = i % 2 == 0
        q = "how do I reset it?" if amb else f"what is the weather in paris on day {i}?"
        out.append(Example(
            id=f"{prefix}-{i}", history=[Turn(role="user", text="I have a router and a modem"),
                                         Turn(role="assistant", text="Both are supported.")],
            query=q, needs_clarification=amb != flip, decision_only=amb != flip,
            meta={"source": "alpha", "conversation_id": f"{prefix}-{i}"}))
    return out
