"""The ``clarifier`` command: one subcommand per stage, plus ``quickstart``.

Every stage takes ``--config FILE`` and trailing dotted overrides (``train.max_steps=20``).
Inside ``ray job submit`` (``RAY_ADDRESS`` set) the stages join that cluster.
"""

from __future__ import annotations

import errno
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from clarifier.core.config import DATASET_REF, ConfigError, dump_config, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
data_app = typer.Typer(no_args_is_help=True, help="Data jobs: synthetic logs, public-dataset fetch and import, preprocessing.")
models_app = typer.Typer(no_args_is_help=True, help="MLflow model registry: register, promote (gated), rollback, list, diff.")
app.add_typer(data_app, name="data")
recipe_app = typer.Typer(no_args_is_help=True, help="Named recipes (clarifier/recipes/configs/) and their comparison benchmarks (clarifier/recipes/plans/).")
app.add_typer(models_app, name="models")
app.add_typer(recipe_app, name="recipe")
label_app = typer.Typer(no_args_is_help=True, help="Labels of your own: which turns of your logs to label next.")
app.add_typer(label_app, name="label")
tenants_app = typer.Typer(no_args_is_help=True, help="Many assistants, one deployment: the tenants file of "
                                                      "serve.tenants_file (check it, scope a key to a tenant).")
app.add_typer(tenants_app, name="tenants")
console = Console(highlight=False, soft_wrap=True)  # Clarifier's own lines and results (stdout)
err_console = Console(highlight=False, soft_wrap=True, stderr=True)  # errors and the log file's path


from clarifier.runtime.cluster import exit_cleanly_on_sigterm  # noqa: E402  (re-exported: the CLI's SIGTERM policy)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the logs of Ray, Serve, DeepSpeed, "
                                       "transformers and MLflow, and tracebacks, on the terminal (default: only "
                                       "Clarifier's own lines; the rest goes to .clarifier/logs/<command>-<time>.log).")) -> None:
    exit_cleanly_on_sigterm()

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML config file (see jobs/configs/).")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. train.max_steps=20 model.lora.r=8")


class _Lines:
    """Clarifier's own lines. Repeated progress lines (``[train] step k/N ...``, one per optimizer step;
    ``[eval] model: k/N``, ``[head] train: k/N (...)`` and ``[data] tokenise: k/N examples``, one per few batches)
    become one live line on a terminal; elsewhere (CI, a job's log) one is printed per ``every_s``,
    plus the last one, so a long run stays readable."""

    # progress lines: "[train] step 7/40: ...", "[encoder] step 7 ...", "[eval] model: 32/120",
    # "[head] train: 64/600 (4.1/s)", "[data] tokenise: 512/6796 examples"
    STEPS = (re.compile(r"^\[(?:train|encoder)\] step (\d+)(?:/(\d+))?[: ]"),
             re.compile(r"^\[eval\] [\w.-]+: (\d+)/(\d+)$"),
             re.compile(r"^\[(?:head|data)\] [\w.-]+: (\d+)/(\d+) "))

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self.status = None
        # None, not 0.0: time.monotonic() counts from boot, and on a machine up for less than every_s a
        # 0.0 would hold back the first progress line
        self.last_printed: float | None = None
        self.pending: str | None = None
        self.lock = threading.Lock()
        self.streams_to_log = False  # main(): sys.stdout/sys.stderr go to the run's log file

    def __call__(self, msg: str) -> None:
        with self.lock:
            m = next((m for p in self.STEPS if (m := p.match(msg))), None)
            if m:
                return self._step(msg, m)
            self._end_steps()
            console.print(msg, markup=False)

    def _step(self, msg: str, m) -> None:
        final = m.group(2) is not None and m.group(1) == m.group(2)
        if console.is_terminal:
            if self.status is None:
                self.status = self._live(msg)
                self.status.start()
            self.spinner.update(text=msg)
            self.pending = msg
            if final:
                self._end_steps()
            return
        now = time.monotonic()
        if final or self.last_printed is None or now - self.last_printed >= self.every_s:
            console.print(msg, markup=False)
            self.last_printed, self.pending = now, None
        else:
            self.pending = msg

    def _live(self, msg: str):
        """The live line (rich's ``console.status`` is the same Live + Spinner). Live would also point
        ``sys.stdout``/``sys.stderr`` at the terminal while it runs; when those go to the run's log
        file, that would put Ray's worker lines, warnings and progress bars back on the terminal."""
        from rich.live import Live
        from rich.spinner import Spinner

        self.spinner = Spinner("dots", text=msg, style="status.spinner")
        to_terminal = not self.streams_to_log
        return Live(self.spinner, console=console, transient=True, refresh_per_second=12.5,
                    redirect_stdout=to_terminal, redirect_stderr=to_terminal)

    def _end_steps(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        if self.pending is not None:  # the last step line stays visible
            console.print(self.pending, markup=False)
            self.pending = None
            self.last_printed = None


_say = _Lines()


def _cfg(config: Optional[Path], overrides: Optional[list[str]]):
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        err_console.print(f"[red]config error:[/red] {exc}")
        raise typer.Exit(2)


SubmitOpt = typer.Option(None, "--submit", metavar="ADDRESS",
                         help="Submit as a Ray job to the cluster whose dashboard is at ADDRESS (http://<head>:8265), "
                              "stream its logs and exit with its status.")
InstalledCodeOpt = typer.Option(False, "--installed-code",
                                help="With --submit: run the clarifier package installed on the cluster instead of shipping this checkout's.")


def _submit(address: str, stage: list[str], cfg, extra_args: list[str] | None = None, installed_code: bool = False):
    """Submit a stage as a Ray job; prints the job id, streams logs, exits with the job's status."""
    from clarifier.runtime.submit import submit_stage

    from ray.exceptions import AuthenticationError

    try:
        sub = submit_stage(address, stage, cfg, extra_args, ship_code=not installed_code, progress=_say)
    except (ValueError, AuthenticationError, ConnectionError) as exc:
        err_console.print(f"[red]submit error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    console.print(json.dumps({"job_id": sub.job_id, "status": sub.status, "address": sub.address}), markup=False)
    raise typer.Exit(sub.exit_code)


@app.command()
def quickstart(
    workdir: Path = typer.Option(Path(".clarifier/quickstart"), help="Where everything of this run is written."),
    config: Optional[Path] = ConfigOpt,
    port: Optional[int] = typer.Option(None, help="HTTP port for Ray Serve (default from config)."),
    overrides: Optional[list[str]] = OverridesArg,
):
    """Run every stage end to end on the embedded default (local Ray, MLflow, object-store folder, SmolLM2)."""
    from clarifier.quickstart import run_quickstart

    try:
        summary = run_quickstart(workdir, config, overrides or [], port=port, progress=_say)
    except ConfigError as exc:
        err_console.print(f"[red]config error:[/red] {exc}")
        raise typer.Exit(2)
    for line, won in verdict_lines(summary):
        console.print(line if won else f"[yellow]{line}[/yellow]", markup=not won, highlight=False)


def verdict_lines(summary: dict) -> list[tuple[str, bool]]:
    """Whether the trained model beat each baseline on its own held-out split, and by how much: F1 at each
    one's own operating point, then (where the summary has it) recall at the baseline's over-asking rate."""
    f1, oa = summary["decision_f1"], summary["over_asking_rate"]
    out = []
    if summary.get("skill"):  # the headline: the margin over position and length alone
        out.append((summary["skill"]["verdict"], bool(summary["skill"]["beats_control"])))
    for b in ("lexical", "always_ask", "base_model"):
        if b not in f1 or "model" not in f1:
            continue
        d = f1["model"] - f1[b]
        head = (f"the trained model beats {b} by {d:+.3f} F1" if d > 0 else
                f"note: on decision F1 the trained model did NOT beat {b} ({d:+.3f})")
        out.append((f"{head}: {f1['model']:.3f} vs {f1[b]:.3f}, over-asking {oa['model']:.3f} vs {oa[b]:.3f}", d > 0))
        same = summary.get("at_baseline_over_asking", {}).get(b)
        if same:
            dr = same["model_recall"] - same["baseline_recall"]
            out.append((f"  asking as often as {b} (over-asking {same['over_asking']:.3f}), the model's scores catch "
                        f"{same['model_recall']:.3f} of the turns that need a question vs {same['baseline_recall']:.3f} "
                        f"({dr:+.3f}; threshold picked on the test split: rankings compared at equal cost)", dr > 0))
    return out


@app.command("config")
def show_config(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Print the fully resolved config (after overrides) as YAML."""
    console.print(dump_config(_cfg(config, overrides)), markup=False, end="")


@data_app.command("synth")
def data_synth(out: str = typer.Option(..., help="Folder or s3:// prefix for JSONL shards."),
               n: int = typer.Option(400, help="Number of conversations."), seed: int = 0, shards: int = 4,
               generator: str = typer.Option("synthetic", help="synthetic (ambiguity from the history), "
                                             "synthetic_rag (ambiguity in each turn's retrieved passages) or "
                                             "synthetic_chat (synthetic_rag as chat transcripts with planted "
                                             "failures, for `clarifier audit`; no gold labels in the logs)."),
               planted_share: float = typer.Option(0.15, help="synthetic_chat: share of the failed turns that "
                                                   "need clarification."),
               failure_rate: float = typer.Option(0.3, help="synthetic_chat: share of the labelled turns that fail.")):
    """Write synthetic multi-turn conversation logs with gold labels (or chat logs with planted failures)."""
    import importlib

    from clarifier.data.sources import GENERATORS
    from clarifier.data.synthetic_chatlogs import GENERATOR as CHAT

    if generator == CHAT:
        from clarifier.data.synthetic_chatlogs import PLANTED_FILE, write_chatlogs

        try:
            files = write_chatlogs(out, n, seed=seed, shards=shards, planted_share=planted_share,
                                   failure_rate=failure_rate)
        except ValueError as exc:
            err_console.print(f"[red]{escape(str(exc))}[/red]")
            raise typer.Exit(2)
        from clarifier.runtime.storage import join, read_text

        s = json.loads(read_text(join(out, PLANTED_FILE)))["summary"]
        share = "n/a" if s["share"] is None else f"{s['share']:.3f}"
        _say(f"wrote {n} {generator} conversations to {len(files)} files under {out}: {s['turns']} user turns, "
             f"{s['failed']} failed, {s['failed_needing_clarification']} of them need clarification (planted share "
             f"{share}; requested {planted_share}); the truth is in {PLANTED_FILE} and each record's 'planted' key")
        return
    if generator not in GENERATORS:
        err_console.print(f"[red]--generator {escape(generator)!r} is not one of {', '.join([*GENERATORS, CHAT])}[/red]")
        raise typer.Exit(2)
    files = importlib.import_module(GENERATORS[generator]).write_logs(out, n, seed=seed, shards=shards)
    _say(f"wrote {n} {generator} conversations to {len(files)} files under {out}")


@data_app.command("import")
def data_import(dataset: str = typer.Argument(..., help="Importer name: clariq, pacific, abgcoqa, claqua or a plugin's."),
                src: str = typer.Option(..., "--src", help="Folder holding the dataset as published, or dataset:<name> "
                                                          "(a registered dataset from $CLARIFIER_DATA_MIRROR or the cache: data fetch)."),
                out: str = typer.Option(..., "--out", help="file.jsonl, or a folder / s3:// prefix (one JSONL per split)."),
                option: Optional[list[str]] = typer.Option(None, "--option", "-o", help="Importer option key=value (repeatable)."),
                s3_endpoint_url: Optional[str] = typer.Option(None, help="S3-compatible endpoint for an s3:// --out.")):
    """Import a public dataset into evaluation-set JSONL; print counts per label and skipped rows by reason."""
    from clarifier.runtime import storage
    from clarifier.data.importers.export import export_dataset

    opts: dict[str, str] = {}
    for o in option or []:
        if "=" not in o:
            err_console.print(f"[red]--option {o!r} must look like key=value[/red]")
            raise typer.Exit(2)
        k, v = o.split("=", 1)
        opts[k.strip()] = v
    storage.set_s3_endpoint(s3_endpoint_url)
    try:
        if src.startswith(DATASET_REF):
            from clarifier.data.datasets import resolve_dataset

            src = resolve_dataset(src[len(DATASET_REF):])
        report = export_dataset(dataset, src, out, opts, progress=_say)
    except (KeyError, ValueError, FileNotFoundError, ImportError, TypeError) as exc:
        from rich.markup import escape

        err_console.print(f"[red]import error:[/red] {escape(str(exc.args[0] if isinstance(exc, KeyError) else exc))}")
        raise typer.Exit(2)
    _say(json.dumps({k: v for k, v in report.items() if k != "skipped_records"}, indent=2))


@data_app.command("fetch")
def data_fetch(dataset: str = typer.Argument(..., help="A registered public dataset (clariq, pacific, abgcoqa, claqua) or 'all'."),
               mirror: Optional[str] = typer.Option(None, "--mirror", metavar="DIR",
                                                    help="Copy from this local folder (or s3:// prefix) holding <name>/ instead of downloading."),
               cache: Optional[Path] = typer.Option(None, "--cache", metavar="DIR",
                                                    help="The datasets cache (default $CLARIFIER_CACHE/datasets, else ~/.cache/clarifier/datasets).")):
    """Download (or copy from --mirror) a registered public dataset into the cache, verifying each file's
    size and sha256; files already verified are kept. `src: dataset:<name>` in data.sources then finds it.

    Downloads come from the dataset's own repository, or from $CLARIFIER_DATA_BASE_URL/<name>/<path> when set.
    Exit code 0 when every file is verified, 1 when one failed, 2 for an unknown dataset."""
    from clarifier.data.datasets import REGISTRY, DatasetError, fetch_dataset, get_dataset

    names = sorted(REGISTRY) if dataset == "all" else [dataset]
    try:
        for name in names:
            get_dataset(name)
    except DatasetError as exc:
        err_console.print(f"[red]fetch error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    reports = [fetch_dataset(name, cache=cache, mirror=mirror, progress=_say) for name in names]
    failed = [r for r in reports if not r.ok]
    _say(f"{len(reports) - len(failed)} of {len(reports)} dataset(s) verified in {Path(reports[0].folder).parent}"
         + (f"; FAILED: {', '.join(r.dataset for r in failed)}" if failed else ""))
    if failed:
        raise typer.Exit(1)


@data_app.command("prepare")
def data_prepare(config: Optional[Path] = ConfigOpt,
                 synthetic: bool = typer.Option(False, help="First write data.synthetic_conversations synthetic logs to data.input."),
                 submit: Optional[str] = SubmitOpt, installed_code: bool = InstalledCodeOpt,
                 overrides: Optional[list[str]] = OverridesArg):
    """Ray Data job: logs -> validated, split, tokenised Parquet + quarantine + manifest."""
    from clarifier.runtime import storage
    from clarifier.data.pipeline import prepare
    from clarifier.runtime.cluster import init_ray

    cfg = _cfg(config, overrides)
    if submit:
        _submit(submit, ["data", "prepare"], cfg, ["--synthetic"] if synthetic else [], installed_code)
    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    if synthetic:
        from clarifier.data.synthetic import write_logs

        if not cfg.data.input:
            err_console.print("[red]--synthetic needs data.input (where to write the logs)[/red]")
            raise typer.Exit(2)
        files = write_logs(cfg.data.input, cfg.data.synthetic_conversations, seed=cfg.data.seed)
        _say(f"[data] wrote {cfg.data.synthetic_conversations} synthetic conversations to {len(files)} files")
    init_ray()
    manifest = prepare(cfg, progress=_say)
    _say(json.dumps(manifest["counts"], indent=2))


@app.command()
def train(config: Optional[Path] = ConfigOpt, submit: Optional[str] = SubmitOpt,
          installed_code: bool = InstalledCodeOpt,
          recipe: Optional[str] = typer.Option(None, "--recipe", help="A named recipe (clarifier/recipes/configs/<name>.yaml) or its file: "
                                               "used as the config, and implies --prepare."),
          prepare: bool = typer.Option(False, "--prepare", help="Run the data job first, unless data.output already holds "
                                       "this data config's output."),
          evaluate_after: bool = typer.Option(True, "--eval/--no-eval", help="After training, evaluate the model and the "
                                              "baselines on eval.split of data.output and log the report (Markdown, JSON, "
                                              "plots) and eval/ metrics to the training run."),
          overrides: Optional[list[str]] = OverridesArg):
    """Ray Train job: LoRA (or full, model.finetune=full) fine-tuning on the joint objective with DeepSpeed, tracked in MLflow.

    Rerunning with the same train.run_name (and storage.root) resumes from the last checkpoint. The trained model
    is then evaluated on the held-out split (--no-eval skips it); its report is in the run's artifacts under eval/."""
    from clarifier.runtime.cluster import init_ray
    from clarifier.train.trainer import train as run_train

    if recipe:
        if config:
            err_console.print("[red]--recipe and --config both name a config; pass one[/red]")
            raise typer.Exit(2)
        from clarifier.recipes import recipe_path

        try:
            config = recipe_path(recipe)
        except ConfigError as exc:
            err_console.print(f"[red]config error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        prepare = True
        _say(f"[recipe] {recipe}: {config}")
    cfg = _cfg(config, overrides)
    if submit:
        _submit(submit, ["train"], cfg, (["--prepare"] if prepare else []) + ([] if evaluate_after else ["--no-eval"]),
                installed_code)
    init_ray()
    if prepare:
        from clarifier.runtime import storage
        from clarifier.recipes import prepare_if_needed

        storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
        prepare_if_needed(cfg, progress=_say)
    res = run_train(cfg, progress=_say)
    report = None
    if evaluate_after:
        from clarifier.evaluation.evaluate import evaluate_training_run

        report = evaluate_training_run(cfg, res.model_dir, res.run_id, progress=_say)  # into <storage.root>/eval/<run id>
    _say(json.dumps({"run_id": res.run_id, "model_dir": res.model_dir, "steps": res.steps, "tracking": res.tracking,
                     "eval_report": report["paths"]["markdown"] if report else None}))


@app.command("eval")
def eval_cmd(model: str = typer.Option(..., help="models:/name@alias, runs:/<id>/adapter, s3:// prefix or folder."),
             data: Optional[str] = typer.Option(None, help="Data-job output folder, evaluation-set JSONL (file, folder, "
                                                "s3://) or builtin:probes: hand-written behaviour checks (default data.output)."),
             run_id: Optional[str] = typer.Option(None, help="Log the report to this MLflow run."),
             out: Optional[Path] = typer.Option(None, help="Folder for report.json / report.md / plots (default: a new <storage.root>/eval/<UTC time>-<id>)."),
             compare: Optional[list[str]] = typer.Option(
                 None, help="NAME=URI: another model in the same report (repeatable), e.g. pipeline=runs:/<id>/adapter."),
             config: Optional[Path] = ConfigOpt, submit: Optional[str] = SubmitOpt,
             installed_code: bool = InstalledCodeOpt, overrides: Optional[list[str]] = OverridesArg):
    """Evaluate a model and the baselines; write JSON, Markdown and plots."""
    from clarifier.evaluation.evaluate import evaluate

    cfg = _cfg(config, overrides)
    for item in compare or []:
        name, sep, uri = item.partition("=")
        if not sep or not name.strip() or not uri.strip():
            err_console.print(f"[red]--compare {item!r}: expected NAME=URI[/red]")
            raise typer.Exit(2)
        cfg.eval.compare = {**cfg.eval.compare, name.strip(): uri.strip()}
    if submit:
        from clarifier.runtime.submit import absolute_path, existing_path

        args = ["--model", existing_path(model)]
        args += ["--data", existing_path(data)] if data else []
        args += ["--run-id", run_id] if run_id else []
        args += ["--out", absolute_path(str(out))] if out else []
        _submit(submit, ["eval"], cfg, args, installed_code)
    rep = evaluate(cfg, model, data, run_id=run_id, out_dir=str(out) if out else None, progress=_say)
    _say(f"report: {rep['paths']}")


@app.command()
def adapt(model: str = typer.Option(..., help="The model to adapt: builtin:<name>, models:/name@alias, "
                                     "runs:/<id>/adapter, s3:// prefix or folder."),
          data: str = typer.Option(..., help="Your labelled turns (needs_clarification set): evaluation-set JSONL "
                                    "(file, folder, s3://) or a data-job output folder (its --split)."),
          out: Path = typer.Option(..., help="Folder for the adapted model: a copy of MODEL with the new decision "
                                   "head and threshold."),
          start: str = typer.Option("auto", help="auto: keep whichever ranks your turns better out of fold; head: the "
                                    "model's own head moved towards your labels; scratch: a head on your turns alone."),
          split: str = typer.Option("train", help="The split of a data-job output folder to learn from."),
          experiment: Optional[str] = typer.Option(None, help="Also log the adapted model as a run of this MLflow "
                                                   "experiment (artifact 'adapter'), to register and promote it."),
          train: bool = typer.Option(False, "--train", help="First train the model's LoRA adapter further on your "
                                     "labelled turns (Ray Train; needs 200 of them plus a queue's kept-apart slice of "
                                     "20, which alone judges it), then fit the head; the report sets it beside the "
                                     "head refit alone."),
          train_minutes: float = typer.Option(10.0, "--train-minutes", min=0.1, help="Time budget of the --train run."),
          config: Optional[Path] = ConfigOpt, submit: Optional[str] = SubmitOpt,
          installed_code: bool = InstalledCodeOpt, overrides: Optional[list[str]] = OverridesArg):
    """Fit the model's decision head to your own labelled turns (minutes on a CPU): a new model folder, and how
    well it ranks those turns before and after (cross-validated). eval.engine=ray reads the model's states on Ray
    actors (eval.ray_actors, eval.ray_gpus_per_actor) instead of in this process. With --submit the job writes
    --out on the cluster (its driver's disk, or a volume the nodes share); --experiment brings the adapted model
    back through MLflow."""
    from clarifier.evaluation.evaluate import load_eval_data
    from clarifier.runtime.mlflow_uri import tracking_uri as resolve_tracking_uri
    from clarifier.train.adapt import AdaptError, adapt_head

    cfg = _cfg(config, overrides)
    if submit:
        from clarifier.runtime.submit import absolute_path, existing_path

        args = ["--model", existing_path(model), "--data", existing_path(data), "--out", absolute_path(str(out)),
                "--start", start, "--split", split, *(["--experiment", experiment] if experiment else []),
                *(["--train", "--train-minutes", str(train_minutes)] if train else [])]
        if not experiment:
            _say(f"[adapt] the adapted model is written to {absolute_path(str(out))} on the cluster's driver; add "
                 "--experiment NAME to have it logged to MLflow, where `clarifier models register` finds it")
        if cfg.eval.engine != "ray":
            _say("[adapt] eval.engine=local: the job's driver (on a KubeRay cluster, the head pod) reads the model's "
                 "states itself; eval.engine=ray puts that work on the cluster's workers")
        _submit(submit, ["adapt"], cfg, args, installed_code)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    ed = load_eval_data(data, split, report=_say)
    if not ed.examples:
        err_console.print(f"[red]no labelled turns in {escape(data)}[/red]"
                          + (f" ({len(ed.skipped)} lines skipped: see above)" if ed.skipped else ""))
        raise typer.Exit(2)
    pool = None
    if cfg.eval.engine == "ray" or train:  # forward passes on Ray actors (a cluster's GPUs with RAY_ADDRESS set)
        from clarifier.runtime.cluster import init_ray

        init_ray()
        pool = cfg.eval.ray_pool() if cfg.eval.engine == "ray" else None

    def fit_head(model_uri: str, folder: Path) -> dict:
        return adapt_head(model_uri, ed.examples, folder, start=start, max_over_asking=cfg.eval.max_over_asking,
                          data_name=ed.name, data_fingerprint=ed.fingerprint, cache_dir=cfg.model.cache_dir,
                          tracking_uri=tracking_uri, precision=cfg.model.precision,
                          batch_size=cfg.train.decision_head.batch_size,
                          seed=cfg.train.seed, ray_pool=pool, progress=_say)

    try:
        if not train:
            res = fit_head(model, out)
        else:
            res = _adapt_with_training(cfg, model, ed.examples, out, train_minutes, fit_head)
    except AdaptError as exc:
        err_console.print(f"[red]cannot adapt:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    _print_adapted(res)
    if res.get("lora_continuation"):
        lc = res["lora_continuation"]
        _say(f"[adapt] LoRA continuation: {lc['steps']} steps in {lc['seconds'] / 60:.1f} min (MLflow run {lc['run_id']})"
             f"; head refit alone: {lc['head_only_folder']}")
        _say(f"[adapt] {lc['comparison']['verdict']}")
    if experiment:
        from clarifier.train.adapt import log_adapted

        run_id = log_adapted(res["folder"], res, experiment, tracking_uri)
        _say(f"[adapt] logged as MLflow run {run_id} (experiment {experiment}); register it:\n"
             f"  clarifier models register --run-id {run_id} --name {cfg.registry.model_name} --alias challenger")


def _adapt_with_training(cfg, model: str, examples: list, out: Path, minutes: float, fit_head) -> dict:
    """``clarifier adapt --train``: the head refit alone first (``<out>.head-only``, the comparison), then the LoRA
    continuation on the labels and the head fitted on its states into ``out``, both scored on the same kept-apart
    turns (clarifier.train.adapt.continue_adapter)."""
    from clarifier.train.adapt import check_train_labels, compare_kept_apart, continue_adapter, is_kept_apart

    check_train_labels(examples)
    out = Path(out).expanduser().resolve()
    head_folder = out.with_name(out.name + ".head-only")
    _say(f"[adapt] --train: first the head refit alone (-> {head_folder}), the figure the continuation must beat")
    head_only = fit_head(model, head_folder)
    name = f"{out.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cont = continue_adapter(cfg, model, examples, name, minutes=minutes, progress=_say)
    res = fit_head(cont["model_dir"], out)
    held = [e for e in examples if is_kept_apart(e)]
    comparison = compare_kept_apart(held, res.get("kept_apart") or {}, head_only.get("kept_apart") or {},
                                    seed=cfg.train.seed)
    res["lora_continuation"] = {**cont, "from": model, "head_only_folder": str(head_folder), "comparison": comparison}
    summary = Path(res["folder"]) / "adapt.json"
    summary.write_text(json.dumps({k: v for k, v in res.items() if k != "folder"}, indent=2) + "\n")
    return res


def _print_adapted(res: dict) -> None:
    from rich.table import Table

    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    table = Table(title=f"AUROC on your {res['n']} labelled turns ({res['clarify']} need a question; fitted heads: "
                        "out of fold)")
    for col in ("decision", "AUROC", "C"):
        table.add_column(col)
    kept = lambda name: "[bold]kept:[/bold] " if name == res["kept"] else ""  # noqa: E731
    table.add_row(f"{kept('shipped')}its {res['before']['decided_by']} as it is", fmt(res["before"]["auroc"]), "")
    for name, h in res["heads"].items():
        label = {"head": "its head moved to your labels", "scratch": "a head on your turns alone"}[name]
        table.add_row(kept(name) + label, fmt(h["cv_auroc"]), f"{h['c']:g}")
    console.print(table)
    before, at = res["before"], res["at_threshold"]
    if before.get("at_threshold"):
        b = before["at_threshold"]
        _say(f"[adapt] as it is, at its threshold {before['threshold']:.3f}: recall {fmt(b['recall'])}, over-asking "
             f"{fmt(b['over_asking_rate'])}, F1 {fmt(b['f1'])}")
    if res["kept"] == "shipped":
        _say("[adapt] neither fitted head ranks your turns better than the model as it is: the copy keeps its decision "
             "and only sets its threshold on your turns")
    _say(f"[adapt] kept: threshold {res['threshold']:.3f} ({res['rule']}): recall {fmt(at['recall'])}, "
         f"over-asking {fmt(at['over_asking_rate'])}, F1 {fmt(at['f1'])}")
    est = res.get("estimate")
    if est:
        _say(f"[adapt] estimate for turns it never saw ({est['method']}; every choice made inside each fold): AUROC "
             f"{fmt(est['auroc'])}, recall {fmt(est['recall_at_budget'])} and F1 {fmt(est['f1_at_budget'])} at "
             f"{est['budget']:.0%} over-asking; surface control (position and length only) {fmt(est['surface_control_auroc'])}")
        won = est["skill"]["beats_control"]
        line = f"[adapt] {est['skill']['verdict']}"
        console.print(line if won else f"[yellow]{escape(line)}[/yellow]", markup=not won, highlight=False)
        if est.get("retriever_scores"):
            r = est["retriever_scores"]
            _say(f"[adapt] {r['verdict']}; the score profile alone {fmt(r['profile_auroc'])} "
                 f"({r['turns_with_scores']} of {r['turns_with_passages']} turns with passages scored)")
    ka = res.get("kept_apart")
    if ka:
        if ka.get("auroc") is None:
            _say(f"[adapt] kept-apart slice ({ka['n']} turns): {ka.get('note', 'no figure')}")
        else:
            iv = ka["auroc_interval"] or [None, None]
            _say(f"[adapt] on the queue's {ka['n']} kept-apart turns (never fitted on): AUROC {fmt(ka['auroc'])} "
                 f"[{fmt(iv[0])}, {fmt(iv[1])}] (before adapting {fmt(ka['before_auroc'])}); at its threshold recall "
                 f"{fmt(ka['at_threshold']['recall'])}, over-asking {fmt(ka['at_threshold']['over_asking_rate'])}, F1 "
                 f"{fmt(ka['at_threshold']['f1'])}; surface control {fmt(ka['surface_control_auroc'])}")
            _say(f"[adapt] kept apart: {ka['skill']['verdict']}")
    _say(f"[adapt] wrote {res['folder']} (adapt.json says how). The table's figures chose the head on the turns they "
         f"score (optimistic); the estimate above did not. Confirm on turns kept apart:\n"
         f"  clarifier eval --model {res['folder']} --data HELD_OUT.jsonl\n"
         f"  clarifier serve serve.model_uri={res['folder']}")


@app.command()
def audit(logs: Optional[str] = typer.Option(None, help="Folder, file or s3:// prefix of chat transcripts (OpenAI "
                                              "messages), conversation logs or examples: JSONL, JSONL.gz, Parquet."),
          model: Optional[str] = typer.Option(None, help="models:/name@alias, runs:/..., s3:// or a folder; default: "
                                               "registry.model_name@registry.alias with a tracking URI, else the quickstart's model."),
          out: Optional[str] = typer.Option(None, help="Folder or s3:// prefix for turns Parquet, quarantine and the report."),
          eval_report: Optional[str] = typer.Option(None, help="report.json of `clarifier eval` for this model (its error rates)."),
          reuse_scores: bool = typer.Option(False, "--reuse-scores", help="Estimate again from the turns an earlier "
                                            "audit scored into --out (same logs and model), without scoring: for other "
                                            "error rates, threshold or rule."),
          config: Optional[Path] = ConfigOpt, submit: Optional[str] = SubmitOpt,
          installed_code: bool = InstalledCodeOpt, overrides: Optional[list[str]] = OverridesArg):
    """Audit RAG logs: the share of failed turns that needed clarification, corrected, with a verdict."""
    from clarifier.runtime import storage

    cfg = _cfg(config, overrides)
    for key, value in (("logs", logs), ("output", out), ("model_uri", model), ("eval_report", eval_report)):
        if value:
            setattr(cfg.audit, key, value)
    if reuse_scores:
        cfg.audit.reuse_scores = True
    if submit:
        _submit(submit, ["audit"], cfg, [], installed_code)
    from clarifier.evaluation.audit import AuditError, run_audit

    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    try:
        summary = run_audit(cfg, progress=_say)
    except (ValueError, FileNotFoundError) as exc:
        err_console.print(f"[red]audit error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    except AuditError as exc:
        err_console.print(f"[red]audit failed:[/red] {escape(str(exc))}")
        raise typer.Exit(1)
    _say(json.dumps({"verdict": summary["verdict"]["decision"], "report": summary["paths"].get("html")}))


@label_app.command("select")
def label_select(logs: str = typer.Option(..., help="Folder, file or s3:// prefix of your chat logs (any format the "
                                          "audit reads: OpenAI transcripts, conversation logs, examples)."),
                 out: str = typer.Option(..., help="Folder or s3:// prefix for queue.jsonl, queue.json and the scored "
                                         "turns."),
                 n: int = typer.Option(100, "--n", help="Turns to queue."),
                 kept_apart: Optional[int] = typer.Option(None, help="Of them, kept apart for the honest estimate "
                                                          "(never fitted on); default a fifth."),
                 model: Optional[str] = typer.Option(None, help="The model whose uncertainty chooses: a folder, "
                                                     "builtin:, models:/, runs:/, s3://; default as the audit's."),
                 labelled: Optional[list[str]] = typer.Option(None, "--labelled", help="JSONL of turns already "
                                                              "labelled or queued (repeatable): never queued again."),
                 seed: int = typer.Option(0, help="The same seed, logs and model give the same queue."),
                 encoder: Optional[str] = typer.Option(None, help="Sentence encoder for the diversity clusters (a "
                                                       "folder or hub id; default the packaged all-MiniLM-L6-v2)."),
                 strategy: str = typer.Option("active", help="How the turns that are not kept apart are chosen: "
                                              "active (near the threshold, spread over topics) or random. Active "
                                              "beat random where few turns need a question and lost where about "
                                              "half do (docs: results/active-vs-random)."),
                 config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Choose the turns of your logs to label next: near the model's threshold, spread over topics (or at random:
    --strategy random), plus a kept-apart slice for an honest estimate. Scores every turn on Ray (audit.actors,
    audit.formats apply)."""
    from clarifier.evaluation.label_queue import QueueError, select_queue
    from clarifier.runtime import storage

    cfg = _cfg(config, overrides)
    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    try:
        summary = select_queue(cfg, logs=logs, out=out, n=n, kept_apart=kept_apart, model_uri=model,
                               labelled=list(labelled or []), seed=seed, encoder=encoder, strategy=strategy,
                               progress=_say)
    except (ValueError, FileNotFoundError) as exc:
        err_console.print(f"[red]label select error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    except QueueError as exc:
        err_console.print(f"[red]label select failed:[/red] {escape(str(exc))}")
        raise typer.Exit(1)
    _say(f"[label] label them in the browser:\n  clarifier label serve --queue {summary['queue']} --out LABELS.jsonl\n"
         "(or add \"needs_clarification\": true or false to each line of the queue), then\n"
         f"  clarifier adapt --model {summary['model_uri']} --data LABELS.jsonl --out ./my-clarifier")


@label_app.command("serve")
def label_serve(queue: Path = typer.Option(..., help="queue.jsonl written by `clarifier label select`."),
                out: Path = typer.Option(..., help="Labels file (JSONL, appended; evaluation-set records that "
                                         "`clarifier adapt --data` reads). Labelling resumes where it stopped."),
                host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: reachable by others)."),
                port: int = typer.Option(8100, help="Port of the page."),
                labeller: Optional[str] = typer.Option(None, help="Your name in each label (default $USER)."),
                take_over: bool = typer.Option(False, "--take-over", help="Open the labels file even though another "
                                               "session's lock is on it (once that session has stopped).")):
    """Label a queue in the browser: the conversation, its passages and the latest message; keys c (needs a
    question), n (clear), s (skip). Every label is on disk before the next turn shows."""
    import uvicorn

    from clarifier.data.label_store import LabelStore, LabelStoreLocked
    from clarifier.serving.label_page import label_app

    try:
        store = LabelStore(queue, out, labeller=labeller or "", take_over=take_over)
    except (ValueError, FileNotFoundError, LabelStoreLocked) as exc:
        err_console.print(f"[red]label serve error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    p = store.progress()
    _say(f"[label] {p['queued']} queued turns, {p['labelled']} labelled and {p['skipped']} skipped already in {out}; "
         f"{p['left']} left")
    _say(f"[label] open http://{'localhost' if host in ('127.0.0.1', '0.0.0.0') else host}:{port}/ (Ctrl+C stops; "
         "nothing acknowledged is lost)")
    try:
        uvicorn.run(label_app(store), host=host, port=port, log_level="warning")
    finally:
        store.close()


@label_app.command("export")
def label_export(queue: Path = typer.Option(..., help="queue.jsonl written by `clarifier label select`."),
                 out: Path = typer.Option(..., help="Label Studio tasks (JSON); label-config.xml is written beside it."),
                 labels: Optional[Path] = typer.Option(None, help="A labels file whose labels become the tasks' "
                                                       "annotations.")):
    """Write a queue as Label Studio tasks (with the model's decision as a pre-annotation) and the labelling
    interface to create the project with."""
    from clarifier.data.label_studio import export_tasks

    try:
        res = export_tasks(queue, out, labels)
    except (ValueError, FileNotFoundError) as exc:
        err_console.print(f"[red]label export error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    _say(f"[label] {res['tasks']} tasks ({res['with_annotations']} with annotations) -> {res['out']}; in Label Studio "
         f"create a project with the labelling interface in {res['label_config']}, import the tasks, label, then "
         f"Export -> JSON and `clarifier label import`")


@label_app.command("import")
def label_import(export: Path = typer.Option(..., "--from", help="Label Studio's JSON export of the project."),
                 queue: Path = typer.Option(..., help="The queue the tasks came from (queue.jsonl)."),
                 out: Path = typer.Option(..., help="Labels file to append to (JSONL; what `clarifier adapt` reads)."),
                 take_over: bool = typer.Option(False, "--take-over", help="Open the labels file even though another "
                                                "session's lock is on it.")):
    """Append Label Studio's annotations to a labels file (each turn once; a cancelled annotation is a skip)."""
    from clarifier.data.label_store import LabelStoreLocked
    from clarifier.data.label_studio import import_annotations

    try:
        res = import_annotations(export, queue, out, take_over=take_over)
    except (ValueError, FileNotFoundError, LabelStoreLocked) as exc:
        err_console.print(f"[red]label import error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    p = res["progress"]
    _say(f"[label] {res['tasks']} tasks: {res['labelled']} labelled, {res['skipped']} skipped, {res['unannotated']} "
         f"without an annotation, {res['already_labelled']} already in {out} (left as they were)"
         + (f", {res['questions_on_clear_turns_ignored']} questions on turns marked Clear ignored"
            if res["questions_on_clear_turns_ignored"] else ""))
    _say(f"[label] {out}: {p['labelled']} labelled ({p['clarify']} need a question), {p['left']} of {p['queued']} left")


@models_app.command("register")
def models_register(run_id: str = typer.Option(..., help="MLflow run holding the 'adapter' artifacts."),
                    name: str = typer.Option("clarifier"), alias: Optional[str] = typer.Option(None)):
    """Register a training run's adapter as a new model version (optionally set an alias)."""
    from clarifier.registry.registry import register_adapter

    mv = register_adapter(run_id, name, alias=alias)
    _say(f"registered {name} version {mv.version}" + (f" with alias {alias}" if alias else ""))


@models_app.command("promote")
def models_promote(name: str = typer.Argument(..., help="Registered model name."),
                   to: str = typer.Option("champion", "--to", help="Alias to move when the gate passes."),
                   from_alias: Optional[str] = typer.Option(None, "--from", help="Alias whose version is the challenger."),
                   version: Optional[str] = typer.Option(None, help="Challenger version (instead of --from)."),
                   data: Optional[str] = typer.Option(None, help="Evaluation set (JSONL or data-job folder) to evaluate "
                                                            "both versions on; default: their logged metrics on a common set."),
                   shadow_log: Optional[str] = typer.Option(
                       None, "--shadow-log", help="Request log (folder or s3:// prefix) of a deployment that ran the "
                                                  "challenger as its shadow model: adds the registry.gate.shadow_* "
                                                  "criteria on live traffic."),
                   config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Promotion gate: move alias --to to the challenger only if every registry.gate criterion holds (audited).

    Exit code 0 when promoted, 1 when the gate refused, 2 on a usage/config error.
    """
    from clarifier.registry.promotion import PromotionError, promote

    cfg = _cfg(config, overrides)
    try:
        d = promote(cfg, name, to_alias=to, from_alias=from_alias, version=version, data=data,
                    shadow_log=shadow_log, progress=_say)
    except PromotionError as exc:
        err_console.print(f"[red]promotion error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    _print_gate(d)
    if d.decision != "promoted":
        raise typer.Exit(1)


def _print_gate(d) -> None:
    from rich.table import Table

    t = Table(title=f"{d.model}: v{d.challenger_version} vs @{d.alias} "
                    + (f"v{d.champion_version}" if d.champion_version else "(none)")
                    + f" on {d.eval_set.get('data')}")
    for col in ("criterion", "value", "limit", "result", "rule"):
        t.add_column(col, overflow="fold")
    for c in d.gate.criteria:
        res = "skipped" if c.skipped else ("pass" if c.passed else "FAIL")
        t.add_row(c.name, _fmt_num(c.value), _fmt_num(c.limit), res, c.rule)
    _print_table(t)
    _say(f"decision: {d.decision}" + ("" if d.decision == "promoted" else f" ({d.gate.summary()})"))


def _print_table(table) -> None:
    """Rich tables at the terminal's width; piped/captured output is not squeezed into 80 columns."""
    out = console if console.is_terminal else Console(highlight=False, width=200, file=console.file)
    out.print(table)


def _fmt_num(v, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


@models_app.command("rollback")
def models_rollback(name: str = typer.Argument(..., help="Registered model name."),
                    alias: str = typer.Option("champion", help="Alias to move back."),
                    reason: Optional[str] = typer.Option(None, help="Why (recorded in the audit log)."),
                    config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Point an alias back at the version it held before (from the audit log); the rollback is audited too."""
    from clarifier.registry.promotion import PromotionError, rollback

    cfg = _cfg(config, overrides)
    try:
        rec = rollback(cfg, name, alias=alias, reason=reason, progress=_say)
    except PromotionError as exc:
        err_console.print(f"[red]rollback error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    _say(f"{name}@{alias} -> version {rec['to_version']} (was {rec['from_version']})")


@models_app.command("list")
def models_list(name: str = typer.Argument("clarifier"),
                config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Versions of a registered model: aliases, key eval metrics, last gate decision."""
    from rich.table import Table

    from clarifier.registry.registry import RegistryError, list_versions
    from clarifier.runtime.mlflow_uri import tracking_uri

    cfg = _cfg(config, overrides)
    try:
        versions = list_versions(name, tracking_uri(cfg.tracking.tracking_uri))
    except RegistryError as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(2)
    t = Table(title=f"{name}")
    for col in ("version", "aliases", "F1", "over-ask", "validity", "eval set", "gate", "run"):
        t.add_column(col, overflow="fold", justify="right" if col in ("F1", "over-ask", "validity") else "left")
    for v in versions:
        gates = ", ".join(f"{k}:{d}" for k, d in v["gates"].items())
        t.add_row(v["version"], ", ".join(v["aliases"]) or "-", _fmt_num(v["f1"], 3), _fmt_num(v["over_asking_rate"], 3),
                  _fmt_num(v["validity"], 3), (v["eval_data"] or "-")[-40:], gates or "-",
                  v.get("run_url") or v["run_id"] or "-")
    _print_table(t)


@models_app.command("diff")
def models_diff(name: str = typer.Argument(..., help="Registered model name."),
                v1: str = typer.Argument(..., help="First version."), v2: str = typer.Argument(..., help="Second version."),
                config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Key metrics of two versions side by side (on their common evaluation set when they have one)."""
    from rich.table import Table

    from clarifier.registry.registry import RegistryError, compare_versions
    from clarifier.runtime.mlflow_uri import tracking_uri

    cfg = _cfg(config, overrides)
    try:
        diff = compare_versions(name, v1, v2, tracking_uri(cfg.tracking.tracking_uri))
    except RegistryError as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(2)
    t = Table(title=f"{name} v{v1} vs v{v2} {diff['where']}")
    for col in ("metric", f"v{v1}", f"v{v2}", "delta"):
        t.add_column(col, justify="left" if col == "metric" else "right", no_wrap=True)
    for k, x, y in diff["metrics"]:
        delta = f"{y - x:+.4f}" if x is not None and y is not None else "-"
        t.add_row(k, _fmt_num(x), _fmt_num(y), delta)
    for label, va, vb in diff["lineage"]:
        t.add_row(label, (va or "-")[:16], (vb or "-")[:16], "" if va == vb else "differs")
    _print_table(t)


@models_app.command("package")
def models_package(model: str = typer.Argument(..., help="Model folder or URI (runs:/..., models:/..., s3://...)."),
                   name: str = typer.Option(..., "--name", help="Built-in name: the model is then builtin:<name>."),
                   result: Optional[Path] = typer.Option(None, help="The recipe benchmark JSON that measured it (for the model card)."),
                   row: str = typer.Option("joint", help="Its row in that result."),
                   out: Optional[Path] = typer.Option(None, help="Folder to write <name>/ into; default: the package's built-in models."),
                   config: Optional[Path] = ConfigOpt):
    """Package a trained LoRA model as a built-in model: bf16 safetensors + tokenizer + MODEL_CARD.md."""
    from clarifier.engine.loading import resolve_model
    from clarifier.engine.models import ModelResolutionError
    from clarifier.recipes.ship import PackageError, package_model
    from clarifier.runtime.mlflow_uri import tracking_uri

    cfg = _cfg(config, [])
    try:
        folder = resolve_model(model, tracking_uri=tracking_uri(cfg.tracking.tracking_uri)).folder
        measured = json.loads(result.read_text()) if result else None
        dst = package_model(folder, name, out_root=out, result=measured, row=row)
    except (PackageError, ModelResolutionError, FileNotFoundError, json.JSONDecodeError) as exc:
        err_console.print(f"[red]package error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    size = sum(p.stat().st_size for p in dst.iterdir()) / 2**20
    _say(f"packaged builtin:{name} -> {dst} ({size:.1f} MB); card: {dst / 'MODEL_CARD.md'}")


@recipe_app.command("list")
def recipe_list():
    """The named recipes and their benchmark plans."""
    from clarifier.recipes import PLANS_DIR, available_recipes, recipe_path

    for name in available_recipes():
        plan = PLANS_DIR / f"{name}.yaml"
        _say(f"{name}: {recipe_path(name)}" + (f"  (benchmark plan: {plan})" if plan.is_file() else ""))


@recipe_app.command("benchmark")
def recipe_benchmark(plan: str = typer.Argument(..., help="Plan name (clarifier/recipes/plans/<name>.yaml) or file."),
                     out: Optional[Path] = typer.Option(None, help="Output path without suffix, a new name (an existing result is never overwritten); default benchmarks/results/recipe-<plan name>."),
                     workdir: Optional[Path] = typer.Option(None, help="Data, checkpoints and the local MLflow store; default .clarifier/recipe-benchmark/<recipe>."),
                     leave_out: Optional[list[str]] = typer.Option(
                         None, "--leave-out", help="Leave out only this source (repeatable), in place of the plan's "
                                                   "leave_one_out.sources; the default output name ends with them."),
                     overrides: Optional[list[str]] = OverridesArg):
    """Train and evaluate every row of the recipe's comparison table (baselines, zero-shot, variants, ablations,
    leave-one-dataset-out) with the platform's own jobs; writes <out>.json and <out>.md."""
    from clarifier.recipes.benchmark import run_benchmark
    from clarifier.recipes.tables import ResultExists

    try:
        run_benchmark(plan, out=out, workdir=workdir, overrides=overrides or [], leave_out=leave_out or [], progress=_say)
    except ConfigError as exc:
        err_console.print(f"[red]config error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    except ResultExists as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)


@tenants_app.command("check")
def tenants_check(file: str = typer.Argument(..., help="Tenants file (a path or s3://)."),
                  resolve: bool = typer.Option(False, "--resolve", help="Also resolve every model (downloads "
                                               "registry and s3 models) and show which tenants share one copy of "
                                               "the weights."),
                  config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Validate a tenants file and show its tenants: model, keys, budget, rate limit (and shared weights)."""
    from rich.table import Table

    from clarifier.core.tenants import TenantsFileError
    from clarifier.serving.admission import RateLimit
    from clarifier.serving.tenants import read_tenants

    try:
        spec, _ = read_tenants(file)
    except TenantsFileError as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(2)
    keys: dict[str, str] = {}
    if resolve:
        from clarifier.engine.inference import weights_key
        from clarifier.engine.loading import resolve_model
        from clarifier.runtime.mlflow_uri import tracking_uri

        cfg = _cfg(config, overrides)
        for t in spec.tenants:
            keys[t.name] = weights_key(resolve_model(t.model_uri, tracking_uri=tracking_uri(cfg.tracking.tracking_uri)).folder)
    t = Table(title=f"{len(spec.tenants)} tenant(s) in {file}" + (f", default {spec.default}" if spec.default else ""))
    for col in ("tenant", "model", "shadow", "keys", "latency budget", "rate limit", *(["weights"] if resolve else [])):
        t.add_column(col, overflow="fold")
    for x in spec.tenants:
        shadow = f"{x.shadow_model_uri} ({x.shadow_share:.0%})" if x.shadow_model_uri else "-"
        t.add_row(x.name, x.model_uri, shadow, str(len(x.keys_sha256)),
                  f"{x.latency_budget_s:g} s" if x.latency_budget_s else "serve's",
                  f"{x.rate_limit_per_s:g}/s (burst {RateLimit(x.rate_limit_per_s, x.rate_burst).burst:g})"
                  if x.rate_limit_per_s else "-", *([keys[x.name]] if resolve else []))
    _print_table(t)
    if resolve:
        _say(f"{len(set(keys.values()))} distinct weights for {len(keys)} tenant(s): tenants with the same weights "
             "share one copy in a replica (serve.max_adapters_per_replica bounds the distinct ones)")


@tenants_app.command("key")
def tenants_key(tenant: str = typer.Argument(..., help="The tenant the new key is scoped to."),
                file: str = typer.Option(..., "--file", "-f", help="Tenants file to add the key's digest to.")):
    """Make an API key scoped to one tenant: its SHA-256 digest goes into the file, the key is printed once."""
    import secrets

    import yaml

    from clarifier.core.tenants import TenantsFileError, add_key_digest, parse_tenants
    from clarifier.runtime import storage
    from clarifier.serving.auth import key_digest

    try:
        data = yaml.safe_load(storage.read_text(file))
        parse_tenants(yaml.safe_dump(data), where=file)
        key = "clk-" + secrets.token_urlsafe(32)
        text = yaml.safe_dump(add_key_digest(data, tenant, key_digest(key)), sort_keys=False)
        parse_tenants(text, where=file)
    except TenantsFileError as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(2)
    storage.write_text(file, text)
    err_console.print(f"added a key for tenant {tenant!r} to {file} (its digest only; comments in the file are not "
                      "kept). The key, shown this once:")
    console.print(key, markup=False, highlight=False, soft_wrap=True)


@app.command()
def serve(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Start the Ray Serve application locally (blocks; Ctrl-C stops it)."""
    from clarifier.runtime.cluster import init_ray
    from clarifier.runtime.services import port_busy
    from clarifier.serving.app import run_local

    cfg = _cfg(config, overrides)
    if port_busy(cfg.serve.host, cfg.serve.port):  # else Serve's proxy retries the bind while /readyz reaches the other one
        raise OSError(errno.EADDRINUSE, f"port {cfg.serve.port} on {cfg.serve.host} is taken by another process "
                                        f"(an earlier `clarifier serve`?): address already in use")
    init_ray()
    url = run_local(cfg.serve, tracking_uri=cfg.tracking.tracking_uri, blocking=True, say=_say)
    _say(f"served at {url}")


# What to do about the errors a new user meets most; the message of the exception says the rest.
HINTS = {
    "TrackingServerUnreachable": "start the MLflow server, or fix tracking.tracking_uri / $MLFLOW_TRACKING_URI",
    "ModelResolutionError": "check the model URI (a folder, models:/name@alias, runs:/<id>/adapter, s3://, builtin:<name>)",
    "ConnectionError": "is the server at that address running and reachable (MLflow tracking URI, S3 endpoint, Ray dashboard)?",
    "MlflowException": "check tracking.tracking_uri / $MLFLOW_TRACKING_URI and that the MLflow server is up",
    "FileNotFoundError": "check the path (relative paths are from the current folder)",
    "PermissionError": "check the permissions of that path",
    "NoSuchBucket": "create the bucket or fix the s3:// URI (and storage.s3_endpoint_url)",
    "OSError": "check the path, the port or the endpoint named above",
}


def _hint(exc: BaseException) -> str:
    text = str(exc)
    if "address already in use" in text.lower():  # an OSError, more precise than OSError's hint
        return "stop the process that holds the port, or pick another (serve.port=<n>; quickstart: --port)"
    if "NoSuchBucket" in text or re.search(r"bucket .{0,80}(does not exist|not found)", text, re.I):
        return HINTS["NoSuchBucket"]
    for cls in type(exc).__mro__:
        if cls.__name__ in HINTS:
            return HINTS[cls.__name__]
    return "rerun with -v for the full logs and traceback"


def _stage(argv: list[str]) -> str:
    from clarifier.runtime.runlog import command_words

    return " ".join(command_words(argv)) or "clarifier"


def report_error(exc: BaseException, argv: list[str], log_path: Optional[Path]) -> None:
    """One clear message for an exception that ended a command: the stage, the cause, what to do, the log."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    cause = lines[-1] if lines else ""
    if len(cause) > 600:
        cause = cause[:600] + "..."
    err_console.print(f"[red]error[/red] in [bold]clarifier {escape(_stage(argv))}[/bold]: "
                      f"{escape(type(exc).__name__)}: {escape(cause)}")
    err_console.print(f"  what to do: {escape(_hint(exc))}" + (f"\n  full log: {log_path}" if log_path else ""))


def main(argv: Optional[list[str]] = None) -> int:  # the `clarifier` executable
    """Run the CLI: Clarifier's own lines on the terminal, other programs' logs in a per-run file."""
    import traceback

    from typer.exceptions import TyperException

    from clarifier.runtime import runlog

    argv = list(sys.argv[1:] if argv is None else argv)
    run = runlog.redirect(runlog.log_path(argv)) if runlog.should_redirect(argv) else runlog.passthrough()
    _say.streams_to_log = run.redirected
    if run.redirected:
        console.file = run.terminal_out
        err_console.file = run.terminal_err
        err_console.print(f"[dim]log: {run.path} (-v shows it here)[/dim]")
    code = 0
    try:
        result = app(args=argv, prog_name="clarifier", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        err_console.print("[yellow]aborted[/yellow]")
        code = 130
    except TyperException as exc:  # usage errors: click's own message, with the usage line
        show = getattr(exc, "show", None)
        show(file=run.terminal_err) if show else err_console.print(escape(str(exc)))
        code = getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted: the services this command started were stopped[/yellow]")
        code = 130
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        traceback.print_exc()  # into the log file when redirected, else on the terminal
        report_error(exc, argv, run.path)
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if run.redirected and run.path.stat().st_size == 0:
            run.path.unlink()  # nothing was logged (clarifier config, --help): no file to keep
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
