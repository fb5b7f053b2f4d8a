"""The data job's optional stages: silver grounding (MiniLM actor pool) and sequence packing."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from clarifier.core.config import build_config
from clarifier.data.pipeline import prepare
from clarifier.data.outputs import PACKED_DIR, load_split
from clarifier.data.synthetic import generate_conversations
from clarifier.core.schema import ConversationLog

pytestmark = pytest.mark.integration
RAY_CPUS = 3

N_CONV = 40
SEED = 11


@pytest.fixture(scope="module")
def job(ray_local, tiny_model_dir, tmp_path_factory):
    """Synthetic logs where every other conversation lost its gold grounding annotation."""
    tmp = tmp_path_factory.mktemp("silver")
    logs, out = tmp / "logs", tmp / "data"
    logs.mkdir()
    convs = generate_conversations(N_CONV, seed=SEED)
    stripped: set[str] = set()
    for k, c in enumerate(convs):
        if k % 2:
            continue
        for i, t in enumerate(c["turns"]):
            if t.get("label") and t["label"].get("grounding_turns"):
                t["label"]["grounding_turns"] = []
                stripped.add(f"{c['conversation_id']}:{i}")
    (logs / "logs.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = build_config({}, [
        f"data.input={logs}", f"data.output={out}", f"model.base_model={tiny_model_dir}",
        "data.silver_grounding.enabled=true", "data.packing.enabled=true", "data.packing.block_length=1024",
        "data.max_length=512", "train.micro_batch_size=4",
    ])
    lines: list[str] = []
    manifest = prepare(cfg, progress=lines.append)
    gold = {e.id: e for c in generate_conversations(N_CONV, seed=SEED) for e in ConversationLog.model_validate(c).explode()}
    return {"manifest": manifest, "out": out, "stripped": stripped, "gold": gold, "progress": lines}


@pytest.mark.timeout(300)
def test_silver_grounding_fills_stripped_turns_and_reports_agreement(job):
    sg = job["manifest"]["silver_grounding"]
    assert sg["enabled"] and sg["assigned"] + sg["no_turn_found"] == len(job["stripped"])
    assert sg["assigned"] >= 0.8 * len(job["stripped"])
    agr = sg["agreement_with_gold"]
    assert agr["examples_compared"] == sg["gold"] > 0
    assert 0.6 <= agr["f1"] <= 1.0 and 0 <= agr["exact_match"] <= 1
    got = {e.id: e for s in ("train", "dev", "test") for e in load_split(str(job["out"]), s)}
    silver = [e for k, e in got.items() if k in job["stripped"]]
    assert silver and all(e.meta.get("grounding_source") == "silver" for e in silver if e.grounding_turns)
    # The labeller agrees with the annotation that was removed on most examples.
    hits = sum(set(e.grounding_turns) == set(job["gold"][e.id].grounding_turns) for e in silver)
    assert hits >= 0.5 * len(silver)
    # Gold-grounded examples are untouched.
    for k, e in got.items():
        if k not in job["stripped"] and e.needs_clarification:
            assert e.grounding_turns == job["gold"][k].grounding_turns and "grounding_source" not in e.meta
    assert any("silver grounding" in line for line in job["progress"])


@pytest.mark.timeout(120)
def test_packed_blocks_cover_the_train_split(job):
    m = job["manifest"]
    p = m["packing"]
    train_n = m["counts"]["splits"]["train"]["examples"]
    t = pads.dataset(str(Path(job["out"]) / PACKED_DIR), format="parquet").to_table()
    assert t.num_rows == p["blocks"] > 0 and p["examples"] == train_n
    ids = [i for row in t.column("example_ids").to_pylist() for i in row]
    assert len(ids) == len(set(ids)) == train_n
    assert {e.id for e in load_split(str(job["out"]), "train")} == set(ids)
    assert all(len(r) == p["block_length"] for r in t.column("input_ids").to_pylist())
    assert sum(t.column("num_tokens").to_pylist()) == p["tokens"] == p["padding"]["tokens"]
    assert p["efficiency"] > p["padding"]["efficiency"]
    assert m["outputs"][PACKED_DIR] == p["output"]
