"""The engine's work on one GPU, with nothing but torch, transformers and peft: a prepared script for a borrowed GPU.

    python benchmarks/engine/gpu_probe.py --out $OUT/engine-gpu.json            # < 8 minutes on one H100 / H200
    python benchmarks/engine/gpu_probe.py --device cpu --smoke --out /tmp/p.json  # a check that it runs, anywhere

No Ray, DeepSpeed or MLflow, nothing downloaded, and no weights carried: the model is SmolLM2-135M's architecture
(the shipped base: 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49,152) initialised at random in bf16.
Throughput and MFU depend on the shapes, not on the values; greedy decoding runs a fixed number of tokens with EOS
ignored. ``--config`` takes a transformers ``config.json`` for another base (e.g. a larger one).

Three measurements, each a fixed time budget:

* **training step** (``--train-seconds``): LoRA (r=16 on every projection, as the recipe) through peft, bf16 weights,
  AdamW, micro-batches of ``--micro-batch`` x ``--seq`` tokens, next-token loss on every position: tokens/s and
  MFU = 4 x parameters x tokens/s / peak (frozen base: forward 2N, input gradients 2N; attention scores ignored),
  ``--peak-tflops`` the GPU's dense bf16 peak (989 for H100/H200 SXM);
* **decision** (``--decision-seconds``): forward passes over batches of ``--seq-decision``-token prompts with only
  the last position's logits, as the engine's decision pass: prompts/s and tokens/s at batch 1 and ``--batch``;
* **decode** (``--decode-seconds``): greedy ``generate`` of ``--new`` tokens after a prompt, batch 1 and
  ``--batch``, as the engine decodes on CUDA (its fast path is CPU-only; on CUDA it keeps ``generate`` and its
  dynamic cache): ms per token, as (t(new) - t(1)) / (new - 1).

Writes one JSON (``--out``): the device, torch/transformers/peft versions, each measurement.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SMOKE = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)


def sync(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(config: dict, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(device=device, dtype=torch.bfloat16)
    return model


def train_probe(config, device, seconds, micro, seq, peak) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    model = build(config, device)
    n_params = sum(p.numel() for p in model.parameters())
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, config["vocab_size"], (micro, seq), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up: kernels chosen, memory allocated
        step()
    sync(device)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        steps += 1
        if steps % 5 == 0:
            sync(device)
    sync(device)
    wall = time.perf_counter() - t0
    tps = steps * micro * seq / wall
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return {"steps": steps, "seconds": round(wall, 2), "micro_batch": micro, "seq": seq, "params": n_params,
            "tokens_per_s": round(tps, 1), "mfu": round(4 * n_params * tps / (peak * 1e12), 4) if peak else None,
            "peak_memory_gib": round(peak_mem, 2) if peak_mem else None}


def decision_probe(model, config, device, seconds, batch, seq) -> dict:
    import torch

    out = {}
    for b in sorted({1, batch}):
        ids = torch.randint(0, config["vocab_size"], (b, seq), device=device)
        with torch.inference_mode():
            for _ in range(3):
                model(input_ids=ids, logits_to_keep=1)
            sync(device)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 2:
                model(input_ids=ids, logits_to_keep=1)
                n += 1
            sync(device)
        wall = time.perf_counter() - t0
        out[f"batch_{b}"] = {"prompts_per_s": round(n * b / wall, 1), "tokens_per_s": round(n * b * seq / wall, 1),
                             "ms_per_pass": round(1000 * wall / n, 2)}
    return out


def decode_probe(model, config, device, seconds, batch, seq, new) -> dict:
    import torch

    out = {}
    for b in sorted({1, batch}):
        ids = torch.randint(3, config["vocab_size"], (b, seq), device=device)
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=config["pad_token_id"], min_new_tokens=new)
        times = {}
        with torch.inference_mode():
            for n in (1, new):
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **kw)  # warm
                sync(device)
                reps, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds / 4 or reps < 2:
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                   **{**kw, "min_new_tokens": n})
                    reps += 1
                sync(device)
                times[n] = (time.perf_counter() - t0) / reps
        ms = 1000 * (times[new] - times[1]) / (new - 1)
        out[f"batch_{b}"] = {"ms_per_token": round(ms, 3), "tokens_per_s": round(1000 * b / ms, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", type=Path, default=None, help="a transformers config.json (default SmolLM2-135M's)")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model and a few seconds each: checks it runs")
    ap.add_argument("--train-seconds", type=float, default=120)
    ap.add_argument("--decision-seconds", type=float, default=60)
    ap.add_argument("--decode-seconds", type=float, default=80)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=448, help="training sequence length (the recipe's data.max_length)")
    ap.add_argument("--seq-decision", type=int, default=200, help="decision prompt length (median of real prompts)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.smoke:
        args.train_seconds, args.decision_seconds, args.decode_seconds = 2, 2, 2
        args.micro_batch, args.seq, args.seq_decision, args.batch, args.new = 2, 64, 32, 4, 4
    import peft
    import torch
    import transformers

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible (pass --device cpu for a check that the script runs)")
    config = json.loads(args.config.read_text()) if args.config else (SMOKE if args.smoke else SMOLLM2_135M)
    t_all = time.time()
    result = {"benchmark": "engine-gpu", "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda")
              else platform.processor() or "cpu", "versions": {"torch": torch.__version__,
              "transformers": transformers.__version__, "peft": peft.__version__},
              "config": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}, "smoke": args.smoke}
    print("[gpu-probe] training step ...", flush=True)
    result["train"] = train_probe(config, args.device, args.train_seconds, args.micro_batch, args.seq,
                                  args.peak_tflops if args.device.startswith("cuda") else None)
    print(f"[gpu-probe] {result['train']}", flush=True)
    model = build(config, args.device).eval()
    result["decision"] = decision_probe(model, config, args.device, args.decision_seconds, args.batch,
                                        args.seq_decision)
    print(f"[gpu-probe] decision {result['decision']}", flush=True)
    result["decode"] = decode_probe(model, config, args.device, args.decode_seconds, args.batch, args.seq_decision,
                                    args.new)
    print(f"[gpu-probe] decode {result['decode']}", flush=True)
    result["seconds"] = round(time.time() - t_all, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[gpu-probe] wrote {args.out} in {result['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
