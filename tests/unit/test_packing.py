import pyarrow as pa
import pytest
import torch

from clarifier.data.packing import IGNORE, collate_packed, efficiency, pack_sequences, pack_table, padding_slots, plan_blocks
from clarifier.core.prompt import PromptOptions
from clarifier.core.schema import Example, Turn
from clarifier.core.objective import SegmentWeights, collate, encode_example, joint_loss


def _row(i, n):
    return {"id": f"e{i}", "input_ids": [i + 1] * n, "labels": [IGNORE] + [i + 1] * (n - 1),
            "loss_weights": [0.0] + [1.0] * (n - 1), "segment_ids": [0] + [2] * (n - 1)}


def test_plan_blocks_fits_every_sequence_once_and_is_deterministic():
    lengths = [7, 3, 5, 2, 8, 1, 4]
    blocks = plan_blocks(lengths, 10)
    assert sorted(i for b in blocks for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in blocks)
    assert len(blocks) == 3  # 30 tokens in blocks of 10: FFD finds the optimum here
    assert plan_blocks(lengths, 10) == blocks


def test_plan_blocks_refuses_a_sequence_longer_than_the_block():
    with pytest.raises(ValueError, match="block_length"):
        plan_blocks([3, 12], 10)


def test_pack_sequences_restarts_positions_and_pads_the_tail():
    rows = [_row(0, 4), _row(1, 3), _row(2, 6)]
    blocks = pack_sequences(rows, 8, pad_id=99)
    assert sum(b["num_examples"] for b in blocks) == 3
    assert sum(b["num_tokens"] for b in blocks) == 13
    for b in blocks:
        assert all(len(b[k]) == 8 for k in ("input_ids", "labels", "loss_weights", "segment_ids", "position_ids"))
        used = b["num_tokens"]
        assert b["input_ids"][used:] == [99] * (8 - used)
        assert b["labels"][used:] == [IGNORE] * (8 - used) and b["loss_weights"][used:] == [0.0] * (8 - used)
    two = next(b for b in blocks if b["num_examples"] == 2)
    assert two["example_ids"] == ["e0", "e1"]
    assert two["position_ids"][:7] == [0, 1, 2, 3, 0, 1, 2]
    # the first token of each packed example is never a loss target
    assert two["labels"][0] == IGNORE and two["labels"][4] == IGNORE


def test_pack_table_and_padding_stats():
    t = pa.Table.from_pylist([_row(i, n) for i, n in enumerate([5, 5, 2, 2])])
    packed = pack_table(t, block_length=7, pad_id=0)
    assert packed.num_rows == 2 and packed.column("num_tokens").to_pylist() == [7, 7]
    assert efficiency(14, 14) == 1.0
    # padded in order, micro-batch 2: [5,5] -> 10 slots, [2,2] -> 4 slots; [5,2],[5,2] -> 20 slots
    assert padding_slots([5, 5, 2, 2], 2) == 14
    assert padding_slots([5, 2, 5, 2], 2) == 20
    assert efficiency(14, 20) == pytest.approx(0.7)


def _examples():
    hist = [Turn(role="user", text="I have a router and a modem."), Turn(role="assistant", text="Okay.")]
    return [
        Example(id="a", history=hist, query="how do I reset it?", needs_clarification=True,
                clarifying_question="The router or the modem?", grounding_turns=[0]),
        Example(id="b", history=[], query="what are your opening hours?", needs_clarification=False),
        Example(id="c", history=hist[:1], query="reset the modem please", needs_clarification=False),
    ]


def test_packed_forward_matches_separate_forwards_and_loss(tiny_model_dir, tiny_tokenizer):
    """Attention never crosses example boundaries: per-example logits and the joint loss are unchanged."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    encs = [dict(encode_example(ex, tiny_tokenizer, SegmentWeights(), PromptOptions(), 1024), id=ex.id)
            for ex in _examples()]
    total = sum(len(e["input_ids"]) for e in encs)
    blocks = pack_sequences(encs, total + 5, pad_id=tiny_tokenizer.pad_token_id)
    assert len(blocks) == 1 and blocks[0]["num_examples"] == 3
    b = collate_packed(blocks)
    with torch.no_grad():
        packed_logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits[0]
        packed_loss, _ = joint_loss(packed_logits[None], b["labels"], b["loss_weights"], b["segment_ids"])
        padded = collate(encs, tiny_tokenizer.pad_token_id)
        padded_logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        padded_loss, _ = joint_loss(padded_logits, padded["labels"], padded["loss_weights"], padded["segment_ids"])
    by_id = {e["id"]: k for k, e in enumerate(encs)}
    start = 0
    for ex_id in blocks[0]["example_ids"]:
        k = by_id[ex_id]
        n = len(encs[k]["input_ids"])
        torch.testing.assert_close(packed_logits[start : start + n], padded_logits[k, :n], atol=1e-4, rtol=1e-4)
        start += n
    assert packed_loss.item() == pytest.approx(padded_loss.item(), rel=1e-4)
