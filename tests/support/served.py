"""Request-log records of simulated conversations, as the serving ingress writes them."""

from __future__ import annotations

from clarifier.core.schema import ClarifyRequest, ClarifyResponse
from clarifier.core.request_record import request_record


def served(conv: str, history: list[tuple[str, str]], query: str, ask: str | None, n: int) -> dict:
    """The record of one answered request: Clarifier asked ``ask`` (None: it stayed silent)."""
    req = ClarifyRequest(history=[{"role": r, "text": t} for r, t in history], query=query, conversation_id=conv,
                         passages=[{"id": "kb-1", "text": f"Reset: hold the button ({conv})."}])
    resp = ClarifyResponse(needs_clarification=ask is not None, confidence=0.8 if ask else 0.1, threshold=0.5,
                           question=ask, grounding={"turns": [0] if ask and history else [], "passages": ["kb-1"]},
                           model_version="clarifier/2")
    return request_record(req, resp, route="clarify", request_id=f"{conv}-{n}", at=1000.0 + n)


def conversation(conv: str, steps: list[tuple[str, str | None, str]]) -> list[dict]:
    """Records of a conversation: each step is (the user's query, Clarifier's question or None, the app's reply);
    the app's reply to a step shows up in the next request's history."""
    history: list[tuple[str, str]] = []
    out = []
    for n, (query, ask, reply) in enumerate(steps):
        out.append(served(conv, history, query, ask, n))
        history += [("user", query), ("assistant", reply)]
    return out
