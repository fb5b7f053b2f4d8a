"""Typed configuration: YAML in, validated, with dotted ``key=value`` overrides.

    cfg = load_config("jobs/configs/quickstart.yaml", ["train.max_steps=20", "model.lora.r=4"])

A wrong key or a wrong type is a ``ConfigError`` that names the dotted key (and the file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A configuration problem; the message names the key and, when known, the file."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(_Strict):
    root: str = Field(".clarifier", description="Local folder or s3:// prefix for all artifacts of a run.")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, s3rver); else AWS.")


class DataConfig(_Strict):
    input: str = Field("", description="Folder, file or s3:// prefix of conversation logs / examples.")
    output: str = Field("", description="Where the data job writes Parquet splits and its manifest.")
    formats: list[Literal["jsonl", "jsonl.gz"]] = ["jsonl", "jsonl.gz"]
    split: dict[str, float] = {"train": 0.8, "dev": 0.1, "test": 0.1}
    seed: int = 0
    max_length: int = 512
    max_turn_chars: int = 4000
    synthetic_conversations: int = 400


class LoraConfig(_Strict):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ModelConfig(_Strict):
    base_model: str = Field(
        "smollm2-135m-instruct",
        description="Built-in name, hub id, local folder, .gguf file or s3:// prefix.",
    )
    cache_dir: str | None = Field(None, description="Where resolved/converted base models are cached.")
    lora: LoraConfig = LoraConfig()
    max_prompt_tokens: int = 384


class LossWeights(_Strict):
    decision: float = Field(2.0, ge=0)
    grounding: float = Field(1.0, ge=0)
    question: float = Field(1.0, ge=0)
    format: float = Field(0.5, ge=0, description="Weight of the fixed 'decision:' prefix tokens.")


class TrainConfig(_Strict):
    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1, gt=0)
    zero_stage: Literal[0, 1, 2, 3] = 2
    micro_batch_size: int = Field(4, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(5e-4, gt=0)
    warmup_steps: int = Field(5, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_steps: int = Field(60, ge=1)
    max_minutes: float | None = Field(None, gt=0, description="Stop early (and checkpoint) after this much training time.")
    checkpoint_every: int = Field(0, ge=0, description="Steps between checkpoints; 0 = only at the end.")
    seed: int = 0
    loss_weights: LossWeights = LossWeights()
    experiment: str = "clarifier"
    run_name: str | None = None


class EvalConfig(_Strict):
    split: str = "test"
    threshold: float = Field(0.5, ge=0, le=1, description="Decision threshold until calibrated.")
    calibration_split: str | None = Field("dev", description="Split used to calibrate the threshold after training; null = keep eval.threshold.")
    max_over_asking: float | None = Field(None, ge=0, le=1, description="Calibrate for best recall within this over-asking budget instead of max F1.")
    max_examples: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(48, ge=1)
    batch_size: int = Field(8, ge=1)
    baselines: list[Literal["always_ask", "never_ask", "base_model"]] = ["always_ask", "never_ask", "base_model"]


class RegistryConfig(_Strict):
    model_name: str = "clarifier"
    alias: str = "champion"


class ServeConfig(_Strict):
    model_uri: str = "models:/clarifier@champion"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = "/"
    num_replicas: int = Field(1, ge=1)
    cpus_per_replica: float = Field(1, gt=0)
    max_ongoing_requests: int = Field(8, ge=1)
    max_batch_size: int = Field(8, ge=1)
    batch_wait_timeout_s: float = Field(0.05, ge=0)
    max_new_tokens: int = Field(48, ge=1)
    max_history_turns: int = Field(50, ge=0)
    max_chars: int = Field(20000, ge=1)


class TrackingConfig(_Strict):
    tracking_uri: str | None = Field(None, description="MLflow tracking URI; default: $MLFLOW_TRACKING_URI.")


class ClarifierConfig(_Strict):
    storage: StorageConfig = StorageConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    registry: RegistryConfig = RegistryConfig()
    serve: ServeConfig = ServeConfig()
    tracking: TrackingConfig = TrackingConfig()


# ---- loading ---------------------------------------------------------------------------------


def _parse_value(raw: str) -> Any:
    """Override values are YAML scalars/lists: ``3`` -> int, ``true`` -> bool, ``[a,b]`` -> list."""
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def apply_override(data: dict, dotted: str) -> None:
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like key.sub=value")
    key, raw = dotted.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override key {key!r} is not a dotted name")
    node: Any = ClarifierConfig
    cur = data
    for i, part in enumerate(parts):
        fields = getattr(node, "model_fields", None)
        if fields is None or part not in fields:
            where = ".".join(parts[:i]) or "top level"
            options = ", ".join(sorted(fields)) if fields else "(not a section)"
            raise ConfigError(f"unknown config key {key!r}: no {part!r} under {where} (known: {options})")
        ann = fields[part].annotation
        if i < len(parts) - 1:
            cur = cur.setdefault(part, {})
            if not isinstance(cur, dict):
                raise ConfigError(f"config key {'.'.join(parts[: i + 1])!r} is not a section")
            node = ann
        else:
            cur[part] = _parse_value(raw)


def build_config(data: dict | None, overrides: list[str] | tuple[str, ...] = (), source: str = "<dict>") -> ClarifierConfig:
    data = dict(data or {})
    for o in overrides:
        apply_override(data, o)
    try:
        return ClarifierConfig.model_validate(data)
    except ValidationError as exc:
        msgs = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e["loc"])
            if e["type"] == "extra_forbidden":
                msgs.append(f"unknown config key {loc!r}")
            else:
                msgs.append(f"{loc}: {e['msg']} (got {e.get('input')!r})")
        raise ConfigError(f"invalid config in {source}: " + "; ".join(msgs)) from None


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
