"""Constrained decoding of the whole target: the pure prefix grammar, the logits processor (checked
token by token against the grammar), and the engine's outputs with the tiny local model."""

from __future__ import annotations

import re

import pytest

from clarifier.core.schema import ClarifyRequest, ConversationLog, Passage, Turn
from clarifier.core.target import GROUNDING_HEAD, MIN_QUESTION_CHARS, question_problem, try_parse_target
from clarifier.engine.inference import end_at_question_line
from clarifier.engine.target_constraint import (
    ROLE_PHRASES,
    TargetConstraint,
    TargetGrammar,
    completion_cost,
    grammar_for,
    question_cost,
    target_complete,
    target_state,
    valid_target_prefix,
)

G = TargetGrammar.for_request(3, ["p1", "p2"])
LINE = GROUNDING_HEAD + "0 passages=p1\n"


# ---- the pure grammar ---------------------------------------------------------------------------


@pytest.mark.parametrize("rest", [
    "", "n", "none", "0", "0,", "0,2", "2,0", "none pas", "none passages=", "0,1 passages=p", "0 passages=p1,",
    "0 passages=p1,p2", "0 passages=none\n", "1 passages=p2,p1\n",
])
def test_valid_grounding_prefixes(rest):
    assert valid_target_prefix(GROUNDING_HEAD + rest, G)


@pytest.mark.parametrize("rest, why", [
    ("3", "turn 3 does not exist in a 3-turn history"),
    ("0,1,2,", "no turn left after all three"),
    ("0,0", "repeated turn"),
    ("01", "not an index"),
    ("none,", "none is not a list item"),
    ("0 passages=p3", "unknown passage"),
    ("0 passages=p1,p1", "repeated passage"),
    ("0 passages=none\nx", "the question line must start with 'question:'"),
    (" passages=none", "empty turn list"),
    ("0,1passages", "missing separator"),
    ("0 passages=\n", "empty passage list"),
])
def test_invalid_grounding_prefixes(rest, why):
    assert not valid_target_prefix(GROUNDING_HEAD + rest, G), why


def test_the_grounding_line_head_is_written_first():
    assert valid_target_prefix("", G) and valid_target_prefix("ground", G)
    assert not valid_target_prefix("question: Which one?", G)
    assert not valid_target_prefix("decision: clarify\n", G)


def test_no_history_allows_only_none():
    g = TargetGrammar.for_request(0, [])
    assert valid_target_prefix(GROUNDING_HEAD + "none passages=none\n", g)
    assert not valid_target_prefix(GROUNDING_HEAD + "0", g)


@pytest.mark.parametrize("q", ["", " ", " W", " Which one?", " Do you mean the router, or: the modem?",
                               " Is the username set?", " Which x = y?", " Is the systematic one"])
def test_valid_question_prefixes(q):
    assert valid_target_prefix(LINE + "question:" + q, G), q


@pytest.mark.parametrize("q, why", [
    ("Which?", "one space after 'question:'"),
    ("  Which?", "not two"),
    (" Which?\n", "no newline: the end is EOS"),
    (" Which?\nmore", "no second line"),
    (" Which\u2028one?", "no line break of any kind"),
    (" Which\tone?", "no control character"),
    (" are you asking about the user?||none", "grounding syntax"),
    (" which | one", "a pipe"),
    (" which turns=", "target syntax"),
    (" which PASSAGES=", "target syntax in any case"),
    (" see question: x", "target syntax"),
    (" are you asking about the user", "a role name (as the last word)"),
    (" are you asking about the users?", "a role name in the plural"),
    (" are you asking about the User's", "a role name, any case"),
    (" are you asking about the   system?", "a role name, any spacing"),
    (" The assistant said what?", "a role name at the start"),
    (" what does the latest user message mean?", "the latest user"),
])
def test_invalid_question_prefixes(q, why):
    assert not valid_target_prefix(LINE + "question:" + q, G), why


def test_a_role_word_ending_the_text_counts_as_a_word():
    q = LINE + "question: is it the user"
    assert not valid_target_prefix(q, G) and not valid_target_prefix(q + "s", G)  # "users" is a role word too
    assert valid_target_prefix(q + "name?", G) and valid_target_prefix(q[:-1], G)  # written as " username"


def test_turns_older_than_the_history_window_cannot_be_named():
    h = [Turn(role="user" if i % 2 == 0 else "assistant", text=f"turn {i}") for i in range(6)]
    g = grammar_for(h, "and that one?", [Passage(id="p1", text="x")], first_turn=4)
    assert g.turns == ("4", "5")
    assert valid_target_prefix(GROUNDING_HEAD + "4,5 passages=p1\n", g) and valid_target_prefix(GROUNDING_HEAD + "none", g)
    assert not valid_target_prefix(GROUNDING_HEAD + "0", g) and not valid_target_prefix(GROUNDING_HEAD + "3", g)


def test_the_engine_constrains_grounding_to_the_turns_its_prompt_shows(tiny_model_dir):
    from dataclasses import replace

    from clarifier.engine.inference import ClarifierEngine

    engine = ClarifierEngine.from_base(str(tiny_model_dir), max_new_tokens=8)
    engine.opts = replace(engine.opts, max_history_turns=2)
    h = [Turn(role="user" if i % 2 == 0 else "assistant", text=f"turn {i}") for i in range(5)]
    items = [(h, "which?", []), (h[:1], "which?", [])]
    enc = engine._encode([engine._prompt(*it) for it in items])
    [constraint] = engine._target_constraint(enc, items)
    assert [g.turns for g in constraint.rows] == [("3", "4"), ("0",)]


def test_role_phrases_in_the_conversation_itself_are_allowed():
    g = TargetGrammar.for_request(3, ["p1"], context="How do I add the user to sudoers?")
    assert valid_target_prefix(LINE + "question: Which is the user you mean?", g)
    assert not valid_target_prefix(LINE + "question: Which is the system you mean?", g)
    assert "the user" not in g.blocked_roles and set(g.blocked_roles) == set(ROLE_PHRASES) - {"the user"}
    h = [Turn(role="user", text="The system crashed")]
    assert "the system" not in grammar_for(h, "why?", [Passage(id="p1", text="x")]).blocked_roles


def test_a_question_is_complete_with_enough_characters():
    assert not target_complete(LINE + "question:", G)
    assert not target_complete(LINE + "question: " + "?" * (MIN_QUESTION_CHARS - 1), G)
    assert target_complete(LINE + "question: Which one?", G)
    assert not target_complete(GROUNDING_HEAD + "0 passages=p1", G)


def _chars(text: str) -> int:
    return len(text)  # a tokenizer where every character is one token


def test_completion_cost_counts_the_shortest_completion():
    st = target_state("", G)
    # "grounding: turns=" + "0" + " passages=" + "p1" + "\nquestion:" + " " + 3 characters
    assert completion_cost(st, G, _chars) == len(GROUNDING_HEAD) + 1 + 10 + 2 + 10 + 1 + MIN_QUESTION_CHARS
    assert completion_cost(target_state(LINE + "question: W", G), G, _chars) == MIN_QUESTION_CHARS - 1
    assert completion_cost(target_state(LINE + "question: Which", G), G, _chars) == 0
    assert question_cost("") == 1 + MIN_QUESTION_CHARS


@pytest.mark.parametrize("text", [
    "", "gro", GROUNDING_HEAD, GROUNDING_HEAD + "1", GROUNDING_HEAD + "0,", GROUNDING_HEAD + "none pa",
    GROUNDING_HEAD + "2 passages=", GROUNDING_HEAD + "2 passages=p", LINE, LINE + "ques", LINE + "question:",
    LINE + "question: W",
])
def test_completion_cost_always_has_a_next_step_one_cheaper(text):
    """End forcing is sound: from any valid state some next character lowers the cost by exactly
    one, so keeping ``cost <= tokens left`` always leaves a way to finish in the budget."""
    alphabet = sorted(set("grounding: turns=none passages=question:\n,0123p?W"))
    cost = completion_cost(target_state(text, G), G, _chars)
    while cost > 0:
        nxt = [text + c for c in alphabet if valid_target_prefix(text + c, G)]
        best = min(nxt, key=lambda t: completion_cost(target_state(t, G), G, _chars))
        assert completion_cost(target_state(best, G), G, _chars) == cost - 1, (text, best)
        text, cost = best, cost - 1
    assert target_complete(text, G)


def test_end_at_question_line():
    out = "grounding: turns=0 passages=none\nquestion: Which one?\nquestion: again\nmore"
    assert end_at_question_line(out) == "grounding: turns=0 passages=none\nquestion: Which one?"
    assert end_at_question_line("grounding: turns=0,1,2,") == "grounding: turns=0,1,2,"


# ---- the logits processor, token by token -------------------------------------------------------

HEAD = "decision: clarify\n"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from clarifier.engine.models import load_causal_lm, load_tokenizer

    return load_causal_lm(str(tiny_model_dir)).eval(), load_tokenizer(str(tiny_model_dir))


def _expected(tok, text, g, left):
    """What the grammar allows after ``text`` with ``left`` tokens to go, by checking every token."""
    from clarifier.engine.target_constraint import vocab_index

    ix = vocab_index(tok)
    st = target_state(text, g)
    ok = {}
    for t, s in enumerate(ix.texts):
        nxt = target_state(text + s, g) if s is not None else None
        if nxt is not None:
            ok[t] = completion_cost(nxt, g, ix.tokens)
    if st.phase == "question":
        done = target_complete(text, g)
        fit = {t for t, c in ok.items() if c <= left - 1 and (left > 1 or ix.texts[t].rstrip().endswith("?"))}
        return fit | ({tok.eos_token_id} if done else set())
    fit = {t for t, c in ok.items() if c <= left - 1}
    return fit or {t for t, c in ok.items() if c == min(ok.values())}


def _allowed(tok, proc, prompt_ids, gen_ids, vocab):
    import torch

    ids = torch.tensor([prompt_ids + gen_ids])
    scores = proc(ids, torch.zeros(1, vocab))
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def _sampled(model, tok, g, max_new, seed, bias=None):
    """Random walks of the model under the constraint (high temperature): the token ids."""
    import torch
    from transformers import LogitsProcessorList

    head = tok(HEAD, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([head])
    procs = ([bias] if bias else []) + [TargetConstraint(tok, len(head), [g], max_new)]
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=True, top_k=0, temperature=2.0, logits_processor=LogitsProcessorList(procs),
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return head, out[0, len(head):].tolist()


@pytest.mark.parametrize("max_new", [40, 60])
def test_the_processor_allows_exactly_what_the_grammar_allows(tiny, max_new):
    """At every step of random walks, the allowed tokens are exactly the vocabulary's tokens that
    keep the text a valid target prefix that still fits the budget (the processor removes only
    those), and the walk ends in a complete target."""
    model, tok = tiny
    vocab = model.config.vocab_size
    for seed, g in enumerate([G, TargetGrammar.for_request(12, ["doc-7", "doc-17", "d"]),
                              TargetGrammar.for_request(0, [])]):
        head, gen = _sampled(model, tok, g, max_new, seed)
        proc = TargetConstraint(tok, len(head), [g], max_new)
        eos_at = gen.index(tok.eos_token_id) if tok.eos_token_id in gen else len(gen)
        for k in range(eos_at):
            text = tok.decode(gen[:k])
            got = _allowed(tok, proc, head, gen[:k], vocab)
            assert got == _expected(tok, text, g, max_new - k), (seed, text)
            assert gen[k] in got
        text = tok.decode(gen[:eos_at])
        assert target_complete(text, g), text
        assert try_parse_target(HEAD + text, history_len=len(g.turns), passage_ids=g.passages)[0] is not None


def test_after_eos_only_eos(tiny):
    model, tok = tiny
    head = tok(HEAD, add_special_tokens=False)["input_ids"]
    text = tok(LINE + "question: Which one?", add_special_tokens=False)["input_ids"]
    proc = TargetConstraint(tok, len(head), [G], 48)
    assert tok.eos_token_id in _allowed(tok, proc, head, text, model.config.vocab_size)
    assert _allowed(tok, proc, head, text + [tok.eos_token_id], model.config.vocab_size) == {tok.eos_token_id}


class Prefer:
    """A LogitsProcessor that makes the model want ``script`` (one token per step), like a model
    trained to write exactly that."""

    def __init__(self, prompt_len, script):
        self.prompt_len, self.script = prompt_len, script

    def __call__(self, input_ids, scores):
        k = input_ids.shape[1] - self.prompt_len
        if k < len(self.script):
            scores[:, self.script[k]] += 1e4
        return scores


def _greedy(model, tok, script_text, g, max_new=64, constrained=True, written=""):
    import torch
    from transformers import LogitsProcessorList

    prompt = tok(HEAD + written, add_special_tokens=False)["input_ids"]
    script = tok(script_text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    procs = [Prefer(len(prompt), script)]
    if constrained:
        procs.append(TargetConstraint(tok, len(prompt), [g], max_new, [written]))
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         logits_processor=LogitsProcessorList(procs), pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    return script, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("target", [
    "grounding: turns=0,2 passages=p1\nquestion: Which of the two routers do you mean?",
    "grounding: turns=none passages=none\nquestion: Do you mean the settings page, or the login page?",
    "grounding: turns=1 passages=p2,p1\nquestion: Is it the router, or the modem?",
])
def test_a_valid_output_is_unchanged_token_for_token(tiny, target):
    model, tok = tiny
    script, out = _greedy(model, tok, target, G)
    assert out == script
    assert _greedy(model, tok, target, G, constrained=False)[1] == script


@pytest.mark.parametrize("target, banned", [
    ("grounding: turns=0 passages=none\nquestion: Are you asking about the user?", "the user"),
    ("grounding: turns=0 passages=none\nquestion: are you asking about the user?||none", "the user"),
    ("grounding: turns=0 passages=none\nquestion: Do you mean the system?", "the system"),
    ("grounding: turns=0 passages=none\nquestion: Is this about the latest user message?", "the latest user"),
    ("grounding: turns=0 passages=none\nquestion: Which one? grounding: turns=1", "grounding:"),
    ("grounding: turns=0 passages=none\nquestion: Which one?\nquestion: which?", "\n"),
])
def test_role_names_and_syntax_are_removed_from_questions(tiny, target, banned):
    model, tok = tiny
    script, out = _greedy(model, tok, target, G)
    text = tok.decode(out, skip_special_tokens=True)
    question = text.split("question:", 1)[1]
    assert not re.search(rf"(?<![a-z]){re.escape(banned)}(?![a-z])", question.lower()) and "|" not in question
    assert try_parse_target(HEAD + text, history_len=3, passage_ids=["p1", "p2"])[0] is not None, text
    assert question_problem(question.strip()) is None
    # where the conversation itself speaks of it, the phrase stays (syntax never does)
    allowed = TargetGrammar.for_request(3, ["p1", "p2"], context=f"it is {banned} again")
    if banned in ROLE_PHRASES and "|" not in target:
        assert _greedy(model, tok, target, allowed)[1] == script


def test_role_names_cannot_be_sampled(tiny):
    """A model pushed hard towards role words (every piece of " user", " system", " assistant")
    still never writes a role phrase."""
    model, tok = tiny
    words = (" user", " users", " system", " assistant", "user", " the")
    pieces = {t for w in words for t in tok(w, add_special_tokens=False)["input_ids"]}

    class Push:
        def __call__(self, input_ids, scores):
            scores[:, sorted(pieces)] += 6.0
            return scores

    seen = 0
    for seed in range(6):
        _, gen = _sampled(model, tok, G, 60, seed, bias=Push())
        question = tok.decode(gen, skip_special_tokens=True).split("question:", 1)[1].lower()
        assert not G.role_in(question), question
        seen += question.count("the")
    assert seen >= 3  # the push worked: "the" was written, the role word after it was not


def test_the_question_stage_of_a_pipeline_continues_a_written_grounding_line(tiny):
    model, tok = tiny
    script, out = _greedy(model, tok, "question: Which of the two?", G, written=LINE)
    assert out == script
    _, out = _greedy(model, tok, "question: the user?", G, written=LINE)
    text = tok.decode(out, skip_special_tokens=True)
    assert text.startswith("question: ") and try_parse_target(HEAD + LINE + text)[0] is not None


# ---- the engine: every output parses ------------------------------------------------------------


def _requests():
    from clarifier.data.synthetic import generate_conversations

    exs = [e for c in generate_conversations(12, seed=5) for e in ConversationLog.model_validate(c).explode()]
    reqs = [ClarifyRequest(history=e.history, query=e.query, passages=e.passages) for e in exs[:10]]
    long_history = [Turn(role="user" if i % 2 == 0 else "assistant", text=f"turn {i} about the router")
                    for i in range(40)]
    many = [Passage(id=f"doc-{i}", text=f"passage {i} on modems") for i in range(12)]
    reqs += [
        ClarifyRequest(history=long_history, query="and that one?", passages=many),
        ClarifyRequest(history=long_history[:25], query="which?", passages=[]),
        ClarifyRequest(history=[], query="it broke", passages=many[:3]),
        ClarifyRequest(history=[], query="help", passages=[]),
    ]
    return reqs


@pytest.mark.parametrize("max_new", [34, 64])
def test_random_tiny_model_outputs_always_parse(tiny_model_dir, max_new):
    from clarifier.engine.inference import ClarifierEngine

    eng = ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32", max_new_tokens=max_new)
    reqs = _requests()
    out = eng.clarify(reqs, threshold=0.0)  # every request goes on to generate
    assert all(r.needs_clarification and r.valid_output for r in out), [r.valid_output for r in out]
    for req, r in zip(reqs, out):
        assert question_problem(r.question) is None
        assert set(r.grounding.turns) <= set(range(len(req.history)))
        assert set(r.grounding.passages) <= {p.id for p in req.passages}
        g = grammar_for(req.history, req.query, req.passages)
        assert not g.role_in(r.question), r.question
    if max_new == 64:  # the same model without the constraint: the test could fail
        eng.constrain_target = False
        assert not any(r.valid_output for r in eng.clarify(reqs, threshold=0.0))


def test_one_prefill_decodes_the_same_valid_targets_as_an_own_prefill(tiny_model_dir):
    """The constraint works on generation continued from the decision pass's KV cache exactly as on
    a fresh prefill (left-padded batch of long and short prompts), and every target parses."""
    from clarifier.engine.inference import ClarifierEngine

    eng = ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32", max_new_tokens=40)
    reqs = _requests()[-6:]
    items = [(r.history, r.query, r.passages) for r in reqs]
    _, state = eng._decide(items, keep_cache=True)
    cached = eng._continue_ids(state, list(range(len(items))), items)
    assert cached.tolist() == eng._prefill_ids(items).tolist()
    for text, r in zip(eng._texts(cached), reqs):
        assert try_parse_target(text, history_len=len(r.history), passage_ids=[p.id for p in r.passages])[0] is not None


def test_a_pipeline_model_decodes_valid_targets_through_both_stages(tiny_model_dir, tmp_path):
    """The pipeline's grounding stage and its question stage (given the grounding line as written
    text) are both constrained: the composed target parses."""
    import json

    from support.adapters import untrained_adapter

    from clarifier.engine.inference import ModelMeta, write_meta
    from clarifier.engine.pipeline import PARTS, PipelineEngine

    folder = tmp_path / "pipeline"
    for i, part in enumerate(PARTS):
        untrained_adapter(tiny_model_dir, folder / part, threshold=0.0, seed=i)
    (folder / "pipeline.json").write_text(json.dumps({"parts": {p: {"folder": p} for p in PARTS}}))
    write_meta(folder, ModelMeta(base_model=str(tiny_model_dir), threshold=0.0))
    eng = PipelineEngine.from_folder(folder, max_new_tokens=40, precision="fp32")
    reqs = _requests()[-4:]
    out = eng.clarify(reqs)
    assert all(r.needs_clarification and r.valid_output for r in out)
    assert all(question_problem(r.question) is None for r in out)


def test_vocab_index_is_built_once_per_vocabulary_not_per_tokenizer_object(tiny_model_dir):
    """Each engine loads its own tokenizer (a replica's tenants adapted from one base): the index (about a second
    for a real vocabulary) is shared by tokenizers that are the same, and not by one that differs."""
    from clarifier.engine.models import load_tokenizer
    from clarifier.engine.target_constraint import vocab_index

    a, b = load_tokenizer(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    assert a is not b and vocab_index(a) is vocab_index(b) is vocab_index(a)
    c = load_tokenizer(str(tiny_model_dir))
    c.add_tokens(["<clarifier-test-token>"])
    assert vocab_index(c) is not vocab_index(a) and len(vocab_index(c).texts) == len(vocab_index(a).texts) + 1
