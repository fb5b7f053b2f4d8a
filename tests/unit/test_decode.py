"""The engine's decode path (clarifier.engine.decode): the same greedy tokens as transformers' generate, bf16 decode
weights beside an fp32 decision, and a clear fallback where the architecture has no fast path."""

import pytest

from clarifier.core.config import ConfigError, build_config
from clarifier.core.schema import ConversationLog
from clarifier.core.target import try_parse_target


def _items(n=8, seed=4):
    from clarifier.data.synthetic import generate_conversations

    exs = [e for c in generate_conversations(30, seed=seed) for e in ConversationLog.model_validate(c).explode()]
    return [(e.history, e.query, e.passages) for e in exs[:n]]


def _strip(row, pad):
    ids = row.tolist()
    while ids and ids[-1] == pad:
        ids.pop()
    return ids


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from clarifier.engine.inference import ClarifierEngine

    def make(precision, decode):
        return ClarifierEngine.from_base(str(tiny_model_dir), precision=precision, max_new_tokens=16, decode=decode)

    return {(p, d): make(p, d) for p in ("fp32", "bf16") for d in ("generate", "fast", "auto")} | {
        ("fp32", "fast-bf16"): make("fp32", "fast-bf16")}


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_fast_decoding_gives_generates_tokens_for_every_row(engines, prec):
    """From a fresh prefill, and continued from the decision pass's cache for all rows and for a subset: the ids
    match ``generate``'s one for one (rows ending at different steps are padded alike)."""
    fast, ref = engines[(prec, "fast")], engines[(prec, "generate")]
    assert fast.decode_path == "fast" and ref.decode_path == "generate"
    items = _items(8)
    assert fast._prefill_ids(items).tolist() == ref._prefill_ids(items).tolist()
    for rows in ([0, 1, 2, 3, 4, 5, 6, 7], [1, 4, 5]):
        sub = [items[i] for i in rows]
        _, s_fast = fast._decide(items, keep_cache=True)
        _, s_ref = ref._decide(items, keep_cache=True)
        got = fast._continue_ids(s_fast, rows, sub)
        want = ref._continue_ids(s_ref, rows, sub)
        assert got.tolist() == want.tolist()
    lengths = {len(_strip(r, fast.tok.pad_token_id)) for r in got}
    assert len(lengths) > 1 or max(lengths) == fast.max_new_tokens  # rows that stop early are exercised


def test_fast_decoding_without_the_target_constraint_matches_too(tiny_model_dir):
    from clarifier.engine.inference import ClarifierEngine

    fast, ref = (ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32", max_new_tokens=12, decode=d)
                 for d in ("fast", "generate"))
    fast.constrain_target = ref.constrain_target = False
    items = _items(5, seed=7)
    assert fast._prefill_ids(items).tolist() == ref._prefill_ids(items).tolist()


def test_one_new_token_is_the_first_steps_argmax(tiny_model_dir):
    from clarifier.engine.inference import ClarifierEngine

    fast, ref = (ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32", max_new_tokens=1, decode=d)
                 for d in ("fast", "generate"))
    items = _items(3)
    got = fast._prefill_ids(items)
    assert got.shape[1] == 1 and got.tolist() == ref._prefill_ids(items).tolist()


def test_bf16_decode_weights_beside_an_fp32_decision(engines, tiny_model_dir):
    """``fast-bf16``: the decision is the fp32 engine's to the last bit; questions decode from bf16 weights and are
    valid targets (the constraint holds); the decoder keeps its own bf16 copy, the model stays fp32."""
    import torch

    from clarifier.core.schema import ClarifyRequest
    from clarifier.engine.inference import ClarifierEngine

    eng, ref = engines[("fp32", "fast-bf16")], engines[("fp32", "generate")]
    assert eng.precision == "fp32" and eng.decode_path == "fast-bf16"
    assert eng.decoder.layers[0].qkv.dtype == torch.bfloat16
    assert next(eng.model.parameters()).dtype == torch.float32
    items = _items(8)
    assert eng.score(items) == ref.score(items)
    roomy = ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32", max_new_tokens=48, decode="fast-bf16")
    reqs = [ClarifyRequest(history=h, query=q, passages=p) for h, q, p in items]
    out = roomy.clarify(reqs, threshold=0.0)
    assert all(r.needs_clarification and r.valid_output and r.question for r in out)
    for text, (h, _q, p) in zip(roomy.generate_clarification(items), items):
        assert try_parse_target(text, history_len=len(h), passage_ids=[x.id for x in p])[0] is not None


def test_auto_decodes_in_the_models_dtype_with_lookup_drafts(engines):
    """``auto`` is the fast path in the model's own dtype, checking prompt-lookup drafts (measured faster than bf16
    decode weights on an fp32 host, one request or a batch, and ``generate``'s tokens); ``fast-bf16`` checks none."""
    from clarifier.engine.decode import LOOKUP

    for prec in ("fp32", "bf16"):
        assert engines[(prec, "auto")].decode_path == "fast"
        assert engines[(prec, "auto")].decoder.lookup == LOOKUP > 0
    assert engines[("fp32", "fast-bf16")].decoder.lookup == 0


def test_lookup_drafts_keep_generates_tokens_one_request_at_a_time(tiny_model_dir):
    """One request at a time the fast path checks drafts copied from the prompt, the target's fixed words and its
    last answers: the tokens are still ``generate``'s, and a request asked again (its answer now among the recent
    ones) takes fewer steps than tokens."""
    from clarifier.engine.inference import ClarifierEngine

    fast, ref = (ClarifierEngine.from_base(str(tiny_model_dir), precision="fp32", max_new_tokens=16, decode=d)
                 for d in ("fast", "generate"))
    assert fast.decoder.lookup > 0
    items = _items(6, seed=5)
    for it in items:
        assert fast._prefill_ids([it]).tolist() == ref._prefill_ids([it]).tolist()
    steps = []
    step = fast.decoder._step
    fast.decoder._step = lambda *a, **kw: steps.append(a[0].shape[1]) or step(*a, **kw)
    again = fast._prefill_ids([items[-1]])
    assert again.tolist() == ref._prefill_ids([items[-1]]).tolist()
    n = len(_strip(again[0], fast.tok.pad_token_id))
    assert max(steps) > 1 and len(steps) < n - 1  # drafts were checked and kept


def test_lookup_drafts_the_longest_ngram_seen_last():
    from clarifier.engine.decode import _Lookup

    look = _Lookup(8, hints=[7, 8, 9, 1, 2, 3, 4])
    assert look.row([5, 1, 2, 6, 9, 1, 2], 8) == [3, 4]  # "9 1 2" is in the hints; the row's own "1 2" is shorter
    # "1 2" in the row itself (before the hints), newest first; after a 2-token match at most k/2 drafts
    assert look.row([5, 1, 2, 6, 0, 4, 4, 4, 4, 4, 1, 2], 8) == [6, 0, 4, 4]
    assert look.row([3, 5, 1, 2], 8) == [3, 4]  # only in the hints
    assert look.row([6, 8], 8) == [9, 1]  # after a 1-token match, k/4
    assert look.row([5, 1, 2, 6, 0, 1, 2], 1) == [6]
    assert look.row([42, 43], 8) == []  # nothing to copy


def test_model_dtype_decoding_shares_the_models_weights(engines):
    """In the model's dtype the fused q/k/v and gate/up matrices are the model's own weights (views), not a copy."""
    eng = engines[("fp32", "fast")]
    layer, fused = eng.model.model.layers[0], eng.decoder.layers[0]
    assert layer.self_attn.q_proj.weight.data_ptr() == fused.qkv.data_ptr()
    assert layer.mlp.gate_proj.weight.data_ptr() == fused.gate_up.data_ptr()
    assert eng.decoder.lm_head.data_ptr() == eng.model.get_input_embeddings().weight.data_ptr()  # tied: one matrix


def test_architectures_without_a_fast_path_keep_generate(tiny_model_dir):
    """``auto`` falls back to generate where the decoder cannot decode exactly (here: an unmerged LoRA adapter, whose
    projections are not the layer's weights); asking for ``fast`` there is a clear error; an unknown mode too."""
    from peft import LoraConfig, get_peft_model

    from clarifier.engine.decode import make_decoder, supports
    from clarifier.engine.models import load_causal_lm

    base = load_causal_lm(str(tiny_model_dir))
    assert supports(base) is None
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).base_model.model
    assert "not plain Linear" in supports(lora)
    assert make_decoder(lora, "auto") is None
    with pytest.raises(ValueError, match="decode=generate"):
        make_decoder(lora, "fast")
    with pytest.raises(ValueError, match="auto, fast, fast-bf16, generate"):
        make_decoder(base, "compiled")
    base.config.model_type = "gemma3_text"
    assert "gemma3_text" in supports(base)


def test_decode_is_a_config_key_with_a_clear_error():
    cfg = build_config({})
    assert cfg.model.decode == "auto" and cfg.serve.decode == "auto"
    assert build_config({}, ["serve.decode=fast-bf16"]).serve.decode == "fast-bf16"
    with pytest.raises(ConfigError, match="model.decode"):
        build_config({}, ["model.decode=turbo"])
