"""Abg-CoQA (Guo et al., AKBC 2021): ``coqa_abg_val.json`` (and ``coqa_abg_train.json`` / ``_test`` if present).

Published format: ``{"version", "data": [...]}``; each item is a CoQA conversation cut at a target
turn: ``id`` (``<coqa story id>|<turn>|<n>``), ``story``, ``history_turns`` (the preceding
question/answer turns), ``target_turn`` (``question``, ``answer``, ...), ``ambiguity``
(``ambiguous`` / ``non_ambiguous``), ``clarification_turn`` (on ambiguous items: ``question`` and
the possible ``answers``), optionally ``clarification_turn_2`` (a second annotator's question).

Mapping (one **record = one item** -> one Example):

* ``id`` = ``abgcoqa-<id>``; ``query`` = ``target_turn.question``; ``history`` = for each of
  ``history_turns`` in order: ``user`` question, ``assistant`` answer.
* ``needs_clarification`` = ``ambiguity == "ambiguous"``; ``clarifying_question`` =
  ``clarification_turn.question``; ``clarification_turn_2.question`` (when present) goes to
  ``meta.alternative_questions`` (a second reference).
* ``grounding_turns`` = [] (not annotated).
* ``passages`` (option ``passages``, default true): the story as passage ``story``;
  ``grounding_passages`` = [].
* ``meta``: ``dataset``, ``split``, ``source_file``, ``index`` (position in ``data``),
  ``original_id``, ``conversation_id`` (= ``abgcoqa-<coqa story id>``, shared by every item cut
  from the same CoQA conversation, so the data job keeps them in one split), ``source`` (the CoQA
  domain), ``target_turn_id``, ``answer`` (the gold answer of the target turn),
  ``history_turn_ids``.

Skip reasons: ``malformed_item`` (not an object / no target question), ``unknown_ambiguity``
(label not ambiguous / non_ambiguous), ``clarification_without_question`` (ambiguous but no
clarifying question), ``invalid_example``. The JSON document is loaded whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from clarifier.core.schema import Example, Passage, Turn
from clarifier.data.importers.base import Importer, ImporterOptions, Skipped, load_json, make_example, one_line, split_files

DATASET = "abgcoqa"
SPLIT_FILES = {"train": "coqa_abg_train.json", "val": "coqa_abg_val.json", "test": "coqa_abg_test.json"}
LABELS = {"ambiguous": True, "non_ambiguous": False}


class AbgCoQAOptions(ImporterOptions):
    splits: list[str] | None = None  # default: every one of train/val/test that is present
    passages: bool = True


def _item(split: str, fname: str, k: int, it: Any, opts: AbgCoQAOptions) -> Example | Skipped:
    where = f"{fname}:data[{k}]"
    target = it.get("target_turn") if isinstance(it, dict) else None
    if not isinstance(target, dict) or not one_line(target.get("question", "")):
        return Skipped("malformed_item", where, "no target_turn.question")
    oid = str(it.get("id") or f"{split}-{k}")
    where = f"{where} (id {oid})"
    amb = it.get("ambiguity")
    if amb not in LABELS:
        return Skipped("unknown_ambiguity", where, f"ambiguity {amb!r} is not one of {', '.join(LABELS)}")
    clarify = LABELS[amb]
    question = None
    if clarify:
        question = one_line((it.get("clarification_turn") or {}).get("question") or "")
        if not question:
            return Skipped("clarification_without_question", where, "ambiguous but clarification_turn has no question")
    history: list[Turn] = []
    turn_ids = []
    for h in it.get("history_turns") or []:
        if not isinstance(h, dict):
            return Skipped("malformed_item", where, "a history turn is not an object")
        history += [Turn(role="user", text=str(h.get("question", ""))), Turn(role="assistant", text=str(h.get("answer", "")))]
        turn_ids.append(h.get("turn_id"))
    alt = one_line((it.get("clarification_turn_2") or {}).get("question") or "")
    meta = {
        "dataset": DATASET, "split": split, "source_file": fname, "index": k, "original_id": oid,
        "conversation_id": f"{DATASET}-{oid.split('|')[0]}", "source": it.get("source"),
        "target_turn_id": target.get("turn_id"), "answer": target.get("answer"), "history_turn_ids": turn_ids,
    }
    if alt:
        meta["alternative_questions"] = [alt]
    story = str(it.get("story") or "")
    passages = [Passage(id="story", text=story)] if opts.passages and story.strip() else []
    return make_example(where, id=f"{DATASET}-{oid}", history=history, query=str(target["question"]),
                        needs_clarification=clarify, clarifying_question=question, passages=passages, meta=meta)


def run(src: Path, opts: AbgCoQAOptions) -> Iterator[Example | Skipped]:
    files = split_files(src, DATASET, SPLIT_FILES, opts.splits, "coqa_abg_*.json")

    def gen():
        for split, path in files:
            doc = load_json(path)
            data = doc.get("data") if isinstance(doc, dict) else None
            if not isinstance(data, list):
                raise ValueError(f"{path}: expected an object with a 'data' list")
            for k, it in enumerate(data):
                yield _item(split, path.name, k, it, opts)

    return gen()


IMPORTER = Importer(name=DATASET, options=AbgCoQAOptions, run=run, unit="item",
                    description="Abg-CoQA: one example per item (ambiguous -> clarify)")
