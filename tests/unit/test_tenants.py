"""Many assistants, one deployment: the tenants file and who may call what (clarifier.core.tenants), per-request
heads over one copy of the weights (Decider, weights_key), the replica's trunk pool, a tenant's rate limit and the
tenants file watch. Ray-free; the served app is tests/integration/test_tenants_serving.py."""

from __future__ import annotations

import json

import pytest

from clarifier.core.tenants import (Caller, TenantDirectory, TenantError, TenantsFileError, add_key_digest,
                                    parse_tenants)
from clarifier.serving.auth import key_digest

D_SUPPORT, D_HR = key_digest("support-key"), key_digest("hr-key")

FILE = f"""
default: support
tenants:
  - name: support
    model_uri: /models/support
    keys_sha256: [{D_SUPPORT}]
    rate_limit_per_s: 5
  - name: hr
    model_uri: models:/clarifier-hr@champion
    keys_sha256: [{D_HR}]
    latency_budget_s: 1.5
    shadow_model_uri: models:/clarifier-hr@challenger
"""


def test_a_tenants_file_parses_and_a_bad_one_names_the_entry():
    spec = parse_tenants(FILE)
    assert [t.name for t in spec.tenants] == ["support", "hr"] and spec.default == "support"
    assert spec.tenants[1].latency_budget_s == 1.5 and spec.tenants[0].mux_id == "support::/models/support"
    assert spec.tenants[1].shadow_mux_id == "hr~shadow::models:/clarifier-hr@challenger"  # "~": in no tenant's name
    assert parse_tenants(json.dumps(spec.model_dump())) == spec  # JSON too
    bad = {
        "tenants: []": "tenants",
        "tenants: [{name: Support, model_uri: x}]": "tenants.0.name: tenant name 'Support' must match",
        "tenants: [{name: a, model_uri: x}, {name: a, model_uri: y}]": "tenants[1]: name 'a' is already tenants[0]'s",
        "tenants: [{name: a, model_uri: x, keys_sha256: [plainkey]}]": "never the key itself",
        f"tenants: [{{name: a, model_uri: x, keys_sha256: [{D_HR}]}}, {{name: b, model_uri: y, keys_sha256: [{D_HR}]}}]":
            "scoped to both 'a' and 'b'",
        "default: c\ntenants: [{name: a, model_uri: x}]": "default 'c' is not a tenant",
        "tenants: [{name: a, model_uri: x, rate_limit_per_s: 0}]": "tenants.0.rate_limit_per_s",
        "tenants: [{name: a, model_uri: x, colour: red}]": "tenants.0.colour",
        "[1, 2]": "expected a mapping",
        "tenants: [": "not valid YAML",
    }
    for text, message in bad.items():
        with pytest.raises(TenantsFileError, match="^tenants.yaml: .*" + __import__("re").escape(message)):
            parse_tenants(text, where="tenants.yaml")


def test_who_may_call_which_model():
    d = TenantDirectory(parse_tenants(FILE))
    support, hr, operator = Caller("support"), Caller("hr"), Caller()
    assert d.scoped_tenant(D_SUPPORT) == "support" and d.scoped_tenant(key_digest("nope")) is None
    assert d.resolve(support, None).name == "support" and d.resolve(support, "support").name == "support"
    for named in ("hr", "no-such-model"):  # a scoped key learns nothing of the other tenants: 403 either way
        with pytest.raises(TenantError) as ei:
            d.resolve(support, named)
        assert ei.value.status == 403 and ei.value.code == "model_not_allowed" and "scoped to model 'support'" in \
            ei.value.message
    assert d.resolve(operator, "hr").name == "hr" and d.resolve(operator, None).name == "support"  # the default
    with pytest.raises(TenantError) as ei:
        d.resolve(operator, "finance")
    assert ei.value.status == 404 and "served: support, hr" in ei.value.message
    no_default = TenantDirectory(parse_tenants(FILE.replace("default: support\n", "")))
    with pytest.raises(TenantError) as ei:
        no_default.resolve(operator, "  ")
    assert ei.value.status == 400 and "one of: support, hr" in ei.value.message
    gone = TenantDirectory(parse_tenants(FILE.replace("default: support\n", "").split("  - name: hr")[0]))
    with pytest.raises(TenantError) as ei:  # the key's tenant was removed while serving
        gone.resolve(hr, None)
    assert ei.value.status == 403 and ei.value.code == "tenant_removed"
    assert [t.name for t in d.visible(support)] == ["support"] and len(d.visible(operator)) == 2
    assert d.changes(gone) == {"added": [], "removed": ["hr"], "changed": []}


def test_a_key_is_scoped_to_a_tenant_by_its_digest():
    data = {"tenants": [{"name": "a", "model_uri": "x"}]}
    assert add_key_digest(data, "a", D_HR)["tenants"][0]["keys_sha256"] == [D_HR]
    with pytest.raises(TenantsFileError, match="no tenant 'b'"):
        add_key_digest(data, "b", D_HR)


def test_a_tenants_rate_limit_is_a_token_bucket():
    from clarifier.serving.admission import RateLimit

    now = [0.0]
    rl = RateLimit(2.0, burst=3, clock=lambda: now[0])
    assert [rl.try_take() for _ in range(3)] == [0, 0, 0]
    assert rl.try_take() == 1  # empty: half a second to the next token, said as whole seconds
    now[0] += 0.5
    assert rl.try_take() == 0 and rl.try_take() == 1
    now[0] += 10
    assert [rl.try_take() for _ in range(4)] == [0, 0, 0, 1]  # refilled to the burst, no more
    assert rl.try_take(5) == 3


def test_the_tenants_file_is_read_again_and_a_bad_change_is_refused(tmp_path):
    from clarifier.serving.tenants import TenantsWatch, read_tenants

    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    spec, text = read_tenants(str(path))
    seen = []
    watch = TenantsWatch(str(path), 0, lambda d, err: seen.append((d and d.names, err)), initial_text=text)
    assert watch.poll_once() is False and seen == []  # unchanged
    path.write_text(FILE + "  - name: finance\n    model_uri: /models/finance\n")
    assert watch.poll_once() is True and seen[-1] == (["support", "hr", "finance"], None)
    path.write_text("tenants: [{name: X, model_uri: y}]")
    assert watch.poll_once() is False and seen[-1][0] is None and "tenant name 'X'" in seen[-1][1]
    assert watch.poll_once() is False and len(seen) == 2  # the same bad text is said once
    path.unlink()
    assert watch.poll_once() is False and "cannot read" in seen[-1][1]
    with pytest.raises(TenantsFileError, match="cannot be read"):
        read_tenants(str(path))


# ---- one copy of the weights, a head per tenant -------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    from support.adapters import untrained_adapter, with_head

    root = tmp_path_factory.mktemp("tenants")
    base = untrained_adapter(tiny_model_dir, root / "base", threshold=0.5)
    return {"base": base,
            "a": with_head(base, root / "a", threshold=0.3, seed=1),
            "b": with_head(base, root / "b", threshold=0.7, seed=2, layers=(2,), pooling=("last", "mean")),
            "own": untrained_adapter(tiny_model_dir, root / "own", threshold=0.5, seed=5)}


def test_models_adapted_from_one_share_its_weights_key(folders, tmp_path):
    import shutil

    from clarifier.engine.inference import read_meta, weights_key, write_meta

    key = weights_key(folders["base"])
    assert weights_key(folders["a"]) == key == weights_key(folders["b"])  # head, threshold, adapt.json differ
    assert weights_key(folders["own"]) != key  # its own adapter
    prompt = shutil.copytree(folders["a"], tmp_path / "prompt")
    meta = read_meta(prompt)
    meta.prompt = {"max_prompt_tokens": 200}
    write_meta(prompt, meta)
    assert weights_key(prompt) != key  # another prompt is another model
    extra = shutil.copytree(folders["a"], tmp_path / "extra")
    (extra / "notes.bin.txt").write_text("an unknown file")
    assert weights_key(extra) != key  # unknown files count: never wrongly shared


def _requests(n=6):
    from clarifier.core.schema import ClarifyRequest, ConversationLog
    from clarifier.data.synthetic import generate_conversations

    exs = [e for c in generate_conversations(20, seed=7) for e in ConversationLog.model_validate(c).explode()][:n]
    return [ClarifyRequest(history=e.history, query=e.query, passages=e.passages) for e in exs]


def test_one_pass_reads_each_request_with_its_own_head(folders):
    """A batch mixing three models over one trunk (two heads of different layers and pooling, and the decision
    tokens) answers each request as that model's own engine would, with its threshold and version."""
    from clarifier.engine.inference import ClarifierEngine, Decider

    engines = {k: ClarifierEngine.from_folder(folders[k], version=k, precision="fp32", max_new_tokens=8)
               for k in ("a", "b")}
    tokens = ClarifierEngine.from_folder(folders["a"], version="tokens", precision="fp32", max_new_tokens=8,
                                         decision_head=False)
    reqs = _requests(6)
    own = {k: e.clarify(reqs) for k, e in {**engines, "tokens": tokens}.items()}
    deciders = [engines["a"].decider, engines["b"].decider, tokens.decider] * 2
    calls = []
    trunk = engines["a"]
    real = trunk._decision_pass
    trunk._decision_pass = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        mixed = trunk.clarify(reqs, deciders=deciders)
    finally:
        trunk._decision_pass = real
    assert len(calls) == 1  # one forward pass for the three models
    for i, (r, d) in enumerate(zip(mixed, deciders)):
        ref = own[d.version][i]
        assert r.confidence == pytest.approx(ref.confidence, abs=1e-5)
        assert (r.threshold, r.model_version, r.needs_clarification) == (ref.threshold, d.version,
                                                                          ref.needs_clarification)
    assert {r.threshold for r in mixed} == {0.3, 0.7}  # the decision-token model is read at a's threshold
    with pytest.raises(ValueError, match="6 requests but 1 deciders"):
        trunk.clarify(reqs, deciders=deciders[:1])
    wide = Decider(engines["a"].decision_head.__class__([1, 9], engines["a"].decision_head.weight, 0.0), 0.5, "w")
    with pytest.raises(ValueError, match="reads layers"):
        trunk.check_decider(wide)


def test_a_replica_holds_one_trunk_per_weights_and_evicts_the_least_recently_used(folders):
    from clarifier.serving.tenant_model import Served, TrunkPool, clarify_grouped, served_loader, split_mux_id
    from clarifier.engine.inference import ClarifierEngine
    from clarifier.engine.loading import resolve_model

    loaded = []

    def load(folder, version):
        loaded.append(folder.name)
        return ClarifierEngine.from_folder(folder, version=version, precision="fp32", max_new_tokens=8)

    pool = TrunkPool(load, max_trunks=1)
    served = {k: served_loader(pool, k, resolve_model)(str(folders[k])) for k in ("a", "b", "own")}
    assert isinstance(served["a"], Served) and served["a"].version == str(folders["a"])
    assert served["a"].key == served["b"].key != served["own"].key
    assert loaded == ["a", "own"] and pool.evictions == 1 and pool.keys() == [served["own"].key]
    reqs = _requests(4)
    items = [(served["a"], reqs[0]), (served["own"], reqs[1]), (served["b"], reqs[2]), (served["own"], reqs[3])]
    out = clarify_grouped(pool, items)
    assert [r.model_version for r in out] == [served[k].version for k in ("a", "own", "b", "own")]
    assert [r.threshold for r in out] == [0.3, 0.5, 0.7, 0.5]
    assert loaded == ["a", "own", "a", "own"]  # the evicted trunk is loaded again when asked for; one at a time
    assert split_mux_id("hr::models:/x@champion") == ("hr", "models:/x@champion")
    with pytest.raises(ValueError, match="is not <tenant>::<model_uri>"):
        split_mux_id("hr")


def test_the_cli_scopes_a_new_key_to_a_tenant_and_checks_the_file(tmp_path, folders):
    from typer.testing import CliRunner

    from clarifier.cli import app
    from clarifier.core.tenants import TenantDirectory
    from clarifier.serving.tenants import read_tenants

    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  - name: a\n    model_uri: {folders['a']}\n  - name: b\n    model_uri: {folders['b']}\n"
                    f"  - name: own\n    model_uri: {folders['own']}\n    rate_limit_per_s: 2.5\n")
    runner = CliRunner()
    out = runner.invoke(app, ["tenants", "key", "b", "--file", str(path)])
    assert out.exit_code == 0, out.output
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("clk-") and key not in path.read_text()
    assert TenantDirectory(read_tenants(str(path))[0]).scoped_tenant(key_digest(key)) == "b"
    out = runner.invoke(app, ["tenants", "key", "finance", "--file", str(path)])
    assert out.exit_code == 2 and "no tenant 'finance'" in out.output
    out = runner.invoke(app, ["tenants", "check", str(path), "--resolve"])
    assert out.exit_code == 0, out.output
    assert "3 tenant(s)" in out.output and "2.5/s (burst 3)" in out.output
    assert "2 distinct weights for 3 tenant(s)" in out.output  # a and b share the base's adapter
    path.write_text("tenants: [{name: a}]")
    out = runner.invoke(app, ["tenants", "check", str(path)])
    assert out.exit_code == 2 and "tenants.0.model_uri" in out.output


class _Handle:
    """A model deployment handle whose calls wait until released (requests stay outstanding)."""

    def __init__(self, mux_id=None, calls=None, gate=None):
        import asyncio

        self.mux_id, self.calls = mux_id, calls if calls is not None else []
        self.gate = gate or asyncio.Event()

    def options(self, multiplexed_model_id):
        return _Handle(multiplexed_model_id, self.calls, self.gate)

    @property
    def clarify(self):
        return self

    def remote(self, arg):
        async def answer():
            self.calls.append(self.mux_id)
            await self.gate.wait()
            return ("answer", self.mux_id)
        return answer()


def test_a_tenants_burst_is_shed_by_its_own_budget_and_rate_limit(tmp_path):
    """Tenant a has used its admission (2 requests outstanding) and its rate limit; b is still admitted: a burst sheds
    its own tenant's load first (with one budget for all, b's request would be refused too)."""
    import asyncio

    from clarifier.serving.ingress import ClarifierIngress
    from clarifier.serving.tenants import read_tenants

    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: a, model_uri: /m/a, rate_limit_per_s: 0.01, rate_burst: 3}\n"
                    "  - {name: b, model_uri: /m/b}\n")
    spec, text = read_tenants(str(path))

    async def scenario():
        handle = _Handle()
        cls = ClarifierIngress.func_or_class  # Serve's ingress wrapper: its __init__ is awaited
        ingress = cls.__new__(cls)
        await cls.__init__(ingress, handle, ray_metrics=False, latency_budget_s=1.0, initial_limit=2,
                           tenants={"file": str(path), "refresh_s": 0, "spec": spec.model_dump(), "text": text})
        a, b = (ingress.tenants.by_name[n] for n in ("a", "b"))
        held = [asyncio.create_task(ingress._admitted("clarify", "q", 1, a)) for _ in range(2)]
        await asyncio.sleep(0.05)
        over = await ingress._admitted("clarify", "q", 1, a)  # a's budget: 2 outstanding
        b_call = asyncio.create_task(ingress._admitted("clarify", "q", 1, b))
        await asyncio.sleep(0.05)
        limited = await ingress._admitted("clarify", "q", 1, a)  # a's bucket (3) is empty now
        handle.gate.set()
        done = await asyncio.gather(*held, b_call)
        return ingress, over, limited, done, handle.calls

    ingress, over, limited, done, calls = asyncio.run(scenario())
    assert over[0] is None and over[1].status_code == 503
    assert json.loads(over[1].body)["detail"]["limit"] == "latency_budget_s" and "its tenant" in over[1].body.decode()
    assert limited[0] is None and limited[1].status_code == 429 and limited[1].headers["Retry-After"] == "100"
    assert [r[0] for r in done] == [("answer", "a::/m/a")] * 2 + [("answer", "b::/m/b")]
    assert sorted(calls) == ["a::/m/a", "a::/m/a", "b::/m/b"]  # each tenant's requests went to its own model id
    from support.metrics import metric_value

    text = ingress.metrics.render()[0].decode()
    assert metric_value(text, "clarifier_rejected_total", model="a", reason="latency_budget") == 1
    assert metric_value(text, "clarifier_rejected_total", model="a", reason="rate_limit") == 1
    assert metric_value(text, "clarifier_rejected_total", model="b") == 0


def test_tenants_take_turns_for_the_model_side():
    """Slots go round-robin over the tenants that wait: another tenant's request waits for one freed slot, not behind
    the burster's queue; a waiter that goes away leaves its place; a request larger than every slot still goes."""
    import asyncio

    from clarifier.serving.admission import FairShare

    async def scenario():
        fair, granted = FairShare(2), []

        async def request(tenant, name, items=1):
            await fair.acquire(tenant, items)
            granted.append(name)

        burst = [asyncio.create_task(request("a", f"a{i}")) for i in range(6)]
        await asyncio.sleep(0)
        other = asyncio.create_task(request("b", "b0"))
        gone = asyncio.create_task(request("c", "c0"))
        await asyncio.sleep(0)
        assert granted == ["a0", "a1"] and fair.busy == 2 and fair.waiting == 6
        gone.cancel()
        await asyncio.sleep(0)
        assert fair.waiting == 5
        for _ in range(3):
            fair.release()
            await asyncio.sleep(0)
        assert granted == ["a0", "a1", "a2", "b0", "a3"]  # b's request took the second freed slot
        for _ in range(4):
            fair.release()
            await asyncio.sleep(0)
        await asyncio.gather(*burst, other)
        assert fair.busy == 0 and fair.waiting == 0
        await asyncio.wait_for(request("a", "big", items=5), 1)  # more than every slot: goes when nothing is out
        return granted

    assert asyncio.run(scenario())[-1] == "big"


def test_a_trunk_loading_does_not_hold_up_the_trunks_already_held():
    import threading
    from pathlib import Path

    from clarifier.serving.tenant_model import TrunkPool

    release, started, calls = threading.Event(), threading.Event(), []

    def load(folder, version):
        calls.append(folder.name)
        if folder.name == "slow":
            started.set()
            assert release.wait(10)
        return f"engine-{folder.name}"

    pool = TrunkPool(load, max_trunks=3)
    assert pool.get("a", Path("a"), "v") == "engine-a"
    waiters = [threading.Thread(target=pool.get, args=("s", Path("slow"), "v")) for _ in range(2)]
    for t in waiters:
        t.start()
    assert started.wait(10)
    assert pool.get("a", Path("a"), "v") == "engine-a"  # answered while "slow" loads
    release.set()
    for t in waiters:
        t.join(10)
    assert calls == ["a", "slow"] and pool.loads == 2  # the second waiter found it loaded


def test_a_removed_tenants_keys_stop_working_and_operator_keys_reach_everyone(tmp_path):
    import asyncio

    from clarifier.core.tenants import TenantDirectory
    from clarifier.serving.auth import key_digests
    from clarifier.serving.ingress import ClarifierIngress

    spec = parse_tenants(FILE)

    async def make():
        cls = ClarifierIngress.func_or_class
        ingress = cls.__new__(cls)
        await cls.__init__(ingress, _Handle(), ray_metrics=False, api_key_digests=key_digests(["ops"]),
                           tenants={"file": str(tmp_path / "t.yaml"), "refresh_s": 0, "spec": spec.model_dump()})
        return ingress

    ingress = asyncio.run(make())
    assert ingress.caller("support-key") == Caller("support") and ingress.caller("ops") == Caller()
    assert ingress.caller("nope") is None and ingress.caller(None) is None
    ingress._reloaded(TenantDirectory(parse_tenants(FILE.split("  - name: hr")[0])), None)  # hr removed
    assert ingress.caller("hr-key") is None  # 401: its digest went with it
    assert ingress.caller("support-key") == Caller("support")
    ingress._reloaded(None, "tenants.yaml: broken")  # a refused file keeps the tenants
    assert ingress.tenants.names == ["support"]
