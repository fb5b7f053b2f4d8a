"""Recipes without Ray: data.sources (import, cap, ownership), recall at an over-asking budget,
error-analysis categories, the benchmark plan, the evaluation sample and the report tables."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from clarifier.core.config import ConfigError, build_config
from clarifier.core.schema import source_of
from clarifier.data.sources import OWNER_FILE, cap_by_conversation, materialize_sources
from clarifier.evaluation.error_analysis import ASKS_CLEAR, FORMAT, MISSED, OK, VAGUE, WRONG_ASPECT, analyse, decision_error, question_category
from clarifier.core.metrics import Prediction, recall_at_over_asking
from clarifier.core.schema import Example, Turn
from support.paths import PUBLIC


def ex(i, conv, clarify=False, q=None, query="how do I reset it?", history=()):
    return Example(id=f"{conv}:{i}", history=[Turn(role="user", text=t) for t in history], query=query,
                   needs_clarification=clarify, clarifying_question=q, meta={"conversation_id": conv})


# ---- data.sources -----------------------------------------------------------------------------


def test_cap_keeps_whole_conversations_within_the_cap_deterministically():
    examples = [ex(i, f"c{i // 3}") for i in range(30)]  # 10 conversations of 3
    kept, dropped = cap_by_conversation(examples, 10, seed=0)
    assert len(kept) == 9 and len(dropped) == 21  # 3 whole conversations; a 4th would overshoot
    convs = {e.conversation_id for e in kept}
    assert all(sum(e.conversation_id == c for e in kept) == 3 for c in convs)
    assert kept == cap_by_conversation(examples, 10, seed=0)[0]
    assert {e.id for e in kept} != {e.id for e in cap_by_conversation(examples, 10, seed=1)[0]}
    assert cap_by_conversation(examples, None, 0) == (examples, [])


def test_cap_order_is_independent_of_the_split_hash():
    """Ordering by the split hash itself would keep only the first split's conversations."""
    from clarifier.data.split import assign_split

    examples = [ex(0, f"conv-{i}") for i in range(400)]
    kept, _ = cap_by_conversation(examples, 100, seed=0)
    splits = [assign_split(e.conversation_id, 0, {"train": 0.7, "dev": 0.1, "test": 0.2}) for e in kept]
    assert 50 < splits.count("train") < 90 and splits.count("test") > 8


@pytest.mark.skipif(not (PUBLIC / "clariq").is_dir(), reason="needs ../shared/data/public (not part of a user's clone)")
def test_materialize_imports_caps_and_owns_the_input_folder(tmp_path):
    cfg = build_config({"data": {"input": str(tmp_path / "in"), "sources": [
        {"importer": "clariq", "src": str(PUBLIC / "clariq"), "max_examples": 40},
        {"importer": "synthetic", "name": "syn", "options": {"conversations": 5}}]}})
    msgs = []
    rep = materialize_sources(cfg.data, msgs.append)
    c = rep["clariq"]
    assert c["imported"] == 237 and c["kept"] == 40 and c["dropped_by_cap"] == 197 and c["skipped"] == 0
    lines = (tmp_path / "in" / "clariq.jsonl").read_text().splitlines()
    assert len(lines) == 40 and all(json.loads(x)["meta"]["source"] == "clariq" for x in lines)
    assert rep["syn"]["conversations"] == 5 and list((tmp_path / "in" / "syn").glob("*.jsonl"))
    assert json.loads((tmp_path / "in" / OWNER_FILE).read_text())["clariq"]["kept"] == 40
    assert any("197 over max_examples=40" in m for m in msgs)
    # rerun with one source less: the folder is rewritten, no stale file is left to be read
    cfg2 = build_config({"data": {"input": str(tmp_path / "in"), "sources": [{"importer": "synthetic", "options": {"conversations": 3}}]}})
    materialize_sources(cfg2.data, lambda m: None)
    assert not (tmp_path / "in" / "clariq.jsonl").exists()


def test_materialize_refuses_a_folder_it_does_not_own_and_names_bad_sources(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "mine.jsonl").write_text("{}\n")
    cfg = build_config({"data": {"input": str(tmp_path / "logs"), "sources": [{"importer": "synthetic"}]}})
    with pytest.raises(ValueError, match="did not write"):
        materialize_sources(cfg.data, lambda m: None)
    assert (tmp_path / "logs" / "mine.jsonl").exists()
    bad = build_config({"data": {"input": str(tmp_path / "new"), "sources": [{"importer": "pacific", "src": str(tmp_path / "nope")}]}})
    with pytest.raises(FileNotFoundError, match=r"data.sources\[pacific\]: src .* does not exist"):
        materialize_sources(bad.data, lambda m: None)
    unknown = build_config({"data": {"input": str(tmp_path / "new2"), "sources": [{"importer": "nosuch", "src": "x"}]}})
    with pytest.raises(KeyError, match=r"data.sources\[nosuch\]: no importer named 'nosuch'.*generators: synthetic, synthetic_rag"):
        materialize_sources(unknown.data, lambda m: None)
    with pytest.raises(ConfigError, match="source names must be unique"):
        build_config({"data": {"sources": [{"importer": "synthetic"}, {"importer": "synthetic"}]}})


def test_generator_sources_write_conversation_logs_and_check_their_options(tmp_path):
    from clarifier.data.synthetic_rag import generate_conversations

    cfg = build_config({"data": {"input": str(tmp_path / "in"), "seed": 4, "sources": [
        {"importer": "synthetic_rag", "options": {"conversations": 6, "seed": 2}},
        {"importer": "synthetic_rag", "name": "rag_default_seed", "options": {"conversations": 3}}]}})
    msgs = []
    rep = materialize_sources(cfg.data, msgs.append)
    assert rep["synthetic_rag"]["conversations"] == 6 and rep["synthetic_rag"]["seed"] == 2
    assert rep["rag_default_seed"]["seed"] == 4  # data.seed
    lines = [json.loads(x) for f in sorted((tmp_path / "in" / "synthetic_rag").glob("*.jsonl")) for x in f.read_text().splitlines()]
    assert sorted(c["conversation_id"] for c in lines) == sorted(c["conversation_id"] for c in generate_conversations(6, 2))
    assert any("6 synthetic_rag conversations" in m for m in msgs)
    long = build_config({"data": {"input": str(tmp_path / "long"), "sources": [
        {"importer": "synthetic_rag", "options": {"conversations": 5, "seed": 1, "long_history_share": 1.0}}]}})
    rep = materialize_sources(long.data, lambda m: None)
    assert rep["synthetic_rag"]["long_history_share"] == 1.0
    logs = [json.loads(x) for f in sorted((tmp_path / "long" / "synthetic_rag").glob("*.jsonl")) for x in f.read_text().splitlines()]
    assert len(logs) == 5 and all(c["meta"]["long_history"] for c in logs)
    for bad, match in [({"options": {"conversations": 2, "shards": 3}}, r"unknown synthetic_rag options \['shards'\]"),
                       ({"options": {"conversations": 2, "long_history_share": 2}}, r"synthetic_rag\]: long_history_share"),
                       ({"max_examples": 5}, "take options.conversations, not max_examples")]:
        cfg = build_config({"data": {"input": str(tmp_path / "other"), "sources": [{"importer": "synthetic_rag", **bad}]}})
        with pytest.raises(ValueError, match=match):
            materialize_sources(cfg.data, lambda m: None)
    cfg = build_config({"data": {"input": str(tmp_path / "syn"), "sources": [
        {"importer": "synthetic", "options": {"conversations": 2, "long_history_share": 0.5}}]}})
    with pytest.raises(ValueError, match=r"unknown synthetic options \['long_history_share'\] \(known: conversations, seed\)"):
        materialize_sources(cfg.data, lambda m: None)


def test_source_of():
    assert source_of(Example(id="a", query="q", needs_clarification=False, meta={"source": "s", "dataset": "d"})) == "s"
    assert source_of(Example(id="a", query="q", needs_clarification=False, meta={"dataset": "d"})) == "d"


# ---- metrics and error analysis -------------------------------------------------------------------


def test_recall_at_over_asking_budget():
    gold = [True] * 3 + [False] * 19
    scores = [0.9, 0.8, 0.1, 0.85] + [0.0] * 18
    assert recall_at_over_asking(gold, scores, 0.05) == pytest.approx(1 / 3)  # 0.85 is 1/19 = 5.3% over-asking
    assert recall_at_over_asking(gold, scores, 0.10) == 1.0
    assert recall_at_over_asking([True, True], [0.5, 0.6], 0.1) is None
    assert recall_at_over_asking([True, False], [0.1, 0.9], 0.0) == 0.0


def test_decision_and_question_categories():
    p = lambda ask, valid=True, q=None: Prediction(needs_clarification=ask, confidence=0.5, question=q, valid=valid)  # noqa: E731
    assert decision_error(False, p(True)) == ASKS_CLEAR
    assert decision_error(True, p(False)) == MISSED
    assert decision_error(True, p(False, valid=False)) == FORMAT
    assert decision_error(False, p(False, valid=False)) is None  # served as "answer": right on a clear turn
    assert decision_error(True, p(True)) is None
    e = ex(0, "c", True, q="Do you mean the printer or the laptop?", history=["my printer and my laptop broke"])
    assert question_category(e, p(True, q="Which device: the printer or the laptop?")) == OK
    assert question_category(e, p(True, q="What do you mean?")) == VAGUE
    assert question_category(e, p(True, q="Could you clarify the invoice currency conversion?")) == WRONG_ASPECT
    assert question_category(e, p(True, q="Printer or laptop?"), similarity=0.2) == WRONG_ASPECT
    assert question_category(e, p(False, valid=False)) == FORMAT


def test_analyse_counts_every_error_and_samples_a_few():
    examples = [ex(i, f"c{i}", clarify=i % 2 == 0, q="printer or laptop?") for i in range(40)]
    preds = [Prediction(needs_clarification=i % 3 == 0, confidence=0.5, question="printer or laptop?" if i % 3 == 0 else None)
             for i in range(40)]
    a = analyse(examples, preds, n_decisions=5, n_questions=4, seed=1)
    wrong = sum(1 for e, q in zip(examples, preds) if e.needs_clarification != q.needs_clarification)
    assert a["decision_errors"] == wrong == sum(a["decision_categories"].values())
    assert len(a["decision_samples"]) == 5 and len(a["question_samples"]) == 4
    assert a == analyse(examples, preds, n_decisions=5, n_questions=4, seed=1)
    with pytest.raises(ValueError):
        analyse(examples, preds[:-1])


# ---- plan, sample, tables, CLI ---------------------------------------------------------------


def test_every_shipped_recipe_and_plan_loads():
    from clarifier.recipes import PLANS_DIR, available_recipes, load_recipe
    from clarifier.recipes.benchmark import load_plan

    assert {"joint-public", "joint-public-gpu"} <= set(available_recipes())
    for name in available_recipes():
        load_recipe(name)
    for path in PLANS_DIR.glob("*.yaml"):
        plan = load_plan(str(path))
        cfg = load_recipe(plan.recipe)
        assert set(plan.leave_one_out.sources) <= {s.source_name for s in cfg.data.sources}
        for extra in plan.variants.values():
            load_recipe(plan.recipe, [*plan.overrides, *extra, *plan.leave_one_out.overrides])


def test_shipped_plan_and_recipe_load():
    from clarifier.recipes import load_recipe
    from clarifier.recipes.benchmark import load_plan

    plan = load_plan("joint-public")
    cfg = load_recipe(plan.recipe)
    names = [s.source_name for s in cfg.data.sources]
    assert set(plan.leave_one_out.sources) <= set(names) and "joint" in plan.variants
    for extra in plan.variants.values():
        load_recipe(plan.recipe, [*plan.overrides, *extra])  # every variant's overrides are valid keys
    assert cfg.train.decision_loss.kind == "weighted" and cfg.data.silver_grounding.enabled


def test_plan_and_recipe_errors(tmp_path):
    from clarifier.recipes import recipe_path
    from clarifier.recipes.benchmark import load_plan, without_source

    with pytest.raises(ConfigError, match="no recipe named 'nope'"):
        recipe_path("nope")
    (tmp_path / "p.yaml").write_text("recipe: joint-public\nvariants: {other: []}\n")
    with pytest.raises(ConfigError, match="must include 'joint'"):
        load_plan(str(tmp_path / "p.yaml"))
    (tmp_path / "q.yaml").write_text("recipe: joint-public\nbogus: 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_plan(str(tmp_path / "q.yaml"))
    cfg = build_config({"data": {"sources": [{"importer": "synthetic"}]}})
    with pytest.raises(ConfigError, match="not one of the recipe's sources"):
        without_source(cfg, "clariq", tmp_path)


def test_leave_out_runs_one_part_of_a_plan_under_its_own_name(tmp_path):
    from clarifier.recipes.benchmark import resolve_plan

    plan, name = resolve_plan("joint-public-loo")
    assert name == "recipe-joint-public-loo" and len(plan.leave_one_out.sources) == 4
    plan, name = resolve_plan("joint-public-loo", ["train.max_minutes=1"], ["pacific", "claqua"])
    assert name == "recipe-joint-public-loo-pacific-claqua" and plan.leave_one_out.sources == ["pacific", "claqua"]
    assert plan.overrides[-1] == "train.max_minutes=1" and plan.leave_one_out.overrides == ["train.max_minutes=20"]
    with pytest.raises(ConfigError, match=r"\['clariqq'\] are not sources of recipe 'joint-public' \(it has \['clariq'"):
        resolve_plan("joint-public-loo", leave_out=["clariqq"])
    (tmp_path / "p.yaml").write_text("recipe: joint-public\nleave_one_out: {sources: [nope]}\n")
    with pytest.raises(ConfigError, match="nope"):  # a plan's own typo, refused before any work
        resolve_plan(str(tmp_path / "p.yaml"))
    result = CliRunner().invoke(__import__("clarifier.cli", fromlist=["app"]).app,
                                ["recipe", "benchmark", "joint-public-loo", "--leave-out", "clariqq"])
    assert result.exit_code == 2 and "clariqq" in result.output


def test_sample_by_source_caps_each_source():
    from clarifier.core.schema import sample_by_source

    examples = [Example(id=f"{s}{i}", query="q", needs_clarification=False, meta={"source": s}) for s in "ab" for i in range(10)]
    examples += [Example(id="c0", query="q", needs_clarification=False, meta={"source": "c"})]
    got = sample_by_source(examples, 4, seed=0)
    assert [source_of(e) for e in got].count("a") == 4 and [source_of(e) for e in got].count("c") == 1
    assert got == sample_by_source(list(reversed(examples)), 4, seed=0)


def test_tables_render_every_row():
    from clarifier.recipes.tables import markdown

    m = {"decision": {"f1": 0.5, "precision": 0.5, "recall": 0.5, "over_asking_rate": 0.1}, "auroc": 0.7,
         "recall_at_over_asking": {"0.05": 0.2, "0.1": 0.4}, "question": {"rougeL_f": None}, "validity": 1.0, "n": 4}
    result = {
        "plan": {"recipe": "r", "grounding_source": "syn", "error_analysis": {"row": "joint"}},
        "eval_set": {"n": 4, "split": "test", "per_source_cap": 2, "by_source": {"a": {"n": 2, "clarify": 1}}},
        "rows": {"lexical": {"kind": "rule", "metrics": {"all": m, "a": m, "grounding_source": "syn"}},
                 "joint": {"kind": "trained", "threshold": 0.3, "metrics": {"all": m, "a": m, "grounding_source": "syn"}}},
        "leave_one_out": {"a": {"left_out": m, "in_distribution": {"lexical": m, "joint": m}}},
        "stages_seconds": {"x": 1.0}, "seconds_total": 60,
    }
    md = markdown(result)
    assert "| joint | trained | 0.500 | 0.500 | 0.500 | 0.100 | 0.700 | 0.200 | 0.400 | n/a |" in md
    assert "| a | joint without a | 0.500 |" in md and "| a | joint (trained with a) |" in md
    assert "bootstrap" not in md  # no intervals measured, no section
    result["uncertainty"] = {"reference": "joint", "n_resamples": 10, "level": 0.95, "seed": 0, "systems": {
        "lexical": {"f1": [0.4, 0.6], "auroc": None, "f1_diff": [-0.1, 0.05], "auroc_diff": None},
        "joint": {"f1": [0.45, 0.55], "auroc": [0.6, 0.8]}}}
    md = markdown(result)
    assert "| lexical | 0.500 | [0.400, 0.600] | 0.700 | n/a | [-0.100, 0.050] | n/a |" in md
    assert "| joint | 0.500 | [0.450, 0.550] | 0.700 | [0.600, 0.800] | (reference) | (reference) |" in md


def test_cli_train_recipe_conflicts_with_config(tmp_path):
    from clarifier.cli import app

    r = CliRunner().invoke(app, ["train", "--recipe", "joint-public", "-c", str(tmp_path / "x.yaml")])
    assert r.exit_code == 2 and "pass one" in r.output
    r = CliRunner().invoke(app, ["train", "--recipe", "nope"])
    assert r.exit_code == 2 and "no recipe named 'nope'" in r.output
    r = CliRunner().invoke(app, ["recipe", "list"])
    assert r.exit_code == 0 and "joint-public" in r.output


def test_sample_by_source_with_a_clarify_share():
    from clarifier.core.schema import sample_by_source

    examples = [Example(id=f"a{i}", query="q", needs_clarification=i < 5, clarifying_question="which?" if i < 5 else None, meta={"source": "a"}) for i in range(100)]
    got = sample_by_source(examples, 20, seed=0, clarify_share=0.5)
    assert len(got) == 20 and sum(e.needs_clarification for e in got) == 5  # only 5 positives exist
    examples += [Example(id=f"b{i}", query="q", needs_clarification=i < 40, clarifying_question="which?" if i < 40 else None, meta={"source": "b"}) for i in range(100)]
    got = [e for e in sample_by_source(examples, 20, seed=0, clarify_share=0.3) if source_of(e) == "b"]
    assert len(got) == 20 and sum(e.needs_clarification for e in got) == 6


def test_old_reports_get_within_source_figures_from_their_per_source_metrics():
    from clarifier.recipes.tables import backfill_within_source, markdown

    per = {"a": {"auroc": 0.6, "recall_at_over_asking": {"0.1": 0.2}}, "b": {"auroc": 0.8, "recall_at_over_asking": {"0.1": 0.4}}}
    result = {"benchmark": "recipe-x", "plan": {"recipe": "x", "grounding_source": None},
              "eval_set": {"n": 4, "split": "test", "per_source_cap": 2, "by_source": {"a": {"n": 2, "clarify": 1},
                                                                                      "b": {"n": 2, "clarify": 1}}},
              "rows": {"joint": {"kind": "trained", "metrics": {"all": {"auroc": 0.9}, **per}}}}
    backfill_within_source(result)
    w = result["rows"]["joint"]["metrics"]["all"]["within_source"]
    assert w["macro_auroc"] == pytest.approx(0.7) and w["min_auroc"] == 0.6
    assert w["macro_recall_at_budget"] == pytest.approx(0.3) and w["macro_f1_at_budget"] is None
    assert "| joint | trained | 0.700 | 0.600 | 0.600 | 0.800 |" in markdown(result)


def test_a_variant_reuses_the_recipes_data_job_only_with_the_same_data_tokenizer_and_prompt(tmp_path):
    from clarifier.core.config import load_config
    from clarifier.recipes import recipe_path
    from clarifier.recipes.benchmark import _variant_cfg, load_plan

    plan = load_plan("joint-public")
    base = load_config(recipe_path(plan.recipe), plan.overrides)
    same = _variant_cfg(base, plan.recipe, plan, "joint_ce", ["train.decision_loss.kind=ce"], tmp_path)
    assert same.data.output == base.data.output and same.data.input == base.data.input
    # another prompt or base model tokenises the same examples differently: preparing it must not overwrite the
    # recipe's data job, which the other rows train on and the evaluation set is drawn from
    for name, extra in (("focus", ["model.passage_focus=true"]), ("window", ["model.max_history_turns=2"]),
                        ("gemma", ["model.base_model=gemma3-270m"])):
        cfg = _variant_cfg(base, plan.recipe, plan, name, extra, tmp_path)
        assert cfg.data.output == str(tmp_path / name / "data") != base.data.output
