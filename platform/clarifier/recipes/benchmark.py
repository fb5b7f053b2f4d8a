"""``clarifier recipe benchmark <name>``: the recipe's comparison table, from the platform's own jobs.

One command, one process: local Ray (or the cluster in ``RAY_ADDRESS``), an MLflow server (the one
in ``MLFLOW_TRACKING_URI``, else a local sqlite one under the work folder), then

1. the data job (``data.sources`` import + Ray Data) for the recipe as it is;
2. Ray Train runs of every *variant* of the plan (the recipe itself = the joint model, the
   pipeline variant, ablations), each calibrated on its dev split; then every *encoder* row: a
   small encoder classifier of the decision alone (:mod:`clarifier.train.encoder_classifier`),
   trained in this process on the recipe's train split, calibrated on its dev split by the same rule;
3. leave-one-dataset-out: the recipe trained without one source, for each listed source (and
   each encoder row with ``leave_one_out``, trained on the train split without that source);
4. one evaluation set: a seeded sample of the recipe's test split, ``eval_per_source`` examples of
   every source; every row is scored on it (leave-one-out models on their left-out source only);
5. report: overall and per-source tables, leave-one-out table, recall at over-asking budgets,
   error analysis of the joint model per source, stage timings -> ``<out>.json`` and ``<out>.md``.

The plan (``clarifier/recipes/plans/<name>.yaml``) is a :class:`BenchmarkPlan`.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from clarifier.core.config import ClarifierConfig, ConfigError, load_config, validation_messages
from clarifier.recipes import PLANS_DIR, recipe_path
from clarifier.train.encoder_classifier import EncoderClassifierConfig

Progress = Callable[[str], None]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LeaveOneOutPlan(_Strict):
    sources: list[str] = Field(default_factory=list, description="Sources left out one at a time.")
    overrides: list[str] = Field(default_factory=list, description="Applied to the recipe for these runs (e.g. a shorter budget).")


class ErrorAnalysisPlan(_Strict):
    row: str = "joint"
    decisions: int = Field(30, ge=0)
    questions: int = Field(30, ge=0)
    min_similarity: float = 0.5


class EncoderPlan(EncoderClassifierConfig):
    """An encoder row: the classifier's settings (``EncoderClassifierConfig``: base model, budget, ...) and
    whether the leave-one-out runs train it too."""

    leave_one_out: bool = Field(True, description="Also train this encoder without each leave_one_out source and score "
                                                  "it on that source (the leave-one-out table shows it).")
    leave_one_out_max_minutes: float | None = Field(None, gt=0, description="Time budget of those runs; null = max_minutes.")

    def classifier_config(self, leave_one_out: bool = False) -> EncoderClassifierConfig:
        cfg = EncoderClassifierConfig(**self.model_dump(exclude={"leave_one_out", "leave_one_out_max_minutes"}))
        if leave_one_out and self.leave_one_out_max_minutes is not None:
            cfg = cfg.model_copy(update={"max_minutes": self.leave_one_out_max_minutes})
        return cfg


class BenchmarkPlan(_Strict):
    recipe: str
    overrides: list[str] = Field(default_factory=list, description="Applied to the recipe for every run.")
    eval_per_source: int = Field(60, ge=1, description="Test-split examples per source in the evaluation set (seeded sample).")
    eval_clarify_share: float | None = Field(
        None, gt=0, lt=1, description="Share of turns needing clarification in each source's sample (where the split has "
                                      "enough); null = the split's own share.")
    seed: int = 0
    rule_baselines: list[str] = ["never_ask", "always_ask", "lexical"]
    zero_shot: dict[str, str] = Field(default_factory=dict, description="Row name -> base model, prompted zero-shot (decision only).")
    variants: dict[str, list[str]] = Field(default_factory=lambda: {"joint": []},
                                           description="Row name -> overrides of the recipe; each is trained on all sources.")
    encoders: dict[str, EncoderPlan] = Field(default_factory=dict, description="Row name -> a fine-tuned encoder "
                                             "classifier of the decision alone (kind 'encoder'), trained on the train split.")
    leave_one_out: LeaveOneOutPlan = LeaveOneOutPlan()
    error_analysis: ErrorAnalysisPlan = ErrorAnalysisPlan()
    grounding_source: str = Field("synthetic", description="Source whose gold grounding the grounding columns are measured on.")
    keep_models: list[str] = Field(["joint"], description="Rows whose trained model folder is kept under "
                                                          "<workdir>/models/<row> (for `clarifier models package`); "
                                                          "the others are deleted after evaluation (MLflow keeps them).")
    decision_token_rows: bool = Field(
        True, description="For every trained row whose model has a decision head (train.decision_head), also a row "
                          "'<name>_tokens': the same model deciding from its decision-token logits (threshold chosen on "
                          "dev by the same rule; decision only), so the head's effect is measured on one model.")
    probes: dict[str, str] = Field(
        default_factory=dict, description="Row name -> base model: the untrained base with a decision head fitted on the "
                                          "train split (the recipe's train.decision_head settings; kind 'probe', decision "
                                          "only): what the head reads without any fine-tuning.")
    source_only: bool = Field(True, description="Add the source-only control row (scores a turn by its source's clarify "
                                                "share in the train split) and the control on the training mix.")
    surface_control: bool = Field(True, description="Add the surface control row (a logistic regression on position "
                                                    "and length only, fitted on the train split: "
                                                    "clarifier.core.surface) and every row's skill over it.")


def plan_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        return p
    return PLANS_DIR / f"{name_or_path}.yaml"


def load_plan(name_or_path: str) -> BenchmarkPlan:
    import yaml
    from pydantic import ValidationError

    path = plan_path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"no benchmark plan {path}")
    try:
        plan = BenchmarkPlan.model_validate(yaml.safe_load(path.read_text()) or {})
    except ValidationError as exc:
        raise ConfigError(f"invalid benchmark plan {path}: {'; '.join(validation_messages(exc))}") from None
    if plan.variants and "joint" not in plan.variants:
        raise ConfigError(f"{path}: variants must include 'joint' (the recipe as it is), or be empty (e.g. a "
                          "leave-one-out plan)")
    return plan


# ---- pure parts ------------------------------------------------------------------------------


def resolve_plan(plan_name: str, overrides=(), leave_out=()) -> tuple[BenchmarkPlan, str]:
    """``(plan, benchmark name)`` as run: the plan with the extra recipe ``overrides``; ``leave_out`` replaces
    its ``leave_one_out.sources`` and is appended to the name (``recipe-joint-public-loo-clariq``). Unknown
    leave-one-out sources are refused here, naming them, not after the hours of work that come before them."""
    plan = load_plan(plan_name)
    name = f"recipe-{plan_path(plan_name).stem}"
    plan = plan.model_copy(update={"overrides": [*plan.overrides, *overrides]})
    if leave_out:
        plan = plan.model_copy(update={"leave_one_out": plan.leave_one_out.model_copy(update={"sources": list(leave_out)})})
        name = "-".join([name, *leave_out])
    names = [s.source_name for s in load_config(recipe_path(plan.recipe), plan.overrides).data.sources]
    unknown = [s for s in plan.leave_one_out.sources if s not in names]
    if unknown:
        raise ConfigError(f"leave-one-out source(s) {unknown} are not sources of recipe {plan.recipe!r} (it has {names})")
    return plan, name


def without_source(cfg: ClarifierConfig, source: str, workdir: Path) -> ClarifierConfig:
    names = [s.source_name for s in cfg.data.sources]
    if source not in names:
        raise ConfigError(f"leave_one_out source {source!r} is not one of the recipe's sources {names}")
    data = cfg.data.model_copy(update={
        "sources": [s for s in cfg.data.sources if s.source_name != source],
        "input": str(workdir / f"loo-{source}" / "input"), "output": str(workdir / f"loo-{source}" / "data")})
    return cfg.model_copy(update={"data": data})


# ---- the run ---------------------------------------------------------------------------------


class _Clock:
    def __init__(self, progress: Progress):
        self.t0 = time.time()
        self.stages: dict[str, float] = {}
        self.progress = progress

    @contextmanager
    def stage(self, name: str):
        t = time.time()
        self.progress(f"\n== {name}  (+{t - self.t0:.0f}s)")
        try:
            yield
        finally:
            self.stages[name] = round(time.time() - t, 1)


def _variant_cfg(base: ClarifierConfig, recipe: str, plan: BenchmarkPlan, name: str, extra: list[str],
                 workdir: Path) -> ClarifierConfig:
    cfg = load_config(recipe_path(recipe), [*plan.overrides, *extra])
    cfg.storage.root = str(workdir / "storage")
    cfg.train.run_name = f"{name}-{int(time.time())}"
    same = cfg.data.model_copy(update={"input": base.data.input, "output": base.data.output})
    if (same.model_dump() == base.data.model_dump() and cfg.model.base_model == base.model.base_model
            and cfg.model.prompt_meta() == base.model.prompt_meta()):
        return cfg.model_copy(update={"data": same})  # same data, tokenizer and prompt as the recipe: reuse its data job
    # Another tokenizer or prompt tokenises the same examples differently: its own data job, so that preparing it
    # does not overwrite the recipe's.
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={
        "input": str(workdir / name / "input"), "output": str(workdir / name / "data")})})


def _train(cfg: ClarifierConfig, progress: Progress) -> dict:
    from clarifier.train.trainer import train
    from clarifier.recipes import prepare_if_needed

    prepare_if_needed(cfg, progress)
    t0 = time.time()
    res = train(cfg, progress=progress)
    return {"run_id": res.run_id, "model_dir": res.model_dir, "model_uri": f"runs:/{res.run_id}/adapter",
            "steps": res.steps, "train_seconds": round(res.seconds, 1),
            "seconds": round(time.time() - t0, 1), "learning_curve": learning_curve(res.run_id)}


def _head_summary(model_dir: str) -> dict | None:
    """How the model's decision head was fitted (its ``clarifier.json``), or None without one."""
    from clarifier.engine.inference import read_meta

    return read_meta(model_dir).decision_head


def learning_curve(run_id: str) -> list[dict]:
    """The run's ``train.learning_curve`` points from MLflow: ``[{"step", "dev/macro_auroc", ...}]``."""
    from mlflow import MlflowClient

    client = MlflowClient()
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith("dev/")]
    points: dict[int, dict] = {}
    for k in keys:
        for m in client.get_metric_history(run_id, k):
            points.setdefault(int(m.step), {"step": int(m.step)})[k] = float(m.value)
    return [points[s] for s in sorted(points)]


def _predict_model(model_dir: str, examples: list, cfg: ClarifierConfig, progress: Progress,
                   keep: Path | None = None) -> tuple[list, float, float]:
    """Predictions of a freshly trained model folder, which is then deleted (it is a temporary copy,
    0.5 GB after full fine-tuning, of what the run logged to MLflow: the row's ``model_uri``) or,
    with ``keep``, moved there."""
    import shutil

    from clarifier.engine.loading import load_engine

    engine = load_engine(model_dir, cache_dir=cfg.model.cache_dir, max_new_tokens=cfg.eval.max_new_tokens,
                         precision=cfg.model.precision)
    t0 = time.time()
    preds = engine.predict(examples, batch_size=cfg.eval.batch_size,
                           progress=lambda d, n: progress(f"[eval] {d}/{n}") if d == n or d % 64 == 0 else None)
    thr = engine.threshold
    del engine
    if keep is not None:
        shutil.rmtree(keep, ignore_errors=True)
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(model_dir, keep)
    else:
        shutil.rmtree(model_dir, ignore_errors=True)
    return preds, thr, round(time.time() - t0, 1)


def _scored_row(engine, dev: list, examples: list, cfg: ClarifierConfig, progress: Progress,
                dev_scores: list[float] | None = None) -> tuple[list, dict]:
    """Decision-only predictions of ``engine`` on ``examples``, thresholded like a trained model: at the
    threshold chosen on ``dev`` (the recipe's calibration split; on ``dev_scores`` when already computed)
    by the same rule (``eval.max_over_asking``); 0.5 without a two-class ``dev``."""
    from clarifier.core.metrics import Prediction
    from clarifier.train.calibrate import choose_threshold

    calib = {"threshold": 0.5, "rule": "default (no calibration split)"}
    gold = [e.needs_clarification for e in dev]
    if len(set(gold)) == 2:
        t_cal = time.time()
        if dev_scores is None:
            dev_scores = engine.score_examples(dev, cfg.eval.batch_size)
        thr, rule = choose_threshold(gold, dev_scores, cfg.eval.max_over_asking)
        calib = {"threshold": thr, "rule": rule, "n": len(dev), "seconds": round(time.time() - t_cal, 1)}
        progress(f"[calibrate] {engine.version}: threshold {thr:.3f} ({rule}) from {len(dev)} dev examples")
    t0 = time.time()
    scores = engine.score_examples(examples, cfg.eval.batch_size,
                                   lambda d, n: progress(f"[eval] {d}/{n}") if d == n or d % 64 == 0 else None)
    thr = calib["threshold"]
    return ([Prediction(needs_clarification=p >= thr, confidence=p) for p in scores],
            {"threshold": thr, "calibration": calib, "eval_seconds": round(time.time() - t0, 1)})


def _predict_tokens(model_dir: str, dev: list, examples: list, cfg: ClarifierConfig, progress: Progress) -> tuple[list, dict]:
    """A model with a decision head, deciding from its decision-token logits instead (decision only)."""
    from clarifier.engine.loading import load_engine

    engine = load_engine(model_dir, cache_dir=cfg.model.cache_dir, precision=cfg.model.precision, decision_head=False)
    return _scored_row(engine, dev, examples, cfg, progress)


def _predict_probe(base_model: str, train: list, dev: list, examples: list, cfg: ClarifierConfig,
                   progress: Progress) -> tuple[list, dict]:
    """The untrained ``base_model`` with a decision head fitted on ``train`` (decision only)."""
    from clarifier.engine.inference import ClarifierEngine
    from clarifier.train.decision_head import LocalFeatures, fit_head

    engine = ClarifierEngine.from_base(base_model, cache_dir=cfg.model.cache_dir,
                                       prompt_opts=cfg.model.prompt_options(),
                                       precision=cfg.model.precision)
    head, fit = fit_head(LocalFeatures(engine), train, dev, cfg.train.decision_head, seed=cfg.train.seed,
                         progress=progress)
    engine.decision_head = head
    preds, info = _scored_row(engine, dev, examples, cfg, progress, dev_scores=fit.pop("dev_scores"))
    return preds, {**info, "base_model": base_model, "decision_head": fit}


def _predict_zero_shot(base_model: str, dev: list, examples: list, cfg: ClarifierConfig,
                       progress: Progress) -> tuple[list, dict]:
    """The prompted base model's P(clarify) on ``examples`` (decision only), thresholded like a trained model."""
    from clarifier.engine.inference import ClarifierEngine

    engine = ClarifierEngine.from_base(base_model, cache_dir=cfg.model.cache_dir, threshold=0.5,
                                       prompt_opts=cfg.model.prompt_options(), precision=cfg.model.precision)
    return _scored_row(engine, dev, examples, cfg, progress)


def _encoder_row(row: EncoderPlan, train: list, dev: list, examples: list, cfg: ClarifierConfig, progress: Progress,
                 leave_one_out: bool = False, save_to: Path | None = None) -> tuple[list, dict]:
    """Train an encoder classifier on ``train``, calibrate it on ``dev`` (``eval.max_over_asking``), score
    ``examples``: its predictions and the row's info (training, threshold, calibration, timing)."""
    from clarifier.train.encoder_classifier import train_encoder_classifier

    clf = train_encoder_classifier(train, row.classifier_config(leave_one_out), progress=progress)
    calib = clf.calibrate(dev, cfg.eval.max_over_asking, progress)
    t0 = time.time()
    preds = clf.predict(examples)
    info = {**clf.train_info, "threshold": clf.threshold, "calibration": calib, "eval_seconds": round(time.time() - t0, 1)}
    if save_to is not None:
        info["model_dir"] = str(clf.save(save_to))
    return preds, info


def row_metrics(examples, preds, sim_fn, grounding_source) -> dict:
    """A benchmark row's metrics: on every example (``all``) and inside each source."""
    from clarifier.core.metrics import evaluate_predictions
    from clarifier.core.schema import source_of

    out = {"all": evaluate_predictions(examples, preds, similarity_fn=sim_fn)}
    for src in sorted({source_of(e) for e in examples}):
        idx = [i for i, e in enumerate(examples) if source_of(e) == src]
        out[src] = evaluate_predictions([examples[i] for i in idx], [preds[i] for i in idx], similarity_fn=sim_fn)
    out["grounding_source"] = grounding_source
    return out


def run_benchmark(plan_name: str, out: str | Path | None = None, workdir: str | Path | None = None,
                  overrides: list[str] | tuple[str, ...] = (), leave_out: list[str] | tuple[str, ...] = (),
                  progress: Progress = print) -> dict:
    """Run the plan; writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/recipe-<plan name>``), and
    refuses at once (``ResultExists``) when either is already there: an earlier run's result is never overwritten.

    ``leave_out`` replaces the plan's ``leave_one_out.sources`` (the default output name then ends with
    them, e.g. ``recipe-joint-public-loo-clariq``), so one plan's sources can be run a part at a time."""
    from clarifier.runtime.services import mlflow_env, start_mlflow_server

    plan, name = resolve_plan(plan_name, overrides, leave_out)
    out = Path(out) if out else Path("benchmarks") / "results" / name  # relative to the working directory
    from clarifier.recipes.tables import output_paths, refuse_existing

    refuse_existing(output_paths(out).values())  # before hours of training, not after: a result is never overwritten
    workdir = Path(workdir or f".clarifier/recipe-benchmark/{plan.recipe}").expanduser().resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    clock = _Clock(progress)
    for k, v in mlflow_env().items():
        os.environ.setdefault(k, v)
    server = None
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        server = start_mlflow_server(workdir / "mlflow")
        os.environ["MLFLOW_TRACKING_URI"] = server.url
        progress(f"MLflow: {server.url} (sqlite under {workdir / 'mlflow'})")
    try:
        from clarifier.runtime.cluster import init_ray

        init_ray()
        result = _run(plan, name, workdir, clock, progress)
    finally:
        if server:
            server.stop()
    result["seconds_total"] = round(time.time() - clock.t0, 1)
    result["stages_seconds"] = clock.stages
    from clarifier.recipes.tables import write_outputs

    paths = write_outputs(result, out)
    progress(f"\nrecipe benchmark done in {result['seconds_total'] / 60:.1f} min: {paths['json']} and {paths['md']}")
    return result


def _run(plan: BenchmarkPlan, benchmark: str, workdir: Path, clock: _Clock, progress: Progress) -> dict:
    from clarifier.data.outputs import load_split
    from clarifier.core.schema import sample_by_source, source_of
    from clarifier.evaluation.baselines import baseline_predictions
    from clarifier.evaluation.error_analysis import analyse
    from clarifier.evaluation.evaluate import fingerprint_examples, similarity_fn_for

    base = load_config(recipe_path(plan.recipe), plan.overrides)
    base.storage.root = str(workdir / "storage")
    base = base.model_copy(update={"data": base.data.model_copy(update={
        "input": str(workdir / "recipe" / "input"), "output": str(workdir / "recipe" / "data")})})
    from clarifier.recipes import prepare_if_needed

    with clock.stage("data job: import the sources, Ray Data preprocessing"):
        manifest = prepare_if_needed(base, progress)
    test = load_split(base.data.output, base.eval.split)
    examples = sample_by_source(test, plan.eval_per_source, plan.seed, plan.eval_clarify_share)
    by_source = {}
    for e in examples:
        by_source.setdefault(source_of(e), [0, 0])
        by_source[source_of(e)][0] += 1
        by_source[source_of(e)][1] += int(e.needs_clarification)
    progress(f"[recipe] evaluation set: {len(examples)} test examples: "
             + ", ".join(f"{s} {n} ({c} clarify)" for s, (n, c) in by_source.items()))
    sim_fn, sim_info = similarity_fn_for(base, progress)

    rows: dict[str, dict] = {}
    preds_of: dict[str, list] = {}

    def add_row(name: str, kind: str, preds: list, **info):
        preds_of[name] = preds
        rows[name] = {"kind": kind, **info, "metrics": row_metrics(examples, preds, sim_fn, plan.grounding_source),
                      # per example, in eval_set.ids order: what later analyses (other intervals, other thresholds) need
                      "scores": [round(float(p.confidence), 6) for p in preds],
                      "decisions": [bool(p.needs_clarification) for p in preds]}
        m = rows[name]["metrics"]["all"]
        progress(f"[recipe] {name}: F1 {m['decision']['f1']:.3f}, over-asking {m['decision']['over_asking_rate']:.3f}, "
                 f"AUROC {m['auroc'] if m['auroc'] is None else round(m['auroc'], 3)}")

    with clock.stage("rule baselines"):
        for name in plan.rule_baselines:
            add_row(name, "rule", baseline_predictions(name, examples))
    # The train and calibration splits as examples, read once for the rows fitted or calibrated in this process.
    calibration = base.eval.calibration_split
    need_splits = (plan.source_only or plan.surface_control or bool(plan.encoders) or bool(plan.probes)
                   or bool(plan.zero_shot) or plan.decision_token_rows)
    train_split = load_split(base.data.output, "train") if need_splits else []
    dev_split = load_split(base.data.output, calibration) if need_splits and calibration else []
    train_mix = {}
    if plan.source_only:
        with clock.stage("source-only control"):
            from clarifier.evaluation.baselines import source_only_predictions
            from clarifier.train.loop import training_mix

            preds, thr = source_only_predictions(train_split, dev_split, examples, base.eval.max_over_asking)
            mix = training_mix(base.train.balance, manifest["counts"]["splits"]["train"])
            train_mix = {k: mix[k] for k in ("balance", "source_only_auroc", "source_only_auroc_natural")}
            progress(f"[recipe] training mix ({base.train.balance}): source-only control AUROC "
                     f"{train_mix['source_only_auroc']} (natural mix {train_mix['source_only_auroc_natural']})")
            add_row("source_only", "control", preds, threshold=thr)
    if plan.surface_control:
        with clock.stage("surface control"):
            from clarifier.evaluation.baselines import surface_control_predictions

            preds, info = surface_control_predictions(train_split, dev_split, examples, base.eval.max_over_asking)
            add_row("surface_control", "control", preds, **info)
    for name, model in plan.zero_shot.items():
        with clock.stage(f"zero-shot {name} ({model})"):
            preds, info = _predict_zero_shot(model, dev_split, examples, base, progress)
            add_row(name, "zero-shot", preds, base_model=model, **info)
    for name, extra in plan.variants.items():
        cfg = _variant_cfg(base, plan.recipe, plan, name, extra, workdir)
        with clock.stage(f"train {name} ({' '.join(extra) or 'the recipe'})"):
            tr = _train(cfg, progress)
        head, tokens = _head_summary(tr["model_dir"]), None
        if head and plan.decision_token_rows:
            with clock.stage(f"evaluate {name} deciding from its decision tokens"):
                dev = (dev_split if cfg.data.output == base.data.output or not calibration
                       else load_split(cfg.data.output, calibration))  # the variant's own calibration split
                tokens = _predict_tokens(tr["model_dir"], dev, examples, cfg, progress)
        with clock.stage(f"evaluate {name}"):
            keep = workdir / "models" / name if name in plan.keep_models else None
            preds, thr, secs = _predict_model(tr.pop("model_dir"), examples, cfg, progress, keep)
            add_row(name, "trained", preds, overrides=extra, threshold=thr, eval_seconds=secs, **tr,
                    decided_by="decision head" if head else "decision tokens",
                    **({"decision_head": head} if head else {}), **({"model_dir": str(keep)} if keep else {}))
        if tokens:
            add_row(f"{name}_tokens", "tokens", tokens[0], overrides=extra, decided_by="decision tokens",
                    run_id=tr["run_id"], steps=tr["steps"], **tokens[1])
    for name, model in plan.probes.items():
        with clock.stage(f"probe {name} ({model} + decision head)"):
            preds, info = _predict_probe(model, train_split, dev_split, examples, base, progress)
            add_row(name, "probe", preds, **info)

    for name, enc in plan.encoders.items():
        with clock.stage(f"encoder {name} ({enc.base_model}): train, calibrate, evaluate"):
            preds, info = _encoder_row(enc, train_split, dev_split, examples, base, progress,
                                       save_to=workdir / "encoders" / name)
            add_row(name, "encoder", preds, **info)

    from clarifier.core.metrics import paired_bootstrap

    gold = [bool(e.needs_clarification) for e in examples]
    uncertainty = paired_bootstrap(
        gold, {name: ([bool(p.needs_clarification) for p in preds], [float(p.confidence) for p in preds])
               for name, preds in preds_of.items()},
        reference=next((n for n in plan.variants if n in preds_of), None), seed=plan.seed,  # the recipe as shipped
        sources=[source_of(e) for e in examples])

    skill = {}
    if "surface_control" in preds_of:  # every trained, probe and encoder row's margin over position and length
        from clarifier.core.surface import skill_over_control

        for name, r in rows.items():
            if r["kind"] in ("trained", "tokens", "probe", "encoder", "zero-shot"):
                skill[name] = skill_over_control(gold, r["scores"], rows["surface_control"]["scores"],
                                                 [source_of(e) for e in examples], model=name, seed=plan.seed)
                progress(f"[recipe] {skill[name]['verdict']}")

    loo: dict[str, dict] = {}
    for src in plan.leave_one_out.sources:
        cfg = without_source(_variant_cfg(base, plan.recipe, plan, f"loo-{src}", plan.leave_one_out.overrides, workdir),
                             src, workdir)
        held = [e for e in examples if source_of(e) == src]
        if not held:
            progress(f"[recipe] WARNING: no evaluation examples from {src}; skipping its leave-one-out run")
            continue
        with clock.stage(f"leave-one-out: train without {src}"):
            tr = _train(cfg, progress)
        with clock.stage(f"leave-one-out: evaluate on {src}"):
            preds, thr, secs = _predict_model(tr.pop("model_dir"), held, cfg, progress)
        from clarifier.core.metrics import evaluate_predictions

        idx = [i for i, e in enumerate(examples) if source_of(e) == src]
        loo[src] = {
            "left_out": evaluate_predictions(held, preds, similarity_fn=sim_fn), "threshold": thr, "eval_seconds": secs,
            "overrides": plan.leave_one_out.overrides, **tr,
            "in_distribution": {name: rows[name]["metrics"].get(src) for name in rows},
            "n": len(idx),
        }
        for name, enc in plan.encoders.items():
            if not enc.leave_one_out:
                continue
            with clock.stage(f"leave-one-out: encoder {name} without {src}"):
                preds, info = _encoder_row(enc, [e for e in train_split if source_of(e) != src],
                                           [e for e in dev_split if source_of(e) != src], held, base, progress,
                                           leave_one_out=True)
            loo[src].setdefault("encoders", {})[name] = {
                "left_out": evaluate_predictions(held, preds, similarity_fn=sim_fn), **info}

    errors = {}
    ea = plan.error_analysis
    if ea.row in preds_of:
        with clock.stage(f"error analysis of {ea.row}"):
            for src in sorted(by_source):
                idx = [i for i, e in enumerate(examples) if source_of(e) == src]
                errors[src] = analyse([examples[i] for i in idx], [preds_of[ea.row][i] for i in idx],
                                      n_decisions=ea.decisions, n_questions=ea.questions, seed=plan.seed,
                                      similarity_fn=sim_fn, min_similarity=ea.min_similarity)
    import clarifier
    from clarifier.runtime.cluster import git_commit

    return {
        "benchmark": benchmark,
        "plan": plan.model_dump(mode="json"),
        "recipe_file": str(recipe_path(plan.recipe)),
        "code": {"clarifier_version": clarifier.__version__, "git_commit": git_commit()},
        "data": {"output": base.data.output, "sources": manifest.get("sources"), "counts": manifest["counts"],
                 "silver_grounding": manifest.get("silver_grounding")},
        "eval_set": {"n": len(examples), "fingerprint": fingerprint_examples(examples), "ids": [e.id for e in examples],
                     "sources": [source_of(e) for e in examples], "gold": [bool(e.needs_clarification) for e in examples],
                     "by_source": {s: {"n": n, "clarify": c} for s, (n, c) in by_source.items()},
                     "split": base.eval.split, "per_source_cap": plan.eval_per_source,
                     "clarify_share": plan.eval_clarify_share,
                     "split_by_source": {s: {"n": sum(source_of(e) == s for e in test),
                                             "clarify": sum(source_of(e) == s and e.needs_clarification for e in test)}
                                         for s in by_source}},
        "semantic_encoder": sim_info,
        "operating_point": {"max_over_asking": base.eval.max_over_asking,
                            "rule": "max F1" if base.eval.max_over_asking is None else
                            f"best recall with over-asking <= {base.eval.max_over_asking:g} on {base.eval.calibration_split}"},
        "train_mix": train_mix,
        "rows": rows,
        "uncertainty": uncertainty,
        "skill_over_surface_control": skill,
        "leave_one_out": loo,
        "error_analysis": errors,
    }
