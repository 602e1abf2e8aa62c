"""End to end in a real browser: `streamlit run app.py`, Debian's chromium driven by Playwright visits
every page, does one thing on it, and finds no exception on screen.

After an action the test waits for the server to say that the script it started has finished (a
`script_finished` message on the page's websocket), then for the page to settle: no fixed sleeps."""

import os
import shutil
from pathlib import Path

import pytest

from kitty_core.browser import PAGE_PATHS, serve_app, settle

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = Path(os.environ.get("KITTY_SCREENSHOTS", "/tmp/kitty-screenshots"))


@pytest.fixture(scope="module")
def server():
    if not Path(CHROMIUM).exists():
        message = "Debian's chromium is needed for the browser test: apt-get install chromium"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    SHOTS.mkdir(parents=True, exist_ok=True)
    with serve_app(SHOTS / "streamlit.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"])
        yield b
        b.close()


def _no_exception(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0, f"{name}: an exception is on screen"
    # the entry point shows an error no page handled as a message (`kitty_app.failed`), not as an exception
    assert page.get_by_text("stopped on an error").count() == 0, f"{name}: an unhandled error is on screen"


def _set_number(page, label: str, value) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(str(value))
    box.press("Enter")


def _script_finished(payload) -> bool:
    """Is this websocket frame the server's message that a script run ended (not one cut short by a rerun)?"""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    if isinstance(payload, str):
        return False
    msg = ForwardMsg()
    try:
        msg.ParseFromString(payload)
    except Exception:  # noqa: BLE001 - not a ForwardMsg
        return False
    return msg.WhichOneof("type") == "script_finished" and msg.script_finished != ForwardMsg.FINISHED_EARLY_FOR_RERUN


def _run_sweep(page) -> None:
    page.get_by_label("Generated tokens", exact=True).fill("64")  # in a form: no rerun until the button
    page.get_by_label("Cache budget (GiB, 0 = until out of memory)", exact=True).fill("0.03")
    page.get_by_role("button", name="Run sweep").click()


# per page, the steps of one thing a user does there; each step starts one script run
ACTIONS = [
    ("overview", [lambda p: _set_number(p, "KV memory budget (GiB)", 40)]),
    ("key_statistics", [lambda p: _set_number(p, "Layer", 3)]),
    ("sensitivity", [lambda p: _set_number(p, "KV head", 1)]),
    ("boost_rate", [lambda p: p.get_by_role("radiogroup", name="Metric").get_by_text("perplexity").click()]),
    ("generations", [lambda p: p.get_by_role("radiogroup", name="Prompt").get_by_text("Short prompt").click(),
                     lambda p: _set_number(p, "New tokens", 8),
                     lambda p: p.get_by_role("button", name="Run on the loaded model").first.click()]),
    ("memory_and_throughput", [_run_sweep]),
    ("where_the_error_comes_from", [lambda p: p.get_by_role("radiogroup", name="Attention error")
                                    .get_by_text("attention output error (relative, %)").click()]),
]
PAGES = [(path, name, action) for path, (name, action) in zip(PAGE_PATHS, ACTIONS)]


@pytest.mark.parametrize("path, name, action", PAGES, ids=[p[1] for p in PAGES])
def test_page_in_chromium(server, browser, path, name, action):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    sockets = []
    page.on("websocket", lambda ws: sockets.append(ws))
    page.goto(f"{server}/{path}")
    page.wait_for_selector(".js-plotly-plot", timeout=240_000)  # every page draws a chart from real data
    settle(page)
    _no_exception(page, name)
    nav = page.locator('[data-testid="stSidebarNav"]').inner_text()
    assert "Overview" in nav and "Memory and throughput" in nav, nav
    stream = next(ws for ws in sockets if ws.url.endswith("/_stcore/stream"))
    for step in action:
        with stream.expect_event("framereceived", predicate=_script_finished, timeout=600_000):
            step(page)
        settle(page)
    _no_exception(page, f"{name}-after")
    page.close()
