"""The weekly loop on loopback services with a tiny model (issue 23): the champion served with the request
log on -> simulated users (some turns ambiguous: the app asks, the user answers; others clear) -> the data
job labels the logged turns by what happened next -> training starts from the champion's adapter
(model.init_from=models:/...@champion) -> evaluation -> the challenger goes through the promotion gate on
the same held-out turns and, served as the champion's shadow, on live traffic -- recorded in the audit log."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

RAY_CPUS = 4
NAME = "loop-clarifier"


def _champion(tiny_model_dir: Path, root: Path, mlflow_server: str) -> tuple[str, dict]:
    """Version 1 of NAME at @champion: a LoRA adapter with non-zero B matrices (a fresh one has zeros), so
    that a run continuing it can be told from a fresh start. Returns the version and its B tensors."""
    import mlflow
    import torch
    from safetensors.torch import load_file, save_file

    from clarifier.registry.registry import register_adapter
    from support.adapters import untrained_adapter

    folder = untrained_adapter(tiny_model_dir, root / "champion", threshold=1.0, seed=7)  # 1.0: never asks
    weights = load_file(str(folder / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    for k in weights:
        if "lora_B" in k:
            weights[k] = torch.randn(weights[k].shape, generator=gen) * 0.05
    save_file(weights, str(folder / "adapter_model.safetensors"))
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("loop")
    with mlflow.start_run(run_name="champion") as run:
        mlflow.log_artifacts(str(folder), "adapter")
    mv = register_adapter(run.info.run_id, NAME, alias="champion", tracking_uri=mlflow_server)
    return str(mv.version), {k: v for k, v in weights.items() if "lora_B" in k}


def _users(url: str, n: int) -> int:
    """``n`` conversations of each kind through the live API, as a RAG app would call it: an ambiguous
    request (Clarifier stays silent, the app asks, the user answers), one the user has to restate after
    the app's answer (Clarifier stayed silent: a miss), and a clear one (the app answers, the user goes
    on). Returns the number of requests."""
    from clarifier.client import ClarifierClient

    sent = 0
    with ClarifierClient(url, timeout=60) as c:
        for i in range(n):
            docs = [{"id": f"kb-{i}", "text": f"Manual page {i}: hold reset for ten seconds."}]
            for kind, turns in (
                ("amb", [("how do I reset it?", "Do you mean the router or the modem?"),
                         ("the router", "Hold the reset button for ten seconds."), ("thanks", None)]),
                ("reform", [("how do I reset my device?", "Unplug it and plug it back in."),
                            ("no, how do I reset the router device itself?", "Hold the reset button."),
                            ("thanks", None)]),
                ("clear", [("how do I reset my router?", "Hold the reset button for ten seconds."),
                           ("and where is the modem's manual?", "On the vendor's site."), ("great", None)]),
            ):
                history: list[dict] = []
                for query, app_reply in turns:
                    c.clarify(history, query, docs, conversation_id=f"{kind}-{i}")
                    sent += 1
                    history += [{"role": "user", "text": query}]
                    if app_reply:
                        history += [{"role": "assistant", "text": app_reply}]
    return sent


@pytest.mark.timeout(900)
def test_serve_log_label_train_from_champion_and_gate(tiny_model_dir, mlflow_server, ray_local, tmp_path):
    import httpx
    from mlflow import MlflowClient
    from ray import serve
    from safetensors.torch import load_file

    from clarifier.core.config import ServeConfig, build_config
    from clarifier.data.pipeline import prepare
    from clarifier.evaluation.evaluate import evaluate_training_run
    from clarifier.registry.audit import AuditLog
    from clarifier.registry.promotion import promote
    from clarifier.registry.registry import register_adapter
    from clarifier.runtime.services import free_port
    from clarifier.serving.app import run_local
    from clarifier.train.trainer import train
    from support.config import tiny_lora
    from support.metrics import metric_value

    version, champion_b = _champion(tiny_model_dir, tmp_path, mlflow_server)
    requests = tmp_path / "requests"

    # 1. serve the champion with the request log on; simulated users talk to it
    port = free_port()  # one port: Serve keeps the one it was first started with
    scfg = ServeConfig(model_uri=f"models:/{NAME}@champion", port=port, cpus_per_replica=0.5,
                       max_new_tokens=4, request_log={"uri": str(requests), "shard_records": 25, "shard_age_s": 1})
    url = run_local(scfg, tracking_uri=mlflow_server, ready_timeout_s=240)
    sent = _users(url, 12)
    serve.delete("clarifier")  # graceful: the ingress writes what its request log holds
    assert sum(1 for f in requests.rglob("*.jsonl.gz")) >= 2

    # 2. the data job puts the conversations back together and labels them by what happened next
    base = [f"storage.root={tmp_path / 'store'}", f"data.input={requests}", f"data.output={tmp_path / 'data'}",
            "data.request_log.enabled=true", "data.split={train: 0.6, dev: 0.0, test: 0.4}",
            *tiny_lora(tiny_model_dir), "train.num_workers=1", "train.max_steps=2", "train.micro_batch_size=2",
            "train.learning_rate=0.000001", "train.warmup_steps=0", "train.experiment=loop",
            "eval.max_examples=8", "eval.max_new_tokens=4", "eval.batch_size=4", "eval.calibration_split=null",
            f"registry.model_name={NAME}", "registry.gate.shadow_min_requests=20"]
    manifest = prepare(build_config({}, base), progress=print)
    rl = manifest["request_log"]
    assert rl["conversations"] == 36 and sent == 108
    assert rl["labels_by_rule"] == {"served_question_answered": 0, "missed_app_asked": 12,
                                    "missed_reformulated": 12, "served_silent_continued": 48}
    assert rl["skipped_by_reason"] == {"no_follow_up": 36}

    # 3. train from the champion's adapter
    cfg = build_config({}, [*base, f"model.init_from=models:/{NAME}@champion"])
    tr = train(cfg, progress=print)
    tags = MlflowClient().get_run(tr.run_id).data.tags
    assert tags["clarifier.init_from"] == f"models:/{NAME}@champion -> {NAME}/{version}"
    trained = load_file(str(Path(tr.model_dir) / "adapter_model.safetensors"))
    for k, b in champion_b.items():
        key = next(t for t in trained if t.endswith(k.split("base_model.model.", 1)[-1]))
        assert (trained[key].float() - b.float()).abs().max() < 1e-3, k  # continued, not a fresh (zero) B

    # 4. evaluate, register as the challenger
    report = evaluate_training_run(cfg, tr.model_dir, tr.run_id, progress=print)
    assert report is not None
    challenger = register_adapter(tr.run_id, NAME, alias="challenger", tracking_uri=mlflow_server)

    # 5. the challenger as the shadow of the champion on live traffic, logged beside it
    shadow_log = tmp_path / "shadow-requests"
    scfg = scfg.model_copy(update={"shadow_model_uri": f"models:/{NAME}@challenger",
                                   "request_log": scfg.request_log.model_copy(update={"uri": str(shadow_log)})})
    url = run_local(scfg, tracking_uri=mlflow_server, ready_timeout_s=240)
    live = _users(url, 4)
    deadline = time.monotonic() + 120
    while True:  # the shadow's answers arrive after the responses
        done = metric_value(httpx.get(f"{url}/metrics", timeout=30).text, "clarifier_shadow_total")
        if done >= live:
            break
        assert time.monotonic() < deadline, f"{done} of {live} shadow answers"
        time.sleep(0.5)
    serve.delete("clarifier")

    # 6. the gate: the same held-out turns for both, plus the live comparison from the shadow log
    decision = promote(cfg, NAME, from_alias="challenger", data=str(tmp_path / "data"), shadow_log=str(shadow_log),
                       progress=print)
    assert decision.decision in ("promoted", "refused") and decision.champion_version == version
    assert decision.challenger_version == str(challenger.version) and decision.eval_set["n"] > 0
    records = AuditLog(str(tmp_path / "store" / "registry" / "audit.jsonl")).records(model=NAME)
    last = records[-1]
    assert last["decision"] == decision.decision and last["shadow"]["requests"] == live
    assert {c["name"] for c in last["criteria"]} >= {"shadow_min_requests", "shadow_max_flag_increase",
                                                     "shadow_min_clear_agreement", "min_validity"}
    print(json.dumps({"requests": sent, "labels": rl["labels_by_rule"], "shadowed": live,
                      "shadow": last["shadow"], "decision": decision.decision, "reason": last["reason"]}))
