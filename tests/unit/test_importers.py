"""Importers against the real public datasets in ../shared/data/public (counts and hand-checked rows)."""

from __future__ import annotations

import csv
import json
from collections import Counter
from importlib.metadata import EntryPoint

import pytest

from clarifier.data import importers
from clarifier.data.importers import available_importers, get_importer, import_dataset, iter_dataset
from clarifier.data.importers.claqua import fill_template
from clarifier.data.importers.pacific import render_answer
from clarifier.data.validate import parse_line
from clarifier.core.schema import Example
from support.paths import PUBLIC

pytestmark = pytest.mark.skipif(
    not PUBLIC.is_dir(), reason=f"public datasets not found at {PUBLIC} (../shared beside the repository)"
)


@pytest.fixture(scope="module")
def pacific():
    return import_dataset("pacific", PUBLIC / "pacific")


@pytest.fixture(scope="module")
def clariq():
    return import_dataset("clariq", PUBLIC / "clariq")


@pytest.fixture(scope="module")
def abgcoqa():
    return import_dataset("abgcoqa", PUBLIC / "abgcoqa")


@pytest.fixture(scope="module")
def claqua():
    return import_dataset("claqua", PUBLIC / "claqua")


def _by_id(res):
    ids = [e.id for e in res.examples]
    assert len(ids) == len(set(ids)), "example ids are not unique"
    return {e.id: e for e in res.examples}


def _round_trips(res):
    """Every example survives the evaluation-set reader (what `clarifier eval --data` and the data job use)."""
    for e in res.examples:
        got, q = parse_line(e.model_dump_json(), "import.jsonl", 1)
        assert q is None, q
        assert got[0] == e
        assert e.meta["conversation_id"] and e.meta["dataset"] == res.dataset and e.meta["source_file"]


# ---- registry ---------------------------------------------------------------------------------


def test_registry_lists_builtins_and_rejects_unknown():
    assert {"clariq", "pacific", "abgcoqa", "claqua"} <= set(available_importers())
    with pytest.raises(KeyError, match="no importer named 'nope'.*clariq"):
        get_importer("nope")


def test_unknown_or_bad_option_is_an_error_naming_it():
    with pytest.raises(ValueError, match="unknown option 'colour'.*need_2"):
        import_dataset("clariq", PUBLIC / "clariq", {"colour": "red"})
    with pytest.raises(ValueError, match="need_2"):
        import_dataset("clariq", PUBLIC / "clariq", {"need_2": "maybe"})
    with pytest.raises(FileNotFoundError, match="no test.tsv"):
        import_dataset("clariq", PUBLIC / "clariq", {"splits": "test"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        iter_dataset("pacific", PUBLIC / "missing-folder")


def test_third_party_importer_via_entry_point(tmp_path, monkeypatch):
    (tmp_path / "toy_importer_mod.py").write_text(
        "from clarifier.data.importers.base import Importer, ImporterOptions, Skipped\n"
        "from clarifier.core.schema import Example\n"
        "class Opts(ImporterOptions):\n    n: int = 2\n"
        "def run(src, opts):\n"
        "    def gen():\n"
        "        for i in range(opts.n):\n"
        "            yield Example(id=f'toy-{i}', query='q', needs_clarification=False, meta={'split': 'x'})\n"
        "        yield Skipped('bad', 'toy:9')\n"
        "    return gen()\n"
        "IMPORTER = Importer(name='toy', options=Opts, run=run)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint(name="toy", value="toy_importer_mod:IMPORTER", group=importers.ENTRY_POINT_GROUP),
           EntryPoint(name="clariq", value="toy_importer_mod:IMPORTER", group=importers.ENTRY_POINT_GROUP),
           EntryPoint(name="broken", value="no_such_module_xyz:IMPORTER", group=importers.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(importers, "entry_points", lambda group: [e for e in eps if e.group == group])
    assert {"toy", "broken", "clariq"} <= set(available_importers())
    res = import_dataset("toy", tmp_path, {"n": "3"})
    assert [e.id for e in res.examples] == ["toy-0", "toy-1", "toy-2"] and res.skipped_by_reason() == {"bad": 1}
    assert get_importer("clariq") is importers.BUILTIN["clariq"]  # built-ins win
    with pytest.raises(ImportError, match="broken.*no_such_module_xyz"):
        get_importer("broken")


# ---- PACIFIC ------------------------------------------------------------------------------------


def test_pacific_counts_match_the_file(pacific):
    raw = json.loads((PUBLIC / "pacific" / "validation.json").read_text())
    turns = [q for d in raw for q in d["questions"]]
    assert len(turns) == 1982
    assert pacific.read == len(pacific.examples) + len(pacific.skipped) == 1982
    assert pacific.skipped == []
    assert sum(e.needs_clarification for e in pacific.examples) == sum(q["req_clari"] for q in turns) == 320
    assert len({e.meta["conversation_id"] for e in pacific.examples}) == len(raw) == 277
    c = pacific.counts()
    assert c["by_split"] == {"validation": {"examples": 1982, "clarify": 320, "answer": 1662}}
    _round_trips(pacific)


def test_pacific_hand_checked_rows(pacific):
    ex = _by_id(pacific)
    clar = ex["pacific-060d955a-8328-454c-a251-a9c299156029"]
    assert clar.query == "What is the company paid on a contract?"
    assert clar.needs_clarification and clar.clarifying_question == "Which type of contract are you asking about?"
    assert [(t.role, t.text) for t in clar.history] == [
        ("user", "What are the contract types?"),
        ("assistant", "fixed-price type; cost-plus type; time-and-material type")]
    assert clar.grounding_turns == [] and clar.meta["conversation_id"] == "pacific-3ffd9053-a45d-491c-957a-1b2fa0af0570"
    assert [p.id for p in clar.passages] == ["table", "p1", "p2"]
    assert clar.passages[0].text.splitlines()[-1] == "Total sales | $1,496.5 | $1,202.9 | $1,107.7"

    reply = ex["pacific-4960801d-277d-4f79-8eca-c4d0200fa9d6"]  # the user's answer to "Which year...?"
    assert reply.query == "2019" and not reply.needs_clarification and reply.clarifying_question is None
    assert len(reply.history) == 8
    assert (reply.history[-2].text, reply.history[-1].text) == ("What is the amount of total sales?", "Which year are you asking about?")
    assert reply.meta["answer"] == "$1,496.5 million"
    assert reply.meta["original_question"] == "What is the amount of total sales in 2019?"
    assert ex["pacific-eb787966-fa02-401f-bfaf-ccabf3828b23"].meta["answer"] == "-12.6 million"
    assert ex["pacific-05b670d3-5b19-438c-873f-9bf6de29c69e"].meta["answer"] == "-22.22%"


def test_pacific_history_is_every_earlier_turn_in_order(pacific):
    dialogue = [e for e in pacific.examples if e.meta["dialogue_index"] == 0]
    assert [e.meta["order"] for e in dialogue] == list(range(1, len(dialogue) + 1))
    for prev, cur in zip(dialogue, dialogue[1:]):
        assert cur.history[: len(prev.history)] == prev.history
        assert [t.role for t in cur.history[len(prev.history):]] == ["user", "assistant"]
        assert cur.history[len(prev.history)].text == prev.query
        if prev.needs_clarification:
            assert cur.history[-1].text == prev.clarifying_question


def test_pacific_without_passages():
    res = import_dataset("pacific", PUBLIC / "pacific", {"passages": "false"})
    assert len(res.examples) == 1982 and all(e.passages == [] for e in res.examples)


def test_render_answer():
    assert render_answer(["73,260", "57,768"], "thousand") == "73,260 thousand; 57,768 thousand"
    assert render_answer(2.0, "") == "2" and render_answer(["13.2"], "percent") == "13.2%"


# ---- ClariQ -------------------------------------------------------------------------------------


def _clariq_topics(split):
    with open(PUBLIC / "clariq" / f"{split}.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return {r["topic_id"]: int(r["clarification_need"]) for r in rows}, len(rows)


def test_clariq_one_example_per_topic_with_the_need_mapping(clariq):
    train, n_rows = _clariq_topics("train")
    dev, _ = _clariq_topics("dev")
    assert n_rows == 9176 and len(train) == 187 and len(dev) == 50
    assert clariq.read == len(clariq.examples) == 237 and clariq.skipped == []
    ex = _by_id(clariq)
    for split, topics in (("train", train), ("dev", dev)):
        for tid, need in topics.items():
            e = ex[f"clariq-{split}-{tid}"]
            assert e.meta["clarification_need"] == need
            assert e.needs_clarification == (need >= 2)  # default need_2=clarify
            assert e.history == [] and e.grounding_turns == []
    assert clariq.counts()["by_split"]["train"] == {"examples": 187, "clarify": 162, "answer": 25}
    _round_trips(clariq)


def test_clariq_need_2_option():
    answer = import_dataset("clariq", PUBLIC / "clariq", {"need_2": "answer", "splits": "train"})
    assert answer.counts()["clarify"] == 88 and answer.counts()["answer"] == 99
    skip = import_dataset("clariq", PUBLIC / "clariq", {"need_2": "skip"})
    assert skip.skipped_by_reason() == {"need_2_skipped": 95}  # 74 train + 21 dev topics
    assert len(skip.examples) == 237 - 95
    assert all(s.where.startswith(("train.tsv:", "dev.tsv:")) for s in skip.skipped)


def test_clariq_hand_checked_topics(clariq):
    ex = _by_id(clariq)
    dino = ex["clariq-train-14"]
    assert dino.query == "I'm interested in dinosaurs" and dino.needs_clarification
    assert dino.clarifying_question == "are you interested in coloring books"  # first in file order
    assert dino.meta["question_id"] == "Q00173" and dino.meta["clarification_need"] == 4
    assert dino.meta["candidate_questions"][:2] == ["are you interested in coloring books", "which dinosaurs are you interested in"]
    assert "Q00001" not in dino.meta["candidate_question_ids"] and dino.meta["conversation_id"] == "clariq-14"
    obama = ex["clariq-train-1"]
    assert obama.query == "Tell me about Obama family tree." and obama.meta["lines"][0] == 2
    assert obama.meta["topic_desc"].startswith("Find information on President Barack Obama's family history")
    assert obama.meta["facet_ids"][:2] == ["F0001", "F0002"]
    negatives = [e for e in clariq.examples if e.meta["clarification_need"] == 1]
    assert len(negatives) == 29 and all(e.clarifying_question is None for e in negatives)


def test_clariq_lowest_id_strategy_is_deterministic_and_differs_somewhere():
    a = import_dataset("clariq", PUBLIC / "clariq", {"question": "lowest_id"})
    b = import_dataset("clariq", PUBLIC / "clariq", {"question": "lowest_id"})
    assert [e.clarifying_question for e in a.examples] == [e.clarifying_question for e in b.examples]
    first = {e.id: e for e in import_dataset("clariq", PUBLIC / "clariq").examples}
    for e in a.examples:
        if e.needs_clarification:
            assert e.meta["question_id"] == min(e.meta["candidate_question_ids"])
    assert sum(e.clarifying_question != first[e.id].clarifying_question for e in a.examples) > 0


# ---- Abg-CoQA -----------------------------------------------------------------------------------


def test_abgcoqa_counts_and_labels(abgcoqa):
    raw = json.loads((PUBLIC / "abgcoqa" / "coqa_abg_val.json").read_text())["data"]
    assert len(raw) == 1092 and abgcoqa.read == 1092 and abgcoqa.skipped == []
    assert sum(e.needs_clarification for e in abgcoqa.examples) == sum(r["ambiguity"] == "ambiguous" for r in raw) == 130
    assert len({e.meta["conversation_id"] for e in abgcoqa.examples}) == 500
    _round_trips(abgcoqa)


def test_abgcoqa_hand_checked_row(abgcoqa):
    e = _by_id(abgcoqa)["abgcoqa-3pxx5px6lxyuqm3uo2o1yddekb4ab3|9|2"]
    assert e.query == "What did they remove?" and e.needs_clarification
    assert e.clarifying_question == "Do you mean what did they remove before heading for the path?"
    assert [(t.role, t.text) for t in e.history] == [
        ("user", "where did the path lead?"), ("assistant", "dense thicket"),
        ("user", "Which way was fastest?"), ("assistant", "the shore")]
    assert e.meta["alternative_questions"] == ["Do you mean the ropes from their arms?"]
    assert e.meta["conversation_id"] == "abgcoqa-3pxx5px6lxyuqm3uo2o1yddekb4ab3"
    assert e.meta["history_turn_ids"] == [7, 8] and e.meta["target_turn_id"] == 9 and e.meta["source"] == "gutenberg"
    assert [p.id for p in e.passages] == ["story"] and e.grounding_turns == []
    first = abgcoqa.examples[0]
    assert first.id == "abgcoqa-369j354ofdapu1z2ebz3jj2p5ajg6o|7|2" and not first.needs_clarification
    assert first.query == "did the driver try to pick more people up?" and first.meta["answer"] == "yes"


# ---- CLAQUA -------------------------------------------------------------------------------------


def _lines(path):
    return [ln for ln in path.read_text().split("\n") if ln.strip()]


def test_claqua_counts_per_variant_and_split(claqua):
    data = PUBLIC / "claqua" / "data"
    c = Counter((e.meta["variant"], e.meta["split"], e.needs_clarification) for e in claqua.examples)
    for variant in ("single-turn", "multi-turn"):
        t1 = [json.loads(ln) for ln in _lines(data / variant / "task1" / "dev_classifier.txt")]
        assert c[(variant, "dev", True)] == sum(r["label"] == "1" for r in t1) == len(_lines(data / variant / "task2" / "src-val.txt"))
        assert c[(variant, "dev", False)] == sum(r["label"] == "0" for r in t1)
    assert c[("single-turn", "train", True)] == 3500 and c[("single-turn", "train", False)] == 0
    assert c[("multi-turn", "train", True)] == 0
    # task-2 train pairs whose template does not fit, and multi-turn tgt-train.txt without its src file
    assert claqua.skipped_by_reason() == {"template_mismatch": 7, "missing_src_file": 12173}
    assert claqua.read == 853 + 973 + 3507 + 12173
    assert {s.where.split(":")[0] for s in claqua.skipped} == {
        "single-turn/task2/src-train.txt", "multi-turn/task2/tgt-train.txt"}
    _round_trips(claqua)


def test_claqua_hand_checked_rows(claqua):
    ex = _by_id(claqua)
    multi = ex["claqua-multi-turn-dev-t1-3"]
    assert [(t.role, t.text) for t in multi.history] == [("user", "Who are the followers of the get set?"), ("assistant", "the Beatles")]
    assert multi.query == "Who influenced this person?" and multi.needs_clarification
    assert multi.clarifying_question == "Do you mean The Get Set or the Beatles, when you ask who influenced this person?"
    assert multi.grounding_turns == [0, 1] and multi.meta["grounding_source"] == "entity_match"
    assert multi.meta["task2_file"] == "multi-turn/task2/src-val.txt" and multi.meta["task2_line"] == 1
    assert multi.meta["entities"] == ["The Get Set", "the Beatles"]
    single = ex["claqua-single-turn-dev-t1-1"]
    assert single.query == "What was the instrument played by Mari?" and single.history == []
    assert single.clarifying_question == (
        "Are you referring to agent Mari or non agent Mari, when you say the musical instruments played by this person?")
    assert [p.id for p in single.passages] == ["entity1", "entity2"]
    assert single.passages[0].text.startswith(
        "Mari (music.artist media_common.cataloged_instance ratings.rated_entity event.agent people.person): Mari Youngblood")
    assert single.passages[1].text.startswith("Mari (music.artist people.person): Mari Burelle-Valencia")
    negatives = [e for e in claqua.examples if not e.needs_clarification]
    assert all(e.grounding_turns == [] and e.clarifying_question is None for e in negatives)


def test_claqua_options():
    res = import_dataset("claqua", PUBLIC / "claqua", {"variants": "multi-turn", "splits": "dev", "grounding": "none",
                                                       "passages": "false"})
    assert len(res.examples) == 973 and res.skipped == []
    assert all(e.grounding_turns == [] and e.passages == [] for e in res.examples)


def test_fill_template():
    assert fill_template("Do you mean <e> or <e>? <TSP> a b <TSP>  c ") == "Do you mean a b or c?"
    with pytest.raises(ValueError, match="2 <e> slot"):
        fill_template("<e> or <e>? <TSP> x")


# ---- CLI ----------------------------------------------------------------------------------------


def test_cli_import_writes_jsonl_per_split_and_a_report(tmp_path):
    from typer.testing import CliRunner

    from clarifier.cli import app

    out = tmp_path / "clariq"
    r = CliRunner().invoke(app, ["data", "import", "clariq", "--src", str(PUBLIC / "clariq"), "--out", str(out),
                                 "--option", "need_2=skip"])
    assert r.exit_code == 0, r.output
    printed = json.loads(r.output[r.output.index("{"):])
    assert printed["examples"] == 142 and printed["skipped_by_reason"] == {"need_2_skipped": 95}
    assert printed["by_split"]["dev"] == {"examples": 29, "clarify": 25, "answer": 4}
    lines = (out / "clariq-train.jsonl").read_text().splitlines()
    assert len(lines) == 113 and all(Example.model_validate_json(ln).meta["split"] == "train" for ln in lines)
    assert len((out / "clariq-dev.jsonl").read_text().splitlines()) == 29
    report = json.loads((out / "clariq-import-report.json").read_text())
    assert len(report["skipped_records"]) == 95 and report["skipped_records"][0]["reason"] == "need_2_skipped"

    bad = CliRunner().invoke(app, ["data", "import", "clariq", "--src", str(PUBLIC / "clariq"), "--out", str(out), "-o", "x=1"])
    assert bad.exit_code == 2 and "unknown option 'x'" in bad.output


def test_cli_import_single_file(tmp_path):
    from typer.testing import CliRunner

    from clarifier.cli import app

    out = tmp_path / "abg.jsonl"
    r = CliRunner().invoke(app, ["data", "import", "abgcoqa", "--src", str(PUBLIC / "abgcoqa"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert len(out.read_text().splitlines()) == 1092
    assert json.loads((tmp_path / "abg.import-report.json").read_text())["clarify"] == 130
