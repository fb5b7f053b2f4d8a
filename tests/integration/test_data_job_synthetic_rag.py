"""The data job on a ``synthetic_rag`` source (data.sources, local 2-CPU Ray): every labelled turn
reaches a split with its own passages and the tokenised prompt is the one that shows them."""

from __future__ import annotations

import pytest

from clarifier.core.config import build_config
from clarifier.core.prompt import PromptOptions, render_prompt
from clarifier.core.schema import ConversationLog
from clarifier.data.outputs import load_split, read_split_table
from clarifier.data.pipeline import prepare
from clarifier.data.synthetic_rag import generate_conversations

pytestmark = pytest.mark.integration
RAY_CPUS = 2

N_CONV, SEED = 40, 3


@pytest.fixture(scope="module")
def job(ray_local, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ragjob")
    cfg = build_config({"data": {"input": str(tmp / "in"), "output": str(tmp / "out"), "seed": SEED, "max_length": 2048,
                                 "sources": [{"importer": "synthetic_rag", "options": {"conversations": N_CONV, "seed": SEED}}]},
                        "model": {"base_model": str(tiny_model_dir)}})
    manifest = prepare(cfg, progress=lambda m: None)
    gold = {e.id: e for c in generate_conversations(N_CONV, SEED) for e in ConversationLog.model_validate(c).explode()}
    return {"cfg": cfg, "manifest": manifest, "gold": gold}


@pytest.mark.timeout(300)
def test_every_labelled_turn_lands_in_a_split_with_its_passages(job):
    c, gold = job["manifest"]["counts"], job["gold"]
    assert job["manifest"]["sources"]["synthetic_rag"]["conversations"] == N_CONV
    assert c["quarantined"] == 0 and c["filtered"] == 0, c["filtered_by_reason"]
    assert c["kept"] == len(gold) and sum(s["clarify"] for s in c["splits"].values()) == sum(
        e.needs_clarification for e in gold.values())
    out = job["cfg"].data.output
    got = {e.id: e for split in ("train", "dev", "test") for e in load_split(out, split)}
    assert got.keys() == gold.keys()
    for k, e in got.items():
        assert e.passages and e.passages == gold[k].passages and e.grounding_passages == gold[k].grounding_passages
        assert e.meta["source"] == "synthetic_rag" and e.meta["kind"] == gold[k].meta["kind"]


@pytest.mark.timeout(120)
def test_tokenised_prompts_show_the_passages(job, tiny_tokenizer):
    out, cfg = job["cfg"].data.output, job["cfg"]
    opts = PromptOptions(max_prompt_tokens=cfg.model.max_prompt_tokens)
    table = read_split_table(out, "train", ["id", "input_ids"])
    ids = dict(zip(table.column("id").to_pylist(), table.column("input_ids").to_pylist()))
    checked = 0
    for e in load_split(out, "train"):
        if not (e.needs_clarification and e.grounding_passages):
            continue
        prompt = render_prompt(tiny_tokenizer, e.history, e.query, e.passages, opts)
        assert "Retrieved passages:" in prompt
        for pid in e.grounding_passages:
            text = " ".join(next(p.text for p in e.passages if p.id == pid).split())
            assert f"[{pid}] {text[:200]}" in prompt, (e.id, pid)
        prompt_ids = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert ids[e.id][: len(prompt_ids)] == prompt_ids
        checked += 1
    assert checked >= 5
