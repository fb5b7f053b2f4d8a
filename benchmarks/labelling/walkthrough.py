"""From a folder of chat logs to an adapted clarifier served, timed step by step: the labelling tutorial's run.

    .venv/bin/python benchmarks/labelling/walkthrough.py --data .clarifier/recipes/joint-public/data \
        --source pacific --model <folder of a model trained without pacific> \
        --out benchmarks/results/labelling-walkthrough-<date>.json

One public source plays a team's assistant: its train turns, **without their labels**, are the team's chat logs;
its test turns are what the team checks the adapted model on afterwards. The model should never have seen the
source (a leave-one-out model), as a team's model never saw its conversations. Every step is the command a user
runs, as a subprocess, timed from start to exit:

1. ``clarifier label select`` over the logs (``--n`` turns, a fifth kept apart);
2. ``clarifier label serve``, with a scripted labeller answering through its API from the source's own labels (the
   time recorded is the page's share; a person's reading time is theirs, see the labelling-page result);
3. ``clarifier adapt`` on the labels (the head refit; the kept-apart slice scored at the end);
4. ``clarifier eval`` of the adapted model on the source's test turns (the figure the kept-apart estimate predicts);
5. ``clarifier serve`` of the adapted model: the time until ``POST /v1/clarify`` answers, and one answer;
6. ``clarifier label select`` again, from the adapted model, leaving out what was queued.

JSON out: minutes per step, the queue's make-up, adapt's figures (kept-apart AUROC with its interval, the estimate,
the surface control) and the test-turn AUROC.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from common import result_file, write_result  # noqa: E402

EXE = Path(sys.executable).with_name("clarifier")


def run(step: str, args: list[str], log: Path, timeout: float = 3600) -> dict:
    """One command as a user runs it; its output kept in ``log``; refused (with its tail) when it fails."""
    t0 = time.time()
    with log.open("w") as f:
        proc = subprocess.run([str(EXE), *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    seconds = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{step}: `clarifier {' '.join(args)}` exited {proc.returncode}:\n"
                         + "\n".join(log.read_text().splitlines()[-30:]))
    print(f"[walkthrough] {step}: {seconds / 60:.1f} min", flush=True)
    return {"command": "clarifier " + " ".join(args), "seconds": round(seconds, 1), "minutes": round(seconds / 60, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-job output holding the source's train and test turns")
    ap.add_argument("--source", required=True)
    ap.add_argument("--model", required=True, help="the model to start from (ideally trained without --source)")
    ap.add_argument("--n", type=int, default=300, help="turns to queue and label")
    ap.add_argument("--max-logs", type=int, default=None, help="a smoke run: this many of the train turns as the logs")
    ap.add_argument("--max-test", type=int, default=None, help="a smoke run: this many test turns")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".clarifier" / "walkthrough")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = result_file(f"labelling-walkthrough-{args.source}", args.out)

    import httpx

    from clarifier.core.schema import source_of
    from clarifier.data.outputs import load_split
    from clarifier.runtime.services import free_port
    from support.browser import label_server

    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "chat-logs").mkdir(parents=True)
    train = [e for e in load_split(args.data, "train") if source_of(e) == args.source]
    test = [e for e in load_split(args.data, "test") if source_of(e) == args.source]
    if args.max_logs:  # whole conversations, the first ones by id
        convs = sorted({e.conversation_id for e in train})[: max(1, args.max_logs // 5)]
        train = [e for e in train if e.conversation_id in set(convs)][: args.max_logs]
    if args.max_test:
        test = test[: args.max_test]
    # the team's logs: one conversation log per conversation (its longest turn's history and query, each user turn with
    # its passages), no labels; the labels kept aside by the turn ids the audit's reader gives (conversation:index)
    by_conv: dict[str, list] = {}
    for e in train:
        by_conv.setdefault(e.conversation_id, []).append(e)
    gold, lines = {}, []
    for cid, turns_of in sorted(by_conv.items()):
        longest = max(turns_of, key=lambda e: len(e.history))
        turns = [{"role": t.role, "text": t.text} for t in longest.history] + [{"role": "user", "text": longest.query}]
        for e in turns_of:
            i = len(e.history)
            if i < len(turns) and turns[i]["role"] == "user" and turns[i]["text"] == e.query:
                if e.passages:
                    turns[i]["passages"] = [p.model_dump(mode="json", exclude_none=True) for p in e.passages]
                gold[f"{cid}:{i}"] = e
        lines.append(json.dumps({"conversation_id": cid, "turns": turns}))
    (work / "chat-logs" / "part-0.jsonl").write_text("".join(line + "\n" for line in lines))
    (work / "test.jsonl").write_text("".join(e.model_dump_json() + "\n" for e in test))
    print(f"[walkthrough] {args.source}: {len(train)} unlabelled turns as the team's logs, {len(test)} test turns",
          flush=True)
    logs = work / "logs"
    logs.mkdir()
    steps: dict[str, dict] = {}
    t_all = time.time()

    steps["select"] = run("label select", ["label", "select", "--logs", str(work / "chat-logs"), "--out",
                                           str(work / "queue"), "--n", str(args.n), "--model", args.model],
                          logs / "select.log")
    queue = [json.loads(line) for line in (work / "queue" / "queue.jsonl").read_text().splitlines()]

    port = free_port()
    t0 = time.time()
    server = label_server(work / "queue" / "queue.jsonl", work / "labels.jsonl", port, "--labeller", "scripted")
    started = time.time() - t0
    per: list[float] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            while True:
                t1 = time.time()
                item = client.get("/api/next").json()["item"]
                if item is None:
                    break
                e = gold.get(item["id"])
                if e is None:  # a user turn of the logs that is no labelled turn of the source: skipped
                    client.post("/api/label", json={"id": item["id"], "decision": "skip"}).raise_for_status()
                    continue
                body = {"id": item["id"], "decision": "clarify" if e.needs_clarification else "clear"}
                if e.needs_clarification and e.clarifying_question:
                    body["question"] = e.clarifying_question
                r = client.post("/api/label", json=body)
                r.raise_for_status()
                per.append(time.time() - t1)
            progress = client.get("/api/progress").json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    per.sort()
    steps["label"] = {"command": "clarifier label serve (scripted labeller through its API)",
                      "seconds": round(started + sum(per), 1), "minutes": round((started + sum(per)) / 60, 2),
                      "server_start_seconds": round(started, 1), "labels": len(per),
                      "per_label_ms_p50": round(1000 * per[len(per) // 2], 1),
                      "kept_apart_estimate_on_the_page": progress["kept_apart"]}
    print(f"[walkthrough] label: {len(per)} labels, {1000 * per[len(per) // 2]:.0f} ms each (p50)", flush=True)

    steps["adapt"] = run("adapt", ["adapt", "--model", args.model, "--data", str(work / "labels.jsonl"), "--out",
                                   str(work / "my-clarifier")], logs / "adapt.log")
    adapted = json.loads((work / "my-clarifier" / "adapt.json").read_text())
    steps["eval"] = run("eval", ["eval", "--model", str(work / "my-clarifier"), "--data", str(work / "test.jsonl"),
                                 "--out", str(work / "eval")], logs / "eval.log")
    report = json.loads((work / "eval" / "report.json").read_text())

    serve_port = free_port()
    t0 = time.time()
    env = {**os.environ, "RAY_SERVE_ENABLE_TASK_EVENTS": "0"}
    proc = subprocess.Popen([str(EXE), "serve", f"serve.model_uri={work / 'my-clarifier'}", f"serve.port={serve_port}"],
                            stdout=(logs / "serve.log").open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    answer = None
    try:
        sample = test[0]
        payload = {"history": [t.model_dump(mode="json") for t in sample.history], "query": sample.query,
                   "passages": [p.model_dump(mode="json", exclude_none=True) for p in sample.passages]}
        deadline = time.time() + 900
        while time.time() < deadline and answer is None:
            if proc.poll() is not None:
                raise SystemExit(f"clarifier serve exited {proc.returncode}: see {logs / 'serve.log'}")
            try:
                r = httpx.post(f"http://127.0.0.1:{serve_port}/v1/clarify", json=payload, timeout=60)
                if r.status_code == 200:
                    answer = r.json()
            except httpx.HTTPError:
                pass
            if answer is None:
                time.sleep(2)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if answer is None:
        raise SystemExit(f"clarifier serve did not answer in 15 minutes: see {logs / 'serve.log'}")
    steps["serve"] = {"command": "clarifier serve serve.model_uri=./my-clarifier",
                      "seconds": round(time.time() - t0, 1), "minutes": round((time.time() - t0) / 60, 2),
                      "what": "from the command to its first answer of POST /v1/clarify", "answer": answer}
    print(f"[walkthrough] serve: first answer after {steps['serve']['minutes']:.1f} min", flush=True)

    steps["select_again"] = run("label select again", [
        "label", "select", "--logs", str(work / "chat-logs"), "--out", str(work / "queue-2"), "--n", str(args.n),
        "--model", str(work / "my-clarifier"), "--labelled", str(work / "labels.jsonl"), "--labelled",
        str(work / "queue" / "queue.jsonl")], logs / "select-again.log")
    queue2 = [json.loads(line) for line in (work / "queue-2" / "queue.jsonl").read_text().splitlines()]

    result = {
        "data": args.data, "source": args.source, "model": args.model,
        "smoke": {"max_logs": args.max_logs, "max_test": args.max_test},
        "n": {"logs": len(train), "test": len(test), "test_clarify": sum(bool(e.needs_clarification) for e in test),
              "queued": len(queue), "kept_apart": sum(1 for r in queue if r["meta"]["queue"]["part"] == "kept_apart"),
              "queued_again": len(queue2),
              "queued_twice": len({r["id"] for r in queue} & {r["id"] for r in queue2})},
        "steps": steps, "total_minutes": round(sum(s["minutes"] for s in steps.values()), 1),
        "wall_minutes": round((time.time() - t_all) / 60, 1),
        "adapt": {"kept": adapted["kept"], "threshold": adapted["threshold"], "before": adapted["before"],
                  "estimate": {k: adapted["estimate"][k] for k in ("auroc", "recall_at_budget", "f1_at_budget",
                                                                     "surface_control_auroc")},
                  "kept_apart": {k: v for k, v in (adapted.get("kept_apart") or {}).items() if k != "turns"},
                  "label_curve": adapted.get("label_curve")},
        "test": _test_figures(report),
    }
    print(f"[walkthrough] wrote {write_result(f'labelling-walkthrough-{args.source}', result, out)}", flush=True)


def _test_figures(report: dict) -> dict:
    """AUROC, recall / F1 at the over-asking budget and the decision at the threshold of the adapted model on the
    test turns, from eval's report.json (its ``models.model`` row), beside the surface-free baselines' AUROC."""
    m = report["models"]["model"]["metrics"]
    ws = m.get("within_source") or {}
    return {"n": m["n"], "auroc": m["auroc"], "threshold": report.get("threshold"), "decision": m["decision"],
            "recall_at_budget": ws.get("macro_recall_at_budget"), "f1_at_budget": ws.get("macro_f1_at_budget"),
            "baselines_auroc": {k: v["metrics"].get("auroc") for k, v in report["models"].items() if k != "model"}}


if __name__ == "__main__":
    main()
