"""ClariQ (ConvAI3; Aliannejadi et al., 2020): ``train.tsv`` / ``dev.tsv`` (+ ``question_bank.tsv``).

Published format: one TSV row per (topic, facet, clarifying question) with the columns
``topic_id, initial_request, topic_desc, clarification_need, facet_id, facet_desc, question_id,
question, answer``. ``clarification_need`` (1..4) is a property of the topic; the questions listed
under a topic are the ones annotated as relevant to it; ``Q00001`` is the reserved "ask no
question" entry (empty text).

Mapping (one **record = one topic** -> one single-turn Example):

* ``id`` = ``clariq-<split>-<topic_id>``; ``query`` = ``initial_request``; ``history`` = [];
  ``grounding_turns`` = [] (single turn); ``passages`` = [] (ClueWeb documents are not included).
* ``needs_clarification`` from ``clarification_need``: **1 -> false; 3, 4 -> true; 2 -> option
  ``need_2``** = ``clarify`` (default: the ClariQ README defines 2 as "clarification is still
  needed but not as much as label 4") | ``answer`` | ``skip`` (the topic is skipped with reason
  ``need_2_skipped``, for a binary set without the borderline level).
* ``clarifying_question`` (only when clarifying): one of the topic's non-empty questions, chosen
  deterministically by option ``question``: ``first`` (default: the first one in file order,
  i.e. the annotation order of the topic's first facet) or ``lowest_id`` (the smallest
  ``question_id``, independent of row order). Question text is whitespace-normalised. (Counting
  facets does not discriminate: in the published files every question of a topic is listed under
  each of its facets.)
  All of the topic's distinct questions (same order) are kept in ``meta.candidate_questions``
  (multi-reference metrics), with their ids in ``meta.candidate_question_ids``.
* ``meta``: ``dataset``, ``split``, ``source_file``, ``lines`` (1-based first/last TSV line of the
  topic), ``topic_id``, ``conversation_id`` (= ``clariq-<topic_id>``), ``clarification_need``,
  ``topic_desc`` (its published ``\\'`` / ``\\"`` escapes undone), ``facet_ids``, ``question_id`` (of the chosen question).

Skip reasons: ``malformed_row`` (wrong number of columns, empty topic id or non-integer need: one
skip per row), ``inconsistent_topic`` (a topic whose rows disagree on request or need),
``need_2_skipped``, ``no_question`` (clarification needed but only empty / ``Q00001`` questions),
``no_labels`` (a file without ``clarification_need``, e.g. ``test.tsv``: one skip per topic),
``invalid_example``. ``question_bank.tsv``, when present, fills in a question whose row text is
empty but whose id is in the bank. A TSV file's rows are read whole (they are grouped by topic).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterator, Literal

from clarifier.core.schema import Example
from clarifier.data.importers.base import Importer, ImporterOptions, Skipped, make_example, one_line, require_dir

DATASET = "clariq"
COLUMNS = ["topic_id", "initial_request", "topic_desc", "clarification_need", "facet_id", "facet_desc",
           "question_id", "question", "answer"]
NO_QUESTION_ID = "Q00001"


class ClariQOptions(ImporterOptions):
    splits: list[str] = ["train", "dev"]
    need_2: Literal["clarify", "answer", "skip"] = "clarify"
    question: Literal["first", "lowest_id"] = "first"


def _read_tsv(path: Path) -> tuple[list[str], list[tuple[int, list[str]]]]:
    csv.field_size_limit(1 << 24)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file (expected a TSV header)")
        rows = []
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                break
            rows.append((start, row))
        return header, rows


def _question_bank(src: Path) -> dict[str, str]:
    path = src / "question_bank.tsv"
    if not path.is_file():
        return {}
    header, rows = _read_tsv(path)
    if header[:2] != ["question_id", "question"]:
        raise ValueError(f"{path}: header must start with question_id, question (got {header[:2]})")
    return {r[0]: one_line(r[1]) for _, r in rows if len(r) >= 2}


def _unescape(text: str) -> str:
    """``topic_desc`` is published with backslash-escaped quotes (``Obama\\'s``); undo that."""
    return text.replace("\\'", "'").replace('\\"', '"')


def _choose(cands: list[tuple[str, str]], strategy: str) -> tuple[str, str]:
    """``cands``: (question_id, text) in file order."""
    return min(cands) if strategy == "lowest_id" else cands[0]


def _topic(split: str, fname: str, rows: list[tuple[int, dict]], opts: ClariQOptions, bank: dict[str, str],
           has_need: bool) -> Example | Skipped:
    first_line, first = rows[0]
    tid = first["topic_id"]
    where = f"{fname}:{first_line} (topic {tid})"
    if not has_need:
        return Skipped("no_labels", where, "file has no clarification_need column")
    if len({r["initial_request"] for _, r in rows}) > 1 or len({r["clarification_need"] for _, r in rows}) > 1:
        return Skipped("inconsistent_topic", where, "rows of the topic differ in initial_request or clarification_need")
    need = int(first["clarification_need"])
    if need == 2 and opts.need_2 == "skip":
        return Skipped("need_2_skipped", where, "clarification_need=2 and need_2=skip")
    clarify = need >= 3 or (need == 2 and opts.need_2 == "clarify")
    facets: dict[str, None] = {}
    cand_text: dict[str, str] = {}
    for _, r in rows:
        facets[r["facet_id"]] = None
        qid = r["question_id"]
        text = one_line(r["question"]) or bank.get(qid, "")
        if qid == NO_QUESTION_ID or not text:
            continue
        cand_text.setdefault(qid, text)
    cands = list(cand_text.items())
    question = qid = None
    if clarify:
        if not cands:
            return Skipped("no_question", where, f"clarification_need={need} but no non-empty question")
        qid, question = _choose(cands, opts.question)
    meta = {
        "dataset": DATASET, "split": split, "source_file": fname, "lines": [first_line, rows[-1][0]],
        "topic_id": tid, "conversation_id": f"{DATASET}-{tid}", "clarification_need": need,
        "topic_desc": _unescape(first["topic_desc"]), "facet_ids": list(facets), "question_id": qid,
        "question_strategy": opts.question, "candidate_question_ids": [c[0] for c in cands],
        "candidate_questions": [c[1] for c in cands],
    }
    return make_example(where, id=f"{DATASET}-{split}-{tid}", history=[], query=first["initial_request"],
                        needs_clarification=clarify, clarifying_question=question, meta=meta)


def _split(src: Path, split: str, opts: ClariQOptions, bank: dict[str, str]) -> Iterator[Example | Skipped]:
    path = src / f"{split}.tsv"
    fname = path.name
    header, raw_rows = _read_tsv(path)
    needed = ["topic_id", "initial_request"]
    missing = [c for c in needed if c not in header]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing} (header: {header})")
    has_need = "clarification_need" in header
    if has_need:
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing} (header: {header})")
    topics: dict[str, list[tuple[int, dict]]] = {}
    for line, row in raw_rows:
        if len(row) != len(header):
            yield Skipped("malformed_row", f"{fname}:{line}", f"{len(row)} columns, header has {len(header)}")
            continue
        r = dict(zip(header, row))
        if not r["topic_id"].strip():
            yield Skipped("malformed_row", f"{fname}:{line}", "empty topic_id")
            continue
        if has_need and r["clarification_need"].strip() not in {"1", "2", "3", "4"}:
            yield Skipped("malformed_row", f"{fname}:{line}", f"clarification_need {r['clarification_need']!r} is not 1..4")
            continue
        if not has_need:
            r.setdefault("topic_desc", "")
        topics.setdefault(r["topic_id"].strip(), []).append((line, r))
    for rows in topics.values():
        yield _topic(split, fname, rows, opts, bank, has_need)


def run(src: Path, opts: ClariQOptions) -> Iterator[Example | Skipped]:
    src = require_dir(src, DATASET)
    missing = [s for s in opts.splits if not (src / f"{s}.tsv").is_file()]
    if missing:
        have = sorted(p.stem for p in src.glob("*.tsv") if p.name != "question_bank.tsv")
        raise FileNotFoundError(f"{DATASET}: no {', '.join(s + '.tsv' for s in missing)} in {src} "
                                f"(have: {', '.join(have) or 'none'}; set option splits=...)")
    bank = _question_bank(src)

    def gen():
        for split in opts.splits:
            yield from _split(src, split, opts, bank)

    return gen()


IMPORTER = Importer(name=DATASET, options=ClariQOptions, run=run, unit="topic",
                    description="ClariQ train/dev TSV: one single-turn example per topic")
