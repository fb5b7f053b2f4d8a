"""Baselines every evaluation report carries: always-ask, never-ask and a lexical heuristic.

Pure Python (no Ray, MLflow or torch). The zero-shot base-model baseline needs a model and lives in
``evaluate.py``.

**The lexical heuristic** (``lexical``) asks for clarification when

1. *ambiguous reference*: the query has an unresolved pronoun or deictic (``it``, ``this``,
   ``that one``, ``them``, ...) **or** is very short (at most ``SHORT_QUERY_WORDS`` words, e.g.
   ``"reset??"``), **and** the history names two or more candidate entities, **and** the query does
   not itself name one of them; or
2. *underspecified*: the query is very short and the history names no candidate at all (nothing it
   could be resolved against, e.g. a one-word single-turn request).

Candidate entities are noun phrases *introduced* by an indefinite or possessive determiner
(``a``/``an``/``my``/``our``) in user turns, or in assistant turns that list two or more of them
(``"I see a checking and a savings account"``; a lone suggestion like ``"try a restart"`` is not
a candidate; system turns are ignored): up to three
following words, stopping at a function word or punctuation, keyed by their last two words
(``"a student checking account"`` -> ``checking account``). Later definite mentions (``the``/
``your`` + phrase) only add grounding turns. Generic nouns (``question``, ``problem``, ``update``,
``daughter``, ...) are not candidates, and two phrases with the same head noun are one candidate
unless both carry different modifiers (``checking account`` vs ``savings account`` are two;
``Saturday ferry`` and ``ferry`` are one).

Its question is a template: ``"Do you mean the A or the B?"`` over the candidates in order of first
mention (``"the A, the B or the C"`` for three or more), or ``'Could you tell me more about what you
mean by "<query>"?'`` when underspecified. Its grounding is the history turns that name a
candidate. Its confidence is graded (>= 0.5 exactly when it asks) so AUROC and the plots are
meaningful.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from clarifier.core.metrics import Prediction

SHORT_QUERY_WORDS = 3

PRONOUNS = frozenset({"it", "its", "itself", "this", "that", "these", "those", "they", "them", "their", "one", "ones"})
INTRODUCERS = frozenset({"a", "an", "my", "our"})
DETERMINERS = INTRODUCERS | {"the", "your"}
# Words that end a noun phrase (function words, common verbs/auxiliaries).
STOP = frozenset("""
a an the my your our his her their its this that these those it they them we you i me us he she
and or but nor so yet if then than as of to in on at by for from with about into onto over under
after before since until via per is are was were be been being am do does did done have has had
having can could will would shall should may might must not no too very also just still again
already please which what who whom whose when where why how there here some any all each every
both either neither other another such own same few more most much many once twice
keeps keep works work shows show says seems needs looks makes gets goes runs includes helps lists blinks
drops stops won't doesn't don't can't isn't wasn't didn't
""".split())
GENERIC = frozenset("""
question questions problem problems issue issues thing things detail details update updates profile
site website app help moment time times day days week weeks month months year years number name
way option options information info matter end start assistant system fee fees rate status
salary daughter son kids children partner wife husband family job jobs work plans setup file
membership receipt confirmation booking bookings reservation reservations cycle lot bit
""".split())

_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'\-]*|[.,;:!?()]")


def _tokens(text: str) -> list[str]:
    return [t.lower() for t in _WORD.findall(text or "")]


def _words(text: str) -> list[str]:
    return [t for t in _tokens(text) if t[0].isalnum()]


@dataclass(frozen=True)
class Candidate:
    key: str  # "checking account"
    head: str  # "account"
    modifier: str | None  # "checking"
    turns: tuple[int, ...]  # history turns that name it


def noun_phrases(text: str, determiners: frozenset = INTRODUCERS) -> list[tuple[str | None, str]]:
    """``(modifier, head)`` of each noun phrase after one of ``determiners`` in ``text`` (lowercased)."""
    toks = _tokens(text)
    out = []
    for i, t in enumerate(toks):
        if t not in determiners:
            continue
        words = []
        for w in toks[i + 1 : i + 4]:
            if not w[0].isalnum() or w in STOP:
                break
            words.append(w)
        while words and words[-1].endswith(("ing", "ed", "ly")):  # "my employer added", "a tour using"
            words.pop()
        if not words or words[-1] in GENERIC or words[-1].isdigit():
            continue
        head = words[-1]
        modifier = words[-2] if len(words) >= 2 and words[-2] not in GENERIC else None
        out.append((modifier, head))
    return out


def candidate_entities(history: Sequence) -> list[Candidate]:
    """Distinct candidate entities named in user/assistant turns of ``history``, in order of first mention."""
    found: dict[tuple[str, str | None], list[int]] = {}
    for idx, turn in enumerate(history):
        if getattr(turn, "role", "user") == "system":
            continue
        phrases = noun_phrases(getattr(turn, "text", ""))
        if getattr(turn, "role", "user") == "assistant" and len(phrases) < 2:
            continue  # an assistant introduces candidates only by listing them ("a X and a Y")
        for modifier, head in phrases:
            found.setdefault((head, modifier), [])
            if idx not in found[(head, modifier)]:
                found[(head, modifier)].append(idx)
    # Merge phrases with the same head unless both have (different) modifiers.
    merged: list[list] = []  # [head, modifier, turns]
    for (head, modifier), turns in found.items():
        target = None
        for m in merged:
            if m[0] == head and (m[1] is None or modifier is None or m[1] == modifier):
                target = m
                break
        if target is None:
            merged.append([head, modifier, list(turns)])
        else:
            if target[1] is None:
                target[1] = modifier
            target[2] = sorted(set(target[2]) | set(turns))
    # Definite mentions ("the router") of an introduced candidate add its grounding turns.
    for idx, turn in enumerate(history):
        if getattr(turn, "role", "user") == "system":
            continue
        for modifier, head in noun_phrases(getattr(turn, "text", ""), DETERMINERS):
            same = [m for m in merged if m[0] == head]
            hit = [m for m in same if modifier is not None and m[1] == modifier] or (same if len(same) == 1 else [])
            for m in hit:
                if idx not in m[2]:
                    m[2] = sorted(m[2] + [idx])
    return [Candidate(key=f"{mod} {head}" if mod else head, head=head, modifier=mod, turns=tuple(turns))
            for head, mod, turns in merged]


@dataclass(frozen=True)
class LexicalDecision:
    clarify: bool
    confidence: float
    reason: str  # "ambiguous_reference" | "underspecified" | "resolved" | "single_candidate" | "clear"
    candidates: tuple[str, ...]
    grounding_turns: tuple[int, ...]
    question: str | None


def _names(query_words: set[str], cand: Candidate, cands: Sequence[Candidate]) -> bool:
    if cand.head not in query_words:
        return False
    same_head = [c for c in cands if c.head == cand.head]
    return len(same_head) == 1 or cand.modifier is None or cand.modifier in query_words


def _join(keys: Sequence[str]) -> str:
    keys = [f"the {k}" for k in keys]
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " or " + keys[-1]


def lexical_decision(history: Sequence, query: str) -> LexicalDecision:
    """The lexical heuristic's decision, question and grounding for one turn (see module docstring)."""
    words = _words(query)
    qset = set(words)
    deictic = bool(qset & PRONOUNS)
    short = len(words) <= SHORT_QUERY_WORDS
    cands = candidate_entities(history)
    keys = tuple(c.key for c in cands)
    if len(cands) >= 2:
        named = any(_names(qset, c, cands) for c in cands)
        if (deictic or short) and not named:
            conf = min(0.6 + 0.1 * (len(cands) - 2) + (0.1 if deictic and short else 0.0), 0.95)
            turns = tuple(sorted({t for c in cands for t in c.turns}))
            return LexicalDecision(True, conf, "ambiguous_reference", keys, turns,
                                   f"Do you mean {_join(keys[:4])}?")
        return LexicalDecision(False, 0.4 if (deictic or short) else 0.15, "resolved" if named else "clear", keys, (), None)
    if not cands and short:
        return LexicalDecision(True, 0.55, "underspecified", keys, (),
                               f'Could you tell me more about what you mean by "{query.strip()}"?')
    return LexicalDecision(False, 0.25 if (deictic or short) else 0.05,
                           "single_candidate" if cands else "clear", keys, (), None)


def lexical_predictions(examples: Sequence) -> list[Prediction]:
    out = []
    for ex in examples:
        d = lexical_decision(ex.history, ex.query)
        out.append(Prediction(needs_clarification=d.clarify, confidence=d.confidence, question=d.question,
                              grounding_turns=d.grounding_turns if d.clarify else ()))
    return out


BASELINES = ("always_ask", "never_ask", "lexical")


def baseline_predictions(name: str, examples: Sequence) -> list[Prediction]:
    """Predictions of a model-free baseline: ``always_ask``, ``never_ask`` or ``lexical``."""
    if name == "always_ask":
        return [Prediction(needs_clarification=True, confidence=1.0) for _ in examples]
    if name == "never_ask":
        return [Prediction(needs_clarification=False, confidence=0.0) for _ in examples]
    if name == "lexical":
        return lexical_predictions(examples)
    raise ValueError(f"unknown baseline {name!r} (known: {', '.join(BASELINES)}, base_model)")


def source_only_predictions(train: Sequence, calibration: Sequence, examples: Sequence,
                            max_over_asking: float | None) -> tuple[list[Prediction], float]:
    """The *source-only control*: P(clarify) = the clarify share of the example's source in ``train``,
    thresholded on ``calibration`` by the models' own rule (``eval.max_over_asking``). It knows which
    dataset a turn came from and nothing else, so on a mixed set it shows how much of a model's
    figure source identity alone can reach; inside one source it is at chance.
    Returns ``(predictions, threshold)``."""
    from clarifier.core.metrics import source_only_scores
    from clarifier.core.schema import source_of
    from clarifier.train.calibrate import choose_threshold

    ts, tg = [source_of(e) for e in train], [bool(e.needs_clarification) for e in train]
    cal_gold = [bool(e.needs_clarification) for e in calibration]
    thr = 0.5
    if len(set(cal_gold)) == 2:
        thr, _ = choose_threshold(cal_gold, source_only_scores(ts, tg, [source_of(e) for e in calibration]),
                                  max_over_asking)
    scores = source_only_scores(ts, tg, [source_of(e) for e in examples])
    return [Prediction(needs_clarification=sc >= thr, confidence=sc) for sc in scores], thr


def surface_control_predictions(train: Sequence, calibration: Sequence, examples: Sequence,
                                max_over_asking: float | None) -> tuple[list[Prediction], dict]:
    """The *surface control* (:mod:`clarifier.core.surface`): a logistic regression on position and length only,
    fitted on ``train`` (per source where a source has the turns), thresholded on ``calibration`` (else ``train``)
    by the models' own rule. With no ``train`` turns of both classes it is cross-fitted on ``examples`` themselves
    (5 folds by conversation, the threshold on those out-of-fold scores). Returns ``(predictions, how it was
    fitted)``."""
    from clarifier.core.schema import source_of
    from clarifier.core.surface import cross_fitted_scores, fit_surface_control
    from clarifier.train.calibrate import choose_threshold

    sources = [source_of(e) for e in examples]
    if len({bool(e.needs_clarification) for e in train}) == 2:
        ctl = fit_surface_control(train, [bool(e.needs_clarification) for e in train], [source_of(e) for e in train])
        scores = ctl.scores(examples, sources)
        ref, ref_name = (calibration, "calibration") if calibration else (train, "train")
        thr, rule = choose_threshold([bool(e.needs_clarification) for e in ref],
                                     ctl.scores(ref, [source_of(e) for e in ref]), max_over_asking)
        info = {"fitted_on": f"the train split ({len(train)} turns)", "threshold": thr,
                "threshold_from": f"the {ref_name} split ({rule})", **ctl.info}
    else:
        gold = [bool(e.needs_clarification) for e in examples]
        scores = cross_fitted_scores(examples, gold, sources, [str(e.conversation_id) for e in examples])
        thr, rule = choose_threshold(gold, scores, max_over_asking)
        info = {"fitted_on": "the evaluation set itself, out of fold (5 folds by conversation; no training turns "
                             "given)", "threshold": thr, "threshold_from": f"the same out-of-fold scores ({rule})"}
    return [Prediction(needs_clarification=sc >= thr, confidence=sc) for sc in scores], info
