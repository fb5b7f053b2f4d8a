"""Headless chromium for the pages' browser tests (Debian's chromium and chromium-driver, driven by selenium).

``missing()`` names what is not installed (the tests skip with it); ``headless_chrome(folder)`` yields a driver that
resolves no host name but 127.0.0.1, so a page under test cannot reach anything else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

CHROMIUM = os.environ.get("CLARIFIER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = os.environ.get("CLARIFIER_CHROMEDRIVER") or shutil.which("chromedriver")


def missing() -> list[str]:
    out = []
    try:
        import selenium  # noqa: F401
    except ImportError:
        out.append("the selenium package (pyproject's test extra: pip install -e '.[test]')")
    if not CHROMIUM:
        out.append("chromium (apt-get install chromium)")
    if not CHROMEDRIVER:
        out.append("chromedriver (apt-get install chromium-driver)")
    return out


@contextlib.contextmanager
def headless_chrome(folder: Path, window: str = "1280,1200"):
    """A headless chromium (profile and chromedriver log under ``folder``), quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={window}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
                "--disable-background-networking", "--disable-component-update", "--disable-default-apps",
                "--disable-domain-reliability", "--no-pings", "--dns-prefetch-disable",
                "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
                # nothing but this machine: every other host name fails to resolve
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                f"--user-data-dir={folder / 'profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER,
                                              log_output=str(folder / "chromedriver.log")), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def label_server(queue: Path, out: Path, port: int, *extra: str):
    """``clarifier label serve`` on ``queue`` / ``out`` as its own process, once its API answers (60 s at most)."""
    import subprocess
    import sys
    import time

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "clarifier.cli", "label", "serve", "--queue", str(queue), "--out",
                             str(out), "--port", str(port), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"label serve exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/progress", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("label serve did not start in 60 s")
