"""Deterministic synthetic RAG chat logs with planted failures: the test bed of ``clarifier audit``.

The audit scores every user turn of a team's chat logs for P(needs clarification) and estimates
**the share of failed turns that needed clarification** (a *failed* turn: its answer carries a
failure signal as :mod:`clarifier.data.signals` reads it). This module writes logs where that share
is known because it was planted.

**Content.** Every record is one conversation of :func:`clarifier.data.synthetic_rag.generate_conversations`
``(n, seed)`` -- the same histories, the same labelled user turns and their passages -- rewritten as
an OpenAI-style transcript in exactly the shape :mod:`clarifier.data.chatlog` documents::

    {"id": "chat-0-00017",
     "messages": [
       {"role": "system", "content": "You are the virtual assistant of a retail bank."},     # optional
       {"role": "user", "content": "Hi, I have a question."},
       {"role": "assistant", "content": "Of course, how can I help?", "feedback": "up"},
       {"role": "user", "content": "what's the limit?"},                                       # a labelled turn
       {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", ...}]},          # retrieval ...
       {"role": "tool", "tool_call_id": "call_1", "content": "[{\\"doc_id\\": \\"kb-...\\", \\"text\\": ...}]"},
       {"role": "assistant", "content": "It's 500 EUR for the debit card.", "rating": 1},      # ... the answer
       {"role": "user", "content": "I mean: what's the limit?"},                               # a restatement
       ...],
     "metadata": {"domain": "banking", "source": "synthetic_chatlogs", "seed": 0,
                  "feedback": [{"message_index": 2, "thumbs": "up"}],                          # sometimes
                  "escalated": true},                                                           # sometimes
     "planted": {"3": {"needs_clarification": true, "failed": true, "signals": ["feedback", "reformulation"],
                       "feedback": "negative", "turn": "labelled", "kind": "rag_ambiguous"}, ...}}   # the truth

A conversation keeps one retrieval style (seeded, ``tool_share``): its turns' passages come either as
an assistant tool call followed by a ``tool`` message (a JSON list of ``{"doc_id", "text"}``) or as
``documents`` on the user message. Doc ids are ``kb-`` + a hash of the domain and text (the same
document has the same id everywhere). A few user messages are a list of content parts. No message
carries a label (``needs_clarification`` / ``label``) unless ``labelled_share`` asks for some.

**Turns** (the record's ``planted`` has one entry per user message, keyed by its message index as a
string -- the audit's turn id is ``"<id>:<index>"``; ``turn`` says which kind it is):

* ``labelled`` -- a user turn synthetic_rag labels; ``needs_clarification`` is its label. The last one
  of a conversation gets a newly written answer: a clear turn the answer on the reading it names (the
  value taken from its passage when one carries it); an ambiguous one, when it did not fail, either
  the clarifying question of its label (half the time) or the answer on one candidate (a lucky guess).
  Labelled turns inside the history (an earlier ambiguous turn answered by a clarifying question and
  the reply naming one reading, ``rag_resolved``) keep synthetic_rag's answers.
* ``history`` -- the other turns of the history (openers, small talk, the turns naming candidates,
  answered explicit questions of another question family): synthetic_rag's answers, never failed;
  ``needs_clarification`` is ``False`` (none is a request an answer could misread: they name their
  subject or ask nothing). Two consecutive user turns are never alike (token Jaccard >= 0.3, or the
  same reading item named in both): of such a pair, a history pair (user turn and answer) is dropped
  (a repeated filler, two questions on the same item), unless it names an item of the last labelled
  turn's question family; then a small-talk pair (a filler and an acknowledgement) is put between
  them (the turn naming two candidates before a query naming one). No labelled turn is touched, no
  label changes; about 3% of conversations are affected.
* ``restatement`` -- the user's repeat of a failed query (the reformulation signal, below): never
  failed, answered like a successful labelled turn; ``needs_clarification`` is the repeated turn's.

**Planted failures.** Only labelled turns fail. With ``N`` labelled turns of which ``A`` need
clarification (``a = A / N``, about 0.5 by synthetic_rag's balance), exactly
``round(planted_share * failure_rate * N)`` of the ``A`` ambiguous turns and
``round((1 - planted_share) * failure_rate * N)`` of the ``N - A`` clear ones fail, drawn without
replacement: P(fail | needs clarification) = ``planted_share * failure_rate / a`` and
P(fail | clear) = ``(1 - planted_share) * failure_rate / (1 - a)``, so ``failure_rate`` of the labelled
turns fail and ``planted_share`` of the failed ones need clarification, up to rounding (not only in
expectation). A combination that needs either probability above 1 is a ``ValueError``.

A failure is shown by one or more signals, each exactly as the audit's default ``audit.signals``
read it (``signals`` lists them, in the order of :data:`clarifier.data.signals.SIGNALS`):

* ``feedback`` -- negative explicit feedback on the answer: ``"down"``, ``"thumbs_down"``,
  ``"negative"``, ``false``, ``{"thumbs": "down"}``, or a rating of 1-2 (``rating`` or a numeric
  ``feedback``); on the message, in its ``metadata``, or as a ``metadata.feedback`` entry pointing at
  it by ``message_index``;
* ``no_answer`` -- the answer is a no-answer reply matching the default patterns ("I couldn't find ...");
* ``escalation`` -- an escalation reply ("Let me transfer you to a human agent ...") and/or a hand-off
  flag (``escalated`` / ``handoff`` on the message or its ``metadata``, or ``metadata.escalated``
  when the turn is the conversation's last answered one);
* ``reformulation`` -- the next user message restates the query. When it is the turn's only signal,
  the query is re-sent as it was or with only its casing changed: MiniLM's tokenizer is uncased, so
  the similarity is 1 and the audit cannot miss it. Alongside another signal it is one of
  ``"I mean: <q>"``, ``"<q>, please?"``, ``"Again: <q>"``, ``"Let me ask again: <q>"`` (greeting
  and thanks dropped) or the query with its typos fixed (the nearest well-formed query of its family,
  difflib ratio >= 0.8): lexically close, but MiniLM scores short or misspelt queries against these
  as low as 0.02, so the audit may not count this signal -- the turn still fails by the other one.
  :func:`is_restatement` recognises every shape.

The last labelled turn of a conversation fails as follows: with probability ``feedback_share`` its
answer has explicit feedback, negative except with probability ``feedback_noise`` (a user who liked an
answer that failed; the turn then fails by another signal); a turn without negative feedback gets
one of no_answer / reformulation / escalation (weights 0.4 / 0.35 / 0.25), and every failed turn gets
each further one of these with probability 0.15. A failed labelled turn *inside* the history can only
show negative feedback (a no-answer reply, a hand-off or a restatement would contradict the logged
conversation that follows), so failed turns carry explicit feedback a little more often than
``feedback_share``.

**Successful turns carry no failure signal**: their feedback (with probability ``feedback_share``, on
every answer of every kind of turn) is positive (``"up"``, ``"thumbs_up"``, ``true``, a rating of 4-5,
...); no answer that did not fail matches a no_answer or escalation pattern; and the next user message
after a turn that did not fail is never a restatement nor alike (above). Measured with the packaged
MiniLM on 3,000 conversations, the pairs of those that share a word score at most 0.65 (the threshold
is 0.75; 0.73 before the separation above). Hence, under the default ``audit.signals``, *a turn is
signalled by the audit exactly when it is planted as failed* (``tests/unit/test_synthetic_chatlogs.py``
checks it with the audit's own scorer, ``-m slow``), and ``planted_summary(...)["share"]`` is the very
quantity the audit estimates. Changing the signal
config (patterns, ``rating_at_most``, ``min_similarity``, another encoder, a disabled signal) breaks
that identity; the per-signal counts of ``signals`` are what was planted, which for reformulation
(alongside another signal) can exceed what the audit counts.

Which turns fail depends on their label only (drawn as above), and the draw of a failure's signals
does not look at the label (only at the turn's place: inside the history, feedback only -- and the
history's labelled turns come in pairs, one of each class), so no signal tells the classes apart.

``planted_summary(records)`` counts from each record's ``planted``, a top-level key the audit does not
read (it is neither a signal nor a label, and outside ``metadata``, so it is not carried into the
audited turns' ``meta`` either). ``labelled_share`` puts the planted label on a seeded sample of
user messages (``needs_clarification``), the audit's in-domain error-rate measurement.
``write_chatlogs`` writes JSONL shards ``chatlogs-<k>.jsonl`` and ``planted.json`` (the arguments,
both probabilities and the summary) next to them; the audit reads ``.jsonl`` files only.

Only ``random.Random`` seeded from ``seed`` is used (synthetic_rag's, and one of this module for the
transcript): the same arguments give the same records.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import random
import re
from typing import Any

from clarifier.data.synthetic_rag import Content, Domain, content, generate_conversations

__all__ = ["GENERATOR", "NO_ANSWER_REPLIES", "ESCALATION_REPLIES", "PLANTED_FILE", "SOURCE", "generate_chatlogs",
           "is_restatement", "planted_probabilities", "planted_summary", "restatement", "write_chatlogs"]

GENERATOR = "synthetic_chat"  # the name `clarifier data synth --generator` takes
SOURCE = "synthetic_chatlogs"  # metadata.source of every record
PLANTED_FILE = "planted.json"
SIGNAL_ORDER = ("feedback", "no_answer", "escalation", "reformulation")  # = clarifier.data.signals.SIGNALS

# Each matches one of the default audit.signals.no_answer / .escalation patterns (tests check it).
NO_ANSWER_REPLIES = (
    "I couldn't find information about that in the documents I have.",
    "Sorry, I could not find an answer to that in our knowledge base.",
    "I wasn't able to find anything on that in the help articles.",
    "No relevant information was found for your question.",
    "I don't have enough information in my sources to answer that.",
)
ESCALATION_REPLIES = (
    "Let me transfer you to a human agent who can help with this.",
    "I'll connect you with a support specialist.",
    "I've opened a support ticket for you; a colleague will get back to you.",
    "I'm escalating this to our support team.",
)
CLOSE_JACCARD = 0.3  # consecutive user turns this close are kept apart (_separate_close_turns)
FALLBACK_FILLER = "One moment, please."
RESTATEMENTS = ("I mean: {q}", "{bare}, please?", "Again: {q}", "Let me ask again: {q}")
RESTATEMENT_WORDS = frozenset({"i", "mean", "please", "again", "let", "me", "ask"})  # the words RESTATEMENTS add
TYPO_RATIO = 0.8  # a typo-fixed restatement: a family template this similar to the query (difflib ratio)
TOOLS = ("search_knowledge_base", "retrieve_documents", "search")

# (field, value) of explicit feedback; a rating or a numeric feedback is read on a 1-5 scale.
NEGATIVE_FEEDBACK: tuple[tuple[str, Any], ...] = (
    ("feedback", "down"), ("feedback", "down"), ("feedback", "thumbs_down"), ("feedback", "negative"),
    ("feedback", False), ("feedback", {"thumbs": "down"}), ("rating", 1), ("rating", 2), ("feedback", 1))
POSITIVE_FEEDBACK: tuple[tuple[str, Any], ...] = (
    ("feedback", "up"), ("feedback", "up"), ("feedback", "thumbs_up"), ("feedback", "positive"),
    ("feedback", True), ("feedback", {"thumbs": "up"}), ("rating", 5), ("rating", 4), ("feedback", 5))
OTHER_SIGNALS = ("no_answer", "reformulation", "escalation")
PRIMARY_WEIGHTS = (0.4, 0.35, 0.25)  # the one signal of a failed turn without negative feedback
EXTRA_SIGNAL = 0.15  # each further signal of a failed turn


# ---- the planted failures -----------------------------------------------------------------------


def planted_probabilities(ambiguous_share: float, planted_share: float, failure_rate: float) -> tuple[float, float]:
    """``(P(fail | needs clarification), P(fail | clear))`` for which ``failure_rate`` of the turns
    fail and ``planted_share`` of the failed ones need clarification; ``ValueError`` when impossible."""
    if not 0 <= planted_share <= 1:
        raise ValueError(f"planted_share must be in [0, 1], got {planted_share}")
    if not 0 < failure_rate <= 1:
        raise ValueError(f"failure_rate must be in (0, 1], got {failure_rate}")
    a = ambiguous_share
    want_a, want_c = planted_share * failure_rate, (1 - planted_share) * failure_rate
    eps = 1e-9
    if want_a > a + eps or want_c > (1 - a) + eps:
        over = (f"{want_a:.1%} of the labelled turns would be failed turns needing clarification, but only {a:.1%} "
                f"need clarification" if want_a > a + eps else
                f"{want_c:.1%} of the labelled turns would be failed clear turns, but only {1 - a:.1%} are clear")
        limit = (a / planted_share if want_a > a + eps else (1 - a) / (1 - planted_share))
        raise ValueError(f"planted_share={planted_share} with failure_rate={failure_rate} is impossible: {over}; "
                         f"with this planted_share, failure_rate can be at most {limit:.3f}")
    return (want_a / a if a > 0 else 0.0), (want_c / (1 - a) if a < 1 else 0.0)


def _choose_failed(labelled: list[tuple[int, int, bool]], planted_share: float, failure_rate: float,
                   rng: random.Random) -> set[tuple[int, int]]:
    """``(conversation, turn)`` of the failed turns among ``labelled`` ``(conversation, turn, needs
    clarification)``: exactly the counts the shares ask for (up to rounding), drawn per class."""
    if not labelled:
        raise ValueError("the generated conversations have no labelled user turn")
    amb = [(c, t) for c, t, nc in labelled if nc]
    clear = [(c, t) for c, t, nc in labelled if not nc]
    n = len(labelled)
    planted_probabilities(len(amb) / n, planted_share, failure_rate)  # ValueError when impossible
    k_a = min(len(amb), round(planted_share * failure_rate * n))
    k_c = min(len(clear), round((1 - planted_share) * failure_rate * n))
    return set(rng.sample(amb, k_a)) | set(rng.sample(clear, k_c))


# ---- text -----------------------------------------------------------------------------------------


def _doc_id(domain: str, text: str) -> str:
    return "kb-" + hashlib.sha256(f"{domain}\x00{text}".encode()).hexdigest()[:10]


def _fill(template: str, item: str, aspect: str, value: str = "") -> str:
    cap = lambda s: s[:1].upper() + s[1:]  # noqa: E731
    return (template.replace("{Item}", cap(item)).replace("{item}", item).replace("{Aspect}", cap(aspect))
            .replace("{aspect}", aspect).replace("{value}", value))


def _core(query: str, c: Content) -> str:
    """The query without a greeting prefix or a thanks suffix (what a user repeats)."""
    q = query.strip()
    for p in c.generic["prefixes"]:
        if q.lower().startswith(p.lower()) and len(q) > len(p):
            q = q[len(p):]
            break
    for s in c.generic["suffixes"]:
        if q.lower().endswith(s.strip().lower()) and len(q) > len(s.strip()):
            q = q[: len(q) - len(s.strip())].rstrip()
            break
    return q or query.strip()


_TOKEN = re.compile(r"[a-z0-9']+")


def _tokens(text: str) -> set[str]:
    return set(_TOKEN.findall(_norm(text)))


def _norm(text: str) -> str:
    return " ".join(text.lower().replace("\u2019", "'").split())


def restatement(rng: random.Random, query: str, templates: list[str], exact: bool, c: Content | None = None) -> str:
    """The user repeating ``query``. ``exact``: the query re-sent as it was, or only its casing changed
    (MiniLM's tokenizer is uncased: similarity 1 to the query); else one of ``RESTATEMENTS`` around
    the query without its greeting or thanks, or (when the query is a misspelt form of one of
    ``templates``) that template -- close in words, but an encoder may score a short or misspelt query
    below the threshold, so these go only with another signal."""
    if exact:
        return rng.choice((query, query, query.lower(), query[:1].upper() + query[1:]))
    c = c or content()
    q = _core(query, c)
    fixed, best = None, 0.0
    bare = _norm(q).rstrip("?!. ")
    if all(_norm(t).rstrip("?!. ") != bare for t in templates):  # not well-formed: perhaps misspelt
        for t in templates:
            r = difflib.SequenceMatcher(None, q.lower(), t.lower()).ratio()
            if r > best:
                best, fixed = r, t
    if fixed is not None and best >= TYPO_RATIO and rng.random() < 0.5:
        return fixed[:1].upper() + fixed[1:]
    return rng.choice(RESTATEMENTS).format(q=q, bare=q.rstrip("?!. ") or q)


def is_restatement(query: str, next_user: str) -> bool:
    """Whether ``next_user`` has one of the shapes :func:`restatement` writes for ``query`` (a lexical
    check, for tests and readers of the logs): the same text up to case, the query's words plus only
    ``RESTATEMENT_WORDS`` (greeting and thanks aside), or a spelling at least ``TYPO_RATIO`` similar (difflib)."""
    nx, core = _norm(next_user), _norm(_core(query, content()))
    if _norm(query) == nx:
        return True
    tq, tn = _tokens(core), _tokens(next_user)
    if tq and tq < tn and tn - tq <= RESTATEMENT_WORDS:
        return True
    return difflib.SequenceMatcher(None, core, nx).ratio() >= TYPO_RATIO


class _Writer:
    """One transcript under construction."""

    def __init__(self, rng: random.Random, c: Content, d: Domain, tool_style: bool, feedback_share: float):
        self.rng, self.c, self.d = rng, c, d
        self.tool_style, self.feedback_share = tool_style, feedback_share
        self.messages: list[dict] = []
        self.meta_feedback: list[dict] = []
        self.planted: dict[str, dict] = {}
        self.escalated = False  # metadata.escalated (the conversation's last answered user turn)
        self.calls = 0

    # -- messages

    def user(self, text: str, passages: list[dict], query_for_tool: str) -> int:
        content_: Any = [{"type": "text", "text": text}] if self.rng.random() < 0.1 else text
        msg: dict = {"role": "user", "content": content_}
        docs = [{"doc_id": _doc_id(self.d.name, p["text"]), "text": p["text"]} for p in passages]
        if docs and not self.tool_style:
            msg["documents"] = docs
        self.messages.append(msg)
        i = len(self.messages) - 1
        if docs and self.tool_style:
            self.calls += 1
            cid = f"call_{self.calls}"
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function", "function": {
                    "name": self.rng.choice(TOOLS), "arguments": json.dumps({"query": query_for_tool})}}]})
            self.messages.append({"role": "tool", "tool_call_id": cid, "content": json.dumps(docs, ensure_ascii=False)})
        return i

    def answer(self, text: str, feedback: str | None, escalation_flag: bool) -> int:
        msg: dict = {"role": "assistant", "content": text}
        self.messages.append(msg)
        i = len(self.messages) - 1
        if feedback is not None:
            field, value = self.rng.choice(NEGATIVE_FEEDBACK if feedback == "negative" else POSITIVE_FEEDBACK)
            where = self.rng.random()
            if where < 0.7:
                msg[field] = value
            elif where < 0.8:
                msg["metadata"] = {field: value}
            else:
                key = "rating" if isinstance(value, (int, float)) and not isinstance(value, bool) else (
                    "thumbs" if isinstance(value, str) else "value")
                self.meta_feedback.append({"message_index": i, key: value})
        if escalation_flag:
            how = self.rng.choice(("escalated", "handoff", "metadata"))
            if how == "metadata":
                msg.setdefault("metadata", {})["escalated"] = True
            else:
                msg[how] = True
        return i

    def positive_feedback(self) -> str | None:
        return "positive" if self.rng.random() < self.feedback_share else None

    # -- answer texts

    def answer_text(self, turn: dict, item: str) -> str:
        """The answer on ``item``'s reading of the turn's family, its value from a passage carrying it."""
        meta = turn["meta"]
        fam = meta["family"]
        reading = next(r for r in self.d.readings[fam] if r.item == item)
        carried = [p["text"] for p, it in zip(turn["passages"], meta["passage_items"]) if it == item]
        value = next((v for v in reading.values if any(v in t for t in carried)), None)
        value = value or self.rng.choice(reading.values)
        t = self.rng.choice(self.c.families[fam].answers)
        out = _fill(t, item=item, aspect=self.c.aspect(fam, reading), value=value)
        return out[:1].upper() + out[1:]

    def success_text(self, turn: dict) -> str:
        label, meta = turn["label"], turn["meta"]
        if label["needs_clarification"]:
            if label.get("clarifying_question") and self.rng.random() < 0.5:
                return label["clarifying_question"]
            return self.answer_text(turn, self.rng.choice(meta["candidates"]))
        return self.answer_text(turn, meta["candidates"][0])

    def failed_text(self, turn: dict) -> str:
        """A guess among the candidates (ambiguous), or the answer on another reading (clear)."""
        meta = turn["meta"]
        if turn["label"]["needs_clarification"]:
            return self.answer_text(turn, self.rng.choice(meta["candidates"]))
        others = [r.item for r in self.d.readings[meta["family"]] if r.item not in meta["candidates"]]
        shown = [it for it in meta["passage_items"] if it in others]
        return self.answer_text(turn, self.rng.choice(shown or others or meta["candidates"]))

    def templates(self, turn: dict) -> list[str]:
        """The well-formed queries of the turn's question family (vague, pronoun and, for an explicit
        query, explicit ones naming its item): what a misspelt query may have meant."""
        meta = turn["meta"]
        fam = self.c.families[meta["family"]]
        out = [*fam.vague, *fam.pronoun]
        target = next((r for r in self.d.readings[meta["family"]] if r.item == meta["candidates"][0]), None)
        if target is not None and meta["kind"] == "rag_explicit":
            out += [_fill(t, item=target.item, aspect=self.c.aspect(meta["family"], target)) for t in fam.explicit]
        return out


def _close(a: str, b: str, items: list[str]) -> bool:
    """Two user messages a reformulation detector might take for a restatement: the same words
    (Jaccard >= ``CLOSE_JACCARD``) or the same reading item named in both."""
    ta, tb = _tokens(a), _tokens(b)
    if ta and tb and len(ta & tb) / len(ta | tb) >= CLOSE_JACCARD:
        return True
    la, lb = a.lower(), b.lower()
    return any(it in la and it in lb for it in items)


def _separate_close_turns(turns: list[dict], c: Content, d: Domain,
                          rng: random.Random) -> list[tuple[int | None, dict]]:
    """``(index in turns, turn)`` of synthetic_rag's turns, no user turn close (:func:`_close`) to the
    next one, since the audit could read a restatement where none was planted: of a close pair, a
    history pair (an unlabelled user turn and its answer) is removed (a repeated filler, two questions
    on the same item) unless it names an item of the last labelled turn's question family (its label
    may rest on it); then a small-talk pair (index None: a filler and an acknowledgement) is put
    between the two (a turn naming two candidates before a question naming one of them)."""
    final = next(t for t in reversed(turns) if t.get("label"))
    grounding = [r.item.lower() for r in d.readings[final["meta"]["family"]]]
    items = sorted({r.item.lower() for rs in d.readings.values() for r in rs})
    fillers = [*d.fillers, *c.generic["fillers"]]
    out: list[tuple[int | None, dict]] = list(enumerate(turns))

    def removable(i: int) -> bool:
        t = out[i][1]
        if t.get("label") or i + 1 >= len(out) or out[i + 1][1]["role"] != "assistant":
            return False
        text = f"{t['text']} {out[i + 1][1]['text']}".lower()
        return not any(g in text for g in grounding)

    changed = True
    while changed:
        changed = False
        users = [i for i, (_, t) in enumerate(out) if t["role"] == "user"]
        for u, v in zip(users, users[1:]):
            a, b = out[u][1]["text"], out[v][1]["text"]
            if not _close(a, b, items):
                continue
            drop = u if removable(u) else v if removable(v) else None
            if drop is not None:
                del out[drop: drop + 2]
            else:
                fits = [f for f in fillers if not _close(a, f, items) and not _close(f, b, items)] or [FALLBACK_FILLER]
                out[v:v] = [(None, {"role": "user", "text": rng.choice(fits)}),
                            (None, {"role": "assistant", "text": rng.choice(c.generic["acks"])})]
            changed = True
            break
    return out


def _failure_signals(rng: random.Random, feedback_share: float, feedback_noise: float) -> tuple[list[str], str | None]:
    """The signals of a failed last labelled turn and its feedback polarity (None: no feedback)."""
    fb = None
    if rng.random() < feedback_share:
        fb = "positive" if rng.random() < feedback_noise else "negative"
    others: list[str] = []
    if fb != "negative":
        others.append(rng.choices(OTHER_SIGNALS, weights=PRIMARY_WEIGHTS)[0])
    others += [s for s in OTHER_SIGNALS if s not in others and rng.random() < EXTRA_SIGNAL]
    signals = (["feedback"] if fb == "negative" else []) + others
    return sorted(signals, key=SIGNAL_ORDER.index), fb


def _transcript(conv: dict, conv_index: int, seed: int, failed: set[tuple[int, int]], rng: random.Random,
                feedback_share: float, feedback_noise: float, tool_share: float, system_share: float) -> dict:
    c = content()
    d = next(x for x in c.domains if x.name == conv["domain"])
    kept = _separate_close_turns(conv["turns"], c, d, rng)
    turns = [t for _, t in kept]
    failed_here = {k for k, (orig, _) in enumerate(kept) if (conv_index, orig) in failed}
    w = _Writer(rng, c, d, tool_style=rng.random() < tool_share, feedback_share=feedback_share)
    if not any(t["role"] == "system" for t in turns) and rng.random() < system_share:
        w.messages.append({"role": "system", "content": d.system})
    last_user = max(i for i, t in enumerate(turns) if t["role"] == "user")
    ti = 0
    while ti < len(turns):
        t = turns[ti]
        if t["role"] == "system":
            w.messages.append({"role": "system", "content": t["text"]})
            ti += 1
            continue
        if t["role"] != "user":  # an assistant turn that answers no user turn: kept as it is
            w.messages.append({"role": "assistant", "content": t["text"]})
            ti += 1
            continue
        labelled = bool(t.get("label"))
        nc = bool(t["label"]["needs_clarification"]) if labelled else False
        is_failed = ti in failed_here
        logged = turns[ti + 1]["text"] if ti + 1 < len(turns) and turns[ti + 1]["role"] == "assistant" else None
        ui = w.user(t["text"], t.get("passages") or [], t["text"])
        entry: dict[str, Any] = {"needs_clarification": nc, "failed": is_failed, "signals": [], "feedback": None,
                                 "turn": "labelled" if labelled else "history",
                                 "kind": t["meta"]["kind"] if labelled else None}
        w.planted[str(ui)] = entry
        if not is_failed and logged is None and not labelled:  # an unanswered history turn: left so
            ti += 1
            continue
        if not is_failed:
            fb = w.positive_feedback()
            text = logged if logged is not None else w.success_text(t)
            w.answer(text, fb, escalation_flag=False)
            entry["feedback"] = fb
            ti += 2 if logged is not None else 1
            continue
        if logged is not None:  # a failed labelled turn inside the history: negative feedback only
            w.answer(logged, "negative", escalation_flag=False)
            entry.update(signals=["feedback"], feedback="negative")
            ti += 2
            continue
        signals, fb = _failure_signals(rng, feedback_share, feedback_noise)
        text = rng.choice(NO_ANSWER_REPLIES) if "no_answer" in signals else w.failed_text(t)
        flag = False
        if "escalation" in signals:
            how = rng.choice(("text", "text", "flag", "both"))
            if how != "flag":
                text = f"{text} {rng.choice(ESCALATION_REPLIES)}"
            if how != "text":
                if "reformulation" not in signals and ti == last_user and rng.random() < 0.3:
                    w.escalated = True  # metadata.escalated: marks the last answered user turn, this one
                else:
                    flag = True
        w.answer(text, fb, escalation_flag=flag)
        entry.update(signals=signals, feedback=fb)
        if "reformulation" in signals:
            alone = signals == ["reformulation"]
            again = restatement(rng, t["text"], w.templates(t), exact=alone, c=c)
            ri = w.user(again, t.get("passages") or [], again)
            rfb = w.positive_feedback()
            w.answer(w.success_text(t), rfb, escalation_flag=False)
            w.planted[str(ri)] = {"needs_clarification": nc, "failed": False, "signals": [], "feedback": rfb,
                                  "turn": "restatement", "kind": None}
        ti += 1
    meta: dict[str, Any] = {"domain": d.name, "source": SOURCE, "seed": seed}
    if w.meta_feedback:
        meta["feedback"] = w.meta_feedback
    if w.escalated:
        meta["escalated"] = True
    return {"id": f"chat-{seed}-{conv_index:05d}", "messages": w.messages, "metadata": meta, "planted": w.planted}


def _check_shares(**shares: float) -> None:
    for name, v in shares.items():
        if not 0 <= v <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {v}")


def generate_chatlogs(n: int, seed: int = 0, planted_share: float = 0.15, failure_rate: float = 0.3,
                      feedback_share: float = 0.6, feedback_noise: float = 0.05, tool_share: float = 0.5,
                      system_share: float = 0.25, labelled_share: float = 0.0) -> list[dict]:
    """``n`` OpenAI-style transcripts with planted failures (see the module docstring), deterministic
    for the arguments. ``tool_share``: conversations whose passages come as tool messages (the rest
    as ``documents``); ``system_share``: conversations without one that get a system message;
    ``labelled_share``: user messages (a seeded sample) that carry their planted
    ``needs_clarification`` as a gold label -- the hand-labelled sample a team makes so that the
    audit measures the model's error rates on its own logs (0: no message carries a label)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    _check_shares(feedback_share=feedback_share, feedback_noise=feedback_noise, tool_share=tool_share,
                  system_share=system_share, labelled_share=labelled_share)
    if feedback_noise >= 1:
        raise ValueError("feedback_noise must be below 1 (a failed turn's feedback is sometimes negative)")
    convs = generate_conversations(n, seed)
    rng = random.Random(f"{SOURCE}:{seed}")
    labelled = [(ci, ti, bool(t["label"]["needs_clarification"])) for ci, conv in enumerate(convs)
                for ti, t in enumerate(conv["turns"]) if t["role"] == "user" and t.get("label")]
    failed = _choose_failed(labelled, planted_share, failure_rate, rng)
    records = [_transcript(conv, ci, seed, failed, rng, feedback_share, feedback_noise, tool_share, system_share)
               for ci, conv in enumerate(convs)]
    if labelled_share:
        lrng = random.Random(f"{SOURCE}:labels:{seed}")  # its own stream: the logs are the same with or without
        for r in records:
            for idx, e in r["planted"].items():
                if lrng.random() < labelled_share:
                    r["messages"][int(idx)]["needs_clarification"] = bool(e["needs_clarification"])
    return records


def planted_summary(records: list[dict]) -> dict[str, Any]:
    """Counts of the planted truth (each record's ``planted``): ``turns`` (user turns), ``failed``,
    ``failed_needing_clarification``, ``share`` (of the failed turns that need clarification: what the
    audit estimates; None without failed turns), ``needing_clarification`` and ``share_all`` (of all
    user turns), ``labelled_turns``, ``labelled_needing_clarification`` and ``failure_rate`` (of the
    labelled turns), ``signals`` (failed turns per signal)."""
    turns = failed = failed_nc = need = labelled = labelled_nc = 0
    per_signal = {s: 0 for s in SIGNAL_ORDER}
    for r in records:
        for e in (r.get("planted") or {}).values():
            turns += 1
            need += bool(e["needs_clarification"])
            if e.get("turn") == "labelled":
                labelled += 1
                labelled_nc += bool(e["needs_clarification"])
            if e["failed"]:
                failed += 1
                failed_nc += bool(e["needs_clarification"])
                for s in e["signals"]:
                    per_signal[s] += 1
    return {"turns": turns, "failed": failed, "failed_needing_clarification": failed_nc,
            "share": failed_nc / failed if failed else None, "needing_clarification": need,
            "share_all": need / turns if turns else None, "labelled_turns": labelled,
            "labelled_needing_clarification": labelled_nc, "failure_rate": failed / labelled if labelled else None,
            "signals": per_signal}


def write_chatlogs(out_uri: str, n: int, seed: int = 0, shards: int = 4, **kw: Any) -> list[str]:
    """Write :func:`generate_chatlogs` ``(n, seed, **kw)`` as JSONL shards ``chatlogs-<k>.jsonl`` under
    ``out_uri`` (a folder or ``s3://`` prefix) and ``planted.json`` next to them; returns the shards."""
    from clarifier.runtime.storage import join, write_text

    records = generate_chatlogs(n, seed, **kw)
    k = max(1, min(shards, n))
    uris = [join(out_uri, f"chatlogs-{s:05d}.jsonl") for s in range(k)]
    for s, uri in enumerate(uris):
        write_text(uri, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in records[s::k]))
    defaults = {k: p.default for k, p in inspect.signature(generate_chatlogs).parameters.items()
                if k not in ("n", "seed")}
    args = {**defaults, **kw}
    summary = planted_summary(records)
    a = summary["labelled_needing_clarification"] / summary["labelled_turns"]
    p_a, p_c = planted_probabilities(a, args["planted_share"], args["failure_rate"])
    write_text(join(out_uri, PLANTED_FILE), json.dumps({
        "generator": GENERATOR, "module": __name__, "conversations": n, "seed": seed, "arguments": args,
        "p_fail_given_needs_clarification": p_a, "p_fail_given_clear": p_c, "files": uris,
        "summary": summary}, indent=1) + "\n")
    return uris
