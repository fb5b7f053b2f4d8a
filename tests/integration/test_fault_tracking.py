"""Fault: the MLflow tracking server stops in the middle of a training run, then comes back.

The test runs its own ``mlflow server`` (sqlite backend, fixed port) and training on Ray Train
(1 worker, tiny model). Once a few steps are in MLflow it stops the server process, keeps it down
while training goes on for several steps (seen by the checkpoints on disk), then restarts it on the
same port with the same backend store. Must hold: training never waits on the dead server and
finishes every step; the one MLflow run then has every step's metrics (the worker buffered them and
sent them when the server returned), or lacks exactly the steps reported lost
(``TrainResult.tracking``, the ``tracking/lost_steps`` metric, the job's output).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

# Steps take ~0.1 s and checkpoints (every 2 steps) ~2 s here; restarting `mlflow server` takes
# 10-45 s on a busy 2-core box, so the outage lasts OUTAGE_STEPS steps plus the restart. From step
# HOLD_FROM on the worker waits until the test says the server is back (``support.faults.HoldFrom``),
# so that training always has steps left to log to the restarted server, however slow the restart.
MAX_STEPS = 30
HOLD_FROM = MAX_STEPS - 2
OUTAGE_STEPS = 6  # steps trained with the server down before it is restarted (at least)


def _wait(what: str, cond, timeout_s: float, every_s: float = 0.25):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture
def own_mlflow(tmp_path):
    """An ``mlflow server`` of this test's own that it can stop and restart on the same port and store."""
    from clarifier.runtime.services import free_port, start_mlflow_server

    root, port = tmp_path / "mlflow", free_port()
    state = {"server": start_mlflow_server(root, port=port)}

    def stop():
        state["server"].stop()

    def start():
        state["server"] = start_mlflow_server(root, port=port)

    yield {"url": state["server"].url, "stop": stop, "start": start}
    state["server"].stop()


@pytest.fixture
def mlflow_globals(monkeypatch):
    """The trainer points the mlflow module at this test's server; give later tests theirs back."""
    import mlflow
    from mlflow.tracking import fluent

    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID"):  # monkeypatch puts today's values back after the test
        if k in os.environ:
            monkeypatch.setenv(k, os.environ[k])
        else:
            monkeypatch.delenv(k, raising=False)
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    exp = fluent._active_experiment_id
    yield
    mlflow.set_tracking_uri(uri)
    fluent._active_experiment_id = exp


@pytest.mark.timeout(900)
def test_tracking_outage_mid_training_loses_no_metrics(own_mlflow, mlflow_globals, ray_own, tiny_model_dir, tmp_path,
                                                       reliability):
    from mlflow import MlflowClient

    from clarifier.core.config import build_config
    from clarifier.data.pipeline import prepare
    from clarifier.data.synthetic import write_logs
    from clarifier.train.tracking import parse_step_ranges
    from clarifier.train.trainer import train
    from support.config import tiny_lora
    from support.faults import HoldFrom

    write_logs(str(tmp_path / "logs"), 40, seed=5, shards=1)
    cfg = build_config({}, [
        f"storage.root={tmp_path / 'store'}", f"data.input={tmp_path / 'logs'}", f"data.output={tmp_path / 'data'}",
        "data.formats=[jsonl]", *tiny_lora(tiny_model_dir), "train.num_workers=1", "train.micro_batch_size=2",
        f"train.max_steps={MAX_STEPS}", "train.checkpoint_every=2", "train.warmup_steps=2",
        "train.run_name=outage", "train.experiment=tracking-outage", "eval.calibration_split=null",
        f"tracking.tracking_uri={own_mlflow['url']}"])
    prepare(cfg, progress=lambda m: None)

    msgs: list[str] = []
    box: dict = {}

    restarted = tmp_path / "server-restarted"

    def run():
        try:
            box["res"] = train(cfg, progress=lambda m: (msgs.append(m), print(m)),
                               callbacks=[HoldFrom(HOLD_FROM, str(restarted))])
        except BaseException as exc:  # surfaced by the main thread
            box["err"] = exc

    ckpt_root = Path(cfg.storage.root) / "ray_results" / "train-outage"

    def last_checkpoint() -> int:
        steps = [int(p.name.removeprefix("checkpoint_step")) for p in ckpt_root.glob("checkpoint_step*")]
        return max(steps, default=0)

    client = MlflowClient(tracking_uri=own_mlflow["url"])

    def losses(run_id):
        return client.get_metric_history(run_id, "train/loss")

    th = threading.Thread(target=run, name="train", daemon=True)
    th.start()
    exp = _wait("the experiment", lambda: client.get_experiment_by_name("tracking-outage"), 300)
    run_id = _wait("the MLflow run", lambda: [r.info.run_id for r in client.search_runs([exp.experiment_id])], 300)[0]
    _wait("3 logged steps", lambda: len(losses(run_id)) >= 3 or box, 600)
    assert not box, f"training ended before the outage: {box}"
    before = max(m.step for m in losses(run_id))

    own_mlflow["stop"]()  # SIGTERM, then waits until the process has exited
    t_down = time.time()
    down_at = last_checkpoint()
    _wait(f"{OUTAGE_STEPS} steps trained with the server down",
          lambda: last_checkpoint() >= down_at + OUTAGE_STEPS or not th.is_alive(), 600)
    assert th.is_alive(), f"training ended during the outage (raise MAX_STEPS): {box}"
    during = last_checkpoint()
    t_restart = time.time()
    own_mlflow["start"]()
    t_up = time.time()
    assert last_checkpoint() < MAX_STEPS, f"training ended before the server was back: {box}"
    restarted.touch()  # the worker may go on past HOLD_FROM
    # The buffered steps arrive once the worker's tracker reaches the server again.
    _wait("the steps logged during the outage", lambda: {m.step for m in losses(run_id)} >= set(range(1, during + 1)),
          120, every_s=0.2)
    t_flushed = time.time()
    th.join(timeout=600)
    assert not th.is_alive(), "training did not finish"
    if "err" in box:
        raise box["err"]
    res = box["res"]
    assert res.steps == MAX_STEPS and res.run_id == run_id

    # One run; every step once, except exactly the steps reported lost (none, for a short outage).
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    lost = parse_step_ranges(res.tracking["lost_step_ranges"])
    assert len(lost) == res.tracking["lost_steps"]
    hist = sorted(losses(run_id), key=lambda m: m.step)
    for key in ("train/loss", "train/lr", "train/tokens_per_s"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert sorted(steps) == sorted(set(range(1, MAX_STEPS + 1)) - lost), key  # no gap, no duplicate
    assert lost == set(), f"a {t_up - t_down:.0f}s outage lost steps {res.tracking['lost_step_ranges']}"
    assert res.tracking["failed_calls"] >= 1  # the worker did see the outage
    metrics = client.get_run(run_id).data.metrics
    assert metrics["tracking/lost_steps"] == 0 and metrics["tracking/failed_calls"] == res.tracking["failed_calls"]
    assert any(m.startswith("[train] MLflow tracking outage:") and "every step's metrics were buffered" in m
               for m in msgs)

    # Training never waited on the dead server: no step during the outage took long (MLflow's
    # default client retries a refused request for ~4 minutes, so a synchronous logger would).
    # Steps take ~0.1 s and checkpoints ~2 s; 60 s leaves room for a loaded 2-core box and is
    # still far below those 4 minutes.
    outage = {m.step for m in hist if t_down * 1000 <= m.timestamp <= t_up * 1000}
    at_risk = len(outage)
    assert at_risk >= OUTAGE_STEPS - 2, (at_risk, before, down_at, during)
    gaps = [(b.timestamp - a.timestamp) / 1000 for a, b in zip(hist, hist[1:]) if b.step in outage]
    assert max(gaps) < 60, gaps
    keys = len({k for k in client.get_run(run_id).data.metrics if k.startswith("train/")} - {"train/steps",
                                                                                            "train/seconds"})
    reliability(fault="MLflow tracking server stopped mid-training",
                injected=f"`mlflow server` process stopped after step {before} of {MAX_STEPS}, restarted on the same "
                         f"port and store: down {t_up - t_down:.0f} s (of which {t_up - t_restart:.0f} s restarting), "
                         f"1 worker, tiny model",
                at_risk=f"{at_risk} metric steps ({at_risk * keys} values) logged while it was down",
                lost=f"{len(lost)} metric steps", recovered=f"{at_risk - len(lost)} metric steps (buffered, then sent)",
                time_to_recover_s=round(t_flushed - t_up, 2))
