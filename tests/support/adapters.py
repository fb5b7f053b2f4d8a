"""Untrained LoRA adapters on the tiny model: a servable, evaluable model folder in a second."""

from __future__ import annotations

from pathlib import Path


def untrained_adapter(base: Path, out: Path, threshold: float, seed: int = 0, r: int = 4) -> Path:
    """A fresh LoRA adapter (q_proj, v_proj) on ``base`` with its tokenizer and ``clarifier.json``.

    The threshold picks the path requests take: 1.0 the fast path (decision pass only), 0.0 always
    generation (noise from an untrained model, kept to a parseable target by the decoding constraint).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clarifier.engine.inference import ModelMeta, write_meta

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=r, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    write_meta(out, ModelMeta(base_model=str(base), threshold=threshold))
    return out


def with_head(src: Path, out: Path, threshold: float, seed: int, layers=(1, 2), pooling=("last",)) -> Path:
    """A copy of the model folder ``src`` with a random decision head and its own threshold: what ``clarifier adapt``
    writes (same adapter, new head and threshold), so it shares ``src``'s weights key."""
    import shutil

    import torch

    from clarifier.engine.decision_head import DecisionHead
    from clarifier.engine.inference import read_meta, write_meta
    from transformers import AutoConfig

    shutil.copytree(src, out)
    meta = read_meta(out)
    hidden = AutoConfig.from_pretrained(meta.base_model).hidden_size
    g = torch.Generator().manual_seed(seed)
    n = len(pooling) * len(layers) * hidden
    DecisionHead.from_standardised(list(layers), torch.randn(n, generator=g), 0.1 * seed, torch.zeros(n),
                                   torch.ones(n), pooling=list(pooling)).save(out)
    meta.threshold = threshold
    write_meta(out, meta)
    (out / "adapt.json").write_text("{}")
    return out
