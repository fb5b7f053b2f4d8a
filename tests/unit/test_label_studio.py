"""A labelling queue out to Label Studio's task format and its JSON export back as labels (clarifier.data.label_studio),
through the command line as a team would run it."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from clarifier.cli import app
from clarifier.core.schema import Example
from support.turns import queue_file as write_queue


def _annotated(tasks: list[dict]) -> list[dict]:
    """What Label Studio's Export -> JSON gives after a person labelled the tasks (ids and dates as it writes them)."""
    out = []
    for i, t in enumerate(tasks):
        t = {**t, "id": 100 + i, "project": 7}
        if i == 0:
            t["annotations"] = [
                {"id": 1, "updated_at": "2026-12-07T10:00:00Z", "was_cancelled": False, "result": [
                    {"from_name": "decision", "to_name": "query", "type": "choices", "value": {"choices": ["Clear"]}}]},
                {"id": 2, "updated_at": "2026-12-07T10:05:00Z", "was_cancelled": False, "result": [  # changed mind
                    {"from_name": "decision", "to_name": "query", "type": "choices",
                     "value": {"choices": ["Needs a question"]}},
                    {"from_name": "question", "to_name": "query", "type": "textarea",
                     "value": {"text": ["The router or the modem?"]}},
                    {"from_name": "grounding", "to_name": "conversation", "type": "textarea", "value": {"text": ["0"]}}]}]
        elif i == 1:
            t["annotations"] = [{"id": 3, "was_cancelled": False, "result": [
                {"from_name": "decision", "to_name": "query", "type": "choices", "value": {"choices": ["Clear"]}}]}]
        elif i == 2:
            t["annotations"] = [{"id": 4, "was_cancelled": True, "result": []}]  # skipped in Label Studio
        out.append(t)
    return out


def test_a_queue_goes_to_label_studio_and_its_annotations_come_back_as_labels(tmp_path):
    queue = write_queue(tmp_path / "queue.jsonl", 5)
    run = CliRunner().invoke
    res = run(app, ["label", "export", "--queue", str(queue), "--out", str(tmp_path / "ls" / "tasks.json")])
    assert res.exit_code == 0, res.output
    tasks = json.loads((tmp_path / "ls" / "tasks.json").read_text())
    assert len(tasks) == 5 and tasks[0]["data"]["turn_id"] == "c0:2"
    assert tasks[0]["data"]["conversation"].startswith("[0] user: I have a router")
    assert tasks[0]["predictions"][0]["result"][0]["value"]["choices"] == ["Needs a question"]  # score 0.9 >= 0.5
    config = (tmp_path / "ls" / "label-config.xml").read_text()
    assert '<Choices name="decision" toName="query"' in config and "$conversation" in config

    export = tmp_path / "export.json"
    export.write_text(json.dumps(_annotated(tasks)))
    labels = tmp_path / "labels.jsonl"
    res = run(app, ["label", "import", "--from", str(export), "--queue", str(queue), "--out", str(labels)])
    assert res.exit_code == 0, res.output
    assert "5 tasks: 2 labelled, 1 skipped, 2 without an annotation" in res.output
    recs = [json.loads(line) for line in labels.read_text().splitlines()]
    ex = [Example.model_validate(r) for r in recs]  # clarifier adapt reads them as they are
    assert [(e.id, e.needs_clarification) for e in ex] == [("c0:2", True), ("c1:2", False)]
    assert ex[0].clarifying_question == "The router or the modem?" and ex[0].grounding_turns == [0]  # latest annotation
    assert json.loads((tmp_path / "labels.skips.jsonl").read_text())["id"] == "c2:2"

    again = run(app, ["label", "import", "--from", str(export), "--queue", str(queue), "--out", str(labels)])
    assert again.exit_code == 0 and "3 already in" in again.output  # never labelled (or skipped) twice
    assert len(labels.read_text().splitlines()) == 2
    back = run(app, ["label", "export", "--queue", str(queue), "--out", str(tmp_path / "t2.json"), "--labels", str(labels)])
    assert back.exit_code == 0 and "2 with annotations" in back.output


def test_a_bad_export_names_the_task(tmp_path):
    queue = write_queue(tmp_path / "queue.jsonl", 2)
    bad = tmp_path / "bad.json"
    for body, match in [([{"data": {}}], "task 0: no data.turn_id"),
                        ([{"data": {"turn_id": "c0:2"}, "annotations": [{"result": [
                            {"from_name": "decision", "value": {"choices": ["Maybe"]}}]}]}], "decision \\['Maybe'\\]"),
                        ([{"data": {"turn_id": "c0:2"}, "annotations": [{"result": [
                            {"from_name": "decision", "value": {"choices": ["Needs a question"]}},
                            {"from_name": "grounding", "value": {"text": ["the first"]}}]}]}], "turn numbers"),
                        ({"tasks": []}, "is a list of tasks")]:
        bad.write_text(json.dumps(body))
        res = CliRunner().invoke(app, ["label", "import", "--from", str(bad), "--queue", str(queue), "--out",
                                       str(tmp_path / "l.jsonl")])
        assert res.exit_code == 2, res.output
        assert re.search(match, res.output), res.output


def test_a_prelabel_from_what_happened_next_is_the_pre_annotation(tmp_path):
    queue = write_queue(tmp_path / "queue.jsonl", 2)
    rows = [json.loads(line) for line in queue.read_text().splitlines()]
    rows[0]["meta"]["prelabel"] = {"needs_clarification": False, "rule": "served_silent_continued"}  # score says ask
    rows[1]["meta"]["prelabel"] = {"needs_clarification": True, "rule": "served_question_answered",
                                   "question": "Which router?"}
    queue.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(app, ["label", "export", "--queue", str(queue), "--out", str(tmp_path / "tasks.json")])
    assert res.exit_code == 0, res.output
    tasks = json.loads((tmp_path / "tasks.json").read_text())
    first, second = (t["predictions"][0] for t in tasks)
    assert first["model_version"] == "what-happened-next:served_silent_continued"
    assert first["result"][0]["value"]["choices"] == ["Clear"]
    assert second["result"][0]["value"]["choices"] == ["Needs a question"]
    assert second["result"][1]["value"]["text"] == ["Which router?"]
