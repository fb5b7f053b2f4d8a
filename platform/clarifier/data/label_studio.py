"""A labelling queue in Label Studio, and Label Studio's annotations back as labels
(``clarifier label export`` / ``clarifier label import``).

Export writes the queue as Label Studio tasks (its JSON task format: a list of ``{"data": ..., "predictions": ...}``)
and the labelling interface to create the project with (``LABEL_CONFIG``, also written beside the tasks as
``label-config.xml``):

* ``data``: ``turn_id``, ``conversation`` (numbered turns, one per line), ``passages``, ``query``, ``part``
  (active, random or kept apart) and the model's ``score``;
* ``predictions``: a pre-annotation Label Studio shows for the person to confirm or change: the turn's pre-label
  from what happened next where it has one (a queue from the serving request log, ``meta.prelabel``;
  ``model_version`` ``what-happened-next:<rule>``, with the question that was asked), else the model's decision at
  its threshold (``model_version`` the queue's model);
* ``annotations``: the labels already given in Clarifier's labels file, if one is passed.

Import reads Label Studio's JSON export (``Export -> JSON``): per task its latest annotation that was not cancelled,
``decision`` (``Needs a question`` / ``Clear``), the optional ``question`` text and ``grounding`` (the numbers of the
turns it refers to, comma-separated), and appends them to a labels file through
:class:`clarifier.data.label_store.LabelStore`, so the same guarantees hold: on disk at once, a turn never labelled
twice (a turn already in the file is counted and left as it is), a second session refused. A cancelled
annotation (Label Studio's skip) becomes a skip.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from clarifier.data.label_store import LabelConflict, LabelStore, jsonl_records, read_queue

ASK, CLEAR = "Needs a question", "Clear"
LABEL_CONFIG = """<View>
  <Header value="Conversation (numbered turns)"/>
  <Text name="conversation" value="$conversation"/>
  <Header value="Retrieved passages"/>
  <Text name="passages" value="$passages"/>
  <Header value="Latest user message"/>
  <Text name="query" value="$query"/>
  <Header value="Does the latest message need a clarifying question before answering?"/>
  <Choices name="decision" toName="query" choice="single" required="true">
    <Choice value="Needs a question" hotkey="c"/>
    <Choice value="Clear" hotkey="n"/>
  </Choices>
  <TextArea name="question" toName="query" placeholder="The question you would ask (optional)" maxSubmissions="1"/>
  <TextArea name="grounding" toName="conversation" placeholder="Turns it refers to, e.g. 0, 2 (optional)" maxSubmissions="1"/>
</View>
"""


def _conversation(item: dict) -> str:
    return "\n".join(f"[{i}] {t.get('role')}: {t.get('text')}" for i, t in enumerate(item.get("history") or []))


def _choice(value: str, to: str = "query") -> dict:
    return {"from_name": "decision", "to_name": to, "type": "choices", "value": {"choices": [value]}}


def _text(name: str, text: str, to: str) -> dict:
    return {"from_name": name, "to_name": to, "type": "textarea", "value": {"text": [text]}}


def export_tasks(queue: str | Path, out: str | Path, labels: str | Path | None = None) -> dict:
    """Write the queue as Label Studio tasks to ``out`` (JSON) and ``label-config.xml`` beside it."""
    items = read_queue(queue)
    given: dict[str, dict] = {}
    if labels is not None and Path(labels).exists():
        given = {rec["id"]: rec for _, rec in jsonl_records(Path(labels).read_text(), str(labels))}
    tasks = []
    for item in items:
        q = (item.get("meta") or {}).get("queue") or {}
        task: dict = {"data": {
            "turn_id": item["id"], "conversation": _conversation(item) or "(no earlier turns)",
            "passages": "\n\n".join(f"{p.get('id')}: {p.get('text')}" for p in item.get("passages") or []) or "(none)",
            "query": item["query"], "part": q.get("part"), "score": q.get("score")}}
        pre = (item.get("meta") or {}).get("prelabel")
        if pre:
            result = [_choice(ASK if pre.get("needs_clarification") else CLEAR)]
            if pre.get("question"):
                result.append(_text("question", pre["question"], "query"))
            task["predictions"] = [{"model_version": f"what-happened-next:{pre.get('rule')}", "result": result}]
        elif q.get("score") is not None and q.get("threshold") is not None:
            task["predictions"] = [{"model_version": str(q.get("model") or "clarifier"), "score": q["score"],
                                    "result": [_choice(ASK if q["score"] >= q["threshold"] else CLEAR)]}]
        rec = given.get(item["id"])
        if rec is not None:
            result = [_choice(ASK if rec.get("needs_clarification") else CLEAR)]
            if rec.get("clarifying_question"):
                result.append(_text("question", rec["clarifying_question"], "query"))
            if rec.get("grounding_turns"):
                result.append(_text("grounding", ", ".join(str(g) for g in rec["grounding_turns"]), "conversation"))
            task["annotations"] = [{"result": result, "was_cancelled": False}]
        tasks.append(task)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(tasks, indent=1, ensure_ascii=False) + "\n")
    config = out.with_name("label-config.xml")
    config.write_text(LABEL_CONFIG)
    return {"tasks": len(tasks), "with_annotations": sum(1 for t in tasks if "annotations" in t), "out": str(out),
            "label_config": str(config)}


def _latest(annotations: list) -> dict | None:
    live = [a for a in annotations or [] if isinstance(a, dict)]
    if not live:
        return None
    return max(live, key=lambda a: (str(a.get("updated_at") or a.get("created_at") or ""), str(a.get("id") or "")))


def _read_result(result: list, where: str) -> tuple[str | None, str | None, list[int]]:
    decision, question, grounding = None, None, []
    for r in result or []:
        name, value = r.get("from_name"), r.get("value") or {}
        if name == "decision":
            choices = value.get("choices") or []
            if len(choices) != 1 or choices[0] not in (ASK, CLEAR):
                raise ValueError(f"{where}: decision {choices!r}: one of {ASK!r}, {CLEAR!r}")
            decision = "clarify" if choices[0] == ASK else "clear"
        elif name == "question":
            question = " ".join(value.get("text") or []).strip() or None
        elif name == "grounding":
            text = " ".join(value.get("text") or [])
            bad = [t for t in re.split(r"[,\s]+", text.strip()) if t and not t.isdigit()]
            if bad:
                raise ValueError(f"{where}: grounding {text!r}: turn numbers separated by commas (e.g. 0, 2)")
            grounding = [int(t) for t in re.split(r"[,\s]+", text.strip()) if t]
    return decision, question, grounding


def import_annotations(export: str | Path, queue: str | Path, labels: str | Path, *, labeller: str = "label-studio",
                       take_over: bool = False) -> dict:
    """Append the annotations of a Label Studio JSON export to ``labels`` (see the module docstring)."""
    try:
        tasks = json.loads(Path(export).read_text())
    except ValueError as exc:
        raise ValueError(f"{export}: not a Label Studio JSON export ({exc})") from None
    if not isinstance(tasks, list):
        raise ValueError(f"{export}: a Label Studio JSON export is a list of tasks, got {type(tasks).__name__}")
    store = LabelStore(queue, labels, labeller=labeller, take_over=take_over)
    counts = {"tasks": len(tasks), "labelled": 0, "skipped": 0, "unannotated": 0, "already_labelled": 0,
              "questions_on_clear_turns_ignored": 0}
    try:
        for i, task in enumerate(tasks):
            where = f"{export}: task {i}"
            turn = ((task or {}).get("data") or {}).get("turn_id")
            if not isinstance(turn, str):
                raise ValueError(f"{where}: no data.turn_id (export the project whose tasks `clarifier label export` "
                                 "wrote)")
            ann = _latest(task.get("annotations"))
            if ann is None:
                counts["unannotated"] += 1
                continue
            try:
                if ann.get("was_cancelled"):
                    store.add(turn, "skip")
                    counts["skipped"] += 1
                    continue
                decision, question, grounding = _read_result(ann.get("result"), f"{where} ({turn})")
                if decision is None:
                    raise ValueError(f"{where} ({turn}): the annotation has no decision")
                if decision == "clear" and question:
                    counts["questions_on_clear_turns_ignored"] += 1
                store.add(turn, decision, question=question if decision == "clarify" else None,
                          grounding_turns=grounding if decision == "clarify" else [])
                counts["labelled"] += 1
            except LabelConflict:
                counts["already_labelled"] += 1
    finally:
        store.close()
    return {**counts, "labels": str(labels), "progress": store.progress()}
