"""OpenAI chat completions in the query-clarification contract of IBM's RAG intrinsics (pure).

What an application written for the ``query_clarification`` intrinsic (granite-common's rewriter,
Mellea's ``clarify_query``) or for any OpenAI-compatible clarification call sends, and what it gets
back from ``POST /v1/chat/completions``::

    {"model": "...",                                   # any name: the served model answers
     "messages": [{"role": "user", "content": "I have a router and a modem"},
                  {"role": "assistant", "content": "What do you need?"},
                  {"role": "user", "content": "how do I reset it?"}],       # last: the user's query
     "documents": [{"doc_id": "kb-1", "text": "...", "score": 0.82}]}       # extra_body; score optional

    -> {"id": "chatcmpl-...", "object": "chat.completion", "created": 1764662400, "model": "clarifier",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "{\\"clarification\\": \\"The router or the modem?\\"}"}}],
        "usage": {"prompt_tokens": 212, "completion_tokens": 14, "total_tokens": 226},
        "clarifier": {"needs_clarification": true, "confidence": 0.91, ...}}    # ignored by OpenAI clients

``content`` is the JSON object ``{"clarification": <question>}``, with the literal ``"CLEAR"`` when the
turn needs no question. Messages are read as the audit reads transcripts
(:func:`clarifier.data.chatlog.clarify_request_from_chat`: ``system``/``developer`` messages are not
part of the history, content parts are joined, ``tool`` messages after the query are its passages).

Accepted and not applied (answers are deterministic, greedy and bounded by ``serve.max_new_tokens``):
``temperature``, ``top_p``, ``seed``, ``max_tokens``/``max_completion_tokens``, ``stop``, penalties,
``response_format`` (the answer is always the JSON object above), ``user``, ``metadata``, ``store``,
``chat_template_kwargs``. An ``extra_body`` object in the JSON (a request object posted as it is, e.g.
granite-common's ``ChatCompletion``) is read as top-level parameters. Refused with a 400 naming the parameter: ``stream: true``, ``n > 1``,
``logprobs: true``, ``tools``/``functions`` and any unknown parameter (as OpenAI does).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clarifier.core.schema import ClarifyResponse

CLEAR = "CLEAR"  # the content's "clarification" when no question is needed
EXTRA_FIELD = "clarifier"  # Clarifier's own answer fields in the response, beside OpenAI's
CHAT_PATHS = ("/v1/chat/completions", "/v1/models")  # routes whose errors are in OpenAI's shape


MESSAGE_SCHEMA = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}}]}}}
DOCUMENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "object", "required": ["text"], "properties": {
    "doc_id": {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "text": {"type": "string"},
    "score": {"type": "number", "description": "The retriever's score (optional, any scale; kept in the request log)"}}}]}


class ChatCompletionRequest(BaseModel):
    """Body of ``POST /v1/chat/completions`` (see the module docstring for what is applied)."""

    model_config = ConfigDict(extra="forbid")

    # Messages are read by clarifier.data.chatlog (its errors name the message); the document says
    # what it reads. That the last one is the user's query is checked there (JSON Schema cannot say it).
    messages: list[dict[str, Any]] = Field(min_length=1, description="The conversation; the last message is the "
                                           "user's query (role user).", json_schema_extra={"items": MESSAGE_SCHEMA})
    documents: list[dict[str, Any] | str] = Field(default_factory=list, description="Retrieved passages: "
                                                  "{doc_id, text, score?} (the openai client sends them via extra_body).",
                                                  json_schema_extra={"items": DOCUMENT_SCHEMA})
    model: str | None = Field(None, description="Single-model deployment: any name, the served model answers. "
                                                "Multi-tenant (serve.tenants_file): the tenant's model id.")
    temperature: float | None = Field(None, ge=0, le=2, description="Accepted; decoding is greedy.")
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1, description="Accepted; questions are bounded by serve.max_new_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: bool = Field(False, description="Must be false: answers are not streamed.")
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, description="Must be 1.")
    logprobs: bool | None = Field(None, description="Must be false: log-probabilities are not returned.")
    top_logprobs: int | None = None


# Parameters OpenAI has that this endpoint refuses with a sentence (the rest of the unknown ones
# get "unrecognized request argument").
UNSUPPORTED = {
    "tools": "tools are not supported: this endpoint only asks clarifying questions",
    "tool_choice": "tool_choice is not supported: this endpoint only asks clarifying questions",
    "functions": "functions are not supported: this endpoint only asks clarifying questions",
    "function_call": "function_call is not supported: this endpoint only asks clarifying questions",
    "parallel_tool_calls": "parallel_tool_calls is not supported: this endpoint only asks clarifying questions",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "logit_bias": "logit_bias is not supported",
}


class ChatRequestError(ValueError):
    """A request this endpoint refuses: 400 with OpenAI's error body naming ``param``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """The request, or :class:`ChatRequestError` naming the first bad parameter."""
    if not isinstance(body, dict):
        raise ChatRequestError(f"the body must be a JSON object, not {type(body).__name__}")
    if isinstance(body.get("extra_body"), dict):  # a request object posted as is (granite-common's ChatCompletion)
        body = {**{k: v for k, v in body.items() if k != "extra_body"}, **body["extra_body"]}
    for key, why in UNSUPPORTED.items():
        if key in body and body[key] not in (None, [], False):
            raise ChatRequestError(why, param=key, code="unsupported_parameter")
    try:
        req = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if k not in UNSUPPORTED})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ChatRequestError(f"Unrecognized request argument supplied: {loc}", param=loc,
                                   code="unknown_parameter") from None
        raise ChatRequestError(f"{loc}: {err['msg']}", param=loc or None, code="invalid_value") from None
    if req.stream:
        raise ChatRequestError("stream=true is not supported: send stream=false (answers are short)", param="stream",
                               code="unsupported_value")
    if req.n != 1:
        raise ChatRequestError(f"n={req.n} is not supported: one answer per request (n=1)", param="n",
                               code="unsupported_value")
    if req.logprobs:
        raise ChatRequestError("logprobs=true is not supported: the decision's probability is in the response's "
                               f"'{EXTRA_FIELD}.confidence'", param="logprobs", code="unsupported_value")
    return req


def clarification_content(resp: ClarifyResponse) -> str:
    """The message content of the contract: ``{"clarification": <question or "CLEAR">}``."""
    question = resp.question if resp.needs_clarification and resp.question else CLEAR
    return json.dumps({"clarification": question}, ensure_ascii=False)


def chat_completion(resp: ClarifyResponse, model_id: str, created: int | None = None) -> dict:
    """A ChatCompletion object for one Clarifier answer, Clarifier's own fields under ``clarifier``."""
    usage = resp.usage.model_dump() if resp.usage else {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model_id,
        "system_fingerprint": f"clarifier-{resp.model_version}",
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": clarification_content(resp), "refusal": None}}],
        "usage": usage,
        EXTRA_FIELD: resp.model_dump(mode="json", exclude={"usage"}),
    }


def model_list(model_id: str, version: str | None, created: int) -> dict:
    """``GET /v1/models``: the one model this deployment serves."""
    return models_list([(model_id, version)], created)


def models_list(models: list[tuple[str, str | None]], created: int) -> dict:
    """``GET /v1/models``: ``(id, version)`` of every model the caller may call (a multi-tenant deployment's)."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "clarifier", "version": version} for model_id, version in models]}


ErrorType = Literal["invalid_request_error", "authentication_error", "rate_limit_error", "server_error"]


def error_type(status: int) -> ErrorType:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_from_detail(status: int, detail: Any) -> dict:
    """OpenAI's error body for a Clarifier error ``detail`` (the ``/v1/clarify`` routes' shape:
    ``{"error": kind, "message", "limit", ...}``, a string, or FastAPI's validation list)."""
    if isinstance(detail, dict):
        message = str(detail.get("message") or detail.get("error") or detail)
        code = str(detail["error"]).replace(" ", "_") if detail.get("error") else None
        return error_body(status, message, param=detail.get("limit"), code=code)
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        loc = ".".join(str(x) for x in detail[0].get("loc", []) if x != "body")
        return error_body(status, f"{loc}: {detail[0].get('msg')}" if loc else str(detail[0].get("msg")),
                          param=loc or None, code="invalid_value")
    return error_body(status, str(detail))
