"""The one prompt renderer: training, evaluation and serving format a turn identically.

History turns are shown with their indexes (``[0] user: ...``) so the model can name them in its
grounding; when the prompt is too long (or has more history turns than ``max_history_turns``) the
*oldest* turns are dropped and the remaining ones keep their original indexes. Rendered through the
tokenizer's chat template when it has one. Pure apart from calling the tokenizer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clarifier.core.schema import Passage, Turn

SYSTEM_PROMPT = (
    "Decide if the latest user message is clear given the conversation, or needs a clarifying question. "
    "Reply 'decision: answer' if clear; else 'decision: clarify', then 'grounding: turns=<indexes> "
    "passages=<ids>', then 'question: <question>'."
)


@dataclass(frozen=True)
class PromptOptions:
    max_prompt_tokens: int = 384
    max_turn_chars: int = 600
    max_passage_chars: int = 300
    max_passages: int = 3
    # Show at most this many of the latest history turns (None: as many as max_prompt_tokens allows). Older turns
    # are dropped like the token budget drops them: the shown ones keep their indexes.
    max_history_turns: int | None = None
    # A passage longer than max_passage_chars shows the run of its sentences that shares the most words with the
    # latest message and the shown history (see focus_passage) instead of its beginning.
    passage_focus: bool = False


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


_WORD = re.compile(r"[^\W_]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_STOPWORDS = frozenset(
    "the and for are was were but not you your with that this what which who whom whose when where why how did does "
    "has have had its his her him she they them their there then than from into onto about over under been being "
    "will would can could should may might must shall any all some one ones our out off too very just also more most "
    "other such only own same each few both here now yes".split())


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if len(w) >= 3 and w not in _STOPWORDS}


def focus_passage(text: str, limit: int, context: list[str]) -> str:
    """``text`` cut to at most ``limit`` characters around what the conversation is about.

    ``context`` lists texts from the most to the least important (the latest message first, then the shown history
    from the newest turn back). A passage that fits is returned whole (whitespace normalised); otherwise the
    contiguous run of its sentences that fits the limit and shares the most context words (a word counts once, with
    the weight of the most important text it appears in) is shown, with "…" where text was left out. A passage that
    shares no word with the context is cut like any other (its beginning)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    weights: dict[str, float] = {}
    for rank, ctx in enumerate(context):
        for w in _words(ctx):
            weights.setdefault(w, 1.0 / (1 + rank))
    sentences = _SENTENCE_END.split(text)
    scores = [sum(weights.get(w, 0.0) for w in _words(s)) for s in sentences]
    best, best_score = None, 0.0
    for i in range(len(sentences)):
        j, size, score = i, 0, 0.0
        while j < len(sentences) and size + len(sentences[j]) + (j > i) <= limit - 2:
            size += len(sentences[j]) + (j > i)
            score += scores[j]
            j += 1
        if j == i:  # one sentence longer than the limit: its beginning
            j, score = i + 1, scores[i]
        if score > best_score:
            best, best_score = (i, j), score
    if best is None:
        return _clip(text, limit)
    i, j = best
    head, body = ("…" if i > 0 else ""), " ".join(sentences[i:j])
    if j < len(sentences):  # text follows: always marked
        return head + _clip(body, limit - len(head) - 1).rstrip("…") + "…"
    return head + _clip(body, limit - len(head))


def render_user_message(
    history: list[Turn], query: str, passages: list[Passage], opts: PromptOptions, first_turn: int = 0
) -> str:
    """The user-side content: indexed history from ``first_turn`` on, passages, the latest message."""
    lines: list[str] = []
    shown = history[first_turn:]
    if shown:
        lines.append("Conversation so far:")
        if first_turn:
            lines.append(f"(turns 0-{first_turn - 1} omitted)")
        for i, t in enumerate(shown, start=first_turn):
            lines.append(f"[{i}] {t.role}: {_clip(t.text, opts.max_turn_chars)}")
    else:
        lines.append("Conversation so far: (none)")
    if passages:
        lines.append("Retrieved passages:")
        context = [query] + [t.text for t in reversed(shown)] if opts.passage_focus else []
        for p in passages[: opts.max_passages]:
            text = (focus_passage(p.text, opts.max_passage_chars, context) if opts.passage_focus
                    else _clip(p.text, opts.max_passage_chars))
            lines.append(f"[{p.id}] {text}")
    lines.append(f"Latest user message: {_clip(query, opts.max_turn_chars)}")
    return "\n".join(lines)


def _messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def _bos_text(tokenizer) -> str:
    """The BOS token text when the tokenizer itself would start an encoding with it, else "".

    Prompts are always encoded with ``add_special_tokens=False`` (a chat template writes its own
    BOS); the plain-text fallback must therefore write it too, or models that rely on it (Gemma:
    about twice the per-token loss without it) see a malformed start.
    """
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos_id else ""


def _apply_template(tokenizer, user: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(_messages(user), tokenize=False, add_generation_prompt=True)
    # Plain-text fallback for base models without a chat template.
    return f"{_bos_text(tokenizer)}{SYSTEM_PROMPT}\n\n{user}\n\nReply:\n"


def first_shown_turn(history: list, opts: PromptOptions) -> int:
    """Index of the first history turn ``opts.max_history_turns`` lets the prompt show (the token budget
    may drop more)."""
    if opts.max_history_turns is None:
        return 0
    return max(0, len(history) - opts.max_history_turns)


def length_order(examples, opts: PromptOptions) -> list[int]:
    """Indexes of ``examples`` (anything with ``history``, ``query``, ``passages``) by the length of their rendered
    conversation, shortest first (stable). Batches of neighbours in this order pad little: on a CPU a batch costs
    its longest prompt times its rows, so batching turns as they come spends part of every pass on padding (measured
    by ``benchmarks/engine/bench_batch_order.py``). Everything that scores a list of turns in batches uses it (the
    engine's ``score_examples`` / ``predict``, the Ray scorer pools, the decision head's features), so the same
    turns meet the same neighbours wherever they are scored."""
    return sorted(range(len(examples)), key=lambda i: len(render_user_message(
        examples[i].history, examples[i].query, examples[i].passages, opts)))


def render_prompt(tokenizer, history, query, passages=(), opts: PromptOptions | None = None) -> str:
    """Prompt text ending where the assistant's reply (the joint target) starts.

    Drops the oldest history turns until the prompt fits ``opts.max_prompt_tokens``; if even the
    query alone does not fit the prompt is returned anyway (the caller's tokenizer truncation and
    length filters decide what to do with it).
    """
    return render_prompts(tokenizer, [(history, query, passages)], opts)[0][0]


def render_prompts(tokenizer, items, opts: PromptOptions | None = None) -> list[tuple[str, list[int]]]:
    """:func:`render_prompt` of many ``(history, query, passages)`` items, with each prompt's token
    ids: the full prompts (at most ``max_history_turns`` of history) are tokenised in one call; only
    those over ``max_prompt_tokens`` drop their oldest turns one at a time."""
    return [(text, ids) for text, ids, _ in render_prompts_shown(tokenizer, items, opts)]


def render_prompts_shown(tokenizer, items, opts: PromptOptions | None = None) -> list[tuple[str, list[int], int]]:
    """:func:`render_prompts` with, per prompt, the index of the first history turn it shows (after the
    window and the token budget): a training target names only turns from there on."""
    opts = opts or PromptOptions()
    items = [(list(h), q, list(p or ())) for h, q, p in items]
    firsts = [first_shown_turn(h, opts) for h, _, _ in items]
    texts = [_apply_template(tokenizer, render_user_message(h, q, p, opts, first))
             for (h, q, p), first in zip(items, firsts)]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for (history, query, passages), text, tids, first in zip(items, texts, ids, firsts):
        while len(tids) > opts.max_prompt_tokens and first < len(history):
            first += 1
            text = _apply_template(tokenizer, render_user_message(history, query, passages, opts, first))
            tids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append((text, list(tids), first))
    return out
