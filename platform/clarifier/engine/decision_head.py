"""The decision head: P(clarify) from the model's hidden states at the decision position.

By default the engine reads the decision from two logits of the language-model head ("clarify" vs
"answer" after ``decision:``): one direction of the last layer. A *decision head* is a logistic
regression on the hidden states of several layers at that same position (the last prompt token of
``prompt + "decision:"``; pooling ``last``) and, with pooling ``mean``, on the same layers' states
averaged over every prompt token, fitted after training on the model as it is served
(:mod:`clarifier.train.decision_head`). It costs nothing at inference (the prefill computes those
states anyway; the KV cache for the question is the same) and, fitted on cached features, it can see
every training example many times where LoRA training sees each at most once on a CPU budget.

A model folder with a head holds ``decision_head.safetensors``: ``weight`` (float32, the layers'
states concatenated -- every layer's ``last`` states, then every layer's ``mean`` states --,
standardisation folded in) and ``bias``, with the hidden-state indexes in the file's metadata
(``layers``: 0 = the embeddings, ``num_hidden_layers`` = the last layer after the final norm, as
``output_hidden_states`` numbers them) and ``pooling`` (absent in heads saved before it: ``["last"]``).
A head fitted on *clipped* standardised features (``train.decision_head.clip``: every feature limited to
``[-clip, clip]`` standard deviations, so a few extreme activations of a long or unusual prompt cannot
swing the decision) cannot fold the standardisation in: its file also holds ``mean`` and ``scale`` and
its metadata ``clip``, and ``weight`` applies to the clipped standardised features.
``clarifier.json`` records how it was fitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

HEAD_FILE = "decision_head.safetensors"
POOLINGS = ("last", "mean")


def resolve_layers(fractions: Sequence[float], num_layers: int) -> list[int]:
    """Hidden-state indexes for depth fractions (0 < f <= 1; 1.0 = the last layer), sorted, unique."""
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad or not fractions:
        raise ValueError(f"decision head layers are depth fractions in (0, 1]; got {list(fractions)}")
    return sorted({max(1, min(num_layers, round(f * num_layers))) for f in fractions})


def check_pooling(pooling: Sequence[str]) -> list[str]:
    """``pooling`` in feature order (``last`` before ``mean``), refusing unknown or repeated kinds."""
    if not pooling or any(p not in POOLINGS for p in pooling) or len(set(pooling)) != len(pooling):
        raise ValueError(f"decision head pooling is one or both of {list(POOLINGS)}; got {list(pooling)}")
    return [p for p in POOLINGS if p in pooling]


@dataclass
class DecisionHead:
    layers: list[int]
    weight: Any  # torch.FloatTensor [len(pooling) * len(layers) * hidden]
    bias: float
    pooling: list[str] = field(default_factory=lambda: ["last"])
    # clipped heads only: weight applies to clamp((x - mean) / scale, -clip, clip)
    clip: float | None = None
    mean: Any = None
    scale: Any = None

    def probability(self, feats):
        """P(clarify) for ``[batch, dim]`` features (float32), on their device (the head follows them there once:
        a model served on a GPU hands over GPU states)."""
        import torch

        if self.weight.device != feats.device:
            self.weight = self.weight.to(feats.device)
            if self.clip is not None:
                self.mean, self.scale = self.mean.to(feats.device), self.scale.to(feats.device)
        if self.clip is not None:
            feats = ((feats - self.mean) / self.scale).clamp(-self.clip, self.clip)
        return torch.sigmoid(feats @ self.weight + self.bias)

    @classmethod
    def from_standardised(cls, layers: Sequence[int], coef, intercept: float, mean, scale,
                          pooling: Sequence[str] = ("last",), clip: float | None = None) -> "DecisionHead":
        """A head fitted on standardised features ``(x - mean) / scale`` (clipped to ``[-clip, clip]`` when
        ``clip`` is set); without clipping the standardisation is folded into one affine map."""
        import torch

        coef, mean, scale = (torch.as_tensor(v, dtype=torch.float64) for v in (coef, mean, scale))
        if clip is not None:
            if not clip > 0:
                raise ValueError(f"decision head clip must be positive; got {clip}")
            return cls(list(layers), coef.float(), float(intercept), check_pooling(pooling), float(clip),
                       mean.float(), scale.float())
        w = coef / scale
        return cls(list(layers), w.float(), float(intercept - (w * mean).sum()), check_pooling(pooling))

    def save(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(folder) / HEAD_FILE
        tensors = {"weight": self.weight.contiguous(), "bias": self.weight.new_tensor([self.bias])}
        meta = {"layers": json.dumps(self.layers), "pooling": json.dumps(self.pooling)}
        if self.clip is not None:
            tensors.update(mean=self.mean.contiguous(), scale=self.scale.contiguous())
            meta["clip"] = json.dumps(self.clip)
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, folder: str | Path) -> "DecisionHead | None":
        """The head of a model folder; None when it has none."""
        from safetensors import safe_open

        path = Path(folder) / HEAD_FILE
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            layers, pooling = json.loads(meta["layers"]), json.loads(meta.get("pooling", '["last"]'))
            weight, bias = f.get_tensor("weight").float(), float(f.get_tensor("bias")[0])
            clip = json.loads(meta["clip"]) if "clip" in meta else None
            names = set(f.keys())
            if clip is not None and not {"mean", "scale"} <= names:
                raise ValueError(f"{path}: a clipped head (clip {clip}) needs its mean and scale tensors; it has "
                                 f"{sorted(names)}")
            mean, scale = (f.get_tensor("mean").float(), f.get_tensor("scale").float()) if clip is not None else (None, None)
        try:
            pooling = check_pooling(pooling)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        return cls([int(i) for i in layers], weight, bias, pooling, clip, mean, scale)

    def check(self, num_layers: int, hidden_size: int) -> None:
        """Refuse a head that does not fit the model it is loaded with (naming both shapes)."""
        if max(self.layers) > num_layers or self.weight.numel() != len(self.pooling) * len(self.layers) * hidden_size:
            raise ValueError(f"{HEAD_FILE} reads layers {self.layers} pooled {'+'.join(self.pooling)} "
                             f"({self.weight.numel()} features) but the model has {num_layers} layers of {hidden_size}")
        if self.clip is not None and not self.mean.numel() == self.scale.numel() == self.weight.numel():
            raise ValueError(f"{HEAD_FILE}: its mean ({self.mean.numel()}) and scale ({self.scale.numel()}) do not "
                             f"match its {self.weight.numel()} weights")
