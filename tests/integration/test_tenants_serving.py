"""Many assistants, one deployment (serve.tenants_file), served on local Ray with a real MLflow registry:

* four tenants from one deployment: two heads adapted from one model (one copy of its weights), one model with its
  own adapter, one followed through a registry alias; each request answered by its tenant's model, chosen by the
  OpenAI ``model`` field, the /v1/clarify ``model`` field or header, or the key's scope;
* isolation: a key scoped to one tenant gets 403 on every other model (existing or not), /v1/models lists what the
  caller may call, metrics carry the model, the request log is written per tenant, one tenant's rate limit sheds its
  own burst only;
* change while serving: one tenant's alias moves (its answers switch, no request of any tenant fails, the others keep
  their versions); the tenants file gains and loses a tenant.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from clarifier.core.config import ServeConfig
from clarifier.serving.auth import key_digest
from support.adapters import untrained_adapter, with_head
from support.metrics import metric_value

pytestmark = pytest.mark.integration

OPS, SUPPORT_KEY, HR_KEY = "ops-key-1c2d", "support-key-9e8f", "hr-key-5a6b"
HR_NAME = "tenants-clarifier-hr"
HISTORY = [{"role": "user", "text": "I have a router and a modem."},
           {"role": "assistant", "text": "Which one is acting up?"}]


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    base = untrained_adapter(tiny_model_dir, root / "base", threshold=1.0)
    return {"support": with_head(base, root / "support", threshold=2.0, seed=1),
            "bursty": with_head(base, root / "bursty", threshold=2.0, seed=2),
            "hr-v1": with_head(base, root / "hr-v1", threshold=2.0, seed=3),
            "hr-v2": with_head(base, root / "hr-v2", threshold=2.0, seed=4),
            "own": untrained_adapter(tiny_model_dir, root / "own", threshold=1.0, seed=7)}


@pytest.fixture(scope="module")
def hr_versions(folders, mlflow_server):
    import mlflow

    from clarifier.registry.registry import register_adapter

    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("serving-tenants")
    versions = []
    for i, key in enumerate(("hr-v1", "hr-v2")):
        with mlflow.start_run(run_name=key) as run:
            mlflow.log_artifacts(str(folders[key]), "adapter")
        mv = register_adapter(run.info.run_id, HR_NAME, alias="champion" if i == 0 else None, tracking_uri=mlflow_server)
        versions.append(f"{HR_NAME}/{mv.version}")
    return versions


def _tenants(folders, hr_versions=None) -> dict:
    return {"default": "support", "tenants": [
        {"name": "support", "model_uri": str(folders["support"]), "keys_sha256": [key_digest(SUPPORT_KEY)]},
        {"name": "hr", "model_uri": f"models:/{HR_NAME}@champion", "keys_sha256": [key_digest(HR_KEY)],
         "shadow_model_uri": f"models:/{HR_NAME}/2"},
        {"name": "own", "model_uri": str(folders["own"])},
        {"name": "bursty", "model_uri": str(folders["bursty"]), "rate_limit_per_s": 0.2, "rate_burst": 2},
    ]}


@pytest.fixture(scope="module")
def served(folders, hr_versions, mlflow_server, tmp_path_factory, port):
    from clarifier.serving.app import run_local
    from support.ray import start_ray

    root = tmp_path_factory.mktemp("tenants-serve")
    tenants_file = root / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump(_tenants(folders)))
    logs = root / "logs"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLARIFIER_API_KEYS", OPS)
        mp.setenv("CLARIFIER_CACHE", str(root / "cache"))
        with start_ray(4):
            cfg = ServeConfig(tenants_file=str(tenants_file), tenants_refresh_s=0.5, model_refresh_s=0.5, port=port,
                              cpus_per_replica=0.5, max_new_tokens=4, max_adapters_per_replica=2,
                              request_log={"uri": str(logs), "shard_age_s": 1, "compress": True})
            url = run_local(cfg, tracking_uri=mlflow_server, ready_timeout_s=240)
            yield {"url": url, "file": tenants_file, "logs": logs}


def _clarify(url, key=OPS, query="how do I reset it?", headers=None, **body):
    return httpx.post(f"{url}/v1/clarify", json={"history": HISTORY, "query": query, **body},
                      headers={**_auth(key), **(headers or {})}, timeout=120)


@pytest.mark.timeout(600)
def test_each_request_is_answered_by_its_tenants_model(served, folders, hr_versions):
    url = served["url"]
    by_field = _clarify(url, model="own")
    assert by_field.status_code == 200, by_field.text
    assert by_field.json()["model_version"] == str(folders["own"]) and by_field.json()["threshold"] == 1.0
    by_header = _clarify(url, headers={"X-Clarifier-Model": "hr"}).json()
    assert by_header["model_version"] == hr_versions[0] and by_header["threshold"] == 2.0
    assert _clarify(url).json()["model_version"] == str(folders["support"])  # the default tenant
    assert _clarify(url, key=SUPPORT_KEY).json()["model_version"] == str(folders["support"])  # the key's tenant
    assert _clarify(url, key=HR_KEY).json()["model_version"] == hr_versions[0]
    # heads over one adapter: the same turn, the same trunk, each tenant's own head
    support = _clarify(url, model="support", query="which plan?").json()["confidence"]
    hr = _clarify(url, model="hr", query="which plan?").json()["confidence"]
    assert support != hr
    chat = httpx.post(f"{url}/v1/chat/completions", headers=_auth(HR_KEY), timeout=120, json={
        "model": "hr", "messages": [{"role": "user", "content": "how do I reset it?"}]}).json()
    assert chat["model"] == "hr" and chat["clarifier"]["model_version"] == hr_versions[0]
    batch = httpx.post(f"{url}/v1/clarify/batch", headers={**_auth(OPS), "X-Clarifier-Model": "own"}, timeout=120,
                       json=[{"query": "a?"}, {"query": "b?", "model": "own"}])
    assert batch.status_code == 200 and {r["model_version"] for r in batch.json()} == {str(folders["own"])}
    mixed = httpx.post(f"{url}/v1/clarify/batch", headers=_auth(OPS), timeout=120,
                       json=[{"query": "a?", "model": "own"}, {"query": "b?", "model": "hr"}])
    assert mixed.status_code == 400 and "names ['hr', 'own']" in mixed.text


@pytest.mark.timeout(600)
def test_concurrent_tenants_share_batches_and_never_fail(served, folders):
    """Requests of three tenants at once (two heads over one adapter, one adapter of its own): every one answered by
    its own model, and the replica's dynamic batches mix tenants (one forward pass per adapter) instead of running one
    batch per tenant side by side."""
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    url = served["url"]
    tenants = ["support", "hr", "own"] * 8
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda kv: (kv[1], _clarify(url, model=kv[1], query=f"reset {kv[0]}?")),
                                enumerate(tenants)))
    assert [r.status_code for _, r in answers] == [200] * len(tenants)
    for tenant, r in answers:
        if tenant in ("support", "own"):  # own: a trunk of its own, in the same batches
            assert r.json()["model_version"] == str(folders[tenant])
    stats = serve.get_deployment_handle("ClarifierModel", app_name="clarifier").batch_stats.remote().result()
    assert stats["mixed"] >= 1 and stats["most_tenants"] >= 2, stats


@pytest.mark.timeout(600)
def test_isolation_rules(served):
    url = served["url"]
    for named in ("hr", "no-such-model"):  # a scoped key learns nothing of other tenants
        r = _clarify(url, key=SUPPORT_KEY, model=named)
        assert r.status_code == 403 and r.json()["detail"]["error"] == "model_not_allowed", r.text
    r = httpx.post(f"{url}/v1/chat/completions", headers=_auth(SUPPORT_KEY), timeout=60, json={
        "model": "hr", "messages": [{"role": "user", "content": "reset it?"}]})
    assert r.status_code == 403 and "scoped to model 'support'" in r.json()["error"]["message"]  # OpenAI's shape
    r = _clarify(url, model="finance-v9")
    assert r.status_code == 404 and "served: support, hr, own, bursty" in r.json()["detail"]["message"]
    assert _clarify(url, key="wrong-key").status_code == 401
    listed = httpx.get(f"{url}/v1/models", headers=_auth(SUPPORT_KEY), timeout=60).json()
    assert [m["id"] for m in listed["data"]] == ["support"]
    listed = httpx.get(f"{url}/v1/models", headers=_auth(OPS), timeout=60).json()
    assert [m["id"] for m in listed["data"]] == ["support", "hr", "own", "bursty"]

    # metrics carry the model that answered
    text = httpx.get(f"{url}/metrics", headers=_auth(OPS), timeout=60).text
    assert metric_value(text, "clarifier_requests_total", model="support", route="clarify", status="403") >= 2
    assert metric_value(text, "clarifier_decisions_total", model="own") >= 1
    assert metric_value(text, "clarifier_rejected_total", reason="tenant") >= 4
    assert metric_value(text, "clarifier_tenants") == 4

    # one tenant's rate limit sheds its own burst; the others are answered meanwhile
    codes = [_clarify(url, model="bursty", query=f"burst {i}?").status_code for i in range(5)]
    assert codes[:2] == [200, 200] and set(codes[2:]) == {429}
    r = _clarify(url, model="bursty")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and r.json()["detail"]["error"] == "rate_limited"
    assert _clarify(url, model="support").status_code == 200 and _clarify(url, model="own").status_code == 200


def _logged(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.rglob("*.jsonl.gz")):
        out += [json.loads(line) for line in gzip.decompress(f.read_bytes()).decode().splitlines()]
    return out


@pytest.mark.timeout(600)
def test_request_logs_are_written_per_tenant_with_the_tenants_shadow(served, hr_versions):
    from clarifier.registry.shadow import read_records, shadow_stats

    url = served["url"]
    assert _clarify(url, model="own", query="log me in own?", conversation_id="c-own").status_code == 200
    assert _clarify(url, key=HR_KEY, query="log me in hr?", conversation_id="c-hr").status_code == 200
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        own, hr = _logged(served["logs"] / "own"), _logged(served["logs"] / "hr")
        if any(r["conversation_id"] == "c-own" for r in own) and any(r["conversation_id"] == "c-hr" for r in hr):
            break
        time.sleep(1)
    assert any(r["conversation_id"] == "c-own" for r in own) and not any(r["conversation_id"] == "c-hr" for r in own)
    assert any(r["conversation_id"] == "c-hr" for r in hr) and not any(r["conversation_id"] == "c-own" for r in hr)
    assert not list(served["logs"].glob("*.jsonl.gz"))  # nothing outside a tenant's folder
    # hr's challenger scored its requests beside the champion, into hr's log only: the promotion gate's evidence
    assert all("shadow" not in r["turns"][-1]["meta"] for r in own)
    stats = shadow_stats(read_records(str(served["logs"] / "hr")), hr_versions[1], hr_versions[0])
    assert stats["requests"] >= 1 and stats["failed"] == 0, stats
    text = httpx.get(f"{url}/metrics", headers=_auth(OPS), timeout=60).text
    assert metric_value(text, "clarifier_shadow_total", model="hr") >= 1
    assert metric_value(text, "clarifier_shadow_total", model="own") == 0


@pytest.mark.timeout(600)
def test_a_tenants_alias_move_switches_it_alone_without_failed_requests(served, folders, hr_versions, mlflow_server):
    from clarifier.registry.registry import set_alias

    url = served["url"]
    stop = threading.Event()
    seen: dict[str, list] = {"hr": [], "support": [], "own": []}
    failed: list = []

    def client(tenant: str):
        with httpx.Client(timeout=120) as http:
            n = 0
            while not stop.is_set():
                n += 1
                r = http.post(f"{url}/v1/clarify", headers=_auth(OPS),
                              json={"history": HISTORY, "query": f"reset it? {n}", "model": tenant})
                if r.status_code != 200:
                    failed.append((tenant, r.status_code, r.text[:200]))
                else:
                    seen[tenant].append(r.json()["model_version"])

    threads = [threading.Thread(target=client, args=(t,), daemon=True) for t in seen]
    for t in threads:
        t.start()
    time.sleep(3)
    set_alias(HR_NAME, "champion", hr_versions[1].split("/")[1], tracking_uri=mlflow_server)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (not seen["hr"] or seen["hr"][-1] != hr_versions[1]):
        time.sleep(0.5)
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(120)
    assert not failed, failed[:3]
    hr = seen["hr"]
    assert hr[0] == hr_versions[0] and hr[-1] == hr_versions[1]
    switch = hr.index(hr_versions[1])
    assert set(hr[switch:]) == {hr_versions[1]}  # once switched, never back
    assert set(seen["support"]) == {str(folders["support"])} and set(seen["own"]) == {str(folders["own"])}
    assert len(seen["support"]) > 3 and len(seen["own"]) > 3


@pytest.mark.timeout(600)
def test_tenants_are_added_and_removed_while_serving(served, folders):
    url = served["url"]
    spec = _tenants(folders)
    spec["tenants"] = [t for t in spec["tenants"] if t["name"] != "bursty"] + [
        {"name": "finance", "model_uri": str(folders["own"])}]
    served["file"].write_text(yaml.safe_dump(spec))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _clarify(url, model="finance").status_code != 200:
        time.sleep(0.5)
    r = _clarify(url, model="finance")
    assert r.status_code == 200 and r.json()["model_version"] == str(folders["own"])
    assert _clarify(url, model="bursty").status_code == 404
    assert _clarify(url, key=SUPPORT_KEY).status_code == 200
    served["file"].write_text("tenants: [{name: Broken, model_uri: x}]")  # refused: the tenants stay
    time.sleep(2)
    assert _clarify(url, model="finance").status_code == 200
    text = httpx.get(f"{url}/metrics", headers=_auth(OPS), timeout=60).text
    assert metric_value(text, "clarifier_tenants_reloads_total", outcome="refused") >= 1
    assert metric_value(text, "clarifier_tenants_reloads_total", outcome="applied") >= 1
