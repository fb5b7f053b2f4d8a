"""``clarifier quickstart``: every stage, end to end, on the embedded default.

local Ray + a sqlite-backed ``mlflow server`` on loopback + a local object-store folder + the real
SmolLM2-135M-Instruct: synthetic logs -> Ray Data job -> Ray Train (DeepSpeed ZeRO-2, LoRA) ->
evaluation with baselines -> MLflow registry (alias ``champion``) -> Ray Serve endpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from clarifier.core.config import ClarifierConfig, load_config
from clarifier.runtime.services import free_port, mlflow_env, port_busy, start_mlflow_server

DEFAULT_CONFIG = Path(__file__).resolve().with_name("quickstart.yaml")  # package data: works from a wheel too

# The logs the quickstart writes: data.synthetic_conversations conversations of each generator, seed data.seed
# (the quickstart's 7; the built-in clarifier it continues was trained on seed 0 of both).
LOG_GENERATORS = {"synthetic": "ambiguity from earlier turns", "synthetic_rag": "ambiguity in the retrieved passages"}

N_EXAMPLE_REQUESTS = 4  # sent to the endpoint at the end: held-out test turns, half needing clarification


def run_quickstart(workdir: str | Path = ".clarifier/quickstart", config: str | Path | None = None,
                   overrides: list[str] | tuple[str, ...] = (), port: int | None = None, progress=print) -> dict:
    t_all = time.time()
    workdir = Path(workdir).expanduser().resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "object-store"
    base = [f"storage.root={workdir}", f"data.input={store / 'logs'}", f"data.output={store / 'data'}"]
    cfg = load_config(config or DEFAULT_CONFIG, [*base, *overrides])
    if port:
        cfg.serve.port = port
    elif port_busy(cfg.serve.host, cfg.serve.port):
        busy, cfg.serve.port = cfg.serve.port, free_port()
        progress(f"port {busy} is in use; Ray Serve will listen on {cfg.serve.port} instead")

    def stage(n, title):
        progress(f"\n== [{n}/7] {title}  (+{time.time() - t_all:.0f}s)")

    for k, v in mlflow_env().items():
        os.environ.setdefault(k, v)
    stage(1, "local services: MLflow tracking server (sqlite) and Ray")
    server = start_mlflow_server(workdir / "mlflow")
    os.environ["MLFLOW_TRACKING_URI"] = server.url
    cfg.tracking.tracking_uri = server.url
    progress(f"MLflow: {server.url}  (UI: open it in a browser; log {server.log_path})")
    try:
        from clarifier.runtime.cluster import init_ray, local_instance

        ray = init_ray()
        dash = getattr(getattr(ray._private.worker.global_worker, "node", None), "webui_url", None)
        cpus, cores = ray.cluster_resources().get("CPU", 0), os.cpu_count() or 0
        # A local instance declares two logical CPUs more than the cores (runtime.cluster.local_cpus).
        progress(f"Ray: {cpus:.0f} logical CPUs" + (f" on {cores} cores" if local_instance() and cores and cores != cpus else "")
                 + (f"  (dashboard: http://{dash})" if dash else ""))
        return _pipeline(cfg, store, workdir, stage, progress, t_all)
    finally:
        _shutdown(progress)
        server.stop()


def _pipeline(cfg: ClarifierConfig, store: Path, workdir: Path, stage, progress, t_all) -> dict:
    from clarifier.runtime import storage
    from clarifier.data.pipeline import prepare
    from clarifier.core.config import SourceConfig
    from clarifier.data.sources import generate_source
    from clarifier.evaluation.evaluate import evaluate
    from clarifier.registry.registry import register_adapter
    from clarifier.train.trainer import train

    stage(2, f"synthetic conversation logs ({' + '.join(LOG_GENERATORS)}) -> {cfg.data.input}")
    storage.delete_dir(cfg.data.input)
    for name in LOG_GENERATORS:  # each under <data.input>/<name>/; the conversations carry meta.source=<name>
        wrote = generate_source(SourceConfig(importer=name), cfg.data)
        progress(f"{name}: {wrote['conversations']} conversations in {len(wrote['files'])} JSONL shards ({LOG_GENERATORS[name]})")

    stage(3, "Ray Data: logs -> validated, split, tokenised training examples (Parquet)")
    prepare(cfg, progress=progress)  # its last line gives the counts per split

    start = f", continuing {cfg.model.init_from}" if cfg.model.init_from else ""
    stage(4, f"Ray Train: {'LoRA' if cfg.model.finetune == 'lora' else 'full'} fine-tuning of {cfg.model.base_model}{start} "
             f"with DeepSpeed ZeRO-{cfg.train.zero_stage}")
    tr = train(cfg, progress=progress)

    import shutil

    kept = workdir / "model"  # a plain model folder: `clarifier audit` defaults to it
    shutil.rmtree(kept, ignore_errors=True)
    shutil.move(tr.model_dir, kept)  # the same files are the MLflow run's `adapter` artifact
    with contextlib.suppress(OSError):
        Path(tr.model_dir).parent.rmdir()  # models/, empty now

    stage(5, "evaluation on the held-out test split (model vs the rules, always-ask and the untrained base)")
    report = evaluate(cfg, str(kept), run_id=tr.run_id, out_dir=str(workdir / "eval"), progress=progress, table=False)

    stage(6, f"MLflow registry: register and set alias {cfg.registry.alias!r}")
    m = report["models"]["model"]["metrics"]
    tags = {"clarifier.run_id": tr.run_id, "clarifier.base_model": cfg.model.base_model,
            "clarifier.data": cfg.data.output, "eval.f1": m["decision"]["f1"],
            "eval.over_asking_rate": m["decision"]["over_asking_rate"]}
    mv = register_adapter(tr.run_id, cfg.registry.model_name, alias=cfg.registry.alias, tags=tags)
    uri = f"models:/{cfg.registry.model_name}@{cfg.registry.alias}"
    progress(f"registered {cfg.registry.model_name} version {mv.version}; {uri} -> v{mv.version}")

    stage(7, f"Ray Serve: deploy {uri} and send example requests")
    answers = _serve_examples(cfg, uri, progress)

    metrics = {name: v["metrics"] for name, v in report["models"].items()}
    summary = {
        "seconds": round(time.time() - t_all, 1),
        "mlflow_run_id": tr.run_id,
        "model_dir": str(kept),
        "model_version": mv.version,
        "train_steps": tr.steps,
        "n_test": report["n"],
        "decision_f1": {name: m["decision"]["f1"] for name, m in metrics.items()},
        "over_asking_rate": {name: m["decision"]["over_asking_rate"] for name, m in metrics.items()},
        "recall": {name: m["decision"]["recall"] for name, m in metrics.items()},
        "within_source_auroc": {name: {s: d["auroc"] for s, d in m["within_source"]["by_source"].items()}
                                for name, m in metrics.items() if m.get("within_source")},
        "at_baseline_over_asking": _at_baseline_over_asking(report, baselines=("lexical",)),
        "skill": {k: report["skill"][k] for k in ("verdict", "beats_control", "headline", "mixed", "within_source")
                  if k in report["skill"]},
        "report": report.get("paths", {}),
        "served": answers,
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    progress(f"\n== Final report: the decision to ask, on the held-out test split ({summary['n_test']} turns; every "
             f"column and the plots: {report['paths']['markdown']})")
    for line in result_lines(summary):
        progress(line)
    progress(f"done in {summary['seconds']:.0f}s; summary: {workdir / 'summary.json'}")
    return summary


def result_lines(summary: dict) -> list[str]:
    """The final report's rows, one per model and baseline (the README shows a recorded run's through these)."""
    lines = []
    for name, f1 in summary["decision_f1"].items():
        if name == "never_ask":  # F1 0 by definition
            continue
        auroc = summary["within_source_auroc"].get(name, {})
        per = ", ".join(f"{s} {a:.2f}" for s, a in auroc.items() if a is not None)
        lines.append(f"  {name:<12} F1 {f1:.3f}   recall {summary['recall'][name]:.3f}   over-asking "
                     f"{summary['over_asking_rate'][name]:.3f}" + (f"   AUROC {per}" if per and name != "always_ask" else ""))
    return lines


def _at_baseline_over_asking(report: dict, baselines: tuple[str, ...]) -> dict:
    """For each baseline: the recall the model's scores reach when they may over-ask as often as the baseline
    did (the threshold is picked on the test split itself: a comparison of rankings at equal cost, beside
    the F1 of each at its own operating point). ``report`` is what ``evaluate`` returns (per-example scores
    included)."""
    from clarifier.core.metrics import recall_at_over_asking

    model = report["models"].get("model", {})
    if "scores" not in model:
        return {}
    out = {}
    for b in baselines:
        if b not in report["models"]:
            continue
        d = report["models"][b]["metrics"]["decision"]
        r = recall_at_over_asking(model["gold"], model["scores"], d["over_asking_rate"])
        if r is not None:
            out[b] = {"over_asking": d["over_asking_rate"], "baseline_recall": d["recall"], "model_recall": r}
    return out


def example_requests(cfg: ClarifierConfig, n: int = N_EXAMPLE_REQUESTS) -> list[tuple[dict, bool]]:
    """``(request body, gold decision)`` pairs from the held-out test split: the first n/2 turns
    that need clarification and the first n/2 that do not (chosen by label, not by prediction)."""
    from clarifier.data.outputs import load_split

    test = load_split(cfg.data.output, cfg.eval.split)
    picked = [e for e in test if e.needs_clarification][: n // 2] + [e for e in test if not e.needs_clarification][: n - n // 2]
    return [({"history": [t.model_dump() for t in e.history], "query": e.query,
              "passages": [p.model_dump() for p in e.passages]}, e.needs_clarification) for e in picked]


def _serve_examples(cfg: ClarifierConfig, uri: str, progress) -> list[dict]:
    from clarifier.client import ClarifierClient
    from clarifier.serving.app import run_local
    from clarifier.serving.auth import load_api_keys

    serve_cfg = cfg.serve.model_copy(update={"model_uri": uri})
    url = run_local(serve_cfg, tracking_uri=cfg.tracking.tracking_uri)
    progress(f"serving at {url}/v1/clarify; held-out test turns (full requests and answers in summary.json):")
    keys = load_api_keys(serve_cfg.api_keys_file)  # when the service has keys, use one of them
    client = ClarifierClient(url, api_key=keys[0] if keys else None, timeout=120)
    answers = []
    for req, gold in example_requests(cfg):
        resp = client.clarify(req["history"], req["query"], req["passages"])
        progress("  " + _one_line(req, resp, gold))
        answers.append({"request": req, "gold_needs_clarification": gold, "response": resp.model_dump()})
    return answers


def _one_line(req: dict, resp, gold: bool) -> str:
    """One console line per example request: the query, the decision with its confidence against the
    threshold, the question asked (if any) and the gold decision."""
    q = req["query"] if len(req["query"]) <= 60 else req["query"][:57] + "..."
    thr = f" vs threshold {resp.threshold:.2f}" if resp.threshold is not None else ""
    said = f"clarify: {resp.question!r}" if resp.needs_clarification else "answer (no question)"
    return f"{q!r} -> {said}  [confidence {resp.confidence:.2f}{thr}; gold {'clarify' if gold else 'answer'}]"


def _shutdown(progress) -> None:
    try:
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                serve.shutdown()
            except Exception:
                pass
            ray.shutdown()
            progress("shut down Ray Serve and Ray")
    except ImportError:
        pass
