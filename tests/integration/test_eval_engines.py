"""Evaluation on the tiny model: the Ray Data engine equals the local one; the report carries the
baselines (lexical included), semantic similarity and the skipped malformed lines."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
RAY_CPUS = 2

BATCH = 3  # small, so the set spans several batches with different padding and a short last one


def _examples(n=10):
    from clarifier.data.synthetic import generate_conversations
    from clarifier.core.schema import ConversationLog

    out = []
    for conv in generate_conversations(40, seed=11):
        for ex in ConversationLog.model_validate(conv).explode():
            if ex.history:
                out.append(ex)
    # a mix of clarify and answer turns, in a fixed order
    pos = [e for e in out if e.needs_clarification][: n // 2]
    neg = [e for e in out if not e.needs_clarification][: n - len(pos)]
    return [e for pair in zip(pos, neg) for e in pair]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir):
    """A LoRA adapter on the tiny model whose threshold is the median P(clarify) of the eval set, so
    about half of the turns take the generation path."""
    from clarifier.engine.inference import ClarifierEngine, ModelMeta, write_meta
    from support.adapters import untrained_adapter

    folder = untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("eval-engines") / "adapter", threshold=0.5, r=2)
    scores = ClarifierEngine.from_folder(folder).score_examples(_examples(), BATCH)
    write_meta(folder, ModelMeta(base_model=str(tiny_model_dir), threshold=statistics.median(scores)))
    return folder


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval-set") / "eval.jsonl"
    lines = [e.model_dump_json() for e in _examples()]
    lines.insert(2, '{"id": "bad", "query": "x", "needs_clarification": "maybe"}')  # line 3: malformed
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(600)
def test_ray_engine_equals_local_engine(adapter, tiny_model_dir, ray_local):
    from clarifier.core.prompt import PromptOptions
    from clarifier.engine.inference import ClarifierEngine, read_meta
    from clarifier.engine.ray_pool import ray_predict

    examples = _examples()
    local_engine = ClarifierEngine.from_folder(adapter, max_new_tokens=8)
    local = local_engine.predict(examples, batch_size=BATCH)
    asked = sum(p.confidence >= local_engine.threshold for p in local)
    assert 0 < asked < len(examples)  # both paths (score only, score + generate) are exercised

    # the same batches (neighbours by rendered length, from the model's prompt options) on the actors
    remote = ray_predict(examples, {"model_uri": str(adapter), "max_new_tokens": 8},
                         opts=read_meta(adapter).prompt_options(), batch_size=BATCH, actors=2, cpus_per_actor=0.5)
    assert remote == local  # every field, every example, in order

    base_local = ClarifierEngine.from_base(str(tiny_model_dir), threshold=0.5).score_examples(examples, BATCH)
    base_remote = ray_predict(examples, {"base_model": str(tiny_model_dir), "threshold": 0.5}, mode="score",
                              opts=PromptOptions(), batch_size=BATCH, actors=1, cpus_per_actor=0.5)
    assert [p.confidence for p in base_remote] == base_local
    assert [p.needs_clarification for p in base_remote] == [s >= 0.5 for s in base_local]


@pytest.mark.timeout(900)
def test_eval_report_local_and_ray_agree_and_carry_baselines_similarity_skips(
        adapter, eval_file, ray_local, tmp_path):
    from clarifier.core.config import build_config
    from clarifier.evaluation.baselines import lexical_predictions
    from clarifier.evaluation.evaluate import evaluate, load_eval_data
    from clarifier.engine.similarity import SentenceEncoder

    base = [f"eval.batch_size={BATCH}", "eval.max_new_tokens=8", "eval.baselines=[always_ask,never_ask,lexical]"]
    msgs: list[str] = []
    local = evaluate(build_config({}, base), str(adapter), str(eval_file), out_dir=str(tmp_path / "local"),
                     progress=msgs.append)
    remote = evaluate(build_config({}, base + ["eval.engine=ray", "eval.ray_actors=2", "eval.ray_cpus_per_actor=0.5"]),
                      str(adapter), str(eval_file), out_dir=str(tmp_path / "ray"), progress=lambda m: None)

    assert set(local["models"]) == {"model", "always_ask", "never_ask", "lexical", "surface_control"}
    # an evaluation set on its own: the surface control is cross-fitted on it, and the report leads with the margin
    assert "out of fold" in local["models"]["surface_control"]["control"]["fitted_on"]
    assert local["skill"]["verdict"] and any("surface control" in m for m in msgs)
    for name in local["models"]:
        assert remote["models"][name]["metrics"] == local["models"][name]["metrics"], name
        assert remote["models"][name]["scores"] == local["models"][name]["scores"], name
    assert (local["engine"], remote["engine"]) == ("local", "ray")
    # the folder reached the actors through the object store, not by its path on this disk: unpacked on the node
    shipped = Path(tempfile.gettempdir()) / "clarifier-shipped"
    assert any(d.is_dir() and (d / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
               for d in shipped.iterdir())

    # the malformed line is reported by number, skipped and counted
    assert local["n"] == 10 and local["skipped_lines"] == 1
    assert local["skipped"][0]["line"] == 3 and "needs_clarification" in local["skipped"][0]["reason"]
    assert any("eval.jsonl:3" in m for m in msgs)
    md = (tmp_path / "local" / "report.md").read_text()
    assert "Malformed evaluation-set lines skipped: 1" in md and "SemSim" in md and "| lexical |" in md

    # semantic similarity: present for every model; the lexical baseline's equals MiniLM on its true positives
    examples = load_eval_data(str(eval_file)).examples
    preds = lexical_predictions(examples)
    tp = [i for i, (e, p) in enumerate(zip(examples, preds)) if e.needs_clarification and p.needs_clarification]
    assert tp
    sims = SentenceEncoder().similarity([examples[i].clarifying_question for i in tp], [preds[i].question for i in tp])
    lex_q = local["models"]["lexical"]["metrics"]["question"]
    assert lex_q["n"] == len(tp)
    assert lex_q["semantic_similarity"] == pytest.approx(float(sims.mean()), abs=1e-6)
    assert 0.0 < lex_q["semantic_similarity"] <= 1.0
    rj = json.loads((tmp_path / "local" / "report.json").read_text())
    for entry in rj["models"].values():
        assert "semantic_similarity" in entry["metrics"]["question"]
    assert rj["data_fingerprint"] == load_eval_data(str(eval_file)).fingerprint


@pytest.mark.timeout(600)
def test_after_training_head_and_threshold_come_from_ray_actors(adapter, ray_local, tmp_path, monkeypatch):
    """eval.engine=ray: the work after training (the decision head's features, the threshold's scores) runs on
    the Ray actors, the model folder shipped to them: the driver (a cluster job's, on a head node without the
    job's GPUs) never loads the model, and gets the head and threshold the model loaded in-process gives."""
    import numpy as np
    from safetensors.numpy import load_file

    import clarifier.data.outputs
    import clarifier.engine.loading
    from clarifier.core.config import build_config
    from clarifier.engine.inference import read_meta
    from clarifier.train import trainer

    splits = {"train": _examples(16), "dev": _examples(10)}
    monkeypatch.setattr(clarifier.data.outputs, "load_split", lambda root, split: splits[split])
    head_opts = ["train.decision_head.enabled=true", "train.decision_head.layers=[0.5,1.0]",
                 "train.decision_head.c_grid=[0.1,1.0]", "train.decision_head.max_per_source=null",
                 f"train.decision_head.batch_size={BATCH}", f"eval.batch_size={BATCH}", "eval.calibration_split=dev"]
    ray_opts = ["eval.engine=ray", "eval.ray_actors=1", "eval.ray_cpus_per_actor=1"]
    folders = {k: shutil.copytree(adapter, tmp_path / k) for k in ("local", "ray", "ray-no-head", "local-no-head")}
    msgs: list[str] = []
    local_head, local_cal = trainer._decision_head_and_threshold(build_config({}, head_opts), folders["local"], print)
    _, local_cal_tokens = trainer._decision_head_and_threshold(
        build_config({}, head_opts + ["train.decision_head.enabled=false"]), folders["local-no-head"], print)

    def no_model_here(*a, **k):
        raise AssertionError("the driver loaded the model")

    monkeypatch.setattr(clarifier.engine.loading, "load_engine", no_model_here)
    head, cal = trainer._decision_head_and_threshold(build_config({}, head_opts + ray_opts), folders["ray"], msgs.append)
    assert any("read by 1 Ray actor(s)" in m for m in msgs), msgs
    assert (head["c"], head["n_train"], head["n_dev"]) == (local_head["c"], 16, 10)
    assert np.allclose(head["dev_scores"], local_head["dev_scores"], atol=1e-5)
    assert cal["threshold"] == pytest.approx(local_cal["threshold"], abs=1e-5)
    w_ray, w_local = (load_file(str(folders[k] / "decision_head.safetensors")) for k in ("ray", "local"))
    assert w_ray.keys() == w_local.keys() and all(np.allclose(w_ray[k], w_local[k], atol=1e-4) for k in w_ray)
    assert read_meta(folders["ray"]).decision_head["n_train"] == 16
    # no head: the calibration split is scored by the actors (decision tokens)
    _, cal_tokens = trainer._decision_head_and_threshold(
        build_config({}, head_opts + ray_opts + ["train.decision_head.enabled=false"]), folders["ray-no-head"], msgs.append)
    assert any("scored by 1 Ray actor(s)" in m for m in msgs), msgs
    assert cal_tokens["threshold"] == pytest.approx(local_cal_tokens["threshold"], abs=1e-5)
    assert read_meta(folders["ray-no-head"]).threshold == pytest.approx(local_cal_tokens["threshold"], abs=1e-5)


@pytest.mark.timeout(600)
def test_adapt_reads_the_states_on_ray_actors(adapter, ray_local, tmp_path, monkeypatch):
    """`clarifier adapt ... eval.engine=ray`: the labelled turns' states come from the actors (a cluster's GPUs for
    many labels), the same adapted model as in-process, and this process never loads the model."""
    import clarifier.engine.loading
    from clarifier.core.config import DecisionHeadConfig
    from clarifier.engine.inference import read_meta
    from clarifier.train.adapt import adapt_head
    from clarifier.train.decision_head import fit_decision_head
    from support.turns import labelled_turns

    headed = shutil.copytree(adapter, tmp_path / "headed")
    fit_decision_head(headed, labelled_turns(24, "t"), labelled_turns(12, "d"),
                      DecisionHeadConfig(layers=[0.5, 1.0], c_grid=[1.0]), precision="fp32", progress=lambda _: None)
    theirs = labelled_turns(30, "u", flip=True)
    local = adapt_head(str(headed), theirs, tmp_path / "local", precision="fp32", progress=lambda _: None)

    def no_model_here(*a, **k):
        raise AssertionError("the driver loaded the model")

    monkeypatch.setattr(clarifier.engine.loading, "load_engine", no_model_here)
    lines: list[str] = []
    remote = adapt_head(str(headed), theirs, tmp_path / "ray", precision="fp32", progress=lines.append,
                        ray_pool={"actors": 1, "cpus_per_actor": 1, "gpus_per_actor": 0})
    assert any("reading its states (on 1 Ray actor(s))" in m for m in lines), lines
    assert remote["kept"] == local["kept"] and remote["before"]["auroc"] == pytest.approx(local["before"]["auroc"])
    for name in ("head", "scratch"):
        assert remote["heads"][name]["c"] == local["heads"][name]["c"]
        assert remote["heads"][name]["cv_auroc"] == pytest.approx(local["heads"][name]["cv_auroc"], abs=1e-6)
    assert remote["threshold"] == pytest.approx(local["threshold"], abs=1e-5)
    assert read_meta(tmp_path / "ray").decision_head["precision"] == "fp32"


@pytest.mark.timeout(300)
def test_compared_models_get_rows_of_their_own(adapter, eval_file, tmp_path):
    """eval.compare (CLI --compare NAME=URI) puts e.g. the pipeline variant in the same report."""
    from clarifier.core.config import build_config
    from clarifier.evaluation.evaluate import evaluate

    cfg = build_config({"eval": {"compare": {"pipeline": str(adapter)}}},
                       [f"eval.batch_size={BATCH}", "eval.max_new_tokens=8", "eval.baselines=[always_ask]",
                        "eval.semantic_encoder=null"])
    rep = evaluate(cfg, str(adapter), str(eval_file), out_dir=str(tmp_path), progress=lambda m: None)
    assert list(rep["models"])[:2] == ["model", "pipeline"]
    assert rep["models"]["pipeline"]["metrics"] == rep["models"]["model"]["metrics"]  # same adapter, same numbers
    assert rep["models"]["pipeline"]["model_uri"] == str(adapter)
    assert "| pipeline |" in (tmp_path / "report.md").read_text()
    with pytest.raises(ValueError, match="taken by a built-in row"):
        evaluate(build_config({"eval": {"compare": {"lexical": str(adapter)}}}), str(adapter), str(eval_file),
                 out_dir=str(tmp_path / "x"), progress=lambda m: None)
