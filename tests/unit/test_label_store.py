"""The labels file of a labelling queue (clarifier.data.label_store) and the page's API (clarifier.serving.label_page):
appended and on disk at once, resumed, never two labels for one turn, two writers detected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clarifier.core.schema import Example
from clarifier.data.label_store import LabelConflict, LabelStore, LabelStoreLocked, read_queue
from support.turns import queue_file as write_queue


def test_labels_are_evaluation_set_records_on_disk_at_once_and_resumed(tmp_path):
    q = write_queue(tmp_path / "queue.jsonl")
    out = tmp_path / "labels.jsonl"
    s = LabelStore(q, out, labeller="ann")
    assert s.next_item()["id"] == "c0:2"
    s.add("c0:2", "clarify", question="The router or the modem?", grounding_turns=[0])
    s.add("c1:2", "clear")
    s.add("c2:2", "clarify")  # no question written: a decision-only positive
    s.add("c3:2", "skip")
    recs = [json.loads(line) for line in out.read_text().splitlines()]  # read by another reader: already there
    assert [r["id"] for r in recs] == ["c0:2", "c1:2", "c2:2"]
    examples = [Example.model_validate(r) for r in recs]  # clarifier adapt reads the file as it is
    assert [e.needs_clarification for e in examples] == [True, False, True]
    assert examples[0].clarifying_question == "The router or the modem?" and examples[0].grounding_turns == [0]
    assert examples[2].decision_only and recs[0]["meta"]["label"]["by"] == "ann"
    assert recs[0]["meta"]["queue"]["part"] == "kept_apart"
    assert json.loads((tmp_path / "labels.skips.jsonl").read_text())["id"] == "c3:2"
    s.close()
    again = LabelStore(q, out)  # a restart resumes after the last label or skip
    assert again.next_item()["id"] == "c4:2"
    p = again.progress()
    assert (p["labelled"], p["skipped"], p["left"], p["clarify"], p["clear"]) == (3, 1, 4, 2, 1)
    with pytest.raises(LabelConflict, match="already labelled by ann"):
        again.add("c1:2", "clarify")  # never two labels for one turn
    for bad, match in [(("c9:9", "clear"), "not in the queue"), (("c4:2", "maybe"), "one of clarify, clear, skip"),
                       (("c4:2", "clear", "A question?"), "a question goes with decision 'clarify'")]:
        with pytest.raises(ValueError, match=match):
            again.add(*bad[:2], question=bad[2] if len(bad) > 2 else None)
    with pytest.raises(ValueError, match=r"grounding_turns \[5\]: the turn has 2 earlier turns"):
        again.add("c4:2", "clarify", grounding_turns=[5])
    again.close()


def test_a_cut_short_write_is_left_for_later_and_the_kept_apart_estimate_appears(tmp_path):
    q = write_queue(tmp_path / "queue.jsonl", 16)
    out = tmp_path / "labels.jsonl"
    s = LabelStore(q, out)
    for i in range(0, 16, 2):  # the kept-apart turns; the model's score ranks them right
        s.add(f"c{i}:2", "clarify" if i % 4 == 0 else "clear")
    est = s.progress()["kept_apart"]
    assert est["n"] == 8 and est["auroc"] == 1.0 and est["interval"] == [1.0, 1.0]
    s.close()
    with open(out, "a") as f:
        f.write('{"id": "c1:2", "needs_clari')  # a write cut short by a kill
    again = LabelStore(q, out)
    assert again.progress()["labelled"] == 8 and again.next_item()["id"] == "c1:2"
    again.close()


def test_a_second_session_on_the_same_file_is_refused_and_a_dead_ones_lock_is_not(tmp_path):
    q = write_queue(tmp_path / "queue.jsonl")
    out = tmp_path / "labels.jsonl"
    first = LabelStore(q, out, labeller="ann")
    with pytest.raises(LabelStoreLocked, match="being labelled by ann"):
        LabelStore(q, out, labeller="bob")
    taken = LabelStore(q, out, labeller="bob", take_over=True)
    taken.close()
    first.close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = json.loads((tmp_path / "labels.jsonl.lock").read_text()) if (tmp_path / "labels.jsonl.lock").exists() else {}
    lock.update({"labeller": "ghost", "pid": int(dead.stdout), "host": os.uname().nodename})
    (tmp_path / "labels.jsonl.lock").write_text(json.dumps(lock))
    LabelStore(q, out).close()  # the session that held it is gone: a restart opens the file


def test_lines_another_process_appends_are_read_and_their_turns_refused(tmp_path):
    q = write_queue(tmp_path / "queue.jsonl")
    out = tmp_path / "labels.jsonl"
    s = LabelStore(q, out)
    s.add("c0:2", "clear")
    with open(out, "a") as f:  # someone else's writer, behind this store's back
        f.write(json.dumps({"id": "c1:2", "needs_clarification": True, "decision_only": True, "query": "q",
                            "meta": {"label": {"by": "bob", "session": "x"}}}) + "\n")
    with pytest.raises(LabelConflict, match="by bob"):
        s.add("c1:2", "clear")
    assert s.progress()["other_writers"] == 1 and s.next_item()["id"] == "c2:2"
    s.close()


def test_read_queue_names_bad_lines(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"id": "a", "query": "q"}\n{"id": "a", "query": "q"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: turn 'a' is queued twice"):
        read_queue(p)
    p.write_text('{"query": "q"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:1: a queued turn needs a string 'id'"):
        read_queue(p)


def test_the_page_api(tmp_path):
    from fastapi.testclient import TestClient

    from clarifier.serving.label_page import label_app

    store = LabelStore(write_queue(tmp_path / "queue.jsonl", 4), tmp_path / "labels.jsonl")
    c = TestClient(label_app(store))
    assert "Clarifier labelling" in c.get("/").text
    first = c.get("/api/next").json()
    assert first["item"]["id"] == "c0:2" and first["progress"]["left"] == 4
    ok = c.post("/api/label", json={"id": "c0:2", "decision": "clarify", "question": "Which one?",
                                    "grounding_turns": [0], "session": "tab-1"})
    assert ok.status_code == 200 and ok.json()["progress"]["labelled"] == 1
    assert c.get("/api/next", params={"after": "c0:2"}).json()["item"]["id"] == "c1:2"
    again = c.post("/api/label", json={"id": "c0:2", "decision": "clear", "session": "tab-2"})
    assert again.status_code == 409 and "already labelled" in again.json()["detail"]
    assert c.post("/api/label", json={"id": "c1:2", "decision": "maybe"}).status_code == 422
    assert c.post("/api/label", json={"id": "c1:2", "decision": "clear", "extra": 1}).status_code == 422
    c.post("/api/label", json={"id": "c1:2", "decision": "clear", "session": "tab-2"})
    assert c.get("/api/progress").json()["pages_labelling"] == 2  # two tabs labelling: the page says so
    store.close()


def test_a_prelabel_confirmed_or_overturned_is_recorded_with_the_label(tmp_path):
    q = write_queue(tmp_path / "queue.jsonl", 4)
    rows = [json.loads(line) for line in q.read_text().splitlines()]
    rows[0]["meta"]["prelabel"] = {"needs_clarification": True, "rule": "served_question_answered"}
    rows[1]["meta"]["prelabel"] = {"needs_clarification": True, "rule": "missed_reformulated"}
    rows[2]["meta"]["prelabel"] = {"needs_clarification": False, "rule": "served_silent_continued"}
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "labels.jsonl"
    s = LabelStore(q, out)
    s.add("c0:2", "clarify")
    s.add("c1:2", "clear")  # the person overturns what happened next
    s.add("c2:2", "skip")
    s.add("c3:2", "clear")  # no pre-label
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["c0:2"]["meta"]["label"]["prelabel_agrees"] is True
    assert recs["c1:2"]["meta"]["label"]["prelabel_agrees"] is False
    assert "prelabel_agrees" not in recs["c3:2"]["meta"]["label"]
    assert recs["c0:2"]["meta"]["prelabel"]["rule"] == "served_question_answered"  # kept with the label
    assert s.progress()["prelabels"] == {"queued": 3, "confirmed": 1, "overturned": 1}
    s.close()
