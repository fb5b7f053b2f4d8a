"""`clarifier label select` on a local Ray cluster: chat logs in a folder -> a reproducible labelling queue of
turns near the threshold plus a kept-apart slice, never queueing a labelled turn twice."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _logs(n: int) -> list[dict]:
    """n transcripts, two user turns each (the second labelled in every fifth conversation), on a few topics."""
    topics = ["router", "modem", "invoice", "password", "printer"]
    out = []
    for i in range(n):
        t = topics[i % len(topics)]
        second = {"role": "user", "content": f"how do I reset it? ({i})" if i % 2 else f"how do I reset the {t} {i}?"}
        if i % 5 == 0:
            second["needs_clarification"] = bool(i % 2)
        out.append({"id": f"c{i:02d}", "messages": [
            {"role": "user", "content": f"I have a {t} and a second {t} at home."},
            {"role": "assistant", "content": "Sure, what do you need?"},
            second,
            {"role": "tool", "tool_call_id": "t", "content": json.dumps([{"doc_id": "kb1", "text": f"Reset the {t}."}])},
            {"role": "assistant", "content": "Hold the button."}]})
    return out


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory, tiny_model_dir):
    from support.adapters import untrained_adapter

    return untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("label") / "model", threshold=0.5, r=2)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from support.tinymodel import build_tiny_bert

    return build_tiny_bert(tmp_path_factory.mktemp("label-bert") / "bert")


def _queue(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "queue.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_label_select_queues_uncertain_diverse_turns_and_a_kept_apart_slice(tmp_path, tiny_adapter, encoder,
                                                                             ray_local):
    from typer.testing import CliRunner

    from clarifier.cli import app
    from clarifier.core.schema import Example

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _logs(40)) + "{not json\n")
    run = lambda out, *extra: CliRunner().invoke(app, [  # noqa: E731
        "label", "select", "--logs", str(logs), "--out", str(out), "--model", str(tiny_adapter), "--n", "12",
        "--kept-apart", "4", "--encoder", str(encoder), "audit.batch_size=4", *extra])
    res = run(tmp_path / "q1")
    assert res.exit_code == 0, res.output
    assert "1 quarantined" in res.output and "queued 12 turns" in res.output
    # audit.actors=auto: as many actors as the cores hold, no more than the 5 blocks of 16 turns
    assert re.search(r"scoring 80 turns with [1-5] actor\(s\) \(audit.actors=auto\)", res.output), res.output
    q = _queue(tmp_path / "q1")
    parts = [r["meta"]["queue"]["part"] for r in q]
    assert len(q) == 12 and parts.count("kept_apart") == 4
    assert "kept_apart" in parts[:4]  # interleaved: an early prefix already holds part of the slice
    kept_convs = [r["meta"]["conversation_id"] for r in q if r["meta"]["queue"]["part"] == "kept_apart"]
    active_convs = {r["meta"]["conversation_id"] for r in q if r["meta"]["queue"]["part"] == "active"}
    assert len(set(kept_convs)) == 4 and not active_convs & set(kept_convs)
    assert [r["meta"]["queue"]["position"] for r in q] == list(range(1, 13))
    labelled_in_logs = {f"c{i:02d}:2" for i in range(0, 40, 5)}
    assert not {r["id"] for r in q} & labelled_in_logs  # a gold label in the logs: never queued
    for r in q:  # a queue line plus a label is a labelled turn adapt reads
        Example.model_validate({**r, "needs_clarification": False})
        assert r["query"] and r["meta"]["queue"]["source"].endswith("part-0.jsonl")
    manifest = json.loads((tmp_path / "q1" / "queue.json").read_text())
    assert manifest["counts"]["turns"] == 80 and manifest["counts"]["labelled_in_logs"] == 8
    assert manifest["counts"]["quarantined"] == 1 and manifest["kept_apart"] == 4

    # the next round, from the first queue's ids, drawn at random this time: nothing queued twice (the same seed
    # and scores: the same kept-apart order, so only the exclusion keeps them apart)
    nxt = run(tmp_path / "q3", "--labelled", str(tmp_path / "q1" / "queue.jsonl"), "--strategy", "random")
    assert nxt.exit_code == 0, nxt.output
    assert "8 drawn at random, 4 kept apart" in nxt.output, nxt.output
    q3 = _queue(tmp_path / "q3")
    assert len(q3) == 12 and not {r["id"] for r in q3} & {r["id"] for r in q}
    assert sorted({r["meta"]["queue"]["part"] for r in q3}) == ["kept_apart", "random"]
    m3 = json.loads((tmp_path / "q3" / "queue.json").read_text())
    assert m3["strategy"] == "random" and m3["random"] == 8 and manifest["strategy"] == "active"
    res = run(tmp_path / "q4", "--strategy", "uncertain")
    assert res.exit_code == 2 and "strategy 'uncertain': one of active, random" in res.output

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "no id"}\n')
    res = run(tmp_path / "q2", "--labelled", str(bad))
    assert res.exit_code == 2 and "bad.jsonl:1: a labelled turn needs a string 'id'" in res.output


@pytest.mark.timeout(600)
def test_label_select_on_the_request_log_queues_each_turn_once_with_its_prelabel(tmp_path, tiny_adapter, encoder,
                                                                                ray_local):
    from typer.testing import CliRunner

    from clarifier.cli import app
    from support.served import conversation

    logs = tmp_path / "request-log"
    logs.mkdir()
    records = []
    for i in range(8):  # three requests per conversation, each repeating the earlier turns in its history
        ask = "The router or the modem?" if i % 2 else None
        records += conversation(f"r{i}", [("how do I reset it?", ask, ask or "Hold the button."),
                                          ("the modem" if ask else f"what about the printer {i}?", None, "Done."),
                                          ("thanks", None, "Bye.")])
    (logs / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records)
                                       + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    res = CliRunner().invoke(app, ["label", "select", "--logs", str(logs), "--out", str(tmp_path / "q"), "--model",
                                   str(tiny_adapter), "--n", "24", "--kept-apart", "4", "--encoder", str(encoder),
                                   "audit.batch_size=4"])
    assert res.exit_code == 0, res.output
    assert "request log" in res.output and "1 quarantined" in res.output
    q = _queue(tmp_path / "q")
    ids = [r["id"] for r in q]
    # 8 conversations x 3 user turns, each read once; the 4 kept apart take their conversations out of the rest
    assert len(ids) == len(set(ids)) == 16
    for r in q:
        conv, turn = r["id"].split(":")
        pre = r["meta"].get("prelabel")
        if turn == "4":
            assert pre is None  # nothing followed the last turn
        elif turn == "0" and int(conv[1:]) % 2:
            assert pre["needs_clarification"] is True and pre["question"] == "The router or the modem?"
            assert pre["rule"] == "served_question_answered"
        else:
            assert pre["needs_clarification"] is False and pre["rule"] == "served_silent_continued"
    manifest = json.loads((tmp_path / "q" / "queue.json").read_text())
    assert manifest["request_log"] is True and manifest["counts"]["turns"] == 24
    assert manifest["prelabelled"]["turns"] == sum(1 for r in q if r["meta"].get("prelabel"))
    assert manifest["counts"]["records"] == 25 and manifest["counts"]["quarantined"] == 1

    # the audit reads the same request log the same way: 24 user turns, not every request's history again (48)
    res = CliRunner().invoke(app, ["audit", "--logs", str(logs), "--model", str(tiny_adapter), "--out",
                                   str(tmp_path / "audit"), f"audit.signals.reformulation.encoder={encoder}",
                                   "audit.bootstrap=200", "audit.sample_questions=4", "audit.batch_size=4"])
    assert res.exit_code == 0, res.output
    assert "a serving request log" in res.output and "24 user turns, 1 quarantined" in res.output
    assert "24 user turns in 25 request-log records of 8 conversations" in res.output  # 24 requests + 1 quarantined
