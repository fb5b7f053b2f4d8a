from dataclasses import replace

import torch

from clarifier.core.prompt import PromptOptions, render_prompt
from clarifier.core.schema import Example, Passage, Turn
from clarifier.core.objective import IGNORE, SEGMENT_IDS, SegmentWeights, collate, encode_example, joint_loss


def _ex(clarify=True, turns=4):
    hist = [Turn(role="user" if i % 2 == 0 else "assistant", text=f"turn number {i} about the router and modem")
            for i in range(turns)]
    return Example(id="e", history=hist, query="how do I reset it?", needs_clarification=clarify,
                   clarifying_question="The router or the modem?" if clarify else None,
                   grounding_turns=[0] if clarify else [], passages=[Passage(id="p1", text="Reset guide")])


def test_prompt_keeps_turn_indexes_and_drops_oldest_first(tiny_tokenizer):
    ex = _ex(turns=12)
    full = render_prompt(tiny_tokenizer, ex.history, ex.query, ex.passages, PromptOptions(max_prompt_tokens=10_000))
    assert "[0] user:" in full and "[11] assistant:" in full and "[p1] Reset guide" in full
    n_full = len(tiny_tokenizer(full)["input_ids"])
    short = render_prompt(tiny_tokenizer, ex.history, ex.query, ex.passages, PromptOptions(max_prompt_tokens=n_full - 20))
    assert "[0] user:" not in short and "[11] assistant:" in short and "omitted" in short
    assert short.endswith("<|im_start|>assistant\n") and "how do I reset it?" in short


def test_history_window_shows_only_the_latest_turns_with_their_indexes(tiny_tokenizer):
    ex = _ex(turns=12)
    opts = PromptOptions(max_prompt_tokens=10_000, max_history_turns=4)
    text = render_prompt(tiny_tokenizer, ex.history, ex.query, ex.passages, opts)
    assert "(turns 0-7 omitted)" in text and "[7] assistant:" not in text
    assert all(f"[{i}] " in text for i in range(8, 12)) and "[p1] Reset guide" in text
    short = _ex(turns=3)  # fewer turns than the window: all shown, nothing omitted
    text = render_prompt(tiny_tokenizer, short.history, short.query, short.passages, opts)
    assert "[0] user:" in text and "omitted" not in text
    none = render_prompt(tiny_tokenizer, ex.history, ex.query, ex.passages, replace(opts, max_history_turns=0))
    assert "Conversation so far: (none)" in none and "[11]" not in none and "how do I reset it?" in none


def test_encode_masks_prompt_and_weights_segments(tiny_tokenizer):
    w = SegmentWeights(decision=3.0, grounding=0.5, question=1.0, format=0.25)
    enc = encode_example(_ex(), tiny_tokenizer, w, PromptOptions(), max_length=2048)
    p = enc["prompt_len"]
    assert all(x == IGNORE for x in enc["labels"][:p]) and all(x == 0.0 for x in enc["loss_weights"][:p])
    segs = enc["segment_ids"][p:]
    order = [SEGMENT_IDS[n] for n in ("format", "decision", "grounding", "question")]
    assert [s for i, s in enumerate(segs) if i == 0 or segs[i - 1] != s] == order  # fixed order, no interleaving
    weights = {s: {enc["loss_weights"][p + i] for i, x in enumerate(segs) if x == s} for s in set(segs)}
    assert weights == {SEGMENT_IDS["decision"]: {3.0}, SEGMENT_IDS["grounding"]: {0.5},
                       SEGMENT_IDS["question"]: {1.0}, SEGMENT_IDS["format"]: {0.25}}
    decision_tokens = [enc["input_ids"][p + i] for i, x in enumerate(segs) if x == SEGMENT_IDS["decision"]]
    assert tiny_tokenizer.decode(decision_tokens).strip() == "clarify"
    assert enc["input_ids"][-1] == tiny_tokenizer.eos_token_id and not enc["truncated"]
    target = tiny_tokenizer.decode(enc["input_ids"][p:], skip_special_tokens=True)
    assert target == "decision: clarify\ngrounding: turns=0 passages=none\nquestion: The router or the modem?"


def test_target_names_only_history_turns_the_prompt_shows(tiny_tokenizer):
    ex = _ex(turns=8).model_copy(update={"grounding_turns": [1, 5, 7]})

    def grounding(opts):
        enc = encode_example(ex, tiny_tokenizer, SegmentWeights(), opts, max_length=4096)
        return tiny_tokenizer.decode(enc["input_ids"][enc["prompt_len"]:], skip_special_tokens=True).split("\n")[1]

    assert grounding(PromptOptions(max_prompt_tokens=10_000)) == "grounding: turns=1,5,7 passages=none"
    assert grounding(PromptOptions(max_prompt_tokens=10_000, max_history_turns=4)) == "grounding: turns=5,7 passages=none"
    assert grounding(PromptOptions(max_prompt_tokens=10_000, max_history_turns=1)) == "grounding: turns=7 passages=none"
    assert grounding(PromptOptions(max_prompt_tokens=10_000, max_history_turns=0)) == "grounding: turns=none passages=none"
    # the token budget drops turns too: the target follows what the prompt finally shows
    full = render_prompt(tiny_tokenizer, ex.history, ex.query, ex.passages, PromptOptions(max_prompt_tokens=10_000))
    budget = PromptOptions(max_prompt_tokens=len(tiny_tokenizer(full)["input_ids"]) - 20)
    shown = render_prompt(tiny_tokenizer, ex.history, ex.query, ex.passages, budget)
    assert "[1] assistant:" not in shown and "[5] assistant:" in shown
    assert grounding(budget) == "grounding: turns=5,7 passages=none"


def test_encode_negative_and_truncation(tiny_tokenizer):
    enc = encode_example(_ex(clarify=False), tiny_tokenizer, SegmentWeights(), PromptOptions(), max_length=2048)
    assert set(enc["segment_ids"][enc["prompt_len"]:]) == {SEGMENT_IDS["format"], SEGMENT_IDS["decision"]}
    short = encode_example(_ex(), tiny_tokenizer, SegmentWeights(), PromptOptions(), max_length=enc["prompt_len"] + 2)
    assert short["truncated"] and len(short["input_ids"]) == enc["prompt_len"] + 2


def test_a_decision_only_positive_trains_the_decision_and_not_where_a_question_ends(tiny_tokenizer):
    ex = Example(id="m", history=_ex().history, query="how do I reset it?", needs_clarification=True,
                 decision_only=True)
    enc = encode_example(ex, tiny_tokenizer, SegmentWeights(), PromptOptions(), max_length=2048)
    p = enc["prompt_len"]
    assert set(enc["segment_ids"][p:]) == {SEGMENT_IDS["format"], SEGMENT_IDS["decision"]}
    assert tiny_tokenizer.eos_token_id not in enc["input_ids"][p:]  # no end-of-turn after "clarify\n"
    assert tiny_tokenizer.decode(enc["input_ids"][p:]) == "decision: clarify\n"
    full = encode_example(_ex(), tiny_tokenizer, SegmentWeights(), PromptOptions(), max_length=2048)
    # the decision tokens are the same as those of a positive with a question
    dec = [t for t, g in zip(full["labels"][p:], full["segment_ids"][p:]) if g == SEGMENT_IDS["decision"]]
    assert [t for t, g in zip(enc["labels"][p:], enc["segment_ids"][p:]) if g == SEGMENT_IDS["decision"]] == dec


def test_joint_loss_weights_and_parts():
    torch.manual_seed(0)
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [IGNORE, 6, 7, 8], "loss_weights": [0, 2.0, 1.0, 1.0],
             "segment_ids": [0, 1, 2, 3]},
            {"input_ids": [5, 6], "labels": [IGNORE, 6], "loss_weights": [0, 2.0], "segment_ids": [0, 1]}]
    b = collate(rows, pad_id=0)
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]] and b["labels"][1, 2] == IGNORE
    logits = torch.randn(2, 4, 10)
    loss, parts = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"])
    ce = torch.nn.functional.cross_entropy
    tok = {(0, 1): ce(logits[0, 0:1], torch.tensor([6])), (0, 2): ce(logits[0, 1:2], torch.tensor([7])),
           (0, 3): ce(logits[0, 2:3], torch.tensor([8])), (1, 1): ce(logits[1, 0:1], torch.tensor([6]))}
    expected = (2 * tok[(0, 1)] + tok[(0, 2)] + tok[(0, 3)] + 2 * tok[(1, 1)]) / 6
    assert torch.allclose(loss, expected, atol=1e-5)
    assert abs(parts["decision"] - float((tok[(0, 1)] + tok[(1, 1)]) / 2)) < 1e-5
    # Zero weight on a segment removes it from the gradient signal.
    b["loss_weights"][0, 2] = 0.0
    loss2, _ = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"])
    assert torch.allclose(loss2, (2 * tok[(0, 1)] + tok[(0, 3)] + 2 * tok[(1, 1)]) / 5, atol=1e-5)


def _decision_batch():
    """Two rows: a clarify example and an answer example, one decision token + one question token each."""
    d, q = SEGMENT_IDS["decision"], SEGMENT_IDS["question"]
    rows = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7], "loss_weights": [0, 2.0, 1.0], "segment_ids": [0, d, q]},
            {"input_ids": [5, 8, 9], "labels": [IGNORE, 8, 9], "loss_weights": [0, 2.0, 1.0], "segment_ids": [0, d, q]}]
    b = collate(rows, pad_id=0)
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 12)
    ce = torch.nn.functional.cross_entropy
    tok = {"c_dec": ce(logits[0, 0:1], torch.tensor([6])), "c_q": ce(logits[0, 1:2], torch.tensor([7])),
           "a_dec": ce(logits[1, 0:1], torch.tensor([8])), "a_q": ce(logits[1, 1:2], torch.tensor([9]))}
    return b, logits, tok, torch.tensor([True, False])


def test_weighted_decision_loss_scales_only_clarify_decision_tokens():
    from clarifier.core.objective import DecisionLoss

    b, logits, tok, clarify = _decision_batch()
    loss, _ = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"], clarify=clarify,
                         decision=DecisionLoss(kind="weighted", clarify_weight=3.0))
    expected = (2 * 3.0 * tok["c_dec"] + tok["c_q"] + 2 * tok["a_dec"] + tok["a_q"]) / (6 + 1 + 2 + 1)
    assert torch.allclose(loss, expected, atol=1e-5)
    ce_loss, _ = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"])
    assert not torch.allclose(loss, ce_loss)
    # clarify_weight 1 is plain CE.
    same, _ = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"], clarify=clarify,
                         decision=DecisionLoss(kind="weighted", clarify_weight=1.0))
    assert torch.allclose(same, ce_loss, atol=1e-6)
    # Per-token labels (packed rows) give the same loss as per-row labels broadcast over the row.
    per_token = clarify[:, None].expand_as(b["labels"])
    packed, _ = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"], clarify=per_token,
                           decision=DecisionLoss(kind="weighted", clarify_weight=3.0))
    assert torch.allclose(packed, loss, atol=1e-6)


def test_focal_decision_loss_down_weights_easy_decision_tokens():
    from clarifier.core.objective import DecisionLoss

    b, logits, tok, clarify = _decision_batch()
    gamma = 2.0
    loss, _ = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"], clarify=clarify,
                         decision=DecisionLoss(kind="focal", clarify_weight=3.0, gamma=gamma))
    focal = lambda x: x * (1 - torch.exp(-x)) ** gamma  # noqa: E731
    expected = (2 * 3.0 * focal(tok["c_dec"]) + tok["c_q"] + 2 * focal(tok["a_dec"]) + tok["a_q"]) / 10
    assert torch.allclose(loss, expected, atol=1e-5)
    # gamma 0 reduces to the weighted loss.
    g0, _ = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"], clarify=clarify,
                       decision=DecisionLoss(kind="focal", clarify_weight=3.0, gamma=0.0))
    w, _ = joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"], clarify=clarify,
                      decision=DecisionLoss(kind="weighted", clarify_weight=3.0))
    assert torch.allclose(g0, w, atol=1e-6)
    # A confidently right decision token contributes (almost) nothing under focal loss.
    easy = logits.clone()
    easy[0, 0, 6] = 50.0
    l_easy, _ = joint_loss(easy, b["labels"], b["loss_weights"], b["segment_ids"], clarify=clarify,
                           decision=DecisionLoss(kind="focal", clarify_weight=3.0, gamma=gamma))
    assert torch.allclose(l_easy, (tok["c_q"] + 2 * focal(tok["a_dec"]) + tok["a_q"]) / 10, atol=1e-5)


def test_class_weighted_decision_loss_needs_labels_and_valid_settings():
    import pytest

    from clarifier.core.objective import DecisionLoss

    b, logits, _, _ = _decision_batch()
    with pytest.raises(ValueError, match="clarify labels"):
        joint_loss(logits, b["labels"], b["loss_weights"], b["segment_ids"], decision=DecisionLoss(kind="focal", gamma=2))
    with pytest.raises(ValueError, match="kind"):
        DecisionLoss(kind="hinge")
    with pytest.raises(ValueError, match="clarify_weight"):
        DecisionLoss(kind="weighted", clarify_weight=0)


def test_auto_clarify_weight_comes_from_the_train_split_counts():
    import pytest

    from clarifier.core.config import ConfigError, build_config
    from clarifier.train.loop import resolve_decision_loss

    cfg = build_config({}, ["train.decision_loss.kind=weighted"])
    d = resolve_decision_loss(cfg, {"examples": 100, "clarify": 20})
    assert d.kind == "weighted" and d.clarify_weight == pytest.approx(4.0) and d.gamma == 0.0
    cfg = build_config({}, ["train.decision_loss.kind=focal", "train.decision_loss.clarify_weight=2.5",
                            "train.decision_loss.gamma=1.5"])
    d = resolve_decision_loss(cfg, {"examples": 100, "clarify": 20})
    assert (d.kind, d.clarify_weight, d.gamma) == ("focal", 2.5, 1.5)
    assert resolve_decision_loss(build_config({}, []), None).kind == "ce"
    with pytest.raises(ValueError, match="clarify_weight=auto"):
        resolve_decision_loss(build_config({}, ["train.decision_loss.kind=weighted"]), {"examples": 10, "clarify": 0})
    with pytest.raises(ConfigError, match="train.decision_loss.clarify_weight"):
        build_config({}, ["train.decision_loss.clarify_weight=0"])
    with pytest.raises(ConfigError, match="train.decision_loss.kind"):
        build_config({}, ["train.decision_loss.kind=hinge"])
