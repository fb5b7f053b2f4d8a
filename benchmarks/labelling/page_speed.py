"""Is the labelling page ever the bottleneck? A scripted labeller drives `clarifier label serve` in headless chromium.

    .venv/bin/python benchmarks/labelling/page_speed.py --out benchmarks/results/labelling-page-<date>.json

A queue of ``--turns`` realistic turns (4 earlier turns, 3 passages of 300-1,500 characters) is served by the real
command; the labeller presses ``c`` / ``n`` / ``s`` in turn and the time from the key to the next turn on screen is
recorded (the label appended and fsync-ed, the next turn fetched and drawn; selenium's own round trips included). The
same through the API alone (POST the label, GET the next turn). A person needs seconds per turn to read it: the page's
share of that is what the figures say. JSON out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from common import result_file, write_result  # noqa: E402


def _queue(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = "router modem invoice password printer reset account card limit plan update screen battery".split()

    def text(k):
        return " ".join(rng.choice(words) for _ in range(k))

    rows = []
    for i in range(n):
        rows.append({"id": f"c{i}:4", "history": [{"role": "user" if j % 2 == 0 else "assistant", "text": text(25)}
                                                  for j in range(4)],
                     "query": f"{text(6)}? ({i})", "passages": [{"id": f"kb{j}", "text": text(rng.randint(50, 250))}
                                                              for j in range(3)],
                     "meta": {"conversation_id": f"c{i}", "queue": {"position": i + 1, "score": rng.random(),
                                                                    "threshold": 0.5, "part": "active"}}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": round(statistics.median(xs) * 1000, 1),
            "p95_ms": round(xs[int(0.95 * (len(xs) - 1))] * 1000, 1), "max_ms": round(xs[-1] * 1000, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=150)
    ap.add_argument("--out", default=None, help="result JSON (default results/labelling-page.json)")
    a = ap.parse_args()
    result_file("labelling-page", a.out)

    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from clarifier.runtime.services import free_port
    from support.browser import headless_chrome, label_server, missing

    if missing():
        raise SystemExit("needs " + "; ".join(missing()))
    with tempfile.TemporaryDirectory(prefix="clarifier-label-bench-") as tmp:
        tmp = Path(tmp)
        half = a.turns // 2
        queue = _queue(tmp / "queue.jsonl", a.turns)
        port = free_port()
        server = label_server(queue, tmp / "labels.jsonl", port)
        page, api = [], []
        try:
            with headless_chrome(tmp, window="1100,1000") as browser:
                browser.get(f"http://127.0.0.1:{port}/")
                wait = WebDriverWait(browser, 30, poll_frequency=0.005)
                wait.until(lambda d: d.find_element(By.ID, "query").text.endswith("(0)"))
                body = browser.find_element(By.TAG_NAME, "body")
                for i in range(half):
                    t = time.perf_counter()
                    body.send_keys("cns"[i % 3])
                    wait.until(lambda d, k=i + 1: d.find_element(By.ID, "query").text.endswith(f"({k})"))
                    page.append(time.perf_counter() - t)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
                item = c.get("/api/next").json()["item"]
                for i in range(half, a.turns - 1):
                    t = time.perf_counter()
                    c.post("/api/label", json={"id": item["id"], "decision": ("clarify", "clear", "skip")[i % 3]}
                           ).raise_for_status()
                    item = c.get("/api/next", params={"after": item["id"]}).json()["item"]
                    api.append(time.perf_counter() - t)
        finally:
            server.kill()
            server.wait(timeout=30)
        kept = sum(1 for _ in (tmp / "labels.jsonl").read_text().splitlines())
        skips = sum(1 for _ in (tmp / "labels.skips.jsonl").read_text().splitlines())
    res = {"turns": a.turns, "page": _summary(page), "api": _summary(api),
           "labels_on_disk": kept, "skips_on_disk": skips, "acknowledged": len(page) + len(api)}
    path = write_result("labelling-page", res, a.out)
    print(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
