"""The joint objective: one token-weighted loss over the decision, grounding and question segments.

``encode_example`` turns an Example into ``input_ids`` / ``labels`` / ``loss_weights`` (prompt
tokens get label -100; each target token carries the weight of its segment). ``joint_loss`` is the
weighted mean cross-entropy, returned with a per-segment breakdown for logging.
Pure: tokenizer + torch, no Ray, no MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass

from clarifier.core.prompt import PromptOptions, render_prompts_shown
from clarifier.core.target import SEGMENTS, example_segments

IGNORE = -100
# What a target's grounding line may name (recorded in the data job's manifest; data tokenised before
# targets were cut to the prompt is prepared again): only history turns the prompt shows.
TARGET_GROUNDING = "shown-turns"
SEGMENT_IDS = {name: i + 1 for i, name in enumerate(SEGMENTS)}  # 0 = prompt / padding


# Pipeline variant (``train.variant=pipeline``): which target segments each of its three adapters
# is trained on (the others get weight 0), in the order inference runs them.
PIPELINE_PARTS = {"when": ("format", "decision"), "how": ("grounding",), "what": ("question",)}


@dataclass(frozen=True)
class SegmentWeights:
    decision: float = 2.0
    grounding: float = 1.0
    question: float = 1.0
    format: float = 0.5  # the fixed "decision:" prefix: learnt at once, so it weighs little

    def of(self, segment: str) -> float:
        return float(getattr(self, segment))


def encode_example(example, tokenizer, weights: SegmentWeights, opts: PromptOptions, max_length: int) -> dict:
    """Token ids, labels, per-token loss weights and segment ids for one Example.

    The end-of-turn token after the target belongs to the last segment, so the model learns to stop;
    a ``decision_only`` positive (``target.example_segments``) ends at ``decision: clarify\n`` with no
    end-of-turn token, so it teaches the decision and nothing about where a question ends. The grounding
    names only history turns the prompt shows (``max_history_turns`` and the token budget drop the oldest):
    the model cannot be taught to cite a turn it was not given.
    Returns ``truncated=True`` when the sequence had to be cut to ``max_length`` (the target is
    never cut silently: the data job filters such rows with that reason).
    """
    return encode_examples([example], tokenizer, weights, opts, max_length)[0]


def encode_examples(examples, tokenizer, weights: SegmentWeights, opts: PromptOptions, max_length: int) -> list[dict]:
    """:func:`encode_example` of many Examples: prompts and target segments are tokenised in one
    call each (the per-call overhead of a tokenizer is most of the cost for short texts)."""
    prompts = render_prompts_shown(tokenizer, [(e.history, e.query, e.passages) for e in examples], opts)
    pieces = [example_segments(e, first) for e, (_, _, first) in zip(examples, prompts)]
    flat = [text for ps in pieces for _, text in ps]
    flat_ids = iter(tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else [])
    out = []
    for (_, prompt_ids, _), segs, ex in zip(prompts, pieces, examples):
        ids = list(prompt_ids)
        labels = [IGNORE] * len(ids)
        w = [0.0] * len(ids)
        seg = [0] * len(ids)
        for k, (name, _) in enumerate(segs):
            piece_ids = list(next(flat_ids))
            if k == len(segs) - 1 and tokenizer.eos_token_id is not None and not getattr(ex, "decision_only", False):
                piece_ids = piece_ids + [tokenizer.eos_token_id]
            ids += piece_ids
            labels += piece_ids
            w += [weights.of(name)] * len(piece_ids)
            seg += [SEGMENT_IDS[name]] * len(piece_ids)
        out.append({
            "input_ids": ids[:max_length],
            "labels": labels[:max_length],
            "loss_weights": w[:max_length],
            "segment_ids": seg[:max_length],
            "prompt_len": len(prompt_ids),
            "truncated": len(ids) > max_length,
        })
    return out


def collate(rows: list[dict], pad_id: int, left: bool = False) -> dict:
    """Pad a list of encoded rows into tensors (right-padded; ``left=True``: left-padded).

    ``position_ids`` count every row's real tokens from 0 either way, as generation does.
    ``target_positions``: with left padding every row ends in the last column, so all targets lie
    in the last ``target_positions`` columns (one more than the longest target: the logits at the
    last prompt position predict the first target token) and only those need logits; right-padded,
    it is the whole length."""
    import torch

    n = max(len(r["input_ids"]) for r in rows)

    def padded(seq, fill):
        fills = [fill] * (n - len(seq))
        return fills + list(seq) if left else list(seq) + fills

    def pad(key, fill, dtype):
        return torch.tensor([padded(r[key], fill) for r in rows], dtype=dtype)

    attn = torch.tensor([padded([1] * len(r["input_ids"]), 0) for r in rows])
    keep = n
    if left:
        first = [next((i for i, x in enumerate(r["labels"]) if x != IGNORE), len(r["labels"])) for r in rows]
        keep = min(n, max(len(r["labels"]) - f + 1 for r, f in zip(rows, first)))
    return {
        "input_ids": pad("input_ids", pad_id, torch.long),
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp_min(0),
        "labels": pad("labels", IGNORE, torch.long),
        "loss_weights": pad("loss_weights", 0.0, torch.float32),
        "segment_ids": pad("segment_ids", 0, torch.long),
        "target_positions": torch.tensor(keep),
    }


@dataclass(frozen=True)
class DecisionLoss:
    """How the decision tokens are weighed (the other segments always use plain cross-entropy).

    ``ce``: unchanged. ``weighted``: decision tokens of clarify examples get ``clarify_weight``
    times their segment weight (answer examples keep 1x) -- class-weighted CE, normalised by the
    sum of the weights like ``torch.nn.functional.cross_entropy(weight=...)``. ``focal``: the same
    class weights and each decision token's loss times ``(1 - p_t) ** gamma`` (Lin et al. 2017).
    """

    kind: str = "ce"  # ce | weighted | focal
    clarify_weight: float = 1.0
    gamma: float = 0.0

    def __post_init__(self):
        if self.kind not in ("ce", "weighted", "focal"):
            raise ValueError(f"decision loss kind must be ce, weighted or focal (got {self.kind!r})")
        if not self.clarify_weight > 0 or self.gamma < 0:
            raise ValueError(f"decision loss needs clarify_weight > 0 and gamma >= 0 (got {self})")


def joint_loss(logits, labels, loss_weights, segment_ids, clarify=None, decision: DecisionLoss | None = None):
    """Weighted token cross-entropy (next-token shift inside). Returns ``(loss, parts)``.

    ``clarify`` (bool per row, or per token for packed rows) is needed by the ``weighted`` /
    ``focal`` decision losses.
    ``parts`` maps each segment to its unweighted mean token loss in this batch (for logging).
    """
    import torch
    import torch.nn.functional as F

    decision = decision or DecisionLoss()
    logits = logits[:, :-1, :].float()
    labels = labels[:, 1:]
    weights = loss_weights[:, 1:]
    segs = segment_ids[:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE, reduction="none")
    tok = tok.view(labels.shape)
    mask = (labels != IGNORE).float()
    wm = weights * mask
    scaled = tok
    if decision.kind != "ce":
        if clarify is None:
            raise ValueError(f"decision loss {decision.kind!r} needs the per-row clarify labels")
        dec = segs == SEGMENT_IDS["decision"]
        if clarify.dim() == 2:  # per token (packed rows hold examples of both classes)
            tok_w = torch.where(clarify[:, 1:].bool(), float(decision.clarify_weight), 1.0).to(wm.dtype)
        else:
            tok_w = torch.where(clarify.bool(), float(decision.clarify_weight), 1.0).to(wm.dtype)[:, None]
        wm = torch.where(dec, wm * tok_w, wm)
        if decision.kind == "focal" and decision.gamma > 0:
            p_t = torch.exp(-tok)
            scaled = torch.where(dec, tok * (1.0 - p_t).clamp_min(0.0) ** decision.gamma, tok)
    loss = (scaled * wm).sum() / wm.sum().clamp_min(1e-8)
    parts = {}
    with torch.no_grad():
        for name, sid in SEGMENT_IDS.items():
            m = (segs == sid).float() * mask
            if m.sum() > 0:
                parts[name] = float((tok * m).sum() / m.sum())
    return loss, parts
