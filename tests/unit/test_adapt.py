"""`clarifier adapt`: a model's decision head fitted to a user's own labelled turns (clarifier.train.adapt), and
the regression under it (clarifier.train.decision_head.fit_on_labels)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.turns import labelled_turns


def _labelled(n: int, seed: int = 0, flip: bool = False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)) * np.array([1, 2, 3, 1, 1, 5]) + 4
    y = (x[:, 0] - 4 + 0.3 * rng.normal(size=n)) > 0
    return x, (~y if flip else y)


def test_a_head_moved_from_a_prior_stays_there_with_few_labels_and_follows_many():
    from clarifier.core.metrics import auroc
    from clarifier.train.decision_head import fit_on_labels, head_scores

    x, y = _labelled(200)
    prior = (np.array([-3.0, 0, 0, 0, 0, 0]), 12.0)  # a head on the raw features that ranks these turns backwards
    raw = 1 / (1 + np.exp(-(x @ prior[0] + prior[1])))
    assert auroc(list(y), list(raw)) < 0.1

    held = fit_on_labels(x, y, prior, c_grid=[1e-6])  # a strength too weak to move it: the prior's own ranking
    assert held["c"] == 1e-6 and np.allclose(head_scores(held, x), raw, atol=0.02)
    moved = fit_on_labels(x, y, prior)  # cross-validation picks a strength that follows the labels
    assert moved["c"] > 1e-6 and moved["cv_auroc"] > 0.9 and auroc(list(y), list(head_scores(moved, x))) > 0.9
    assert len(moved["oof"]) == len(y) and [t["c"] for t in moved["tried"]] == [1e-4, 1e-3, 1e-2, 0.1, 1.0]
    alone = fit_on_labels(x, y)
    assert alone["cv_auroc"] > 0.9 and alone["scaler"].mean_ == pytest.approx(x.mean(0))


def test_labels_need_two_of_each_class():
    from clarifier.train.decision_head import fit_on_labels

    x, y = _labelled(30)
    y[:] = False
    y[0] = True
    with pytest.raises(ValueError, match="1 need a question and 29 do not; cross-validation needs at least 2 of each"):
        fit_on_labels(x, y)


@pytest.fixture(scope="module")
def headed_model(tiny_model_dir, tmp_path_factory):
    from clarifier.core.config import DecisionHeadConfig
    from clarifier.train.decision_head import fit_decision_head
    from support.adapters import untrained_adapter

    folder = untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("headed") / "m", threshold=0.5)
    fit_decision_head(folder, labelled_turns(24, "t"), labelled_turns(12, "d"), DecisionHeadConfig(layers=[0.5, 1.0], c_grid=[1.0]),
                      precision="fp32", progress=lambda _: None)
    return folder


def test_adapting_to_a_user_whose_notion_is_the_opposite(headed_model, tmp_path):
    from clarifier.core.metrics import auroc
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import load_engine
    from clarifier.train.adapt import adapt_head

    before_files = sorted(p.name for p in headed_model.iterdir())
    theirs = labelled_turns(30, "u", flip=True)
    lines = []
    res = adapt_head(str(headed_model), theirs, tmp_path / "adapted", precision="fp32", data_name="theirs.jsonl",
                     progress=lines.append)
    assert res["before"]["decided_by"] == "decision head" and res["before"]["auroc"] < 0.1  # ranked backwards
    assert res["kept"] in ("head", "scratch") and res["heads"][res["kept"]]["cv_auroc"] > 0.9
    assert set(res["heads"]) == {"head", "scratch"} and res["n"] == 30 and res["clarify"] == 15
    # the figure to quote: every choice made again inside each fold by conversation, beside the surface control
    est = res["estimate"]
    assert est["method"].startswith("nested cross-validation") and est["auroc"] > 0.8
    assert est["surface_control_auroc"] is not None and est["skill"]["mixed"]["control_auroc"] == est["surface_control_auroc"]
    assert any("honest estimate" in line for line in lines)

    engine = load_engine(tmp_path / "adapted", precision="fp32")
    scores = engine.score([(e.history, e.query, e.passages) for e in theirs])
    assert auroc([e.needs_clarification for e in theirs], scores) > 0.9
    meta = read_meta(tmp_path / "adapted")
    assert meta.threshold == pytest.approx(res["threshold"]) and meta.decision_head["adapted"]["kept"] == res["kept"]
    assert meta.calibration["split"] == "adapt (out of fold)"
    assert json.loads((tmp_path / "adapted" / "adapt.json").read_text())["data"] == "theirs.jsonl"
    assert sorted(p.name for p in headed_model.iterdir()) == before_files  # the model adapted from is untouched
    assert auroc([e.needs_clarification for e in theirs], load_engine(headed_model, precision="fp32").score(
        [(e.history, e.query, e.passages) for e in theirs])) < 0.1

    # Turns the model already ranks right: nothing fitted beats it, so the copy keeps its decision (threshold reset).
    same = adapt_head(str(headed_model), labelled_turns(30, "s"), tmp_path / "same", precision="fp32", progress=lines.append)
    assert same["kept"] == "shipped" and same["before"]["auroc"] == 1.0
    assert (tmp_path / "same" / "decision_head.safetensors").read_bytes() == \
        (headed_model / "decision_head.safetensors").read_bytes()


def test_a_queues_kept_apart_turns_are_never_fitted_on_and_scored_at_the_end(headed_model, tmp_path):
    from clarifier.train.adapt import adapt_head

    fit = labelled_turns(30, "u", flip=True)
    held = [e.model_copy(update={"meta": {**e.meta, "queue": {"part": "kept_apart"}}})
            for e in labelled_turns(12, "k", flip=True)]
    lines = []
    res = adapt_head(str(headed_model), fit + held, tmp_path / "adapted", precision="fp32", progress=lines.append)
    assert res["n"] == 30  # fitted on the others only
    ka = res["kept_apart"]
    assert ka["n"] == 12 and ka["clarify"] == 6 and ka["auroc"] > 0.9 and ka["before_auroc"] < 0.1
    assert ka["auroc_interval"][0] <= ka["auroc"] <= ka["auroc_interval"][1]
    assert ka["surface_control_auroc"] is not None and "at_threshold" in ka and ka["skill"]["verdict"]
    assert any("kept-apart slice" in line for line in lines)
    curve = res["label_curve"]  # what more labels would buy, scored on the kept-apart turns
    assert curve["scored_on"] == "kept-apart turns" and len(curve["points"]) >= 3
    assert curve["points"][-1]["labels"] == 30 and curve["doubling_gain"] is not None
    assert any(line.startswith("[adapt] AUROC against labels") for line in lines)
    one_class = [h for h in held if h.needs_clarification][:3]
    res = adapt_head(str(headed_model), fit + one_class, tmp_path / "again", precision="fp32", progress=lines.append)
    assert res["kept_apart"]["auroc"] is None and "both classes are needed" in res["kept_apart"]["note"]


def test_adapting_refuses_what_it_cannot_do(headed_model, tmp_path):
    from clarifier.train.adapt import AdaptError, adapt_head

    few = [e for e in labelled_turns(30, "u") if not e.needs_clarification] + [e for e in labelled_turns(6, "v") if e.needs_clarification]
    with pytest.raises(AdaptError, match=r"3 need a question and 15 do not; adapting needs at least 5 of each"):
        adapt_head(str(headed_model), few, tmp_path / "out", precision="fp32")
    with pytest.raises(AdaptError, match="is the model's own folder"):
        adapt_head(str(headed_model), labelled_turns(20, "u"), headed_model, precision="fp32")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's own files")
    with pytest.raises(AdaptError, match="exists and is not an earlier `clarifier adapt` output"):
        adapt_head(str(headed_model), labelled_turns(20, "u"), tmp_path / "mine", precision="fp32")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "a user's own files"  # never emptied
    with pytest.raises(AdaptError, match="start 'sideways'"):
        adapt_head(str(headed_model), labelled_turns(20, "u"), tmp_path / "out", start="sideways")
    assert not (tmp_path / "out").exists()


def test_cli_adapts_from_a_jsonl_file_and_names_a_one_class_file(headed_model, tmp_path):
    from typer.testing import CliRunner

    from clarifier.cli import app

    path = tmp_path / "theirs.jsonl"
    path.write_text("".join(e.model_dump_json() + "\n" for e in labelled_turns(30, "u", flip=True)))
    res = CliRunner().invoke(app, ["adapt", "--model", str(headed_model), "--data", str(path), "--out",
                                   str(tmp_path / "adapted"), "model.precision=fp32"])
    assert res.exit_code == 0, res.output
    assert "AUROC on your 30 labelled turns (15 need a question" in res.output and "kept:" in res.output
    assert "clarifier eval --model" in res.output and (tmp_path / "adapted" / "adapt.json").is_file()
    assert "estimate for turns it never saw (nested cross-validation" in res.output and "surface control" in res.output
    again = CliRunner().invoke(app, ["adapt", "--model", str(headed_model), "--data", str(path), "--out",
                                     str(tmp_path / "adapted"), "model.precision=fp32"])
    assert again.exit_code == 0, again.output  # an earlier adapt output is replaced

    # the next step it prints: `clarifier eval`; without --out its report goes to a new folder under
    # <storage.root>/eval (kept, and said), not to a temporary folder
    store = tmp_path / "store"
    seen: set = set()
    for run in range(2):
        res = CliRunner().invoke(app, ["eval", "--model", str(tmp_path / "adapted"), "--data", str(path),
                                       f"storage.root={store}", "eval.semantic_encoder=null", "eval.max_new_tokens=4",
                                       "eval.baselines=[]", "model.precision=fp32"])
        assert res.exit_code == 0, res.output
        new = {p.parent for p in (store / "eval").glob("*/report.json")} - seen
        assert len(new) == 1 and len(seen) == run  # one new folder; an earlier report is never replaced
        folder = new.pop()
        assert folder.name in res.output.replace("\n", "")  # and the command says where it is
        assert json.loads((folder / "report.json").read_text())["n"] == 30
        seen.add(folder)

    clear = tmp_path / "clear.jsonl"
    clear.write_text("".join(e.model_dump_json() + "\n" for e in labelled_turns(30, "u") if not e.needs_clarification))
    res = CliRunner().invoke(app, ["adapt", "--model", str(headed_model), "--data", str(clear), "--out",
                                   str(tmp_path / "none"), "model.precision=fp32"])
    assert res.exit_code == 2 and "cannot adapt" in res.output and "0 need a question and 15 do not" in res.output


def test_a_lora_continuation_needs_enough_labels_and_is_compared_on_the_kept_apart_turns():
    from clarifier.train.adapt import AdaptError, check_train_labels, compare_kept_apart

    turns = labelled_turns(240, "t")
    for e in turns[:30]:
        e.meta["queue"] = {"part": "kept_apart"}
    assert check_train_labels(turns) == (210, 30)
    with pytest.raises(AdaptError, match="190 labelled turns to train on and 30 kept apart"):
        check_train_labels(turns[:220])
    with pytest.raises(AdaptError, match="210 labelled turns to train on and 15 kept apart"):
        check_train_labels(turns[15:])
    held = turns[:30]
    gold = [e.needs_clarification for e in held]
    good = {e.id: (0.9 if g else 0.1) for e, g in zip(held, gold)}
    noisy = {e.id: (0.6 if g else 0.4) if i % 3 else (0.4 if g else 0.6) for i, (e, g) in enumerate(zip(held, gold))}
    better = compare_kept_apart(held, {"turns": good}, {"turns": noisy})
    assert better["auroc_diff_interval"][0] > 0 and "ranks the kept-apart turns better" in better["verdict"]
    worse = compare_kept_apart(held, {"turns": noisy}, {"turns": good})
    assert "worse than the head refit alone" in worse["verdict"]
    same = compare_kept_apart(held, {"turns": good}, {"turns": dict(good)})
    assert "no measured difference" in same["verdict"]
    assert "not scored on the same" in compare_kept_apart(held, {"turns": good}, {})["verdict"]
