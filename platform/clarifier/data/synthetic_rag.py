"""Deterministic synthetic RAG conversation logs: underspecification visible in the retrieved passages.

The public clarification sets have few or no retrieved passages; in RAG traffic a query is often
ambiguous only because retrieval returned passages that answer *different readings* of it ("what's
the limit?" -> the daily ATM withdrawal limit of the debit card and the credit limit of the credit
card). This generator writes ``ConversationLog`` dicts whose labelled user turns carry their own
``passages`` (the per-turn field of :class:`clarifier.core.schema.LogTurn`) and their own ``meta``
(``kind``, ``family``, ``candidates``, ``passage_items``: the reading each passage carries, ``None``
for a distractor). Content (domains, question families, readings, templates) is package data:
``synthetic_rag_domains.yaml`` next to this module.

Kinds (``meta.kind`` of each labelled turn); the same query surface forms are used with both labels:

* ``rag_ambiguous`` -- a vague query ("what's the limit?") and passages on 2-3 readings -> clarify,
  the question names the readings, grounded on the passages that carry them;
* ``rag_ambiguous_history`` -- two candidates named earlier (by the user, or offered by the
  assistant), a vague or pronoun query; the passages cover both, one or none of them -> clarify,
  grounded on the history turns naming them and the passages on them;
* ``rag_illformed_multi`` -- a fragment or misspelt query ("limit??", "wats the limit") with
  passages on 2-3 readings -> clarify;
* ``rag_settled`` -- a vague query whose passages all carry one reading (sometimes twice, from two
  documents) besides distractors -> answer;
* ``rag_history_resolved`` -- the history names exactly one candidate, a vague or pronoun query,
  passages on several readings -> answer (hard negative);
* ``rag_short_in_context`` -- as above with a fragment query ("limit?") -> answer (hard negative);
* ``rag_explicit`` -- the query names one candidate while the passages cover two or three -> answer
  (hard negative);
* ``rag_illformed_single`` -- a fragment or misspelt query with one reading in the passages -> answer;
* ``rag_resolved`` -- only inside a history: after an earlier ``rag_ambiguous`` (or
  ``rag_illformed_multi``) turn and the assistant's clarifying question, the user's reply naming
  one reading ("The credit card.") -> answer.

Balance: the final turn's label is chosen against the running count of its domain (an earlier
ambiguous/resolved pair adds one of each), so every domain is within one example of 50/50.
Passages: 1-4 per labelled turn, each 25-360 characters; the reading (item, aspect, value) is the
first sentence after an optional document title, within the first 250 characters, and every
passage that carries a reading is among the first 3 (the prompt shows ``max_passages=3``, each
clipped to ``max_passage_chars=300``); distractors (domain notices, or passages of another question
family of the domain) fill the other places; the order is shuffled. History: 0-6 turns before the
final query (optional system turn, opener, fillers, an answered explicit question or an earlier
ambiguous/resolved exchange of another family, the turns naming candidates). ``long_history_share``
(default 0, which leaves every log above unchanged) makes that share of conversations 8-16 turns long
before the final query, both labels alike, the answered questions carrying the readings' notes.

Combinatorics: 14 domains, 7 question families (3-4 per domain), 176 readings (4 per family and
domain, 3 values each, 0-2 notes), so 264 candidate pairs and 176 triples; per family 7-8 vague,
4-5 pronoun, 7-8 fragment and 4-5 + 3 explicit query templates (each with casing, 7 greeting
prefixes, 4 suffixes and random typos on top), 5 passage templates (with 8 document titles and up
to 4 of 8 closing sentences). A default run (``generate_conversations(400, seed=0)``) gives 456
labelled turns (228 clarify) in 14 domains, 348 distinct query strings and 1,143 distinct passage
texts; in 2,000 conversations every query string seen 10 or more times occurs with both labels.
``tests/unit/test_synthetic_rag.py`` checks these numbers.

Only ``random.Random(seed)`` is used: a seed always gives the same logs, and the first ``k`` of
``generate_conversations(n)`` equal ``generate_conversations(k)``.
"""

from __future__ import annotations

import json
import random
import re
from functools import lru_cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["CLARIFY_KINDS", "CLEAR_KINDS", "CONTENT_FILE", "GENERIC_KEYS", "KINDS", "SOURCE", "Content", "content",
           "generate_conversations", "write_logs"]

SOURCE = "synthetic_rag"
CONTENT_FILE = "synthetic_rag_domains.yaml"

# Weights chosen so that each query style (vague, pronoun, fragment) has about the same share with
# both labels; explicit queries (a clear-only style) are kept to 14% of the clear turns.
CLARIFY_KINDS: dict[str, float] = {"rag_ambiguous": 0.40, "rag_ambiguous_history": 0.28, "rag_illformed_multi": 0.32}
CLEAR_KINDS: dict[str, float] = {"rag_settled": 0.34, "rag_history_resolved": 0.22, "rag_short_in_context": 0.12,
                                 "rag_explicit": 0.14, "rag_illformed_single": 0.18}
RESOLVED_KIND = "rag_resolved"  # the reply to a clarifying question, inside a history
KINDS = (*CLARIFY_KINDS, *CLEAR_KINDS, RESOLVED_KIND)
MAX_HISTORY = 6
SHOWN_PASSAGES = 3  # PromptOptions.max_passages: every reading-bearing passage goes in front of this


# ---- content (package data, validated) --------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Family(_Strict):
    """A kind of question whose readings differ per domain; slots {item} {Item} {aspect} {Aspect} {value}."""

    aspect: str | None = Field(None, description="Default aspect for readings that give none.")
    label: str = Field(..., description="How a clarifying question names a reading.")
    vague: tuple[str, ...]
    pronoun: tuple[str, ...]
    fragments: tuple[str, ...]
    explicit: tuple[str, ...]
    explicit_fragments: tuple[str, ...]
    passages: tuple[str, ...]
    answers: tuple[str, ...]


class Reading(_Strict):
    item: str
    aspect: str | None
    values: tuple[str, ...] = Field(..., min_length=1)
    notes: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, v):
        if isinstance(v, (list, tuple)):
            if len(v) != 4:
                raise ValueError(f"a reading is [item, aspect|null, values, notes]; got {len(v)} entries: {v!r}")
            return dict(zip(("item", "aspect", "values", "notes"), v))
        return v


class Domain(_Strict):
    name: str
    system: str
    fillers: tuple[str, ...]
    distractors: tuple[str, ...]
    readings: dict[str, tuple[Reading, ...]]


# The cross-domain template lists under ``generic:`` (each a list of strings).
GENERIC_KEYS = ("doc_titles", "tails", "fillers", "openers", "greetings", "acks", "mention_one", "mention_two",
                "reply_one", "reply_two", "offer_two", "resolutions", "questions_two", "questions_three",
                "prefixes", "suffixes")


class Content(_Strict):
    families: dict[str, Family]
    domains: tuple[Domain, ...]
    generic: dict[str, tuple[str, ...]] = Field(..., description=f"Template lists: {', '.join(GENERIC_KEYS)}.")

    @field_validator("domains")
    @classmethod
    def _unique(cls, v):
        names = [d.name for d in v]
        if len(set(names)) != len(names):
            raise ValueError(f"domain names repeat: {names}")
        return v

    @field_validator("generic")
    @classmethod
    def _generic_keys(cls, v):
        missing, unknown = sorted(set(GENERIC_KEYS) - set(v)), sorted(set(v) - set(GENERIC_KEYS))
        if missing or unknown:
            raise ValueError(f"generic: missing {missing}, unknown {unknown}")
        return v

    @model_validator(mode="after")
    def _families_and_aspects(self) -> "Content":
        for d in self.domains:
            for fam, readings in d.readings.items():
                if fam not in self.families:
                    raise ValueError(f"domain {d.name!r}: unknown family {fam!r} (known: {sorted(self.families)})")
                if len(readings) < 2:
                    raise ValueError(f"domain {d.name!r}, family {fam!r}: needs at least 2 readings")
                for r in readings:
                    if r.aspect is None and self.families[fam].aspect is None:
                        raise ValueError(f"domain {d.name!r}, family {fam!r}, item {r.item!r}: no aspect and no family default")
        return self

    def aspect(self, family: str, r: Reading) -> str:
        return r.aspect or self.families[family].aspect or ""


@lru_cache(maxsize=1)
def content() -> Content:
    """The validated package data (``synthetic_rag_domains.yaml``)."""
    text = resources.files("clarifier.data").joinpath(CONTENT_FILE).read_text(encoding="utf-8")
    try:
        return Content.model_validate(yaml.safe_load(text))
    except ValueError as exc:
        raise ValueError(f"clarifier/data/{CONTENT_FILE}: {exc}") from exc


# ---- text helpers -------------------------------------------------------------------------------


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _fill(template: str, *, item: str = "", aspect: str = "", value: str = "") -> str:
    return (template.replace("{Item}", _cap(item)).replace("{item}", item)
            .replace("{Aspect}", _cap(aspect)).replace("{aspect}", aspect).replace("{value}", value))


_WORD = re.compile(r"[A-Za-z]{4,}")


def _typo(rng: random.Random, text: str) -> str:
    """One or two keyboard slips: a dropped or swapped letter, no apostrophes/capitals, changed '?'."""
    out = text
    for op in rng.sample(("drop", "swap", "plain", "mark"), rng.choice((1, 1, 2))):
        words = list(_WORD.finditer(out))
        if op in ("drop", "swap") and words:
            m = rng.choice(words)
            w = m.group()
            k = rng.randrange(1, len(w) - 2)
            w = w[:k] + w[k + 1:] if op == "drop" else w[:k] + w[k + 1] + w[k] + w[k + 2:]
            out = out[:m.start()] + w + out[m.end():]
        elif op == "plain":
            out = out.replace("'", "").lower()
        else:
            out = out.rstrip("?") + rng.choice(("", "??", " ?"))
    return out if out.strip() and out != text else text.rstrip("?")


def _slots(names: list[str]) -> dict[str, str]:
    """``{a}``, ``{b}``, ``{c}`` of the question and mention templates."""
    return dict(zip("abc", names))


# ---- one conversation ---------------------------------------------------------------------------


class _Conv:
    """A conversation under construction: turns, the domain's content and the rng."""

    def __init__(self, rng: random.Random, c: Content, d: Domain):
        self.rng, self.c, self.d, self.g = rng, c, d, c.generic
        self.turns: list[dict] = []
        self.long = False  # a long-history conversation (long_history_share)

    def add(self, role: str, text: str, **extra) -> int:
        self.turns.append({"role": role, "text": text, **extra})
        return len(self.turns) - 1

    # -- queries

    def surface(self, q: str, well_formed: bool) -> str:
        """Casing, a greeting prefix or a thanks suffix: the same distribution for every kind."""
        r = self.rng
        if r.random() < (0.55 if well_formed else 0.15):
            q = _cap(q)
        if r.random() < 0.18:
            q = r.choice(self.g["prefixes"]) + q[:1].lower() + q[1:]
        if r.random() < 0.08:
            q += r.choice(self.g["suffixes"])
        return q

    def query(self, fam: str, style: str, item: str = "", aspect: str = "") -> str:
        f, r = self.c.families[fam], self.rng
        if style == "explicit":
            u = r.random()
            if u < 0.25:
                return self.surface(_fill(r.choice(f.explicit_fragments), item=item, aspect=aspect), False)
            t = r.choice(f.explicit)
            if u < 0.4:  # misspelt, but never in the item's name: it still names the candidate
                t = _typo(r, t.replace("{item}", "\x00").replace("{aspect}", "\x01")).replace("\x00", "{item}").replace("\x01", "{aspect}")
            return self.surface(_fill(t, item=item, aspect=aspect), u >= 0.4)
        if style == "fragment":
            q = r.choice(f.fragments) if r.random() < 0.6 else _typo(r, r.choice(f.vague))
            return self.surface(q, False)
        return self.surface(r.choice(f.pronoun if style == "pronoun" else f.vague), True)

    # -- passages

    def reading_text(self, fam: str, reading: Reading, value: str) -> str:
        r, f = self.rng, self.c.families[fam]
        head = ""
        if r.random() < 0.35:
            t = r.choice(self.g["doc_titles"])
            head = r.choice((f"{t}: ", f"{t} - ", f"[{t}] "))
        key = _fill(r.choice(f.passages), item=reading.item, aspect=self.c.aspect(fam, reading), value=value)
        notes = list(reading.notes)
        r.shuffle(notes)
        body = [key, *notes[: r.randint(0, len(notes))], *r.sample(self.g["tails"], r.choice((0, 0, 1, 1, 2, 3, 4)))]
        return head + " ".join(body)

    def distractor_text(self, fam: str) -> str:
        """A passage that answers no reading of ``fam``: a domain notice or another family's reading."""
        r = self.rng
        others = [f for f in self.d.readings if f != fam]
        if others and r.random() < 0.5:
            of = r.choice(others)
            rd = r.choice(self.d.readings[of])
            return self.reading_text(of, rd, r.choice(rd.values))
        tails = r.sample(self.g["tails"], r.choice((0, 1)))
        return " ".join([r.choice(self.d.distractors), *tails])

    def passages(self, fam: str, carried: list[tuple[Reading, str]], dup: bool = False, n_min: int = 1,
                 n_max: int = 4) -> tuple[list[dict], list[str | None]]:
        """Passages for one turn: ``carried`` (reading, value) pairs, an optional second document on
        the first one, distractors up to ``n_min``-``n_max`` in all; reading passages within the first 3."""
        r = self.rng
        entries: list[tuple[str, str | None]] = [(self.reading_text(fam, rd, v), rd.item) for rd, v in carried]
        if dup and carried and len(entries) < SHOWN_PASSAGES:
            rd, v = carried[0]
            entries.append((self.reading_text(fam, rd, v), rd.item))
        room = n_max - len(entries)
        lo = max(0, n_min - len(entries))
        n_distract = r.choice([k for k in range(lo, room + 1) for _ in range(max(1, 3 - k))]) if room >= lo else 0
        entries += [(self.distractor_text(fam), None) for _ in range(n_distract)]
        r.shuffle(entries)
        for i in range(SHOWN_PASSAGES, len(entries)):  # readings forward into the shown places
            if entries[i][1] is not None:
                j = next(j for j in range(SHOWN_PASSAGES) if entries[j][1] is None)
                entries[i], entries[j] = entries[j], entries[i]
        seen: set[str] = set()
        kept = [e for e in entries if not (e[0] in seen or seen.add(e[0]))]  # two identical documents read as one
        return [{"id": f"p{k + 1}", "text": t} for k, (t, _) in enumerate(kept)], [it for _, it in kept]

    # -- clarifying questions and answers

    def question(self, fam: str, cands: list[Reading]) -> str:
        r, f = self.rng, self.c.families[fam]
        if r.random() < 0.5:
            names = [_fill(f.label, item=x.item, aspect=self.c.aspect(fam, x)) for x in cands]
        else:
            names = [x.item for x in cands]
        t = r.choice(self.g["questions_two"] if len(names) == 2 else self.g["questions_three"])
        return t.format(**_slots(names))

    def answer(self, fam: str, reading: Reading, value: str) -> str:
        t = self.rng.choice(self.c.families[fam].answers)
        return _cap(_fill(t, item=reading.item, aspect=self.c.aspect(fam, reading), value=value))


def _words(readings) -> set[str]:
    return {w.lower() for x in readings for w in _WORD.findall(x.item)}


def _labelled(cv: _Conv, text: str, kind: str, fam: str, cands: list[Reading], passages, items,
              clarify: bool, question: str | None = None) -> int:
    names = [x.item for x in cands]
    label: dict = {"needs_clarification": clarify, "clarifying_question": question,
                   "grounding_turns": [], "grounding_passages": []}
    if clarify:
        label["grounding_turns"] = [i for i, t in enumerate(cv.turns)
                                    if t["role"] != "system" and any(n.lower() in t["text"].lower() for n in names)]
        label["grounding_passages"] = [p["id"] for p, it in zip(passages, items) if it in names]
    meta = {"kind": kind, "family": fam, "candidates": names, "passage_items": items}
    return cv.add("user", text, label=label, passages=passages, meta=meta)


def _other_family(cv: _Conv, fam: str) -> str | None:
    """A family of the domain whose items share no word with ``fam``'s (so that talking about it
    never names, or hints at, a candidate of ``fam``); None when there is none."""
    taken = _words(cv.d.readings[fam])
    fams = [f for f in cv.d.readings if f != fam and not (_words(cv.d.readings[f]) & taken)]
    return cv.rng.choice(fams) if fams else None


def _prior_exchange(cv: _Conv, fam: str) -> bool:
    """An earlier ambiguous turn of another family, the clarifying question, the reply naming one
    reading (labelled ``rag_resolved``) and the answer. False when no family fits."""
    r, d = cv.rng, cv.d
    f2 = _other_family(cv, fam)
    if f2 is None:
        return False
    pair = r.sample(list(d.readings[f2]), 2)
    values = {x.item: r.choice(x.values) for x in pair}
    ps, items = cv.passages(f2, [(x, values[x.item]) for x in pair], n_max=3)
    q = cv.question(f2, pair)
    style = r.choice(("vague", "vague", "fragment"))
    kind = "rag_ambiguous" if style == "vague" else "rag_illformed_multi"
    _labelled(cv, cv.query(f2, style), kind, f2, pair, ps, items, True, q)
    cv.add("assistant", q)
    chosen = r.choice(pair)
    carried = [(chosen, values[chosen.item])] + ([(x, values[x.item]) for x in pair if x is not chosen] if r.random() < 0.4 else [])
    ps2, items2 = cv.passages(f2, carried, n_max=3)
    reply = r.choice(cv.g["resolutions"]).replace("{A}", _cap(chosen.item)).replace("{a}", chosen.item)
    _labelled(cv, reply, RESOLVED_KIND, f2, [chosen], ps2, items2, False)
    cv.add("assistant", cv.answer(f2, chosen, values[chosen.item]))
    return True


def _prior_qa(cv: _Conv, fam: str) -> bool:
    """An answered explicit question about another family (unlabelled history)."""
    r, d = cv.rng, cv.d
    f2 = _other_family(cv, fam)
    if f2 is None:
        return False
    x = r.choice(d.readings[f2])
    v = r.choice(x.values)
    cv.add("user", cv.surface(_fill(r.choice(cv.c.families[f2].explicit), item=x.item, aspect=cv.c.aspect(f2, x)), True))
    answer = cv.answer(f2, x, v)
    if cv.long:  # answers as long as real assistants' (the reading's notes, a closing sentence)
        answer = " ".join([answer, *x.notes] + ([r.choice(cv.g["tails"])] if r.random() < 0.5 else []))
    cv.add("assistant", answer)
    return True


# History lengths the neutral part aims at. An earlier ambiguous/resolved exchange puts a clarify
# turn at history 0-1, so the clear kinds without named candidates start empty more often: the
# history-length distributions of the two labels then match (tests/unit/test_synthetic_rag.py).
_TARGETS = (0, 0, 1, 2, 2, 3, 4, 4, 5, 6)
_TARGETS_CLEAR = (0, 0, 0, 0, 1, 2, 2, 3, 4, 4, 5, 6)
# long_history_share: conversations of 8-16 turns before the final query, both labels alike, whose answered
# questions carry the reading's notes (real assistants' answers are long): a model must not learn "a long
# conversation needs a question" (benchmarks/recipe/probes.py measures it).
_TARGETS_LONG = (8, 9, 10, 11, 12, 13, 14, 15, 16)


def _history(cv: _Conv, fam: str, mention: list[Reading], assistant_offers: bool, targets=_TARGETS) -> int:
    """Neutral turns, then (when ``mention``) the turns naming the candidates; returns how many
    labelled turns the history holds (an ambiguous/resolved pair adds 2)."""
    r, g = cv.rng, cv.g
    if r.random() < 0.2:
        cv.add("system", cv.d.system)
    need = 2 if mention else 0
    target = max(need + len(cv.turns), r.choice(targets))
    labelled = 0
    first = True
    while target - len(cv.turns) - need >= 2:
        room = target - len(cv.turns) - need
        u = r.random()
        if first and u < 0.3:
            cv.add("user", r.choice(g["openers"]))
            cv.add("assistant", r.choice(g["greetings"]))
        elif room >= 4 and u < 0.55 and labelled == 0 and _prior_exchange(cv, fam):
            labelled += 2
        elif u < (0.9 if cv.long else 0.75) and _prior_qa(cv, fam):
            pass
        else:
            cv.add("user", r.choice((*cv.d.fillers, *g["fillers"])))
            cv.add("assistant", r.choice(g["acks"]))
        first = False
    names = _slots([x.item for x in mention])
    if len(mention) == 1:
        cv.add("user", r.choice(g["mention_one"]).format(**names))
        cv.add("assistant", r.choice(g["reply_one"]).format(**names))
    elif mention and assistant_offers:
        cv.add("user", r.choice(g["openers"]))
        cv.add("assistant", r.choice(g["offer_two"]).format(**names))
    elif mention:
        cv.add("user", r.choice(g["mention_two"]).format(**names))
        cv.add("assistant", r.choice(g["reply_two"]).format(**names))
    return labelled


def _conversation(rng: random.Random, conv_id: str, seed: int, counts: dict[str, list[int]],
                  long_history_share: float = 0.0) -> dict:
    c = content()
    d = rng.choice(c.domains)
    bal = counts.setdefault(d.name, [0, 0])  # [clarify, clear] labelled turns so far
    clarify = bal[0] < bal[1] or (bal[0] == bal[1] and rng.random() < 0.5)
    table = CLARIFY_KINDS if clarify else CLEAR_KINDS
    kind = rng.choices(list(table), weights=list(table.values()))[0]
    fam = rng.choice(list(d.readings))
    pool = list(d.readings[fam])
    cv = _Conv(rng, c, d)
    cv.long = long_history_share > 0 and rng.random() < long_history_share  # no draw at 0: default logs unchanged
    u = rng.random()

    # who the candidates are, what the history names, which readings the passages carry, the query style
    if kind in ("rag_ambiguous", "rag_illformed_multi"):
        cands = rng.sample(pool, 3 if rng.random() < 0.2 and len(pool) >= 3 else 2)
        mention = cands[:2] if kind == "rag_illformed_multi" and len(cands) == 2 and u < 0.3 else []
        carried, style = cands, "vague" if kind == "rag_ambiguous" else "fragment"
    elif kind == "rag_ambiguous_history":
        cands = rng.sample(pool, 2)
        mention = cands
        carried = cands if u < 0.4 else cands[:1] if u < 0.85 else []
        style = "vague" if rng.random() < 0.6 else "pronoun"
    else:
        cands = [rng.choice(pool)]
        others = [x for x in pool if x is not cands[0]]
        extra = rng.sample(others, rng.choice((1, 1, 2)))
        if kind in ("rag_settled", "rag_illformed_single"):
            mention = cands if kind == "rag_settled" and u < 0.2 else []
            carried = cands
            style = "vague" if kind == "rag_settled" else "fragment"
            if mention and rng.random() < 0.5:
                style = "pronoun"
        elif kind in ("rag_history_resolved", "rag_short_in_context"):
            mention = cands
            carried = (cands + extra) if u < 0.8 else rng.sample(others, 2)
            style = "fragment" if kind == "rag_short_in_context" else "vague" if rng.random() < 0.6 else "pronoun"
        else:  # rag_explicit
            mention = [cands[0], extra[0]] if u < 0.3 else []
            carried = cands + extra
            style = "explicit"
        rng.shuffle(carried)

    targets = _TARGETS_LONG if cv.long else _TARGETS_CLEAR if not clarify and not mention else _TARGETS
    labelled = _history(cv, fam, mention, assistant_offers=rng.random() < 0.35, targets=targets)
    values = [(x, rng.choice(x.values)) for x in carried]
    single = not clarify and len(carried) == 1  # one reading: often a second document or a distractor
    ps, items = cv.passages(fam, values, dup=single and rng.random() < 0.45, n_min=2 if single and rng.random() < 0.6 else 1)
    target = cands[0]
    text = cv.query(fam, style, item=target.item, aspect=c.aspect(fam, target))
    q = cv.question(fam, cands) if clarify else None
    _labelled(cv, text, kind, fam, cands, ps, items, clarify, q)
    bal[0] += (1 if clarify else 0) + labelled // 2
    bal[1] += (0 if clarify else 1) + labelled // 2
    meta = {"source": SOURCE, "seed": seed, **({"long_history": True} if cv.long else {})}
    return {"conversation_id": conv_id, "domain": d.name, "turns": cv.turns, "meta": meta}


def generate_conversations(n: int, seed: int = 0, long_history_share: float = 0.0) -> list[dict]:
    """``n`` synthetic RAG ConversationLog dicts, deterministic for ``seed``; ``long_history_share`` of them
    with 8-16 turns before the final query (``meta.long_history``; 0 gives the default logs unchanged)."""
    if not 0.0 <= long_history_share <= 1.0:
        raise ValueError(f"long_history_share must be between 0 and 1; got {long_history_share!r}")
    rng = random.Random(seed)
    counts: dict[str, list[int]] = {}
    return [_conversation(rng, f"rag-{seed}-{i:05d}", seed, counts, long_history_share) for i in range(n)]


def write_logs(out_uri: str, n: int, seed: int = 0, shards: int = 4, long_history_share: float = 0.0) -> list[str]:
    """Write ``n`` conversations as JSONL shards ``conversations-<k>.jsonl`` under ``out_uri``."""
    from clarifier.runtime.storage import join, write_text

    convs = generate_conversations(n, seed, long_history_share)
    k = max(1, min(shards, n))
    uris = [join(out_uri, f"conversations-{s:05d}.jsonl") for s in range(k)]
    for s, uri in enumerate(uris):
        write_text(uri, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in convs[s::k]))
    return uris
