"""CLAQUA (Xu et al., EMNLP 2019): clarification in KBQA, ``data/{single-turn,multi-turn}/task{1,2}/``.

Published format (per variant ``single-turn`` / ``multi-turn`` and split):

* task 1 (clarification identification), ``task1/<split>_classifier.txt``: JSON lines
  ``{"context", "entity1", "entity2", "label"}``; ``label`` "1" = the question needs clarification
  (it is ambiguous between the two entities), "0" = it does not.
* task 2 (clarification generation), ``task2/src-<s>.txt`` + ``task2/tgt-<s>.txt`` (``<s>`` is
  ``val`` for the dev split), aligned line by line; every pair needs clarification. ``src`` is
  ``context <SP> entity1 <SP> entity2``, ``tgt`` a question template with one ``<e>`` per entity
  and the entity phrases after ``<TSP>``: ``Which one do you mean, <e> or <e>, when you say the
  parents? <TSP> film character John <TSP> tv character John``.
* ``context`` is the question (single-turn) or ``Q1 <EOS> A1 <EOS> Q2`` (multi-turn); an entity is
  ``name <S> freebase types <S> description``.

Mapping (one **record = one decision point**: a task-1 line, or a task-2 pair no task-1 line
covers):

* ``query`` = the last ``<EOS>`` part of the context; ``history`` = the earlier parts, alternately
  ``user`` / ``assistant`` (multi-turn), [] for single-turn.
* task-1 label "0" -> ``needs_clarification`` false. Label "1" -> true, with the question of the
  task-2 pair of the same split that has the same context and entities (the published dev files
  pair up exactly: every dev positive has its task-2 ``val`` line); a positive without one is
  skipped (``no_question``: task 1 carries no question). A task-2 pair that no task-1 line covers
  (e.g. the task-2 ``train`` files, which have no task-1 counterpart here) is a positive of its own.
* ``clarifying_question`` = the ``tgt`` template with each ``<e>`` replaced, in order, by the
  ``<TSP>`` phrases, whitespace-normalised.
* ``grounding_turns`` (option ``grounding``): ``entity_match`` (default) = on clarify examples, the
  history turns whose text contains the name of entity 1 or 2 (case-insensitive). This is derived
  from the annotated entity names (CLAQUA does not annotate turns; ``meta.grounding_source`` says
  so); ``none`` leaves it empty. Always empty for single-turn.
* ``passages`` (option ``passages``, default true): ``entity1`` / ``entity2`` as
  ``"<name> (<types>): <description>"``; ``grounding_passages`` = [].
* ``id`` = ``claqua-<variant>-<split>-t1-<line>`` (task-1 line) or ``...-t2-<line>`` (task-2 pair).
* ``meta``: ``dataset``, ``split``, ``variant``, ``source_file`` (+ ``task2_file``), ``line`` (+
  ``task2_line``), ``label``, ``entities`` (names), ``conversation_id`` (=
  ``claqua-<variant>-<sha1(context)[:12]>``: CLAQUA has no conversation ids; equal contexts share
  one, so the data job never splits them apart), ``grounding_source``.

Skip reasons: ``malformed_line`` (bad JSON / missing fields / label not 0 or 1 / ``src`` without
three ``<SP>`` parts), ``malformed_context`` (multi-turn context that does not end with a user
turn), ``no_question``, ``template_mismatch`` (number of ``<e>`` slots differs from the ``<TSP>``
phrases), ``missing_src_file`` / ``missing_tgt_file`` (one side of a task-2 pair is not in this
copy: each line of the other side is skipped -- e.g. multi-turn ``tgt-train.txt`` here),
``unpaired_line`` (src and tgt differ in length), ``invalid_example``. Files are streamed line by
line, except the task-2 pairs of a split, which are indexed first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Literal

from clarifier.core.schema import Example, Passage, Turn
from clarifier.data.importers.base import Importer, ImporterOptions, Skipped, make_example, one_line, require_dir, short_hash

DATASET = "claqua"
VARIANTS = ("single-turn", "multi-turn")
SPLITS = ("train", "dev", "test")


class ClaquaOptions(ImporterOptions):
    variants: list[Literal["single-turn", "multi-turn"]] = list(VARIANTS)
    splits: list[Literal["train", "dev", "test"]] | None = None  # default: every split with a file here
    grounding: Literal["entity_match", "none"] = "entity_match"
    passages: bool = True


def _task2_name(split: str) -> str:
    return "val" if split == "dev" else split


def _files(base: Path, variant: str, split: str) -> dict[str, Path]:
    t2 = _task2_name(split)
    return {"task1": base / variant / "task1" / f"{split}_classifier.txt",
            "src": base / variant / "task2" / f"src-{t2}.txt",
            "tgt": base / variant / "task2" / f"tgt-{t2}.txt"}


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if line.strip():
                yield n, line


def _entity(raw: str) -> tuple[str, Passage | None]:
    parts = [p.strip() for p in raw.split("<S>")]
    name = parts[0]
    if len(parts) >= 3:
        return name, Passage(id="", text=f"{name} ({parts[1]}): {parts[2]}")
    return name, Passage(id="", text=one_line(raw))


def fill_template(tgt: str) -> str:
    """The clarifying question from a task-2 target line; ``ValueError`` when slots and phrases differ."""
    parts = tgt.split("<TSP>")
    template, fillers = parts[0], [one_line(p) for p in parts[1:]]
    slots = template.count("<e>")
    if slots != len(fillers):
        raise ValueError(f"{slots} <e> slot(s) but {len(fillers)} <TSP> phrase(s)")
    pieces = template.split("<e>")
    out = pieces[0]
    for f, rest in zip(fillers, pieces[1:]):
        out += f + rest
    return one_line(out)


def _example(rid: str, where: str, variant: str, split: str, context: str, e1: str, e2: str,
             question: str | None, opts: ClaquaOptions, meta: dict) -> Example | Skipped:
    parts = [p.strip() for p in context.split("<EOS>")] if variant == "multi-turn" else [context.strip()]
    if len(parts) % 2 == 0:
        return Skipped("malformed_context", where, f"context has {len(parts)} <EOS> parts: it must end with a user turn")
    history = [Turn(role="user" if i % 2 == 0 else "assistant", text=p) for i, p in enumerate(parts[:-1])]
    (n1, p1), (n2, p2) = _entity(e1), _entity(e2)
    grounding: list[int] = []
    if question and opts.grounding == "entity_match":
        names = [n.lower() for n in (n1, n2) if n]
        grounding = [i for i, t in enumerate(history) if any(n in t.text.lower() for n in names)]
    passages = []
    if opts.passages:
        passages = [Passage(id="entity1", text=p1.text), Passage(id="entity2", text=p2.text)]
    meta = {"dataset": DATASET, "split": split, "variant": variant, **meta, "entities": [n1, n2],
            "conversation_id": f"{DATASET}-{variant}-{short_hash(one_line(context))}",
            "grounding_source": ("entity_match" if grounding else "none") if question else None}
    return make_example(where, id=rid, history=history, query=parts[-1], needs_clarification=question is not None,
                        clarifying_question=question, grounding_turns=grounding, passages=passages, meta=meta)


def _rel(path: Path, base: Path) -> str:
    return path.relative_to(base).as_posix()


def _task2_pairs(files: dict[str, Path], base: Path) -> tuple[list[tuple[int, str, str]], list[Skipped]]:
    src, tgt = files["src"], files["tgt"]
    if not src.is_file() and not tgt.is_file():
        return [], []
    if not src.is_file():
        return [], [Skipped("missing_src_file", f"{_rel(tgt, base)}:{n}", f"no {src.name} beside it")
                    for n, _ in _lines(tgt)]
    if not tgt.is_file():
        return [], [Skipped("missing_tgt_file", f"{_rel(src, base)}:{n}", f"no {tgt.name} beside it")
                    for n, _ in _lines(src)]
    with open(src, encoding="utf-8") as f:
        s_lines = [ln.rstrip("\r\n") for ln in f]
    with open(tgt, encoding="utf-8") as f:
        t_lines = [ln.rstrip("\r\n") for ln in f]
    pairs, skipped = [], []
    for n in range(max(len(s_lines), len(t_lines))):
        s = s_lines[n] if n < len(s_lines) else ""
        t = t_lines[n] if n < len(t_lines) else ""
        if not s.strip() and not t.strip():
            continue
        if not s.strip() or not t.strip():
            side = _rel(src if s.strip() else tgt, base)
            skipped.append(Skipped("unpaired_line", f"{side}:{n + 1}", "the other file has no line here"))
            continue
        pairs.append((n + 1, s, t))
    return pairs, skipped


def _split(base: Path, variant: str, split: str, opts: ClaquaOptions) -> Iterator[Example | Skipped]:
    files = _files(base, variant, split)
    pairs, skipped = _task2_pairs(files, base)
    yield from skipped
    src_name = _rel(files["src"], base)
    index: dict[tuple, list[int]] = {}
    parsed: dict[int, tuple[str, str, str, str]] = {}
    for n, s, t in pairs:
        parts = [p.strip() for p in s.split("<SP>")]
        if len(parts) != 3:
            yield Skipped("malformed_line", f"{src_name}:{n}", f"src has {len(parts)} <SP> parts, expected 3")
            continue
        parsed[n] = (parts[0], parts[1], parts[2], t)
        index.setdefault((parts[0], frozenset(parts[1:])), []).append(n)
    consumed: set[int] = set()
    t1 = files["task1"]
    if t1.is_file():
        t1_name = _rel(t1, base)
        for n, line in _lines(t1):
            where = f"{t1_name}:{n}"
            try:
                rec = json.loads(line)
                ctx, e1, e2, label = (str(rec["context"]), str(rec["entity1"]), str(rec["entity2"]), str(rec["label"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                yield Skipped("malformed_line", where, f"{type(exc).__name__}: {exc}")
                continue
            if label not in ("0", "1"):
                yield Skipped("malformed_line", where, f"label {label!r} is not 0 or 1")
                continue
            meta = {"source_file": t1_name, "line": n, "label": int(label)}
            question = None
            if label == "1":
                match = [m for m in index.get((ctx.strip(), frozenset([e1.strip(), e2.strip()])), []) if m not in consumed]
                if not match:
                    yield Skipped("no_question", where, f"label 1 but no task-2 line in {src_name} with this context")
                    continue
                m = match[0]
                consumed.add(m)
                meta.update(task2_file=src_name, task2_line=m)
                try:
                    question = fill_template(parsed[m][3])
                except ValueError as exc:
                    yield Skipped("template_mismatch", f"{where} (task-2 line {m})", str(exc))
                    continue
            yield _example(f"{DATASET}-{variant}-{split}-t1-{n}", where, variant, split, ctx, e1, e2, question, opts, meta)
    for n, (ctx, e1, e2, t) in parsed.items():
        if n in consumed:
            continue
        where = f"{src_name}:{n}"
        try:
            question = fill_template(t)
        except ValueError as exc:
            yield Skipped("template_mismatch", where, str(exc))
            continue
        meta = {"source_file": src_name, "line": n, "task2_file": src_name, "task2_line": n}
        yield _example(f"{DATASET}-{variant}-{split}-t2-{n}", where, variant, split, ctx, e1, e2, question, opts, meta)


def _base(src: Path) -> Path:
    for cand in (src / "data", src):
        if any((cand / v).is_dir() for v in VARIANTS):
            return cand
    raise FileNotFoundError(f"{DATASET}: no single-turn/ or multi-turn/ folder in {src} or {src / 'data'}")


def run(src: Path, opts: ClaquaOptions) -> Iterator[Example | Skipped]:
    base = _base(require_dir(src, DATASET))
    combos = []
    for v in opts.variants:
        for s in opts.splits or SPLITS:
            present = any(p.is_file() for p in _files(base, v, s).values())
            if present:
                combos.append((v, s))
            elif opts.splits:
                raise FileNotFoundError(f"{DATASET}: no files of split {s!r} for {v} under {base / v} "
                                        f"(looked for {', '.join(p.name for p in _files(base, v, s).values())})")
    if not combos:
        raise FileNotFoundError(f"{DATASET}: no task1/task2 files for {opts.variants} under {base}")

    def gen():
        for v, s in combos:
            yield from _split(base, v, s, opts)

    return gen()


IMPORTER = Importer(name=DATASET, options=ClaquaOptions, run=run, unit="decision point",
                    description="CLAQUA task1 (need labels) joined with task2 (questions), single- and multi-turn")
