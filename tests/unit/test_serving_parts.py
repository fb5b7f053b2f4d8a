"""Pure parts of the serving layer (no Ray started): API keys, model hot-switch, metrics."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest

from clarifier.core.config import ConfigError
from clarifier.serving.auth import ApiKeyAuth, key_digests, load_api_keys, presented_key
from clarifier.serving.lifecycle import ModelLifecycle, parse_alias_uri, pinned_uri

# ---- API keys ------------------------------------------------------------------------------------


def test_keys_from_env_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# ops keys\nfile-key-1\n\n  file-key-2  \nenv-key-a\n")
    keys = load_api_keys(str(f), environ={"CLARIFIER_API_KEYS": " env-key-a, env-key-b ,,"})
    assert keys == ["env-key-a", "env-key-b", "file-key-1", "file-key-2"]
    assert load_api_keys(None, environ={}) == []
    assert load_api_keys(None, environ={"CLARIFIER_API_KEYS": " , "}) == []


def test_bad_key_files_are_errors_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match="api_keys_file .*missing.*does not exist"):
        load_api_keys(str(tmp_path / "missing"), environ={})
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="holds no API key"):
        load_api_keys(str(empty), environ={"CLARIFIER_API_KEYS": "k"})  # env keys do not excuse a bad file


def test_check_compares_against_every_key_and_off_only_without_keys(monkeypatch):
    auth = ApiKeyAuth(key_digests(["alpha-key", "beta-key", "gamma-key"]))
    assert auth.enabled and auth.n_keys == 3
    assert auth.check("alpha-key") and auth.check("gamma-key")
    for bad in (None, "", "alpha", "alpha-key ", "ALPHA-KEY", "delta-key"):
        assert not auth.check(bad), bad

    import clarifier.serving.auth as auth_mod

    calls = []
    real = auth_mod.hmac.compare_digest
    monkeypatch.setattr(auth_mod.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert auth.check("alpha-key")  # matches the first key ...
    assert len(calls) == 3  # ... yet every configured digest is compared (no early exit)

    off = ApiKeyAuth(())
    assert not off.enabled and off.check(None) and off.check("anything")


def test_digests_not_keys_are_kept():
    auth = ApiKeyAuth(key_digests(["s3cr3t-value"]))
    assert "s3cr3t-value" not in repr(vars(auth))


def test_presented_key_headers():
    assert presented_key({"authorization": "Bearer abc"}) == "abc"
    assert presented_key({"authorization": "bearer   abc "}) == "abc"
    assert presented_key({"x-api-key": " k "}) == "k"
    assert presented_key({"authorization": "Basic abc", "x-api-key": "k"}) == "k"
    assert presented_key({"authorization": "Bearer "}) is None
    assert presented_key({}) is None


# ---- hot switch ----------------------------------------------------------------------------------


class FakeEngine:
    def __init__(self, version):
        self.version = version


def test_alias_uri_parsing():
    assert parse_alias_uri("models:/clarifier@champion") == ("clarifier", "champion")
    assert parse_alias_uri("models:/clarifier/3") is None
    assert parse_alias_uri("/some/folder") is None and parse_alias_uri("runs:/abc/adapter") is None
    assert pinned_uri("clarifier/4") == "models:/clarifier/4"


def test_switch_loads_new_beside_old_then_releases_old():
    loaded = []
    target = {"v": "m/1"}

    def load(uri):
        loaded.append(uri)
        return FakeEngine("m/1" if uri == "models:/m@champion" else uri.split("models:/")[1])

    switches = []
    lc = ModelLifecycle(load, "models:/m@champion", probe=lambda: target["v"], refresh_s=0,
                        on_switch=lambda old, new, s: switches.append((old, new)))
    assert not lc.loaded
    with pytest.raises(RuntimeError, match="not loaded"):
        lc.engine
    lc.load_initial()
    old = weakref.ref(lc.engine)
    held_by_batch = lc.engine  # a batch in flight keeps its engine
    assert lc.poll_once() is False and loaded == ["models:/m@champion"]  # alias unchanged: nothing loaded
    target["v"] = "m/2"
    assert lc.poll_once() is True
    assert lc.version == "m/2" and loaded[-1] == "models:/m/2" and switches == [("m/1", "m/2")]
    assert held_by_batch.version == "m/1"  # the running batch finishes on the old engine
    del held_by_batch
    gc.collect()
    assert old() is None  # and then it is freed
    assert lc.poll_once() is False and len(loaded) == 2


def test_failed_probe_or_load_keeps_serving_and_backs_off(caplog):
    now = {"t": 0.0}
    state = {"fail_load": True, "fail_probe": False}

    def load(uri):
        if uri != "models:/m@a" and state["fail_load"]:
            raise OSError("artifact store down")
        return FakeEngine("m/1" if uri == "models:/m@a" else "m/2")

    def probe():
        if state["fail_probe"]:
            raise ConnectionError("registry down")
        return "m/2"

    lc = ModelLifecycle(load, "models:/m@a", probe=probe, refresh_s=10, clock=lambda: now["t"])
    lc.load_initial()
    with caplog.at_level(logging.WARNING, logger="ray.serve.clarifier"):
        assert lc.poll_once() is False and lc.version == "m/1"
        assert "loading m/2 failed" in caplog.text
        state["fail_load"] = False
        assert lc.poll_once() is False  # still inside the backoff window (20 s)
        now["t"] = 25.0
        state["fail_probe"] = True
        assert lc.poll_once() is False and "registry down" in caplog.text
        state["fail_probe"] = False
        assert lc.poll_once() is True and lc.version == "m/2"


def test_a_version_that_keeps_failing_is_tried_ever_later_up_to_an_hour():
    now = {"t": 0.0}
    tried_at = []

    def load(uri):
        if uri == "models:/m@a":
            return FakeEngine("m/1")
        tried_at.append(now["t"])
        raise OSError("corrupt artifact")

    lc = ModelLifecycle(load, "models:/m@a", probe=lambda: "m/2", refresh_s=300, clock=lambda: now["t"])
    lc.load_initial()
    for i in range(40):  # a poll every refresh_s, on the fake clock
        now["t"] = i * 300.0
        assert lc.poll_once() is False and lc.version == "m/1"
    # waits of refresh_s * 2**failures: 600, 1200, 2400 s, then the 1 h cap
    assert tried_at == [0.0, 600.0, 1800.0, 4200.0, 7800.0, 11400.0]


def test_watcher_thread_switches_and_stops():
    target = {"v": "m/1"}
    switched = threading.Event()
    lc = ModelLifecycle(lambda uri: FakeEngine("m/1" if "@" in uri else uri[len("models:/"):]), "models:/m@a",
                        probe=lambda: target["v"], refresh_s=0.05, on_switch=lambda *a: switched.set())
    lc.load_initial()
    lc.start()
    try:
        target["v"] = "m/7"
        assert switched.wait(10), "the watcher did not switch"
        assert lc.version == "m/7"
    finally:
        lc.stop()
    assert lc._thread is None
    # no probe (a folder or a pinned version): nothing to watch
    fixed = ModelLifecycle(lambda uri: FakeEngine("x"), "/folder", refresh_s=1)
    fixed.load_initial()
    fixed.start()
    assert not fixed.watching and fixed._thread is None and fixed.poll_once() is False


# ---- metrics -------------------------------------------------------------------------------------


def test_ingress_metrics_classify_answers():
    from prometheus_client.parser import text_string_to_metric_families

    from clarifier.core.schema import ClarifyResponse
    from clarifier.serving.metrics import IngressMetrics

    m = IngressMetrics(ray=False)
    m.observe_answer(ClarifyResponse(needs_clarification=False, confidence=0.1, model_version="v"))  # fast
    m.observe_answer(ClarifyResponse(needs_clarification=True, confidence=0.9, question="Which?", model_version="v"))
    m.observe_answer(ClarifyResponse(needs_clarification=False, confidence=0.8, model_version="v", valid_output=False))
    m.observe_request("clarify", 200, 0.02)
    text, ctype = m.render()
    assert ctype.startswith("text/plain")
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}
    assert got[("clarifier_decisions_total", (("decision", "answer"), ("model", "")))] == 2
    assert got[("clarifier_decisions_total", (("decision", "clarify"), ("model", "")))] == 1
    assert got[("clarifier_path_total", (("model", ""), ("path", "fast")))] == 1
    assert got[("clarifier_path_total", (("model", ""), ("path", "generate")))] == 2
    assert got[("clarifier_invalid_outputs_total", (("model", ""),))] == 1
    assert got[("clarifier_requests_total", (("model", ""), ("route", "clarify"), ("status", "200")))] == 1
    assert got[("clarifier_request_latency_seconds_count", (("model", ""), ("route", "clarify")))] == 1
    m.observe_answer(ClarifyResponse(needs_clarification=False, confidence=0.1, model_version="v"), model="hr")
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(m.render()[0].decode()) for s in fam.samples}
    assert got[("clarifier_decisions_total", (("decision", "answer"), ("model", "hr")))] == 1  # per tenant


# ---- ingress: a model replica lost mid-request ------------------------------------------------------


class _FakeMethod:
    def __init__(self, outcomes: list):
        self.outcomes, self.calls = outcomes, 0

    async def _next(self, arg):
        self.calls += 1
        out = self.outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return (out, arg)

    def remote(self, arg):
        return self._next(arg)


def _fake_ingress(outcomes: list):
    from types import SimpleNamespace

    from clarifier.serving.metrics import IngressMetrics

    method = _FakeMethod(outcomes)
    return SimpleNamespace(model=SimpleNamespace(clarify=method), metrics=IngressMetrics(ray=False)), method


def _lost(metrics, outcome: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text, _ = metrics.render()
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name == "clarifier_replica_lost_total" and s.labels == {"outcome": outcome}:
                return s.value
    return 0.0


class _Records(logging.Handler):
    """The serving logger's records (Serve stops it propagating to caplog once imported)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_ingress_resends_a_request_whose_model_replica_died():
    import asyncio

    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from clarifier.serving.ingress import ClarifierIngress

    call_model = ClarifierIngress.func_or_class._call_model
    ingress, method = _fake_ingress([ActorDiedError(), ActorUnavailableError("gone", None), "answer"])
    records, serve_log = _Records(), logging.getLogger("ray.serve.clarifier")
    serve_log.addHandler(records)
    try:
        assert asyncio.run(call_model(ingress, "clarify", "req")) == ("answer", "req")
    finally:
        serve_log.removeHandler(records)
    assert method.calls == 3 and _lost(ingress.metrics, "retried") == 2
    assert records.messages == [
        "model replica lost during clarify (ActorDiedError); sending the request again (retry 1 of 2)",
        "model replica lost during clarify (ActorUnavailableError); sending the request again (retry 2 of 2)"]

    ingress, method = _fake_ingress([ActorDiedError()] * 3)  # retries exhausted: raised, counted
    with pytest.raises(ActorDiedError):
        asyncio.run(call_model(ingress, "clarify", "req"))
    assert method.calls == 3 and _lost(ingress.metrics, "unavailable") == 1

    ingress, method = _fake_ingress([RuntimeError("the model failed"), "unused"])  # not a lost replica
    with pytest.raises(RuntimeError):
        asyncio.run(call_model(ingress, "clarify", "req"))
    assert method.calls == 1 and _lost(ingress.metrics, "retried") == 0


def test_a_lost_replica_is_a_retryable_503_not_a_500():
    import json

    from ray.exceptions import ActorDiedError

    from clarifier.serving.ingress import ClarifierIngress

    ingress, _ = _fake_ingress([])
    resp = ClarifierIngress.func_or_class._unavailable(ingress, ActorDiedError())
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert json.loads(resp.body)["detail"]["error"] == "unavailable"
