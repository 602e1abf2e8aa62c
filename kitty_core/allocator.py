"""The Python memory allocator a lab process runs with, and the one the lab asks for on a GPU.

On a GPU, every lab process that ran with CPython's own small-object allocator (pymalloc, the
default) and reached its live runs ended with a segmentation fault: seven of seven, at a point that
moves (a garbage collection in the main thread, plotly, Dynamo), so memory was damaged earlier by
code that has not been found. With the C library's allocator (`PYTHONMALLOC=malloc`) one run of five
pages and all their live runs completed, and one with the C library's heap checks ran past the
points where the others had faulted (`docs/results.md`, "The whole lab on one H200"). pymalloc
relies on the GIL and the C library's allocator does not, which fits native code that allocates or
frees a Python object without the GIL; a change of heap layout hiding an overrun would fit as well.
Until the cause is found, the lab asks for the C library's allocator on a GPU: `serve_app` and
`bench app --headless` start their processes with it, and the sidebar says how to start the lab
with it.

The allocator is chosen when Python starts, from the environment (which `python -E` and `-I`
ignore); a running process cannot change it.
"""

from __future__ import annotations

import os

VARIABLE = "PYTHONMALLOC"
THREAD_SAFE = ("malloc", "malloc_debug", "mimalloc", "mimalloc_debug")  # allocators with their own locks
LAB_COMMAND = f"{VARIABLE}=malloc streamlit run app.py"


def pymalloc_in_use(environ=None) -> bool:
    """Does a process started with this environment (default: this process's) use pymalloc?"""
    environ = os.environ if environ is None else environ
    return environ.get(VARIABLE, "") not in THREAD_SAFE


def lab_environment(environ=None) -> dict:
    """`environ` (default: this process's) with the C library's allocator in place of pymalloc, keeping
    Python's debug hooks where they were asked for (`debug`, `pymalloc_debug` -> `malloc_debug`)."""
    environ = dict(os.environ if environ is None else environ)
    if pymalloc_in_use(environ):
        environ[VARIABLE] = "malloc_debug" if environ.get(VARIABLE, "").endswith("debug") else "malloc"
    return environ


def gpu_lab_note(device_type: str, environ=None) -> str | None:
    """What the lab tells a user whose model is on a GPU in a process that uses pymalloc; None where
    nothing needs saying."""
    if device_type != "cuda" or not pymalloc_in_use(environ):
        return None
    return (f"This lab runs with Python's own memory allocator, with which lab processes on a GPU have "
            f"ended in a segmentation fault after their first live runs. Restart it as `{LAB_COMMAND}` "
            f"(docs/results.md, \"The whole lab on one H200\").")
