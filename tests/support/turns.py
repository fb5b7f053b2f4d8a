"""Labelled turns whose words say whether they need a question (so a decision head can learn it)."""

from __future__ import annotations

import json

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


def queue_file(path, n: int = 8):
    """A labelling queue (what `clarifier label select` writes) of ``n`` turns: even ones kept apart, scores 0.9 /
    0.5 / 0.2 / 0.5 in turn."""
    lines = []
    for i in range(n):
        lines.append({"id": f"c{i}:2", "history": [{"role": "user", "text": "I have a router and a modem."},
                                                   {"role": "assistant", "text": "What do you need?"}],
                      "query": "how do I reset it?" if i % 2 else f"reset router {i}?",
                      "passages": [{"id": "kb1", "text": "Hold the button."}],
                      "meta": {"conversation_id": f"c{i}", "queue": {
                          "position": i + 1, "part": "kept_apart" if i % 2 == 0 else "active",
                          "score": 0.9 if i % 4 == 0 else 0.2 if i % 4 == 2 else 0.5, "threshold": 0.5}}})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path
