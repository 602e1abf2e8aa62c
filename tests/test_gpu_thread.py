"""kitty_core.gpu_thread: every call on one thread, callbacks and items on the caller's."""

import threading

import pytest

from kitty_core.gpu_thread import GpuThread, on_caller, shared


class Stopped(Exception):
    pass


def _work(n, progress):
    for i in range(n):
        progress(i, threading.current_thread())
    return threading.current_thread()


def _items(n, closed):
    try:
        for i in range(n):
            yield i, threading.current_thread()
    finally:
        closed.append(threading.current_thread())


def test_calls_from_any_thread_run_on_one_thread_and_callbacks_on_the_caller():
    gpu, seen = GpuThread(), []

    def progress(i, worker):
        seen.append((i, worker, threading.current_thread()))

    first = gpu.call(_work, 2, progress=on_caller(progress))
    box = []
    other = threading.Thread(
        target=lambda: box.append((gpu.call(_work, 1, on_caller(progress)), threading.current_thread())))
    other.start()
    other.join()
    second, caller = box[0]
    assert first is second and first is not threading.current_thread()
    here = threading.current_thread()
    assert seen == [(0, first, here), (1, first, here),
                    (0, first, caller)]


def test_a_callbacks_exception_ends_the_work_and_reaches_the_caller():
    gpu, reached = GpuThread(), []

    def stop(i, worker):
        reached.append(i)
        raise Stopped("pressed")

    with pytest.raises(Stopped, match="pressed"):
        gpu.call(_work, 5, progress=on_caller(stop))
    assert reached == [0]  # the work ended at its first callback
    with pytest.raises(ZeroDivisionError):
        gpu.call(lambda: 1 / 0)
    assert gpu.call(lambda: 7) == 7  # the thread lives on


def test_iterate_hands_items_over_and_closes_the_generator_on_the_gpu_thread():
    gpu, closed = GpuThread(), []
    got = list(gpu.iterate(_items, 3, closed))
    worker = got[0][1]
    assert [i for i, _ in got] == [0, 1, 2] and {w for _, w in got} == {worker} and closed == [worker]
    for i, _ in gpu.iterate(_items, 10, closed):
        if i == 1:
            break
    assert closed == [worker, worker]  # closed by the break, on the GPU thread
    with pytest.raises(Stopped):
        for i, _ in gpu.iterate(_items, 10, closed):
            raise Stopped
    assert len(closed) == 3


def test_iterate_raises_the_producers_exception_after_its_items():
    def broken():
        yield 1
        raise ValueError("producer")

    gpu, got = GpuThread(), []
    with pytest.raises(ValueError, match="producer"):
        for x in gpu.iterate(broken):
            got.append(x)
    assert got == [1]


def test_a_call_made_on_the_gpu_thread_runs_inline():
    gpu = GpuThread()
    assert gpu.call(lambda: gpu.call(threading.current_thread)) is gpu.call(threading.current_thread)
    assert gpu.call(lambda: list(gpu.iterate(_items, 2, []))[1][0]) == 1


def test_iterate_relays_callbacks_and_raises_the_producers_cleanup_error_on_close():
    def counted(n, progress):
        for i in range(n):
            progress(i)
            yield i

    gpu, seen = GpuThread(), []
    assert list(gpu.iterate(counted, 3, on_caller(lambda i: seen.append((i, threading.current_thread()))))) == [0, 1, 2]
    assert seen == [(i, threading.current_thread()) for i in range(3)]

    def cleanup_fails():
        try:
            yield 1
            yield 2
        finally:
            raise ValueError("cleanup")

    it = gpu.iterate(cleanup_fails)
    assert next(it) == 1
    with pytest.raises(ValueError, match="cleanup"):  # as closing a plain generator raises it
        it.close()


def test_the_gpu_thread_never_waits_on_a_caller_that_is_gone():
    gpu, kept = GpuThread(), []
    gpu.call(lambda progress: kept.append(progress), progress=on_caller(lambda: None))
    with pytest.raises(RuntimeError, match="stopped waiting"):  # a callback kept past its call
        gpu.call(lambda: kept[0]())
    it = gpu.iterate(_items, 5, [])
    next(it)
    it.close()  # a loop left by name: the producer ends, the thread is free
    assert gpu.call(lambda: 3) == 3


def test_a_callback_cannot_hand_work_to_the_gpu_thread():
    gpu = GpuThread()

    def nested():
        return gpu.call(lambda: 1)

    with pytest.raises(RuntimeError, match="cannot hand work"):
        gpu.call(lambda cb: cb(), on_caller(nested))
    with pytest.raises(RuntimeError, match="cannot hand work"):
        for _ in gpu.iterate(_items, 2, []):
            gpu.call(lambda: 1)
    assert gpu.call(lambda: 2) == 2
    assert shared() is shared()


def test_a_process_exits_while_the_gpu_thread_is_busy():
    """A server stopped mid-run does not wait for the run: the GPU thread is a daemon."""
    import subprocess
    import sys

    busy = ("import threading, time; from kitty_core.gpu_thread import shared; started = threading.Event(); "
            "work = lambda: (started.set(), time.sleep(3600)); "
            "threading.Thread(target=shared().call, args=(work,), daemon=True).start(); "
            "started.wait(); print('busy', flush=True)")
    done = subprocess.run([sys.executable, "-c", busy], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "busy", done.stderr[-500:]


def test_the_labs_runs_share_one_thread_across_script_runs():
    """Streamlit starts a thread per script run; the lab's model calls (`gpu_turn`) all run on one."""
    from streamlit.testing.v1 import AppTest

    def script():
        import threading

        import streamlit as st

        from kitty_app import gpu_turn
        from kitty_core.gpu_thread import on_caller

        with gpu_turn("The test run") as gpu:
            worker = gpu.call(threading.current_thread)
            gpu.call(lambda tick: tick(), tick=on_caller(lambda: st.write("called back")))
        runs = st.session_state.setdefault("runs", [])
        runs.append((worker, threading.current_thread()))

    at = AppTest.from_function(script, default_timeout=60).run()
    at.run()
    (w1, s1), (w2, s2) = at.session_state["runs"]
    assert not at.exception and at.markdown[0].value == "called back"
    assert w1 is w2 and s1 is not s2 and w1 not in (s1, s2)
