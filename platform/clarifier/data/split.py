"""Deterministic train/dev/test assignment by conversation (no conversation in two splits)."""

from __future__ import annotations

import hashlib


def split_fraction(conversation_id: str, seed: int) -> float:
    """A stable pseudo-random number in [0, 1) for a conversation and seed (sha256, not ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(conversation_id: str, seed: int, fractions: dict[str, float]) -> str:
    """The split whose cumulative (normalised) fraction range holds ``split_fraction``.

    ``fractions`` is taken in its order (``{"train": .8, "dev": .1, "test": .1}``); they need not
    sum to 1 (they are normalised). A split with fraction 0 never receives a conversation.
    """
    items = [(name, float(f)) for name, f in fractions.items() if float(f) > 0]
    if not items:
        raise ValueError("data.split needs at least one split with a positive fraction")
    total = sum(f for _, f in items)
    u = split_fraction(conversation_id, seed) * total
    acc = 0.0
    for name, f in items:
        acc += f
        if u < acc:
            return name
    return items[-1][0]
