"""The Python memory allocator a lab process runs with, and the one the lab needs on a GPU.

On a GPU, lab processes that ran with CPython's own small-object allocator (pymalloc, the default)
ended with a segmentation fault after their first live runs: five runs of five, at a point that moves
(a garbage collection in the main thread, plotly, Dynamo), memory damaged earlier by code that has
not been found. The same pages and live runs with the C library's allocator (`PYTHONMALLOC=malloc`)
completed (`docs/results.md`, "The whole lab on one H200"). pymalloc relies on the GIL, the C
library's allocator does not, so the damage is most likely a Python object allocated or freed by
native code in a thread that does not hold the GIL. Until that code is found, the lab asks for the C
library's allocator on a GPU: `serve_app` and `bench app --headless` set it, and the sidebar says
how to start the lab with it.

The allocator is chosen when Python starts, from the environment; a running process cannot change it.
"""

from __future__ import annotations

import os

VARIABLE = "PYTHONMALLOC"
THREAD_SAFE = ("malloc", "malloc_debug")  # the C library's allocator, with or without Python's checks
LAB_COMMAND = f"{VARIABLE}=malloc streamlit run app.py"


def pymalloc_in_use(environ=None) -> bool:
    """Does a process started with this environment (default: this process's) use pymalloc?"""
    environ = os.environ if environ is None else environ
    return environ.get(VARIABLE, "") not in THREAD_SAFE


def lab_environment(environ=None) -> dict:
    """The environment to start a lab process on a GPU with: `environ` with the C library's allocator."""
    environ = os.environ if environ is None else environ
    return {**environ, VARIABLE: "malloc"} if pymalloc_in_use(environ) else dict(environ)


def gpu_lab_note(device_type: str, environ=None) -> str | None:
    """What the lab tells a user whose model is on a GPU in a process that uses pymalloc; None where
    nothing needs saying."""
    if device_type != "cuda" or not pymalloc_in_use(environ):
        return None
    return (f"This lab runs with Python's own memory allocator, with which lab processes on a GPU have "
            f"ended in a segmentation fault after their first live runs. Restart it as `{LAB_COMMAND}` "
            f"(docs/results.md, \"The whole lab on one H200\").")
