"""Driver side of the training job: MLflow run, Ray Data inputs, TorchTrainer assembly, artifacts."""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clarifier.runtime import storage
from clarifier.runtime.mlflow_uri import check_reachable, tracking_uri as resolve_tracking_uri
from clarifier.core.config import ClarifierConfig, TrainConfig, flatten
from clarifier.engine.inference import META_FILE, read_meta
from clarifier.core.objective import PIPELINE_PARTS
from clarifier.engine.pipeline import PIPELINE_FILE
from clarifier.train.loop import (DS_DIR, RANK_DIR, STATE_FILE, resolve_decision_loss, train_columns,
                                  train_loop_per_worker, training_mix)
from clarifier.core.objective import DecisionLoss

RUN_NAME_TAG = "clarifier.run_name"


@dataclass
class TrainResult:
    run_id: str
    model_dir: str  # the final checkpoint as a loadable Clarifier model folder (see model_folder)
    steps: int
    seconds: float
    # MLflow tracking outages: failed_calls, lost_steps / lost_values (metrics missing from the run
    # after the buffer was flushed), lost_step_ranges ("12-15,18"; pipeline: "when:...; how:...")
    tracking: dict = field(default_factory=dict)
    precision: str = "fp32"  # the resolved training precision (bf16 | fp32)


def train(cfg: ClarifierConfig, progress=print, callbacks=()) -> TrainResult:
    """Train (``train.variant=joint``: one adapter; ``pipeline``: when/how/what adapters) and log to MLflow.

    Resume: the Ray Train run is named after ``train.run_name`` (else after the new MLflow run), in
    ``<storage.root>/ray_results``. A worker failure restarts the worker group from the last
    checkpoint (``train.max_failures``); rerunning the same command with the same ``train.run_name``
    continues that run from its last checkpoint, in the same MLflow run.

    ``callbacks`` run inside every worker after each optimizer step
    (:class:`clarifier.train.loop.WorkerRecipe`); they must be picklable.
    """
    import mlflow
    import ray

    from clarifier.data.outputs import read_manifest
    from clarifier.engine.models import resolve_base_model

    data_root = cfg.data.output
    if not data_root or not storage.exists(storage.join(data_root, "manifest.json")):
        raise FileNotFoundError(
            f"data.output={data_root!r} has no manifest.json: run `clarifier data prepare` first (or point data.output at its output)")
    manifest = read_manifest(data_root)
    differ = cfg.model.prompt_differences((manifest.get("config") or {}).get("tokenizer") or {})
    if differ:  # the model folder would record a prompt its training never saw
        theirs, ours = (", ".join(f"{k}={v[i]}" for k, v in differ.items()) for i in (0, 1))
        raise ValueError(f"data.output={data_root!r} was tokenised with {theirs} but this run has {ours}: "
                         "run `clarifier data prepare` with this config again (`clarifier train --recipe` does it), "
                         "or set the same values")
    train_counts = manifest["counts"]["splits"]["train"]
    n_train = train_counts["examples"]
    t = cfg.train
    what = "examples"
    if cfg.data.packing.enabled:
        packing = manifest.get("packing") or {}
        if not packing.get("blocks"):
            raise ValueError(f"data.packing.enabled=true but the data job at {data_root} wrote no packed blocks: "
                             "rerun `clarifier data prepare` with data.packing.enabled=true")
        if t.variant == "pipeline":
            raise ValueError("train.variant=pipeline trains on padded examples: set data.packing.enabled=false")
        n_train, what = int(packing["blocks"]), "packed blocks"
    if n_train < t.num_workers * t.micro_batch_size:
        raise ValueError(f"the train split has {n_train} {what}, fewer than train.num_workers x "
                         f"train.micro_batch_size = {t.num_workers * t.micro_batch_size}")
    if t.balance != "none" and cfg.data.packing.enabled:
        raise ValueError(f"train.balance={t.balance} reorders single examples; set data.packing.enabled=false")
    mix = training_mix(t.balance, train_counts)
    if mix["source_only_auroc"] is not None:
        progress(f"[train] training mix (train.balance={t.balance}): {mix['clarify']}/{mix['examples']} need a question per epoch; "
                 f"source-only control AUROC {mix['source_only_auroc']:.3f}"
                 + (f" (natural mix {mix['source_only_auroc_natural']:.3f})" if t.balance != "none" else ""))
    decision = resolve_decision_loss(cfg, mix)  # fails early on clarify_weight=auto without both classes

    need = t.num_workers * t.cpus_per_worker
    have = ray.cluster_resources().get("CPU", 0)
    if need > have:
        raise ValueError(f"train.num_workers x train.cpus_per_worker = {need:g} CPUs, but the Ray cluster has "
                         f"{have:g}; training would wait forever. Lower train.cpus_per_worker or add CPUs.")

    check_placement(t, ray.nodes())
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    check_reachable(tracking_uri)  # before any model conversion or worker start

    # Convert/download the base model once on the driver's node so workers find it cached.
    base_path = resolve_base_model(cfg.model.base_model, cfg.model.cache_dir)
    init = None
    if cfg.model.init_from:
        init = check_init_from(cfg, base_path, tracking_uri)
        version = "" if init["version"] == cfg.model.init_from else f"{init['version']}: "
        progress(f"[train] starting from the adapter of {cfg.model.init_from} ({version}LoRA r={init['r']} on "
                 f"{','.join(init['target_modules'])})")

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(t.experiment)
    run_id, resumed = _mlflow_run(cfg, manifest, data_root, decision)
    if init:  # lineage: which version the alias pointed at when this run started from it
        mlflow.MlflowClient().set_tag(run_id, "clarifier.init_from", f"{cfg.model.init_from} -> {init['version']}")
    ray_name = f"train-{_slug(t.run_name)}" if t.run_name else f"train-{run_id}"
    storage_path = storage.join(cfg.storage.root, "ray_results")
    if not storage.is_s3(storage_path):
        storage_path = str(Path(storage_path).expanduser().resolve())
    progress(f"[train] {'resuming' if resumed else 'starting'} MLflow run {run_id}; Ray Train run {ray_name} "
             f"in {storage_path}")

    t0 = time.time()
    out = model_folder(cfg, run_id)
    tracking: dict[str, dict] = {}  # MLflow run id -> tracking stats of the fit that logged to it
    dataset = train_dataset(cfg)  # read once; pipeline parts pick their rows in the workers
    if t.variant == "joint":
        result = _fit(cfg, None, run_id, tracking_uri, decision, ray_name, storage_path, dataset, progress, callbacks)
        steps = _copy_model(result, out)
        tracking[run_id] = _tracking_stats(result)
    else:
        steps = 0
        parts = {}
        for part in PIPELINE_PARTS:
            child = _child_run(run_id, part, t.experiment)
            result = _fit(cfg, part, child, tracking_uri, decision if part == "when" else DecisionLoss(),
                          f"{ray_name}-{part}", storage_path, dataset, progress, callbacks)
            steps += _copy_model(result, out / part)
            tracking[child] = {**_tracking_stats(result), "part": part}
            parts[part] = {"folder": part, "segments": list(PIPELINE_PARTS[part]), "mlflow_run_id": child}
        shutil.copy(out / "when" / META_FILE, out / META_FILE)  # threshold + base model of the composition
        (out / PIPELINE_FILE).write_text(json.dumps({"variant": "pipeline", "parts": parts}, indent=2))
    seconds = time.time() - t0
    summary = _tracking_summary(tracking)
    precision = read_meta(out).precision or "fp32"  # as the workers resolved model.precision on their device
    head, calib = _decision_head_and_threshold(cfg, out, progress)
    with mlflow.start_run(run_id=run_id):
        mlflow.log_artifacts(str(out), artifact_path="adapter")
        mlflow.log_metrics({"train/steps": steps, "train/seconds": seconds,
                            **({"train_mix/source_only_auroc": mix["source_only_auroc"],
                                "train_mix/source_only_auroc_natural": mix["source_only_auroc_natural"]}
                               if mix["source_only_auroc"] is not None else {})})
        mlflow.set_tag("clarifier.precision", precision)
        _log_tracking(tracking, run_id, summary)
        if head:
            mlflow.log_metrics({f"decision_head/{k}": head[k] for k in ("dev_macro_auroc", "dev_macro_auroc_token", "c",
                                                                         "n_train", "seconds") if head[k] is not None})
            mlflow.set_tags({"decision_head.layers": ",".join(map(str, head["layers"])),
                             "decision_head.pooling": "+".join(head.get("pooling") or ["last"])})
        if calib:
            mlflow.log_metrics({"calibration/threshold": calib["threshold"]})
            mlflow.set_tags({"calibration.rule": calib["rule"], "calibration.n": calib["n"]})
    if summary["failed_calls"] or summary["lost_steps"]:
        progress(f"[train] MLflow tracking outage: {summary['failed_calls']} failed requests from the workers; "
                 + (f"metrics of {summary['lost_steps']} steps lost (steps {summary['lost_step_ranges']}; "
                    f"{summary['lost_values']} values), see tracking/lost_steps" if summary["lost_steps"]
                    else "every step's metrics were buffered and delivered"))
    progress(f"[train] done: {steps} steps in {seconds:.0f}s ({precision}); adapter logged to run {run_id}")
    return TrainResult(run_id=run_id, model_dir=str(out), steps=steps, seconds=seconds, tracking=summary,
                       precision=precision)


def _tracking_stats(result) -> dict:
    """The tracker's counts as reported with the final checkpoint (see loop._report)."""
    m = result.metrics or {}
    return {"lost_steps": int(m.get("tracking_lost_steps") or 0),
            "lost_values": int(m.get("tracking_lost_values") or 0),
            "failed_calls": int(m.get("tracking_failed_calls") or 0),
            "lost_step_ranges": str(m.get("tracking_lost_step_ranges") or "")}


def _tracking_summary(tracking: dict[str, dict]) -> dict:
    out = {k: sum(s[k] for s in tracking.values()) for k in ("lost_steps", "lost_values", "failed_calls")}
    ranges = [(f"{s['part']}:" if "part" in s else "") + s["lost_step_ranges"]
              for s in tracking.values() if s["lost_step_ranges"]]
    out["lost_step_ranges"] = "; ".join(ranges)
    return out


def _log_tracking(tracking: dict[str, dict], run_id: str, summary: dict) -> None:
    """``tracking/lost_steps``, ``tracking/lost_values``, ``tracking/failed_calls`` (and the tag
    ``tracking.lost_steps`` naming them) in every run trained here; the parent of a pipeline gets the sums.
    Logged by the driver after training, with MLflow's own retries, so they survive a worker-side outage."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    client = MlflowClient()
    ts = int(time.time() * 1000)
    for rid, stats in {**tracking, run_id: summary}.items():
        client.log_batch(rid, metrics=[Metric(f"tracking/{k}", float(stats[k]), ts, 0)
                                       for k in ("lost_steps", "lost_values", "failed_calls")],
                         tags=[RunTag("tracking.lost_steps", stats["lost_step_ranges"])]
                         if stats["lost_step_ranges"] else [])


def check_init_from(cfg: ClarifierConfig, base_path: str, tracking_uri: str | None) -> dict:
    """``model.init_from`` resolved on the driver (workers resolve it again from the same cache): a
    Clarifier LoRA model on this run's base model, else ValueError saying what differs."""
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import resolve_model
    from clarifier.engine.models import resolve_base_model

    uri = cfg.model.init_from
    if cfg.train.variant != "joint":
        raise ValueError(f"model.init_from={uri!r} continues one joint adapter; this run has train.variant="
                         f"{cfg.train.variant}")
    if cfg.model.finetune != "lora":
        raise ValueError(f"model.init_from={uri!r} continues a LoRA adapter; this run has model.finetune="
                         f"{cfg.model.finetune}")
    resolved = resolve_model(uri, cfg.model.cache_dir, tracking_uri)
    meta = read_meta(resolved.folder)
    adapter_cfg = Path(resolved.folder, "adapter_config.json")
    if meta.finetune != "lora" or not adapter_cfg.is_file():
        raise ValueError(f"model.init_from={uri!r} ({resolved.version}) is not a LoRA model (finetune={meta.finetune}); "
                         "only a LoRA adapter can be continued")
    theirs = resolve_base_model(meta.base_model, cfg.model.cache_dir)
    if Path(theirs).resolve() != Path(base_path).resolve():
        raise ValueError(f"model.init_from={uri!r} ({resolved.version}) was trained on base model {meta.base_model!r}, "
                         f"this run's model.base_model is {cfg.model.base_model!r}: set model.base_model to its base")
    lora = json.loads(adapter_cfg.read_text())
    return {"version": resolved.version, "folder": str(resolved.folder), "r": lora.get("r"),
            "target_modules": sorted(lora.get("target_modules") or [])}


def check_placement(t: TrainConfig, nodes: list[dict]) -> None:
    """``STRICT_SPREAD`` needs a node per worker (``nodes`` as from ``ray.nodes()``); without one
    the placement group is never scheduled and training would wait forever."""
    if t.placement_strategy != "STRICT_SPREAD":
        return
    fit = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= t.cpus_per_worker
           and (not t.use_gpu or n.get("Resources", {}).get("GPU", 0) >= 1)]
    if len(fit) < t.num_workers:
        raise ValueError(f"train.placement_strategy=STRICT_SPREAD puts each of the {t.num_workers} workers on its own "
                         f"node, but only {len(fit)} node(s) of the Ray cluster can hold one; training would wait "
                         "forever. Use SPREAD (best effort) or add nodes.")


def _slug(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
    if not s:
        raise ValueError(f"train.run_name={name!r} has no usable characters for a run folder name")
    return s[:100]


def _mlflow_run(cfg: ClarifierConfig, manifest: dict, data_root: str, decision) -> tuple[str, bool]:
    """The MLflow run of this training: the existing one with the same ``train.run_name`` (resume),
    else a new one with the params, the data manifest and the tags."""
    import mlflow

    t = cfg.train
    if t.run_name:
        found = mlflow.search_runs(experiment_names=[t.experiment], output_format="list",
                                   filter_string=f"tags.`{RUN_NAME_TAG}` = '{t.run_name}'")
        if found:
            run = sorted(found, key=lambda r: r.info.start_time)[-1]
            if run.info.status == "FINISHED" and "train/steps" in run.data.metrics:
                raise ValueError(f"train.run_name={t.run_name!r} names a finished training (MLflow run "
                                 f"{run.info.run_id}); choose a new train.run_name to train again")
            return run.info.run_id, True
    with mlflow.start_run(run_name=t.run_name) as run:
        mlflow.log_params({k: ("" if v is None else str(v))[:500] for k, v in flatten(cfg).items()})
        mlflow.log_dict(manifest, "data/manifest.json")
        mlflow.set_tags({"clarifier.stage": "train", "clarifier.base_model": cfg.model.base_model,
                         "clarifier.data": data_root, "clarifier.variant": t.variant,
                         "clarifier.decision_loss": f"{decision.kind} clarify_weight={decision.clarify_weight:.4g} "
                                                    f"gamma={decision.gamma:g}",
                         **({RUN_NAME_TAG: t.run_name} if t.run_name else {})})
        return run.info.run_id, False


def _child_run(parent_id: str, part: str, experiment: str) -> str:
    """The nested MLflow run of one pipeline part (reused when the parent is resumed)."""
    import mlflow

    found = mlflow.search_runs(experiment_names=[experiment], output_format="list",
                               filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and tags.`clarifier.part` = '{part}'")
    if found:
        return found[0].info.run_id
    with mlflow.start_run(run_id=parent_id):
        with mlflow.start_run(run_name=part, nested=True) as child:
            mlflow.set_tags({"clarifier.part": part, "clarifier.segments": ",".join(PIPELINE_PARTS[part])})
            return child.info.run_id


def train_dataset(cfg: ClarifierConfig):
    """The data job's train split (or its packed blocks) as a Ray Data dataset, token columns only,
    read on the cluster (local folder or ``s3://``) and materialized in the object store before the
    workers take their CPUs/GPUs: the workers' ``get_dataset_shard`` iterators then only fetch
    blocks (no read tasks competing with training for resources), and a restarted worker group
    reads the same blocks again."""
    import ray.data

    from clarifier.data.outputs import PACKED_DIR

    packed = cfg.data.packing.enabled
    fs, path = storage.filesystem(storage.join(cfg.data.output, PACKED_DIR if packed else "train"))
    return ray.data.read_parquet(path, filesystem=fs, columns=train_columns(packed, cfg.train.balance)).materialize()


def worker_config(cfg: ClarifierConfig) -> dict:
    """``cfg`` as the workers get it: local relative paths made absolute (``runtime.submit.portable_config``, as
    for a submitted job), since Ray Train runs each worker in its own directory (before this, the recipe's
    relative ``data.output`` turned its learning curve off)."""
    from clarifier.runtime.submit import portable_config

    return portable_config(cfg, progress=lambda _message: None).model_dump(mode="json")


def _fit(cfg: ClarifierConfig, part: str | None, run_id: str, tracking_uri: str | None, decision, ray_name: str,
         storage_path: str, dataset, progress, callbacks=()):
    from clarifier.runtime.relay import ProgressRelay

    with ProgressRelay(progress) as relay:  # the workers' step lines, to this process's progress
        return _fit_with(cfg, part, run_id, tracking_uri, decision, ray_name, storage_path, dataset, callbacks,
                         relay.handle)


def _fit_with(cfg, part, run_id, tracking_uri, decision, ray_name, storage_path, dataset, callbacks, relay_handle):
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t = cfg.train
    scaling = ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu,
                            resources_per_worker={"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})},
                            placement_strategy=t.placement_strategy)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": worker_config(cfg), "mlflow_run_id": run_id, "tracking_uri": tracking_uri,
                           "part": part, "decision_loss": asdict(decision), "callbacks": list(callbacks),
                           "relay": relay_handle},
        scaling_config=scaling,
        # Not split: every worker takes its rows of one seeded global order (exact resume; loop.py).
        datasets={"train": dataset}, dataset_config=DataConfig(datasets_to_split=[]),
        torch_config=TorchConfig(backend="nccl" if t.use_gpu else "gloo"),
        run_config=RunConfig(name=ray_name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=t.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=t.keep_checkpoints)),
    )
    result = trainer.fit()
    if result.error:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError("training finished without a checkpoint")
    return result


def model_folder(cfg: ClarifierConfig, run_id: str) -> Path:
    """Where a run's trained model lands (emptied first: a resumed run writes it again): beside the run's Ray
    results, ``<storage.root>/models/<run_id>``, when storage is a local folder; with an ``s3://`` root, in this
    machine's cache (``<cache>/trained/<run_id>``). The same files are logged to the MLflow run as ``adapter``."""
    out = run_folder(cfg, run_id, "models", cached_as="trained")
    out.mkdir(parents=True)
    return out


def run_folder(cfg: ClarifierConfig, run_id: str, kind: str, cached_as: str | None = None) -> Path:
    """Where a run's local output of one ``kind`` (``models``, ``eval``) goes, removed first (a rerun writes it
    again; its writer creates it): ``<storage.root>/<kind>/<run_id>`` when storage is a local folder, else
    ``<cache>/<cached_as or kind>/<run_id>`` on this machine."""
    if storage.is_s3(cfg.storage.root):
        out = storage.cache_root() / (cached_as or kind) / run_id
    else:
        out = Path(cfg.storage.root).expanduser().resolve() / kind / run_id
    shutil.rmtree(out, ignore_errors=True)
    return out


def _copy_model(result, out: Path) -> int:
    """Copy the model files of the final checkpoint (not the DeepSpeed / RNG state) to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with result.checkpoint.as_directory() as d:
        shutil.copytree(d, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(DS_DIR, RANK_DIR))
        state = json.loads((Path(d) / STATE_FILE).read_text())
    return int(state["step"])


def _decision_head_and_threshold(cfg: ClarifierConfig, folder: Path, progress) -> tuple[dict | None, dict | None]:
    """After training: fit the decision head (``train.decision_head.enabled``) on the train split, then pick
    the decision threshold on the calibration split (if it has both classes) -- on the head's scores.

    With ``eval.engine=ray`` the model's forward passes (the head's features, the calibration scores) run on the
    evaluation's Ray actors (``eval.ray_*``: a GPU cluster's GPUs), the model folder shipped to them through the
    object store; this process, a cluster job's driver, then only fits the regression and picks the threshold."""
    from clarifier.data.outputs import load_split
    from clarifier.train.calibrate import calibrate_model

    split = cfg.eval.calibration_split
    examples = load_split(cfg.data.output, split) if split else []
    if split and len({e.needs_clarification for e in examples}) < 2:
        progress(f"[calibrate] split {split!r} has {len(examples)} examples and not both classes; "
                 f"keeping threshold {cfg.eval.threshold}")
        split = None
    e, pool = cfg.eval, cfg.eval.ray_pool()
    head = None
    if cfg.train.decision_head.enabled:
        if not split:
            progress("[head] no decision head: it is chosen on the calibration split, which is missing or one-class")
        else:
            from clarifier.train.decision_head import RayFeatures, fit_decision_head

            features = None
            if e.engine == "ray":
                features = RayFeatures(folder, cache_dir=cfg.model.cache_dir, precision=cfg.model.precision, **pool)
                progress(f"[head] the model's states are read by {e.ray_actors} Ray actor(s) (eval.engine=ray)")
            head = fit_decision_head(folder, load_split(cfg.data.output, "train"), examples, cfg.train.decision_head,
                                     seed=cfg.train.seed, cache_dir=cfg.model.cache_dir,
                                     precision=cfg.model.precision, progress=progress, features=features)
    if not split:
        return head, None
    scores, precision = (head["dev_scores"], head["precision"]) if head else (None, cfg.model.precision)
    if scores is None and e.engine == "ray":
        from clarifier.engine.inference import read_meta
        from clarifier.engine.ray_pool import ray_predict, ship_folder

        spec = {**ship_folder(folder), "cache_dir": cfg.model.cache_dir, "precision": cfg.model.precision}
        scores = [p.confidence for p in ray_predict(examples, spec, opts=read_meta(folder).prompt_options(),
                                                    mode="score", batch_size=e.batch_size, **pool)]
        progress(f"[calibrate] {len(examples)} {split} examples scored by {e.ray_actors} Ray actor(s) (eval.engine=ray)")
    return head, calibrate_model(folder, examples, max_over_asking=cfg.eval.max_over_asking,
                                 cache_dir=cfg.model.cache_dir, batch_size=cfg.eval.batch_size, progress=progress,
                                 precision=precision, split=split, scores=scores)


