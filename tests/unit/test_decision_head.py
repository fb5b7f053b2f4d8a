"""The decision head: a logistic regression on hidden states at the decision position, fitted after
training (clarifier.train.decision_head), stored in the model folder and used by the one engine."""

from __future__ import annotations

import math

import pytest


def test_layers_are_depth_fractions():
    from clarifier.engine.decision_head import resolve_layers

    assert resolve_layers([0.25, 0.5, 0.75, 1.0], 30) == [8, 15, 22, 30]
    assert resolve_layers([0.1, 0.2, 1.0], 2) == [1, 2]  # never the embeddings (0); duplicates merged
    for bad in ([], [0.0], [1.5]):
        with pytest.raises(ValueError, match="depth fractions"):
            resolve_layers(bad, 30)


def test_standardisation_folds_into_one_affine_map(tmp_path):
    import torch

    from clarifier.engine.decision_head import DecisionHead

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 6, generator=g) * 3 + 1
    coef, mean, scale = torch.randn(6, generator=g), x.mean(0), x.std(0)
    head = DecisionHead.from_standardised([1, 2], coef, 0.3, mean, scale)
    expected = torch.sigmoid(((x - mean) / scale) @ coef + 0.3)
    assert torch.allclose(head.probability(x), expected, atol=1e-5)

    head.save(tmp_path)
    back = DecisionHead.load(tmp_path)
    assert back.layers == [1, 2] and torch.allclose(back.probability(x), expected, atol=1e-5)
    assert DecisionHead.load(tmp_path / "nowhere") is None
    with pytest.raises(ValueError, match=r"reads layers \[1, 2\] pooled last \(6 features\) but the model has 2 layers of 64"):
        back.check(2, 64)
    back.check(2, 3)

    # Pooling travels in the file; a head saved before it (no "pooling" metadata) reads the last position.
    both = DecisionHead.from_standardised([1, 2], coef, 0.3, mean, scale, pooling=["mean", "last"])
    assert both.pooling == ["last", "mean"]  # feature order: every layer's last, then every layer's mean
    both.save(tmp_path)
    assert DecisionHead.load(tmp_path).pooling == ["last", "mean"]
    with pytest.raises(ValueError, match=r"pooled last\+mean \(6 features\)"):
        DecisionHead.load(tmp_path).check(2, 3)  # 2 poolings x 2 layers x 3 = 12 features expected
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(6), "bias": torch.zeros(1)}, str(tmp_path / "decision_head.safetensors"),
              metadata={"layers": "[1, 2]"})
    assert DecisionHead.load(tmp_path).pooling == ["last"]
    save_file({"weight": torch.zeros(6), "bias": torch.zeros(1)}, str(tmp_path / "decision_head.safetensors"),
              metadata={"layers": "[1, 2]", "pooling": '["max"]'})
    with pytest.raises(ValueError, match=r"decision_head.safetensors: decision head pooling is one or both of"):
        DecisionHead.load(tmp_path)


def test_clipped_head_limits_each_standardised_feature_and_survives_saving(tmp_path):
    import torch

    from clarifier.engine.decision_head import HEAD_FILE, DecisionHead

    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=g) * 3 + 1
    x[0, 2] = 500.0  # one extreme activation
    coef, mean, scale = torch.randn(6, generator=g), x.mean(0), x.std(0)
    head = DecisionHead.from_standardised([1, 2], coef, -0.2, mean, scale, clip=1.0)
    z = ((x - mean) / scale).clamp(-1, 1)
    expected = torch.sigmoid(z @ coef - 0.2)
    assert torch.allclose(head.probability(x), expected, atol=1e-5)
    # the extreme feature counts as 1 sd, not as hundreds: the same score as at 1 sd exactly
    at_one = x[:1].clone()
    at_one[0, 2] = mean[2] + scale[2]
    assert torch.allclose(head.probability(x[:1]), head.probability(at_one), atol=1e-6)
    unclipped = DecisionHead.from_standardised([1, 2], coef, -0.2, mean, scale)
    assert not torch.allclose(unclipped.probability(x[:1]), head.probability(x[:1]), atol=1e-3)

    head.save(tmp_path)
    back = DecisionHead.load(tmp_path)
    assert back.clip == 1.0 and torch.allclose(back.probability(x), expected, atol=1e-5)
    back.check(2, 3)
    on_meta = back.probability(x.to("meta"))  # states on another device (a GPU): the head follows them
    assert on_meta.device.type == "meta" and back.weight.device.type == "meta" and back.mean.device.type == "meta"
    with pytest.raises(ValueError, match="clip must be positive"):
        DecisionHead.from_standardised([1], coef, 0.0, mean, scale, clip=0.0)

    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(6), "bias": torch.zeros(1)}, str(tmp_path / HEAD_FILE),
              metadata={"layers": "[1, 2]", "clip": "1.0"})
    with pytest.raises(ValueError, match=r"a clipped head \(clip 1.0\) needs its mean and scale tensors"):
        DecisionHead.load(tmp_path)
    save_file({"weight": torch.zeros(6), "bias": torch.zeros(1), "mean": torch.zeros(4), "scale": torch.ones(4)},
              str(tmp_path / HEAD_FILE), metadata={"layers": "[1, 2]", "clip": "1.0"})
    with pytest.raises(ValueError, match=r"its mean \(4\) and scale \(4\) do not match its 6 weights"):
        DecisionHead.load(tmp_path).check(2, 3)


def test_balanced_weights_give_every_source_and_class_the_same_total():
    from clarifier.train.decision_head import balanced_weights

    sources = ["a"] * 6 + ["b"] * 2
    gold = [True, False, False, False, False, False, True, False]
    w = balanced_weights(sources, gold)
    totals = {}
    for s, g, x in zip(sources, gold, w):
        totals[(s, g)] = totals.get((s, g), 0.0) + x
    assert len(set(round(v, 9) for v in totals.values())) == 1 and math.isclose(sum(w), len(w))


def _examples(n: int, prefix: str):
    """Two sources; whether a turn needs a question is written in its words (so a head can learn it)."""
    from clarifier.core.schema import Example, Turn

    out = []
    for i in range(n):
        amb = i % 2 == 0
        src = "alpha" if i % 4 < 2 else "beta"
        q = "how do I reset it?" if amb else f"what is the weather in paris on day {i}?"
        out.append(Example(
            id=f"{prefix}-{i}", history=[Turn(role="user", text="I have a router and a modem"),
                                         Turn(role="assistant", text="Both are supported.")],
            query=q, needs_clarification=amb, clarifying_question="The router or the modem?" if amb else None,
            grounding_turns=[0] if amb else [], meta={"source": src, "conversation_id": f"{prefix}-{i}"}))
    return out


def test_fitted_head_is_saved_and_decides_for_the_engine(tiny_model_dir, tmp_path):
    import torch

    from clarifier.core.config import DecisionHeadConfig
    from clarifier.engine.decision_head import HEAD_FILE
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import load_engine
    from clarifier.train.decision_head import fit_decision_head
    from support.adapters import untrained_adapter

    folder = untrained_adapter(tiny_model_dir, tmp_path / "m", threshold=0.5)
    train, dev = _examples(32, "t"), _examples(16, "d")
    lines = []
    summary = fit_decision_head(folder, train, dev, DecisionHeadConfig(layers=[0.5, 1.0], max_per_source=12,
                                                                       c_grid=[0.01, 1.0], pooling=["last", "mean"]),
                                precision="fp32", progress=lines.append)
    assert (folder / HEAD_FILE).is_file()
    assert summary["layers"] == [1, 2] and summary["n_train"] == 24 and summary["n_dev"] == 16
    assert summary["pooling"] == ["last", "mean"]
    assert summary["c"] in (0.01, 1.0) and summary["dev_macro_auroc"] == 1.0  # the words decide: separable
    meta = read_meta(folder)
    assert meta.decision_head["c"] == summary["c"] and "dev_scores" not in meta.decision_head
    assert any(line.startswith("[head] kept C=") for line in lines)

    engine = load_engine(folder, precision="fp32")
    items = [(e.history, e.query, e.passages) for e in dev]
    scores = engine.score(items)
    assert engine.decision_head is not None and engine.decision_head.pooling == ["last", "mean"]
    assert scores == pytest.approx(summary["dev_scores"], abs=1e-4)  # the calibration reuses these scores
    token = load_engine(folder, precision="fp32", decision_head=False)
    assert token.decision_head is None and token.score(items) != pytest.approx(scores, abs=1e-3)

    # The clarify path still decodes from the decision pass's KV cache with a head deciding.
    with torch.no_grad():
        engine.decision_head.weight.zero_()
    engine.decision_head.bias = 5.0  # sigmoid(5) = 0.993 for every request
    from clarifier.core.schema import ClarifyRequest

    out = engine.clarify([ClarifyRequest(history=e.history, query=e.query) for e in dev[:2]], threshold=0.99)
    assert [r.confidence for r in out] == pytest.approx([1 / (1 + math.exp(-5))] * 2, abs=1e-6)
    assert all(r.usage.completion_tokens > 0 for r in out)  # both were decoded past the decision


def test_clipped_head_is_fitted_recorded_and_applied_by_the_engine(tiny_model_dir, tmp_path):
    from clarifier.core.config import DecisionHeadConfig, build_config
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import load_engine
    from clarifier.train.decision_head import fit_decision_head
    from support.adapters import untrained_adapter

    folder = untrained_adapter(tiny_model_dir, tmp_path / "m", threshold=0.5)
    dev, lines = _examples(16, "d"), []
    summary = fit_decision_head(folder, _examples(32, "t"), dev, DecisionHeadConfig(
        layers=[1.0], max_per_source=None, c_grid=[1.0], clip=0.5), precision="fp32", progress=lines.append)
    assert summary["clip"] == 0.5 and read_meta(folder).decision_head["clip"] == 0.5
    assert any("features clipped at 0.5 sd" in line for line in lines)
    engine = load_engine(folder, precision="fp32")
    assert engine.decision_head.clip == 0.5
    assert engine.score([(e.history, e.query, e.passages) for e in dev]) == pytest.approx(summary["dev_scores"], abs=1e-4)
    assert build_config({}, ["train.decision_head.clip=1"]).train.decision_head.clip == 1.0
    from clarifier.core.config import ConfigError

    with pytest.raises(ConfigError, match="clip"):
        build_config({}, ["train.decision_head.clip=0"])


def test_head_without_a_cap_reads_every_train_turn(tiny_model_dir, tmp_path):
    from clarifier.core.config import DecisionHeadConfig, build_config
    from clarifier.train.decision_head import fit_decision_head
    from support.adapters import untrained_adapter

    folder = untrained_adapter(tiny_model_dir, tmp_path / "m", threshold=0.5)
    train = _examples(40, "t")[:-6]  # 34 turns: per source 17, of which 9 / 8 need a question
    summary = fit_decision_head(folder, train, _examples(16, "d"), DecisionHeadConfig(
        layers=[1.0], max_per_source=None, c_grid=[1.0]), precision="fp32", progress=lambda _: None)
    assert summary["n_train"] == 34  # a cap of 12 would have drawn 24, half of them needing a question
    assert build_config({}, ["train.decision_head.max_per_source=null"]).train.decision_head.max_per_source is None


def test_head_needs_both_classes(tiny_model_dir, tmp_path):
    from clarifier.core.config import DecisionHeadConfig
    from clarifier.train.decision_head import fit_decision_head
    from support.adapters import untrained_adapter

    folder = untrained_adapter(tiny_model_dir, tmp_path / "m", threshold=0.5)
    clear = [e for e in _examples(8, "t") if not e.needs_clarification]
    with pytest.raises(ValueError, match="the train sample needs turns of both classes"):
        fit_decision_head(folder, clear, _examples(8, "d"), DecisionHeadConfig(), progress=lambda _: None)


def test_config_rejects_bad_layers_and_strengths():
    from clarifier.core.config import ConfigError, build_config

    assert build_config({}, ["train.decision_head.enabled=true"]).train.decision_head.layers == [0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ConfigError, match="depth fractions"):
        build_config({}, ["train.decision_head.layers=[0.5,2]"])
    with pytest.raises(ConfigError, match="pooling"):
        build_config({}, ["train.decision_head.pooling=[last,last]"])
    with pytest.raises(ConfigError, match="pooling"):
        build_config({}, ["train.decision_head.pooling=[max]"])
    with pytest.raises(ConfigError, match="every C must be > 0"):
        build_config({}, ["train.decision_head.c_grid=[0.1,0]"])


def test_hooked_states_equal_the_models_hidden_states(tiny_model_dir):
    """The engine keeps only the last position of the layers a head reads (forward hooks); those are exactly
    what ``output_hidden_states`` numbers them (i: decoder layer i - 1's output; the last: after the final norm)."""
    import torch

    from clarifier.core.target import DECISION_PREFIX
    from clarifier.engine.inference import ClarifierEngine, positions_from_mask

    engine = ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32")
    items = [(e.history, e.query, e.passages) for e in _examples(3, "h")]
    _, feats = engine.decision_features(items, [1, 2])
    enc = engine._encode([engine._prompt(h, q, p) + DECISION_PREFIX for h, q, p in items])
    with torch.inference_mode():
        out = engine.model(**enc, position_ids=positions_from_mask(enc["attention_mask"]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[1][:, -1], out.hidden_states[2][:, -1]], dim=-1)
    assert feats.shape == (3, 128) and torch.allclose(feats, expected, atol=1e-5)

    # Mean pooling: every prompt token's states averaged, the left padding of shorter prompts masked out
    # (the three prompts differ in length); the last layer's come from the final norm, as numbered above.
    m = enc["attention_mask"].unsqueeze(-1).float()
    assert len(set(enc["attention_mask"].sum(1).tolist())) > 1
    _, both = engine.decision_features(items, [1, 2], ["last", "mean"])
    means = [(out.hidden_states[i] * m).sum(1) / m.sum(1) for i in (1, 2)]
    assert both.shape == (3, 256) and torch.allclose(both, torch.cat([expected, *means], dim=-1), atol=1e-5)


def test_engine_batches_neighbours_by_length_and_returns_every_result_in_the_given_order(tiny_model_dir):
    """score_examples / predict batch turns of similar rendered length (a batch pads to its longest prompt) and
    put each result back at its turn's place: the same scores as batching them as they come, to float noise."""
    import numpy as np

    from clarifier.core.prompt import length_order, render_user_message
    from clarifier.engine.inference import ClarifierEngine

    engine = ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32")
    examples = _examples(9, "b")
    examples[3] = examples[3].model_copy(update={"query": examples[3].query + " and more words" * 30})  # the longest
    lengths = [len(render_user_message(e.history, e.query, e.passages, engine.opts)) for e in examples]
    batches = engine.batches(examples, 4)
    assert [len(b) for b in batches] == [4, 4, 1] and sorted(sum(batches, [])) == list(range(9))
    assert sum(batches, []) == length_order(examples, engine.opts)
    flat = [lengths[i] for i in sum(batches, [])]
    assert flat == sorted(flat) and batches[-1] == [3]
    assert engine.batches(examples, 4, order="given") == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    with pytest.raises(ValueError, match="order must be 'length' or 'given'"):
        engine.batches(examples, 4, order="random")

    by_length = engine.score_examples(examples, 4)
    given = engine.score_examples(examples, 4, order="given")
    one_by_one = [engine.score([(e.history, e.query, e.passages)])[0] for e in examples]
    assert np.allclose(by_length, one_by_one, atol=1e-5) and np.allclose(given, one_by_one, atol=1e-5)
    preds = engine.predict(examples, 4)
    assert [p.confidence for p in preds] == by_length  # predict batches as score_examples does


def test_a_head_on_early_layers_stops_the_pass_there_and_the_rows_that_ask_finish_it(tiny_model_dir):
    """A head that reads no layer past k: the decision pass runs layers 1..k only (the later layers are never
    called), its scores and features are those of the whole pass, and the rows that ask go on through the rest,
    so their questions are the tokens of the whole pass's cache and of a prefill of their own."""
    import torch

    from clarifier.core.schema import ClarifyRequest
    from clarifier.engine.decision_head import DecisionHead
    from clarifier.engine.inference import ClarifierEngine
    from clarifier.train.decision_head import hidden_features

    engine = ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32", max_new_tokens=12)
    hidden = engine.model.config.hidden_size
    torch.manual_seed(0)
    engine.decision_head = DecisionHead([1], torch.randn(2 * hidden) * 0.5, 0.0, ["last", "mean"])
    items = [(e.history, e.query, e.passages) for e in _examples(6, "s")]

    calls = []
    last = engine.model.get_decoder().layers[1]
    hook = last.register_forward_hook(lambda _m, args, _o: calls.append(args[0].shape[0]))
    try:
        stopped, state = engine._decide(items, keep_cache=True)
        assert calls == [] and state.rest is not None  # layer 2 never ran
        _, _, full = engine._decision_pass(items, True, [1], ["last", "mean"])  # stop=False: the whole pass
        assert calls == [len(items)] and full.rest is None
        p_full = engine.decision_head.probability(engine._decision_pass(items, False, [1], ["last", "mean"])[1])
        assert torch.allclose(torch.tensor(stopped), p_full.float(), atol=1e-6)
        _, f_stop = engine.decision_features(items, [1], ["last", "mean"], token=False)
        tok, f_full = engine.decision_features(items, [1], ["last", "mean"])
        assert torch.equal(f_stop, f_full) and not any(t != t for t in tok)
        calls.clear()  # the head's train turns while it is fitted (token=False): the pass stops there too
        examples = _examples(6, "s")
        _, x_stop = hidden_features(engine, examples, [1], 4, "train", lambda _m: None, ("last", "mean"), token=False)
        assert calls == []
        _, x_full = hidden_features(engine, examples, [1], 4, "train", lambda _m: None, ("last", "mean"))
        assert calls and (x_stop == x_full).all()

        rows = [1, 3, 4]
        sub = [items[i] for i in rows]
        calls.clear()
        got = engine._continue_ids(state, rows, sub)
        assert calls[0] == len(rows)  # only the rows that ask finished the pass (then the decoding steps)
        want = engine._continue_ids(full, rows, sub)
        assert got.tolist() == want.tolist() == engine._prefill_ids(sub).tolist()
    finally:
        hook.remove()

    # Served: the same answers as from a whole pass (the tiny model's questions do not parse: valid_output says so)
    engine.threshold = sorted(stopped)[3]
    reqs = [ClarifyRequest(history=h, query=q, passages=p) for h, q, p in items]

    def served(e):
        return [(round(a.confidence, 5), a.valid_output, a.needs_clarification, a.question, a.usage.completion_tokens)
                for a in e.clarify(reqs)]

    answers = served(engine)
    assert sum(not valid or asked for _, valid, asked, _, _ in answers) == 3
    engine.early_stop = False  # the whole pass
    calls.clear()
    hook = last.register_forward_hook(lambda _m, args, _o: calls.append(args[0].shape[0]))
    try:
        assert served(engine) == answers
        assert calls[0] == len(items)
    finally:
        hook.remove()
