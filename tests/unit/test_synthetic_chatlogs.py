"""clarifier.data.synthetic_chatlogs: OpenAI-style chat logs with planted failures -- determinism,
the transcripts parse as the audit reads them, the planted share is realized, the planted signals
are exactly the ones the audit's default signals read, impossible requests fail, files are written."""

from __future__ import annotations

import json

import pytest

from clarifier.core.config import load_config
from clarifier.data import synthetic_chatlogs as sc
from clarifier.data.chatlog import audit_turns
from clarifier.data.signals import matches, text_signals
from clarifier.data.synthetic_rag import content
from clarifier.data.synthetic_chatlogs import (ESCALATION_REPLIES, NO_ANSWER_REPLIES, generate_chatlogs,
                                               planted_summary, write_chatlogs)

SIGNALS_CFG = load_config().audit.signals
TEXT_SIGNALS = ("feedback", "no_answer", "escalation")


def _turns(records):
    """``(AuditTurn, planted entry)`` of every user turn."""
    for r in records:
        planted = r["planted"]
        turns = audit_turns(r, "fallback")
        assert sorted(int(t.id.rsplit(":", 1)[1]) for t in turns) == sorted(map(int, planted))
        for t in turns:
            yield t, planted[t.id.rsplit(":", 1)[1]]


@pytest.fixture(scope="module")
def noisy():
    # many failures, much feedback noise: every code path of the failure signals
    return generate_chatlogs(600, seed=5, planted_share=0.3, failure_rate=0.5, feedback_share=0.7, feedback_noise=0.3)


def test_deterministic():
    a = generate_chatlogs(80, seed=3)
    assert a == generate_chatlogs(80, seed=3)
    assert json.dumps(a) == json.dumps(generate_chatlogs(80, seed=3))
    assert a != generate_chatlogs(80, seed=4)
    assert a != generate_chatlogs(80, seed=3, planted_share=0.3)


def test_every_record_parses_as_the_audit_reads_it(noisy):
    records = noisy + generate_chatlogs(300, seed=0)
    kinds = {"tool": 0, "documents": 0, "parts": 0, "system": 0}
    for r in records:
        assert set(r) == {"id", "messages", "metadata", "planted"} and r["metadata"]["domain"]
        for m in r["messages"]:
            assert "needs_clarification" not in m and "label" not in m  # no gold label the audit would read
            kinds["tool"] += m["role"] == "tool"
            kinds["documents"] += "documents" in m
            kinds["parts"] += isinstance(m.get("content"), list)
            kinds["system"] += m["role"] == "system"
    assert all(kinds.values()), kinds
    n = 0
    for t, e in _turns(records):
        n += 1
        assert t.gold is None and t.answer and t.meta["domain"]
        assert set(e) >= {"needs_clarification", "failed", "signals"}
        if e["turn"] == "labelled":
            assert t.passages  # a labelled turn's passages come with it (tool messages or documents)
    assert n == planted_summary(records)["turns"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("share", [0.05, 0.15, 0.30])
def test_realized_share(seed, share):
    records = generate_chatlogs(2000, seed=seed, planted_share=share)
    s = planted_summary(records)
    assert s["failed"] > 500
    assert s["share"] == pytest.approx(share, abs=0.01)
    assert s["failure_rate"] == pytest.approx(0.3, abs=0.01)
    assert s["failed_needing_clarification"] == sum(
        e["failed"] and e["needs_clarification"] for r in records for e in r["planted"].values())


def test_planted_signals_are_the_signals_the_audit_reads(noisy):
    fired_on = {k: 0 for k in (*TEXT_SIGNALS, "reformulation", "positive_feedback_on_failed")}
    for t, e in _turns(noisy):
        sig = text_signals(t, SIGNALS_CFG)
        fired = {k for k in TEXT_SIGNALS if sig[k]}
        assert not sig["feedback_unknown"]
        if not e["failed"]:
            assert not fired, (t.id, t.answer, t.feedback)
            assert e["signals"] == []
            continue
        assert e["turn"] == "labelled"
        assert fired == set(e["signals"]) - {"reformulation"}, (t.id, t.answer, t.feedback, e)
        assert fired or "reformulation" in e["signals"]  # every failed turn carries a signal
        for k in fired:
            fired_on[k] += 1
        if e["feedback"] == "positive":
            assert sig["feedback"] is False
            fired_on["positive_feedback_on_failed"] += 1
        if "reformulation" in e["signals"]:
            fired_on["reformulation"] += 1
            assert t.next_user and sc.is_restatement(t.query, t.next_user), (t.query, t.next_user)
    assert all(v > 10 for v in fired_on.values()), fired_on


def test_no_restatement_after_a_turn_that_did_not_fail(noisy):
    """Consecutive user turns are never alike (same words, the same item) unless a restatement was planted."""
    items = sorted({r.item.lower() for d in content().domains for rs in d.readings.values() for r in rs})
    pairs = 0
    for t, e in _turns(noisy):
        if t.next_user and "reformulation" not in e["signals"]:
            pairs += 1
            assert not sc.is_restatement(t.query, t.next_user), (t.id, t.query, t.next_user)
            assert not sc._close(t.query, t.next_user, items), (t.id, t.query, t.next_user)
    assert pairs > 500


def test_failure_reply_templates_match_the_default_patterns():
    assert all(matches(x, SIGNALS_CFG.no_answer.patterns) for x in NO_ANSWER_REPLIES)
    assert not any(matches(x, SIGNALS_CFG.escalation.patterns) for x in NO_ANSWER_REPLIES)
    assert all(matches(x, SIGNALS_CFG.escalation.patterns) for x in ESCALATION_REPLIES)
    assert not any(matches(x, SIGNALS_CFG.no_answer.patterns) for x in ESCALATION_REPLIES)


@pytest.mark.parametrize("share,rate", [(0.9, 0.9), (0.0, 0.8), (1.0, 0.6)])
def test_impossible_combination(share, rate):
    with pytest.raises(ValueError, match="impossible"):
        generate_chatlogs(200, seed=0, planted_share=share, failure_rate=rate)


@pytest.mark.parametrize("kw", [{"planted_share": 1.2}, {"failure_rate": 0}, {"feedback_share": -0.1},
                                {"feedback_noise": 1.0}])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        generate_chatlogs(20, seed=0, **kw)


def test_write_chatlogs(tmp_path):
    out = tmp_path / "logs"
    files = write_chatlogs(str(out), 40, seed=2, shards=3, planted_share=0.2)
    assert [p.split("/")[-1] for p in files] == [f"chatlogs-{k:05d}.jsonl" for k in range(3)]
    records = [json.loads(line) for f in files for line in open(f)]
    assert len(records) == 40
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in generate_chatlogs(40, seed=2, planted_share=0.2))
    planted = json.loads((out / sc.PLANTED_FILE).read_text())
    assert planted["summary"] == planted_summary(records)
    assert planted["arguments"]["planted_share"] == 0.2 and planted["arguments"]["failure_rate"] == 0.3
    assert planted["seed"] == 2 and planted["conversations"] == 40 and planted["files"] == files
    assert 0 < planted["p_fail_given_needs_clarification"] < planted["p_fail_given_clear"] < 1


def test_data_synth_chat(tmp_path):
    from typer.testing import CliRunner

    from clarifier.cli import app

    runner = CliRunner()
    out = tmp_path / "chat"
    res = runner.invoke(app, ["data", "synth", "--out", str(out), "--n", "300", "--shards", "2", "--generator",
                              "synthetic_chat", "--planted-share", "0.25", "--failure-rate", "0.4"])
    assert res.exit_code == 0, res.output
    planted = json.loads((out / sc.PLANTED_FILE).read_text())
    assert planted["arguments"]["planted_share"] == 0.25 and planted["arguments"]["failure_rate"] == 0.4
    assert f"planted share {planted['summary']['share']:.3f}; requested 0.25" in " ".join(res.output.split())
    assert len(list(out.glob("chatlogs-*.jsonl"))) == 2
    res = runner.invoke(app, ["data", "synth", "--out", str(tmp_path / "bad"), "--n", "50", "--generator",
                              "synthetic_chat", "--planted-share", "0.9", "--failure-rate", "0.9"])
    assert res.exit_code == 2 and "impossible" in res.output


def test_not_a_training_source():
    """Chat transcripts are no ConversationLog: the data job's generator sources must not offer them."""
    from clarifier.data.sources import GENERATORS

    assert sc.GENERATOR not in GENERATORS and "clarifier.data.synthetic_chatlogs" not in GENERATORS.values()


@pytest.mark.slow
def test_the_audit_signals_exactly_the_planted_failures():
    """End to end with the audit's own signals, the MiniLM reformulation scorer included (about a
    minute on a 2-core box): a turn is signalled exactly when it was planted as failed."""
    pa = pytest.importorskip("pyarrow")
    from clarifier.data.signals import ReformulationScorer
    from clarifier.engine.similarity import EncoderNotAvailable, resolve_encoder

    try:
        resolve_encoder(None)
    except EncoderNotAvailable as exc:
        pytest.skip(str(exc))
    records = generate_chatlogs(300, seed=11, planted_share=0.3, failure_rate=0.5)
    rows = list(_turns(records))
    scorer = ReformulationScorer(SIGNALS_CFG.reformulation.encoder, SIGNALS_CFG.reformulation.min_similarity, cpus=1)
    table = scorer(pa.table({"query": [t.query for t, _ in rows], "next_user": [t.next_user for t, _ in rows]}))
    reform = table.column("reformulation").to_pylist()
    for (t, e), rf in zip(rows, reform):
        sig = text_signals(t, SIGNALS_CFG)
        signalled = rf or any(sig[k] for k in TEXT_SIGNALS)
        assert signalled == e["failed"], (t.id, t.query, t.next_user, e)
        if e["signals"] == ["reformulation"]:
            assert rf  # the only signal: the restatement is read as one


def test_deterministic_across_processes():
    """No set or hash order leaks into the records (PYTHONHASHSEED differs between processes)."""
    import os
    import subprocess
    import sys

    code = ("import hashlib, json; from clarifier.data.synthetic_chatlogs import generate_chatlogs; "
            "print(hashlib.sha256(json.dumps(generate_chatlogs(60, 4)).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": h}).stdout for h in ("1", "2")}
    assert len(digests) == 1


def test_labelled_share_labels_a_sample_with_the_planted_truth():
    from clarifier.data.chatlog import audit_turns

    plain = generate_chatlogs(60, seed=3)
    records = generate_chatlogs(60, seed=3, labelled_share=0.5)
    turns = [t for r in records for t in audit_turns(r, "f")]
    truth = {f"{r['id']}:{i}": e["needs_clarification"] for r in records for i, e in r["planted"].items()}
    gold = [t for t in turns if t.gold is not None]
    assert 0.35 * len(turns) < len(gold) < 0.65 * len(turns)
    assert all(t.gold == truth[t.id] for t in gold)
    strip = lambda r: [{k: v for k, v in m.items() if k != "needs_clarification"} for m in r["messages"]]  # noqa: E731
    assert [strip(r) for r in records] == [strip(r) for r in plain]  # the same logs otherwise
    assert all("planted" not in t.meta for t in turns)
