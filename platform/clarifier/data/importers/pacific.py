"""PACIFIC (Deng et al., EMNLP 2022): ``validation.json`` (and ``train.json`` / ``test.json`` if present).

Published format: a JSON list of dialogues ``{"table": {"uid", "table": [[cells]]}, "paragraphs":
[{"uid", "order", "text"}], "questions": [...]}``; each question is a user turn with ``uid``,
``order``, ``question``, ``answer`` (list of spans, number or string), ``scale``, ``req_clari``,
``original_question`` (the self-contained rewrite) and more. On turns with ``req_clari: true`` the
``answer`` is the system's clarifying question; the next user turn answers it.

Mapping (one **record = one user turn**, i.e. one question, in ``order``):

* ``id`` = ``pacific-<question uid>``; ``query`` = ``question``; ``needs_clarification`` =
  ``req_clari``; ``clarifying_question`` = the single string of ``answer`` on those turns.
* ``history``: every earlier turn of the dialogue as ``user`` (the question) then ``assistant``
  (its answer, rendered as text: span lists joined with ``"; "``, numbers as written, with the
  ``scale`` appended -- ``"%"`` for percent, else ``" thousand"``/``" million"``/... ; on clarifying
  turns the assistant turn is the clarifying question itself).
* ``grounding_turns`` = [] (PACIFIC does not annotate which turns a clarification refers to;
  ``rel_paragraphs`` is empty on every clarifying turn).
* ``passages`` (option ``passages``, default true): the table as ``table`` (rows joined by
  newlines, cells by `` | ``) and each paragraph as ``p<order>``; ``grounding_passages`` = [].
* ``meta``: ``dataset``, ``split``, ``source_file``, ``dialogue_index``, ``conversation_id``
  (= ``pacific-<table uid>``), ``table_uid``, ``question_uid``, ``order``, ``original_question``,
  ``answer_type``, ``answer_from``, ``scale``, ``req_comparison``, ``follow_up``, and ``answer``
  (the rendered gold answer, on non-clarifying turns).

Skip reasons: ``malformed_dialogue`` (not an object with a ``questions`` list: one skip for the
dialogue), ``malformed_turn`` (a question that is not an object or has no text; it is left out of the
history of later turns),
``clarification_without_question`` (``req_clari`` but ``answer`` is not one non-empty string),
``invalid_example``. The JSON document is loaded whole (the published format is one document).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from clarifier.core.schema import Example, Passage, Turn
from clarifier.data.importers.base import Importer, ImporterOptions, Skipped, load_json, make_example, one_line, split_files

DATASET = "pacific"
SPLIT_FILES = {"train": "train.json", "validation": "validation.json", "test": "test.json"}


class PacificOptions(ImporterOptions):
    splits: list[str] | None = None  # default: every one of train/validation/test that is present
    passages: bool = True


def _num(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def render_answer(answer: Any, scale: str) -> str:
    """An answer as assistant text: spans joined by '; ', numbers as written, with the scale."""
    items = answer if isinstance(answer, list) else [answer]
    out = []
    for a in items:
        s = one_line(_num(a))
        if scale == "percent":
            s = s if s.endswith("%") else s + "%"
        elif scale:
            s = f"{s} {scale}"
        out.append(s)
    return "; ".join(out)


def _table_text(table: Any) -> str:
    rows = table.get("table") if isinstance(table, dict) else None
    if not isinstance(rows, list):
        return ""
    return "\n".join(" | ".join(one_line(c) for c in row) for row in rows if isinstance(row, list))


def _passages(dlg: dict) -> list[Passage]:
    out = []
    t = _table_text(dlg.get("table"))
    if t.strip():
        out.append(Passage(id="table", text=t))
    for k, p in enumerate(dlg.get("paragraphs") or []):
        if isinstance(p, dict) and str(p.get("text", "")).strip():
            out.append(Passage(id=f"p{p.get('order', k + 1)}", text=str(p["text"])))
    return out


def _dialogue(split: str, fname: str, k: int, dlg: Any, opts: PacificOptions) -> Iterator[Example | Skipped]:
    if not isinstance(dlg, dict) or not isinstance(dlg.get("questions"), list):
        yield Skipped("malformed_dialogue", f"{fname}[{k}]", "not an object with a 'questions' list")
        return
    table_uid = str((dlg.get("table") or {}).get("uid") or f"{split}-{k}")
    passages = _passages(dlg) if opts.passages else []
    qs = dlg["questions"]
    order = sorted(range(len(qs)), key=lambda n: (qs[n].get("order", n) if isinstance(qs[n], dict) else n, n))
    history: list[Turn] = []
    for n in order:
        q = qs[n]
        where = f"{fname}[{k}].questions[{n}]"
        if not isinstance(q, dict) or not one_line(q.get("question", "")):
            yield Skipped("malformed_turn", where, "question is not an object with non-empty 'question' text")
            continue
        where = f"{where} (uid {q.get('uid')})"
        text = str(q["question"])
        answer = q.get("answer")
        clari = bool(q.get("req_clari"))
        if clari:
            ok = isinstance(answer, list) and len(answer) == 1 and isinstance(answer[0], str) and answer[0].strip()
            ok = ok or (isinstance(answer, str) and answer.strip())
            if not ok:
                yield Skipped("clarification_without_question", where, f"req_clari but answer is {answer!r}")
                history += [Turn(role="user", text=text), Turn(role="assistant", text=render_answer(answer, ""))]
                continue
            reply = one_line(answer[0] if isinstance(answer, list) else answer)
        else:
            reply = render_answer(answer, str(q.get("scale") or ""))
        meta = {
            "dataset": DATASET, "split": split, "source_file": fname, "dialogue_index": k,
            "conversation_id": f"{DATASET}-{table_uid}", "table_uid": table_uid, "question_uid": q.get("uid"),
            "order": q.get("order"), "original_question": q.get("original_question"),
            "answer_type": q.get("answer_type"), "answer_from": q.get("answer_from"), "scale": q.get("scale"),
            "req_comparison": q.get("req_comparison"), "follow_up": q.get("follow_up"),
        }
        if not clari:
            meta["answer"] = reply
        yield make_example(where, id=f"{DATASET}-{q.get('uid') or f'{table_uid}-{n}'}", history=list(history),
                           query=text, needs_clarification=clari, clarifying_question=reply if clari else None,
                           passages=passages, meta=meta)
        history += [Turn(role="user", text=text), Turn(role="assistant", text=reply)]


def run(src: Path, opts: PacificOptions) -> Iterator[Example | Skipped]:
    files = split_files(src, DATASET, SPLIT_FILES, opts.splits, "train/validation/test .json")

    def gen():
        for split, path in files:
            data = load_json(path)
            if not isinstance(data, list):
                raise ValueError(f"{path}: expected a JSON list of dialogues (got {type(data).__name__})")
            for k, dlg in enumerate(data):
                yield from _dialogue(split, path.name, k, dlg, opts)

    return gen()


IMPORTER = Importer(name=DATASET, options=PacificOptions, run=run, unit="user turn",
                    description="PACIFIC dialogues: one example per user turn (req_clari -> clarify)")
