"""clarifier.data.synthetic_rag: deterministic RAG conversation logs whose ambiguity is in the
retrieved passages -- balance, labels that the passages (not the wording) decide, grounding,
what the prompt shows, schema validity, surface-level leakage."""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from clarifier.core.prompt import PromptOptions, render_user_message
from clarifier.core.schema import ConversationLog, Example
from clarifier.data import synthetic_rag
from clarifier.data.synthetic_rag import CLARIFY_KINDS, CLEAR_KINDS, KINDS, content, generate_conversations, write_logs
from clarifier.data.validate import parse_line

N, SEED = 400, 0  # the default run the module docstring describes
PASSAGE_DRIVEN = ("rag_ambiguous", "rag_illformed_multi")
ONE_READING = ("rag_settled", "rag_illformed_single")
KEY_CHARS = 250  # the reading must be within this many characters (the prompt clips at 300)


@pytest.fixture(scope="module")
def convs():
    return generate_conversations(N, SEED)


@pytest.fixture(scope="module")
def examples(convs) -> list[Example]:
    return [e for c in convs for e in ConversationLog.model_validate(c).explode()]


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def _core(query: str) -> str:
    """The query without the greeting prefix / thanks suffix every kind gets alike."""
    g = content().generic
    q = _norm(query)
    for pre in g["prefixes"]:
        if q.startswith(_norm(pre) + " "):
            q = q[len(_norm(pre)) + 1:]
    for suf in g["suffixes"]:
        if q.endswith(" " + _norm(suf)):
            q = q[: -len(_norm(suf)) - 1]
    return q


def test_deterministic_for_a_seed():
    assert generate_conversations(30, seed=5) == generate_conversations(30, seed=5)
    assert generate_conversations(30, seed=5)[:10] == generate_conversations(10, seed=5)
    assert generate_conversations(30, seed=5) != generate_conversations(30, seed=6)


def test_every_written_line_passes_the_platform_validator(tmp_path: Path):
    uris = write_logs(str(tmp_path / "logs"), n=120, seed=3, shards=3)
    assert len(uris) == 3
    lines = [line for u in uris for line in Path(u).read_text().splitlines()]
    assert len(lines) == 120
    n_examples = 0
    for k, line in enumerate(lines, 1):
        exs, quarantined = parse_line(line, source="synthetic_rag", line_no=k)
        assert quarantined is None, quarantined
        assert exs and all(e.passages for e in exs)  # every labelled turn has its own retrieval
        n_examples += len(exs)
    assert n_examples == len([e for c in generate_conversations(120, 3) for e in ConversationLog.model_validate(c).explode()])


def test_labels_balanced_overall_and_in_every_domain(examples):
    by_domain: dict[str, Counter] = defaultdict(Counter)
    for e in examples:
        by_domain[e.meta["domain"]][e.needs_clarification] += 1
    assert len(by_domain) >= 12
    for d, c in by_domain.items():
        assert abs(c[True] - c[False]) <= 1, (d, c)  # chosen against the domain's running count
    assert abs(sum(e.needs_clarification for e in examples) / len(examples) - 0.5) < 0.02


def test_every_kind_occurs_with_its_label(examples):
    kinds = Counter((e.meta["kind"], e.needs_clarification) for e in examples)
    assert {k for k, _ in kinds} == set(KINDS)
    for (kind, clarify) in kinds:
        assert clarify == (kind in CLARIFY_KINDS), kind


@pytest.fixture(scope="module")
def large() -> list[Example]:
    """Enough turns (~2,300) that the frequent query strings occur 10-20 times each."""
    return [e for c in generate_conversations(2000, seed=1) for e in ConversationLog.model_validate(c).explode()]


def test_same_query_surface_with_both_labels(examples, large):
    labels: dict[str, set] = defaultdict(set)
    for e in large:
        labels[e.query].add(e.needs_clarification)
    counts = Counter(e.query for e in large)
    frequent = [q for q, k in counts.items() if k >= 10]
    assert len(frequent) >= 20
    one_label = {q: labels[q] for q in frequent if labels[q] != {True, False}}
    assert not one_label, one_label  # a bag of words over the frequent queries cannot tell the label
    assert sum(len({e.needs_clarification for e in examples if e.query == q}) == 2
               for q in {e.query for e in examples}) >= 40
    # the settled turns ask with the forms of the clarify turns (the wording alone cannot decide)
    clar = {_core(e.query) for e in large if e.needs_clarification}
    amb = {_core(e.query) for e in large if e.meta["kind"] == "rag_ambiguous"}
    settled = [_core(e.query) for e in large if e.meta["kind"] == "rag_settled"]
    assert sum(q in clar for q in settled) / len(settled) > 0.95
    assert sum(q in amb for q in settled) / len(settled) > 0.8  # the rest: pronoun forms after a named item


@pytest.mark.parametrize("size", [lambda e: len(e.query), lambda e: len(e.history), lambda e: len(e.passages)],
                         ids=["query_chars", "history_turns", "passages"])
def test_sizes_do_not_give_the_label_away(examples, large, size):
    for sample in (examples, large):
        clar = statistics.mean(size(e) for e in sample if e.needs_clarification)
        clear = statistics.mean(size(e) for e in sample if not e.needs_clarification)
        assert abs(clar - clear) / max(clar, clear) < 0.2, (clar, clear)


def test_passage_driven_ambiguity_carries_two_readings_in_the_shown_passages(examples):
    amb = [e for e in examples if e.meta["kind"] in PASSAGE_DRIVEN]
    assert len(amb) > 100
    for e in amb:
        items = e.meta["passage_items"]
        shown = {it for it in items[: PromptOptions().max_passages] if it}
        assert len(shown) >= 2 and shown == set(e.meta["candidates"]), e.id
        assert sorted(e.grounding_passages) == sorted(p.id for p, it in zip(e.passages, items) if it)
        assert e.grounding_turns == [] or e.meta["kind"] == "rag_illformed_multi"


def test_clarify_questions_name_the_candidates_and_grounding_points_at_them(examples):
    clar = [e for e in examples if e.needs_clarification]
    for e in clar:
        ids = {p.id for p in e.passages}
        assert set(e.grounding_passages) <= ids and e.clarifying_question.endswith("?")
        for name in e.meta["candidates"]:
            assert name in e.clarifying_question, (e.id, name)
        by_id = {p.id: p.text for p in e.passages}
        for pid in e.grounding_passages:
            assert any(_norm(n) in _norm(by_id[pid])[:KEY_CHARS] for n in e.meta["candidates"]), (e.id, pid)
        naming = [i for i, t in enumerate(e.history)
                  if t.role != "system" and any(n.lower() in t.text.lower() for n in e.meta["candidates"])]
        assert e.grounding_turns == naming, e.id
    hist = [e for e in clar if e.meta["kind"] == "rag_ambiguous_history"]
    assert hist and all(e.grounding_turns for e in hist)
    assert any(e.history[i].role == "assistant" for e in hist for i in e.grounding_turns)  # the assistant offered both
    assert any(not e.grounding_passages for e in hist)  # retrieval missed both: the history alone decides


def test_clear_turns(examples):
    clear = [e for e in examples if not e.needs_clarification]
    for e in clear:
        assert e.clarifying_question is None and e.grounding_turns == [] and e.grounding_passages == []
        readings = {it for it in e.meta["passage_items"] if it}
        if e.meta["kind"] in ONE_READING:
            assert readings == set(e.meta["candidates"]), e.id
        if e.meta["kind"] in ("rag_explicit",):
            assert len(readings) >= 2 and e.meta["candidates"][0].lower() in e.query.lower(), e.id
    resolved = [e for e in clear if e.meta["kind"] in ("rag_history_resolved", "rag_short_in_context")]
    assert resolved and all(any(e.meta["candidates"][0] in t.text for t in e.history) for e in resolved)
    assert any(len({it for it in e.meta["passage_items"] if it}) >= 2 for e in resolved)
    # the hard negatives use the pronoun, short and ill-formed forms the clarify turns use
    pronoun = {_norm(q) for f in content().families.values() for q in f.pronoun}
    assert any(_norm(e.query) in pronoun for e in resolved)


def test_passages_put_the_reading_where_the_prompt_shows_it(examples):
    opts = PromptOptions()
    counts, lengths = Counter(), []
    for e in examples:
        counts[len(e.passages)] += 1
        lengths += [len(p.text) for p in e.passages]
        items = e.meta["passage_items"]
        assert len(items) == len(e.passages) and all(it is None for it in items[opts.max_passages:]), e.id
        for p, it in zip(e.passages, items):
            if it:
                assert _norm(it) in _norm(p.text)[:KEY_CHARS], (e.id, p.text)
        if e.needs_clarification and e.grounding_passages:
            shown = render_user_message(e.history, e.query, e.passages, opts)
            for pid in e.grounding_passages:
                text = next(p.text for p in e.passages if p.id == pid)
                assert f"[{pid}] " + " ".join(text.split())[:KEY_CHARS] in shown
    assert set(counts) == {1, 2, 3, 4}
    assert min(lengths) < 60 and max(lengths) > 300  # some are clipped by the prompt, past their reading


def test_history_lengths_vary_up_to_six(examples):
    lengths = Counter(len(e.history) for e in examples if e.meta["kind"] != "rag_resolved")
    assert set(lengths) == set(range(7)), lengths


def test_domain_texts_never_name_an_item():
    """Fillers, distractor notices and the generic turns must not name a reading's item: that would
    make an unintended candidate (and a wrong grounding turn)."""
    c = content()
    g = c.generic
    generic = [x for k in ("fillers", "openers", "greetings", "acks", "tails", "doc_titles") for x in g[k]]
    for d in c.domains:
        items = [r.item.lower() for rs in d.readings.values() for r in rs]
        for text in [*generic, *d.fillers, *d.distractors, d.system]:
            assert not [i for i in items if re.search(rf"\b{re.escape(i)}\b", text.lower())], (d.name, text)
        for fam, rs in d.readings.items():
            assert len(rs) >= 3, (d.name, fam)
            assert len({r.item for r in rs}) == len(rs), (d.name, fam)


def test_docstring_numbers_are_those_of_the_default_run(examples):
    doc = synthetic_rag.__doc__
    c = content()
    n_readings = sum(len(rs) for d in c.domains for rs in d.readings.values())
    pairs = sum(len(rs) * (len(rs) - 1) // 2 for d in c.domains for rs in d.readings.values())
    triples = sum(len(rs) * (len(rs) - 1) * (len(rs) - 2) // 6 for d in c.domains for rs in d.readings.values())
    texts = {p.text for e in examples for p in e.passages}
    stated = {
        f"{len(c.domains)} domains": True, f"{len(c.families)} question families": True,
        f"{n_readings} readings": True, f"{pairs} candidate pairs": True, f"{triples} triples": True,
        f"{len(examples)} labelled turns ({sum(e.needs_clarification for e in examples)} clarify)": True,
        f"{len({e.query for e in examples})} distinct query strings": True,
        f"{len(texts):,} distinct passage texts": True,
    }
    missing = [s for s in stated if " ".join(s.split()) not in " ".join(doc.split())]
    assert not missing, missing


def test_content_file_errors_name_the_place():
    from clarifier.data.synthetic_rag import Content

    raw = {"families": {}, "domains": [{"name": "x", "system": "s", "fillers": [], "distractors": [],
                                        "readings": {"nope": [["a", "b", ["v"], []], ["c", "d", ["v"], []]]}}],
           "generic": dict(content().generic)}
    with pytest.raises(ValueError, match="domain 'x': unknown family 'nope'"):
        Content.model_validate(raw)
    with pytest.raises(ValueError, match=r"generic: missing \['acks'\]"):
        Content.model_validate({**raw, "generic": {k: v for k, v in raw["generic"].items() if k != "acks"}})


def test_write_logs_shards_hold_every_conversation_once(tmp_path: Path):
    uris = write_logs(str(tmp_path / "logs"), n=7, seed=2, shards=3)
    got = [json.loads(x)["conversation_id"] for u in uris for x in Path(u).read_text().splitlines()]
    assert sorted(got) == sorted(c["conversation_id"] for c in generate_conversations(7, 2))
    assert CLEAR_KINDS and all(k.startswith("rag_") for k in KINDS)


def test_long_history_share_adds_long_conversations_of_both_labels_and_keeps_the_default_logs(convs):
    assert generate_conversations(N, SEED, long_history_share=0.0) == convs  # 0: not one rng draw more
    with pytest.raises(ValueError, match="long_history_share must be between 0 and 1"):
        generate_conversations(3, long_history_share=1.5)
    mixed = generate_conversations(200, seed=1, long_history_share=0.5)
    flagged = [c for c in mixed if c["meta"].get("long_history")]
    assert 0.35 < len(flagged) / len(mixed) < 0.65
    final = [ConversationLog.model_validate(c).explode()[-1] for c in generate_conversations(200, 1, 1.0)]
    long = [e for e in final if len(e.history) >= 8]
    assert len(long) / len(final) > 0.9
    assert max(len(e.history) for e in final) >= 14
    clarify = sum(e.needs_clarification for e in long)
    assert 0.4 < clarify / len(long) < 0.6  # both labels after a long conversation: length says nothing
    # the answers in a long history carry the readings' notes: as long as real assistants' answers
    chars = statistics.mean(sum(len(t.text) for t in e.history) for e in long)
    assert chars > 500, chars
