"""The OpenAI-compatible endpoint and the LangChain gate against a running Serve app, with the real
client libraries: the `openai` client (documents in extra_body, a question, CLEAR, usage, Clarifier's
extra fields, /v1/models, a missing key, unsupported parameters, overload) and langchain-core (a RAG
chain behind ``clarify_or``).

Two real apps on one Serve instance: one whose adapter asks for every turn (threshold 0: the tiny
random model's question is noise kept to a parseable target), one that never asks (threshold 1.01).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from clarifier.core.config import ServeConfig
from clarifier.runtime.services import free_port

pytestmark = pytest.mark.integration

KEY = "chat-key-5d1e"
MESSAGES = [{"role": "system", "content": "You are a support assistant."},
            {"role": "user", "content": "I have a router and a modem."},
            {"role": "assistant", "content": "Sure, what do you need?"},
            {"role": "user", "content": "how do I reset it?"}]
DOCS = [{"doc_id": "kb-1", "text": "Hold the router's reset button for 10 seconds."},
        {"doc_id": "kb-2", "text": "Unplug the modem for 30 seconds to reset it."}]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory) -> dict:
    from ray import serve

    from clarifier.serving.app import build_app, run_local
    from support.adapters import untrained_adapter
    from support.ray import start_ray

    tmp = tmp_path_factory.mktemp("chat")
    asks = untrained_adapter(tiny_model_dir, tmp / "asks", threshold=0.0)
    silent = untrained_adapter(tiny_model_dir, tmp / "silent", threshold=1.01)
    with pytest.MonkeyPatch.context() as mp, start_ray(4):
        mp.setenv("CLARIFIER_API_KEYS", KEY)
        cfg = ServeConfig(model_uri=str(asks), port=free_port(), max_new_tokens=12, cpus_per_replica=0.5, max_chars=20_000,
                          model_name="clarifier-test")
        url = run_local(cfg, ready_timeout_s=120)
        serve.run(build_app(cfg.model_copy(update={"model_uri": str(silent), "model_name": None})), name="silent",
                  route_prefix="/silent")
        from clarifier.serving.app import wait_ready

        wait_ready(url + "/silent", timeout_s=120)
        yield {"asks": url, "silent": url + "/silent", "silent_model": silent}


def _client(base: str, key: str | None = KEY, **kw):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key=key or "none", max_retries=0, timeout=60, **kw)


@pytest.mark.timeout(300)
def test_the_openai_client_gets_a_question_grounded_in_the_documents(servers):
    c = _client(servers["asks"])
    out = c.chat.completions.create(model="granite-4.0-micro", messages=MESSAGES, temperature=0.0,
                                    max_completion_tokens=64, extra_body={"documents": DOCS})
    assert out.object == "chat.completion" and out.model == "clarifier-test" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    clarification = json.loads(choice.message.content)["clarification"]
    extra = out.model_extra["clarifier"]
    if extra["valid_output"]:
        assert extra["needs_clarification"] and clarification == extra["question"] and clarification != "CLEAR"
    else:  # the noise did not parse: answered as clear, never an error
        assert clarification == "CLEAR"
    assert set(extra["grounding"]["passages"]) <= {"kb-1", "kb-2"} and extra["confidence"] >= extra["threshold"] == 0.0
    assert out.usage.prompt_tokens > 20 and out.usage.completion_tokens >= 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    models = c.models.list()
    assert [m.id for m in models.data] == ["clarifier-test"]


@pytest.mark.timeout(300)
def test_a_clear_turn_answers_CLEAR_with_no_generated_tokens(servers):
    out = _client(servers["silent"]).chat.completions.create(model="anything", messages=MESSAGES,
                                                             extra_body={"documents": DOCS})
    assert json.loads(out.choices[0].message.content) == {"clarification": "CLEAR"}
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens > 20
    assert out.model == Path(servers["silent_model"]).name  # no serve.model_name: the folder's name
    assert out.model_extra["clarifier"]["needs_clarification"] is False


@pytest.mark.timeout(300)
def test_a_missing_or_wrong_key_is_the_clients_authentication_error(servers):
    import openai

    for key in ("wrong-key", None):
        with pytest.raises(openai.AuthenticationError) as info:
            _client(servers["asks"], key=key).chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
        assert KEY not in str(info.value.body)
    with pytest.raises(openai.AuthenticationError):
        _client(servers["asks"], key="wrong-key").models.list()


@pytest.mark.timeout(300)
def test_unsupported_parameters_and_bad_conversations_are_bad_requests(servers):
    import openai

    c = _client(servers["asks"])
    cases = [({"stream": True}, "stream"), ({"n": 2}, "n"), ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
             ({"messages": [*MESSAGES, {"role": "assistant", "content": "Hold it."}]}, "messages")]
    for extra, param in cases:
        kw = {"model": "m", "messages": MESSAGES, **extra}
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(**kw)
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
        assert info.value.body["type"] == "invalid_request_error" and info.value.body["message"]
    # over a size limit: the 413 in OpenAI's shape, naming the limit
    r = httpx.post(f"{servers['asks']}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"messages": [{"role": "user", "content": "x" * 30_000}]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "max_chars"


@pytest.mark.timeout(300)
def test_overload_is_a_503_with_retry_after_in_openais_shape(servers):
    """The default admission (the latency budget) in front of a slow model side that answers one
    request at a time: a second request while the first is being answered is refused at once, and
    the client sees Retry-After."""
    import asyncio

    import openai
    from ray import serve

    from clarifier.core.schema import ClarifyResponse
    from clarifier.serving.ingress import ClarifierIngress

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1)
    class SlowModel:  # defined here so it is pickled by value
        async def clarify(self, request):
            await asyncio.sleep(3)
            return ClarifyResponse(needs_clarification=False, confidence=0.1, threshold=0.5, model_version="slow")

        async def version(self):
            return "slow"

    ingress = ClarifierIngress.options(ray_actor_options={"num_cpus": 0}).bind(SlowModel.bind(), latency_budget_s=5.0,
                                                                              initial_limit=1)
    serve.run(ingress, name="slow", route_prefix="/slow")
    try:
        base = servers["asks"] + "/slow"
        first = threading.Thread(target=lambda: _client(base).chat.completions.create(model="m", messages=MESSAGES))
        first.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            _client(base).chat.completions.create(model="m", messages=MESSAGES)
        assert time.monotonic() - t0 < 2.5  # refused, not queued behind the first
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"]
        assert info.value.body["code"] == "overloaded" and info.value.body["param"] == "latency_budget_s"
        assert "retry after" in info.value.body["message"]
        first.join(timeout=30)
        # once the first is answered, the next one gets through
        done = _client(base).chat.completions.create(model="m", messages=MESSAGES)
        assert json.loads(done.choices[0].message.content) == {"clarification": "CLEAR"}
    finally:
        serve.delete("slow")


@pytest.mark.timeout(300)
def test_the_clarifier_client_speaks_the_same_contract(servers):
    from clarifier.client import ClarifierAPIError, ClarifierClient, clarification_of

    with ClarifierClient(servers["silent"], api_key=KEY) as c:
        out = c.chat_completions(MESSAGES, DOCS, model="m")
        assert clarification_of(out) is None and out["usage"]["completion_tokens"] == 0
        with pytest.raises(ClarifierAPIError) as info:
            c.chat_completions(MESSAGES, stream=True)
        assert info.value.status == 400 and info.value.detail["param"] == "stream"


@pytest.mark.timeout(300)
def test_a_langchain_rag_chain_asks_instead_of_retrieving(servers):
    from langchain_core.language_models.fake import FakeListLLM
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda

    from clarifier.client import ClarifierClient
    from clarifier.integrations.langchain import ClarifierGate, clarify_or

    retrieved: list[str] = []

    def retrieve(x: dict) -> dict:
        retrieved.append(x["question"])
        return {**x, "context": "\n".join(d["text"] for d in DOCS)}

    prompt = ChatPromptTemplate.from_messages([("system", "Answer from: {context}"), ("human", "{question}")])
    rag = RunnableLambda(retrieve) | prompt | FakeListLLM(responses=["Hold the reset button."]) | StrOutputParser()
    turn = {"question": "how do I reset it?", "history": [("human", "I have a router and a modem."),
                                                          ("ai", "Sure, what do you need?")]}

    asking = clarify_or(rag, ClarifierClient(servers["asks"], api_key=KEY))
    gate = ClarifierGate(base_url=servers["asks"], api_key=KEY).invoke(turn)
    answer = asking.invoke(turn)
    if gate["clarification"] is not None:  # the model asked: the chain answers with the question, no retrieval
        assert isinstance(answer, str) and answer and not retrieved
    else:  # its noise did not parse this time: answered as clear, so the chain retrieved
        assert answer == "Hold the reset button." and retrieved
    assert gate["clarifier"]["threshold"] == 0.0 and gate["question"] == turn["question"]

    silent = clarify_or(rag, base_url=servers["silent"], api_key=KEY)
    assert silent.invoke(turn) == "Hold the reset button." and retrieved[-1] == "how do I reset it?"
    assert silent.batch([turn, {**turn, "question": "and the modem?"}]) == ["Hold the reset button."] * 2
