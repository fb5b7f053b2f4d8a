"""The request log's record (``serve.request_log``): one answered request as a conversation-log record.

The serving ingress writes these (clarifier.serving.request_log); the data job reads them back
(clarifier.data.served_logs), the promotion gate compares the champion's and the shadow's answers in
them (clarifier.registry.shadow). The layout is in clarifier.serving.request_log's docstring.
Pure: no Ray, no I/O.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Optional

from clarifier.core.schema import ClarifyRequest, ClarifyResponse

RECORD_VERSION = 1
REDACTED = "[redacted]"
META_KEY = "request_log"  # the record's meta.request_log: request id, route, time, turn_index


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def answer_fields(resp: ClarifyResponse) -> dict:
    """What the request log keeps of a model's answer: a shadow's is ``meta.shadow`` of the query turn, the
    champion's (with its grounding) ``meta.served``."""
    return {"needs_clarification": resp.needs_clarification, "confidence": resp.confidence,
            "threshold": resp.threshold, "question": resp.question, "model_version": resp.model_version,
            "valid_output": resp.valid_output}


def request_record(req: ClarifyRequest, resp: ClarifyResponse, *, route: str, request_id: str, at: float,
                   omit: tuple[str, ...] | list[str] = (), shadow: Optional[dict] = None) -> dict:
    """The conversation-log record of one answered request (see the module docstring); ``shadow``: the
    shadow model's answer (:func:`answer_fields`) or ``{"error": ...}``, when the request was shadowed."""
    history_omitted = "history" in omit
    turns: list[dict[str, Any]] = [] if history_omitted else [{"role": t.role, "text": t.text} for t in req.history]
    query: dict[str, Any] = {"role": "user", "text": req.query, "meta": {
        "served": {**answer_fields(resp), "grounding": resp.grounding.model_dump()}}}
    if shadow is not None:
        query["meta"]["shadow"] = shadow
    if "passages" not in omit:
        text = "passages.text" not in omit
        query["passages"] = [{"id": p.id, "text": p.text if text else "",
                              **({"score": p.score} if p.score is not None else {})} for p in req.passages]
    turns.append(query)
    conversation = req.conversation_id
    return {"conversation_id": conversation or f"request-{request_id}", "turns": turns,
            "meta": {META_KEY: {"version": RECORD_VERSION, "request_id": request_id, "route": route,
                                     "at": _iso(at), "turn_index": len(req.history),
                                     "client_conversation_id": conversation is not None,
                                     "history_omitted": history_omitted}}}


def redact(record: dict, patterns: list[re.Pattern]) -> dict:
    """``record`` with every pattern's matches replaced in each text (turns, passages, the served question)."""
    if not patterns:
        return record

    def clean(text: Optional[str]) -> Optional[str]:
        if not text:
            return text
        for p in patterns:
            text = p.sub(REDACTED, text)
        return text

    for turn in record["turns"]:
        turn["text"] = clean(turn["text"])
        for p in turn.get("passages") or []:
            p["text"] = clean(p["text"])
        for key in ("served", "shadow"):
            answer = (turn.get("meta") or {}).get(key)
            if answer and answer.get("question"):
                answer["question"] = clean(answer["question"])
    return record
