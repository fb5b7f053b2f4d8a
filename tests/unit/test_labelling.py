"""Raw-log labelling rules on hand-written conversations (and on PACIFIC's real dialogues)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from clarifier.core.config import ConfigError, LabellingConfig, build_config
from clarifier.data.labelling import FILTER_REASONS, content_words, is_clarifying_question, label_conversation, lexical_grounding, question_text
from support.paths import PUBLIC
from clarifier.data.validate import parse_line, parse_line_full
from clarifier.core.schema import ConversationLog, Turn

RULES = LabellingConfig()


def _log(*turns, cid="c1", **kw):
    return ConversationLog(conversation_id=cid, turns=[{"role": r, "text": t} for r, t in turns], **kw)


@pytest.mark.parametrize("text", [
    "Do you mean the router or the modem?",
    "Which one: the checking or the savings account?",
    "Could you clarify which account you mean?",
    "Which year are you asking about?",
    "Sure. Which of your two cards do you want to block?",
    "Do you want to reset the Netgear router or the Arris modem?",
    "When you say 'it', are you talking about the laptop?",
])
def test_clarifying_questions_are_detected(text):
    assert is_clarifying_question(text, RULES)


@pytest.mark.parametrize("text", [
    "Anything else?",
    "Hold the reset button for ten seconds. Anything else I can help with?",
    "Hold the reset button for ten seconds.",
    "Does that help?",
    "Is it plugged in?",  # a question, but none of the clarification patterns
    "Do you mean the router",  # no question mark
    "",
    "Here is a long answer. " * 15 + "Which one do you mean?",  # over max_question_chars: an answer
])
def test_answers_and_courtesy_questions_are_not_clarifying(text):
    assert not is_clarifying_question(text, RULES)


def test_detection_rules_are_configurable():
    assert is_clarifying_question("Do you mean the router", RULES.model_copy(update={"require_question_mark": False}))
    assert is_clarifying_question("Is it plugged in?", RULES.model_copy(update={"patterns": []}))
    assert not is_clarifying_question("Anything else?", RULES.model_copy(update={"patterns": []}))
    no_excl = RULES.model_copy(update={"exclude_patterns": [], "patterns": [r"anything"]})
    assert is_clarifying_question("Anything else?", no_excl)
    custom = RULES.model_copy(update={"patterns": [r"\bmeinen sie\b"]})
    assert is_clarifying_question("Meinen Sie den Router?", custom) and not is_clarifying_question("Do you mean X?", custom)
    assert not is_clarifying_question("Which one do you mean?" + " x" * 20, RULES.model_copy(update={"max_question_chars": 30}))


def test_bad_pattern_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"data\.labelling\.patterns.*not a valid regex"):
        build_config({}, ["data.labelling.patterns=['(unclosed']"])
    cfg = build_config({}, ["data.labelling.enabled=true", "data.labelling.max_question_chars=120"])
    assert cfg.data.labelling.enabled and cfg.data.labelling.max_question_chars == 120


ROUTER = _log(
    ("user", "My Netgear router drops Wi-Fi and the Arris modem blinks orange."),  # 0
    ("assistant", "Both can cause that."),                                        # 1
    ("user", "How do I reset it?"),                                               # 2 -> positive
    ("assistant", "Do you mean the router or the modem?"),                        # 3
    ("user", "The router."),                                                      # 4 -> negative
    ("assistant", "Hold its reset button for ten seconds."),                      # 5
    ("user", "Thanks!"),                                                          # 6 -> no_reply
    domain="devices", meta={"tenant": "t1"},
)


def test_positive_negative_and_unknown_turns():
    res = label_conversation(ROUTER, RULES)
    by_turn = {e.meta["turn_index"]: e for e in res.examples}
    assert sorted(by_turn) == [0, 2, 4]
    pos = by_turn[2]
    assert pos.id == "c1:2" and pos.needs_clarification and pos.query == "How do I reset it?"
    assert pos.clarifying_question == "Do you mean the router or the modem?"
    assert [t.text for t in pos.history] == [t.text for t in ROUTER.turns[:2]]
    assert pos.grounding_turns == [0]  # router/modem named only in turn 0
    assert pos.meta["labelling_rule"] == "clarifying_question_answered" and pos.meta["question_turn"] == 3
    assert pos.meta["conversation_id"] == "c1" and pos.meta["domain"] == "devices" and pos.meta["tenant"] == "t1"
    assert not by_turn[0].needs_clarification and by_turn[0].history == []
    assert not by_turn[4].needs_clarification and by_turn[4].meta["labelling_rule"] == "direct_answer"
    assert by_turn[4].history[-1].text == "Do you mean the router or the modem?"
    assert [(f.turn_index, f.reason) for f in res.filtered] == [(6, "no_reply")]
    assert set(f.reason for f in res.filtered) <= set(FILTER_REASONS)


def test_rule_labelled_turns_keep_their_own_passages_and_meta():
    log = ConversationLog.model_validate({"conversation_id": "r", "passages": [{"id": "c", "text": "conversation-level"}],
                                          "meta": {"tenant": "t1"}, "turns": [
        {"role": "user", "text": "what's the limit?", "passages": [{"id": "p1", "text": "ATM limit"}], "meta": {"retriever": "bm25"}},
        {"role": "assistant", "text": "Do you mean the ATM limit or the credit limit?"},
        {"role": "user", "text": "the credit limit"},
        {"role": "assistant", "text": "It is 5,000."}]})
    pos, neg = label_conversation(log, RULES).examples
    assert pos.needs_clarification and [p.text for p in pos.passages] == ["ATM limit"]
    assert pos.meta["retriever"] == "bm25" and pos.meta["tenant"] == "t1" and pos.meta["label_source"] == "rules"
    assert not neg.needs_clarification and [p.text for p in neg.passages] == ["conversation-level"]
    assert "retriever" not in neg.meta


def test_clarification_without_user_reply_is_filtered():
    res = label_conversation(_log(("user", "reset it"), ("assistant", "Which one, the router or the modem?")), RULES)
    assert res.examples == [] and [(f.turn_index, f.reason) for f in res.filtered] == [(0, "clarification_unanswered")]
    # the assistant keeps talking instead of waiting for the user: still no reply to the question
    res = label_conversation(_log(("user", "reset it"), ("assistant", "Which one, the router or the modem?"),
                                  ("assistant", "Hello?")), RULES)
    assert [f.reason for f in res.filtered] == ["clarification_unanswered"]


def test_next_turn_user_empty_turns_and_system_turns():
    res = label_conversation(_log(("user", "hi"), ("user", "reset my router"), ("assistant", "Hold the button.")), RULES)
    assert [(f.turn_index, f.reason) for f in res.filtered] == [(0, "next_turn_is_user")]
    assert [e.meta["turn_index"] for e in res.examples] == [1] and len(res.examples[0].history) == 1

    res = label_conversation(_log(("user", "   "), ("assistant", "Hi"), ("user", "close it"), ("assistant", " ")), RULES)
    assert [(f.turn_index, f.reason) for f in res.filtered] == [(0, "empty_query"), (2, "empty_reply")]

    res = label_conversation(_log(
        ("system", "You are a bank assistant. Accounts: checking, savings."),
        ("user", "I have a checking account and a savings account."),
        ("user", "close it"),
        ("system", "tool: lookup done"),
        ("assistant", "Which account do you want to close, the checking or the savings account?"),
        ("system", "note"),
        ("user", "savings"),
        ("assistant", "Done."),
    ), RULES)
    by_turn = {e.meta["turn_index"]: e for e in res.examples}
    assert by_turn[2].needs_clarification and by_turn[2].meta["question_turn"] == 4
    assert by_turn[2].history[0].role == "system"
    assert by_turn[2].grounding_turns == [1]  # the system turn names the accounts too, but is never grounding
    assert not by_turn[6].needs_clarification
    assert [(f.turn_index, f.reason) for f in res.filtered] == [(1, "next_turn_is_user")]


def test_anything_else_is_an_answer():
    res = label_conversation(_log(("user", "How do I reset the router?"),
                                  ("assistant", "Hold the button for 10 s. Anything else?"), ("user", "no")), RULES)
    assert [e.needs_clarification for e in res.examples] == [False]
    assert [f.reason for f in res.filtered] == ["no_reply"]


def test_grounding_ignores_words_the_question_shares_with_the_query():
    history = [Turn(role="user", text="I want to close something."),
               Turn(role="assistant", text="OK."),
               Turn(role="user", text="I have checking accounts and a savings account.")]
    q, query = "Which account do you want to close?", "how do I close it?"
    assert lexical_grounding(q, query, history, RULES) == [2]  # 'close' is in the query: not evidence
    assert lexical_grounding("Which one do you mean?", query, history, RULES) == []  # only stopwords
    assert lexical_grounding(q, query, history, RULES.model_copy(update={"grounding": "none"})) == []
    assert lexical_grounding(q, query, history, RULES.model_copy(update={"extra_stopwords": ["account"]})) == []


def test_grounding_max_turns_keeps_the_latest_and_numbers_count():
    history = [Turn(role="user", text="Revenue in 2018?"), Turn(role="assistant", text="12 million"),
               Turn(role="user", text="And in 2019?"), Turn(role="assistant", text="15 million")]
    assert lexical_grounding("2018 or 2019?", "what is the change?", history, RULES) == [0, 2]
    assert lexical_grounding("2018 or 2019?", "what is the change?", history,
                             RULES.model_copy(update={"max_grounding_turns": 1})) == [2]


def test_content_words_and_question_text():
    assert content_words("Do you mean the Routers or the modem in 2019?") == {"router", "modem", "2019"}
    full = "I see two accounts on your profile. Which one do you mean?"
    assert question_text(full, RULES) == full
    assert question_text(full, RULES.model_copy(update={"question_text": "from_question"})) == "Which one do you mean?"


# ---- data-job validation with labelling ---------------------------------------------------------


def _raw(log: ConversationLog) -> str:
    return log.model_dump_json()


def test_parse_line_labels_unlabelled_logs_only_when_enabled():
    line = _raw(ROUTER)
    examples, q = parse_line(line, "raw.jsonl", 3)
    assert examples == [] and "no labelled user turns" in q["reason"] and "data.labelling.enabled" in q["reason"]
    enabled = RULES.model_copy(update={"enabled": True})
    examples, q, filtered = parse_line_full(line, "raw.jsonl", 3, labelling=enabled)
    assert q is None and [e.id for e in examples] == ["c1:0", "c1:2", "c1:4"]
    assert [(f.turn_index, f.reason) for f in filtered] == [(6, "no_reply")]
    # a disabled config behaves like no config
    assert parse_line_full(line, "raw.jsonl", 3, labelling=RULES)[1] is not None


def test_gold_labels_win_and_empty_results_are_quarantined_with_reasons():
    enabled = RULES.model_copy(update={"enabled": True})
    gold = {"conversation_id": "g", "turns": [
        {"role": "user", "text": "How do I reset it?", "label": {"needs_clarification": False}},
        {"role": "assistant", "text": "Do you mean the router or the modem?"},
        {"role": "user", "text": "router"}]}
    examples, q, filtered = parse_line_full(json.dumps(gold), "x", 1, labelling=enabled)
    assert q is None and len(examples) == 1 and not examples[0].needs_clarification and filtered == []
    lonely = json.dumps({"conversation_id": "l", "turns": [{"role": "user", "text": "hello?"}]})
    examples, q, filtered = parse_line_full(lonely, "x", 9, labelling=enabled)
    assert examples == [] and q["line"] == 9 and "turn 0 no_reply" in q["reason"]


# ---- real data: the rules recover PACIFIC's req_clari labels --------------------------------------


PACIFIC = PUBLIC / "pacific" / "validation.json"


@pytest.mark.skipif(not PACIFIC.is_file(), reason=f"PACIFIC not found at {PACIFIC} (../shared beside the repository)")
def test_rules_recover_pacific_clarifications():
    from clarifier.data.importers.pacific import render_answer

    dialogues = json.loads(PACIFIC.read_text())
    agree = total = positives = 0
    for k, d in enumerate(dialogues):
        turns, gold = [], {}
        for q in d["questions"]:
            gold[len(turns)] = q["req_clari"]
            turns += [{"role": "user", "text": q["question"]},
                      {"role": "assistant", "text": q["answer"][0] if q["req_clari"] else render_answer(q["answer"], q["scale"])}]
        res = label_conversation(ConversationLog(conversation_id=f"d{k}", turns=turns), RULES)
        assert res.filtered == []  # every PACIFIC user turn has an assistant reply, and every clarification a user answer
        for e in res.examples:
            total += 1
            positives += e.needs_clarification
            agree += e.needs_clarification == gold[e.meta["turn_index"]]
    assert total == 1982 and positives == 320 and agree == 1982


# ---- synthetic logs: gold labels turned into assistant behaviour, then recovered by the rules ----


def _synthetic_as_raw(conv: dict) -> tuple[dict, dict[int, dict]]:
    """Each gold label becomes what the assistant did: ask the gold question (and get a reply), or answer."""
    turns, gold, new_index = [], {}, {}
    for k, t in enumerate(conv["turns"]):
        new_index[k] = len(turns)
        turns.append({"role": t["role"], "text": t["text"]})
        lab = t.get("label")
        if not lab:
            continue
        gold[len(turns) - 1] = dict(lab, grounding_turns=[new_index[g] for g in lab.get("grounding_turns", [])])
        if lab["needs_clarification"]:
            turns += [{"role": "assistant", "text": lab["clarifying_question"]}, {"role": "user", "text": "The first one."},
                      {"role": "assistant", "text": "Here is how to do that."}]
        else:
            turns.append({"role": "assistant", "text": "Here is how to do that."})
    return dict(conv, turns=turns), gold


def test_rules_recover_synthetic_gold_decisions_and_most_grounding():
    from clarifier.data.synthetic import generate_conversations

    decisions = agree = clarify = grounding_exact = all_mentions_exact = 0
    for conv in generate_conversations(400, 0):
        raw, gold = _synthetic_as_raw(conv)
        log = ConversationLog.model_validate(raw)
        by_turn = {e.meta["turn_index"]: e for e in label_conversation(log, RULES).examples}
        loose = {e.meta["turn_index"]: e for e in label_conversation(
            log, RULES.model_copy(update={"grounding": "all_mentions"})).examples}
        for i, lab in gold.items():
            decisions += 1
            agree += by_turn[i].needs_clarification == lab["needs_clarification"]
            if lab["needs_clarification"]:
                clarify += 1
                grounding_exact += by_turn[i].grounding_turns == lab["grounding_turns"]
                all_mentions_exact += loose[i].grounding_turns == lab["grounding_turns"]
    assert (decisions, agree, clarify) == (464, 464, 221)
    assert grounding_exact == 210 and all_mentions_exact == 89  # the numbers quoted in the module docstring


# ---- the data job's parse stage (pure, no Ray): JSONL and Parquet, labelled and filtered rows -----


def test_parse_files_emits_examples_filtered_turns_and_reads_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from clarifier.data.stages import parse_files

    (tmp_path / "raw.jsonl").write_text(_raw(ROUTER) + "\n\n" + json.dumps({"conversation_id": "l", "turns": [
        {"role": "user", "text": "hello?"}]}) + "\n")
    pq.write_table(pa.Table.from_pylist([
        {"id": "e1", "query": "what is the fee?", "needs_clarification": False, "conversation_id": None, "turns": None},
        {"id": None, "query": None, "needs_clarification": None, "conversation_id": "p1",
         "turns": [{"role": "user", "text": "close my account"}, {"role": "assistant", "text": "Which account do you mean?"},
                   {"role": "user", "text": "savings"}]},
    ]), tmp_path / "mixed.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"nope")
    paths = pa.table({"path": [str(tmp_path / n) for n in ("raw.jsonl", "mixed.parquet", "bad.parquet")]})
    kw = dict(filesystem=pafs.LocalFileSystem(), scheme="", seed=0, fractions={"train": 1.0}, max_turn_chars=4000)

    rows = parse_files(paths, labelling=RULES.model_copy(update={"enabled": True}).model_dump(), **kw).to_pylist()
    kinds = Counter((r["kind"], r["source"].rsplit("/", 1)[-1]) for r in rows)
    assert kinds == Counter({("example", "raw.jsonl"): 3, ("filtered", "raw.jsonl"): 1, ("quarantine", "raw.jsonl"): 1,
                             ("example", "mixed.parquet"): 2, ("filtered", "mixed.parquet"): 1,
                             ("quarantine", "bad.parquet"): 1, ("file", "raw.jsonl"): 1, ("file", "mixed.parquet"): 1,
                             ("file", "bad.parquet"): 1})
    filtered = {r["id"]: r for r in rows if r["kind"] == "filtered"}
    assert filtered["c1:6"]["reason"] == "labelling:no_reply" and filtered["c1:6"]["raw"] == "Thanks!"
    assert filtered["c1:6"]["line"] == 1 and filtered["c1:6"]["split"] == "train"
    assert filtered["p1:2"]["reason"] == "labelling:no_reply" and filtered["p1:2"]["line"] == 2
    files = {r["source"].rsplit("/", 1)[-1]: r for r in rows if r["kind"] == "file"}
    assert (files["raw.jsonl"]["n_lines"], files["raw.jsonl"]["n_blank"]) == (2, 1)
    assert files["mixed.parquet"]["n_lines"] == 2 and files["bad.parquet"]["n_lines"] == 1
    quarantine = {r["source"].rsplit("/", 1)[-1]: r for r in rows if r["kind"] == "quarantine"}
    assert quarantine["raw.jsonl"]["line"] == 3 and "turn 0 no_reply" in quarantine["raw.jsonl"]["reason"]
    assert quarantine["bad.parquet"]["line"] == 0 and quarantine["bad.parquet"]["reason"].startswith("cannot read Parquet")
    ex = {r["id"]: r for r in rows if r["kind"] == "example"}
    assert ex["p1:0"]["needs_clarification"] and ex["e1"]["line"] == 1 and not ex["e1"]["needs_clarification"]

    # without labelling, the unlabelled logs are quarantined and nothing is filtered
    rows = parse_files(paths, **kw).to_pylist()
    assert not any(r["kind"] == "filtered" for r in rows)
    assert sum(r["kind"] == "quarantine" for r in rows) == 4
