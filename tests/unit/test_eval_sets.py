"""Built-in evaluation sets (``builtin:probes``): shipped, valid, labelled per capability, and
reported per source with the wrong decisions listed."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from clarifier.core.metrics import Prediction, evaluate_predictions
from clarifier.core.schema import source_of
from clarifier.evaluation.evaluate import (builtin_eval_sets, load_eval_data, mistaken_decisions, resolve_eval_set)
from clarifier.evaluation.report import format_source_table, source_rows, write_report


def test_probes_ship_and_load_without_a_malformed_line():
    assert "probes" in builtin_eval_sets()
    ed = load_eval_data("builtin:probes", report=lambda *_: None)
    assert ed.name == "builtin:probes" and not ed.skipped and len(ed.examples) >= 80
    assert len({e.id for e in ed.examples}) == len(ed.examples)
    counts = Counter((source_of(e), e.needs_clarification) for e in ed.examples)
    capabilities = {s for s, _ in counts}
    assert {"probe:standalone", "probe:history_reference", "probe:rag_passages", "probe:clarification_reply",
            "probe:ill_formed", "probe:long_rag", "probe:small_talk"} <= capabilities
    for cap in capabilities - {"probe:clarification_reply"}:  # a reply to a clarifying question is clear by design
        assert counts[(cap, True)] >= 3 and counts[(cap, False)] >= 3, cap
    for e in ed.examples:
        assert e.meta.get("why"), e.id  # every case says why its label holds
        if e.needs_clarification:
            assert e.clarifying_question
        assert all(0 <= t < len(e.history) for t in e.grounding_turns), e.id
    rag = [e for e in ed.examples if source_of(e) == "probe:rag_passages"]
    assert all(len(e.passages) >= 1 and not e.history for e in rag)
    # the same fingerprint on every load: a report can say it ran on the same probes
    assert load_eval_data("builtin:probes", report=lambda *_: None).fingerprint == ed.fingerprint


def test_unknown_builtin_set_names_the_shipped_ones(tmp_path):
    with pytest.raises(ValueError, match=r"no built-in evaluation set 'nope'.*shipped: .*probes"):
        resolve_eval_set("builtin:nope")
    assert resolve_eval_set(str(tmp_path)) == str(tmp_path)  # any other location is left alone


def _report(examples, preds):
    m = evaluate_predictions(examples, preds)
    wrong = mistaken_decisions(examples, preds)
    return {"n": len(examples), "models": {"model": {"metrics": m}}, "n_mistakes": len(wrong), "mistakes": wrong}


def test_by_source_table_and_wrong_decisions_in_the_report(tmp_path):
    ed = load_eval_data("builtin:probes", report=lambda *_: None)
    # a model that asks whenever there is history: right on stand-alone clear turns, wrong on replies
    preds = [Prediction(bool(e.history), 0.9 if e.history else 0.1, "Which one?" if e.history else None)
             for e in ed.examples]
    rep = _report(ed.examples, preds)
    header, rows = source_rows(rep)
    by = {r[0]: dict(zip(header, r)) for r in rows}
    reply = by["probe:clarification_reply"]
    assert reply["Over-ask"] == "1.000" and reply["Recall"] == "n/a" and reply["Acc"] == "0.000"
    assert by["probe:standalone"]["Asked"] == "0"
    assert rows[-1][0].startswith("mean of 6 sources")
    text = format_source_table(rep)
    assert "probe:long_rag" in text and "R@10%OA" in text.splitlines()[0]
    assert rep["n_mistakes"] == sum(1 for e, p in zip(ed.examples, preds)
                                    if e.needs_clarification != p.needs_clarification) > 0
    assert all(m["why"] for m in rep["mistakes"])
    paths = write_report(rep, tmp_path)
    md = paths["markdown"].read_text()
    assert "## By source (model)" in md and "## Wrong decisions (model;" in md
    assert "probe-clarification_reply-clear-0" in md
    assert json.loads(paths["json"].read_text())["mistakes"][0]["id"] == rep["mistakes"][0]["id"]


def test_one_source_gets_no_by_source_table():
    ed = load_eval_data("builtin:probes", report=lambda *_: None)
    one = [e for e in ed.examples if source_of(e) == "probe:standalone"]
    rep = _report(one, [Prediction(True, 0.9, "Which?")] * len(one))
    assert source_rows(rep) is None and format_source_table(rep) == ""
