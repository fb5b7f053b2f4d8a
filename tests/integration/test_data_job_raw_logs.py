"""The data job on unlabelled conversation logs (data.labelling) and on Parquet inputs, on a local 2-CPU Ray."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from clarifier.core.config import build_config
from clarifier.data.labelling import label_conversation
from clarifier.data.pipeline import prepare
from clarifier.data.outputs import FILTERED_COLUMNS, load_split
from clarifier.data.synthetic import generate_conversations
from clarifier.core.schema import ConversationLog

pytestmark = pytest.mark.integration
RAY_CPUS = 2


def _raw(conv: dict, thanks: bool) -> dict:
    """A synthetic conversation as a production log: labels replaced by what the assistant did, no labels left."""
    turns = []
    for t in conv["turns"]:
        turns.append({"role": t["role"], "text": t["text"]})
        lab = t.get("label")
        if lab and lab["needs_clarification"]:
            turns += [{"role": "assistant", "text": lab["clarifying_question"]}, {"role": "user", "text": "The first one."},
                      {"role": "assistant", "text": "Here is how to do that."}]
        elif lab:
            turns.append({"role": "assistant", "text": "Here is how to do that."})
    if thanks:
        turns.append({"role": "user", "text": "Thanks!"})  # no reply: filtered as labelling:no_reply
    return {"conversation_id": conv["conversation_id"], "domain": conv.get("domain"), "turns": turns}


@pytest.fixture(scope="module")
def job(ray_local, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rawlogs")
    logs, out = tmp / "logs", tmp / "data"
    logs.mkdir()
    raw = [_raw(c, thanks=i % 2 == 0) for i, c in enumerate(generate_conversations(24, 3))]
    gold = generate_conversations(30, 4)[-1]  # a log with gold labels: used as is, never relabelled
    lonely = {"conversation_id": "lonely", "turns": [{"role": "user", "text": "hello?"}]}
    (logs / "raw.jsonl").write_text("\n".join(json.dumps(r) for r in [*raw, gold, lonely]) + "\n")

    examples = [{"id": f"pq-{i}", "query": f"what is the fee for plan {i}?", "needs_clarification": False,
                 "history": [{"role": "user", "text": "I have two plans."}]} for i in range(4)]
    examples.append({"id": "pq-bad", "query": "which?", "needs_clarification": True,
                     "history": [{"role": "user", "text": "x"}]})  # no question: quarantined
    pq.write_table(pa.Table.from_pylist(examples), logs / "examples.parquet")
    raw_pq = [_raw(c, thanks=True) for c in generate_conversations(27, 3)[24:]]
    pq.write_table(pa.Table.from_pylist(raw_pq), logs / "raw-logs.parquet")
    (logs / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")

    rules = build_config({}, ["data.labelling.enabled=true"]).data.labelling
    expected = Counter()
    for r in [*raw, *raw_pq]:
        res = label_conversation(ConversationLog.model_validate(r), rules)
        expected["examples"] += len(res.examples)
        expected.update("labelling:" + f.reason for f in res.filtered)
    expected["examples"] += len(ConversationLog.model_validate(gold).explode()) + 4

    cfg = build_config({}, [f"data.input={logs}", f"data.output={out}", f"model.base_model={tiny_model_dir}",
                            "data.labelling.enabled=true", "data.max_length=1024", "model.max_prompt_tokens=900"])
    lines: list[str] = []
    manifest = prepare(cfg, progress=lines.append)
    return {"manifest": manifest, "out": out, "expected": expected, "raw": raw, "raw_pq": raw_pq, "progress": lines}


@pytest.mark.timeout(300)
def test_raw_logs_counts_add_up(job):
    m, exp = job["manifest"], job["expected"]
    c = m["counts"]
    assert c["files"] == 4
    # rows: 24 raw + 1 gold + 1 lonely JSONL lines, 5 + 3 Parquet rows, 1 unreadable Parquet file
    assert c["rows_read"] == 24 + 1 + 1 + 5 + 3 + 1
    assert c["quarantined"] == 3  # the lonely log, the example without a question, the corrupt Parquet file
    assert c["rows_read"] == c["rows_with_examples"] + c["quarantined"]
    assert c["examples"] == exp["examples"]
    labelling = {k: v for k, v in c["filtered_by_reason"].items() if k.startswith("labelling:")}
    assert labelling == {k: v for k, v in exp.items() if k.startswith("labelling:")}
    assert labelling["labelling:no_reply"] >= 12 + 3  # every other JSONL log and every Parquet log end with "Thanks!"
    assert c["labelling_filtered"] == sum(labelling.values())
    assert c["examples"] + c["labelling_filtered"] == c["kept"] + c["filtered"]
    assert all(m["invariants"].values()), m["invariants"]
    assert m["config"]["data"]["labelling"]["enabled"] is True


@pytest.mark.timeout(60)
def test_filtered_turns_are_written_with_their_reason(job):
    t = pads.dataset(str(job["out"] / "filtered"), format="parquet").to_table()
    assert t.column_names == FILTERED_COLUMNS
    no_reply = [r for r in t.to_pylist() if r["reason"] == "labelling:no_reply"]
    assert len(no_reply) == job["manifest"]["counts"]["filtered_by_reason"]["labelling:no_reply"]
    thanks = [r for r in no_reply if r["raw"] == "Thanks!"]
    assert len(thanks) == 12 + 3
    first = job["raw"][0]
    assert any(r["id"] == f"{first['conversation_id']}:{len(first['turns']) - 1}" and r["line"] == 1 for r in thanks)
    q = pads.dataset(str(job["out"] / "quarantine"), format="parquet").to_table().to_pylist()
    reasons = {Path(r["source"]).name: r["reason"] for r in q}
    assert "turn 0 no_reply" in reasons["raw.jsonl"]
    assert reasons["corrupt.parquet"].startswith("cannot read Parquet file")
    assert "clarifying_question" in reasons["examples.parquet"]


@pytest.mark.timeout(60)
def test_rule_labelled_examples_reach_the_splits(job):
    got = {e.id: e for s in ("train", "dev", "test") for e in load_split(str(job["out"]), s)}
    assert {f"pq-{i}" for i in range(4)} <= set(got)  # Parquet example rows
    ruled = [e for e in got.values() if e.meta.get("label_source") == "rules"]
    positives = [e for e in ruled if e.needs_clarification]
    assert positives and all(e.meta["labelling_rule"] == "clarifying_question_answered" for e in positives)
    # the clarifying question is the assistant turn that followed the user turn in the raw log
    logs = {r["conversation_id"]: r for r in [*job["raw"], *job["raw_pq"]]}
    for e in positives:
        turns = logs[e.meta["conversation_id"]]["turns"]
        assert turns[e.meta["question_turn"]]["text"] == e.clarifying_question
        assert turns[e.meta["turn_index"]]["text"] == e.query and len(e.history) == e.meta["turn_index"]
    assert any(e.grounding_turns for e in positives)
