"""Logs as teams have them -> the user turns an audit scores, each with what happened after it.

One record (a JSONL line or a Parquet row) is one conversation, in one of three shapes:

**OpenAI-style chat transcript** (what most RAG apps log)::

    {"id": "c-17",                                   # or conversation_id, or metadata.conversation_id
     "messages": [
       {"role": "system", "content": "You are ..."},            # system/developer: not part of the history
       {"role": "user", "content": "how do I reset it?",
        "documents": [{"doc_id": "kb-3", "text": "..."}],       # optional: passages retrieved for this turn
        "needs_clarification": true},                           # optional: a gold label (hand-labelled sample)
       {"role": "assistant", "content": null, "tool_calls": [...]},   # a retrieval call: not a turn
       {"role": "tool", "tool_call_id": "call-1",
        "content": "[{\\"doc_id\\": \\"kb-3\\", \\"text\\": \\"...\\"}]"},  # retrieved passages (JSON list or plain text)
       {"role": "assistant", "content": "Hold the power button ...",
        "feedback": "down"}                                     # optional outcome fields, below
     ],
     "metadata": {"domain": "routers", "documents": [...], "feedback": [{"message_index": 4, "rating": 1}],
                  "escalated": false}}

``content`` may also be a list of parts (``[{"type": "text", "text": ...}]``). A turn's passages are
its own ``documents`` and the ``tool`` messages between it and the answer; a turn with neither gets
``metadata.documents`` (the conversation's). Passage objects may name their id ``doc_id`` or ``id``
and their text ``text``, ``content`` or ``page_content``, with an optional retriever ``score`` (or
``relevance_score``, a finite number, kept as the passage's ``score``); plain-text tool output is one passage
(id = ``tool_call_id``).

**The platform's conversation log** (``turns`` with ``role``/``text``; see ``clarifier.core.schema``):
outcome fields of an answer live in the *user* turn's ``meta`` (``meta.feedback``, ``meta.rating``,
``meta.escalated``), a gold ``label`` is used as the turn's label.

**An evaluation-set example** (``history`` + ``query``): one turn, no answer, its gold label.

**Outcome fields** of an assistant message (also inside its ``metadata``): ``feedback`` (``"up"``/
``"down"``, ``"thumbs_up"``/``"thumbs_down"``, ``"positive"``/``"negative"``, a bool, a number = a
rating, or an object with ``thumbs``/``rating``/``value``/``score``), ``rating`` (a number),
``escalated`` / ``handoff`` (true = the conversation was handed to a person after this answer).
``metadata.feedback`` entries point at a message by ``message_index``; ``metadata.escalated: true``
marks the conversation's last answered user turn. What counts as a failure is decided by
:mod:`clarifier.data.signals` from these raw values.

Errors are ``ValueError`` naming the field (``messages[3].role: 'bot' is not one of ...``); the
audit job quarantines the line with that reason.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, Field

from clarifier.core.schema import ClarifyRequest, ConversationLog, Example, Passage, Turn, describe_validation_error

SKIPPED_ROLES = ("system", "developer")
TOOL_ROLES = ("tool", "function")
ROLES = ("user", "assistant", *SKIPPED_ROLES, *TOOL_ROLES)
OUTCOME_KEYS = ("feedback", "rating", "escalated", "handoff")


class AuditTurn(BaseModel):
    """One user turn to audit: what the model sees (history, query, passages) and what happened next."""

    id: str  # "<conversation_id>:<index>" (index: message index in a transcript, turn index in a platform log)
    conversation_id: str
    turn_index: int  # position of the query in the history (user and assistant turns only)
    user_position: int  # 1 for the conversation's first user turn
    history: list[Turn] = Field(default_factory=list)
    query: str
    passages: list[Passage] = Field(default_factory=list)
    answer: str | None = None  # the assistant's reply to this turn; None when the log ends before one
    next_user: str | None = None  # the user's next message, if any
    feedback: list[Any] = Field(default_factory=list)  # raw outcome values attached to the answer
    escalated: bool = False
    gold: bool | None = None  # a label from the log, when it has one
    meta: dict[str, Any] = Field(default_factory=dict)  # the conversation's metadata, the turn's over it

    def example(self) -> Example:
        """The turn as the engine scores it (the label is a placeholder when the log has none)."""
        return Example(id=self.id, history=self.history, query=self.query, passages=self.passages,
                       needs_clarification=False, meta={**self.meta, "conversation_id": self.conversation_id,
                                                        "turn_index": self.turn_index})


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") not in (None, "text", "input_text", "output_text"):
                continue  # images, audio, ...: not text the model reads
            else:
                raise ValueError(f"{where}.content[{j}]: a content part needs a 'text' string")
        return "\n".join(parts)
    raise ValueError(f"{where}.content: expected a string or a list of parts, got {type(content).__name__}")


def _passage(obj: Any, where: str, fallback_id: str) -> Passage:
    if isinstance(obj, str):
        return Passage(id=fallback_id, text=obj)
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a document must be an object or a string, got {type(obj).__name__}")
    pid = obj.get("doc_id", obj.get("id", obj.get("document_id")))
    text = next((obj[k] for k in ("text", "content", "page_content", "snippet") if isinstance(obj.get(k), str)), None)
    if text is None:
        raise ValueError(f"{where}: a document needs a text (one of text, content, page_content, snippet)")
    score = obj.get("score", obj.get("relevance_score"))
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))
                              or score != score or score in (float("inf"), float("-inf"))):
        raise ValueError(f"{where}.score: the retriever's score must be a finite number, got {score!r}")
    return Passage(id=str(pid) if pid is not None else fallback_id, text=text,
                   score=float(score) if score is not None else None)


def _documents(value: Any, where: str, prefix: str) -> list[Passage]:
    if value is None:
        return []
    if isinstance(value, dict) and "documents" in value:
        value = value["documents"]
    if not isinstance(value, list):
        raise ValueError(f"{where}: documents must be a list, got {type(value).__name__}")
    return [_passage(d, f"{where}[{j}]", f"{prefix}{j}") for j, d in enumerate(value)]


def _tool_passages(msg: dict, where: str, k: int) -> list[Passage]:
    content = msg.get("content")
    fid = str(msg.get("tool_call_id") or msg.get("name") or f"tool{k}")
    if isinstance(content, str):
        s = content.strip()
        if s[:1] in "[{":
            try:
                return _documents(json.loads(s), f"{where}.content", f"{fid}-")
            except (json.JSONDecodeError, ValueError):
                pass  # not JSON documents: the text itself is the passage
        return [Passage(id=fid, text=content)] if s else []
    if isinstance(content, list):
        if all(isinstance(c, dict) and c.get("type") in ("text", "input_text") for c in content):
            text = _text(content, where)
            return [Passage(id=fid, text=text)] if text.strip() else []
        return _documents(content, f"{where}.content", f"{fid}-")
    if content is None:
        return []
    raise ValueError(f"{where}.content: expected tool output as a string or a list, got {type(content).__name__}")


def _outcomes(obj: dict | None) -> tuple[list[Any], bool]:
    """Raw feedback values and the escalation flag of one message (its fields and its ``metadata``)."""
    fb: list[Any] = []
    esc = False
    for src in (obj or {}, (obj or {}).get("metadata") if isinstance((obj or {}).get("metadata"), dict) else {}):
        for key in ("feedback", "rating"):
            if src.get(key) is not None:
                fb.append(src[key])
        esc = esc or bool(src.get("escalated")) or bool(src.get("handoff"))
    return fb, esc


def conversation_id_of(obj: dict, fallback: str) -> str:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    for v in (obj.get("conversation_id"), obj.get("id"), meta.get("conversation_id"), meta.get("id")):
        if v is not None and str(v).strip():
            return str(v)
    return fallback


def _gold(msg: dict) -> bool | None:
    v = msg.get("needs_clarification")
    if v is None and isinstance(msg.get("label"), dict):
        v = msg["label"].get("needs_clarification")
    if v is None and isinstance(msg.get("metadata"), dict):
        v = msg["metadata"].get("needs_clarification")
    if v is None:
        return None
    if not isinstance(v, bool):
        raise ValueError(f"needs_clarification must be true or false, got {v!r}")
    return v


def from_transcript(obj: dict, fallback_id: str) -> list[AuditTurn]:
    """The user turns of an OpenAI-style transcript (see the module docstring)."""
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("messages: expected a non-empty list of messages")
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    if obj.get("metadata") is not None and not isinstance(obj.get("metadata"), dict):
        raise ValueError(f"metadata: expected an object, got {type(obj['metadata']).__name__}")
    conv = conversation_id_of(obj, fallback_id)
    conv_docs = _documents(meta.get("documents"), "metadata.documents", "doc")
    extra_fb: dict[int, list[Any]] = {}
    for j, entry in enumerate(meta.get("feedback") or []):
        if not isinstance(entry, dict) or not isinstance(entry.get("message_index"), int):
            raise ValueError(f"metadata.feedback[{j}]: expected an object with an integer message_index")
        value = next((entry[k] for k in ("thumbs", "rating", "value", "score", "feedback") if k in entry), None)
        extra_fb.setdefault(entry["message_index"], []).append(value if value is not None else entry)

    history: list[Turn] = []
    turns: list[dict] = []  # per user turn: its fields while the following messages are read
    current: dict | None = None
    for i, msg in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: expected an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}")
        if role in SKIPPED_ROLES:
            continue
        if role in TOOL_ROLES:
            if current is not None and current["answer"] is None:
                current["passages"] += _tool_passages(msg, where, i)
            continue
        text = _text(msg.get("content"), where)
        if role == "assistant":
            if not text.strip():  # a tool call, or an empty message: not a turn
                continue
            fb, esc = _outcomes(msg)
            fb += extra_fb.get(i, [])
            if current is not None and current["answer"] is None:
                current.update(answer=text, feedback=fb, escalated=esc)
            history.append(Turn(role="assistant", text=text))
            continue
        # user
        if not text.strip():
            raise ValueError(f"{where}.content: a user message is empty")
        if current is not None and current["next_user"] is None:
            current["next_user"] = text
        user_meta = msg.get("metadata") if isinstance(msg.get("metadata"), dict) else {}
        try:
            gold = _gold(msg)
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from None
        current = {"i": i, "turn_index": len(history), "history": list(history), "query": text,
                   "passages": _documents(msg.get("documents"), f"{where}.documents", f"m{i}-d"),
                   "answer": None, "next_user": None, "feedback": [], "escalated": False, "gold": gold,
                   "meta": {k: v for k, v in user_meta.items() if k not in OUTCOME_KEYS}}
        turns.append(current)
        history.append(Turn(role="user", text=text))
    if not turns:
        raise ValueError("messages: the conversation has no user message")
    if meta.get("escalated"):
        answered = [t for t in turns if t["answer"] is not None] or turns
        answered[-1]["escalated"] = True
    conv_meta = {k: v for k, v in meta.items() if k not in ("documents", "feedback", "escalated", "handoff")}
    return [AuditTurn(id=f"{conv}:{t['i']}", conversation_id=conv, turn_index=t["turn_index"], user_position=n,
                      history=t["history"], query=t["query"], passages=t["passages"] or list(conv_docs),
                      answer=t["answer"], next_user=t["next_user"], feedback=t["feedback"], escalated=t["escalated"],
                      gold=t["gold"], meta={**conv_meta, **t["meta"]})
            for n, t in enumerate(turns, start=1)]


def from_conversation_log(obj: dict) -> list[AuditTurn]:
    """The user turns of a platform conversation log; outcomes from each user turn's ``meta``."""
    try:
        log = ConversationLog.model_validate(obj)
    except ValueError as exc:
        raise ValueError(describe_validation_error(exc)) from None
    out: list[AuditTurn] = []
    users = [i for i, t in enumerate(log.turns) if t.role == "user"]
    for n, i in enumerate(users, start=1):
        turn = log.turns[i]
        nxt = log.turns[i + 1] if i + 1 < len(log.turns) else None
        answer = nxt.text if nxt is not None and nxt.role == "assistant" else None
        later = [log.turns[j].text for j in users if j > i]
        fb, esc = _outcomes(turn.meta or {})
        meta = {k: v for k, v in log.turn_meta(i).items() if k not in (*OUTCOME_KEYS, "conversation_id", "turn_index")}
        out.append(AuditTurn(id=f"{log.conversation_id}:{i}", conversation_id=log.conversation_id, turn_index=i,
                             user_position=n, history=[Turn(role=t.role, text=t.text) for t in log.turns[:i]],
                             query=turn.text, passages=log.turn_passages(i), answer=answer,
                             next_user=later[0] if later else None, feedback=fb, escalated=esc,
                             gold=turn.label.needs_clarification if turn.label else None, meta=meta))
    if not out:
        raise ValueError("turns: the conversation has no user turn")
    return out


def from_example(obj: dict) -> list[AuditTurn]:
    try:
        ex = Example.model_validate(obj)
    except ValueError as exc:
        raise ValueError(describe_validation_error(exc)) from None
    return [AuditTurn(id=ex.id, conversation_id=ex.conversation_id, turn_index=len(ex.history), user_position=1
                      + sum(t.role == "user" for t in ex.history), history=ex.history, query=ex.query,
                      passages=ex.passages, gold=ex.needs_clarification,
                      meta={k: v for k, v in ex.meta.items() if k not in ("conversation_id", "turn_index")})]


def audit_turns(obj: Any, fallback_id: str) -> list[AuditTurn]:
    """The user turns of one record, whichever of the three shapes it has; ``ValueError`` naming the
    field otherwise. ``fallback_id`` names a conversation whose record has no id (e.g. ``file:line``)."""
    if not isinstance(obj, dict):
        raise ValueError(f"record: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        return from_transcript(obj, fallback_id)
    if "turns" in obj:
        return from_conversation_log(obj)
    if "query" in obj:
        return from_example(obj)
    raise ValueError("record: not a chat transcript ('messages'), a conversation log ('turns') or an example ('query')")


def stable_id(source: str, line: int) -> str:
    """A conversation id for a record without one: short, stable across reruns."""
    return "conv-" + hashlib.sha256(f"{source}:{line}".encode()).hexdigest()[:12]


def clarify_request_from_chat(messages: list[Any], documents: list[Any] = ()) -> ClarifyRequest:
    """The :class:`ClarifyRequest` of a chat-completions request (``POST /v1/chat/completions``):
    ``messages`` read as a transcript (above), the last user message is the query, ``documents``
    (``[{"doc_id", "text"}]`` or strings) its passages unless it carries its own or tool results follow
    it. ``ValueError`` naming the message when the conversation does not end with the user's query."""
    turns = from_transcript({"messages": list(messages), "metadata": {"documents": list(documents)}}, "request")
    last = turns[-1]
    if last.answer is not None:
        raise ValueError(f"messages[{len(messages) - 1}]: the conversation ends with an assistant answer; the last "
                         "message must be the user's query (role 'user') that may need clarifying")
    return ClarifyRequest(history=last.history, query=last.query, passages=last.passages)
