"""The whole lab headless, timed: every page through Streamlit's AppTest in one process, on the device
the sidebar picks ("auto": the GPU where there is one), then every button that runs a live
computation. Where the browser timing (`bench app`) needs chromium, this needs only streamlit, so it
runs on a GPU machine without a display."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
PAGE_FILES = ["app.py"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pages").glob("*.py"))
# the buttons that start a computation on the loaded model (labels as the pages write them)
LIVE_BUTTONS = ("Run on the loaded model", "Run the sweep", "Run sweep")


def _outcome(at) -> str:
    problems = [f"exception: {e.value}" for e in at.exception] + [f"error: {e.value}" for e in at.error]
    return "; ".join(problems)[:300] or "ok"


def time_lab(live: bool = True, timeout_s: float = 1800, progress=None) -> pd.DataFrame:
    """Per page: the first render (which loads the model and the page's analyses), a second render
    (Streamlit's caches), and with `live` each live-run button pressed once. Streamlit's caches are
    the process's, so later pages find the model loaded, as in one browser session."""
    from streamlit.testing.v1 import AppTest

    rows = []
    steps = len(PAGE_FILES) * (2 + (len(LIVE_BUTTONS) if live else 0))

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
        for label in LIVE_BUTTONS:
            found = [b for b in at.button if b.label == label]
            if found:
                timed(page, f"'{label}'", at, lambda b=found[0]: b.click().run())
    return pd.DataFrame(rows)
