"""The one inference engine, used by evaluation, serving and the quickstart alike.

Decision fast path: every request costs one forward pass that reads P(clarify) from the logits of
the first token after the fixed target prefix ``decision:`` (computed in float32 from the final
hidden state, whatever the model's precision); only requests at or above the threshold are decoded
further (grounding, then question), and that decoding continues from the decision pass's KV cache
(``one_prefill``): the prompt is encoded once per request, not once to decide and again to ask.
Everything decoded is constrained to the target grammar (``target_constraint``): a grounding line of
the request's own turns and passages, one plain-text question line, EOS, within ``max_new_tokens``.
Malformed generations (under the constraint only when ``max_new_tokens`` is too small for any
target) fall back to "no clarification" with ``valid_output=False`` -- never an exception.

Precision: engines load in the resolved ``precision`` (``clarifier.engine.precision``: ``auto`` = bf16 on
a device that computes it natively, else fp32); a LoRA adapter is merged into the float32 base
before the merged model is cast, so the weights are rounded once.

A *model folder* (what training writes and the registry stores) holds the trained weights -- a
PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, applied to the base
model named in ``clarifier.json``), or, after full fine-tuning, the whole model (``config.json`` +
``model*.safetensors``) -- the tokenizer, and ``clarifier.json`` with the base-model spec, the
decision threshold and the prompt options.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from clarifier.engine.decision_head import POOLINGS, DecisionHead
from clarifier.engine.decode import make_decoder, positions_from_mask, resolve_decode
from clarifier.engine.target_constraint import TargetConstraint, grammar_for, vocab_index
from clarifier.engine.models import ModelResolutionError, load_causal_lm, load_tokenizer, resolve_base_model
from clarifier.engine.precision import place, resolve_precision, torch_dtype
from clarifier.core.prompt import PromptOptions, first_shown_turn, length_order, render_prompt
from clarifier.core.schema import ClarifyRequest, ClarifyResponse, Grounding, Usage
from clarifier.core.target import (
    ANSWER,
    CLARIFY,
    DECISION_PREFIX,
    QUESTION_HEAD,
    JointTarget,
    render_segments,
    try_parse_target,
)

log = logging.getLogger(__name__)

META_FILE = "clarifier.json"
FORMAT_VERSION = 1


@dataclass
class ModelMeta:
    base_model: str
    threshold: float = 0.5
    prompt: dict | None = None
    finetune: str = "lora"  # how the weights were trained (model.finetune): lora | full
    precision: str | None = None  # the resolved training precision (bf16 | fp32); None: written before it was recorded
    # The decision's confusion counts at ``threshold`` on the calibration split ({split, n, tp, fn, tn, fp, rule}):
    # what the audit corrects its estimates with when it has nothing better. None: not calibrated.
    calibration: dict | None = None
    # How the decision head (decision_head.safetensors) was fitted ({layers, c, n_train, dev_auroc, ...}); None:
    # the decision is read from the two decision-token logits.
    decision_head: dict | None = None
    format_version: int = FORMAT_VERSION

    def prompt_options(self) -> PromptOptions:
        return PromptOptions(**(self.prompt or {}))


def end_at_question_line(generated: str) -> str:
    """Stop-sequence semantics: the output ends with the question line (a newline after it ends it)."""
    i = generated.find("question:")
    j = generated.find("\n", i) if i >= 0 else -1
    return generated[:j] if j >= 0 else generated


def write_meta(folder: str | Path, meta: ModelMeta) -> None:
    Path(folder, META_FILE).write_text(json.dumps(asdict(meta), indent=2))


def read_meta(folder: str | Path) -> ModelMeta:
    p = Path(folder, META_FILE)
    if not p.is_file():
        raise ModelResolutionError(f"{folder} is not a Clarifier model folder (no {META_FILE})")
    data = json.loads(p.read_text())
    return ModelMeta(**{k: v for k, v in data.items() if k in ModelMeta.__dataclass_fields__})


def refuse_pickles(folder: str | Path) -> None:
    bad = [p.name for p in Path(folder).glob("*") if p.suffix in {".bin", ".pt", ".pth", ".pkl", ".ckpt"}]
    if bad:
        raise ModelResolutionError(
            f"{folder} contains pickle files {bad}; Clarifier loads safetensors only and will not unpickle"
        )


# Files of a model folder that do not change its language model: the decision head and threshold (clarifier.json's
# other fields are read into the key), the card, adapt's summary.
NOT_WEIGHTS = {"decision_head.safetensors", META_FILE, "MODEL_CARD.md", "card.json", "adapt.json"}


def weights_key(folder: str | Path) -> str:
    """What a model folder's language model is: the same key means the same weights, tokenizer and prompt, so two
    models (say one and its ``clarifier adapt`` copies) can be served from one loaded copy, each with its own head and
    threshold (:class:`Decider`). A digest of every file but :data:`NOT_WEIGHTS` and of the base model, fine-tuning
    kind and prompt options; an unknown extra file only makes the key differ (no sharing), never wrongly equal."""
    import hashlib

    folder = Path(folder)
    meta = read_meta(folder)
    h = hashlib.sha256(json.dumps([meta.base_model, meta.finetune, meta.prompt], sort_keys=True).encode())
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in NOT_WEIGHTS):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def load_weights(folder: Path, meta: ModelMeta, cache_dir=None, dtype=None):
    """The model of a (non-pipeline) model folder, by what its files hold, in ``dtype`` (default fp32).

    A LoRA adapter is merged into the float32 base and the merged weights cast once."""
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        base = load_causal_lm(resolve_base_model(meta.base_model, cache_dir))
        merged = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
        return merged.to(dtype) if dtype is not None else merged
    if (folder / "config.json").is_file() and any(folder.glob("model*.safetensors")):
        return load_causal_lm(str(folder), dtype=dtype)
    raise ModelResolutionError(
        f"{folder} holds no weights: expected a LoRA adapter (adapter_config.json + adapter_model.safetensors) or "
        f"fully fine-tuned weights (config.json + model.safetensors); {META_FILE} says finetune={meta.finetune!r}")


def num_layers(folder: str | Path, cache_dir=None) -> int:
    """The number of transformer layers of a (non-pipeline) model folder's model, from its configuration alone
    (no weights loaded): the base model's for a LoRA adapter, the folder's own for full fine-tuning."""
    from transformers import AutoConfig

    folder = Path(folder)
    path = (resolve_base_model(read_meta(folder).base_model, cache_dir)
            if (folder / "adapter_config.json").is_file() else str(folder))
    config = AutoConfig.from_pretrained(path)
    return int(getattr(config, "num_hidden_layers", None) or config.get_text_config().num_hidden_layers)


@dataclass(frozen=True)
class Decider:
    """What differs between models that share their weights (a base + adapter and a prompt): the decision head,
    the threshold and the version label. An engine answers each request with its own decider, so models adapted
    from one (``clarifier adapt``: a new head and threshold, the same adapter) are served from one copy of the
    weights in one forward pass per batch (:mod:`clarifier.serving.tenants`)."""

    head: DecisionHead | None
    threshold: float
    version: str


def head_columns(head: DecisionHead, layers: Sequence[int], pooling: Sequence[str], hidden: int) -> list[int]:
    """The feature columns ``head`` reads in features computed for ``layers`` pooled as ``pooling`` (a superset of
    its own): :meth:`ClarifierEngine._decision_pass`'s layout, every pooling kind's layers in order."""
    blocks = [(kind, i) for kind in POOLINGS if kind in pooling for i in layers]
    at = {b: k for k, b in enumerate(blocks)}
    return [at[(kind, i)] * hidden + j for kind in POOLINGS if kind in head.pooling for i in head.layers
            for j in range(hidden)]


@dataclass
class DecisionPass:
    """What the decision forward pass leaves for generation: its inputs and its KV cache."""

    input_ids: Any  # torch.LongTensor [batch, length]: left-padded prompt + "decision:" ids
    attention_mask: Any
    cache: Any  # the transformers Cache of every row (None unless the pass kept it)
    prompt_tokens: list[int]  # tokens each row read (its unpadded length)
    # a pass that stopped after the head's deepest layer (``_decision_pass(stop=True)``) and kept its cache:
    # (the next layer's index, that layer's input hidden states [batch, length, hidden], the keyword arguments
    # every layer was called with); the rows that ask go through the rest of the layers (:meth:`_finish_cache`)
    rest: Any = None


class _Stopped(Exception):
    """Raised by the decision pass's hook after the last layer a decision head reads (the rest is not computed)."""


#: Architectures whose decoder calls every layer with the same keyword arguments (mask, rotary embedding), so a pass
#: stopped after layer k can be finished from k's output for the rows that ask (Gemma's layers differ by type).
FINISHABLE = ("llama",)


class ClarifierEngine:
    # Generation continues from the decision pass's KV cache (the prompt is encoded once). A
    # subclass whose decision and generation run different weights (PipelineEngine) sets False.
    one_prefill: bool = True
    # A head whose deepest layer is not the last ends the decision pass there (:meth:`_decision_pass`'s ``stop``);
    # False runs every layer (the benchmark's reference, benchmarks/engine/bench_early_exit.py).
    early_stop: bool = True

    def __init__(self, model, tokenizer, *, threshold: float = 0.5, version: str = "local",
                 prompt_opts: PromptOptions | None = None, max_new_tokens: int = 48,
                 constrain_target: bool = True, decision_head: DecisionHead | None = None, decode: str = "auto"):
        import torch

        self.model = model.eval()
        self.tok = tokenizer
        self.tok.padding_side = "left"
        self.threshold = threshold
        self.version = version
        self.opts = prompt_opts or PromptOptions()
        self.max_new_tokens = max_new_tokens
        self.constrain_target = constrain_target
        if constrain_target:
            vocab_index(self.tok)  # built once per tokenizer, here rather than in the first request
        self._torch = torch
        self.device = next(model.parameters()).device
        prefix = self.tok(DECISION_PREFIX, add_special_tokens=False)["input_ids"]
        ids_c = self.tok(f"{DECISION_PREFIX} {CLARIFY}", add_special_tokens=False)["input_ids"]
        ids_a = self.tok(f"{DECISION_PREFIX} {ANSWER}", add_special_tokens=False)["input_ids"]
        if ids_c[: len(prefix)] != prefix or ids_a[: len(prefix)] != prefix:
            raise ValueError("tokenizer does not split 'decision:' consistently; cannot score the decision")
        self.clarify_id, self.answer_id = ids_c[len(prefix)], ids_a[len(prefix)]
        if self.clarify_id == self.answer_id:
            raise ValueError("'clarify' and 'answer' share their first token; cannot score the decision")
        if decision_head is not None:
            decision_head.check(model.config.num_hidden_layers, model.config.hidden_size)
        self.decision_head = decision_head
        self.decode_path = resolve_decode(model, decode)  # fast | fast-bf16 | generate; a bad mode fails here

    @functools.cached_property
    def decoder(self):
        """The fast decoder of :attr:`decode_path` (None: ``model.generate``), built when a question is first decoded,
        so the engines that only score (calibration, the head's features, the audit's actors, adapt) never hold its
        fused or bf16 weights."""
        return make_decoder(self.model, self.decode_path)

    @functools.cached_property
    def _draft_hints(self) -> list[int]:
        """The target's fixed words, for the decoder's drafts (``decode._Lookup``): the grounding line and the
        question's head follow the decision line in every question decoded."""
        pieces = render_segments(JointTarget(needs_clarification=True, question="?"))
        text = "".join(t for seg, t in pieces if seg != "question") + QUESTION_HEAD  # grounding: none, none
        return self.tok(text, add_special_tokens=False)["input_ids"]

    @property
    def precision(self) -> str:
        """``bf16`` or ``fp32``: the dtype the model computes in."""
        return "bf16" if next(self.model.parameters()).dtype == self._torch.bfloat16 else "fp32"

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path, *, version: str = "local", cache_dir=None,
                    threshold: float | None = None, max_new_tokens: int = 48, precision: str = "auto",
                    device: str = "cpu", decision_head: bool = True, decode: str = "auto") -> "ClarifierEngine":
        """Load a joint Clarifier model folder: base model + LoRA adapter (merged for speed), or the fully
        fine-tuned weights, in ``precision`` (``auto`` / ``bf16`` / ``fp32``, resolved for ``device``), with
        its decision head when it has one (``decision_head=False``: decide from the decision-token logits).
        Any model URI, pipeline folders included: :func:`clarifier.engine.loading.load_engine`."""
        folder = Path(folder)
        refuse_pickles(folder)
        meta = read_meta(folder)
        model = load_weights(folder, meta, cache_dir, torch_dtype(resolve_precision(precision, device)))
        tok = load_tokenizer(str(folder))
        return cls(place(model, device), tok, threshold=meta.threshold if threshold is None else threshold,
                   version=version, prompt_opts=meta.prompt_options(), max_new_tokens=max_new_tokens,
                   decision_head=DecisionHead.load(folder) if decision_head else None, decode=decode)

    @classmethod
    def from_base(cls, base_model: str, *, cache_dir=None, threshold: float = 0.5,
                  prompt_opts: PromptOptions | None = None, max_new_tokens: int = 48, precision: str = "auto",
                  device: str = "cpu", decode: str = "auto") -> "ClarifierEngine":
        """The untrained base model, prompted with the same prompt (the zero-shot baseline)."""
        path = resolve_base_model(base_model, cache_dir)
        model = load_causal_lm(path, dtype=torch_dtype(resolve_precision(precision, device)))
        return cls(place(model, device), load_tokenizer(path), threshold=threshold,
                   version=f"base:{base_model}", prompt_opts=prompt_opts, max_new_tokens=max_new_tokens,
                   decode=decode)

    # ---- core ---------------------------------------------------------------------------------

    def _prompt(self, history, query, passages) -> str:
        return render_prompt(self.tok, history, query, passages, self.opts)

    def _encode(self, texts: list[str]):
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return {k: v.to(self.device) for k, v in enc.items()}

    def _decision_pass(self, items: list[tuple], keep_cache: bool = False, layers: list[int] | None = None,
                       pooling: Sequence[str] = ("last",), stop: bool = False):
        """One forward pass over ``prompt + "decision:"``: ``(P(clarify) from the decision tokens, the hidden
        states of ``layers`` pooled as ``pooling`` or None, DecisionPass)``.

        The two decision logits are computed in float32 from the final hidden state (a bf16 model's
        own logits are rounded to 8 bits of mantissa, too coarse for a calibrated threshold). With
        ``keep_cache`` the pass also returns its inputs and KV cache for :meth:`_ask`. ``layers`` are
        numbered as ``output_hidden_states`` numbers them (``i``: the output of decoder layer ``i - 1``;
        the last: after the final norm); hooks reduce each to its last position (``last``) and to its
        mean over the prompt's tokens (``mean``, padding masked) as it is computed, so a large batch does
        not hold every layer's states for every token. Features: every layer's ``last``, then every
        layer's ``mean`` (:mod:`clarifier.engine.decision_head`).

        ``stop``: when the deepest of ``layers`` is not the last, the pass ends after it (a head on the first half
        of the layers costs half a pass); the decision tokens' P(clarify) are then NaN (only a head decides). With
        ``keep_cache`` too (architectures in :data:`FINISHABLE`; others run the whole pass), the state keeps that
        layer's output, and :meth:`_continue_ids` finishes the cache of the rows that ask.
        """
        torch = self._torch
        texts = [self._prompt(h, q, p) + DECISION_PREFIX for h, q, p in items]
        head = self.model.get_output_embeddings()
        n_layers = self.model.config.num_hidden_layers
        captured: dict = {}
        stop_at = max(layers) if stop and layers and max(layers) < n_layers else None
        if stop_at and keep_cache and getattr(self.model.config, "model_type", None) not in FINISHABLE:
            stop_at = None

        def keep(i: int, kinds: Sequence[str]):
            def hook(_m, _args, out):
                t = out[0] if isinstance(out, tuple) else out
                if "last" in kinds:
                    captured[("last", i)] = t[:, -1, :].float()
                if "mean" in kinds:
                    m = captured["mask"]
                    captured[("mean", i)] = (t.float() * m).sum(1) / m.sum(1)
            return hook

        def stopper(_m, _args, kwargs, out):  # after the pooling hooks of the same layer (registered before it)
            if keep_cache:
                captured["rest"] = (stop_at, out[0] if isinstance(out, tuple) else out, kwargs)
            raise _Stopped

        hooks = [head.register_forward_hook(lambda _m, args, _out: captured.__setitem__("h", args[0]))]
        decoder = self.model.get_decoder() if layers else None
        for i in (layers or []):
            if i < n_layers:
                hooks.append(decoder.layers[i - 1].register_forward_hook(keep(i, pooling)))
            elif "mean" in pooling:  # the last layer after the final norm: the LM head sees only its last position
                if getattr(decoder, "norm", None) is None:
                    raise ValueError(f"mean pooling of the last layer needs the decoder's final norm "
                                     f"({type(decoder).__name__} has no .norm)")
                hooks.append(decoder.norm.register_forward_hook(keep(i, ("mean",))))
        if stop_at:
            hooks.append(decoder.layers[stop_at - 1].register_forward_hook(stopper, with_kwargs=True))
        cache = None
        try:
            with torch.inference_mode():
                enc = self._encode(texts)
                captured["mask"] = enc["attention_mask"].unsqueeze(-1).float()
                if stop_at and keep_cache:
                    from transformers import DynamicCache

                    cache = DynamicCache(config=self.model.config)  # the layers before the stop fill it
                try:
                    # Only the last position's logits: with a large vocabulary (Gemma: 262k) the full
                    # [batch, length, vocab] tensor would cost most of the time and gigabytes of memory.
                    out = self.model(**enc, position_ids=positions_from_mask(enc["attention_mask"]), logits_to_keep=1,
                                     use_cache=keep_cache, **({"past_key_values": cache} if cache is not None else {}))
                    cache = out.past_key_values if keep_cache else None
                except _Stopped:
                    out = None
                if out is None:
                    probs = torch.full((len(items),), float("nan"))
                else:
                    hidden = captured["h"][:, -1, :].float()
                    rows = [self.clarify_id, self.answer_id]
                    pair = hidden @ head.weight[rows].float().T
                    if getattr(head, "bias", None) is not None:
                        pair = pair + head.bias[rows].float()
                    cap = getattr(self.model.config, "final_logit_softcapping", None)
                    if cap:
                        pair = torch.tanh(pair / cap) * cap
                    probs = torch.softmax(pair, dim=-1)[:, 0]
                    captured.update({("last", i): hidden for i in (layers or []) if i >= n_layers})
                feats = (torch.cat([captured[(kind, i)] for kind in POOLINGS if kind in pooling for i in layers], dim=-1)
                         if layers else None)
        finally:
            for h in hooks:
                h.remove()
        state = DecisionPass(enc["input_ids"], enc["attention_mask"], cache,
                             [int(n) for n in enc["attention_mask"].sum(dim=1)], captured.get("rest"))
        return probs, feats, state

    def _finish_cache(self, state: DecisionPass, rows: list[int]):
        """The KV cache of rows ``rows`` through every layer, after a pass that stopped early and kept its cache
        (``state.rest``): their hidden states go on through the layers the pass did not compute, called as the pass
        called its layers (the same mask and rotary embedding, those rows' of them)."""
        torch = self._torch
        start, hidden, kwargs = state.rest
        b = hidden.shape[0]
        idx = torch.tensor(rows, device=hidden.device)
        cache = state.cache
        if len(rows) != b:
            cache.batch_select_indices(idx)

        def pick(v):  # a tensor with a row per item: those rows (a mask broadcast over the batch stays as it is)
            if isinstance(v, torch.Tensor):
                return v[idx] if v.dim() and v.shape[0] == b and len(rows) != b else v
            if isinstance(v, (tuple, list)):
                return type(v)(pick(x) for x in v)
            return v

        kwargs = {k: pick(v) for k, v in kwargs.items()} | {"past_key_values": cache, "use_cache": True}
        h = pick(hidden)
        with torch.inference_mode():
            for layer in self.model.get_decoder().layers[start:self.model.config.num_hidden_layers]:
                h = layer(h, **kwargs)
                h = h[0] if isinstance(h, tuple) else h
        state.rest = None
        return cache

    def _decide(self, items: list[tuple], keep_cache: bool = False,
                heads: Sequence[DecisionHead | None] | None = None) -> tuple[list[float], DecisionPass | None]:
        """P(clarify) per item -- from the decision head when the model has one, else from the decision
        tokens -- and the pass's state (see :meth:`_decision_pass`). ``heads``: each item's own head (None: the
        decision tokens), all read from one pass over the union of their layers."""
        if heads is None:
            heads = [self.decision_head] * len(items)
        distinct = list({id(h): h for h in heads if h is not None}.values())
        layers = sorted({i for h in distinct for i in h.layers})
        pooling = [k for k in POOLINGS if any(k in h.pooling for h in distinct)] or ["last"]
        # every item decided by a head: the pass ends after the deepest layer they read
        stop = self.early_stop and bool(layers) and all(h is not None for h in heads)
        token_probs, feats, state = self._decision_pass(items, keep_cache, layers or None, pooling, stop=stop)
        out = [float(x) for x in token_probs]
        for h in distinct:
            rows = [r for r, g in enumerate(heads) if g is h]
            x = feats if len(rows) == len(items) else feats[rows]
            if (list(h.layers), list(h.pooling)) != (layers, pooling):  # it reads some of the pass's features
                cols = head_columns(h, layers, pooling, self.model.config.hidden_size)
                x = x[:, self._torch.tensor(cols, device=feats.device)]
            for r, p in zip(rows, h.probability(x)):
                out[r] = float(p)
        return out, state

    def decision_features(self, items: list[tuple], layers: list[int], pooling: Sequence[str] = ("last",),
                          token: bool = True) -> tuple[list[float], Any]:
        """``(P(clarify) from the decision tokens, [n, len(pooling) * len(layers) * hidden] float32 features)``
        for ``(history, query, passages)`` items: what a decision head is fitted on (one forward pass).
        ``token=False``: the pass ends after the deepest of ``layers`` and the decision tokens' P(clarify) are NaN."""
        probs, feats, _ = self._decision_pass(items, False, layers, pooling, stop=not token)
        return [float(x) for x in probs], feats

    def score(self, items: list[tuple]) -> list[float]:
        """P(clarify) for ``(history, query, passages)`` items: one forward pass per batch."""
        if not items:
            return []
        return self._decide(items)[0]

    def batches(self, examples, batch_size: int, order: str = "length") -> list[list[int]]:
        """Indexes of ``examples`` in batches of ``batch_size``: neighbours by rendered length
        (:func:`clarifier.core.prompt.length_order`: a batch pads little) or, with ``order="given"``, as they come."""
        if order not in ("length", "given"):
            raise ValueError(f"order must be 'length' or 'given', got {order!r}")
        idx = length_order(examples, self.opts) if order == "length" else list(range(len(examples)))
        return [idx[k:k + batch_size] for k in range(0, len(idx), batch_size)]

    def score_examples(self, examples, batch_size: int = 8, progress=None, order: str = "length") -> list[float]:
        """P(clarify) for Examples, in their order, scored in batches of ``batch_size`` (:meth:`batches`; decision
        only, no decoding)."""
        scores: list[float] = [0.0] * len(examples)
        done = 0
        for rows in self.batches(examples, batch_size, order):
            for i, s in zip(rows, self.score([(examples[i].history, examples[i].query, examples[i].passages)
                                              for i in rows])):
                scores[i] = s
            done += len(rows)
            if progress:
                progress(done, len(examples))
        return scores

    def _generate_ids(self, enc: dict, items: list[tuple], cache=None):
        """Greedy decoding after ``enc`` (prompt + forced ``decision: clarify`` line): the new token ids."""
        kw = dict(past_key_values=cache, max_new_tokens=self.max_new_tokens, eos_token_id=self.tok.eos_token_id,
                  pad_token_id=self.tok.pad_token_id, logits_processor=self._target_constraint(enc, items))
        if self.decoder is not None:
            out = self.decoder.generate(enc["input_ids"], enc["attention_mask"], hints=self._draft_hints, **kw)
        else:
            with self._torch.inference_mode():
                out = self.model.generate(**enc, do_sample=False, **kw)
        return out[:, enc["input_ids"].shape[1]:]

    def _texts(self, new_ids) -> list[str]:
        head = f"{DECISION_PREFIX} {CLARIFY}\n"
        return [head + end_at_question_line(s) for s in self.tok.batch_decode(new_ids, skip_special_tokens=True)]

    def _prefill_ids(self, items: list[tuple]):
        """New token ids decoded for ``items`` with a prefill of their own (the two-pass path)."""
        head = f"{DECISION_PREFIX} {CLARIFY}\n"
        return self._generate_ids(self._encode([self._prompt(h, q, p) + head for h, q, p in items]), items)

    def generate_clarification(self, items: list[tuple]) -> list[str]:
        """Decode grounding and question after a forced ``decision: clarify`` line (own prefill)."""
        if not items:
            return []
        return self._texts(self._prefill_ids(items))

    def _ask(self, state: DecisionPass, rows: list[int], items: list[tuple]) -> tuple[list[str], list[int]]:
        """The target texts for ``items`` (rows ``rows`` of the decision pass) and how many tokens were
        generated for each: from the pass's KV cache when it kept one, else with a prefill of their own."""
        ids = self._continue_ids(state, rows, items) if state.cache is not None else self._prefill_ids(items)
        return self._texts(ids), self._generated_counts(ids)

    def _generated_counts(self, new_ids) -> list[int]:
        """Tokens generated per row: up to and including the first end-of-sequence token (the rest is padding)."""
        eos = self.tok.eos_token_id
        out = []
        for row in new_ids.tolist():
            out.append(row.index(eos) + 1 if eos in row else len(row))
        return out

    def _continue_ids(self, state: DecisionPass, rows: list[int], items: list[tuple]):
        """:meth:`generate_clarification` for ``items`` (rows ``rows`` of the decision pass),
        continuing from that pass's KV cache: only `` clarify\n`` is encoded, not the prompt again.

        The token sequence is exactly the one :meth:`generate_clarification` would encode (checked
        per row: where the tokenizer would merge differently across the boundary, those rows get
        their own prefill instead), so greedy outputs are the same token for token."""
        torch = self._torch
        head = f"{DECISION_PREFIX} {CLARIFY}\n"
        ids, mask = state.input_ids[rows], state.attention_mask[rows]
        suffixes = []
        for k, (h, q, p) in enumerate(items):
            full = self.tok(self._prompt(h, q, p) + head, add_special_tokens=False)["input_ids"]
            cached = ids[k][mask[k].bool()].tolist()
            suffixes.append(full[len(cached):] if full[:len(cached)] == cached else None)
        if any(s is None for s in suffixes) or len({tuple(s) for s in suffixes}) != 1:
            log.debug("decision prefix tokenises differently in the full prompt; generating with a new prefill")
            return self._prefill_ids(items)
        suffix = torch.tensor([suffixes[0]] * len(rows), dtype=ids.dtype, device=ids.device)
        enc = {"input_ids": torch.cat([ids, suffix], dim=1),
               "attention_mask": torch.cat([mask, torch.ones_like(suffix, dtype=mask.dtype)], dim=1)}
        cache = state.cache
        if state.rest is not None:  # the pass stopped at the head's deepest layer: the rows that ask go through the rest
            cache = self._finish_cache(state, rows)
        elif len(rows) != state.input_ids.shape[0]:  # keep only the rows that ask
            cache.batch_select_indices(torch.tensor(rows, device=ids.device))
        return self._generate_ids(enc, items, cache=cache)

    def _target_constraint(self, enc, items, written: list[str] | None = None):
        """Decoding after ``decision: clarify`` keeps to each request's target grammar
        (``target_constraint``); ``written``: target text already in the prompts after that line."""
        from transformers import LogitsProcessorList

        if not self.constrain_target:
            return None
        return LogitsProcessorList([TargetConstraint(
            self.tok, enc["input_ids"].shape[1],
            [grammar_for(h, q, p, first_shown_turn(h, self.opts)) for h, q, p in items], self.max_new_tokens,
            written)])

    @property
    def decider(self) -> Decider:
        """This engine's own head, threshold and version."""
        return Decider(self.decision_head, self.threshold, self.version)

    def check_decider(self, decider: Decider) -> None:
        """Refuse a head that does not fit this engine's model (naming both shapes)."""
        if decider.head is not None:
            decider.head.check(self.model.config.num_hidden_layers, self.model.config.hidden_size)

    def clarify(self, requests: list[ClarifyRequest], threshold: float | None = None,
                deciders: Sequence[Decider] | None = None) -> list[ClarifyResponse]:
        """Answer serving requests: decision for all, question only for those above the threshold.
        ``deciders``: each request's own head, threshold and version (models sharing these weights; one pass)."""
        if deciders is None:
            own = self.decider
            deciders = [own if threshold is None else Decider(own.head, threshold, own.version)] * len(requests)
        elif len(deciders) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(deciders)} deciders")
        items = [(r.history, r.query, r.passages) for r in requests]
        if not items:
            return []
        probs, state = self._decide(items, keep_cache=self.one_prefill, heads=[d.head for d in deciders])
        ask = [i for i, p in enumerate(probs) if p >= deciders[i].threshold]
        texts, generated = self._ask(state, ask, [items[i] for i in ask]) if ask else ([], [])
        prompt_tokens = state.prompt_tokens
        del state  # the KV cache: freed before the responses are built
        gens = dict(zip(ask, texts))
        new_tokens = dict(zip(ask, generated))
        out = []
        for i, (req, p) in enumerate(zip(requests, probs)):
            n_new = new_tokens.get(i, 0)
            usage = Usage(prompt_tokens=prompt_tokens[i], completion_tokens=n_new, total_tokens=prompt_tokens[i] + n_new)
            common = {"confidence": p, "threshold": deciders[i].threshold, "model_version": deciders[i].version,
                      "usage": usage}
            if i not in gens:
                out.append(ClarifyResponse(needs_clarification=False, **common))
                continue
            target, err = try_parse_target(gens[i], history_len=len(req.history), passage_ids=[x.id for x in req.passages])
            if target is None:
                log.warning("malformed generation (%s); answering without clarification", err)
                out.append(ClarifyResponse(needs_clarification=False, valid_output=False, **common))
                continue
            out.append(ClarifyResponse(
                needs_clarification=True, question=target.question,
                grounding=Grounding(turns=list(target.grounding_turns), passages=list(target.grounding_passages)),
                **common,
            ))
        return out

    def predict(self, examples, batch_size: int = 8, threshold: float | None = None, progress=None,
                order: str = "length"):
        """Evaluation predictions (``core.metrics.Prediction``) for Examples, in their order, computed in batches of
        ``batch_size`` (:meth:`batches`)."""
        from clarifier.core.metrics import Prediction

        preds: list = [None] * len(examples)
        done = 0
        for rows in self.batches(examples, batch_size, order):
            reqs = [ClarifyRequest(history=examples[i].history, query=examples[i].query, passages=examples[i].passages)
                    for i in rows]
            for i, r in zip(rows, self.clarify(reqs, threshold=threshold)):
                preds[i] = Prediction(
                    needs_clarification=r.needs_clarification, confidence=r.confidence, question=r.question,
                    grounding_turns=tuple(r.grounding.turns), grounding_passages=tuple(r.grounding.passages),
                    valid=r.valid_output,
                )
            done += len(rows)
            if progress:
                progress(done, len(examples))
        return preds
