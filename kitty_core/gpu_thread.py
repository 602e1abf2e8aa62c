"""GPU work on one long-lived thread, whatever thread asks for it.

A server such as Streamlit runs each script run on a new thread. torch keeps state per thread for
compiled and graphed code (the CUDA-graph trees of `torch.compile`'s reduce-overhead mode, dynamo's
thread-local settings), so work handed out from many short-lived threads builds that state again on
each, and leaves the old threads' copies to be torn down whenever those threads end. `GpuThread`
runs every call on the same thread instead, one at a time, for the whole process.

The caller's callbacks (progress bars, streamed text: anything that touches the caller's UI) are
marked with `on_caller` and run on the caller's thread, which waits for the call and serves them as
they come; an exception a callback raises there (a Stop pressed in the page, say) is raised inside
the GPU call at the point that made the callback, so the work ends the way it would have ended had
it run on the caller's thread. A generator's items are handed over the same way (`iterate`), and
leaving the loop early closes the generator on the GPU thread.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator


class on_caller:  # noqa: N801 - a marker used like a function: on_caller(progress)
    """Mark a callable argument of `GpuThread.call` / `iterate` to run on the calling thread."""

    def __init__(self, fn: Callable):
        self.fn = fn


class GpuThread:
    """One worker thread for the process's GPU work (see the module's docstring)."""

    def __init__(self, name: str = "kitty-gpu"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._thread: threading.Thread | None = None

    def on_thread(self) -> bool:
        """Is the current thread the GPU thread? (Calls from it run inline: no waiting on itself.)"""
        return threading.current_thread() is self._thread

    def call(self, fn: Callable, /, *args, **kwargs) -> Any:
        """fn(*args, **kwargs) on the GPU thread; its result, or its exception raised here. Arguments
        wrapped in `on_caller` are called back on this thread while it waits."""
        if self.on_thread():
            return fn(*_unwrapped(args), **dict(zip(kwargs, _unwrapped(kwargs.values()))))
        requests: queue.SimpleQueue = queue.SimpleQueue()
        args, kwargs = _relayed(args, requests), dict(zip(kwargs, _relayed(kwargs.values(), requests)))
        job = self._pool.submit(self._enter, fn, *args, **kwargs)
        job.add_done_callback(lambda _: requests.put(None))
        _serve(requests)
        return job.result()

    def iterate(self, fn: Callable[..., Iterator], /, *args, **kwargs) -> Iterator:
        """The items of the generator fn(*args, **kwargs), run on the GPU thread, one at a time: the
        GPU thread waits while this thread handles an item. Leaving the loop early (a break, an
        exception) closes the generator there; its exception ends the loop here."""
        if self.on_thread():
            yield from fn(*_unwrapped(args), **dict(zip(kwargs, _unwrapped(kwargs.values()))))
            return
        requests: queue.SimpleQueue = queue.SimpleQueue()
        args, kwargs = _relayed(args, requests), dict(zip(kwargs, _relayed(kwargs.values(), requests)))

        def produce() -> None:
            gen = fn(*args, **kwargs)
            try:
                for item in gen:
                    handed: Future = Future()
                    requests.put(("item", item, handed))
                    if not handed.result():  # False: the consumer left the loop
                        return
            finally:
                gen.close()

        job = self._pool.submit(self._enter, produce)
        job.add_done_callback(lambda _: requests.put(None))
        leaving = None
        while (request := requests.get()) is not None:  # None: the producer has ended
            if request[0] != "item":
                _answer(request)
                continue
            _, item, handed = request
            if leaving is not None:
                handed.set_result(False)
                continue
            try:
                yield item
            except BaseException as err:  # noqa: BLE001 - GeneratorExit, a Stop: end the producer, then re-raise
                leaving = err
                handed.set_result(False)
                continue
            handed.set_result(True)
        if leaving is not None:
            raise leaving
        job.result()  # the producer's exception, if it raised one

    def _enter(self, fn: Callable, *args, **kwargs) -> Any:
        self._thread = threading.current_thread()
        return fn(*args, **kwargs)


def _unwrapped(values) -> list:
    return [v.fn if isinstance(v, on_caller) else v for v in values]


def _relayed(values, requests: queue.SimpleQueue) -> list:
    """`on_caller` arguments as stand-ins that ask the waiting thread to make the call."""

    def relay(fn: Callable) -> Callable:
        def stand_in(*args, **kwargs):
            answer: Future = Future()
            requests.put(("call", fn, args, kwargs, answer))
            return answer.result()  # the callback's result, or its exception raised here

        return stand_in

    return [relay(v.fn) if isinstance(v, on_caller) else v for v in values]


def _answer(request: tuple) -> None:
    _, fn, args, kwargs, answer = request
    try:
        answer.set_result(fn(*args, **kwargs))
    except BaseException as err:  # noqa: BLE001 - handed to the GPU thread, which raises it in the work
        answer.set_exception(err)


def _serve(requests: queue.SimpleQueue) -> None:
    """Make the callbacks the GPU thread asks for until its job is done (the None put at its end)."""
    while (request := requests.get()) is not None:
        _answer(request)


__all__ = ["GpuThread", "on_caller"]
