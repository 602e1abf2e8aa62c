"""The lab's pages, timed (what `bench app` runs), two ways. In chromium (`time_app`): a freshly
started lab served and driven as a user does, page after page through the sidebar, the first visit
and later ones. Headless (`time_lab`): every page through Streamlit's AppTest in one process, on the
device the sidebar picks ("auto": the GPU where there is one), then every button that runs a live
computation; where the browser timing needs chromium, this needs only streamlit, so it runs on a
GPU machine without a display."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
PAGE_FILES = ["app.py"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pages").glob("*.py"))
# the buttons that start a computation on the loaded model (labels as the pages write them)
LIVE_BUTTONS = ("Run on the loaded model", "Run the sweep", "Run sweep")
LIVE_SOURCE = "run on the loaded model"  # the option of the pages' "Results" radio that shows live runs


def _outcome(at) -> str:
    problems = [f"exception: {e.value}" for e in at.exception] + [f"error: {e.value}" for e in at.error]
    return "; ".join(problems)[:300] or "ok"


def time_lab(live: bool = True, timeout_s: float = 1800, progress=None) -> pd.DataFrame:
    """Per page: the first render (which loads the model and the page's analyses), a second render
    (Streamlit's caches), and with `live` each live-run button pressed once. Streamlit's caches are
    the process's, so later pages find the model loaded, as in one browser session. A crash of the
    process (a segmentation fault in a GPU library) leaves every thread's Python stack on stderr."""
    import faulthandler

    import streamlit.logger
    from streamlit.testing.v1 import AppTest

    faulthandler.enable()
    streamlit.logger.set_log_level("warning")  # AppTest runs the script at debug level
    rows = []
    steps = len(PAGE_FILES) * (4 if live else 2)  # about: two renders, then a page's live runs

    def timed(page, step, at, action):
        if progress:
            progress(len(rows), steps, f"{Path(page).stem}: {step}")
        start = time.perf_counter()
        action()
        rows.append({"page": Path(page).stem, "step": step, "seconds": time.perf_counter() - start,
                     "outcome": _outcome(at)})
        print(f"{Path(page).stem} / {step}: {rows[-1]['seconds']:.1f} s, {rows[-1]['outcome']}", flush=True)

    for page in PAGE_FILES:
        at = AppTest.from_file(str(ROOT / page), default_timeout=timeout_s)
        timed(page, "first render", at, at.run)
        timed(page, "second render", at, at.run)
        if not live:
            continue
        for radio in at.radio:
            if LIVE_SOURCE in radio.options:
                timed(page, f"'{LIVE_SOURCE}'", at, lambda r=radio: r.set_value(LIVE_SOURCE).run())
        live_buttons = [i for i, b in enumerate(at.button) if b.label in LIVE_BUTTONS]
        for n, i in enumerate(live_buttons):
            label = at.button[i].label + (f" ({n + 1})" if len(live_buttons) > 1 else "")
            timed(page, f"'{label}'", at, lambda i=i: at.button[i].click().run())
    return pd.DataFrame(rows)


def time_app(chromium: str, log: Path, visits: int = 2, progress=None) -> pd.DataFrame:
    """Seconds from opening each page of a freshly started lab (demo model) until its script has
    finished, in one tab, moving through the sidebar's navigation as a user does, visit after visit:
    the first visit pays for loading the model and the page's analyses, later ones find them in
    Streamlit's caches."""
    from playwright.sync_api import sync_playwright

    from .browser import PAGES, serve_app, settle

    rows = []
    with serve_app(log) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        for visit in range(1, visits + 1):
            for path, title in PAGES:
                if progress:
                    progress(len(rows), visits * len(PAGES), f"visit {visit}: {title}")
                start = time.time()
                if visit == 1 and not path:
                    page.goto(url)
                else:
                    page.locator('[data-testid="stSidebarNav"] a', has_text=title).first.click()
                page.wait_for_url(f"{url}/{path}", timeout=60_000)
                page.wait_for_selector(".js-plotly-plot", timeout=300_000)
                done = settle(page, timeout_s=300, quiet_s=0.5)
                rows.append({"page": title, "visit": visit, "seconds": done - start})
                print(f"visit {visit} {title}: {done - start:.1f} s", flush=True)
        browser.close()
    return pd.DataFrame(rows)
