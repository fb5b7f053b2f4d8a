"""The one inference engine, used by evaluation, serving and the quickstart alike.

Decision fast path: every request costs one forward pass that reads P(clarify) from the logits of
the first token after the fixed target prefix ``decision:``; only requests at or above the
threshold are decoded further (grounding, then question); the grounding line is constrained to the
request's turns and passages (``grounding_constraint``). Malformed generations fall back to
"no clarification" with ``valid_output=False`` -- never an exception.

A *model folder* (what training writes and the registry stores) holds the trained weights -- a
PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, applied to the base
model named in ``clarifier.json``), or, after full fine-tuning, the whole model (``config.json`` +
``model*.safetensors``) -- the tokenizer, and ``clarifier.json`` with the base-model spec, the
decision threshold and the prompt options.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from .grounding_constraint import GroundingConstraint
from .models import ModelResolutionError, load_causal_lm, load_tokenizer, resolve_base_model
from .prompt import PromptOptions, render_prompt
from .schema import ClarifyRequest, ClarifyResponse, Grounding
from .target import ANSWER, CLARIFY, DECISION_PREFIX, try_parse_target

log = logging.getLogger(__name__)

META_FILE = "clarifier.json"
FORMAT_VERSION = 1


@dataclass
class ModelMeta:
    base_model: str
    threshold: float = 0.5
    prompt: dict | None = None
    finetune: str = "lora"  # how the weights were trained (model.finetune): lora | full
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


def load_weights(folder: Path, meta: ModelMeta, cache_dir=None):
    """The model of a (non-pipeline) model folder, by what its files hold."""
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        base = load_causal_lm(resolve_base_model(meta.base_model, cache_dir))
        return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    if (folder / "config.json").is_file() and any(folder.glob("model*.safetensors")):
        return load_causal_lm(str(folder))
    raise ModelResolutionError(
        f"{folder} holds no weights: expected a LoRA adapter (adapter_config.json + adapter_model.safetensors) or "
        f"fully fine-tuned weights (config.json + model.safetensors); {META_FILE} says finetune={meta.finetune!r}")


class ClarifierEngine:
    def __init__(self, model, tokenizer, *, threshold: float = 0.5, version: str = "local",
                 prompt_opts: PromptOptions | None = None, max_new_tokens: int = 48,
                 constrain_grounding: bool = True):
        import torch

        self.model = model.eval()
        self.tok = tokenizer
        self.tok.padding_side = "left"
        self.threshold = threshold
        self.version = version
        self.opts = prompt_opts or PromptOptions()
        self.max_new_tokens = max_new_tokens
        self.constrain_grounding = constrain_grounding
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

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path, *, version: str = "local", cache_dir=None,
                    threshold: float | None = None, max_new_tokens: int = 48) -> "ClarifierEngine":
        """Load a Clarifier model folder: base model + LoRA adapter (merged for speed), or the fully
        fine-tuned weights."""
        folder = Path(folder)
        if cls is ClarifierEngine and (folder / "pipeline.json").is_file():  # train.variant=pipeline
            from .pipeline_engine import PipelineEngine

            return PipelineEngine.from_folder(folder, version=version, cache_dir=cache_dir, threshold=threshold,
                                              max_new_tokens=max_new_tokens)
        refuse_pickles(folder)
        meta = read_meta(folder)
        model = load_weights(folder, meta, cache_dir)
        tok = load_tokenizer(str(folder))
        return cls(model, tok, threshold=meta.threshold if threshold is None else threshold, version=version,
                   prompt_opts=meta.prompt_options(), max_new_tokens=max_new_tokens)

    @classmethod
    def from_base(cls, base_model: str, *, cache_dir=None, threshold: float = 0.5,
                  prompt_opts: PromptOptions | None = None, max_new_tokens: int = 48) -> "ClarifierEngine":
        """The untrained base model, prompted with the same prompt (the zero-shot baseline)."""
        path = resolve_base_model(base_model, cache_dir)
        return cls(load_causal_lm(path), load_tokenizer(path), threshold=threshold,
                   version=f"base:{base_model}", prompt_opts=prompt_opts, max_new_tokens=max_new_tokens)

    # ---- core ---------------------------------------------------------------------------------

    def _prompt(self, history, query, passages) -> str:
        return render_prompt(self.tok, history, query, passages, self.opts)

    def _encode(self, texts: list[str]):
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return {k: v.to(self.device) for k, v in enc.items()}

    def score(self, items: list[tuple]) -> list[float]:
        """P(clarify) for ``(history, query, passages)`` items: one forward pass per batch."""
        if not items:
            return []
        texts = [self._prompt(h, q, p) + DECISION_PREFIX for h, q, p in items]
        with self._torch.inference_mode():
            enc = self._encode(texts)
            # Only the last position's logits: with a large vocabulary (Gemma: 262k) the full
            # [batch, length, vocab] tensor would cost most of the time and gigabytes of memory.
            logits = self.model(**enc, logits_to_keep=1).logits[:, -1, :]
            pair = logits[:, [self.clarify_id, self.answer_id]].float()
            probs = self._torch.softmax(pair, dim=-1)[:, 0]
        return [float(x) for x in probs]

    def score_examples(self, examples, batch_size: int = 8, progress=None) -> list[float]:
        """P(clarify) for Examples in batches of ``batch_size`` (decision only, no decoding)."""
        scores: list[float] = []
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            scores += self.score([(e.history, e.query, e.passages) for e in chunk])
            if progress:
                progress(len(scores), len(examples))
        return scores

    def generate_clarification(self, items: list[tuple]) -> list[str]:
        """Decode grounding and question after a forced ``decision: clarify`` line."""
        if not items:
            return []
        head = f"{DECISION_PREFIX} {CLARIFY}\n"
        texts = [self._prompt(h, q, p) + head for h, q, p in items]
        with self._torch.inference_mode():
            enc = self._encode(texts)
            out = self.model.generate(
                **enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id,
                logits_processor=self._grounding_constraint(enc, items),
            )
        new = out[:, enc["input_ids"].shape[1]:]
        return [head + end_at_question_line(s) for s in self.tok.batch_decode(new, skip_special_tokens=True)]

    def _grounding_constraint(self, enc, items):
        """The grounding line may only name turns and passages the request has (``grounding_constraint``)."""
        from transformers import LogitsProcessorList

        if not self.constrain_grounding:
            return None
        return LogitsProcessorList([GroundingConstraint(
            self.tok, enc["input_ids"].shape[1], [(len(h), [x.id for x in (p or [])]) for h, _, p in items])])

    def clarify(self, requests: list[ClarifyRequest], threshold: float | None = None) -> list[ClarifyResponse]:
        """Answer serving requests: decision for all, question only for those above the threshold."""
        thr = self.threshold if threshold is None else threshold
        items = [(r.history, r.query, r.passages) for r in requests]
        probs = self.score(items)
        ask = [i for i, p in enumerate(probs) if p >= thr]
        gens = dict(zip(ask, self.generate_clarification([items[i] for i in ask])))
        out = []
        for i, (req, p) in enumerate(zip(requests, probs)):
            if i not in gens:
                out.append(ClarifyResponse(needs_clarification=False, confidence=p, model_version=self.version))
                continue
            target, err = try_parse_target(gens[i], history_len=len(req.history), passage_ids=[x.id for x in req.passages])
            if target is None:
                log.warning("malformed generation (%s); answering without clarification", err)
                out.append(ClarifyResponse(needs_clarification=False, confidence=p, model_version=self.version, valid_output=False))
                continue
            out.append(ClarifyResponse(
                needs_clarification=True, confidence=p, question=target.question,
                grounding=Grounding(turns=list(target.grounding_turns), passages=list(target.grounding_passages)),
                model_version=self.version,
            ))
        return out

    def predict(self, examples, batch_size: int = 8, threshold: float | None = None, progress=None):
        """Evaluation predictions (``evaluation.metrics.Prediction``) for Examples, in order."""
        from .evaluation.metrics import Prediction

        preds = []
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            reqs = [ClarifyRequest(history=e.history, query=e.query, passages=e.passages) for e in chunk]
            for r in self.clarify(reqs, threshold=threshold):
                preds.append(Prediction(
                    needs_clarification=r.needs_clarification, confidence=r.confidence, question=r.question,
                    grounding_turns=tuple(r.grounding.turns), grounding_passages=tuple(r.grounding.passages),
                    valid=r.valid_output,
                ))
            if progress:
                progress(len(preds), len(examples))
        return preds
