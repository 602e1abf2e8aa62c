"""End to end in a real browser: `streamlit run app.py`, Debian's chromium driven by Playwright visits
every page, does one thing on it, and finds no exception on screen."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = Path(os.environ.get("KITTY_SCREENSHOTS", "/tmp/kitty-screenshots"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    if not Path(CHROMIUM).exists():
        message = "Debian's chromium is needed for the browser test: apt-get install chromium"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    port = _free_port()
    SHOTS.mkdir(parents=True, exist_ok=True)
    log = open(SHOTS / "streamlit.log", "w")  # a file, not a pipe: an unread pipe would block the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
         "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("streamlit did not answer on /_stcore/health within 90 s:\n" + (SHOTS / "streamlit.log").read_text())
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"])
        yield b
        b.close()


def _settle(page, timeout_s: float = 240) -> None:
    """Wait until the script has run to the end (the app's own script state), steadily for a second."""
    app = page.locator('[data-testid="stApp"]')
    app.wait_for(timeout=timeout_s * 1000)
    deadline, quiet_since = time.time() + timeout_s, None
    while time.time() < deadline:
        if app.get_attribute("data-test-script-state") == "running":
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.time()
        elif time.time() - quiet_since > 1.0:
            return
        time.sleep(0.25)
    raise AssertionError(f"the page was still running after {timeout_s:.0f} s")


def _no_exception(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0, f"{name}: an exception is on screen"


def _set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(str(value))
    box.press("Enter")


PAGES = [
    ("", "overview", lambda p: _set_number(p, "KV memory budget (GiB)", 40)),
    ("Key_statistics", "key_statistics", lambda p: _set_number(p, "Layer", 3)),
    ("Sensitivity", "sensitivity", lambda p: _set_number(p, "KV head", 1)),
    ("Boost_rate", "boost_rate", lambda p: p.get_by_role("radiogroup", name="Metric").get_by_text("perplexity").click()),
    ("Generations", "generations", lambda p: _set_number(p, "New tokens", 8)),
    ("Memory_and_throughput", "memory_and_throughput", lambda p: _run_sweep(p)),
]


def _run_sweep(page) -> None:
    page.get_by_label("Generated tokens", exact=True).fill("64")
    page.get_by_role("button", name="Run sweep").click()


@pytest.mark.parametrize("path, name, action", PAGES, ids=[p[1] for p in PAGES])
def test_page_in_chromium(server, browser, path, name, action):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{server}/{path}")
    page.wait_for_selector(".js-plotly-plot", timeout=240_000)  # every page draws a chart from real data
    _settle(page)
    _no_exception(page, name)
    action(page)
    time.sleep(0.5)
    _settle(page)
    _no_exception(page, f"{name}-after")
    page.close()
