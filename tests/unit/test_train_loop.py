"""Pure parts of the training loop: data order, pipeline segment masks, RNG state, DeepSpeed config."""

import os
import random

import numpy as np
import pytest
import torch

from clarifier.core.config import ConfigError, build_config
from clarifier.core.objective import PIPELINE_PARTS
from clarifier.train.loop import batch_indices, canonical_train_table, deepspeed_config, epoch_permutation, make_batch, micro_batches_per_epoch, rng_state, segment_scale, set_rng_state
from clarifier.core.objective import IGNORE, SEGMENT_IDS


def test_data_order_is_a_function_of_seed_and_epoch_and_skipping_reproduces_it():
    n, world, mb = 23, 2, 3
    per_epoch = micro_batches_per_epoch(n, world, mb)
    assert per_epoch == 3  # 18 of 23 rows per epoch; the remainder is dropped so ranks stay in step
    full = [[batch_indices(n, 7, world, r, mb, j) for r in range(world)] for j in range(3 * per_epoch)]
    # An epoch covers distinct rows, disjoint across ranks.
    first = [i for j in range(per_epoch) for r in range(world) for i in full[j][r]]
    assert len(first) == len(set(first)) == per_epoch * world * mb
    # Each epoch is reshuffled, and deterministically so.
    assert full[0] != full[per_epoch]
    assert list(epoch_permutation(n, 7, 1)) == list(epoch_permutation(n, 7, 1))
    assert list(epoch_permutation(n, 7, 1)) != list(epoch_permutation(n, 8, 1))
    # Resuming at micro-batch k (any epoch) yields exactly the rest of the uninterrupted order.
    for k in (0, 2, per_epoch, 2 * per_epoch + 1):
        assert [[batch_indices(n, 7, world, r, mb, j) for r in range(world)] for j in range(k, 3 * per_epoch)] == full[k:]
    with pytest.raises(ValueError, match="micro-batch"):
        batch_indices(5, 0, 2, 0, 3, 0)


def test_rows_in_any_arrival_order_give_the_same_canonical_table():
    """Ray Data may deliver the train split's blocks in any order; the data order is defined on
    rows sorted by id (packed blocks: by first example id), and how/what parts keep clarify rows."""
    import pyarrow as pa

    f, d, g, q = (SEGMENT_IDS[k] for k in ("format", "decision", "grounding", "question"))
    # e4 is a decision_only positive: its target is the decision alone, so how/what skip it too
    rows = [{"id": f"e{i}", "needs_clarification": i % 3 == 0 or i == 4, "input_ids": [i, i + 1],
             "segment_ids": [0, f, d, g, q] if i % 3 == 0 else [0, f, d]} for i in range(9)]
    shuffled = [rows[i] for i in (4, 0, 8, 2, 7, 1, 6, 3, 5)]
    a = canonical_train_table(pa.Table.from_pylist(rows), None)
    b = canonical_train_table(pa.Table.from_pylist(shuffled), None)
    assert a.to_pylist() == b.to_pylist() == rows
    assert canonical_train_table(pa.Table.from_pylist(shuffled), "when").num_rows == 9
    what = canonical_train_table(pa.Table.from_pylist(shuffled), "what")
    assert what.column("id").to_pylist() == ["e0", "e3", "e6"]
    assert canonical_train_table(pa.Table.from_pylist(shuffled), "how").column("id").to_pylist() == ["e0", "e3", "e6"]
    blocks = pa.Table.from_pylist([{"example_ids": ["e5", "e1"], "num_tokens": 4},
                                   {"example_ids": ["e2"], "num_tokens": 2},
                                   {"example_ids": ["e0", "e9"], "num_tokens": 3}])
    packed = canonical_train_table(blocks, None, packed=True)
    assert [r[0] for r in packed.column("example_ids").to_pylist()] == ["e0", "e2", "e5"]
    assert "_first" not in packed.column_names


def test_pipeline_parts_keep_only_their_segments():
    assert segment_scale(None) is None
    covered = set()
    for part, segs in PIPELINE_PARTS.items():
        scale = segment_scale(part)
        assert {n for n, sid in SEGMENT_IDS.items() if scale[sid] == 1.0} == set(segs)
        covered |= set(segs)
    assert covered == set(SEGMENT_IDS)  # the three parts together train every target segment once
    d, g = SEGMENT_IDS["decision"], SEGMENT_IDS["grounding"]
    import pyarrow as pa

    table = pa.table({"input_ids": [[5, 6, 7]], "labels": [[IGNORE, 6, 7]], "loss_weights": [[0.0, 2.0, 1.0]],
                      "segment_ids": [[0, d, g]], "needs_clarification": [True]})
    b = make_batch(table, [0], pad_id=0, device="cpu", scale=segment_scale("how"))
    assert b["loss_weights"].tolist() == [[0.0, 0.0, 1.0]] and b["clarify"].tolist() == [True]
    b = make_batch(table, [0], pad_id=0, device="cpu", scale=segment_scale("when"))
    assert b["loss_weights"].tolist() == [[0.0, 2.0, 0.0]]


def test_rng_state_round_trips_through_a_weights_only_torch_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    st = rng_state()
    torch.save(st, tmp_path / "rank0.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(torch.load(tmp_path / "rank0.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_deepspeed_config_offload_and_errors_name_the_key():
    cfg = build_config({}, ["train.zero_stage=3", "train.offload_optimizer=true", "train.offload_params=true"])
    z = deepspeed_config(cfg, 10)["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert "offload_optimizer" not in deepspeed_config(build_config({}, []), 10)["zero_optimization"]
    with pytest.raises(ConfigError, match="train.offload_params"):
        build_config({}, ["train.zero_stage=2", "train.offload_params=true"])
    with pytest.raises(ConfigError, match="train.variant"):
        build_config({}, ["train.variant=ensemble"])


def test_job_configs_for_one_cpu_box_one_gpu_and_a_gpu_cluster():
    from pathlib import Path

    from clarifier.core.config import load_config

    configs = Path(__file__).resolve().parents[2] / "jobs" / "configs"
    cpu = load_config(configs.parents[1] / "platform" / "clarifier" / "quickstart.yaml").train
    assert not cpu.use_gpu and cpu.num_workers == 2
    gpu1 = load_config(configs / "gpu-1.yaml").train
    assert gpu1.use_gpu and gpu1.num_workers == 1 and gpu1.checkpoint_every > 0
    cluster = load_config(configs / "cluster-gpu.yaml").train
    assert cluster.use_gpu and cluster.num_workers == 8 and cluster.zero_stage == 3 and cluster.max_failures >= 1
    assert cluster.checkpoint_every > 0 and cluster.run_name is None  # a new run per job unless named to resume
    gpu_cfg = load_config(configs / "gpu-1.yaml", ["train.offload_optimizer=true"])
    assert gpu_cfg.model.precision == "auto"  # bf16 on a GPU that has it (resolved in the worker)
    ds = deepspeed_config(gpu_cfg, 10, "bf16")
    assert ds["bf16"]["enabled"] and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert not deepspeed_config(gpu_cfg, 10, "fp32")["bf16"]["enabled"]


def test_no_warmup_is_one_flat_step_deepspeed_accepts():
    from clarifier.core.config import build_config

    for over, steps in ((["train.warmup_steps=0"], 10), (["train.warmup_steps=5"], 1)):
        sched = deepspeed_config(build_config({}, over), steps)["scheduler"]["params"]
        assert sched["warmup_num_steps"] == 1  # DeepSpeed refuses 0
        assert sched["warmup_min_lr"] == sched["warmup_max_lr"]  # so the LR starts at its peak
    sched = deepspeed_config(build_config({}, ["train.warmup_steps=3"]), 10)["scheduler"]["params"]
    assert sched["warmup_num_steps"] == 3 and sched["warmup_min_lr"] == 0.0


def test_target_only_logits_give_the_loss_of_full_logits(tiny_model_dir, tiny_tokenizer):
    """Left-padded batches compute logits only in the last ``target_positions`` columns; the loss
    and its per-segment parts equal those of the whole right-padded sequence's logits."""
    import torch

    from clarifier.data.synthetic import generate_conversations
    from clarifier.engine.models import load_causal_lm
    from clarifier.core.prompt import PromptOptions
    from clarifier.core.schema import ConversationLog
    from clarifier.train.loop import forward_loss
    from clarifier.core.objective import SegmentWeights, collate, encode_example, joint_loss

    exs = [e for c in generate_conversations(6, seed=3) for e in ConversationLog.model_validate(c).explode()][:4]
    rows = [encode_example(e, tiny_tokenizer, SegmentWeights(), PromptOptions(), 512) for e in exs]
    assert len({len(r["input_ids"]) for r in rows}) > 1  # rows of different lengths: real padding
    model = load_causal_lm(str(tiny_model_dir)).eval()
    pad = tiny_tokenizer.pad_token_id
    with torch.no_grad():
        full = collate(rows, pad)
        out = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"])
        ref, ref_parts = joint_loss(out.logits, full["labels"], full["loss_weights"], full["segment_ids"])
        left = collate(rows, pad, left=True)
        loss, parts = forward_loss(model, left)
    keep, n = int(left["target_positions"]), left["input_ids"].shape[1]
    assert keep < n / 2  # the prompt's logits are not computed
    assert torch.all(left["labels"][:, : n - keep] == -100)  # every target lies in the kept columns
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    assert parts.keys() == ref_parts.keys() and all(parts[k] == pytest.approx(ref_parts[k], rel=1e-4) for k in parts)


def test_deepspeed_builds_run_the_pinned_ninja_whatever_path_a_process_has(monkeypatch, tmp_path):
    # ninja 1.11 (Debian) and 1.13 (the pinned package) hash build commands differently: a process that found the
    # other one on PATH compiled DeepSpeed's ops again. Every build now puts the pinned one first.
    import shutil
    import subprocess

    import ninja

    from clarifier.train.ops import use_pinned_ninja

    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{ninja.BIN_DIR}{os.pathsep}/usr/bin")
    assert shutil.which("ninja") == str(other / "ninja")
    assert use_pinned_ninja() == ninja.BIN_DIR
    assert use_pinned_ninja() == ninja.BIN_DIR  # idempotent: no second entry
    parts = os.environ["PATH"].split(os.pathsep)
    assert parts == [ninja.BIN_DIR, str(other), "/usr/bin"]
    version = subprocess.run(["ninja", "--version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith(ninja.__version__)  # the package's binary, not the one first on PATH before
