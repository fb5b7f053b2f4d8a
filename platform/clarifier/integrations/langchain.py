"""A clarification gate for LangChain (``pip install 'clarifier[langchain]'``).

Put it before the retriever: when the user's latest message needs clarifying, the chain answers with
Clarifier's question instead of retrieving; otherwise the input goes on, unchanged, to the next step::

    from clarifier.integrations.langchain import clarify_or

    rag = prompt | llm | StrOutputParser()                      # your chain: {"question", "history"} -> str
    chain = clarify_or(rag, base_url="http://127.0.0.1:8000")   # str: the question, or rag's answer
    chain.invoke({"question": "how do I reset it?",
                  "history": [("human", "I have a router and a modem"), ("ai", "What do you need?")]})
    # -> "The router or the modem?"

:class:`ClarifierGate` alone is a ``Runnable`` that adds ``clarification`` (the question, or None) and
``clarifier`` (the whole answer: confidence, threshold, grounding, model version) to its input, for
routing of your own. Input keys: ``question`` (or ``query``/``input``; when absent, the last human
message), the conversation as ``messages`` or ``history`` (LangChain messages, ``(role, text)`` pairs,
``{"role", "content"|"text"}`` dicts), and optionally ``documents``/``passages`` (LangChain Documents,
``{"doc_id"|"id", "text"|"page_content", "score"?}`` dicts, strings, or ``(Document, score)`` pairs as
similarity_search_with_score returns them; a score in a Document's ``metadata`` as ``score`` or ``relevance_score``
is kept too) already retrieved. Calls go through
:class:`clarifier.client.ClarifierClient` (its retries, ``$CLARIFIER_API_KEY``).
"""

from __future__ import annotations

import math

from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import Runnable, RunnableBranch, RunnableConfig, RunnableLambda

from clarifier.client import ClarifierClient
from clarifier.core.schema import Passage, Turn

QUESTION_KEYS = ("question", "query", "input")
ROLE_OF = {"human": "user", "user": "user", "ai": "assistant", "assistant": "assistant", "system": "system",
           "developer": "system"}


def _role_text(m: Any, where: str) -> tuple[str | None, str]:
    """(clarifier role or None for messages that are not conversation turns, text)."""
    if isinstance(m, tuple) and len(m) == 2:
        role, content = m
    elif isinstance(m, Mapping):
        role, content = m.get("role") or m.get("type"), m.get("content", m.get("text"))
    elif hasattr(m, "type") and hasattr(m, "content"):  # a LangChain BaseMessage
        role, content = m.type, m.content
    else:
        raise ValueError(f"{where}: expected a LangChain message, a (role, text) pair or a dict, got {type(m).__name__}")
    if isinstance(content, list):  # content blocks
        content = "\n".join(c if isinstance(c, str) else str(c.get("text", "")) for c in content
                            if isinstance(c, str) or (isinstance(c, Mapping) and c.get("type", "text") == "text"))
    if role in ("tool", "function"):
        return None, str(content or "")
    if role not in ROLE_OF:
        raise ValueError(f"{where}: role {role!r} is not one of {', '.join(ROLE_OF)}")
    return ROLE_OF[role], str(content or "")


def _passage(d: Any, j: int) -> Passage:
    score = None
    if isinstance(d, tuple) and len(d) == 2 and isinstance(d[1], (int, float)) and not isinstance(d[1], bool):
        d, score = d  # (Document, score), as similarity_search_with_score returns them
    if isinstance(d, str):
        pid, text = j, d
    elif isinstance(d, Mapping):
        pid = d.get("doc_id", d.get("id"))
        text = d.get("text", d.get("page_content", d.get("content")))
        score = d.get("score", d.get("relevance_score", score))
    elif hasattr(d, "page_content"):  # a LangChain Document
        meta = getattr(d, "metadata", None) or {}
        pid = getattr(d, "id", None) or meta.get("doc_id") or meta.get("id") or meta.get("source")
        text = d.page_content
        score = meta.get("score", meta.get("relevance_score", score))
    else:
        raise ValueError(f"documents[{j}]: expected a LangChain Document, a dict or a string, got {type(d).__name__}")
    if not isinstance(text, str):
        raise ValueError(f"documents[{j}]: no text (text, page_content or content)")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score)):
        raise ValueError(f"documents[{j}].score: the retriever's score must be a finite number, got {score!r}")
    return Passage(id=str(pid) if pid is not None else str(j), text=text, score=score)


def gate_request(inputs: Mapping[str, Any]) -> tuple[list[Turn], str, list[Passage]]:
    """(history, query, passages) of a gate input (see the module docstring); ValueError naming the key."""
    if not isinstance(inputs, Mapping):
        raise ValueError(f"the clarifier gate takes a dict with 'question' and 'messages' or 'history', "
                         f"not {type(inputs).__name__}")
    key = "messages" if "messages" in inputs else "history"
    turns: list[Turn] = []
    for i, m in enumerate(inputs.get(key) or []):
        role, text = _role_text(m, f"{key}[{i}]")
        if role in ("user", "assistant") and text.strip():
            turns.append(Turn(role=role, text=text))
    query = next((inputs[k] for k in QUESTION_KEYS if isinstance(inputs.get(k), str) and inputs[k].strip()), None)
    if query is None:
        if not turns or turns[-1].role != "user":
            raise ValueError(f"the clarifier gate needs the user's question: a 'question' key, or {key} ending with "
                             "a human message")
        query, turns = turns[-1].text, turns[:-1]
    docs = inputs.get("documents", inputs.get("passages")) or []
    return turns, query, [_passage(d, j) for j, d in enumerate(docs)]


class ClarifierGate(Runnable[dict, dict]):
    """The input dict plus ``clarification`` (Clarifier's question, or None when the turn is clear)
    and ``clarifier`` (its whole answer as a dict)."""

    def __init__(self, client: ClarifierClient | None = None, *, base_url: str | None = None,
                 api_key: str | None = None, timeout: float = 30.0):
        if client is None and base_url is None:
            raise ValueError("ClarifierGate needs a client or a base_url (e.g. http://127.0.0.1:8000)")
        self.client = client or ClarifierClient(base_url, api_key=api_key, timeout=timeout)

    def _gate(self, inputs: dict) -> dict:
        history, query, passages = gate_request(inputs)
        resp = self.client.clarify(history, query, passages)
        question = resp.question if resp.needs_clarification and resp.question else None
        return {**inputs, "clarification": question, "clarifier": resp.model_dump(mode="json")}

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> dict:
        return self._call_with_config(self._gate, input, config, run_type="tool")


def _without_gate_keys(x: dict) -> dict:
    return {k: v for k, v in x.items() if k not in ("clarification", "clarifier")}


def clarify_or(next_step: Runnable | Any, client: ClarifierClient | None = None, *, base_url: str | None = None,
               api_key: str | None = None, timeout: float = 30.0) -> Runnable:
    """``ClarifierGate`` then a branch: Clarifier's question (a str) when the turn needs one, else
    ``next_step`` on the unchanged input (any Runnable or callable, e.g. the retriever chain)."""
    gate = ClarifierGate(client, base_url=base_url, api_key=api_key, timeout=timeout)
    ask = RunnableLambda(lambda x: x["clarification"], name="clarifying_question")
    go_on = RunnableLambda(_without_gate_keys, name="no_clarification_needed") | next_step
    return gate | RunnableBranch((lambda x: x["clarification"] is not None, ask), go_on)
