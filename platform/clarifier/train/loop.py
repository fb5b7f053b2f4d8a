"""The per-worker training loop (runs inside Ray Train workers): PEFT LoRA or full fine-tuning
(``model.finetune``) + DeepSpeed ZeRO.

Data order. The driver hands the train split (token columns only) to Ray Train as a Ray Data
dataset that is *not* split between workers (``DataConfig(datasets_to_split=[])``): every worker
drains its ``get_dataset_shard("train")`` iterator, sorts the rows by example id, and walks one
global order that is a pure function of ``(train.seed, epoch)``: global micro-batch
``j`` of an epoch is rows ``perm[j*W*B:(j+1)*W*B]`` of that epoch's permutation, rank ``r`` takes
the ``r``-th ``B`` of them (``W`` workers, ``B`` = micro batch; the remainder of an epoch is
dropped so every rank runs the same number of micro-batches). The data position is therefore one
integer -- micro-batches consumed -- and skipping them reproduces the uninterrupted order exactly.
(A split dataset -- ``streaming_split`` -- would hand rows to workers in arrival order, which
differs between runs, so a resumed run could not continue the uninterrupted order. The price:
every worker holds the train split's token columns in memory, ~13 bytes per token.)

Every worker runs exactly ``max_steps`` optimizer steps, so collectives stay in lock-step; a time
budget (``max_minutes``) is agreed on by an all-reduce so all ranks stop at the same step.

Checkpoints (every ``checkpoint_every`` steps and at the end), one directory merged by Ray Train
from every rank's files:

    adapter_model.safetensors, adapter_config.json, tokenizer files, clarifier.json   (rank 0: a model folder;
        with model.finetune=full: model.safetensors + config.json instead of the adapter files)
    train_state.json          step, micro-batches consumed, samples, MLflow run id, world size   (rank 0)
    deepspeed/<tag>/...       engine.save_checkpoint from every rank (ZeRO optimizer/scheduler shards)
    rank_state/rank<r>.pt     python/numpy/torch RNG state + an optimizer-state checksum (every rank)

On (re)start the loop restores all of it from ``ray.train.get_checkpoint()`` and continues with
the same step count, LR schedule, data order and RNG streams; the restored optimizer state is
verified against the checksum saved with it. Rank 0 logs to MLflow, skipping steps the run
already has (a crash after logging a step cannot duplicate it), through the buffer of
:mod:`clarifier.train.tracking`: a tracking-server outage neither stalls the loop nor, when short,
leaves a gap; steps whose metrics are lost anyway are counted, carried across restarts in the
checkpoint, and logged by the driver (``tracking/lost_steps``).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from functools import lru_cache

from clarifier.core.config import ClarifierConfig
from clarifier.runtime import relay
from clarifier.data.packing import collate_packed
from clarifier.engine.precision import describe, resolve_precision, set_threads, torch_dtype
from clarifier.train.ops import use_pinned_ninja
from clarifier.core.objective import PIPELINE_PARTS, SEGMENT_IDS, DecisionLoss, collate, joint_loss

COLUMNS = ["input_ids", "labels", "loss_weights", "segment_ids"]
TRAIN_COLUMNS = ["id", "needs_clarification", *COLUMNS]
PACKED_COLUMNS = [*COLUMNS, "position_ids", "clarify"]
STATE_FILE = "train_state.json"
DS_DIR = "deepspeed"
RANK_DIR = "rank_state"


_RELAY = None  # the driver's ProgressRelay handle (train_loop_per_worker sets it)


def _say(msg: str) -> None:
    """Progress line from a worker, to the driver's progress callback (runtime/relay.py). Without a relay
    it goes to the process's real stdout (Ray Train patches ``print`` to tee into its logger: each
    line would reach the driver twice)."""
    relay.say(_RELAY, msg)


# ---- pure helpers (unit-tested) ------------------------------------------------------------


def deepspeed_config(cfg: ClarifierConfig, total_steps: int, precision: str = "fp32") -> dict:
    """The DeepSpeed config; ``precision`` (resolved: bf16 | fp32) switches DeepSpeed's bf16 mode:
    the module computes in bf16 and DeepSpeed keeps fp32 master weights and optimizer state."""
    t = cfg.train
    zero: dict = {"stage": t.zero_stage}
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": bool(t.use_gpu)}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": bool(t.use_gpu)}
    warmup = min(t.warmup_steps, max(total_steps - 1, 0))
    # DeepSpeed refuses warmup_num_steps=0: "no warmup" is one warmup step from lr to lr.
    warmup_min_lr = 0.0 if warmup > 0 else t.learning_rate
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": t.learning_rate, "weight_decay": t.weight_decay,
                                                   "betas": [0.9, 0.999], "eps": 1e-8}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": warmup_min_lr, "warmup_max_lr": t.learning_rate,
            "warmup_num_steps": max(warmup, 1), "total_num_steps": max(total_steps, 1),
            "warmup_type": "linear"}},
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def epoch_permutation(n: int, seed: int, epoch: int):
    """The global row order of ``epoch``: a deterministic function of (seed, epoch) only."""
    import numpy as np

    return np.random.default_rng([int(seed), int(epoch)]).permutation(n)


def balanced_epoch_order(keys: tuple[tuple[str, bool], ...], seed: int, epoch: int):
    """The row order of ``epoch`` for ``train.balance=source_class``: inside every source half the rows
    are turns that need a question and half clear ones, so the source predicts nothing.

    ``keys`` are the rows' ``(source, needs_clarification)``. Each source keeps its number of rows
    (so an epoch is still ``n`` rows and sources keep their share); its minority class is drawn
    again (a fresh permutation each round) and its majority class subsampled, differently every
    epoch. A source with a single class keeps its rows as they are. Deterministic in (seed, epoch).
    """
    import numpy as np

    rng = np.random.default_rng([int(seed), int(epoch), 1])
    groups: dict[str, tuple[list[int], list[int]]] = {}
    for i, (src, gold) in enumerate(keys):
        groups.setdefault(str(src), ([], []))[1 if gold else 0].append(i)
    rows: list[int] = []
    for src in sorted(groups):
        clear, ask = groups[src]
        if not clear or not ask:
            rows += clear + ask
            continue
        n = len(clear) + len(ask)
        for idx, m in ((ask, (n + 1) // 2), (clear, n // 2)):
            rounds = -(-m // len(idx))
            rows += np.concatenate([rng.permutation(idx) for _ in range(rounds)])[:m].tolist()
    return rng.permutation(np.asarray(rows, dtype=np.int64))


def balanced_counts(by_source: dict[str, dict]) -> dict[str, dict]:
    """Per-source ``{"examples", "clarify"}`` counts of one epoch of :func:`balanced_epoch_order`."""
    out = {}
    for src, c in by_source.items():
        n, k = int(c["examples"]), int(c["clarify"])
        out[src] = {"examples": n, "clarify": (n + 1) // 2 if 0 < k < n else k}
    return out


def training_mix(balance: str, train_counts: dict) -> dict:
    """What one epoch of training sees: the train split's counts (the manifest's
    ``counts.splits.train``) as ``train.balance`` mixes them, and the source-only control on that mix
    (AUROC of a score that knows only the source: 0.5 = the source predicts nothing)."""
    from clarifier.core.metrics import source_only_auroc_from_counts

    by = train_counts.get("by_source") or {}
    if balance == "source_class" and not by:
        raise ValueError("train.balance=source_class needs per-source counts in the data manifest "
                         "(counts.splits.train.by_source), which this data output predates: rerun `clarifier data prepare`")
    mixed = balanced_counts(by) if balance == "source_class" else by
    return {"balance": balance, "examples": int(train_counts["examples"]),
            "clarify": sum(c["clarify"] for c in mixed.values()) if mixed else int(train_counts["clarify"]),
            "by_source": mixed,
            "source_only_auroc_natural": source_only_auroc_from_counts(by) if by else None,
            "source_only_auroc": source_only_auroc_from_counts(mixed) if mixed else None}


@lru_cache(maxsize=2)
def _epoch_order(n: int, seed: int, epoch: int, keys: tuple | None):
    return epoch_permutation(n, seed, epoch) if keys is None else balanced_epoch_order(keys, seed, epoch)


def micro_batches_per_epoch(n: int, world: int, micro_batch: int) -> int:
    return n // (world * micro_batch)


def batch_indices(n: int, seed: int, world: int, rank: int, micro_batch: int, micro_index: int,
                  keys: tuple | None = None) -> list[int]:
    """Row indices of rank ``rank``'s ``micro_index``-th micro-batch (counted from the very start);
    with ``keys`` (the rows' ``(source, needs_clarification)``) epochs follow :func:`balanced_epoch_order`."""
    per_epoch = micro_batches_per_epoch(n, world, micro_batch)
    if per_epoch < 1:
        raise ValueError(f"the train split has {n} examples, fewer than one global micro-batch "
                         f"(train.num_workers x train.micro_batch_size = {world * micro_batch})")
    epoch, j = divmod(micro_index, per_epoch)
    perm = _epoch_order(n, seed, epoch, keys)
    start = (j * world + rank) * micro_batch
    return [int(i) for i in perm[start:start + micro_batch]]


def segment_scale(part: str | None) -> dict[int, float] | None:
    """Per-segment-id multipliers for a pipeline part (None = joint: keep every segment)."""
    if part is None:
        return None
    keep = PIPELINE_PARTS[part]
    return {sid: (1.0 if name in keep else 0.0) for name, sid in SEGMENT_IDS.items()}


def resolve_decision_loss(cfg: ClarifierConfig, class_counts: dict | None) -> DecisionLoss:
    """The decision-loss settings with ``clarify_weight: auto`` resolved from the train split's counts."""
    d = cfg.train.decision_loss
    if d.kind == "ce":
        return DecisionLoss()
    w = d.clarify_weight
    if w == "auto":
        n, k = (class_counts or {}).get("examples", 0), (class_counts or {}).get("clarify", 0)
        if not n or not k or k >= n:
            raise ValueError(
                f"train.decision_loss.clarify_weight=auto needs both classes in the train split "
                f"(manifest counts: {k} clarify of {n}); set a number instead")
        w = (n - k) / k
    return DecisionLoss(kind=d.kind, clarify_weight=float(w), gamma=float(d.gamma) if d.kind == "focal" else 0.0)


# ---- batches -------------------------------------------------------------------------------


def make_batch(table, indices: list[int], pad_id: int, device, scale: dict[int, float] | None = None) -> dict:
    """The one place that turns rows of the train table into model-ready tensors.

    Padded rows are left-padded (``attention_mask``, ``position_ids`` from the mask, and
    ``target_positions``: the last columns that hold every row's target, see
    :func:`forward_loss`); packed blocks (``position_ids`` column, see
    :mod:`clarifier.data.packing`) give restarting ``position_ids`` and no mask. ``n_tokens`` is
    the number of real (non-padding) tokens, for throughput.
    """
    import torch

    sub = table.take(indices).to_pydict()
    if "position_ids" in sub:
        rows = [{k: sub[k][i] for k in PACKED_COLUMNS} for i in range(len(indices))]
        b = collate_packed(rows)
        b["n_tokens"] = torch.tensor(sum(sub["num_tokens"]))
    else:
        rows = [{k: sub[k][i] for k in COLUMNS} for i in range(len(indices))]
        b = collate(rows, pad_id, left=True)
        b["n_tokens"] = b["attention_mask"].sum()
        if "needs_clarification" in sub:
            b["clarify"] = torch.tensor([bool(x) for x in sub["needs_clarification"]], dtype=torch.bool)
    if scale is not None:
        lut = torch.zeros(max(scale) + 1)
        for sid, s in scale.items():
            lut[sid] = s
        b["loss_weights"] = b["loss_weights"] * lut[b["segment_ids"]]
    return {k: v.to(device) for k, v in b.items()}


def forward_loss(model, b: dict, decision: DecisionLoss | None = None):
    """The joint loss of one batch from :func:`make_batch`: ``(loss, parts)``.

    Padded batches compute logits at their ``target_positions`` last columns only (every row's
    target is there, see ``objective.collate``): the output projection over the vocabulary is the
    largest single matmul of a small model, and the prompt's logits carry no loss. Packed blocks
    (targets spread through the block; no mask, no KV cache: block-diagonal attention) need all.
    """
    if "attention_mask" not in b:
        out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
        return joint_loss(out.logits, b["labels"], b["loss_weights"], b["segment_ids"], clarify=b.get("clarify"),
                          decision=decision)
    import torch

    n = b["input_ids"].shape[1]
    keep = int(b["target_positions"])
    # The kept columns as an index tensor, not an int: transformers slices the hidden states with
    # it, and a tensor index gives a contiguous copy that the output projection multiplies with one
    # matmul; a slice (non-contiguous) makes torch expand and copy the vocabulary-sized weight per row.
    cols = torch.arange(n - keep, n, device=b["input_ids"].device)
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                logits_to_keep=cols, use_cache=False)
    tail = slice(n - keep, None)
    return joint_loss(out.logits, b["labels"][:, tail], b["loss_weights"][:, tail], b["segment_ids"][:, tail],
                      clarify=b.get("clarify"), decision=decision)


def canonical_train_table(table, part: str | None, packed: bool = False):
    """The train split's token columns in the canonical order the data order is defined on (by
    example id; packed blocks by their first example id), whatever order the reader delivered them
    in. Pipeline parts that train only clarification segments keep only the examples that have them
    (not the clear turns, nor ``decision_only`` positives, whose target is the decision alone)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if packed:
        first = pc.list_element(table["example_ids"], 0)
        return table.take(pc.sort_indices(table.append_column("_first", first), sort_keys=[("_first", "ascending")]))
    table = table.take(pc.sort_indices(table, sort_keys=[("id", "ascending")]))
    if part in ("how", "what"):
        segs = table["segment_ids"].combine_chunks()
        wanted = pc.is_in(pc.list_flatten(segs), value_set=pa.array([SEGMENT_IDS[s] for s in PIPELINE_PARTS[part]]))
        rows = pc.unique(pc.filter(pc.list_parent_indices(segs), wanted))  # ascending: parents are in order
        table = table.take(rows)
    return table


def train_columns(packed: bool, balance: str = "none") -> list[str]:
    """The train split's columns the loop reads (``data_source`` only to balance by source)."""
    if packed:
        return ["example_ids", "num_tokens", *PACKED_COLUMNS]
    return [*TRAIN_COLUMNS, "data_source"] if balance != "none" else TRAIN_COLUMNS


def load_train_table(data_root: str, part: str | None, packed: bool = False):
    """The train split read directly with pyarrow (the benchmarks' plain loop; the Ray Train
    workers receive the same rows through Ray Data, see :func:`shard_to_table`)."""
    from clarifier.data.outputs import PACKED_DIR, read_split_table

    table = read_split_table(data_root, PACKED_DIR if packed else "train", columns=train_columns(packed))
    return canonical_train_table(table, part, packed)


def shard_to_table(shard):
    """Drain a Ray Data iterator (``ray.train.get_dataset_shard``) into one Arrow table."""
    import pyarrow as pa

    batches = [b for b in shard.iter_batches(batch_size=None, batch_format="pyarrow") if b.num_rows]
    if not batches:
        raise RuntimeError("the train dataset given to this worker is empty")
    return pa.concat_tables(batches, promote_options="permissive")


# ---- RNG / optimizer state -----------------------------------------------------------------


def rng_state() -> dict:
    import numpy as np
    import torch

    npst = np.random.get_state()
    st = {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
          "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    import numpy as np
    import torch

    v, internal, gauss = st["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def optimizer_checksum(engine) -> float:
    """Sum of |x| over this rank's optimizer state tensors (its ZeRO partition): restored == saved."""
    import torch

    opt = engine.optimizer
    seen = set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        state = getattr(opt, "state", None)
        if isinstance(state, dict) and state and not hasattr(opt, "optimizer"):
            break
        opt = getattr(opt, "optimizer", None)
    total = 0.0
    for s in (getattr(opt, "state", {}) or {}).values():
        for v in (s.values() if isinstance(s, dict) else ()):
            if torch.is_tensor(v) and v.is_floating_point() and v.numel() > 1:
                total += float(v.detach().double().abs().sum())
    return total


# ---- the loop ------------------------------------------------------------------------------


class WorkerRecipe:
    """One Ray Train worker's training, read top to bottom (torchtune's recipe shape):
    :meth:`setup` (model, DeepSpeed engine, data), :meth:`restore` (the last checkpoint, verified),
    :meth:`setup_tracking`, then :meth:`train`, which repeats :meth:`step` and
    :meth:`save_checkpoint`. ``callbacks`` are objects with ``on_step_end(recipe, step)`` called on
    every worker after each optimizer step (and its checkpoint); tests inject faults with them
    (``tests/support/faults.py``), never through the product config."""

    def __init__(self, config: dict, callbacks=()):
        import ray.train

        self.config = config
        self.cfg = ClarifierConfig.model_validate(config["cfg"])
        self.part = config.get("part")  # pipeline variant: when / how / what; None = joint
        self.callbacks = list(callbacks)
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device_kind = "cuda" if self.cfg.train.use_gpu else "cpu"
        self.precision = resolve_precision(self.cfg.model.precision, self.device_kind)
        self.step, self.micro, self.resumed = 0, 0, False
        self.lost_before: set[int] = set()  # steps whose metrics earlier attempts could not log

    # ---- set-up ------------------------------------------------------------------------------

    def setup(self) -> None:
        import numpy as np
        import torch

        t = self.cfg.train
        torch.manual_seed(t.seed + self.rank)
        random.seed(t.seed + self.rank)
        np.random.seed(t.seed + self.rank)
        self.threads = set_threads(t.cpus_per_worker)
        use_pinned_ninja()  # DeepSpeed builds its CPU ops with the same ninja everywhere (clarifier.train.ops)
        model = self._setup_model()
        self._setup_engine(model)
        self._setup_data()

    def _setup_model(self):
        from peft import LoraConfig, get_peft_model

        from clarifier.engine.models import load_causal_lm, load_tokenizer, resolve_base_model

        cfg = self.cfg
        base_path = resolve_base_model(cfg.model.base_model, cfg.model.cache_dir)
        self.tok = load_tokenizer(base_path)
        # bf16: frozen weights load in bf16; LoRA weights are created in fp32 and DeepSpeed's bf16 mode
        # computes in bf16 while it keeps the fp32 master weights and optimizer state (the loss is fp32).
        # On CPU in bf16 the eager attention trains faster than torch's SDPA kernel, whose bf16 backward
        # is slower than its fp32 one (measured on SmolLM2-135M, 2 x 177 tokens: 225 vs 198 tokens/s).
        attn = "eager" if self.precision == "bf16" and self.device_kind == "cpu" else None
        model = load_causal_lm(base_path, dtype=torch_dtype(self.precision), attn_implementation=attn)
        if cfg.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        self.full = cfg.model.finetune == "full"
        if not self.full and cfg.model.init_from:
            # Continue an existing adapter (model.init_from, checked on the driver): its weights and its LoRA shape.
            from peft import PeftModel

            from clarifier.engine.loading import resolve_model
            from clarifier.runtime.mlflow_uri import tracking_uri

            folder = resolve_model(cfg.model.init_from, cfg.model.cache_dir, tracking_uri(cfg.tracking.tracking_uri)).folder
            model = PeftModel.from_pretrained(model, str(folder), is_trainable=True)
        elif not self.full:
            lc = cfg.model.lora
            model = get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                                     target_modules=lc.target_modules, task_type="CAUSAL_LM"))
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.total = sum(p.numel() for p in model.parameters())
        return model

    def _setup_engine(self, model) -> None:
        import deepspeed

        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=deepspeed_config(self.cfg, self.cfg.train.max_steps, self.precision),
        )

    def _setup_data(self) -> None:
        import ray.train

        t = self.cfg.train
        # The train split arrives through Ray Data (read on the cluster by the driver's dataset, not
        # split: every worker gets all rows and takes its share of one global order, see above).
        self.table = canonical_train_table(shard_to_table(ray.train.get_dataset_shard("train")), self.part,
                                           packed=self.cfg.data.packing.enabled)
        self.n_rows = self.table.num_rows
        self.per_epoch = micro_batches_per_epoch(self.n_rows, self.world, t.micro_batch_size)
        if self.per_epoch < 1:
            raise RuntimeError(f"worker {self.rank}: the train split{f' (part {self.part})' if self.part else ''} "
                               f"has {self.n_rows} examples, fewer than train.num_workers x train.micro_batch_size = "
                               f"{self.world * t.micro_batch_size}")
        # train.balance=source_class: the epochs' row order balances the classes inside every source.
        self.keys = (tuple(zip(self.table["data_source"].to_pylist(), self.table["needs_clarification"].to_pylist()))
                     if t.balance == "source_class" else None)
        self.scale = segment_scale(self.part)
        self.curve = self._curve_sample()
        self.curve_tok = None
        dl = self.config.get("decision_loss")
        self.dloss = DecisionLoss(**dl) if dl else DecisionLoss()

    def _curve_sample(self) -> list:
        """The fixed dev sample of ``train.learning_curve`` (every rank scores it: ZeRO-3 shards need all)."""
        lc = self.cfg.train.learning_curve
        if not lc.every or self.part in ("how", "what"):  # those parts do not train the decision
            return []
        from clarifier.core.schema import sample_by_source
        from clarifier.data.outputs import load_split

        split = self.cfg.eval.calibration_split or "dev"
        try:
            dev = load_split(self.cfg.data.output, split)
        except FileNotFoundError:
            dev = []
        if len({e.needs_clarification for e in dev}) < 2:
            if self.rank == 0:
                _say(f"[train] learning curve off: the {split} split does not have both classes")
            return []
        return sample_by_source(dev, lc.examples_per_source, self.cfg.train.seed, clarify_share=0.5)

    def score_curve(self) -> None:
        """One point of the learning curve: P(clarify) of the dev sample with the weights as they are now,
        within-source AUROC (and recall at 10% over-asking) logged at this step."""
        import torch

        from clarifier.core.metrics import within_source_summary
        from clarifier.core.schema import source_of
        from clarifier.engine.inference import ClarifierEngine
        from clarifier.engine.models import load_tokenizer, resolve_base_model

        module = self.engine.module
        if self.curve_tok is None:  # its own tokenizer: the engine pads on the left, training's must not change
            self.curve_tok = load_tokenizer(resolve_base_model(self.cfg.model.base_model, self.cfg.model.cache_dir))
        scorer = ClarifierEngine(module, self.curve_tok,
                                 prompt_opts=self.cfg.model.prompt_options())
        t0 = time.time()
        with torch.no_grad():
            scores = scorer.score_examples(self.curve, self.cfg.train.learning_curve.batch_size)
        module.train()
        if self.rank != 0:
            return
        w = within_source_summary([e.needs_clarification for e in self.curve], scores, [source_of(e) for e in self.curve])
        m = {"dev/macro_auroc": w["macro_auroc"], "dev/min_auroc": w["min_auroc"],
             "dev/macro_recall_at_10pct": w["macro_recall_at_budget"],
             **{f"dev/auroc/{s}": v["auroc"] for s, v in w["by_source"].items()}}
        self.tracker.log_metrics({k: float(v) for k, v in m.items() if v is not None}, self.step)
        _say(f"[train] step {self.step}: dev within-source AUROC {w['macro_auroc']:.3f} ("
             + ", ".join(f"{s} {v['auroc']:.2f}" for s, v in w["by_source"].items() if v["auroc"] is not None)
             + f"; {len(self.curve)} examples, {time.time() - t0:.0f}s)")

    # ---- restore -----------------------------------------------------------------------------

    def restore(self) -> bool:
        """Continue from ``ray.train.get_checkpoint()`` if there is one: DeepSpeed state, this rank's
        RNG streams and the data position; the optimizer state is verified against its checksum."""
        import ray.train
        import torch

        from clarifier.train.tracking import parse_step_ranges

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return False
        with ckpt.as_directory() as d:
            state = json.loads(open(os.path.join(d, STATE_FILE)).read())
            if int(state["world_size"]) != self.world:
                raise RuntimeError(
                    f"checkpoint was written by {state['world_size']} workers, this run has {self.world}: "
                    "resume with the same train.num_workers (the data order and ZeRO shards depend on it)")
            if state.get("precision", self.precision) != self.precision:
                raise RuntimeError(
                    f"checkpoint was trained in {state['precision']}, this run resolves model.precision="
                    f"{self.cfg.model.precision!r} to {self.precision}: resume with model.precision={state['precision']}")
            load_path, _ = self.engine.load_checkpoint(os.path.join(d, DS_DIR), tag=state["tag"],
                                                       load_module_strict=False, load_optimizer_states=True,
                                                       load_lr_scheduler_states=True)
            if load_path is None:
                raise RuntimeError(f"DeepSpeed found no checkpoint {state['tag']!r} under {d}/{DS_DIR}")
            rs = torch.load(os.path.join(d, RANK_DIR, f"rank{self.rank}.pt"), weights_only=True)
        got = optimizer_checksum(self.engine)
        if abs(got - rs["optimizer_checksum"]) > 1e-6 * max(1.0, abs(rs["optimizer_checksum"])):
            raise RuntimeError(f"worker {self.rank}: optimizer state not restored from step {state['step']} "
                               f"(checksum {got} != saved {rs['optimizer_checksum']})")
        set_rng_state(rs["rng"])
        self.step, self.micro = int(state["step"]), int(state["micro_batches"])
        self.lost_before = parse_step_ranges(state.get("tracking_lost_steps"))
        self.resumed = True
        if self.rank == 0:
            _say(f"[train] resumed from step {self.step} ({self.micro} micro-batches consumed); optimizer state verified")
        return True

    def setup_tracking(self) -> None:
        """Rank 0 logs to MLflow through the buffer of :mod:`clarifier.train.tracking`, skipping
        steps the run already has."""
        from clarifier.train.tracking import SafeTracker

        tc, rank = self.cfg.tracking, self.rank
        self.tracker = SafeTracker(self.config.get("mlflow_run_id") if rank == 0 else None,
                                   self.config.get("tracking_uri"), max_buffered=tc.buffer_max_values,
                                   request_timeout_s=tc.request_timeout_s,
                                   lost_steps=self.lost_before if rank == 0 else ())
        known = self.tracker.last_step("train/loss") if rank == 0 else None
        self.logged_upto = known or 0
        if rank == 0 and self.resumed and known is not None and known < self.step:
            # The previous attempt computed these steps but its buffered metrics died with it (or the
            # server was down): the run lacks them and this attempt does not recompute them.
            self.tracker.note_lost_steps(range(known + 1, self.step + 1))
        if rank == 0:
            t, lc = self.cfg.train, self.cfg.model.lora
            _say(f"[train] {self.world} workers, ZeRO-{t.zero_stage}, "
                 f"{'full fine-tuning' if self.full else f'LoRA r={lc.r}'}"
                 f"{f', pipeline part {self.part!r}' if self.part else ''}: {self.trainable:,} trainable of "
                 f"{self.total:,} parameters; {self.n_rows} rows, {self.per_epoch} micro-batches per epoch; precision "
                 f"{describe(self.cfg.model.precision, self.device_kind)}, {self.threads} torch thread(s) per worker")
            if self.resumed:
                self.tracker.log_metrics({"train/resumed_at_step": self.step}, self.step)

    # ---- the loop ----------------------------------------------------------------------------

    def step_once(self) -> tuple[list[float], dict, int]:
        """Micro-batches up to the next optimizer step: (their losses, the last loss parts, tokens)."""
        t = self.cfg.train
        losses, tokens = [], 0
        while True:
            idx = batch_indices(self.n_rows, t.seed, self.world, self.rank, t.micro_batch_size, self.micro, self.keys)
            b = make_batch(self.table, idx, self.tok.pad_token_id, self.engine.device, self.scale)
            loss, parts = forward_loss(self.engine, b, self.dloss)
            self.engine.backward(loss)
            self.engine.step()
            self.micro += 1
            tokens += int(b["n_tokens"])
            losses.append(float(loss.detach()))
            if self.micro % t.gradient_accumulation_steps == 0:
                self.step += 1
                return losses, parts, tokens

    def should_stop(self, t_start: float) -> bool:
        """Every rank agrees (all-reduce) to stop at the same step: max_steps or the time budget."""
        import torch
        import torch.distributed as dist

        t = self.cfg.train
        over = t.max_minutes is not None and (time.time() - t_start) > t.max_minutes * 60
        flag = torch.tensor([1.0 if (over or self.step >= t.max_steps) else 0.0])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def train(self) -> None:
        import numpy as np

        t, tc = self.cfg.train, self.cfg.tracking
        if self.step >= t.max_steps:  # the restored checkpoint is already the final one (fit() returns it)
            if self.rank == 0:
                _say(f"[train] checkpoint at step {self.step} is final; nothing left to train")
            self.tracker.close(tc.flush_timeout_s)
            return
        t_start = t_last = time.time()
        steps_at_start = self.step
        while True:
            losses, parts, tokens = self.step_once()
            stop = self.should_stop(t_start)
            now = time.time()
            if self.rank == 0:
                lr = self.scheduler.get_last_lr()[0] if self.scheduler is not None else t.learning_rate
                m = {"train/loss": float(np.mean(losses)), "train/lr": lr,
                     "train/tokens_per_s": tokens * self.world / max(now - t_last, 1e-6),
                     "train/epoch": self.micro / self.per_epoch}
                m.update({f"train/loss_{k}": v for k, v in parts.items()})
                if self.step > self.logged_upto:
                    self.tracker.log_metrics(m, self.step)
                eta = (now - t_start) / max(self.step - steps_at_start, 1) * (t.max_steps - self.step)
                if t.max_minutes is not None:  # the time budget ends training first on a slow box
                    eta = min(eta, max(t.max_minutes * 60 - (now - t_start), 0.0))
                _say(f"[train] step {self.step}/{t.max_steps} loss {m['train/loss']:.4f} "
                     f"({', '.join(f'{k} {v:.3f}' for k, v in parts.items())}) lr {lr:.2e} "
                     f"{m['train/tokens_per_s']:.0f} tok/s eta {eta:.0f}s")
            if self.curve and (stop or self.step % t.learning_curve.every == 0):
                self.score_curve()
            t_last = time.time()
            if stop or (t.checkpoint_every and self.step % t.checkpoint_every == 0):
                self.save_checkpoint(final=stop)
            for cb in self.callbacks:
                cb.on_step_end(self, self.step)
            if stop:
                break
        ts = self.tracker.close(tc.flush_timeout_s)  # (already closed by the final checkpoint)
        if self.rank == 0 and (ts["failed_calls"] or ts["lost_steps"]):
            _say(f"[train] MLflow tracking: {ts['failed_calls']} failed requests, up to {ts['peak_buffered']} values "
                 f"buffered; " + (f"metrics of {ts['lost_steps']} steps lost (steps {ts['lost_step_ranges']}, "
                                  f"{ts['lost_values']} values)" if ts["lost_steps"] else "every step's metrics delivered"))

    def save_checkpoint(self, final: bool) -> None:
        _report(self.engine, self.tok, self.cfg, self.step, self.micro, self.rank, self.world, self.tracker,
                final=final, config=self.config, precision=self.precision)


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's entry on every worker: the :class:`WorkerRecipe`, in order."""
    global _RELAY
    _RELAY = config.get("relay")
    recipe = WorkerRecipe(config, callbacks=config.get("callbacks") or ())
    recipe.setup()
    recipe.restore()
    recipe.setup_tracking()
    recipe.train()


def _save_model(engine, d: str, rank: int, zero_stage: int, precision: str) -> None:
    """Rank 0 writes the trained weights as safetensors: the LoRA adapter (a PEFT model), or the whole
    model (full fine-tuning). In bf16 these are DeepSpeed's fp32 master weights, gathered from every
    rank's partition (the bf16 copies the model computed with are rounded to 8 bits of mantissa);
    under ZeRO-3 in fp32 every rank first gathers the parameters from the shards."""
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if precision == "bf16":
        from deepspeed.utils import safe_get_full_fp32_param

        state = {}
        for name, p in params:  # collective: every rank takes part for every parameter
            full = safe_get_full_fp32_param(p)
            if rank == 0:
                state[name] = full.detach().to("cpu", copy=True)
        if rank == 0:
            engine.module.save_pretrained(d, safe_serialization=True, state_dict=state)
    elif zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            if rank == 0:
                engine.module.save_pretrained(d, safe_serialization=True)
    elif rank == 0:
        engine.module.save_pretrained(d, safe_serialization=True)


def _report(engine, tok, cfg: ClarifierConfig, step: int, micro: int, rank: int, world: int, tracker,
            final: bool, config: dict, precision: str) -> None:
    import ray.train
    import torch

    from clarifier.engine.inference import ModelMeta, write_meta

    tag = f"step{step:08d}"
    # Metrics of the steps up to this checkpoint reach MLflow before it is reported (a crash right
    # after it cannot lose them), unless the server is down: then they stay buffered; at the end,
    # wait up to tracking.flush_timeout_s for it so the final counts of lost metrics are known.
    tc = cfg.tracking
    if final:
        tracker.close(tc.flush_timeout_s)
    else:
        tracker.flush(tc.request_timeout_s, only_if_up=True)
    ts = tracker.stats()
    metrics = {"step": step, "final": final, "tracking_lost_steps": ts["lost_steps"],
               "tracking_lost_step_ranges": ts["lost_step_ranges"], "tracking_lost_values": ts["lost_values"],
               "tracking_failed_calls": ts["failed_calls"]}
    with tempfile.TemporaryDirectory() as d:
        # Collective (every rank): ZeRO shards of optimizer / scheduler / trainable weights.
        engine.save_checkpoint(os.path.join(d, DS_DIR), tag=tag, exclude_frozen_parameters=True)
        _save_model(engine, d, rank, cfg.train.zero_stage, precision)
        os.makedirs(os.path.join(d, RANK_DIR), exist_ok=True)
        torch.save({"rng": rng_state(), "optimizer_checksum": optimizer_checksum(engine)},
                   os.path.join(d, RANK_DIR, f"rank{rank}.pt"))
        if rank == 0:
            tok.save_pretrained(d)
            write_meta(d, ModelMeta(base_model=cfg.model.base_model, threshold=cfg.eval.threshold,
                                    finetune=cfg.model.finetune, precision=precision,
                                    prompt=cfg.model.prompt_meta()))
            state = {"step": step, "micro_batches": micro, "samples": micro * world * cfg.train.micro_batch_size,
                     "final": final, "tag": tag, "world_size": world, "zero_stage": cfg.train.zero_stage,
                     "seed": cfg.train.seed, "part": config.get("part"), "precision": precision, "mlflow_run_id": config.get("mlflow_run_id"),
                     "tracking_lost_steps": ts["lost_step_ranges"]}
            with open(os.path.join(d, STATE_FILE), "w") as f:
                json.dump(state, f)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d),
                         checkpoint_dir_name=f"checkpoint_{tag}")
    # Wait until the controller has registered this checkpoint: a worker dying right after
    # report() could otherwise lose it (the restart would then start over from step 0).
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
