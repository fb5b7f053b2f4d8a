"""The grounding line's constrained decoding: the pure prefix check and the logits processor."""

from __future__ import annotations

import pytest

from clarifier.engine.grounding_constraint import LINE_HEAD, GroundingConstraint, valid_grounding_prefix
from clarifier.engine.inference import end_at_question_line
from clarifier.core.target import parse_target


@pytest.mark.parametrize("rest", [
    "", "n", "none", "0", "0,", "0,2", "2,0", "none pas", "none passages=", "0,1 passages=p", "0 passages=p1,",
    "0 passages=p1,p2", "0 passages=none\n", "1 passages=p2,p1\n",
])
def test_valid_prefixes(rest):
    assert valid_grounding_prefix(rest, 3, ["p1", "p2"])


@pytest.mark.parametrize("rest, why", [
    ("3", "turn 3 does not exist in a 3-turn history"),
    ("0,1,2,", "no turn left after all three"),
    ("0,0", "repeated turn"),
    ("01", "not an index"),
    ("none,", "none is not a list item"),
    ("0 passages=p3", "unknown passage"),
    ("0 passages=p1,p1", "repeated passage"),
    ("0 passages=none\nx", "text after the line"),
    (" passages=none", "empty turn list"),
    ("0,1passages", "missing separator"),
    ("0 passages=\n", "empty passage list"),
])
def test_invalid_prefixes(rest, why):
    assert not valid_grounding_prefix(rest, 3, ["p1", "p2"]), why


def test_no_history_allows_only_none():
    assert valid_grounding_prefix("none passages=none\n", 0, [])
    assert not valid_grounding_prefix("0", 0, [])


def test_end_at_question_line():
    out = "grounding: turns=0 passages=none\nquestion: Which one?\nquestion: again\nmore"
    assert end_at_question_line(out) == "grounding: turns=0 passages=none\nquestion: Which one?"
    assert end_at_question_line("grounding: turns=0,1,2,") == "grounding: turns=0,1,2,"


def test_processor_keeps_a_random_model_inside_the_grammar(tiny_model_dir):
    """An untrained model writes noise; under the constraint its grounding line must still parse."""
    import torch
    from transformers import LogitsProcessorList

    from clarifier.engine.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir)).eval()
    head = tok("decision: clarify\n", add_special_tokens=False)["input_ids"]
    line = tok(LINE_HEAD, add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    for history_len, pids in [(2, ["p1"]), (5, []), (0, ["doc-7", "doc-8"])]:
        ids = torch.tensor([head + line])
        processor = GroundingConstraint(tok, len(head), [(history_len, pids)])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                             do_sample=True, top_k=0, temperature=1.5, logits_processor=LogitsProcessorList([processor]),
                             pad_token_id=tok.pad_token_id, eos_token_id=None)
        text = tok.decode(out[0, len(head):], skip_special_tokens=True)
        assert text.startswith(LINE_HEAD)
        grounding = text.split("\n", 1)[0] + "\n"
        assert valid_grounding_prefix(grounding[len(LINE_HEAD):], history_len, pids), text
        if "\n" in text:  # the line was finished: it parses as a full target
            t = parse_target(f"decision: clarify\n{grounding}question: Which one?", history_len=history_len,
                             passage_ids=pids)
            assert set(t.grounding_turns) <= set(range(history_len))
