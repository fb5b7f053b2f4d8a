"""The playground page in a real headless browser, against the real serving app.

The app (tiny model + untrained LoRA adapter at threshold 0, so every answer takes the generation
path; API keys on; served under a route prefix, so the page's API calls must be relative to it) is
started like tests/integration/test_serving.py's. Debian's chromium is driven through its
chromium-driver with selenium (pinned in pyproject's test extra; infra/local/setup.sh installs
chromium with apt-get): the test clicks "Load example" and "Clarify" and checks that the decision,
P(clarify), the threshold, the question and the grounding highlights shown are those of a direct
POST of the same body, and that API errors (401, 413, 422 from the app; 503 bodies fed to the
page's fetch) are one readable line. Screenshots are
kept under the test's tmp_path and copied to ``.clarifier/test-artifacts/`` (gitignored).

Where selenium, chromium or chromedriver is missing the module skips, naming what is missing.
The browser resolves no host name but 127.0.0.1 (``--host-resolver-rules``), so it cannot reach
anything else, and the test checks that the page loaded nothing from another origin.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from clarifier.core.config import ServeConfig
from clarifier.runtime.services import free_port

pytestmark = pytest.mark.integration

KEY = "playground-key-5e1c07"
PREFIX = "/clarifier"
MAX_HISTORY = 3
ARTIFACTS = Path(__file__).resolve().parents[2] / ".clarifier" / "test-artifacts"

from support.browser import headless_chrome, missing  # noqa: E402

if missing():
    pytest.skip("the playground browser test needs " + "; ".join(missing()) + " (infra/local/setup.sh installs "
                "them)", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """(base URL with the route prefix, model folder) of a running app with API keys on."""
    from clarifier.serving.app import run_local
    from support.adapters import untrained_adapter
    from support.ray import start_ray

    folder = untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("playground") / "adapter", threshold=0.0)
    with pytest.MonkeyPatch.context() as mp, start_ray(4):
        mp.setenv("CLARIFIER_API_KEYS", KEY)  # read by build_app, in this process
        cfg = ServeConfig(model_uri=str(folder), port=free_port(), route_prefix=PREFIX, max_new_tokens=40,
                          max_history_turns=MAX_HISTORY, cpus_per_replica=0.5)
        yield run_local(cfg, ready_timeout_s=240), folder


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with headless_chrome(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver


def _wait(browser, cond, timeout=120):
    return WebDriverWait(browser, timeout, poll_frequency=0.2).until(cond)


def _id(browser, i):
    return browser.find_element(By.ID, i)


def _requests_done(browser) -> int:
    return int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-requests") or 0)


def _click_clarify(browser) -> None:
    n = _requests_done(browser)
    _id(browser, "clarify").click()
    _wait(browser, lambda d: _requests_done(d) > n)


def _percent(browser, element_id, prop) -> float:
    """An inline ``style.<prop>`` given in percent (the browser writes 0.00% as 0%)."""
    value = browser.execute_script(f"return document.getElementById('{element_id}').style.{prop}")
    assert value.endswith("%"), value
    return float(value[:-1])


def _set(browser, element_id, text) -> None:
    e = _id(browser, element_id)
    e.clear()
    if text:
        e.send_keys(text)


def _screenshot(browser, tmp_path, name) -> Path:
    """The whole page (beyond the window), as a PNG under tmp_path and ARTIFACTS."""
    import base64

    shot = tmp_path / name
    png = browser.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    shot.write_bytes(base64.b64decode(png["data"]))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, ARTIFACTS / name)
    assert shot.stat().st_size > 10_000  # a rendered page, not an empty image
    return shot


def _open(browser, url) -> None:
    browser.get(url)
    # the page asks readyz (relative to its own path) for the model version
    _wait(browser, lambda d: _id(d, "status").text.endswith(" ready"))


@pytest.mark.timeout(600)
def test_playground_shows_the_apis_answer(server, browser, tmp_path):
    import json

    url, folder = server
    _open(browser, f"{url}/playground")
    assert str(folder) in _id(browser, "status").text
    assert not _id(browser, "result").is_displayed()

    _id(browser, "load-example").click()
    _set(browser, "api-key", KEY)
    assert _id(browser, "query").get_attribute("value")
    _click_clarify(browser)
    _wait(browser, lambda d: _id(d, "result").is_displayed())
    assert not _id(browser, "error").is_displayed(), _id(browser, "error").text

    # the body the page sent, then the same body straight to the API
    sent = json.loads(_id(browser, "request-json").get_attribute("textContent"))
    assert set(sent) == {"history", "query", "passages"} and len(sent["history"]) == 2 and len(sent["passages"]) == 2
    shown = json.loads(_id(browser, "response-json").get_attribute("textContent"))
    r = httpx.post(f"{url}/v1/clarify", json=sent, headers={"X-API-Key": KEY}, timeout=120)
    assert r.status_code == 200, r.text
    direct = r.json()
    assert direct["model_version"] == shown["model_version"] == str(folder)
    assert direct["threshold"] == shown["threshold"] == 0.0
    assert shown["needs_clarification"] == direct["needs_clarification"]
    assert shown["confidence"] == pytest.approx(direct["confidence"], abs=1e-4)
    conf, thr, ask = shown["confidence"], shown["threshold"], shown["needs_clarification"]

    # what is rendered is that answer
    decision = _id(browser, "decision")
    assert decision.get_attribute("data-value") == ("ask" if ask else "dont-ask")
    assert decision.text.startswith("Ask:" if ask else "Don't ask:")
    assert _id(browser, "confidence").text == f"{conf:.3f}"
    assert float(_id(browser, "confidence").get_attribute("data-value")) == pytest.approx(direct["confidence"], abs=1e-4)
    assert _id(browser, "threshold").text == f"{thr:.3f}"
    assert float(_id(browser, "threshold").get_attribute("data-value")) == direct["threshold"]
    assert _id(browser, "confidence-fill").value_of_css_property("width") != "0px" or conf == 0
    assert _percent(browser, "confidence-fill", "width") == pytest.approx(conf * 100, abs=0.01)
    assert _percent(browser, "threshold-marker", "left") == pytest.approx(thr * 100, abs=0.01)
    assert _id(browser, "threshold-marker").is_displayed()
    assert _id(browser, "model-version").text == str(folder)
    assert _id(browser, "invalid-note").is_displayed() == (not shown["valid_output"])
    if shown["question"]:
        assert _id(browser, "question").text == shown["question"]
    else:
        assert not _id(browser, "question").is_displayed()
    # grounding: exactly the turns and passages the answer names are highlighted
    grounded = browser.find_elements(By.CSS_SELECTOR, "#transcript li.grounded")
    assert {int(e.get_attribute("data-turn")) for e in grounded if e.get_attribute("data-turn")} == \
        set(shown["grounding"]["turns"])
    assert {e.get_attribute("data-passage") for e in grounded if e.get_attribute("data-passage")} == \
        set(shown["grounding"]["passages"])
    assert len(browser.find_elements(By.CSS_SELECTOR, "#transcript li")) == 2 + 2 + 1  # turns, passages, latest

    # nothing came from anywhere but the app, and the page logged no error
    origin = url[: url.index(PREFIX)]
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(u.startswith(origin + PREFIX + "/") for u in loaded), loaded
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors

    shot = _screenshot(browser, tmp_path, "playground.png")
    print(f"\nplayground screenshot: {shot} (copy: {ARTIFACTS / 'playground.png'}); answer: ask={ask} "
          f"P(clarify)={conf:.3f} threshold={thr:.3f} question={shown['question']!r} grounding={shown['grounding']}")


@pytest.mark.timeout(600)
def test_playground_errors_are_one_readable_line(server, browser, tmp_path):
    url, _ = server
    _open(browser, f"{url}/")  # the prefix's root serves the page as well
    _id(browser, "load-example").click()

    def error_after_clarify() -> str:
        _click_clarify(browser)
        err = _id(browser, "error")
        assert err.is_displayed() and not _id(browser, "result").is_displayed()
        text = err.text
        assert "\n" not in text and "{" not in text and "[" not in text, text  # a sentence, not a dump
        return text

    _set(browser, "api-key", "")
    assert error_after_clarify().startswith("Unauthorized (HTTP 401): missing API key")
    _set(browser, "api-key", "wrong-" + KEY)
    text = error_after_clarify()
    assert text.startswith("Unauthorized (HTTP 401): invalid API key") and KEY not in text

    _set(browser, "api-key", KEY)
    _set(browser, "query", "")
    text = error_after_clarify()
    assert text.startswith("Invalid request (HTTP 422): query: "), text

    _set(browser, "query", "and the other one?")
    for _ in range(MAX_HISTORY + 1 - len(browser.find_elements(By.CSS_SELECTOR, "#turns .turn-row"))):
        _id(browser, "add-turn").click()
        browser.find_elements(By.CSS_SELECTOR, "#turns .turn-text")[-1].send_keys("one more turn")
    text = error_after_clarify()
    assert text == (f"Request too large (HTTP 413): history has {MAX_HISTORY + 1} turns; max_history_turns is "
                    f"{MAX_HISTORY}"), text
    _screenshot(browser, tmp_path, "playground-error.png")

    # A 503 cannot be had cheaply from the real app: the page's next fetch gets the ingress's
    # latency-budget refusal (its body and Retry-After), then Serve's proxy's plain-text one.
    for body, ctype, expected in (
            ('{"detail": {"error": "overloaded", "limit": "latency_budget_s", "max": 5.0, "message": "9 requests '
             'are already being answered; retry after 2s"}}', "application/json",
             "Unavailable (HTTP 503): 9 requests are already being answered; retry after 2s"),
            ("Service Unavailable", "text/plain", "Unavailable (HTTP 503): Service Unavailable; retry after 2 s")):
        browser.execute_script(
            "const real = window.fetch; window.fetch = async () => { window.fetch = real; return new Response("
            "arguments[0], {status: 503, headers: {'Content-Type': arguments[1], 'Retry-After': '2'}}); };", body, ctype)
        assert error_after_clarify() == expected

    # the pasted-text format fills the rows; the last user line becomes the latest message
    browser.find_element(By.CSS_SELECTOR, "#paste summary").click()
    _set(browser, "query", "")
    _set(browser, "paste-text", "user: I rent two flats.\nassistant: How can I help?\nsecond line\nuser: End the lease.")
    _id(browser, "paste-apply").click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#turns .turn-row")
    assert [(r.find_element(By.CLASS_NAME, "turn-role").get_attribute("value"),
             r.find_element(By.CLASS_NAME, "turn-text").get_attribute("value")) for r in rows] == [
        ("user", "I rent two flats."), ("assistant", "How can I help?\nsecond line")]
    assert _id(browser, "query").get_attribute("value") == "End the lease."
    _click_clarify(browser)
    assert _id(browser, "result").is_displayed() and not _id(browser, "error").is_displayed()
