"""Ray Serve application end to end: a tiny model + LoRA adapter served locally over HTTP.

The adapter's threshold is 0 so every request takes the generation path; the tiny random model
produces garbage, which exercises the engine's malformed-output fallback (valid_output=False).
The first tests (config file, app_builder args) do not start Ray.
"""

from __future__ import annotations

import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (tinymodel)

from clarifier.config import ConfigError, ServeConfig  # noqa: E402
from clarifier.schema import ClarifyResponse  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MAX_HISTORY = 5
MAX_CHARS = 3000

HISTORY = [
    {"role": "user", "text": "I have a checking account and a savings account."},
    {"role": "assistant", "text": "Got it, how can I help with them?"},
]
PASSAGES = [{"id": "p1", "text": "To close an account, visit the branch."}, {"id": "p2", "text": "Savings accounts earn interest."}]


# ---- no Ray ------------------------------------------------------------------------------------


def test_serve_config_file_is_a_valid_serve_deploy_config():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((REPO / "serve" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data)
    (app,) = [a for a in schema.applications if a.name == "clarifier"]
    assert app.import_path == "clarifier.serving.app:app_builder"
    assert app.route_prefix == "/"
    assert app.args["model_uri"] == "models:/clarifier@champion"
    from clarifier.serving.app import parse_app_args

    cfg, _ = parse_app_args(app.args)  # the file's args are valid ServeConfig overrides
    assert cfg.model_uri == "models:/clarifier@champion"


def test_app_builder_args_are_validated():
    from clarifier.serving.app import app_builder, parse_app_args

    cfg, tracking = parse_app_args({"model_uri": "/m", "num_replicas": "2", "max_batch_size": "4",
                                    "tracking_uri": "http://mlflow:5000"})
    assert (cfg.model_uri, cfg.num_replicas, cfg.max_batch_size, tracking) == ("/m", 2, 4, "http://mlflow:5000")
    with pytest.raises(ConfigError, match="num_replica"):
        app_builder({"model_uri": "/m", "num_replica": 2})
    with pytest.raises(ConfigError, match="max_batch_size"):
        app_builder({"max_batch_size": "zero"})
    app = app_builder({"model_uri": "/m"})  # builds (binds) without touching Ray
    assert app is not None


def test_serve_app_reexport():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_app_reexport", REPO / "serve" / "app.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from clarifier.serving.app import app_builder, build_app

    assert mod.app_builder is app_builder and mod.build_app is build_app


# ---- live server -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from peft import LoraConfig, get_peft_model
    from tinymodel import build_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clarifier.inference import ModelMeta, write_meta

    root = tmp_path_factory.mktemp("serving")
    base = build_tiny_model(root / "tiny")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    folder = root / "adapter"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    write_meta(folder, ModelMeta(base_model=str(base), threshold=0.0))
    return folder


@pytest.fixture(scope="module")
def server(model_folder):
    import ray
    from ray import serve

    from clarifier.serving.app import run_local

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = ServeConfig(model_uri=str(model_folder), port=_free_port(), max_new_tokens=12,
                          max_history_turns=MAX_HISTORY, max_chars=MAX_CHARS, max_batch_size=8,
                          batch_wait_timeout_s=0.05)
        url = run_local(cfg, ready_timeout_s=120)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _post(url, body, timeout=60):
    return httpx.post(f"{url}/v1/clarify", json=body, timeout=timeout)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_clarify_returns_full_response(server, model_folder):
    r = _post(server, {"history": HISTORY, "query": "how do I close it?", "passages": PASSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == set(ClarifyResponse.model_fields)
    resp = ClarifyResponse.model_validate(body)
    assert resp.model_version == str(model_folder)
    assert isinstance(resp.needs_clarification, bool)
    assert 0.0 <= resp.confidence <= 1.0
    if not resp.valid_output:  # garbage from the random tiny model -> fallback, never an error
        assert resp.needs_clarification is False and resp.question is None
    else:
        assert resp.needs_clarification is True and resp.question


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_invalid_bodies_are_422_naming_the_field(server):
    r = _post(server, {"history": HISTORY})
    assert r.status_code == 422
    assert any(e["loc"][-1] == "query" for e in r.json()["detail"]), r.text
    r = _post(server, {"query": "x", "history": [{"role": "robot", "text": "hi"}]})
    assert r.status_code == 422 and "role" in r.text
    r = _post(server, {"query": "x", "unexpected": 1})
    assert r.status_code == 422 and "unexpected" in r.text


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_limits_are_413_naming_the_limit(server):
    turns = [{"role": "user", "text": f"turn {i}"} for i in range(MAX_HISTORY + 1)]
    r = _post(server, {"history": turns, "query": "which one?"})
    assert r.status_code == 413, r.text
    d = r.json()["detail"]
    assert d["limit"] == "max_history_turns" and d["value"] == MAX_HISTORY + 1 and d["max"] == MAX_HISTORY
    r = _post(server, {"query": "why?", "passages": [{"id": "p", "text": "x" * MAX_CHARS}]})
    assert r.status_code == 413
    d = r.json()["detail"]
    assert d["limit"] == "max_chars" and d["value"] == MAX_CHARS + 4


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_health_ready_and_docs(server, model_folder):
    assert httpx.get(f"{server}/healthz").status_code == 200
    r = httpx.get(f"{server}/readyz", timeout=30)
    assert r.status_code == 200 and r.json()["model_version"] == str(model_folder)
    spec = httpx.get(f"{server}/openapi.json").json()
    assert "/v1/clarify" in spec["paths"] and "post" in spec["paths"]["/v1/clarify"]
    assert httpx.get(f"{server}/docs").status_code == 200


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_concurrent_requests_are_batched_and_all_succeed(server):
    bodies = [{"history": HISTORY, "query": f"how do I close it? ({i})", "passages": PASSAGES} for i in range(8)]
    t0 = time.time()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: _post(server, b, timeout=120), bodies))
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results if r.status_code != 200]
    for r in results:
        ClarifyResponse.model_validate(r.json())
    assert time.time() - t0 < 120


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_client_against_server(server, model_folder):
    from clarifier.client import ClarifierAPIError, ClarifierClient
    from clarifier.schema import Passage, Turn

    with ClarifierClient(server, api_key="secret", timeout=60) as c:
        assert c.ready()
        assert c.model_version() == str(model_folder)
        resp = c.clarify([Turn(**HISTORY[0]), HISTORY[1]], "how do I close it?", [Passage(**PASSAGES[0])])
        assert isinstance(resp, ClarifyResponse) and resp.model_version == str(model_folder)
        with pytest.raises(ClarifierAPIError) as ei:
            c.clarify(HISTORY, "")
        assert ei.value.status == 422 and "query" in str(ei.value.detail)
        with pytest.raises(ClarifierAPIError) as ei:
            c.clarify([{"role": "user", "text": "t"}] * (MAX_HISTORY + 1), "which?")
        assert ei.value.status == 413 and ei.value.detail["limit"] == "max_history_turns"


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_engine_errors_are_500_without_internals_and_slow_model_is_not_ready(server):
    import asyncio

    from ray import serve

    from clarifier.serving.app import ClarifierIngress

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class BrokenModel:  # defined in the test so it is pickled by value
        async def clarify(self, request):
            raise RuntimeError("SECRET /internal/path exploded")

        async def version(self):
            await asyncio.sleep(5)
            return "never"

    app = ClarifierIngress.options(ray_actor_options={"num_cpus": 0}).bind(BrokenModel.bind(), ready_timeout_s=0.5)
    serve.run(app, name="broken", route_prefix="/broken")
    try:
        r = _post(server + "/broken", {"query": "close it"})
        assert r.status_code == 500
        assert "SECRET" not in r.text and "Traceback" not in r.text and "RuntimeError" not in r.text
        assert r.json()["detail"]["error"] == "internal error"
        assert httpx.get(f"{server}/broken/healthz").status_code == 200
        assert httpx.get(f"{server}/broken/readyz", timeout=30).status_code == 503
        assert httpx.get(f"{server}/readyz", timeout=30).status_code == 200  # the real app is unaffected
    finally:
        serve.delete("broken")
