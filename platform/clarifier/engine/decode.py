"""Greedy decoding without ``generate``'s per-token overhead: the engine's decode path for Llama-family models.

A clarifying question is ~25 tokens, one forward pass each over one token per row. At that size a step is the
weights read once (memory bound) plus the cost of launching ~30 layers of small eager operations; ``generate`` adds
its own per-step work on top (input preparation, a cache that grows by concatenation, mask building, stopping
criteria). :class:`FastDecoder` decodes with

* a **static KV cache**: the decision pass's keys and values copied once into buffers sized for the longest answer,
  the tokens after it (`` clarify\n``) encoded in one step, then one column written in place per token (left padding
  keeps every row at the same column, as ``generate`` does). Without a cache the prompt goes through the model's own
  forward first (a large matrix product, where the model's kernels are the right ones);
* **fused weights**: q/k/v in one matrix and gate/up in one, so a layer is five matrix-vector products;
* **drafts checked several per step** (``lookup``, one request at a time): tokens copied from the prompt, the
  target's fixed words or the decoder's last answers after the n-gram that ends the answer so far; one step computes
  the logits after each, and greedy keeps the drafts it would have picked, then its own next token (prompt lookup
  decoding). A step of several tokens reads the weights once, like a step of one;
* **decode weights in their own dtype** (``weights="bf16"``): a step reads every weight once, so bf16 halves the bytes
  even on a CPU without bf16 arithmetic. Only the products read bf16; norms, rotary embedding, attention over the
  cache and the residual stream stay in the model's dtype, and the decision pass keeps the model's precision (its
  threshold was calibrated there). The agreement with the model's own precision: ``benchmarks/engine/bench_decode.py``.

Outputs follow ``generate``'s greedy semantics exactly (finished rows are padded, the logits processor sees the
whole sequence, stopping when every row has produced EOS or after ``max_new_tokens``), so the target constraint
and every caller keep working; in the model's own dtype the tokens match ``generate`` (tested).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Decoder-only architectures whose layers are Llama's (RMSNorm, rotary q/k, GQA attention, SiLU-gated MLP).
SUPPORTED = ("llama",)


def positions_from_mask(attention_mask):
    """Position ids of left-padded rows, as ``generate`` computes them: real tokens count from 0."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def supports(model) -> str | None:
    """``None`` when :class:`FastDecoder` can decode ``model``, else why not (it then keeps ``generate``)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {SUPPORTED}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "biases in attention or MLP"
    rope = getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return f"rope_scaling {rope}"  # inv_freq is read from the model, but dynamic kinds change it per length
    if model.device.type != "cpu":
        return f"device {model.device.type} (generate is already fused there)"
    import torch

    layers = getattr(model.get_decoder(), "layers", None) or []
    for layer in layers[:1]:
        projs = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                 layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
        if any(type(p) is not torch.nn.Linear for p in projs):  # an unmerged LoRA layer: its weight is not the layer's
            return "projections are not plain Linear layers (an adapter not merged?)"
    return None


@dataclass
class _Layer:
    norm1: Any
    qkv: Any  # [q_dim + 2 * kv_dim, hidden]
    o: Any
    norm2: Any
    gate_up: Any  # [2 * intermediate, hidden]
    down: Any


class FastDecoder:
    """Greedy decoding of a Llama-family ``model`` (LoRA merged) with a static cache and fused weights.

    ``weights``: ``"model"`` (the model's dtype; the tokens match ``generate``) or ``"bf16"`` (a bf16 copy of the
    decoder's weights for decoding only; half the bytes read per token). ``lookup``: drafts checked per step
    (:class:`_Lookup`; 0: one token per step), drafted from the prompt, the ``hints`` and the decoder's last
    ``RECENT`` answers.
    """

    RECENT = 8

    def __init__(self, model, weights: str = "model", lookup: int = 0):
        import torch

        why = supports(model)
        if why:
            raise ValueError(f"FastDecoder cannot decode this model: {why}")
        if weights not in ("model", "bf16"):
            raise ValueError(f"weights must be 'model' or 'bf16', not {weights!r}")
        if lookup < 0:
            raise ValueError(f"lookup must be 0 (off) or the drafts checked per step, not {lookup}")
        self.model = model
        self.lookup = lookup
        self._recent: deque[list[int]] = deque(maxlen=self.RECENT)  # the last answers' ids: drafts for the next
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.model_dtype = next(model.parameters()).dtype
        self.dtype = torch.bfloat16 if weights == "bf16" else self.model_dtype
        self.weights = weights
        dec = model.get_decoder()
        rot = dec.rotary_emb
        self.inv_freq = rot.inv_freq.float()
        self.attention_scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.act = self.model_dtype  # activations, norms and the KV cache
        d = self.dtype

        def w(t):
            return t.detach().to(d).contiguous()

        def norm(t):
            return t.detach().to(self.act).contiguous()

        with torch.no_grad():
            self.layers = [self._fuse(layer, w, norm) for layer in dec.layers]
            self.norm = norm(dec.norm.weight)
            self.embed = w(dec.embed_tokens.weight)
            head = model.get_output_embeddings().weight
            self.lm_head = self.embed if head is dec.embed_tokens.weight and d == self.model_dtype else w(head)
        self.q_dim = self.n_heads * self.head_dim
        self.kv_dim = self.n_kv * self.head_dim
        self.inter = self.layers[0].gate_up.shape[0] // 2 if self.layers else 0

    def _remember(self, new_ids, eos: int | None) -> None:
        for ids in new_ids.tolist():
            self._recent.append(ids[: ids.index(eos) + 1] if eos in ids else ids)

    def _fuse(self, layer, w, norm) -> _Layer:
        """One layer's weights for decoding; in the model's dtype the model's own projections become views of the
        fused matrices (no second copy in memory), in bf16 the copy is the decoder's own."""
        import torch

        att, mlp = layer.self_attn, layer.mlp
        fused = _Layer(norm1=norm(layer.input_layernorm.weight),
                       qkv=w(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])),
                       o=w(att.o_proj.weight),
                       norm2=norm(layer.post_attention_layernorm.weight),
                       gate_up=w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                       down=w(mlp.down_proj.weight))
        if self.dtype == self.model_dtype:
            for parts, whole in (((att.q_proj, att.k_proj, att.v_proj), fused.qkv),
                                 ((mlp.gate_proj, mlp.up_proj), fused.gate_up)):
                start = 0
                for p in parts:
                    n = p.weight.shape[0]
                    p.weight = torch.nn.Parameter(whole[start: start + n], requires_grad=False)
                    start += n
        return fused

    # ---- one step ----------------------------------------------------------------------------------

    def _rope(self, positions):
        """cos, sin for ``positions`` [batch, n] (as the model's rotary embedding computes them): [batch, 1, n, hd]."""
        import torch

        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.act)
        sin = (emb.sin() * self.attention_scaling).to(self.act)
        return cos[:, None], sin[:, None]

    def _linear(self, x, weight):
        """``x @ weight.T`` with activations in the model's dtype and the weight in its own (bf16 decode weights
        are read as bf16, the rest of the step -- norms, rotary, attention, residual -- stays in the model's
        dtype, where a CPU without bf16 arithmetic is fast)."""
        import torch.nn.functional as F

        if weight.dtype == x.dtype:
            return F.linear(x, weight)
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)

    def _step(self, tokens, positions, keys, values, col: int, mask, every: bool = False):
        """Logits (float32) after ``tokens`` [batch, n] written at cache columns ``col..col+n``: [batch, vocab] after
        the last token, or [batch, n, vocab] after each (``every``); ``mask`` [batch, 1, n, col + n]: which columns
        each new token attends to."""
        import torch
        import torch.nn.functional as F

        b, n = tokens.shape
        hd, half = self.head_dim, self.head_dim // 2
        lin = self._linear
        x = F.embedding(tokens, self.embed).to(self.act)  # [b, n, hidden]
        cos, sin = self._rope(positions)
        scale = hd ** -0.5
        end = col + n
        for i, L in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), L.norm1, self.eps)
            qkv = lin(h, L.qkv)
            q = qkv[..., : self.q_dim].view(b, n, self.n_heads, hd).transpose(1, 2)
            k = qkv[..., self.q_dim: self.q_dim + self.kv_dim].view(b, n, self.n_kv, hd).transpose(1, 2)
            v = qkv[..., self.q_dim + self.kv_dim:].view(b, n, self.n_kv, hd).transpose(1, 2)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            keys[i][:, :, col:end] = k
            values[i][:, :, col:end] = v
            a = F.scaled_dot_product_attention(q, keys[i][:, :, :end], values[i][:, :, :end], attn_mask=mask,
                                               scale=scale, enable_gqa=self.n_kv != self.n_heads)
            x = x + lin(a.transpose(1, 2).reshape(b, n, self.q_dim), L.o)
            h = F.rms_norm(x, (x.shape[-1],), L.norm2, self.eps)
            gu = lin(h, L.gate_up)
            x = x + lin(F.silu(gu[..., : self.inter]) * gu[..., self.inter:], L.down)
        x = F.rms_norm(x if every else x[:, -1], (x.shape[-1],), self.norm, self.eps)
        return lin(x, self.lm_head).float()

    # ---- greedy loop ---------------------------------------------------------------------------------

    def _static(self, cache, b: int, room: int):
        """Every layer's keys and values of a transformers cache copied into buffers of ``room`` columns."""
        import torch

        keys, values = [], []
        for layer in cache.layers:
            k = torch.zeros((b, self.n_kv, room, self.head_dim), dtype=self.act)
            v = torch.zeros_like(k)
            n = layer.keys.shape[2]
            k[:, :, :n] = layer.keys
            v[:, :, :n] = layer.values
            keys.append(k)
            values.append(v)
        return keys, values

    def generate(self, input_ids, attention_mask, *, past_key_values=None, max_new_tokens: int,
                 eos_token_id: int | None, pad_token_id: int | None, logits_processor=None,
                 hints: list[int] | None = None):
        """``model.generate(..., do_sample=False)``'s output for left-padded ``input_ids``: prompt + new ids.

        ``past_key_values``: a cache holding the first ``n`` columns of ``input_ids`` (the decision pass's); the
        rest are encoded in one step of this decoder. Without it the prompt goes through the model's own forward.
        ``hints``: token ids the drafts may also be copied from (with ``lookup``; the engine passes the target's
        skeleton)."""
        import torch

        model = self.model
        b, length = input_ids.shape
        done = past_key_values.get_seq_length() if past_key_values is not None else 0
        pad = eos_token_id if pad_token_id is None else pad_token_id
        with torch.inference_mode():
            positions = positions_from_mask(attention_mask)
            room = length + max_new_tokens
            row = torch.zeros((b, room), dtype=torch.bool)  # the columns every row attends to
            row[:, :length] = attention_mask.bool()
            if done == 0:  # no cache: the prompt through the model's own forward (a large matrix product)
                out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                            use_cache=True, logits_to_keep=1)
                keys, values = self._static(out.past_key_values, b, room)
                logits = out.logits[:, -1:, :].float()
                del out
            else:  # the decision pass's cache, then the tokens after it (`` clarify\n``) in one step
                keys, values = self._static(past_key_values, b, room)
                n = length - done
                causal = torch.ones((n, n), dtype=torch.bool).tril()
                mask = row[:, None, None, :length].expand(b, 1, n, length).clone()
                mask[:, :, :, done:] &= causal
                logits = self._step(input_ids[:, done:], positions[:, done:], keys, values, done, mask)[:, None]
            seq = input_ids
            unfinished = torch.ones(b, dtype=torch.bool)
            col, pos = length, positions[:, -1:] + 1  # the cache column and position of the next token written
            drafts = seq.new_zeros((b, 0))
            lookup = None
            if self.lookup and b <= _Lookup.ROWS:  # a batch's step costs its rows x (1 + drafts), keeps its worst row's
                recent = tuple(self._recent)  # a snapshot: a replica's other thread may add to it
                lookup = _Lookup(self.lookup, list(hints or []) + [t for ids in recent for t in ids])
            while True:
                # logits [b, 1 + drafts, vocab]: after the last token written and after each draft. Greedy picks one
                # token per column; a draft is kept while it is the token greedy picks, for every row still going.
                for kept in range(logits.shape[1]):
                    scores = logits[:, kept]
                    if logits_processor is not None:
                        scores = logits_processor(seq, scores)
                    nxt = scores.argmax(-1)
                    if eos_token_id is not None:
                        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
                    seq = torch.cat([seq, nxt[:, None]], dim=1)
                    if eos_token_id is not None:
                        unfinished &= nxt != eos_token_id
                    if not bool(unfinished.any()) or seq.shape[1] - length == max_new_tokens:
                        if self.lookup:
                            self._remember(seq[:, length:], eos_token_id)
                        return seq
                    if kept == drafts.shape[1] or bool((nxt != drafts[:, kept])[unfinished].any()):
                        break
                if drafts.shape[1]:  # the last step wrote its token and drafts from ``col - 1``: drop those not kept
                    row[:, col + kept: col + drafts.shape[1]] = False
                    col, pos = col + kept, pos + kept
                left = max_new_tokens - (seq.shape[1] - length) - 1  # drafts this step may check
                drafts = lookup.drafts(seq, unfinished, left) if lookup is not None and left > 0 else drafts[:, :0]
                tokens = torch.cat([seq[:, -1:], drafts], dim=1)
                n = tokens.shape[1]
                row[:, col: col + n] = True
                mask = row[:, None, None, : col + n]
                if n > 1:
                    mask = mask.expand(b, 1, n, col + n).clone()
                    mask[:, :, :, col:] &= torch.ones((n, n), dtype=torch.bool).tril()
                logits = self._step(tokens, pos + torch.arange(n), keys, values, col, mask, every=True)
                col, pos = col + 1, pos + 1


class _Lookup:
    """Draft tokens for one decode step by prompt lookup: the longest n-gram (``NGRAM`` down to 1 tokens) that ends
    a row's sequence, found earlier in that row (its prompt and what it generated, newest first) or in the hints,
    proposes the tokens that followed it there. One step then checks up to ``k`` drafts at once; greedy keeps those
    it would have picked, so the tokens are the same as one per step. On a CPU a step of a few tokens costs little
    more than one token's (the weights are read once), and a clarifying question copies much from its conversation
    and passages; the target's fixed words and the model's habits come from the hints."""

    NGRAM = 3
    ROWS = 1

    def __init__(self, k: int, hints: list[int] | None):
        self.k = k
        self.hints = hints or []

    @staticmethod
    def _after(ctx: list[int], suffix: list[int], k: int, skip_end: bool) -> list[int]:
        n = len(suffix)
        for s in range(len(ctx) - n - (1 if skip_end else 0), -1, -1):
            if ctx[s: s + n] == suffix:
                follow = ctx[s + n: s + n + k]
                if follow:
                    return follow
        return []

    def row(self, ids: list[int], k: int) -> list[int]:
        """Drafts for one row: up to ``k`` after a match of ``NGRAM`` tokens, fewer after a shorter one (a shorter
        match is more often wrong, and a wider step costs more: k/2 after 2 tokens, k/4 after 1)."""
        for n in range(min(self.NGRAM, len(ids)), 0, -1):
            suffix = ids[-n:]
            most = max(1, k >> (self.NGRAM - n))
            found = self._after(ids, suffix, most, True) or self._after(self.hints, suffix, most, False)
            if found:
                return found
        return []

    def drafts(self, seq, unfinished, left: int):
        """[batch, w] drafts (w <= min(k, left)); rows without one, or finished, are padded with their last token
        (checked like any draft, so only a row's own greedy token is ever kept)."""
        import torch

        k = min(self.k, left)
        found = [self.row(ids, k) if go else [] for ids, go in zip(seq.tolist(), unfinished.tolist())]
        w = max(map(len, found))
        last = seq[:, -1].tolist()
        return torch.tensor([f + [t] * (w - len(f)) for f, t in zip(found, last)], dtype=seq.dtype)


#: ``auto``: the fast path where the architecture has it (in the model's dtype, with prompt-lookup drafts), else
#: ``generate``; ``fast``: that path (``generate``'s tokens) or an error; ``fast-bf16``: that path with bf16 decode
#: weights (half the bytes read per token; on a CPU without bf16 arithmetic a step of several tokens is slow, so it
#: checks no drafts) or an error; ``generate``: transformers' ``generate``.
DECODE_MODES = ("auto", "fast", "fast-bf16", "generate")
#: Drafts a ``fast`` step checks at most (one request at a time). 6, 8 and 12 were alike on Abg-CoQA turns by hand;
#: ``benchmarks/engine/bench_decode.py`` measures 8 against none.
LOOKUP = 8


def resolve_decode(model, mode: str = "auto") -> str:
    """The decode path ``mode`` (:data:`DECODE_MODES`) gives ``model``: ``fast``, ``fast-bf16`` or ``generate``;
    a mode the model cannot have is refused here, when the engine loads, not at its first question."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {mode!r}")
    if mode == "generate":
        return "generate"
    why = supports(model)
    if why:
        if mode == "auto":
            log.debug("decoding with generate: %s", why)
            return "generate"
        raise ValueError(f"decode={mode!r} is not available for this model: {why}; use decode=generate")
    return "fast" if mode == "auto" else mode


def make_decoder(model, mode: str = "auto") -> FastDecoder | None:
    """The engine's decoder for ``mode`` (:data:`DECODE_MODES`); ``None`` means ``model.generate``."""
    path = resolve_decode(model, mode)
    if path == "generate":
        return None
    return FastDecoder(model, weights="bf16", lookup=0) if path == "fast-bf16" else FastDecoder(model, lookup=LOOKUP)
