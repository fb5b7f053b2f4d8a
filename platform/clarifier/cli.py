"""The ``clarifier`` command: one subcommand per stage, plus ``quickstart``.

Every stage takes ``--config FILE`` and trailing dotted overrides (``train.max_steps=20``).
Inside ``ray job submit`` (``RAY_ADDRESS`` set) the stages join that cluster.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .config import ConfigError, dump_config, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
data_app = typer.Typer(no_args_is_help=True, help="Data jobs: synthetic logs, preprocessing.")
models_app = typer.Typer(no_args_is_help=True, help="MLflow model registry: register, promote, list.")
app.add_typer(data_app, name="data")
app.add_typer(models_app, name="models")
console = Console(highlight=False, soft_wrap=True)

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML config file (see jobs/configs/).")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. train.max_steps=20 model.lora.r=8")


def _say(msg: str) -> None:
    console.print(msg, markup=False)


def _cfg(config: Optional[Path], overrides: Optional[list[str]]):
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        console.print(f"[red]config error:[/red] {exc}")
        raise typer.Exit(2)


@app.command()
def quickstart(
    workdir: Path = typer.Option(Path(".clarifier/quickstart"), help="Where everything of this run is written."),
    config: Optional[Path] = ConfigOpt,
    port: Optional[int] = typer.Option(None, help="HTTP port for Ray Serve (default from config)."),
    overrides: Optional[list[str]] = OverridesArg,
):
    """Run every stage end to end on the embedded default (local Ray, MLflow, object-store folder, SmolLM2)."""
    from .quickstart import run_quickstart

    try:
        summary = run_quickstart(workdir, config, overrides or [], port=port, progress=_say)
    except ConfigError as exc:
        console.print(f"[red]config error:[/red] {exc}")
        raise typer.Exit(2)
    f1 = summary["decision_f1"]
    if not (f1["model"] > f1.get("base_model", -1) and f1["model"] > f1.get("always_ask", -1)):
        console.print("[yellow]warning: the trained model did not beat the baselines on decision F1[/yellow]")


@app.command("config")
def show_config(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Print the fully resolved config (after overrides) as YAML."""
    print(dump_config(_cfg(config, overrides)))


@data_app.command("synth")
def data_synth(out: str = typer.Option(..., help="Folder or s3:// prefix for JSONL shards."),
               n: int = typer.Option(400, help="Number of conversations."), seed: int = 0, shards: int = 4):
    """Write synthetic multi-turn conversation logs with gold labels."""
    from .data.synthetic import write_logs

    files = write_logs(out, n, seed=seed, shards=shards)
    _say(f"wrote {n} conversations to {len(files)} files under {out}")


@data_app.command("prepare")
def data_prepare(config: Optional[Path] = ConfigOpt,
                 synthetic: bool = typer.Option(False, help="First write data.synthetic_conversations synthetic logs to data.input."),
                 overrides: Optional[list[str]] = OverridesArg):
    """Ray Data job: logs -> validated, split, tokenised Parquet + quarantine + manifest."""
    from . import storage
    from .data.pipeline import prepare
    from .runtime import init_ray

    cfg = _cfg(config, overrides)
    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    if synthetic:
        from .data.synthetic import write_logs

        if not cfg.data.input:
            console.print("[red]--synthetic needs data.input (where to write the logs)[/red]")
            raise typer.Exit(2)
        files = write_logs(cfg.data.input, cfg.data.synthetic_conversations, seed=cfg.data.seed)
        _say(f"[data] wrote {cfg.data.synthetic_conversations} synthetic conversations to {len(files)} files")
    init_ray()
    manifest = prepare(cfg, progress=_say)
    _say(json.dumps(manifest["counts"], indent=2))


@app.command()
def train(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Ray Train job: LoRA fine-tuning on the joint objective with DeepSpeed, tracked in MLflow."""
    from .runtime import init_ray
    from .train.trainer import train as run_train

    cfg = _cfg(config, overrides)
    init_ray()
    res = run_train(cfg, progress=_say)
    _say(json.dumps({"run_id": res.run_id, "model_dir": res.model_dir, "steps": res.steps}))


@app.command("eval")
def eval_cmd(model: str = typer.Option(..., help="models:/name@alias, runs:/<id>/adapter, s3:// prefix or folder."),
             data: Optional[str] = typer.Option(None, help="Data-job output folder or evaluation-set JSONL (default data.output)."),
             run_id: Optional[str] = typer.Option(None, help="Log the report to this MLflow run."),
             out: Optional[Path] = typer.Option(None, help="Folder for report.json / report.md / plots."),
             config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Evaluate a model and the baselines; write JSON, Markdown and plots."""
    from .evaluation.evaluate import evaluate

    cfg = _cfg(config, overrides)
    rep = evaluate(cfg, model, data, run_id=run_id, out_dir=str(out) if out else None, progress=_say)
    _say(f"report: {rep['paths']}")


@models_app.command("register")
def models_register(run_id: str = typer.Option(..., help="MLflow run holding the 'adapter' artifacts."),
                    name: str = typer.Option("clarifier"), alias: Optional[str] = typer.Option(None)):
    """Register a training run's adapter as a new model version (optionally set an alias)."""
    from .registry.registry import register_adapter

    mv = register_adapter(run_id, name, alias=alias)
    _say(f"registered {name} version {mv.version}" + (f" with alias {alias}" if alias else ""))


@models_app.command("promote")
def models_promote(name: str, to: str = typer.Option("champion", "--to"),
                   from_alias: Optional[str] = typer.Option(None, "--from", help="Alias whose version is promoted."),
                   version: Optional[str] = typer.Option(None, help="Version to promote (instead of --from).")):
    """Point alias --to at a version (given directly or via another alias)."""
    from mlflow import MlflowClient

    from .registry.registry import set_alias

    if not (from_alias or version):
        console.print("[red]give --from ALIAS or --version N[/red]")
        raise typer.Exit(2)
    if from_alias:
        version = MlflowClient().get_model_version_by_alias(name, from_alias).version
    set_alias(name, to, version)
    _say(f"{name}@{to} -> version {version}")


@models_app.command("list")
def models_list(name: str = typer.Argument("clarifier")):
    """List versions of a registered model with their aliases."""
    from mlflow import MlflowClient

    client = MlflowClient()
    rm = client.get_registered_model(name)
    aliases: dict[str, list[str]] = {}
    for a, v in (rm.aliases or {}).items():
        aliases.setdefault(str(v), []).append(a)
    for mv in client.search_model_versions(f"name='{name}'"):
        _say(f"{name} v{mv.version}  aliases={aliases.get(str(mv.version), [])}  run={mv.run_id}  source={mv.source}")


@app.command()
def serve(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Start the Ray Serve application locally (blocks; Ctrl-C stops it)."""
    from .runtime import init_ray
    from .serving.app import run_local

    cfg = _cfg(config, overrides)
    init_ray()
    url = run_local(cfg.serve, tracking_uri=cfg.tracking.tracking_uri, blocking=True)
    _say(f"served at {url}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
