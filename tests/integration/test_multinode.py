"""A real two-node Ray cluster on one machine, used exactly as a user uses a remote cluster.

The fixture starts two ``ray start --block`` processes of our own: a head (GCS, dashboard with the
Job Submission API, 2 CPUs, custom resource ``{"head_node": 1}``) and a second node that joins it
(``ray start --address <head>``, 2 CPUs, ``{"node_b": 1}``), each with its own raylet, object
store, temp dir and ports. Both are started in an environment holding the loopback S3 endpoint
(moto) with its credentials and the MLflow server's URI, as a cluster's pods get them from their
ConfigMap and Secrets. The test then submits the data job and the training job with the CLI
(``clarifier data prepare --submit http://<dashboard> ...``, ``clarifier train --submit ...``), so
they travel the documented way (``clarifier.runtime.submit``: a working dir with the resolved config,
this checkout's package as ``py_modules``, non-secret env only); input, output and checkpoint
storage are ``s3://`` prefixes in the moto bucket. (The tiny base model is a local folder, which
both nodes see because they share the host; on separate hosts it would be an ``s3://`` prefix.)

Where the work ran. Both nodes run on the same host, so they are told apart by Ray node id (the
custom resource says which id is which), and the head's State API says which node each of a job's
tasks and actors ran on (``list_tasks`` / ``list_actors`` filtered by the job's Ray job id; Ray
keeps the finished tasks and dead actors of finished jobs, and their events arrive asynchronously,
so the test polls briefly). Both jobs' drivers run on the head (``JobDetails.driver_node_id``).
Training uses ``train.placement_strategy=STRICT_SPREAD`` with 2 workers, so Ray must put the two
``RayTrainWorker`` actors on different nodes; the test checks that the training job's workers are
exactly one on the head and one on node_b (and both ranks' checkpoint shards reach S3). The work after
training (the decision head's states, the calibration scores, the evaluation) runs on a pool of scorer actors
(``eval.engine=ray``) that get the model folder through the object store, not by its path on the driver's node. The data
job's tasks and actors are placed by Ray Data's default ``SPREAD`` strategy; the test checks that
some of them ran on node_b (Ray Data's own bookkeeping actors live on the driver's node, the
head), which held in every run so far but is Ray Data's choice, not something the job forces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NODE_CPUS = 2


@pytest.fixture(scope="module")
def two_node_cluster(s3_server, mlflow_server):
    """Head + second node as separate ``ray start`` processes; yields the dashboard URL and the
    node ids by role ({"head": ..., "node_b": ...})."""
    from ray.util.state import list_nodes

    from support.ray import start_cluster

    with start_cluster(NODE_CPUS, resources=({"head_node": 1}, {"node_b": 1}),
                       node_args=("--object-store-memory=300000000",)) as cluster:
        deadline = time.time() + 180
        nodes: dict[str, str] = {}
        tries = 1
        while len(nodes) < 2:
            if cluster.procs[-1].poll() is not None:
                # `ray start --address` gives up when its raylet has not registered with the GCS within 30 s
                # (seen once on a loaded 2-core box: "The current node timed out during startup"). A pod
                # would be restarted; so is this node, once, with fresh ports and temp dir.
                if tries == 2:
                    raise RuntimeError(f"node_b exited twice; the second time: {cluster.log(-1)}")
                print(f"node_b exited while joining; starting it again: {cluster.log(-1)[-1500:]}")
                cluster.join({"node_b": 1})
                tries += 1
            assert time.time() < deadline, f"node_b did not join: {nodes}"
            time.sleep(2)
            for n in list_nodes(address=cluster.url, detail=True, raise_on_missing_output=False):
                if n.state == "ALIVE":
                    for role in ("head_node", "node_b"):
                        if n.resources_total.get(role):
                            nodes["head" if role == "head_node" else "node_b"] = n.node_id
        yield {"url": cluster.url, "nodes": nodes}


def _submit(cli_args: list[str], timeout: float) -> tuple[dict, str]:
    """``clarifier <cli_args>`` as a user runs it; returns its final status line and all output."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    res = subprocess.run([str(BIN / "clarifier"), *cli_args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    out = res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), out[-5000:]
    last = json.loads(lines[-1])  # {"job_id", "status", "address"}
    assert res.returncode == (0 if last["status"] == "SUCCEEDED" else 1), out[-5000:]
    return last, out


def _ran_on(url: str, ray_job_id: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Node ids of the job's tasks and actors, by task name / actor class: {name: {node_id, ...}}."""
    from ray.util.state import list_actors, list_tasks

    tasks: dict[str, set[str]] = {}
    for t in list_tasks(address=url, filters=[("job_id", "=", ray_job_id)], detail=True, limit=10000,
                        raise_on_missing_output=False):
        if t.node_id:
            tasks.setdefault(t.name, set()).add(t.node_id)
    actors: dict[str, set[str]] = {}
    for a in list_actors(address=url, filters=[("job_id", "=", ray_job_id)], detail=True, limit=10000,
                         raise_on_missing_output=False):
        if a.node_id:
            actors.setdefault(a.class_name, set()).add(a.node_id)
    return tasks, actors


@pytest.mark.timeout(1200)  # ~10 min measured on a loaded 2-core box; the cluster start and stop count too
def test_data_and_training_jobs_run_across_two_nodes(two_node_cluster, s3_server, s3_bucket, mlflow_server,
                                                     tiny_model_dir, monkeypatch):
    import boto3
    from mlflow import MlflowClient
    from ray.job_submission import JobSubmissionClient

    from clarifier.data.synthetic import write_logs
    from support.s3 import keys as s3_keys

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    url, nodes = two_node_cluster["url"], two_node_cluster["nodes"]
    assert set(nodes) == {"head", "node_b"} and nodes["head"] != nodes["node_b"]
    base = f"s3://{s3_bucket}"
    write_logs(f"{base}/logs", 40, seed=3, shards=2)
    experiment = f"multinode-{uuid.uuid4().hex[:8]}"
    common = ["-c", "platform/clarifier/quickstart.yaml", f"storage.root={base}/store", f"data.input={base}/logs",
              f"data.output={base}/data", "data.formats=[jsonl]", f"model.base_model={tiny_model_dir}"]
    client = JobSubmissionClient(url)
    s3 = boto3.client("s3", endpoint_url=s3_server)

    # --- the data job ---------------------------------------------------------------------------
    t0 = time.time()
    last, out = _submit(["data", "prepare", "--submit", url, *common], timeout=400)
    print(f"[multinode] data job {last['status']} in {time.time() - t0:.0f}s")
    assert last["status"] == "SUCCEEDED", out[-5000:]
    keys = s3_keys(s3, s3_bucket, "data/")
    assert "data/manifest.json" in keys, keys
    manifest = json.loads(s3.get_object(Bucket=s3_bucket, Key="data/manifest.json")["Body"].read())
    assert manifest["counts"]["rows_read"] == 40 and all(manifest["invariants"].values())
    for split in ("train", "dev", "test"):
        assert any(k.startswith(f"data/{split}/") and k.endswith(".parquet") for k in keys), (split, keys)
        assert manifest["counts"]["splits"][split]["examples"] > 0
    info = client.get_job_info(last["job_id"])
    assert info.driver_node_id == nodes["head"]  # the job's driver runs on the head
    data_job = info.job_id
    tasks, actors = _wait_ran_on(url, data_job, lambda t, a: nodes["node_b"] in set().union(*t.values(), *a.values()))
    data_nodes = set().union(*tasks.values(), *actors.values())
    print(f"[multinode] data job ran on {sorted(_role(nodes, n) for n in data_nodes)}: "
          f"{ {k: sorted(_role(nodes, n) for n in v) for k, v in {**tasks, **actors}.items()} }")
    assert nodes["node_b"] in data_nodes, (nodes, tasks, actors)

    # --- the training job -------------------------------------------------------------------------
    t0 = time.time()
    # the work after training on the cluster's actors (eval.engine=ray): the decision head's states, the calibration
    # scores and the evaluation, the model folder shipped to them through the object store
    last, out = _submit(["train", "--submit", url, *common, "model.lora.r=4", "model.init_from=null",
                         "train.decision_head.c_grid=[0.01,1.0]", "eval.engine=ray", "eval.ray_actors=2",
                         "eval.max_new_tokens=8",
                         "model.lora.target_modules=[q_proj,v_proj]",
                         "train.num_workers=2", "train.cpus_per_worker=1", "train.placement_strategy=STRICT_SPREAD",
                         "train.micro_batch_size=2", "train.max_steps=4", "train.warmup_steps=1",
                         "train.checkpoint_every=2", "train.max_minutes=null", "train.run_name=multinode",
                         f"train.experiment={experiment}"], timeout=600)
    print(f"[multinode] training job {last['status']} in {time.time() - t0:.0f}s")
    assert last["status"] == "SUCCEEDED", out[-5000:]
    info = client.get_job_info(last["job_id"])
    assert info.driver_node_id == nodes["head"]
    train_job = info.job_id

    def two_workers(t, a):
        return sum(len(v) for k, v in a.items() if "TrainWorker" in k) >= 2 and any("ScorerActor" in k for k in a)

    tasks, actors = _wait_ran_on(url, train_job, two_workers)
    print(f"[multinode] training job's actors: { {k: sorted(_role(nodes, n) for n in v) for k, v in actors.items()} }")
    workers = set().union(*(v for k, v in actors.items() if "TrainWorker" in k))
    assert workers == {nodes["head"], nodes["node_b"]}, (nodes, actors)
    # the pool's actors ran (which node is Ray Data's choice: with this little data the first actor ready does it all)
    assert any("ScorerActor" in k for k in actors), actors
    logs = client.get_job_logs(last["job_id"])
    assert "[head] the model's states are read by 2 Ray actor(s)" in logs and "[eval] ray: " in logs, logs[-5000:]

    # checkpoints under the s3 storage path, written by both ranks
    keys = s3_keys(s3, s3_bucket, "store/ray_results/train-multinode/")
    final = [k for k in keys if "/checkpoint_step00000004/" in k and not k.endswith("/")]
    assert any(k.endswith("adapter_model.safetensors") for k in final), keys
    assert {k.rsplit("/", 1)[1] for k in final if "/rank_state/" in k} == {"rank0.pt", "rank1.pt"}
    state = json.loads(s3.get_object(Bucket=s3_bucket, Key=next(k for k in final if k.endswith("train_state.json")))
                       ["Body"].read())
    assert state["step"] == 4

    # the MLflow run: metrics per step and the adapter artifact
    ml = MlflowClient(mlflow_server)
    runs = ml.search_runs([ml.get_experiment_by_name(experiment).experiment_id],
                          filter_string="tags.`clarifier.run_name` = 'multinode'")
    assert len(runs) == 1 and runs[0].info.run_id == state["mlflow_run_id"]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert [m.step for m in ml.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
    assert run.data.metrics["train/steps"] == 4
    assert run.data.params["train.placement_strategy"] == "STRICT_SPREAD"
    assert {"adapter/adapter_model.safetensors", "adapter/decision_head.safetensors"} <= {
        f.path for f in ml.list_artifacts(run.info.run_id, "adapter")}
    assert run.data.tags["calibration.rule"] == "over_asking<=0.1" and "decision_head/dev_macro_auroc" in run.data.metrics
    # ... and the evaluation every training run ends with: report and plots in the run, eval/ metrics beside train/
    evals = {f.path for f in ml.list_artifacts(run.info.run_id, "eval")}
    assert {"eval/report.md", "eval/report.json", "eval/pr_curve.png"} <= evals, evals
    assert "eval/decision/f1" in run.data.metrics and "eval_baseline/lexical/decision/f1" in run.data.metrics, \
        sorted(run.data.metrics)
    assert run.data.tags["eval.data"].endswith("/data#test")


def _role(nodes: dict[str, str], node_id: str) -> str:
    return next((r for r, n in nodes.items() if n == node_id), node_id)


def _wait_ran_on(url: str, ray_job_id: str, done, timeout_s: float = 60):
    """Task/actor events reach the GCS asynchronously (about once a second): poll briefly."""
    deadline = time.time() + timeout_s
    while True:
        tasks, actors = _ran_on(url, ray_job_id)
        if done(tasks, actors) or time.time() > deadline:
            return tasks, actors
        time.sleep(2)
