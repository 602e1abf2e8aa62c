"""The lab in a real browser: start `streamlit run app.py` on a free local port, and wait for a page's
script to finish (shared by the browser test and `python -m kitty_core.bench app`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the seven pages: URL path (st.Page derives it from the file name in app.py), title in the navigation
PAGES = [("", "Overview"), ("Key_statistics", "Key statistics"), ("Sensitivity", "Sensitivity"),
         ("Boost_rate", "Boost rate"), ("Generations", "Generations"),
         ("Memory_and_throughput", "Memory and throughput"), ("Where_the_error_comes_from", "Where the error comes from")]
PAGE_PATHS = [path for path, _ in PAGES]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_app(log_path: Path, start_timeout_s: float = 90):
    """Run the app headless on 127.0.0.1 and yield its URL; the server's output goes to log_path
    (a file, not a pipe: an unread pipe would block the server)."""
    port = _free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port",
             str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + start_timeout_s
            while True:
                try:
                    if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                        break
                except OSError:
                    if time.time() > deadline or proc.poll() is not None:
                        raise RuntimeError(f"streamlit did not answer on /_stcore/health within "
                                           f"{start_timeout_s:.0f} s:\n{Path(log_path).read_text()}") from None
                    time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def settle(page, timeout_s: float = 240, quiet_s: float = 1.0) -> float:
    """Wait until the page's script has run to the end (the app's own script state) and stayed so
    for quiet_s; returns the time.time() at which it last stopped running."""
    app = page.locator('[data-testid="stApp"]')
    app.wait_for(timeout=timeout_s * 1000)
    deadline, quiet_since = time.time() + timeout_s, None
    while time.time() < deadline:
        if app.get_attribute("data-test-script-state") == "running":
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.time()
        elif time.time() - quiet_since > quiet_s:
            return quiet_since
        time.sleep(0.05)
    raise AssertionError(f"the page was still running after {timeout_s:.0f} s")
