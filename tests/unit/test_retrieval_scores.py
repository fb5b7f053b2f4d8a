"""The retriever's own scores: accepted per passage / document, validated, kept through the request log and the
data, and turned into the score profile and the embedding geometry (clarifier.core.retrieval)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from clarifier.core.chat_completions import ChatRequestError, parse_chat_request
from clarifier.core.request_record import request_record
from clarifier.core.retrieval import GEOMETRY, PROFILE, geometry, passage_scores, score_profile
from clarifier.core.schema import ClarifyRequest, ClarifyResponse, ConversationLog, Example, Passage
from clarifier.data.chatlog import audit_turns, clarify_request_from_chat

RESP = ClarifyResponse(needs_clarification=False, confidence=0.1, threshold=0.5, model_version="m/1")


def test_a_passage_score_is_optional_finite_and_absent_from_json_when_not_given():
    assert Passage(id="a", text="t").model_dump_json() == '{"id":"a","text":"t"}'  # set fingerprints unchanged
    assert json.loads(Passage(id="a", text="t", score=0.8).model_dump_json())["score"] == 0.8
    for bad in (float("nan"), float("inf"), "high", "0.8", False):  # a number, not a string or a bool
        with pytest.raises(ValidationError, match="score"):
            ClarifyRequest.model_validate({"query": "q", "passages": [{"id": "a", "text": "t", "score": bad}]})
    ex = Example.model_validate({"id": "e", "query": "q", "needs_clarification": False,
                                 "passages": [{"id": "a", "text": "t", "score": 2.5}]})
    assert Example.model_validate_json(ex.model_dump_json()).passages[0].score == 2.5


def test_scores_travel_from_chat_documents_and_clarify_requests_into_the_request_log():
    req = clarify_request_from_chat([{"role": "user", "content": "how do I reset it?"}],
                                    [{"doc_id": "kb-1", "text": "Router.", "score": 0.91},
                                     {"doc_id": "kb-2", "text": "Modem.", "relevance_score": 0.88}])
    assert [p.score for p in req.passages] == [0.91, 0.88]
    rec = request_record(req, RESP, route="chat", request_id="r", at=0)
    assert [p.get("score") for p in rec["turns"][-1]["passages"]] == [0.91, 0.88]
    unscored = request_record(ClarifyRequest(query="q", passages=[{"id": "a", "text": "t"}]), RESP, route="clarify",
                              request_id="r2", at=0)
    assert "score" not in unscored["turns"][-1]["passages"][0]
    log = ConversationLog.model_validate(rec)  # the data job and the audit read the log with its scores
    assert [p.score for p in log.turns[-1].passages] == [0.91, 0.88]
    body = {"messages": [{"role": "user", "content": "q"}], "documents": [{"doc_id": "a", "text": "t", "score": 1}]}
    assert parse_chat_request(body).documents[0]["score"] == 1


@pytest.mark.parametrize("score", ["high", True, float("nan")])
def test_a_bad_document_score_names_where(score):
    rec = {"messages": [{"role": "user", "content": "q", "documents": [{"doc_id": "a", "text": "t", "score": score}]}]}
    with pytest.raises(ValueError, match=r"messages\[0\]\.documents\[0\]\.score: the retriever's score must be a finite"):
        audit_turns(rec, "f")


def test_score_profile_reads_flat_and_peaked_retrievals_apart():
    assert len(score_profile([0.9, 0.5])) == len(PROFILE)
    peaked, flat = score_profile([0.92, 0.41, 0.40]), score_profile([0.71, 0.70, 0.69])
    assert peaked[0] == pytest.approx(0.92) and peaked[1] == pytest.approx(0.51) and peaked[2] == 1
    assert flat[1] == pytest.approx(0.01) and flat[2] == 3  # every passage near the top
    # BM25-like scales: "near the top" is a share of the range, so the order of the scores is what counts
    assert score_profile([30.0, 29.5, 10.0])[2] == 2 and score_profile([30.0, 20.0, 10.0])[2] == 1
    assert score_profile([]) == [0.0] * len(PROFILE) and score_profile([0.5])[1] == 1.0
    assert score_profile([0.5, 0.2])[4] == pytest.approx(math.log1p(2))
    with pytest.raises(ValueError, match="finite"):
        score_profile([0.5, float("nan")])


def test_passage_scores_only_when_every_passage_has_one():
    assert passage_scores([Passage(id="a", text="t", score=1.0), {"id": "b", "text": "u", "score": 0.5}]) == [1.0, 0.5]
    assert passage_scores([Passage(id="a", text="t", score=1.0), Passage(id="b", text="u")]) is None
    assert passage_scores([]) is None


def test_geometry_of_agreeing_and_disagreeing_passages():
    e = np.eye(4)
    q = (e[0] + e[1]) / np.sqrt(2)
    agree = geometry(q, np.stack([e[0], e[0]]), np.stack([q]))
    split = geometry(q, np.stack([e[0], e[1]]), None)
    assert len(agree) == len(GEOMETRY)
    assert agree[0] == pytest.approx(1.0) and split[0] == pytest.approx(0.0)  # pp_min: the passages disagree
    assert split[4] == pytest.approx(0.0) and split[5] == 2  # the query sits between them: no gap, both near top
    assert agree[7] == pytest.approx(1.0) and split[7] == 0.0  # the query repeats an earlier user turn
    assert geometry(q, np.zeros((0, 4)))[:6] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def _turns(n: int, seed: int, informative: bool, scored: bool = True):
    """Turns whose retriever scores are flat exactly when the turn needs a question (``informative``), or random."""
    import random

    rng = random.Random(seed)
    out, gold = [], []
    for i in range(n):
        ask = i % 2 == 0
        flat = ask if informative else rng.random() < 0.5
        top = rng.uniform(0.6, 0.9)
        scores = [top, top - (0.01 if flat else 0.3), top - (0.02 if flat else 0.35)]
        out.append(Example(id=f"t{i}", query="how do I reset it?", needs_clarification=False, meta={
            "conversation_id": f"c{i}"}, passages=[Passage(id=f"p{j}", text="x", score=s if scored else None)
                                                    for j, s in enumerate(scores)]))
        gold.append(ask)
    return out, gold


def test_retriever_score_check_says_when_the_scores_carry_what_the_model_misses():
    import random

    from clarifier.core.retrieval import retriever_score_check

    rng = random.Random(1)
    exs, gold = _turns(200, 0, informative=True)
    weak = [0.5 + (0.1 if g else 0.0) + rng.gauss(0, 0.3) for g in gold]  # a model that barely knows
    r = retriever_score_check(exs, gold, weak, folds=4)
    assert r["turns_with_scores"] == 200 and r["profile_auroc"] > 0.9
    assert r["adds_to_model"] and r["stacked_auroc"] > r["model_auroc"] and "worth feeding" in r["verdict"]
    noise, gold2 = _turns(200, 2, informative=False)
    strong = [(1.0 if g else 0.0) + rng.gauss(0, 0.5) for g in gold2]
    r2 = retriever_score_check(noise, gold2, strong, folds=4)
    assert not r2["adds_to_model"] and r2["verdict"].startswith("the retriever's scores add nothing measurable")
    unscored, gold3 = _turns(200, 3, informative=True, scored=False)
    assert retriever_score_check(unscored, gold3, weak, folds=4) is None  # nothing to measure: no figure


def test_the_audit_reports_the_retriever_check_on_labelled_turns_that_carry_scores():
    import random

    from clarifier.evaluation.audit import labelled_skill

    rng = random.Random(4)
    exs, gold = _turns(120, 5, informative=True)
    rows = [{"gold": g, "turn_json": e.model_dump_json(), "score": 0.5 + rng.gauss(0, 0.2)} for e, g in zip(exs, gold)]
    said, notes = [], []
    skill = labelled_skill(rows, 10, notes, said.append)
    assert skill["retriever_scores"]["adds_to_model"]
    assert any("the retriever's scores add" in line for line in said)
