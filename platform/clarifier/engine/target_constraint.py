"""Constrained decoding of the whole joint target after ``decision: clarify``: a grounding line that
names only the request's turns and passages, one plain-text question line, then the end.

Why: the decision is read from one token's probability, and everything after it is generated. A
briefly trained model fell into counting loops on the grounding line (``turns=0,1,2,...,14,``; 21
of 50 synthetic clarifications lost before the line was constrained), and on unseen multi-turn RAG
conversations 6.4% of the outputs still did not parse when only that line was constrained (the
question line missing, or text after it), while served questions carried grounding syntax and role
names (``are you asking about the user?||none``). The constraint only removes tokens; among the
tokens it keeps, the model's own ranking decides, so what it says is still its choice.

The grammar of what is generated after ``decision: clarify\\n`` (``target.render_segments``)::

    grounding: turns=(none | I(,I)*) passages=(none | P(,P)*)\\n
    question: Q<eos>

* I: a distinct turn index < len(history) that the prompt shows (not older than its history window); P: a
  distinct passage id of the request.
* Q: one line of plain text, written right after one space (``question: Which one?``) with at least
  ``MIN_QUESTION_CHARS`` non-space characters; no line break or control character, none of the
  target syntax ``QUESTION_SYNTAX`` (``|``, ``turns=``, ``passages=``, ``decision:``, ``grounding:``,
  ``question:``, any case -- the parser rejects those questions too), and no *role phrase* (below).
* <eos>: the end-of-turn token right after the question, with no newline between: training puts
  the tokenizer's EOS there (``objective.encode_examples``), so the constrained end is what training
  taught. The EOS is allowed only once the question is complete, and after it only EOS.

Role phrases: a question about the conversation's roles instead of its content ("are you asking
about the user?", "the system", "the latest user message") is blocked. ``ROLE_PHRASES`` are
"the" / "the latest" / "the last" / "the previous" / "the current" followed by a ``ROLE_WORDS``
word ("user", "system", "assistant" and their plurals: ``" users"`` is what a model denied
``" user"`` writes next), as whole words, in any case and spacing. A phrase is blocked only when it
does not occur in the request's own text (history, query, passages): a conversation about "the
system" may ask about it. Blocking is token-level and cheap: at each step only the tokens that
would complete a phrase begun at the end of the question (``" user"`` after ``"... the"``) or that
hold a whole phrase are checked. A role word that ends a token counts as a whole word, so the
model is stopped at the token that names the role rather than left to garble it afterwards; the
price is that a word which the tokenizer splits right after a role word cannot follow "the"
(SmolLM2: "the systemd" is ``" system"`` + ``"d"``; "the username", "the systematic" are one token
each and stay possible).

Budget: ``max_new_tokens`` must not cut the target. Each step keeps only tokens after which the rest
can still be written in the tokens left. The cost of a state is the fewest tokens for its shortest
completion (the open list finished with one item, the rest ``none``, the line end, ``question:``)
plus a question of ``MIN_QUESTION_CHARS`` one-character tokens; it drops by one along its own
completion, so a target that fits the budget keeps fitting. On the last step an unfinished question is closed: only
EOS (if complete) or a token that ends it with ``?``. The cost is an upper bound, so forcing can
begin a few tokens earlier than strictly needed; a target the model ends with EOS before that is
never changed. (A tokenizer without EOS: the question runs to the budget and is closed so.)

``target_state`` / ``valid_target_prefix`` / ``completion_cost`` are the pure grammar;
``TargetConstraint`` applies it as a transformers ``LogitsProcessor`` to batched, left-padded
generation (the prompt ends at the same column for every row), including generation that
continues from the decision pass's KV cache.
"""

from __future__ import annotations

import bisect
import re
import threading
import unicodedata
import weakref
from dataclasses import dataclass
from functools import cached_property, lru_cache

from clarifier.core.target import (
    GROUNDING_HEAD,
    MIN_QUESTION_CHARS,
    PASSAGES_SEP,
    QUESTION_HEAD,
    nonspace_chars,
    syntax_in_question,
)

ROLE_WORDS = ("user", "users", "system", "systems", "assistant", "assistants")
ROLE_LEADS = ("the", "the latest", "the last", "the previous", "the current")
ROLE_PHRASES = tuple(f"{lead} {word}" for lead in ROLE_LEADS for word in ROLE_WORDS)
_LETTER = r"[^\W\d_]"
_SYNTAX_TAIL = 16  # longer than every QUESTION_SYNTAX piece: enough of the question to find a new one


def _norm(text: str) -> str:
    """Lowercased, each whitespace run one space: the form role phrases are matched in."""
    return re.sub(r"\s+", " ", text.lower())


def _role_regex(phrases) -> re.Pattern | None:
    """Any of ``phrases`` as whole words (no letter before it, nor after it, the text's end included)."""
    if not phrases:
        return None
    alts = "|".join(re.escape(p) for p in sorted(phrases, key=len, reverse=True))
    return re.compile(rf"(?<!{_LETTER})(?:{alts})(?!{_LETTER})")


def _plain_char(c: str) -> bool:
    """A character a question may hold: not a line break (``str.splitlines``) nor a control character."""
    return unicodedata.category(c) != "Cc" and len(f"a{c}b".splitlines()) == 1


@dataclass(frozen=True)
class TargetGrammar:
    """One request's grammar: its turn indexes, passage ids and the role phrases blocked for it."""

    turns: tuple[str, ...]
    passages: tuple[str, ...]
    blocked_roles: tuple[str, ...] = ROLE_PHRASES

    @classmethod
    def for_request(cls, history_len: int, passage_ids, context: str = "", first_turn: int = 0) -> "TargetGrammar":
        """``context``: the request's own text; role phrases that occur in it are not blocked. ``first_turn``: the
        first history turn the prompt shows (``model.max_history_turns``): older ones cannot be named."""
        ctx = _norm(context)
        blocked = tuple(p for p in ROLE_PHRASES if not _role_regex([p]).search(ctx))
        return cls(tuple(str(i) for i in range(max(first_turn, 0), max(history_len, 0))),
                   tuple(str(p) for p in passage_ids), blocked)

    @cached_property
    def role_re(self) -> re.Pattern | None:
        return _role_regex(self.blocked_roles)

    def role_in(self, question: str) -> bool:
        return self.role_re is not None and self.role_re.search(_norm(question)) is not None


def grammar_for(history, query: str, passages, first_turn: int = 0) -> TargetGrammar:
    """The grammar of an engine item ``(history, query, passages)`` (``Turn`` / ``Passage`` objects) whose
    prompt shows the history from ``first_turn`` on."""
    passages = list(passages or [])
    context = "\n".join([t.text for t in history] + [query] + [p.text for p in passages])
    return TargetGrammar.for_request(len(history), [p.id for p in passages], context, first_turn)


@dataclass(frozen=True)
class State:
    """Where a valid prefix stands. ``phase``: head | turns | sep | passages | qhead | question;
    ``part``: the text of that phase so far (the partial literal, list, or the question after
    ``question:``, its leading space included)."""

    phase: str
    part: str


def _list_state(part: str, allowed) -> tuple[str, list[str]] | None:
    """``(last, starts)`` of a partial list: its unfinished last item and the items that may still
    follow (``none`` only as the whole list); None when ``part`` cannot become a valid list."""
    *done, last = part.split(",")
    if len(set(done)) != len(done) or any(x not in allowed for x in done):
        return None
    starts = [a for a in allowed if a not in done] + ([] if done else ["none"])
    return (last, starts) if any(a.startswith(last) for a in starts) else None


def _list_complete(part: str, allowed) -> bool:
    if part == "none":
        return True
    items = part.split(",")
    return bool(part) and len(set(items)) == len(items) and all(x in allowed for x in items)


def question_ok(q: str, g: TargetGrammar) -> bool:
    """Is ``q`` (the text after ``question:``) the start of an allowed question for ``g``?"""
    if not q:
        return True
    if q[0] != " " or (len(q) > 1 and q[1].isspace()):
        return False
    return all(_plain_char(c) for c in q) and syntax_in_question(q) is None and not g.role_in(q)


def target_state(text: str, g: TargetGrammar) -> State | None:
    """The state of ``text`` (what follows ``decision: clarify\\n``), or None if no valid target starts so."""
    if len(text) < len(GROUNDING_HEAD):
        return State("head", text) if GROUNDING_HEAD.startswith(text) else None
    if not text.startswith(GROUNDING_HEAD):
        return None
    rest = text[len(GROUNDING_HEAD):]
    nl = rest.find("\n")
    line = rest if nl < 0 else rest[:nl]
    i = line.find(PASSAGES_SEP)
    if i < 0:
        if nl >= 0:
            return None
        if _list_state(line, g.turns) is not None:
            return State("turns", line)
        # a complete turn list followed by the start of " passages="
        for j in range(len(line)):
            if PASSAGES_SEP.startswith(line[j:]) and _list_complete(line[:j], g.turns):
                return State("sep", line[j:])
        return None
    if not _list_complete(line[:i], g.turns):
        return None
    p = line[i + len(PASSAGES_SEP):]
    if nl < 0:
        return State("passages", p) if _list_state(p, g.passages) is not None else None
    if not _list_complete(p, g.passages):
        return None
    after = rest[nl + 1:]
    if len(after) < len(QUESTION_HEAD):
        return State("qhead", after) if QUESTION_HEAD.startswith(after) else None
    if not after.startswith(QUESTION_HEAD):
        return None
    q = after[len(QUESTION_HEAD):]
    return State("question", q) if question_ok(q, g) else None


def valid_target_prefix(text: str, g: TargetGrammar) -> bool:
    return target_state(text, g) is not None


def target_complete(text: str, g: TargetGrammar) -> bool:
    """``text`` is a whole target: the EOS may follow."""
    st = target_state(text, g)
    return st is not None and st.phase == "question" and question_cost(st.part) == 0


def question_cost(q: str) -> int:
    """Tokens still needed for a complete question: a space, then one-character tokens."""
    return (0 if q else 1) + max(0, MIN_QUESTION_CHARS - nonspace_chars(q))


def _finishes(part: str, allowed, closer: str) -> list[str]:
    """Ways to finish the partial list ``part`` (one more item at most), each followed by ``closer``."""
    last, starts = _list_state(part, allowed)
    return [a[len(last):] + closer for a in starts if a.startswith(last)]


def completion_cost(st: State, g: TargetGrammar, tokens) -> int:
    """The fewest tokens (``tokens(literal)``: how many tokens a literal needs) to make the target
    complete from state ``st``: finish the open list, the rest ``none`` (or the cheapest first
    item), the line end, ``question:`` and a shortest question."""
    if st.phase == "question":
        return question_cost(st.part)
    tail = "\n" + QUESTION_HEAD
    first_p = min(["none", *g.passages], key=tokens)
    first_t = min(["none", *g.turns], key=tokens)
    if st.phase == "head":
        options = [GROUNDING_HEAD[len(st.part):] + first_t + PASSAGES_SEP + first_p + tail]
    elif st.phase == "turns":
        options = _finishes(st.part, g.turns, PASSAGES_SEP + first_p + tail)
    elif st.phase == "sep":
        options = [PASSAGES_SEP[len(st.part):] + first_p + tail]
    elif st.phase == "passages":
        options = _finishes(st.part, g.passages, tail)
    else:  # qhead
        options = [QUESTION_HEAD[len(st.part):]]
    return min(tokens(o) for o in options) + question_cost("")


def next_units(st: State, g: TargetGrammar) -> list[str]:
    """Outside the question: literals such that every valid next token is a prefix of one of them
    or starts with one of them (the candidates a step has to check)."""
    if st.phase == "head":
        return [GROUNDING_HEAD[len(st.part):]]
    if st.phase == "sep":
        return [PASSAGES_SEP[len(st.part):]]
    if st.phase == "qhead":
        return [QUESTION_HEAD[len(st.part):]]
    allowed, closer = (g.turns, PASSAGES_SEP) if st.phase == "turns" else (g.passages, "\n")
    last, starts = _list_state(st.part, allowed)
    units = {a[len(last):] for a in starts if a.startswith(last) and len(a) > len(last)}
    if last in starts:  # a whole item (or the whole ``none``): the list may go on or end
        units |= {closer} if last == "none" else {",", closer}
    return sorted(units)


# ---- the vocabulary, indexed once per tokenizer -----------------------------------------------


class _ByPrefix:
    """``(key, token id)`` pairs sorted by key: the ids whose key starts with a prefix, by bisection."""

    def __init__(self, pairs):
        pairs = sorted(pairs)
        self.keys = [k for k, _ in pairs]
        self.ids = [t for _, t in pairs]

    def starting_with(self, prefix: str) -> list[int]:
        lo = bisect.bisect_left(self.keys, prefix)
        hi = lo
        while hi < len(self.keys) and self.keys[hi].startswith(prefix):
            hi += 1
        return self.ids[lo:hi]


class VocabIndex:
    """Every token's text, decoded after an anchor token (so a tokenizer that drops a leading space
    when a token is decoded alone still gives the text the token adds), looked up by exact text and
    by prefix, and summarised per token for the question line. Special tokens have no text here:
    they are never allowed inside the target (the EOS only at its end)."""

    def __init__(self, tok):
        anchor = tok("a", add_special_tokens=False)["input_ids"][:1]
        head = tok.decode(anchor)
        special = set(tok.all_special_ids)
        texts: list[str | None] = []
        for tid, s in enumerate(tok.batch_decode([anchor + [t] for t in range(len(tok))])):
            ok = tid not in special and s.startswith(head) and len(s) > len(head)
            texts.append(s[len(head):] if ok else None)
        self.texts = texts
        self.eos = tok.eos_token_id
        self.by_text: dict[str, list[int]] = {}
        for tid, s in enumerate(texts):
            if s is not None:
                self.by_text.setdefault(s, []).append(tid)
        self.max_len = max((len(s) for s in self.by_text), default=1)
        self.by_prefix = _ByPrefix((s, t) for t, s in enumerate(texts) if s is not None)
        # the question line, per token
        self.q_ok = [s is not None and "|" not in s and all(_plain_char(c) for c in s) for s in texts]
        self.nonspace = [nonspace_chars(s) if s else 0 for s in texts]
        self.first_space = [bool(s) and s[0] == " " and not (len(s) > 1 and s[1].isspace()) for s in texts]
        self.no_lead_space = [bool(s) and not s[0].isspace() for s in texts]
        self.closes = [bool(s) and s.rstrip().endswith("?") for s in texts]
        self.syntax_ids = [t for t, s in enumerate(texts) if self.q_ok[t] and (":" in s or "=" in s)]
        norm = [(_norm(s), t) for t, s in enumerate(texts) if self.q_ok[t]]
        self.role_keys = _ByPrefix(norm)
        self.role_keys_joined = _ByPrefix((k.lstrip(" "), t) for k, t in norm)  # after a space
        self.role_inside = [t for k, t in norm if any(p in k for p in ROLE_PHRASES)]

    def candidates(self, units) -> set[int]:
        """Tokens that are a prefix of a unit or start with one."""
        out: set[int] = set()
        for u in units:
            for k in range(1, len(u) + 1):
                out.update(self.by_text.get(u[:k], ()))
            out.update(self.by_prefix.starting_with(u))
        return out

    def role_candidates(self, q: str, phrases) -> set[int]:
        """Tokens that could complete a role phrase at the end of question ``q``: those that start
        with the rest of a phrase whose beginning ``q`` ends with, and those holding a whole phrase."""
        n = _norm(q)
        keys = self.role_keys_joined if n.endswith(" ") else self.role_keys
        out = set(self.role_inside)
        for p in phrases:
            for j in range(1, len(p)):
                if n.endswith(p[:j]):
                    out.update(keys.starting_with(p[j:]))
        return out

    @lru_cache(maxsize=4096)
    def tokens(self, literal: str) -> int:
        """The fewest vocabulary tokens whose texts concatenate to ``literal``."""
        best = [0] + [len(literal) + 1] * len(literal)
        for j in range(1, len(literal) + 1):
            for i in range(max(0, j - self.max_len), j):
                if best[i] + 1 < best[j] and literal[i:j] in self.by_text:
                    best[j] = best[i] + 1
        return best[-1]


def vocab_index(tok) -> VocabIndex:
    """The tokenizer's ``VocabIndex``, built once per vocabulary (about a second for a 49k one): engines whose
    tokenizers are the same (a serving replica's tenants adapted from one base, each loading its own tokenizer)
    share one index. Looked up by the tokenizer object first (every question asks for it), then by what the
    index depends on (:func:`_vocab_key`)."""
    try:
        return _BY_OBJECT[tok]
    except (KeyError, TypeError):
        pass
    key = _vocab_key(tok)
    with _LOCK:
        index = _BY_KEY.pop(key, None) or VocabIndex(tok)
        _BY_KEY[key] = index  # most recently used last
        while len(_BY_KEY) > _KEEP:
            _BY_KEY.pop(next(iter(_BY_KEY)))
    try:
        _BY_OBJECT[tok] = index
    except TypeError:  # a tokenizer that cannot be weakly referenced: found by its key each time
        pass
    return index


def _vocab_key(tok) -> str:
    """What the index depends on: the tokenizer's whole definition (vocabulary, merges, added and special tokens,
    normaliser, decoder) as its fast backend serialises it, and its special ids."""
    import hashlib

    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
    return hashlib.sha256((text + repr((tok.all_special_ids, tok.eos_token_id))).encode()).hexdigest()


_KEEP = 8  # distinct vocabularies kept
_LOCK = threading.Lock()
_BY_KEY: dict[str, VocabIndex] = {}
_BY_OBJECT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TargetConstraint:
    """``LogitsProcessor``: every row's generated text stays a prefix of a valid target for its
    request, completes within ``max_new_tokens``, and ends with EOS.

    ``prompt_len``: the padded prompt length (left padding: generation starts there for all rows);
    ``rows``: one ``TargetGrammar`` per row; ``written``: per row, target text already in the
    prompt after ``decision: clarify\\n`` (the pipeline's question stage is given the grounding line).
    A row whose text is not a valid prefix (only possible through ``written``), or that no token
    could continue, is left to the model rather than stalled.
    The masks are built in numpy and applied in one tensor operation per step: many small tensor
    operations cost more than the model's step on a busy multi-threaded CPU.
    """

    def __init__(self, tokenizer, prompt_len: int, rows: list[TargetGrammar], max_new_tokens: int,
                 written: list[str] | None = None):
        self.tok = tokenizer
        self.prompt_len = prompt_len
        self.rows = rows
        self.max_new_tokens = max_new_tokens
        self.written = written or [""] * len(rows)
        self.index = vocab_index(tokenizer)
        self._vectors: dict = {}

    def _vector(self, name: str, vocab: int):
        """A per-token list of the index as an array over the model's vocabulary (padding: no text)."""
        import numpy as np

        key = (name, vocab)
        if key not in self._vectors:
            values = np.asarray(getattr(self.index, name), dtype=np.int64 if name == "nonspace" else bool)[:vocab]
            self._vectors[key] = np.concatenate([values, np.zeros(vocab - len(values), dtype=values.dtype)])
        return self._vectors[key]

    def _text(self, row, gen: list[int]) -> str:
        anchor = [int(row[self.prompt_len - 1])]
        return self.tok.decode(anchor + gen)[len(self.tok.decode(anchor)):]

    def __call__(self, input_ids, scores):
        import numpy as np
        import torch

        left = self.max_new_tokens - (input_ids.shape[1] - self.prompt_len)  # this step included
        vocab = scores.shape[-1]
        eos = self.index.eos
        keep = np.ones((input_ids.shape[0], vocab), dtype=bool)
        for b, row in enumerate(input_ids.tolist()):
            gen = row[self.prompt_len:]
            if eos is not None and eos in gen:  # finished: generate pads the row; keep its scores finite
                keep[b] = _ids_mask([eos], vocab)
                continue
            text = self.written[b] + self._text(row, gen)
            st = target_state(text, self.rows[b])
            if st is None:
                continue
            if st.phase == "question":
                keep[b] = self._question(st.part, self.rows[b], left, vocab)
            else:
                keep[b] = _ids_mask(self._structure(text, self.rows[b], st, left), vocab)
            if not keep[b].any():  # no token can go on (a tokenizer that cannot spell it): leave the row be
                keep[b] = True
        if not keep.all():
            scores = scores.masked_fill(torch.from_numpy(~keep).to(scores.device), float("-inf"))
        return scores

    def _structure(self, text: str, g: TargetGrammar, st: State, left: int) -> list[int]:
        """Grounding line and ``question:``: the valid candidates that leave enough tokens."""
        ix = self.index
        costs = {}
        for t in ix.candidates(next_units(st, g)):
            nxt = target_state(text + ix.texts[t], g)
            if nxt is not None:
                costs[t] = completion_cost(nxt, g, ix.tokens)
        fits = [t for t, c in costs.items() if c <= left - 1]
        if fits or not costs:
            return fits
        least = min(costs.values())
        return [t for t, c in costs.items() if c == least]  # the budget cannot be met: come closest

    def _question(self, q: str, g: TargetGrammar, left: int, vocab: int):
        """The question line: plain text, no target syntax, no blocked role phrase, within budget,
        closed on the last step; EOS once it is complete."""
        ix = self.index
        keep = self._vector("q_ok", vocab).copy()
        if q == "":
            keep &= self._vector("first_space", vocab)
        elif q == " ":
            keep &= self._vector("no_lead_space", vocab)
        tail = q[-_SYNTAX_TAIL:]
        bad = [t for t in ix.syntax_ids if syntax_in_question(tail + ix.texts[t]) is not None]
        if g.role_re is not None:
            bad += [t for t in ix.role_candidates(q, g.blocked_roles) if g.role_in(q + ix.texts[t])]
        keep[[t for t in bad if t < vocab]] = False
        need = max(0, MIN_QUESTION_CHARS - nonspace_chars(q))
        cost = (need - self._vector("nonspace", vocab)).clip(min=0)  # question_cost(q + token)
        within = keep & (cost <= left - 1)
        if left == 1:  # the last token: only one that closes the question
            within &= self._vector("closes", vocab)
        if ix.eos is not None and ix.eos < vocab and need == 0:
            within[ix.eos] = True
        if within.any() or not keep.any():
            return within
        return keep & (cost == cost[keep].min())  # the budget cannot be met: come closest


def _ids_mask(ids, vocab: int):
    import numpy as np

    keep = np.zeros(vocab, dtype=bool)
    keep[[t for t in ids if t < vocab]] = True
    return keep
