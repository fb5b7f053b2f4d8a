"""The data job on a serving request log (data.request_log): conversations put back together from shards
in any order, served turns labelled by what happened next, counts per rule in the manifest."""

from __future__ import annotations

import json
import random

import pytest

from clarifier.core.config import RequestLogConfig, build_config
from clarifier.data.outputs import load_split, read_manifest
from clarifier.data.pipeline import prepare
from clarifier.serving.request_log import RequestLog
from support.served import conversation

pytestmark = pytest.mark.integration
RAY_CPUS = 2


def simulated_traffic(n: int, seed: int) -> list[dict]:
    """``n`` conversations of each kind: asked and answered, silent then the app asked, silent then a
    reformulation, silent and on with something else (every conversation ends with a turn nothing follows)."""
    kinds = [
        [("how do I reset it?", "The router or the modem?", "The router or the modem?"),
         ("the modem", None, "Hold the reset button for 10 seconds."), ("thanks", None, "You're welcome.")],
        [("reset it", None, "Do you mean the router or the modem?"), ("router", None, "Hold the button."),
         ("ok", None, "Good.")],
        [("reset my router device", None, "Unplug it."), ("how do I reset my router device properly", None,
                                                          "Press reset."), ("bye", None, "Bye.")],
    ]
    records = []
    for i in range(n):
        for k, steps in enumerate(kinds):
            records += conversation(f"c{k}-{i}", steps)
    random.Random(seed).shuffle(records)
    return records


@pytest.mark.timeout(600)
def test_a_request_log_becomes_labelled_splits(ray_local, tiny_model_dir, tmp_path):
    log_uri = tmp_path / "requests"
    # Three writers (replicas), small shards: a conversation's records are spread over files.
    records = simulated_traffic(10, seed=1)
    for w in range(3):
        rl = RequestLog(RequestLogConfig(uri=str(log_uri), shard_records=7), writer_id=f"replica-{w}", start=False)
        for r in records[w::3]:
            rl.append(r)
        rl.close()
    (log_uri / "stray.jsonl").write_text('{"conversation_id": "x", "turns": []}\nnot json\n')

    out = tmp_path / "data"
    cfg = build_config({}, [f"data.input={log_uri}", f"data.output={out}", f"model.base_model={tiny_model_dir}",
                            "data.request_log.enabled=true", "data.split={train: 0.5, dev: 0.0, test: 0.5}"])
    said: list[str] = []
    manifest = prepare(cfg, progress=said.append)
    rl = manifest["request_log"]
    assert rl["conversations"] == 30 and rl["shards"] > 3
    assert rl["labels_by_rule"] == {"served_question_answered": 10, "missed_app_asked": 10,
                                    "missed_reformulated": 10, "served_silent_continued": 30}
    assert rl["skipped_by_reason"] == {"no_follow_up": 30}
    assert rl["not_request_records"] == 2 and manifest["counts"]["quarantined"] == 2
    assert read_manifest(str(out))["request_log"]["examples"] == 60
    examples = load_split(str(out), "train") + load_split(str(out), "test")
    assert len(examples) == 60
    by_rule = {}
    for e in examples:
        by_rule.setdefault(e.meta["labelling_rule"], []).append(e)
    silver = by_rule["served_question_answered"]
    assert all(e.needs_clarification and e.meta["silver_target"] and e.clarifying_question == "The router or the modem?"
               for e in silver)
    assert all(not e.needs_clarification for e in by_rule["served_silent_continued"])
    # a silence the user had to reformulate after: a positive with no question (trained on the decision)
    assert all(e.needs_clarification and e.decision_only and e.clarifying_question is None
               for e in by_rule["missed_reformulated"])
    assert {e.meta["source"] for e in examples} == {"request_log"}
    # a conversation never lands in two splits
    splits = {}
    for split in ("train", "test"):
        for e in load_split(str(out), split):
            splits.setdefault(e.conversation_id, set()).add(split)
    assert all(len(s) == 1 for s in splits.values())
    assert any("30 conversations -> 60 labelled turns" in m for m in said), said
    json.dumps(manifest)  # the manifest stays JSON
