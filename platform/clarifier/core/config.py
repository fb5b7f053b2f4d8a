"""Typed configuration: YAML in, validated, with dotted ``key=value`` overrides.

    cfg = load_config("platform/clarifier/quickstart.yaml", ["train.max_steps=20", "model.lora.r=4"])

A wrong key or a wrong type is a ``ConfigError`` that names the dotted key (and the file).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clarifier.core.objective import SegmentWeights
from clarifier.core.prompt import PromptOptions


class ConfigError(ValueError):
    """A configuration problem; the message names the key and, when known, the file."""


def _regexes(v: list[str]) -> list[str]:
    """A field validator: every entry compiles as a regular expression (the error names the first that does not)."""
    for i, pat in enumerate(v):
        try:
            re.compile(pat)
        except re.error as exc:
            raise ValueError(f"pattern [{i}] {pat!r} is not a valid regex: {exc}") from None
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(_Strict):
    """Where runs keep their artifacts: Ray Train results and checkpoints, model folders, evaluation reports, the registry's audit log."""

    root: str = Field(".clarifier", description="Local folder or s3:// prefix for all artifacts of a run.")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, s3rver); else AWS.")


class SilverGroundingConfig(_Strict):
    """Fill missing grounding of clarify examples from MiniLM similarity (see clarifier.data.grounding)."""

    enabled: bool = Field(False, description="Run the silver-grounding stage in the data job.")
    encoder: str | None = Field(None, description="Sentence encoder: null = packaged all-MiniLM-L6-v2; folder, hub id or s3://.")
    roles: list[Literal["user", "assistant", "system"]] = Field(["user"], description="Turns that can be grounding.")
    min_similarity: float = Field(0.3, ge=-1, le=1, description="MiniLM cosine similarity to the question a turn needs to be chosen.")
    margin: float = Field(0.3, ge=0, le=2, description="Keep turns within this much of the best turn's similarity.")
    max_turns: int = Field(3, ge=1, description="Choose at most this many (most similar) turns per example.")
    compare_with_gold: bool = Field(True, description="Also score gold-grounded examples to report agreement.")
    actors: int = Field(1, ge=1, description="Encoder actors (each holds one encoder).")


class PackingConfig(_Strict):
    """Pack train examples into fixed-length blocks (attention kept within each example)."""

    enabled: bool = Field(False, description="The data job also writes packed train blocks (train_packed/) and training "
                                             "reads those. Not with train.variant=pipeline or train.balance.")
    block_length: int = Field(1024, ge=8, description="Tokens per packed block; >= data.max_length.")


# Default rules of clarifier.data.labelling (regexes, matched case-insensitively on the assistant turn).
DEFAULT_CLARIFY_PATTERNS = (
    r"\byou mean\b",  # do / did / whether / what do you mean
    r"\bwhich (one|ones|of)\b",
    r"\bwhich \w+(\s\w+)? (do|did|are|were|would|should) you\b",
    r"\b(could|can|would) you (please )?(clarify|specify|be more specific)\b",
    r"\bare you (asking|referring|talking|thinking) (about|to|of)\b",
    r"\b(do|would) you (want|like|need|prefer|have in mind)\b.*\bor\b",
    r"\bwhen you say\b",
    r"\bare you (looking|searching) for\b",
    r"\b(is|was) (this|it|that) (about|for|regarding)\b.*\bor\b",
)
DEFAULT_EXCLUDE_PATTERNS = (
    r"\banything else\b",
    r"\bsomething else\b",
    r"\bis there (anything|something|more)\b",
    r"\b(does|did|do) (this|that|these|it) (help|answer|work|solve|make sense)\b",
    r"\b(can|may) i help\b",
    r"\bhow else\b",
    r"\bhope (this|that) helps\b",
)


class LabellingConfig(_Strict):
    """Rules that label unlabelled conversation logs (see clarifier.data.labelling and README "Labelling raw logs")."""

    enabled: bool = Field(False, description="Label conversation logs without any gold label by these rules.")
    require_question_mark: bool = Field(True, description="A clarifying assistant turn must end with '?'.")
    patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_CLARIFY_PATTERNS),
        description="Regexes (case-insensitive); a clarifying turn matches at least one. Empty = any turn ending with '?'.")
    exclude_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_EXCLUDE_PATTERNS),
        description="Regexes (case-insensitive); a turn matching any is not clarifying (e.g. 'Anything else?').")
    max_question_chars: int = Field(300, ge=1, description="Longer assistant turns are answers, not clarifying questions.")
    question_text: Literal["full", "from_question"] = Field(
        "full", description="Target question: the whole assistant turn, or from its first sentence ending in '?'.")
    grounding: Literal["first_mention", "all_mentions", "none"] = Field(
        "first_mention", description="Prior turns that first mention (or: all that mention) a content word of the question not in the query.")
    min_word_chars: int = Field(3, ge=1, description="Shorter words (without digits) are not content words.")
    extra_stopwords: list[str] = Field(default_factory=list, description="Added to the built-in stopword list.")
    max_grounding_turns: int | None = Field(None, ge=1, description="Keep at most this many (most recent) grounding turns.")

    _compiles = field_validator("patterns", "exclude_patterns")(_regexes)


DATASET_REF = "dataset:"  # src: dataset:<name> names a registered public dataset (clarifier.data.datasets)


class SourceConfig(_Strict):
    """One dataset the data job imports into ``data.input`` before it runs (see clarifier.data.sources)."""

    importer: str = Field(..., description="Importer name (clariq, pacific, abgcoqa, claqua, a plugin's) or a generator: 'synthetic' (ambiguity from the history), 'synthetic_rag' (ambiguity in the retrieved passages).")
    name: str | None = Field(None, description="Name of this source in meta.source, counts and leave-one-out; default: the importer name.")
    src: str = Field("", description="The dataset's folder or s3:// prefix (importers), or dataset:<name>: a registered "
                                     "public dataset (clarifier.data.datasets), read from data.mirror or the download "
                                     "cache (clarifier data fetch <name>); unused for the generators.")
    options: dict[str, Any] = Field(default_factory=dict, description="Importer options; generators: {conversations: N, seed: S} (defaults data.synthetic_conversations, data.seed).")
    max_examples: int | None = Field(None, ge=1, description="Keep at most this many examples, whole conversations in a seeded random order; the rest are counted as dropped_by_cap.")

    @field_validator("src")
    @classmethod
    def _dataset_named(cls, v: str) -> str:
        if v.startswith(DATASET_REF) and not v[len(DATASET_REF):].strip():
            raise ValueError(f"{v!r} names no dataset: write {DATASET_REF}<name>, e.g. {DATASET_REF}clariq")
        return v

    @property
    def source_name(self) -> str:
        return self.name or self.importer

    @property
    def dataset(self) -> str | None:
        """The registered dataset that ``src: dataset:<name>`` names; None for a folder or s3:// prefix."""
        return self.src[len(DATASET_REF):].strip() if self.src.startswith(DATASET_REF) else None


class DataRequestLogConfig(_Strict):
    """``data.request_log``: data.input is a serving request log (serve.request_log); the job first puts each
    conversation back together and labels its served turns by what happened next (clarifier.data.served_logs)."""

    enabled: bool = Field(False, description="Read data.input as a request log (records with meta.request_log).")
    min_reformulation_overlap: float = Field(
        0.5, gt=0, le=1, description="Content-word overlap (Jaccard) of the user's next message with the query at or "
                                     "above which it is a reformulation (a missed clarification).")


class DataConfig(_Strict):
    """The data job (`clarifier data prepare`): conversation logs to validated, split, tokenised Parquet (clarifier.data.pipeline)."""

    input: str = Field("", description="Folder, file or s3:// prefix of conversation logs / examples.")
    mirror: str | None = Field(
        None, description="Local folder or s3:// prefix holding <name>/ copies of the registered public datasets: "
                          "data.sources entries with src: dataset:<name> are read from there first, then from the "
                          "download cache ($CLARIFIER_CACHE/datasets); null = $CLARIFIER_DATA_MIRROR, if set.")
    output: str = Field("", description="Where the data job writes Parquet splits and its manifest.")
    formats: list[Literal["jsonl", "jsonl.gz", "parquet"]] = Field(
        ["jsonl", "jsonl.gz", "parquet"], description="Input file kinds read under data.input (Parquet: one example or log per row).")
    split: dict[str, float] = Field(
        {"train": 0.8, "dev": 0.1, "test": 0.1},
        description="Split name -> fraction of conversations (normalised; 0 = none), assigned by a seeded hash of the "
                    "conversation id, so a conversation never lands in two splits.")
    seed: int = Field(0, description="Seeds the split hash, the synthetic generators (unless options.seed) and the sample "
                                     "data.sources[].max_examples keeps.")
    max_length: int = Field(512, description="Tokens of prompt + target per example; a longer example is filtered "
                                             "(reason too_long).")
    max_turn_chars: int = Field(200_000, ge=1, description="Guard against abuse only: a record with a longer turn is "
                                "quarantined. Real long turns (RAG answers of thousands of characters) are kept; the "
                                "prompt renderer truncates them by tokens.")
    synthetic_conversations: int = Field(
        400, description="Conversations that `clarifier data prepare --synthetic` writes to data.input; the synthetic "
                         "generators' default options.conversations.")
    shuffle_strategy: Literal["sort", "hash"] = Field(
        "sort", description="Ray Data shuffle behind the duplicate-key aggregate beyond 200,000 examples (below, "
                            "one task groups the keys): sort = the task-based pull shuffle, hash = Ray's actor-based "
                            "hash shuffle (~2x slower on a 2-core box; scales to more partitions on a large cluster).")
    encode_actors: int | None = Field(
        None, ge=1, description="Actors that tokenise and write the examples (one CPU each); default: the cluster's "
                                "CPUs (a local instance: the machine's cores).")
    silver_grounding: SilverGroundingConfig = SilverGroundingConfig()
    packing: PackingConfig = PackingConfig()
    labelling: LabellingConfig = LabellingConfig()
    request_log: DataRequestLogConfig = DataRequestLogConfig()
    sources: list[SourceConfig] = Field(
        default_factory=list,
        description="Datasets imported into data.input (which the data job then owns) before the job runs; empty = read data.input as it is.")

    @field_validator("sources")
    @classmethod
    def _unique_sources(cls, v: list[SourceConfig]) -> list[SourceConfig]:
        names = [s.source_name for s in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"source names must be unique; repeated: {dup} (set 'name' to tell them apart)")
        return v


class LoraConfig(_Strict):
    r: int = Field(16, ge=1, description="Rank of the adapter's low-rank matrices.")
    alpha: int = Field(32, ge=1, description="LoRA scaling: the adapter's update is scaled by alpha / r.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter's input during training.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names of the base model's modules that get an adapter (default: the attention and MLP projections).")


class ModelConfig(_Strict):
    """The base model, how it is fine-tuned, and the prompt it is trained, evaluated and served with."""

    base_model: str = Field(
        "smollm2-135m-instruct",
        description="Built-in name, hub id, local folder, .gguf file or s3:// prefix.",
    )
    cache_dir: str | None = Field(None, description="Where resolved/converted base models are cached.")
    finetune: Literal["lora", "full"] = Field(
        "lora", description="lora: train a PEFT LoRA adapter (model.lora) on the frozen base; full: train every "
                            "weight of the base (the model folder then holds full safetensors weights).")
    lora: LoraConfig = Field(LoraConfig(), description="The adapter, with model.finetune=lora (ignored with full).")
    init_from: str | None = Field(
        None, description="Start from this Clarifier LoRA model's adapter weights (models:/name@alias, models:/name/3, "
                          "runs:/..., s3:// or a folder; e.g. this week's champion) instead of a fresh adapter; its "
                          "LoRA shape replaces model.lora. It must be a LoRA model on the same base model.")
    max_prompt_tokens: int = Field(
        PromptOptions.max_prompt_tokens,
        description="Token budget of the prompt: the oldest history turns are dropped until it fits (training, "
                    "evaluation and serving alike; the model folder records it).")
    max_history_turns: int | None = Field(
        PromptOptions.max_history_turns, ge=0,
        description="Show the model at most this many of the latest history turns (training, evaluation and serving "
                    "alike; the model folder records it); older ones are dropped as max_prompt_tokens drops them. "
                    "None: as many as max_prompt_tokens allows.")
    passage_focus: bool = Field(
        PromptOptions.passage_focus,
        description="A retrieved passage longer than the prompt's passage limit (300 characters) shows the run of its "
                    "sentences sharing the most words with the latest message and the shown history, instead of its "
                    "beginning (clarifier.core.prompt.focus_passage; training, evaluation and serving alike).")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Numeric precision of training, calibration and evaluation: auto = bf16 where the device "
                            "computes it natively (CUDA with bf16; a CPU with AVX512-BF16 or AMX), else fp32. "
                            "Training keeps fp32 master weights, optimizer state and loss.")
    decode: Literal["auto", "fast", "fast-bf16", "generate"] = Field(
        "auto", description="How evaluation decodes a question: fast = the engine's fast path (static KV cache, fused "
                            "weights, one request at a time drafts copied from the prompt checked several per step; "
                            "the tokens of transformers' generate), for the Llama family on CPU; fast-bf16 = that path "
                            "with bf16 decode weights and no drafts (half the bytes read per token; the decision keeps "
                            "model.precision; not every question identical, see the decode-speed results); "
                            "auto = fast, or generate where the architecture has no fast path; generate = transformers' "
                            "generate.")

    def prompt_options(self) -> PromptOptions:
        """The prompt renderer's options this model config trains and scores with."""
        return PromptOptions(**self.prompt_meta())

    def prompt_meta(self) -> dict:
        """What a model folder and a data job's manifest record of them (``ModelMeta.prompt``, ``tokenizer``)."""
        return {"max_prompt_tokens": self.max_prompt_tokens, "max_history_turns": self.max_history_turns,
                "passage_focus": self.passage_focus}

    def prompt_differences(self, recorded: dict) -> dict[str, tuple]:
        """``{"model.<name>": (recorded value, this config's value)}`` for each prompt setting where ``recorded`` (a
        data job's manifest ``tokenizer`` section) differs from this config; a setting it lacks was the default."""
        defaults = PromptOptions()
        return {f"model.{k}": (recorded.get(k, getattr(defaults, k)), v) for k, v in self.prompt_meta().items()
                if recorded.get(k, getattr(defaults, k)) != v}


class LossWeights(_Strict):
    """Loss weight of each target segment's tokens; the data job writes them into the tokenised rows."""

    decision: float = Field(SegmentWeights.decision, ge=0, description="Weight of the decision token(s): answer or clarify.")
    grounding: float = Field(SegmentWeights.grounding, ge=0, description="Weight of the grounding line (turns=..., passages=...).")
    question: float = Field(SegmentWeights.question, ge=0, description="Weight of the clarifying question (with the end-of-turn token).")
    format: float = Field(SegmentWeights.format, ge=0, description="Weight of the fixed 'decision:' prefix tokens.")


class DecisionLossConfig(_Strict):
    """The loss on the decision tokens (answer or clarify)."""

    kind: Literal["ce", "weighted", "focal"] = Field(
        "ce", description="Loss on the decision tokens: plain cross-entropy, class-weighted, or focal.")
    clarify_weight: float | Literal["auto"] = Field(
        "auto", description="weighted/focal: weight of 'clarify' examples' decision tokens relative to 'answer' "
                            "ones; auto = n_answer / n_clarify of the train split (from the data manifest).")
    gamma: float = Field(2.0, ge=0, description="focal: the focusing exponent (0 = class-weighted CE).")

    @field_validator("clarify_weight")
    @classmethod
    def _positive(cls, v):
        if v != "auto" and not v > 0:
            raise ValueError("must be > 0 or 'auto'")
        return v


class LearningCurveConfig(_Strict):
    """A learning curve during training: a fixed dev sample scored every few steps, its AUROC logged to MLflow."""

    every: int = Field(0, ge=0, description="Score a dev sample every this many optimizer steps (and at the last "
                                            "step) and log its within-source AUROC to MLflow (dev/...); 0 = off.")
    examples_per_source: int = Field(20, ge=2, description="Dev examples per source in that sample (seeded, the same "
                                                           "each time; half need a question where the split has enough). "
                                                           "Each point costs about a second per example on one CPU core.")
    batch_size: int = Field(8, ge=1, description="Examples per batch when that sample is scored.")


class DecisionHeadConfig(_Strict):
    """An optional decision head fitted after training: a logistic regression on the model's hidden states."""

    enabled: bool = Field(
        False, description="After training, fit a decision head: a logistic regression on the model's hidden states "
                           "at the decision position (several layers), on a sample of the train split, its strength "
                           "chosen on the calibration split by the mean within-source AUROC. The model then decides "
                           "from it instead of the two decision-token logits (same single prefill).")
    layers: list[float] = Field(
        [0.25, 0.5, 0.75, 1.0], min_length=1,
        description="Depths whose states it reads, as fractions of the model's layers (1.0 = the last layer). "
                    "When the deepest is before the last, the decision pass stops after it (a clear turn costs that "
                    "part of a pass; the turns that ask finish it).")
    pooling: list[Literal["last", "mean"]] = Field(
        ["last"], min_length=1,
        description="What it reads of each layer: the state at the decision position (last) and/or the states "
                    "averaged over the prompt's tokens (mean). The recipe joint-public reads both, fitted on every train "
                    "turn: +0.053 mean within-source AUROC over [last] on 600 turns per source, paired interval "
                    "[+0.013, +0.090] (benchmarks/results/recipe-head-refit.json).")
    max_per_source: int | None = Field(
        600, ge=2, description="Train examples per source it is fitted on (seeded; half need a question where the "
                               "source has enough); null: every train example.")
    c_grid: list[float] = Field([1e-4, 3e-4, 1e-3, 3e-3, 1e-2], min_length=1,
                                description="Inverse L2 strengths tried (on standardised features).")
    clip: float | None = Field(
        None, gt=0, description="Limit every standardised feature to [-clip, clip] standard deviations before the "
                                "regression (in fitting and when the engine applies the head), so that a few extreme "
                                "activations cannot swing the decision; null: no limit.")
    batch_size: int = Field(8, ge=1, description="Examples per forward pass when reading the hidden states.")

    @field_validator("layers")
    @classmethod
    def _fractions(cls, v):
        if any(not 0 < f <= 1 for f in v):
            raise ValueError("layers are depth fractions in (0, 1]")
        return v

    @field_validator("pooling")
    @classmethod
    def _pooling(cls, v):
        if len(set(v)) != len(v):
            raise ValueError("pooling lists each of last, mean at most once")
        return v

    @field_validator("c_grid")
    @classmethod
    def _positive_c(cls, v):
        if any(c <= 0 for c in v):
            raise ValueError("every C must be > 0")
        return v


class TrainConfig(_Strict):
    """Training (`clarifier train`): Ray Train workers fine-tuning with DeepSpeed (clarifier.train)."""

    num_workers: int = Field(2, ge=1, description="Ray Train workers (data-parallel DeepSpeed ranks).")
    use_gpu: bool = Field(False, description="One GPU per worker: training runs on CUDA (NCCL); else on CPU (gloo).")
    cpus_per_worker: float = Field(1, gt=0, description="CPUs Ray reserves per worker; also its torch threads.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How Ray places the training workers' bundles: PACK (fewest nodes), SPREAD (across nodes, best effort), STRICT_PACK (one node), STRICT_SPREAD (each worker on a different node).")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2, description="DeepSpeed ZeRO stage: 0 = off; 1 = optimizer state sharded across workers; 2 = also gradients; "
                       "3 = also parameters.")
    micro_batch_size: int = Field(4, ge=1, description="Examples (with data.packing: packed blocks) per worker per "
                                                       "forward/backward pass.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(5e-4, gt=0, description="AdamW peak learning rate, reached after warmup_steps, then "
                                                         "decayed linearly to 0 at max_steps.")
    warmup_steps: int = Field(5, ge=0, description="Optimizer steps of linear warmup to learning_rate (at most "
                                                   "max_steps - 1).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_steps: int = Field(60, ge=1, description="Optimizer steps to train; also the length of the learning-rate schedule.")
    max_minutes: float | None = Field(None, gt=0, description="Stop early (and checkpoint) after this much training time.")
    checkpoint_every: int = Field(0, ge=0, description="Steps between checkpoints; 0 = only at the end.")
    keep_checkpoints: int | None = Field(2, ge=1, description="Newest checkpoints kept in storage; null = all.")
    max_failures: int = Field(1, ge=-1, description="Worker-group failures to recover from (resume from the last checkpoint); -1 = unlimited.")
    seed: int = Field(0, description="Seeds the workers' random generators, the training row order, the learning-curve "
                                     "sample and the decision head's fit.")
    loss_weights: LossWeights = LossWeights()
    decision_loss: DecisionLossConfig = DecisionLossConfig()
    learning_curve: LearningCurveConfig = LearningCurveConfig()
    decision_head: DecisionHeadConfig = DecisionHeadConfig()
    balance: Literal["none", "source_class"] = Field(
        "none", description="The training mixture. none: every train row once per epoch; source_class: inside every "
                            "source half the rows need a question and half are clear (minority class drawn again, "
                            "majority subsampled, anew each epoch), so that which dataset a turn came from predicts "
                            "nothing. Not with data.packing.")
    variant: Literal["joint", "pipeline"] = Field(
        "joint", description="joint: one adapter for decision+grounding+question; pipeline: three adapters "
                             "(when = decision, how = grounding, what = question) trained one after another.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (less memory, ~30% slower).")
    offload_optimizer: bool = Field(False, description="DeepSpeed: keep optimizer state in CPU memory (ZeRO-1/2/3).")
    offload_params: bool = Field(False, description="DeepSpeed: keep parameters in CPU memory (ZeRO-3 only).")
    experiment: str = Field("clarifier", description="MLflow experiment of the training runs (the audit logs to "
                                                     "<experiment>-audit).")
    run_name: str | None = Field(None, description="Names the MLflow run and the Ray Train run; rerunning with the same name (and storage.root) resumes from its last checkpoint.")

    @model_validator(mode="after")
    def _check(self):
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("train.offload_params needs train.zero_stage=3")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("train.offload_optimizer needs train.zero_stage >= 1")
        return self


class EvalConfig(_Strict):
    """Evaluation (`clarifier eval` and the one that ends every training run) and the threshold calibration after training."""

    split: str = Field("test", description="Split of data.output that is evaluated.")
    threshold: float = Field(0.5, ge=0, le=1, description="Decision threshold until calibrated.")
    calibration_split: str | None = Field("dev", description="Split used to calibrate the threshold after training; null = keep eval.threshold.")
    max_over_asking: float | None = Field(
        0.10, ge=0, le=1, description="The operating point: calibrate the threshold on the calibration split for the best "
                                      "recall asking about at most this share of clear turns (over-asking is the costliest "
                                      "error); null = maximise F1 instead.")
    max_examples: int | None = Field(None, ge=1, description="Evaluate only the first this many examples; null = all.")
    max_new_tokens: int = Field(48, ge=1, description="Most tokens generated per example (decision, grounding and "
                                                      "question); the audit and the recipe benchmark use it too.")
    batch_size: int = Field(8, ge=1, description="Examples per batch when scoring and generating (also the "
                                                 "calibration scores after training).")
    baselines: list[Literal["always_ask", "never_ask", "lexical", "base_model"]] = Field(
        ["always_ask", "never_ask", "lexical", "base_model"],
        description="Baseline rows of the report; always_ask, never_ask and lexical are always there, base_model (the "
                    "untrained base model, zero-shot, decision only) only when listed.")
    compare: dict[str, str] = Field(
        default_factory=dict,
        description="More models in the same report, name -> URI (e.g. {pipeline: models:/clarifier-pipeline/3}).")
    engine: Literal["local", "ray"] = Field(
        "local", description="local: score/generate in this process; ray: Ray Data map_batches over a pool of scorer actors.")
    ray_actors: int = Field(1, ge=1, description="eval.engine=ray: scorer actors (each loads the model once).")
    ray_cpus_per_actor: float = Field(1, gt=0, description="eval.engine=ray: CPUs per scorer actor (its torch threads).")
    ray_gpus_per_actor: float = Field(0, ge=0, description="eval.engine=ray: GPUs per scorer actor; > 0 runs the "
                                                           "model on CUDA.")
    semantic_encoder: str | None = Field(
        "all-minilm-l6-v2", description="Sentence encoder for question semantic similarity; null = skip that metric.")

    def ray_pool(self) -> dict:
        """The scorer-actor pool of ``engine=ray``, as ``clarifier.engine.ray_pool`` takes it."""
        return {"actors": self.ray_actors, "cpus_per_actor": self.ray_cpus_per_actor,
                "gpus_per_actor": self.ray_gpus_per_actor}


class GateConfig(_Strict):
    """Promotion gate: the challenger is promoted only when every configured criterion holds."""

    max_f1_drop: float | None = Field(0.01, ge=0, description="Challenger F1 >= champion F1 - this (skipped without a champion).")
    max_over_asking_increase: float | None = Field(
        None, ge=0, description="Challenger over-asking <= champion over-asking + this (skipped without a champion).")
    min_f1: float | None = Field(None, ge=0, le=1, description="Absolute floor on the challenger's decision F1.")
    max_over_asking: float | None = Field(0.35, ge=0, le=1, description="Absolute ceiling on the challenger's over-asking rate.")
    min_validity: float | None = Field(0.95, ge=0, le=1, description="Absolute floor on the share of outputs that parse.")
    # Live evidence (`clarifier models promote --shadow-log <request log>`): the challenger served as the shadow.
    shadow_max_flag_increase: float | None = Field(
        0.05, ge=0, le=1, description="With --shadow-log: the challenger's share of live turns flagged as needing "
                                      "clarification <= the champion's + this (over-asking shows up here first).")
    shadow_min_clear_agreement: float | None = Field(
        0.9, ge=0, le=1, description="With --shadow-log: of the live turns the champion judged clear, the share the "
                                     "challenger also judged clear.")
    shadow_min_requests: int = Field(50, ge=1, description="With --shadow-log: fewer shadowed requests than this "
                                                           "fail the shadow criteria (too little live evidence).")


class RegistryConfig(_Strict):
    """The MLflow model registry: the model name and alias, the promotion gate and its audit log."""

    model_name: str = Field("clarifier", description="Registered model name: the quickstart registers its model "
                                                     "under it; the audit's default model is model_name@alias.")
    alias: str = Field("champion", description="Alias the quickstart sets on the version it registers; see "
                                               "registry.model_name.")
    gate: GateConfig = GateConfig()
    audit_log: str | None = Field(
        None, description="Promotion audit log: local JSONL file or s3:// prefix; default <storage.root>/registry/audit.jsonl.")


class ServeAutoscalingConfig(_Strict):
    """Ray Serve autoscaling of the ClarifierModel deployment (the ingress follows; see serving.app)."""

    enabled: bool = Field(False, description="Autoscale model replicas (serve.num_replicas is then ignored).")
    min_replicas: int = Field(1, ge=1, description="Fewest model replicas.")
    max_replicas: int = Field(4, ge=1, description="Most model replicas (the ingress scales up to as many).")
    initial_replicas: int | None = Field(None, ge=1, description="Model replicas at deployment; null = min_replicas.")
    target_ongoing_requests: float = Field(4, gt=0, description="Ongoing requests per replica the autoscaler aims for.")
    upscale_delay_s: float = Field(30, ge=0, description="Seconds the load must stay above target before replicas are "
                                                         "added (model and ingress).")
    downscale_delay_s: float = Field(600, ge=0, description="Seconds the load must stay below target before replicas "
                                                            "are removed (model and ingress).")
    look_back_period_s: float = Field(30, gt=0, description="Seconds over which ongoing requests are averaged for a "
                                                            "scaling decision.")
    metrics_interval_s: float = Field(10, gt=0, description="Seconds between the replicas' reports of their ongoing "
                                                            "requests to the autoscaler.")

    @model_validator(mode="after")
    def _bounds(self) -> "ServeAutoscalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas ({self.initial_replicas}) outside [min_replicas, max_replicas]")
        return self


REQUEST_LOG_OMITTABLE = ("history", "passages", "passages.text")


class RequestLogConfig(_Strict):
    """``serve.request_log``: every answered request, as a conversation-log record, in rotated JSONL shards
    written off the request path (clarifier.serving.request_log)."""

    uri: str | None = Field(None, description="Local folder or s3:// prefix of the request log; null = off.")
    shard_records: int = Field(500, ge=1, description="A shard is written once it holds this many records...")
    shard_age_s: float = Field(30, gt=0, description="...or once its first record is this many seconds old.")
    max_buffered: int = Field(
        20_000, ge=1, description="Records held in memory (open shard + shards the store has not taken yet); beyond, "
                                  "new records are dropped and counted (metric, log line), requests are still answered.")
    compress: bool = Field(True, description="gzip the shards (.jsonl.gz); false = .jsonl.")
    redact: list[str] = Field(
        default_factory=list, description="Regular expressions replaced by [redacted] in every text (history, query, "
                                          "passages, question) before it is written, e.g. e-mail addresses.")
    omit: list[Literal[REQUEST_LOG_OMITTABLE]] = Field(  # type: ignore[valid-type]
        default_factory=list, description="Parts of the request never written: history (only the query is kept), "
                                          "passages, or passages.text (ids kept).")
    flush_timeout_s: float = Field(
        10, gt=0, description="On shutdown, how long the last shards may take to write (Serve gives a replica 20 s).")

    _compiles = field_validator("redact")(_regexes)


class ServeConfig(_Strict):
    """`clarifier serve`: the Ray Serve application, a batched model deployment behind an HTTP ingress (clarifier.serving.app)."""

    model_uri: str = Field("models:/clarifier@champion", description="The model served: models:/name@alias (followed, "
                           "see model_refresh_s), models:/name/3, runs:/..., s3:// or a model folder.")
    model_name: str | None = Field(None, description="The model id of GET /v1/models and chat completions; default: "
                                   "the registered model's name (models:/name...), else the model folder's name.")
    host: str = Field("127.0.0.1", description="Address the Serve HTTP proxy listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port the Serve HTTP proxy listens on.")
    route_prefix: str = Field("/", description="URL path prefix of the application's endpoints.")
    num_replicas: int = Field(1, ge=1, description="Model replicas without autoscaling (the ingress has one).")
    cpus_per_replica: float = Field(1, gt=0, description="CPUs Ray reserves per model replica; also its torch threads.")
    gpus_per_replica: float = Field(0, ge=0, description="GPUs per model replica (the model then runs on CUDA).")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Numeric precision of the model replicas: auto = bf16 where the replica's device computes "
                            "it natively, else fp32 (the decision probability is computed in fp32 either way).")
    decode: Literal["auto", "fast", "fast-bf16", "generate"] = Field(
        "auto", description="How the replicas decode a question: auto | fast | fast-bf16 | generate, as model.decode "
                            "(auto: the fast path where the architecture has it).")
    autoscaling: ServeAutoscalingConfig = ServeAutoscalingConfig()
    max_ongoing_requests: int = Field(8, ge=1, description="Per model replica; raised to max_batch_size if lower.")
    max_queued_requests: int | None = Field(
        None, ge=-1, description="Requests waiting for a model replica before 503 (Serve's own queue bound; -1 = "
                                 "unbounded); null = derived from the measured throughput and serve.latency_budget_s.")
    latency_budget_s: float = Field(
        5.0, gt=0, description="With max_queued_requests null: admit a request only while the backlog ahead of it is "
                               "answered within this many seconds at the measured throughput; else a fast 503.")
    max_batch_size: int = Field(8, ge=1, description="Most requests a model replica answers in one dynamic batch.")
    batch_wait_timeout_s: float = Field(0.05, ge=0, description="Seconds a model replica waits for more requests to "
                                                                "fill a batch.")
    max_new_tokens: int = Field(48, ge=1, description="Most tokens generated per answer (decision, grounding and "
                                                      "question).")
    max_history_turns: int = Field(50, ge=0, description="Guard against abuse: a request with more history turns is "
                                                         "refused (413).")
    max_chars: int = Field(1_000_000, ge=1, description="Guard against abuse only: history + query + passages of one "
                                                        "request; the prompt renderer truncates long turns by tokens.")
    max_batch_requests: int = Field(32, ge=1, description="Most requests in one POST /v1/clarify/batch.")
    api_keys_file: str | None = Field(
        None, description="File with API keys, one per line (# comments); also $CLARIFIER_API_KEYS (comma separated).")
    model_refresh_s: float = Field(
        30, ge=0, description="Poll a models:/name@alias URI this often and hot-switch on change; 0 = never.")
    request_log: RequestLogConfig = RequestLogConfig()
    shadow_model_uri: str | None = Field(
        None, description="A challenger (e.g. models:/clarifier@challenger) that also scores live requests, off the "
                          "response path: its answers are logged beside the champion's (request log meta.shadow) and "
                          "counted (clarifier_shadow_total), never returned; null = no shadow.")
    shadow_share: float = Field(1.0, ge=0, le=1, description="Share of answered requests the shadow also scores.")
    shadow_max_inflight: int = Field(
        16, ge=1, description="Shadow calls waiting at once per ingress replica; beyond, a request is not shadowed "
                              "(counted as skipped), so a slow shadow never builds a backlog.")
    shadow_timeout_s: float = Field(30, gt=0, description="A shadow answer later than this is counted as failed.")
    tenants_file: str | None = Field(
        None, description="Many assistants, one deployment: a tenants file (YAML/JSON, a path or s3://) naming each "
                          "tenant's model, keys, budget and rate limit (clarifier.core.tenants); model_uri, model_name "
                          "and shadow_model_uri are then unused. null = one model (model_uri).")
    tenants_refresh_s: float = Field(10, ge=0, description="Read the tenants file again this often and apply a "
                                                           "change while serving; 0 = never.")
    max_models_per_replica: int = Field(64, ge=1, description="Tenants a model replica holds at once (Serve's model "
                                                              "multiplexing evicts the least recently used).")
    max_adapters_per_replica: int = Field(4, ge=1, description="Distinct weights (base + adapter) a model replica holds "
                                                               "at once; tenants adapted from one model share one.")


class FeedbackSignalConfig(_Strict):
    """Explicit feedback on an answer (``feedback``/``rating`` fields, see clarifier.data.chatlog)."""

    enabled: bool = Field(True, description="Compute this signal; when off it never marks a turn failed.")
    rating_at_most: float = Field(2, description="A numeric rating at or below this marks a failure (1-5 scale: 2; "
                                                 "set 0 for a 0/1 scale, -1 for a -1/+1 scale).")
    negative_values: list[str] = Field(
        ["down", "thumbs_down", "thumbsdown", "negative", "bad", "dislike", "unhelpful", "wrong", "\U0001f44e"],
        description="Feedback strings (case-insensitive) that mark a failure.")
    positive_values: list[str] = Field(
        ["up", "thumbs_up", "thumbsup", "positive", "good", "like", "helpful", "correct", "\U0001f44d"],
        description="Feedback strings that mark a success (anything else is unknown and counted as such).")


class PatternSignalConfig(_Strict):
    """A signal that fires when the assistant's answer matches one of its patterns."""

    enabled: bool = Field(True, description="Compute this signal; when off it never marks a turn failed.")
    patterns: list[str] = Field(default_factory=list, description="Case-insensitive regular expressions.")


class ReformulationSignalConfig(_Strict):
    """The user restates the same request in the next turn (a sign the answer missed)."""

    enabled: bool = Field(True, description="Compute this signal (the scorer actors then also load the encoder); when "
                                            "off it never marks a turn failed.")
    min_similarity: float = Field(0.75, ge=-1, le=1, description="MiniLM cosine similarity of a user turn and the "
                                                                 "next user turn at or above which it is a reformulation.")
    encoder: str | None = Field(None, description="Sentence encoder; null = the packaged all-MiniLM-L6-v2.")
    actors: int = Field(1, ge=1, description="Not read by the audit: each scorer actor (audit.actors) holds its own "
                                             "encoder.")


class AuditSignalsConfig(_Strict):
    """Outcome signals: a turn failed when any enabled signal fires (clarifier.data.signals)."""

    feedback: FeedbackSignalConfig = FeedbackSignalConfig()
    no_answer: PatternSignalConfig = Field(PatternSignalConfig(patterns=[
        r"\bI (?:could not|couldn['’]?t|cannot|can not|can['’]?t|was unable to|am unable to|wasn['’]?t able to) find\b",
        r"\bno (?:relevant )?(?:information|results|documents?) (?:was |were )?found\b",
        r"\bI (?:do not|don['’]?t) (?:have|know)\b.{0,40}\b(?:information|answer|details)\b",
        r"\bI'?m (?:not sure|sorry, but I (?:can't|cannot|couldn't))\b", r"\bunable to (?:answer|help with)\b"]),
        description="The answer says it found nothing (\"I couldn't find ...\").")
    escalation: PatternSignalConfig = Field(PatternSignalConfig(patterns=[
        r"\b(?:transfer|connect|escalat)\w* (?:you|this|your (?:request|case))\b.{0,40}\b(?:human|agent|person|support|specialist|team)\b",
        r"\bopen(?:ed)? a (?:support )?ticket\b"]),
        description="A hand-off to a human: the log marks it (escalated / handoff) or the answer matches a pattern.")
    reformulation: ReformulationSignalConfig = ReformulationSignalConfig()


class AuditConfig(_Strict):
    """``clarifier audit``: is a clarifier worth it for these logs? (clarifier.evaluation.audit)."""

    logs: str = Field("", description="Folder, file or s3:// prefix of chat transcripts / conversation logs.")
    output: str = Field("", description="Folder or s3:// prefix for the audit's Parquet, report and plots.")
    model_uri: str | None = Field(None, description="The model; null = the registry's registry.model_name@registry.alias "
                                                    "when a tracking URI is set, else the quickstart's model.")
    formats: list[Literal["jsonl", "jsonl.gz", "parquet"]] = Field(
        ["jsonl", "jsonl.gz", "parquet"], description="Log file kinds read under audit.logs (Parquet: one record per row).")
    rule_share: float = Field(0.15, gt=0, lt=1, description="A clarifier is worth it when more than this share of "
                                                            "failed turns needed clarification.")
    confidence: float = Field(0.95, gt=0, lt=1, description="Confidence level of the shares' bootstrap intervals.")
    bootstrap: int = Field(1000, ge=100, description="Bootstrap replicates behind each interval.")
    buckets: int = Field(1000, ge=10, description="Conversations are hashed into this many buckets; the bootstrap "
                                                  "resamples buckets (turns of a conversation stay together).")
    seed: int = Field(0, description="Seeds the bootstrap and the sample of flagged turns given a question.")
    segments: list[str] = Field(["domain"], description="Metadata fields to break the shares down by.")
    max_segment_values: int = Field(20, ge=1, description="Per segment field, the most frequent values shown; the rest are 'other'.")
    sample_questions: int = Field(30, ge=0, description="Flagged turns (a seeded sample) for which a question is "
                                                        "generated and shown in the report.")
    error_rates: Literal["auto", "labels", "report", "calibration", "none"] = Field(
        "auto", description="The model's recall and false-positive rate for the correction: labels = the logs' own "
        "labelled turns; report = eval_report; calibration = the counts stored with the model (its dev split); "
        "auto = labels when there are min_labelled of each class, else report when given, else calibration.")
    eval_report: str | None = Field(None, description="report.json of `clarifier eval` for this model.")
    min_labelled: int = Field(30, ge=1, description="Labelled turns of each class the logs need for their own error "
                                                    "rates (and, in each half, for threshold=youden).")
    min_youden_j: float = Field(0.1, ge=0, lt=1, description="Below this recall - false-positive rate the model's "
                                "flags are too weak to correct from: the verdict is 'undetermined'.")
    threshold: Literal["auto", "model", "youden"] | float = Field(
        "auto", description="Score threshold the shares are estimated at. model = the model's own (its serving "
        "operating point; the calibration counts and eval reports are measured there); youden = the threshold "
        "maximising recall - false-positive rate on half of the logs' labelled turns (split by conversation), "
        "with the error rates measured on the other half: a conservative serving threshold flags too few turns "
        "to correct from. auto = youden when the error rates come from labels and each half has min_labelled "
        "of each class, else model. A number: that threshold (error rates from the labels only).")
    reuse_scores: bool = Field(False, description="Estimate again from the scored turns an earlier audit wrote "
                               "to `output` (same logs, same model) without scoring again: for other error rates, "
                               "threshold, rule, bootstrap or labels. Refused when the logs or the model changed.")
    actors: int | Literal["auto"] = Field(
        "auto", description="Scorer actors (each loads the model once). auto = as many as the CPUs hold at "
        "cpus_per_actor each (this machine's cores for a local Ray, the cluster's CPUs now for RAY_ADDRESS; its GPUs "
        "at gpus_per_actor when that is > 0), never more than there are blocks of turns to score (4 x batch_size "
        "turns each). Also label select's.")
    cpus_per_actor: float = Field(1, gt=0, description="CPUs per scorer actor (its torch threads).")
    gpus_per_actor: float = Field(0, ge=0, description="GPUs per scorer actor; > 0 runs the model on CUDA.")
    batch_size: int = Field(8, ge=1, description="Turns per forward pass of a scorer actor.")

    @field_validator("actors")
    @classmethod
    def _actors_at_least_one(cls, v):
        if v != "auto" and v < 1:
            raise ValueError("actors must be >= 1 or 'auto'")
        return v
    max_turn_chars: int = Field(200_000, ge=1, description="Guard against abuse only: longer turns quarantine their "
                                                            "conversation. Long turns are truncated for the prompt.")
    signals: AuditSignalsConfig = AuditSignalsConfig()


class TrackingConfig(_Strict):
    """MLflow tracking: where runs are logged, and how training copes with an unreachable server."""

    tracking_uri: str | None = Field(None, description="MLflow tracking URI; default: $MLFLOW_TRACKING_URI.")
    buffer_max_values: int = Field(
        50_000, ge=1, description="Training: metric values held in memory while the MLflow server is unreachable "
                                  "(sent when it returns); steps that do not fit are dropped and counted (tracking/lost_steps).")
    request_timeout_s: int = Field(
        10, ge=1, description="Training: timeout of one MLflow request from the logging worker (MLflow's own retries "
                              "are off there; the tracker retries with backoff up to 10 s).")
    flush_timeout_s: float = Field(
        60, ge=0, description="Training: at the end, wait this long for an unreachable MLflow server before counting "
                              "the metrics still buffered as lost.")


class ClarifierConfig(_Strict):
    storage: StorageConfig = StorageConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    registry: RegistryConfig = RegistryConfig()
    serve: ServeConfig = ServeConfig()
    tracking: TrackingConfig = TrackingConfig()
    audit: AuditConfig = AuditConfig()

    @model_validator(mode="after")
    def _check_finetune(self):
        if self.model.finetune == "full" and self.train.variant == "pipeline":
            raise ValueError("model.finetune=full does not combine with train.variant=pipeline (three LoRA adapters "
                             "on one shared base); use model.finetune=lora, or train.variant=joint")
        return self


# ---- loading ---------------------------------------------------------------------------------


def _parse_value(raw: str) -> Any:
    """Override values are YAML scalars/lists: ``3`` -> int, ``true`` -> bool, ``[a,b]`` -> list."""
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def set_dotted(data: dict, key: str, value: Any, model: Any = None, what: str = "config key") -> None:
    """``data[a][b][c] = value`` for ``key="a.b.c"`` (a mapping value merges into an existing
    section). With ``model`` (a pydantic class) every part must be one of its fields, so a typo is
    an error naming the known keys instead of a silently ignored setting."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"{what} {key!r} is not a dotted name")
    node, cur = model, data
    for i, part in enumerate(parts):
        if model is not None:
            fields = getattr(node, "model_fields", None)
            if fields is None or part not in fields:
                where = ".".join(parts[:i]) or "top level"
                options = ", ".join(sorted(fields)) if fields else "(not a section)"
                close = difflib.get_close_matches(part, list(fields or ()), n=1)
                guess = f"; did you mean {'.'.join([*parts[:i], close[0]])!r}?" if close else ""
                raise ConfigError(f"unknown {what} {key!r}: no {part!r} under {where}{guess} (known: {options})")
            node = fields[part].annotation
        if i == len(parts) - 1:
            if isinstance(value, dict) and isinstance(cur.get(part), dict):
                cur[part].update(value)
            else:
                cur[part] = value
        else:
            cur = cur.setdefault(part, {})
            if not isinstance(cur, dict):
                raise ConfigError(f"{what} {'.'.join(parts[: i + 1])!r} is not a section")


def apply_override(data: dict, dotted: str) -> None:
    """``key.sub=value`` (the value parsed as YAML) into ``data``, checked against ClarifierConfig."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like key.sub=value")
    key, raw = dotted.split("=", 1)
    set_dotted(data, key, _parse_value(raw), ClarifierConfig)


def build_config(data: dict | None, overrides: list[str] | tuple[str, ...] = (), source: str = "<dict>") -> ClarifierConfig:
    data = dict(data or {})
    for o in overrides:
        apply_override(data, o)
    try:
        return ClarifierConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid config in {source}: " + "; ".join(validation_messages(exc))) from None


def validation_messages(exc: ValidationError, *, unknown: str = "unknown config key {loc!r}", prefix: str = "",
                        empty_loc: str = "") -> list[str]:
    """One readable line per pydantic error, the same way for every typed input (configs, plans,
    importer options, serve arguments): ``unknown`` for keys the model forbids, the bare message for
    a check across fields (it names the keys), else ``<prefix><loc>: <msg> (got <value>)``."""
    msgs = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"]) or empty_loc
        if e["type"] == "extra_forbidden":
            msgs.append(unknown.format(loc=loc))
        elif not loc:
            msgs.append(e["msg"].removeprefix("Value error, "))
        else:
            msgs.append(f"{prefix}{loc}: {e['msg']} (got {e.get('input')!r})")
    return msgs


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ClarifierConfig:
    """Load a YAML config (or defaults when ``path`` is None) and apply dotted overrides."""
    data: dict = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p} must hold a mapping of sections (data, model, train, ...)")
        data = loaded
    return build_config(data, overrides, source)


def dump_config(cfg: ClarifierConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(cfg: ClarifierConfig) -> dict[str, Any]:
    """Dotted key -> value (for MLflow params)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = obj

    walk("", cfg.model_dump(mode="json"))
    return out
