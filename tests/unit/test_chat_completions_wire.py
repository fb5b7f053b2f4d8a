"""The OpenAI-compatible contract, pure parts: request parsing and refusals, messages -> a clarify
request, the ChatCompletion built from an answer (and granite-common's result processor on it), the
engine's token counts, the LangChain gate's input conversion."""

from __future__ import annotations

import json

import pytest

from clarifier.core.chat_completions import (CLEAR, ChatRequestError, chat_completion, error_from_detail,
                                             parse_chat_request)
from clarifier.core.schema import ClarifyRequest, ClarifyResponse, Grounding, Usage
from clarifier.data.chatlog import clarify_request_from_chat

CONVERSATION = [{"role": "system", "content": "You are a support assistant."},
                {"role": "user", "content": "I have a router and a modem."},
                {"role": "assistant", "content": "Sure, what do you need?"},
                {"role": "user", "content": [{"type": "text", "text": "how do I reset it?"}]}]
DOCS = [{"doc_id": "kb-1", "text": "Hold the router's reset button for 10 s."},
        {"doc_id": 2, "text": "Unplug the modem for 30 s."}]


def _answer(question: str | None) -> ClarifyResponse:
    return ClarifyResponse(needs_clarification=question is not None, confidence=0.9 if question else 0.1,
                           threshold=0.5, question=question, model_version="7",
                           grounding=Grounding(turns=[0], passages=["kb-1"]) if question else Grounding(),
                           usage=Usage(prompt_tokens=120, completion_tokens=9 if question else 0,
                                       total_tokens=129 if question else 120))


# ---- requests ----------------------------------------------------------------------------------


def test_a_granite_style_request_becomes_the_clarify_request():
    chat = parse_chat_request({"model": "granite-4.0-micro", "messages": CONVERSATION, "documents": DOCS,
                               "temperature": 0.0, "max_completion_tokens": 64, "stream": False,
                               "chat_template_kwargs": {"documents": DOCS}, "response_format": {"type": "json_object"}})
    req = clarify_request_from_chat(chat.messages, chat.documents)
    assert isinstance(req, ClarifyRequest)
    assert [(t.role, t.text) for t in req.history] == [("user", "I have a router and a modem."),
                                                       ("assistant", "Sure, what do you need?")]  # system: not a turn
    assert req.query == "how do I reset it?"
    assert [(p.id, p.text[:4]) for p in req.passages] == [("kb-1", "Hold"), ("2", "Unpl")]


def test_extra_body_posted_as_is_is_read_as_parameters():
    """granite-common's ChatCompletion dumped to JSON keeps documents under extra_body."""
    chat = parse_chat_request({"messages": CONVERSATION[1:], "extra_body": {"documents": DOCS[:1]}})
    assert clarify_request_from_chat(chat.messages, chat.documents).passages[0].id == "kb-1"


def test_tool_results_after_the_query_are_its_passages():
    msgs = [*CONVERSATION[1:], {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": json.dumps([{"doc_id": "t1", "text": "Reset page."}])}]
    req = clarify_request_from_chat(parse_chat_request({"messages": msgs, "documents": DOCS}).messages, DOCS)
    assert req.query == "how do I reset it?" and [p.id for p in req.passages] == ["t1"]


@pytest.mark.parametrize("body, param, words", [
    ({"messages": CONVERSATION, "stream": True}, "stream", "stream=true is not supported"),
    ({"messages": CONVERSATION, "n": 2}, "n", "n=2 is not supported"),
    ({"messages": CONVERSATION, "logprobs": True}, "logprobs", "confidence"),
    ({"messages": CONVERSATION, "tools": [{"type": "function"}]}, "tools", "tools are not supported"),
    ({"messages": CONVERSATION, "frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
    ({"messages": CONVERSATION, "temperature": 7}, "temperature", "temperature"),
    ({"messages": []}, "messages", "at least 1"),
    ({}, "messages", "Field required"),
])
def test_unsupported_or_bad_parameters_are_refused_naming_them(body, param, words):
    with pytest.raises(ChatRequestError) as info:
        parse_chat_request(body)
    assert info.value.param == param and words in info.value.message


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(ChatRequestError, match="must be a JSON object, not list"):
        parse_chat_request([CONVERSATION])


@pytest.mark.parametrize("messages, words", [
    ([*CONVERSATION, {"role": "assistant", "content": "Hold the button."}], r"messages\[4\]: the conversation ends "
                                                                            "with an assistant answer"),
    ([{"role": "system", "content": "Be brief."}], "no user message"),
    ([{"role": "robot", "content": "hi"}], r"messages\[0\].role: 'robot' is not one of"),
    ([{"role": "user", "content": "  "}], r"messages\[0\].content: a user message is empty"),
])
def test_conversations_that_do_not_end_with_a_query_are_refused(messages, words):
    with pytest.raises(ValueError, match=words):
        clarify_request_from_chat(messages, [])


# ---- responses ---------------------------------------------------------------------------------


def test_a_question_and_a_clear_turn_in_the_contract():
    asked = chat_completion(_answer("The router or the modem?"), "clarifier", created=1)
    assert json.loads(asked["choices"][0]["message"]["content"]) == {"clarification": "The router or the modem?"}
    assert asked["object"] == "chat.completion" and asked["id"].startswith("chatcmpl-") and asked["model"] == "clarifier"
    assert asked["usage"] == {"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129}
    assert asked["clarifier"]["confidence"] == 0.9 and asked["clarifier"]["grounding"] == {"turns": [0],
                                                                                           "passages": ["kb-1"]}
    clear = chat_completion(_answer(None), "clarifier")
    assert json.loads(clear["choices"][0]["message"]["content"]) == {"clarification": CLEAR}
    assert clear["usage"]["completion_tokens"] == 0 and clear["choices"][0]["finish_reason"] == "stop"


def test_an_unparsed_generation_answers_clear():
    resp = _answer(None).model_copy(update={"valid_output": False, "confidence": 0.8})
    out = chat_completion(resp, "m")
    assert json.loads(out["choices"][0]["message"]["content"])["clarification"] == CLEAR
    assert out["clarifier"]["valid_output"] is False


def test_granite_commons_result_processor_accepts_the_answer():
    """granite-common's intrinsic output processing, offline: the response parses as its
    ChatCompletionResponse and its processor (no transformations, as for a plain JSON intrinsic) keeps
    the clarification."""
    from granite_common.base.types import ChatCompletionResponse
    from granite_common.intrinsics.output import IntrinsicsResultProcessor

    schema = {"type": "object", "properties": {"clarification": {"type": "string"}}, "required": ["clarification"]}
    proc = IntrinsicsResultProcessor(config_dict={"model": None, "response_format": json.dumps(schema),
                                                  "transformations": None})
    for question in ("The router or the modem?", None):
        parsed = ChatCompletionResponse.model_validate(chat_completion(_answer(question), "clarifier"))
        out = proc.transform(parsed)
        assert json.loads(out.choices[0].message.content) == {"clarification": question or CLEAR}


def test_errors_in_openais_shape():
    e = error_from_detail(503, {"error": "overloaded", "limit": "max_queued_requests", "message": "busy"})
    assert e == {"error": {"message": "busy", "type": "server_error", "param": "max_queued_requests",
                           "code": "overloaded"}}
    assert error_from_detail(401, {"error": "unauthorized", "message": "missing API key"})["error"]["type"] == \
        "authentication_error"
    v = error_from_detail(400, [{"loc": ["body", "messages"], "msg": "Field required"}])
    assert v["error"]["param"] == "messages" and v["error"]["type"] == "invalid_request_error"


# ---- the engine's token counts -------------------------------------------------------------------


def test_usage_counts_the_prompt_and_the_generated_tokens(tiny_model_dir):
    from clarifier.core.target import DECISION_PREFIX
    from clarifier.engine.inference import ClarifierEngine

    eng = ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32", max_new_tokens=12)
    req = ClarifyRequest(history=[{"role": "user", "text": "I have a router and a modem."}], query="how do I reset it?",
                         passages=[{"id": "kb-1", "text": "Hold the reset button."}])
    n_prompt = len(eng.tok(eng._prompt(req.history, req.query, req.passages) + DECISION_PREFIX,
                           add_special_tokens=False)["input_ids"])
    silent, = eng.clarify([req], threshold=1.01)
    assert silent.usage == Usage(prompt_tokens=n_prompt, completion_tokens=0, total_tokens=n_prompt)
    asked, = eng.clarify([req], threshold=0.0)
    assert asked.usage.prompt_tokens == n_prompt and 1 <= asked.usage.completion_tokens <= 12
    assert asked.usage.total_tokens == n_prompt + asked.usage.completion_tokens
    # in a batch each row counts its own unpadded prompt
    short = ClarifyRequest(query="reset?")
    both = eng.clarify([req, short], threshold=1.01)
    assert both[0].usage.prompt_tokens == n_prompt and both[1].usage.prompt_tokens < n_prompt


# ---- the LangChain gate's input ----------------------------------------------------------------


def test_gate_inputs_in_the_shapes_langchain_users_have():
    from langchain_core.documents import Document
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from clarifier.integrations.langchain import gate_request

    history, query, passages = gate_request({
        "messages": [SystemMessage("Be brief."), HumanMessage("I have a router and a modem."),
                     AIMessage("What do you need?"), HumanMessage("how do I reset it?")],
        "documents": [Document(page_content="Hold the reset button.", id="kb-1"), "Unplug the modem."]})
    assert [(t.role, t.text) for t in history] == [("user", "I have a router and a modem."),
                                                   ("assistant", "What do you need?")]
    assert query == "how do I reset it?" and [(p.id, p.text[:4]) for p in passages] == [("kb-1", "Hold"), ("1", "Unpl")]
    # the retriever's scores, in the shapes retrievers hand them over
    _, _, scored = gate_request({"question": "q", "documents": [
        (Document(page_content="a", id="d1"), 0.83), Document(page_content="b", metadata={"relevance_score": 0.4}),
        {"doc_id": "d3", "text": "c", "score": 12.5}, "d"]})
    assert [p.score for p in scored] == [0.83, 0.4, 12.5, None]
    with pytest.raises(ValueError, match=r"documents\[0\]\.score: the retriever's score must be a finite number"):
        gate_request({"question": "q", "documents": [{"text": "c", "score": "high"}]})
    history, query, _ = gate_request({"question": "and the modem?", "history": [("human", "hi"), ("ai", "hello")]})
    assert query == "and the modem?" and [t.role for t in history] == ["user", "assistant"]
    with pytest.raises(ValueError, match="needs the user's question"):
        gate_request({"history": [("ai", "hello")]})
    with pytest.raises(ValueError, match=r"history\[0\]: role 'wizard'"):
        gate_request({"question": "q", "history": [("wizard", "hi")]})
