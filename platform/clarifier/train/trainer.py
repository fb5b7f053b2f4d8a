"""Driver side of the training job: MLflow run, Ray Data inputs, TorchTrainer assembly, artifacts."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .. import storage
from ..config import ClarifierConfig, flatten
from .loop import train_loop_per_worker


@dataclass
class TrainResult:
    run_id: str
    model_dir: str  # local copy of the final checkpoint (a loadable Clarifier model folder)
    steps: int
    seconds: float


def _tracking_uri(cfg: ClarifierConfig) -> str | None:
    return cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")


def train(cfg: ClarifierConfig, progress=print) -> TrainResult:
    import mlflow
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ..data.pipeline import read_manifest
    from ..models import resolve_base_model

    data_root = cfg.data.output
    if not data_root or not storage.exists(storage.join(data_root, "manifest.json")):
        raise FileNotFoundError(
            f"data.output={data_root!r} has no manifest.json: run `clarifier data prepare` first (or point data.output at its output)")
    manifest = read_manifest(data_root)
    n_train = manifest["counts"]["splits"]["train"]["examples"]
    if n_train < cfg.train.num_workers:
        raise ValueError(f"the train split has {n_train} examples, fewer than train.num_workers={cfg.train.num_workers}")

    # Convert/download the base model once on the driver's node so workers find it cached.
    resolve_base_model(cfg.model.base_model, cfg.model.cache_dir)

    tracking_uri = _tracking_uri(cfg)
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(cfg.train.experiment)
    t = cfg.train
    with mlflow.start_run(run_name=t.run_name) as run:
        mlflow.log_params({k: ("" if v is None else str(v))[:500] for k, v in flatten(cfg).items()})
        mlflow.log_dict(manifest, "data/manifest.json")
        mlflow.set_tags({"clarifier.stage": "train", "clarifier.base_model": cfg.model.base_model,
                         "clarifier.data": data_root})
        run_id = run.info.run_id

    need = t.num_workers * t.cpus_per_worker
    have = ray.cluster_resources().get("CPU", 0)
    if have - need < 1:
        raise ValueError(
            f"train.num_workers x train.cpus_per_worker = {need:g} CPUs leaves {have - need:g} of the cluster's "
            f"{have:g} CPUs for the Ray Data tasks that feed the workers; training would wait forever. "
            "Lower train.cpus_per_worker or add CPUs (a local Ray started by clarifier has cores + 2).")
    train_ds = ray.data.read_parquet(storage.join(data_root, "train"), **_fs_kwargs(data_root),
                                     columns=["input_ids", "labels", "loss_weights", "segment_ids"])
    storage_path = storage.join(cfg.storage.root, "ray_results")
    if not storage.is_s3(storage_path):
        storage_path = str(Path(storage_path).expanduser().resolve())
    scaling = ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu,
                            resources_per_worker={"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})})
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.model_dump(mode="json"), "mlflow_run_id": run_id, "tracking_uri": tracking_uri},
        scaling_config=scaling,
        torch_config=TorchConfig(backend="nccl" if t.use_gpu else "gloo"),
        datasets={"train": train_ds},
        run_config=RunConfig(name=f"train-{run_id}", storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=0)),
    )
    progress(f"[train] TorchTrainer: {t.num_workers} workers, ZeRO-{t.zero_stage}, {t.max_steps} steps, "
             f"{n_train} training examples; MLflow run {run_id}")
    t0 = time.time()
    result = trainer.fit()
    seconds = time.time() - t0
    if result.error:
        raise result.error
    ckpt = result.checkpoint
    if ckpt is None:
        raise RuntimeError("training finished without a checkpoint")
    out = Path(tempfile.mkdtemp(prefix="clarifier-model-"))
    with ckpt.as_directory() as d:
        shutil.copytree(d, out, dirs_exist_ok=True)
    steps = int((result.metrics or {}).get("step", 0))
    calib = _calibrate(cfg, out, progress)
    with mlflow.start_run(run_id=run_id):
        mlflow.log_artifacts(str(out), artifact_path="adapter")
        mlflow.log_metrics({"train/steps": steps, "train/seconds": seconds})
        if calib:
            mlflow.log_metrics({"calibration/threshold": calib["threshold"]})
            mlflow.set_tags({"calibration.rule": calib["rule"], "calibration.n": calib["n"]})
    progress(f"[train] done: {steps} steps in {seconds:.0f}s; adapter logged to run {run_id}")
    return TrainResult(run_id=run_id, model_dir=str(out), steps=steps, seconds=seconds)


def _calibrate(cfg: ClarifierConfig, folder: Path, progress) -> dict | None:
    """Pick the decision threshold on the calibration split (if it has both classes)."""
    from ..data.pipeline import load_split
    from ..evaluation.calibrate import calibrate_model

    split = cfg.eval.calibration_split
    if not split:
        return None
    examples = load_split(cfg.data.output, split)
    labels = {e.needs_clarification for e in examples}
    if len(labels) < 2:
        progress(f"[calibrate] split {split!r} has {len(examples)} examples and not both classes; "
                 f"keeping threshold {cfg.eval.threshold}")
        return None
    return calibrate_model(folder, examples, max_over_asking=cfg.eval.max_over_asking,
                           cache_dir=cfg.model.cache_dir, batch_size=cfg.eval.batch_size, progress=progress)


def _fs_kwargs(uri: str) -> dict:
    if storage.is_s3(uri):
        fs, _ = storage.filesystem(uri)
        return {"filesystem": fs}
    return {}
