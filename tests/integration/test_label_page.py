"""The labelling page (`clarifier label serve`) in a real headless browser: a person's keys and clicks become labels
on disk, a killed server loses none of the labels it acknowledged and resumes where it stopped, and a second server
on the same labels file is refused. Debian's chromium through chromium-driver and selenium, as the playground's test;
the module skips, naming what is missing, where they are not installed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clarifier.runtime.services import free_port

pytestmark = pytest.mark.integration

ARTIFACTS = Path(__file__).resolve().parents[2] / ".clarifier" / "test-artifacts"
CLI = [sys.executable, "-m", "clarifier.cli"]

from support.browser import headless_chrome, label_server, missing  # noqa: E402

if missing():
    pytest.skip("the labelling page's browser test needs " + "; ".join(missing()) + " (infra/local/setup.sh installs "
                "them)", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


def _queue(path: Path, n: int = 6) -> Path:
    rows = [{"id": f"c{i}:2", "history": [{"role": "user", "text": f"I have a router and a modem ({i})."},
                                         {"role": "assistant", "text": "What do you need?"}],
             "query": f"how do I reset it? ({i})", "passages": [{"id": "kb1", "text": "Hold the reset button."}],
             "meta": {"conversation_id": f"c{i}", "queue": {"position": i + 1, "score": 0.5, "threshold": 0.5,
                                                            "part": "kept_apart" if i % 3 == 0 else "active"}}}
            for i in range(n)]
    rows[-1]["meta"]["prelabel"] = {"needs_clarification": True, "rule": "served_question_answered",
                                    "why": "Clarifier asked, the app showed the question and the user answered",
                                    "question": "The router or the modem?"}  # a queue from the request log
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _serve(queue: Path, out: Path, port: int):
    return label_server(queue, out, port, "--labeller", "tester")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with headless_chrome(tmp_path_factory.mktemp("chromium-label"), window="1100,1000") as driver:
        yield driver


def _wait(browser, cond, timeout=60):
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(cond)


def _text(browser, i) -> str:
    return browser.find_element(By.ID, i).text


def _shows(browser, query):
    _wait(browser, lambda d: _text(d, "query") == query)


def _labels(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(300)
def test_labelling_in_the_browser_survives_a_killed_server(browser, tmp_path):
    queue, out = _queue(tmp_path / "queue.jsonl"), tmp_path / "labels.jsonl"
    port = free_port()
    server = _serve(queue, out, port)
    try:
        browser.get(f"http://127.0.0.1:{port}/")
        _shows(browser, "how do I reset it? (0)")
        assert "0 labelled, 0 skipped, 6 left of 6" in _text(browser, "count")
        assert "kept apart" in _text(browser, "part")
        # a positive with its question and grounding: click turn 0, type, Ctrl+Enter
        browser.find_element(By.CSS_SELECTOR, '#history .turn[data-index="0"]').click()
        q = browser.find_element(By.ID, "question")
        q.send_keys("The router or the modem?")
        q.send_keys(Keys.CONTROL, Keys.ENTER)
        _shows(browser, "how do I reset it? (1)")
        body = browser.find_element(By.TAG_NAME, "body")
        body.send_keys("n")  # clear
        _shows(browser, "how do I reset it? (2)")
        body.send_keys("s")  # skip
        _shows(browser, "how do I reset it? (3)")
        body.send_keys("c")  # needs a question, no question written
        _shows(browser, "how do I reset it? (4)")
        recs = _labels(out)  # every label the page moved past is on disk
        assert [(r["id"], r["needs_clarification"]) for r in recs] == [("c0:2", True), ("c1:2", False), ("c3:2", True)]
        assert recs[0]["clarifying_question"] == "The router or the modem?" and recs[0]["grounding_turns"] == [0]
        assert recs[2]["decision_only"] is True and recs[0]["meta"]["label"]["by"] == "tester"
        assert _labels(tmp_path / "labels.skips.jsonl")[0]["id"] == "c2:2"
        assert "2 need a question / 1 clear" in _text(browser, "balance")

        second = subprocess.run([*CLI, "label", "serve", "--queue", str(queue), "--out", str(out), "--port",
                                 str(free_port())], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "being labelled by tester" in second.stdout + second.stderr

        server.send_signal(signal.SIGKILL)  # killed mid-session: nothing acknowledged is lost
        server.wait(timeout=30)
        body.send_keys("n")
        _wait(browser, lambda d: "Not saved" in _text(d, "error"))  # the page says the label did not land
        assert len(_labels(out)) == 3

        server = _serve(queue, out, port)  # restarted: resumes at the first turn without a label
        browser.get(f"http://127.0.0.1:{port}/")
        _shows(browser, "how do I reset it? (4)")
        assert "3 labelled, 1 skipped, 2 left of 6" in _text(browser, "count")
        assert not browser.find_element(By.ID, "prelabel").is_displayed()
        browser.find_element(By.TAG_NAME, "body").send_keys("n")
        _shows(browser, "how do I reset it? (5)")
        # a pre-label from what happened next: shown with its rule, its question filled in, Enter confirms it
        assert "needs a question" in _text(browser, "prelabel") and "user answered" in _text(browser, "prelabel")
        assert browser.find_element(By.ID, "question").get_attribute("value") == "The router or the modem?"
        browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ENTER)
        _wait(browser, lambda d: d.find_element(By.ID, "done").is_displayed())
        assert [r["id"] for r in _labels(out)] == ["c0:2", "c1:2", "c3:2", "c4:2", "c5:2"]
        last = _labels(out)[-1]
        assert last["needs_clarification"] is True and last["clarifying_question"] == "The router or the modem?"
        assert last["meta"]["label"]["prelabel_agrees"] is True
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "label-page-done.png"))
    finally:
        server.kill()
        server.wait(timeout=30)
