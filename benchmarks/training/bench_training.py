"""Training benchmark: tokens/s of the Clarifier trainer vs a plain loop, 1 vs 2 workers, ZeRO-2 vs ZeRO-3.

    .venv/bin/python benchmarks/training/bench_training.py                       # CPU: real SmolLM2, 30 steps
    .venv/bin/python benchmarks/training/bench_training.py --model <folder> --steps 8 --conversations 60  # smoke
    .venv/bin/python benchmarks/training/bench_training.py --gpu                 # GPU: ZeRO-2 vs ZeRO-3, < 8 min

CPU mode (default), all on the same prepared data, model, LoRA config, micro-batch and step count
(the defaults are the recipe's: micro-batch 2 per worker, sequences up to 448 tokens, LoRA r=16),
in the default precision (``model.precision=auto``: bf16 on a CPU with AVX512-BF16/AMX) unless said:

1. **plain**: a single-process transformers + PEFT loop (torch AdamW, no Ray, no DeepSpeed, no
   tracking; bf16 base with fp32 LoRA weights when the precision is bf16), reading the same rows in
   the same order as the trainer's rank 0 with one worker;
2. **trainer, 1 worker**: ``clarifier.train.trainer.train`` (Ray Train + DeepSpeed ZeRO-2 on gloo,
   MLflow tracking); ratio **trainer_1w / plain** is the trainer's overhead;
3. **trainer, 2 workers**: ratio **trainer_2w / trainer_1w** is the data-parallel scaling on CPU;
4. **trainer, 2 workers, fp32** (``--skip-fp32`` to skip): ratio **trainer_2w / trainer_2w_fp32**
   is what bf16 buys (DeepSpeed's bf16 mode, fp32 master weights, optimizer state and loss);
5. **trainer, 1 worker, packed** (``--packing-block N``, 0 to skip): the data job's packed blocks of N
   tokens (``data.packing``), ``micro_batch * max_length / N`` blocks per step so that a step holds as
   many token slots as a padded one; ratio **packed_1w / trainer_1w** is what packing buys.

Tokens/s counts non-padding tokens of all workers per optimizer step; each run's figure is the median
over its steps after ``--warmup`` steps (start-up, model loading and the final checkpoint are
outside it). Every worker and the plain loop use ``--threads`` torch threads.

GPU mode (``--gpu``): the trainer with ``train.use_gpu`` (bf16) on all visible GPUs, for each of
``--gpu-models`` (default SmolLM2-135M and the 2x larger Gemma 3 270M, both built in: no network
needed) ZeRO-2 then ZeRO-3, each for ``--minutes`` of training (``train.max_minutes``); tokens/s and MFU =
``flops_per_token * tokens/s / (n_gpus * peak)``, with ``flops_per_token = 4 * n_params`` (LoRA:
forward 2N plus the activation-gradient half of backward 2N; frozen weights get no weight-gradient
GEMMs; +2N with gradient checkpointing; attention-score FLOPs ignored) and ``--peak-tflops`` per GPU
(default 989, H100/H200 dense bf16). Four runs of ``--minutes 1`` plus start-up (a data job per model,
~30 s of worker start and model load per run) are meant to fit in 8 minutes; pass a hub id or folder
to ``--gpu-models`` for a larger base where the machine can reach it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import result_file, write_result  # noqa: E402


def _prepare(args, work: Path, ray_started) -> list[str]:
    from clarifier.core.config import build_config
    from clarifier.data.pipeline import prepare
    from clarifier.data.synthetic import write_logs

    base = [f"storage.root={work / 'store'}", f"data.input={work / 'logs'}", f"data.output={args.data or work / 'data'}",
            "data.formats=[jsonl]", f"model.base_model={args.model}", f"model.lora.r={args.lora_r}",
            f"train.micro_batch_size={args.micro_batch}", f"train.max_steps={args.steps}", "train.checkpoint_every=0",
            "train.max_failures=0", "eval.calibration_split=null", "train.warmup_steps=2", "model.lora.dropout=0.0",
            f"train.cpus_per_worker={args.threads}", f"data.max_length={args.max_length}",
            "train.experiment=bench-training", f"model.precision={args.precision}", "train.learning_rate=0.0015"]
    if args.packing_block:  # the data job writes padded splits and packed blocks; each run picks one
        base += ["data.packing.enabled=true", f"data.packing.block_length={args.packing_block}"]
    if not args.data:
        write_logs(str(work / "logs"), args.conversations, seed=0, shards=2)
        prepare(build_config({}, base), progress=lambda m: None)
    return base


def _trainer_tps(base: list[str], extra: list[str], warmup: int) -> dict:
    from mlflow import MlflowClient

    from clarifier.core.config import build_config
    from clarifier.train.trainer import train

    cfg = build_config({}, [*base, *extra])
    t0 = time.time()
    res = train(cfg, progress=lambda m: None)
    wall = time.time() - t0
    print(f"  {res.steps} steps in {wall:.0f}s ({res.precision})", flush=True)
    client = MlflowClient()
    hist = sorted((m.step, m.value) for m in client.get_metric_history(res.run_id, "train/tokens_per_s"))
    vals = [v for s, v in hist if s > warmup] or [v for _, v in hist]
    return {"tokens_per_s": statistics.median(vals), "steps": res.steps, "wall_s_incl_startup": round(wall, 1),
            "precision": res.precision,
            "per_step_tokens_per_s": [round(v, 1) for _, v in hist], "run_id": res.run_id}


def _plain_tps(base: list[str], warmup: int, threads: int) -> dict:
    """The same training in one process: transformers + PEFT + torch AdamW, same rows and order."""
    import torch
    from peft import LoraConfig, get_peft_model

    from clarifier.core.config import build_config
    from clarifier.engine.models import load_causal_lm, load_tokenizer, resolve_base_model
    from clarifier.train.loop import batch_indices, forward_loss, load_train_table, make_batch

    from clarifier.engine.precision import resolve_precision, torch_dtype

    cfg = build_config({}, base)
    t = cfg.train
    torch.set_num_threads(threads)
    torch.manual_seed(t.seed)
    path = resolve_base_model(cfg.model.base_model, cfg.model.cache_dir)
    precision = resolve_precision(cfg.model.precision, "cpu")
    tok, model = load_tokenizer(path), load_causal_lm(path, dtype=torch_dtype(precision))
    lc = cfg.model.lora
    model = get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                             target_modules=lc.target_modules, task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.learning_rate)
    table = load_train_table(cfg.data.output, None)
    rates = []
    for step in range(t.max_steps):
        t0 = time.perf_counter()
        b = make_batch(table, batch_indices(table.num_rows, t.seed, 1, 0, t.micro_batch_size, step), tok.pad_token_id, "cpu")
        loss, _ = forward_loss(model, b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rates.append(int(b["attention_mask"].sum()) / (time.perf_counter() - t0))
    vals = rates[warmup:] or rates
    return {"tokens_per_s": statistics.median(vals), "steps": len(rates), "precision": precision,
            "per_step_tokens_per_s": [round(r, 1) for r in rates]}


def _n_params(model_spec: str) -> int:
    from clarifier.engine.models import load_causal_lm, resolve_base_model

    m = load_causal_lm(resolve_base_model(model_spec, None))
    return sum(p.numel() for p in m.parameters())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.base_model (built-in name, folder, hub id)")
    ap.add_argument("--data", default=None, help="an existing data-job output folder (default: synthesise and prepare)")
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of each median")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=448)
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help="model.precision of the runs")
    ap.add_argument("--skip-fp32", action="store_true", help="CPU mode: no fp32 comparison run")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (and for the plain loop)")
    ap.add_argument("--packing-block", type=int, default=1024, help="CPU mode: also train on packed blocks of this "
                    "many tokens (>= --max-length; 0 = skip)")
    ap.add_argument("--gpu", action="store_true", help="GPU mode: ZeRO-2 vs ZeRO-3 tokens/s and MFU")
    ap.add_argument("--gpus", type=int, default=None, help="GPU mode: workers (default: all visible GPUs)")
    ap.add_argument("--gpu-models", nargs="+", default=None, help="GPU mode: base models, smallest first (default: "
                    "smollm2-135m-instruct gemma3-270m, both built in, so the run needs no network)")
    ap.add_argument("--minutes", type=float, default=1.0, help="GPU mode: training time per model and ZeRO stage")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="GPU mode: peak dense bf16 TFLOP/s per GPU")
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/training[-gpu].json)")
    args = ap.parse_args(argv)
    result_file("training-gpu" if args.gpu else "training", args.out)  # refused now, not after the run, when that file is already there

    import ray

    from clarifier.runtime.cluster import init_ray

    from clarifier.runtime.services import start_mlflow_server

    work = Path(tempfile.mkdtemp(prefix="bench-training-"))
    server = start_mlflow_server(work / "mlflow")  # a real tracking server, as in training (workers log to it)
    os.environ["MLFLOW_TRACKING_URI"] = server.url
    if args.gpu:
        import torch

        n_gpu = args.gpus or torch.cuda.device_count()
        if n_gpu < 1:
            raise SystemExit("--gpu: no GPU visible")
        ray.init(address="local", num_cpus=max(os.cpu_count() or 4, n_gpu * (args.threads + 1)), num_gpus=n_gpu,
                 include_dashboard=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
        models = args.gpu_models or ["smollm2-135m-instruct", "gemma3-270m"]
        if args.data and len(models) > 1:
            raise SystemExit("--data holds one tokenizer's token ids: pass a single --gpu-models with it")
        result = {"mode": "gpu", "gpus": n_gpu, "peak_tflops_per_gpu": args.peak_tflops, "micro_batch": args.micro_batch,
                  "max_length": args.max_length, "minutes_per_stage": args.minutes, "models": {}}
        for model in models:  # each model: its own data job (its tokenizer), then ZeRO-2 and ZeRO-3
            args.model = model
            base = _prepare(args, work / model.replace("/", "_"), True)
            base += ["train.use_gpu=true", f"train.num_workers={n_gpu}", f"train.max_minutes={args.minutes}",
                     "train.max_steps=100000"]
            n_params = _n_params(model)
            flops_per_token = 4 * n_params
            runs = {}
            for stage in (2, 3):
                r = _trainer_tps(base, [f"train.zero_stage={stage}",
                                        f"train.run_name=bench-{model.replace('/', '_')}-zero{stage}-{int(time.time())}"],
                                 args.warmup)
                r["mfu"] = flops_per_token * r["tokens_per_s"] / (n_gpu * args.peak_tflops * 1e12)
                runs[f"zero{stage}"] = r
                print(f"{model} ZeRO-{stage}: {r['tokens_per_s']:.0f} tokens/s, MFU {r['mfu']:.2%}", flush=True)
            result["models"][model] = {"n_params": n_params, "flops_per_token": flops_per_token, "runs": runs,
                                       "ratio_zero3_over_zero2": runs["zero3"]["tokens_per_s"] / runs["zero2"]["tokens_per_s"]}
        path = write_result("training-gpu", result, args.out)
    else:
        init_ray(num_cpus=2 * args.threads + 2)
        base = _prepare(args, work, True)
        plain = _plain_tps(base, args.warmup, args.threads)
        print(f"plain loop: {plain['tokens_per_s']:.0f} tokens/s", flush=True)
        padded = ["data.packing.enabled=false"]
        one = _trainer_tps(base, [*padded, "train.num_workers=1", "train.run_name=bench-1w"], args.warmup)
        print(f"trainer, 1 worker: {one['tokens_per_s']:.0f} tokens/s", flush=True)
        two = _trainer_tps(base, [*padded, "train.num_workers=2", "train.run_name=bench-2w"], args.warmup)
        print(f"trainer, 2 workers: {two['tokens_per_s']:.0f} tokens/s", flush=True)
        runs = {"plain": plain, "trainer_1w": one, "trainer_2w": two}
        ratios = {"ratio_trainer_1w_over_plain": one["tokens_per_s"] / plain["tokens_per_s"],
                  "ratio_2w_over_1w": two["tokens_per_s"] / one["tokens_per_s"]}
        if not args.skip_fp32 and two["precision"] != "fp32":
            fp32 = _trainer_tps(base, [*padded, "train.num_workers=2", "model.precision=fp32",
                                       "train.run_name=bench-2w-fp32"], args.warmup)
            print(f"trainer, 2 workers, fp32: {fp32['tokens_per_s']:.0f} tokens/s", flush=True)
            runs["trainer_2w_fp32"] = fp32
            ratios[f"ratio_{two['precision']}_over_fp32_2w"] = two["tokens_per_s"] / fp32["tokens_per_s"]
        if args.packing_block:
            blocks = max(1, args.micro_batch * args.max_length // args.packing_block)
            packed = _trainer_tps(base, ["train.num_workers=1", f"train.micro_batch_size={blocks}",
                                         "train.run_name=bench-1w-packed"], args.warmup)
            packed["blocks_per_step"] = blocks
            print(f"trainer, 1 worker, packed: {packed['tokens_per_s']:.0f} tokens/s", flush=True)
            runs["trainer_1w_packed"] = packed
            ratios["ratio_packed_over_padded_1w"] = packed["tokens_per_s"] / one["tokens_per_s"]
        result = {"mode": "cpu", "model": args.model, "steps": args.steps, "micro_batch": args.micro_batch,
                  "threads_per_worker": args.threads, "conversations": args.conversations,
                  "max_length": args.max_length, "packing_block": args.packing_block, "runs": runs, **ratios,
                  "notes": "tokens/s = non-padding tokens of all workers per optimizer step, median after warm-up; "
                           "the trainer's figure includes its per-step MLflow logging"}
        path = write_result("training", result, args.out)
    ray.shutdown()
    server.stop()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
