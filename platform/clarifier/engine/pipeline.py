"""Inference for the ``train.variant=pipeline`` baseline: three LoRA adapters composed in sequence.

A pipeline model folder (what training writes for ``train.variant=pipeline``) holds
``pipeline.json``, ``clarifier.json`` (base model, decision threshold, prompt options) and one
ordinary model folder per part:

* ``when/`` -- trained on the decision tokens only: P(clarify) comes from it (one forward pass);
* ``how/``  -- trained on the grounding line only: after a forced ``decision: clarify`` line it
  decodes ``grounding: ...`` up to the end of that line;
* ``what/`` -- trained on the question only: after the decision line and the *generated* grounding
  line it decodes ``question: ...``.

The three adapters share one base model in memory (PEFT named adapters, switched per stage).
Generation does not continue from the decision pass's KV cache (``one_prefill`` is off): each
part's adapter changes the attention keys and values, so a cache computed under ``when`` is not
the prefill ``how`` or ``what`` would compute. Everything else -- prompts, threshold, parsing, the response -- is :class:`ClarifierEngine`'s, so
evaluation and serving treat a pipeline model like a joint one.
"""

from __future__ import annotations

import json
from pathlib import Path

from clarifier.engine.decision_head import DecisionHead
from clarifier.engine.inference import ClarifierEngine, read_meta, refuse_pickles
from clarifier.engine.models import ModelResolutionError, load_causal_lm, load_tokenizer, resolve_base_model
from clarifier.engine.precision import place, resolve_precision, torch_dtype
from clarifier.core.objective import PIPELINE_PARTS
from clarifier.core.target import CLARIFY, DECISION_PREFIX

PIPELINE_FILE = "pipeline.json"
PARTS = tuple(PIPELINE_PARTS)  # when, how, what


def is_pipeline_folder(folder: str | Path) -> bool:
    return Path(folder, PIPELINE_FILE).is_file()


class PipelineEngine(ClarifierEngine):
    """``ClarifierEngine`` whose decision, grounding and question come from three adapters."""

    one_prefill = False  # the parts' adapters change keys and values: no shared KV cache

    @classmethod
    def from_folder(cls, folder: str | Path, *, version: str = "local", cache_dir=None,
                    threshold: float | None = None, max_new_tokens: int = 48, precision: str = "auto",
                    device: str = "cpu", decision_head: bool = True, decode: str = "auto") -> "PipelineEngine":
        from peft import PeftModel

        folder = Path(folder)
        spec = json.loads((folder / PIPELINE_FILE).read_text())
        parts = spec.get("parts") or {}
        missing = [p for p in PARTS if p not in parts or not (folder / parts[p]["folder"]).is_dir()]
        if missing:
            raise ModelResolutionError(f"{folder} is a pipeline model without the {missing} part(s)")
        for p in PARTS:
            refuse_pickles(folder / parts[p]["folder"])
        meta = read_meta(folder)
        base = load_causal_lm(resolve_base_model(meta.base_model, cache_dir))
        model = PeftModel.from_pretrained(base, str(folder / parts["when"]["folder"]), adapter_name="when")
        for p in ("how", "what"):
            model.load_adapter(str(folder / parts[p]["folder"]), adapter_name=p)
        tok = load_tokenizer(str(folder / parts["when"]["folder"]))
        model = place(model.to(torch_dtype(resolve_precision(precision, device))), device)
        return cls(model, tok, threshold=meta.threshold if threshold is None else threshold, version=version,
                   prompt_opts=meta.prompt_options(), max_new_tokens=max_new_tokens,
                   decision_head=DecisionHead.load(folder) if decision_head else None,  # read with "when"'s states
                   decode="generate")  # PEFT switches adapters between the parts: no fused weights

    def _decision_pass(self, items: list[tuple], keep_cache: bool = False, layers: list[int] | None = None,
                       pooling=("last",), stop: bool = False):
        self.model.set_adapter("when")
        return super()._decision_pass(items, keep_cache, layers, pooling, stop)

    def _continue(self, texts: list[str], adapter: str, one_line: bool, items, written=None) -> list[str]:
        self.model.set_adapter(adapter)
        with self._torch.inference_mode():
            enc = self._encode(texts)
            out = self.model.generate(
                **enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id,
                logits_processor=self._target_constraint(enc, items, written),
            )
        new = self.tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [s.split("\n", 1)[0] if one_line else s for s in new]

    def _ask(self, state, rows: list[int], items: list[tuple]) -> tuple[list[str], list[int]]:
        """Texts from the ``how`` and ``what`` adapters; tokens generated counted on the decoded text
        (two generate calls, re-tokenised: the text's tokens, not the exact ids sampled)."""
        texts = self.generate_clarification(items)
        skip = len(f"{DECISION_PREFIX} {CLARIFY}\n")
        return texts, [len(self.tok(t[skip:], add_special_tokens=False)["input_ids"]) + 1 for t in texts]

    def generate_clarification(self, items: list[tuple]) -> list[str]:
        """Grounding from the ``how`` adapter, then the question from the ``what`` adapter."""
        if not items:
            return []
        head = f"{DECISION_PREFIX} {CLARIFY}\n"
        prompts = [self._prompt(h, q, p) + head for h, q, p in items]
        grounding = self._continue(prompts, "how", one_line=True, items=items)
        lines = [g + "\n" for g in grounding]
        questions = self._continue([p + g for p, g in zip(prompts, lines)], "what", one_line=False, items=items,
                                   written=lines)
        return [head + g + "\n" + q for g, q in zip(grounding, questions)]
