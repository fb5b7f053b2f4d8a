"""Sequence packing: several encoded examples per fixed-length block, attention kept within each.

Padding a micro-batch to its longest example wastes compute on pad tokens; packing concatenates
examples into blocks of ``block_length`` tokens instead. Boundaries are respected through
``position_ids`` that restart at 0 for every example: with ``attention_mask=None``, transformers
turns restarting positions into a block-diagonal causal mask (``find_packed_sequence_indices``),
so no token attends across examples (the forward pass must run with ``use_cache=False``: with a
KV cache transformers skips the detection), and every example's first token has label -100 already (it
is a prompt token), so no loss crosses a boundary either.

Packing is first-fit decreasing inside each batch the data job hands over (deterministic: ties
break on input order); the tail of a block is padding with label -100 and weight 0, positions
counting from 0 as a sequence of its own.

Pure functions over lists and Arrow tables; the data job runs :func:`pack_table` in
``map_batches`` and writes the blocks to ``<output>/train_packed/``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import pyarrow as pa

IGNORE = -100
SEQ_KEYS = ("input_ids", "labels", "loss_weights", "segment_ids")
PACKED_SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("labels", pa.list_(pa.int32())),
    ("loss_weights", pa.list_(pa.float32())),
    ("segment_ids", pa.list_(pa.int8())),
    ("position_ids", pa.list_(pa.int32())),
    ("clarify", pa.list_(pa.int8())),  # per token: 1 inside an example that needs clarification
    ("num_tokens", pa.int32()),      # real (non-padding) tokens in the block
    ("num_examples", pa.int32()),
    ("example_ids", pa.list_(pa.string())),
])


def plan_blocks(lengths: Sequence[int], block_length: int) -> list[list[int]]:
    """First-fit decreasing: lists of indexes into ``lengths``, each list fitting in one block."""
    too_long = [i for i, n in enumerate(lengths) if n > block_length]
    if too_long:
        raise ValueError(
            f"{len(too_long)} sequence(s) longer than the block ({max(lengths[i] for i in too_long)} > "
            f"{block_length} tokens): set data.packing.block_length >= data.max_length"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    blocks: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                blocks[b].append(i)
                free[b] -= n
                break
        else:
            blocks.append([i])
            free.append(block_length - n)
    return [sorted(b) for b in blocks]


def pack_sequences(rows: Sequence[dict], block_length: int, pad_id: int) -> list[dict]:
    """Encoded rows (``input_ids``, ``labels``, ``loss_weights``, ``segment_ids``, ``id``, optionally
    ``needs_clarification``) -> blocks; ``clarify`` marks, per token, the examples that need it
    (the class-weighted decision loss reads it, as a packed row holds examples of both classes)."""
    out = []
    for block in plan_blocks([len(r["input_ids"]) for r in rows], block_length):
        seq = {k: [] for k in SEQ_KEYS}
        pos: list[int] = []
        clarify: list[int] = []
        for i in block:
            r = rows[i]
            for k in SEQ_KEYS:
                seq[k].extend(list(r[k]))
            pos.extend(range(len(r["input_ids"])))
            clarify.extend([int(bool(r.get("needs_clarification")))] * len(r["input_ids"]))
        used = len(pos)
        pad = block_length - used
        seq["input_ids"] += [pad_id] * pad
        seq["labels"] += [IGNORE] * pad
        seq["loss_weights"] += [0.0] * pad
        seq["segment_ids"] += [0] * pad
        pos += list(range(pad))
        clarify += [0] * pad
        out.append({**seq, "position_ids": pos, "clarify": clarify, "num_tokens": used, "num_examples": len(block),
                    "example_ids": [str(rows[i].get("id", i)) for i in block]})
    return out


def pack_table(batch: pa.Table, *, block_length: int, pad_id: int) -> pa.Table:
    """``map_batches`` stage: encoded split rows -> PACKED_SCHEMA blocks."""
    cols = ["id", *SEQ_KEYS] + (["needs_clarification"] if "needs_clarification" in batch.column_names else [])
    rows = batch.select(cols).to_pylist()
    return pa.Table.from_pylist(pack_sequences(rows, block_length, pad_id), schema=PACKED_SCHEMA)


def padding_slots(lengths: Sequence[int], micro_batch_size: int) -> int:
    """Token slots used when consecutive micro-batches are each padded to their longest row."""
    total = 0
    for s in range(0, len(lengths), micro_batch_size):
        chunk = lengths[s : s + micro_batch_size]
        total += max(chunk) * len(chunk)
    return total


def padding_stats(batch: pa.Table, *, micro_batch_size: int) -> pa.Table:
    """One row (tokens, slots) for this batch padded in consecutive micro-batches (the data job's counts)."""
    lengths = batch.column("num_tokens").to_pylist()
    return pa.table({"tokens": [sum(lengths)], "slots": [padding_slots(lengths, micro_batch_size)]})


def efficiency(tokens: int, slots: int) -> float:
    """Share of non-padding tokens."""
    return tokens / slots if slots else 0.0


def collate_packed(rows: Iterable[dict]):
    """Packed blocks -> tensors for the model: no attention mask, restarting position ids."""
    import torch

    rows = list(rows)
    return {
        "input_ids": torch.tensor([list(r["input_ids"]) for r in rows], dtype=torch.long),
        "position_ids": torch.tensor([list(r["position_ids"]) for r in rows], dtype=torch.long),
        "labels": torch.tensor([list(r["labels"]) for r in rows], dtype=torch.long),
        "loss_weights": torch.tensor([list(r["loss_weights"]) for r in rows], dtype=torch.float32),
        "segment_ids": torch.tensor([list(r["segment_ids"]) for r in rows], dtype=torch.long),
        "clarify": torch.tensor([list(r["clarify"]) for r in rows], dtype=torch.bool),
    }
