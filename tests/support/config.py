"""Config overrides shared by the training tests."""

from __future__ import annotations

from pathlib import Path


def tiny_lora(base: Path) -> list[str]:
    """The tiny base model with a small LoRA (rank 4 on q_proj, v_proj): training steps take ~0.1 s. A new
    adapter: the quickstart's ``model.init_from`` (the built-in clarifier, on SmolLM2) does not fit the tiny base."""
    return [f"model.base_model={base}", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]", "model.init_from=null"]
