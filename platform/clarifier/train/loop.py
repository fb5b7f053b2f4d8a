"""The per-worker training loop (runs inside Ray Train workers): PEFT LoRA + DeepSpeed ZeRO.

Every worker runs exactly ``max_steps`` optimizer steps (re-reading its data shard as often as
needed), so collective calls stay in lock-step; a time budget (``max_minutes``) is agreed on by an
all-reduce so all ranks stop at the same step. Rank 0 logs to MLflow and writes the checkpoint:
the LoRA adapter (safetensors), tokenizer and ``clarifier.json`` -- a loadable model folder.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import tempfile
import time

from ..config import ClarifierConfig
from .objective import collate, joint_loss

COLUMNS = ["input_ids", "labels", "loss_weights", "segment_ids"]


def _say(msg: str) -> None:
    """Progress line from a worker. Ray Train patches ``print`` to tee into its logger (each line
    would reach the driver twice); the process's real stdout is streamed to the driver once."""
    print(msg, file=sys.__stdout__, flush=True)


def deepspeed_config(cfg: ClarifierConfig, total_steps: int) -> dict:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": t.learning_rate, "weight_decay": t.weight_decay,
                                                   "betas": [0.9, 0.999], "eps": 1e-8}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": t.learning_rate,
            "warmup_num_steps": min(t.warmup_steps, max(total_steps - 1, 0)), "total_num_steps": max(total_steps, 1),
            "warmup_type": "linear"}},
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": bool(t.use_gpu)},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _rows(batch: dict) -> list[dict]:
    n = len(batch["input_ids"])
    return [{k: list(batch[k][i]) for k in COLUMNS} for i in range(n)]


def train_loop_per_worker(config: dict) -> None:
    import deepspeed
    import numpy as np
    import torch
    import torch.distributed as dist
    import ray.train
    from peft import LoraConfig, get_peft_model

    from ..models import load_causal_lm, load_tokenizer, resolve_base_model
    from .tracking import SafeTracker

    cfg = ClarifierConfig.model_validate(config["cfg"])
    t = cfg.train
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.manual_seed(t.seed + rank)
    random.seed(t.seed + rank)
    np.random.seed(t.seed + rank)
    torch.set_num_threads(max(1, int(t.cpus_per_worker)))

    base_path = resolve_base_model(cfg.model.base_model, cfg.model.cache_dir)
    tok = load_tokenizer(base_path)
    model = load_causal_lm(base_path)
    lcfg = cfg.model.lora
    model = get_peft_model(model, LoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                                             target_modules=lcfg.target_modules, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(cfg, t.max_steps),
    )
    device = engine.device
    tracker = SafeTracker(config.get("mlflow_run_id") if rank == 0 else None, config.get("tracking_uri"))
    if rank == 0:
        _say(f"[train] {ctx.get_world_size()} workers, ZeRO-{t.zero_stage}, LoRA r={lcfg.r}: "
              f"{trainable:,} trainable of {total:,} parameters")

    shard = ray.train.get_dataset_shard("train")
    step = 0
    micro = 0
    tokens_since = 0
    t_start = time.time()
    t_last = t_start
    losses: list[float] = []
    stop = False
    for epoch in itertools.count():
        batches = shard.iter_batches(batch_size=t.micro_batch_size, batch_format="numpy",
                                     local_shuffle_buffer_size=256, local_shuffle_seed=t.seed + epoch)
        got_any = False
        for batch in batches:
            got_any = True
            b = collate(_rows(batch), tok.pad_token_id)
            b = {k: v.to(device) for k, v in b.items()}
            out = engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            loss, parts = joint_loss(out.logits, b["labels"], b["loss_weights"], b["segment_ids"])
            engine.backward(loss)
            engine.step()
            micro += 1
            tokens_since += int(b["attention_mask"].sum())
            losses.append(float(loss))
            if micro % t.gradient_accumulation_steps:
                continue
            step += 1
            # Agree on stopping (time budget) so every rank leaves at the same step.
            over = t.max_minutes is not None and (time.time() - t_start) > t.max_minutes * 60
            flag = torch.tensor([1.0 if (over or step >= t.max_steps) else 0.0])
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item() > 0)
            now = time.time()
            if rank == 0:
                lr = scheduler.get_last_lr()[0] if scheduler is not None else t.learning_rate
                m = {"train/loss": float(np.mean(losses)), "train/lr": lr,
                     "train/tokens_per_s": tokens_since * ctx.get_world_size() / max(now - t_last, 1e-6)}
                m.update({f"train/loss_{k}": v for k, v in parts.items()})
                tracker.log_metrics(m, step)
                eta = (now - t_start) / step * (t.max_steps - step)
                _say(f"[train] step {step}/{t.max_steps} loss {m['train/loss']:.4f} "
                      f"({', '.join(f'{k} {v:.3f}' for k, v in parts.items())}) lr {lr:.2e} "
                      f"{m['train/tokens_per_s']:.0f} tok/s eta {eta:.0f}s")
            losses.clear()
            tokens_since = 0
            t_last = now
            last = stop
            if last or (t.checkpoint_every and step % t.checkpoint_every == 0):
                _report(engine, tok, cfg, step, rank, tracker, final=last)
            if stop:
                break
        if stop:
            break
        if not got_any:
            raise RuntimeError(f"worker {rank} received no training rows: the train split is empty or too small "
                               f"for {ctx.get_world_size()} workers")
    if rank == 0 and tracker.failed_calls:
        _say(f"[train] warning: {tracker.failed_calls} MLflow calls failed; {tracker.lost_metrics} metric values lost")


def _report(engine, tok, cfg: ClarifierConfig, step: int, rank: int, tracker, final: bool) -> None:
    import ray.train

    from ..inference import ModelMeta, write_meta

    metrics = {"step": step, "final": final, "mlflow_lost_metrics": tracker.lost_metrics}
    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as d:
        engine.module.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        write_meta(d, ModelMeta(base_model=cfg.model.base_model, threshold=cfg.eval.threshold,
                                prompt={"max_prompt_tokens": cfg.model.max_prompt_tokens}))
        with open(os.path.join(d, "train_state.json"), "w") as f:
            json.dump({"step": step, "final": final}, f)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
