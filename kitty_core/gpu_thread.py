"""GPU work on one long-lived thread, whatever thread asks for it.

A server such as Streamlit runs each script run on a new thread. torch keeps state per thread for
compiled and graphed code (the CUDA-graph trees of `torch.compile`'s reduce-overhead mode, dynamo's
thread-local settings), so work handed out from many short-lived threads builds that state again on
each, and leaves the old threads' copies to be torn down whenever those threads end. `GpuThread`
runs every call on the same thread instead, one at a time, for the whole process (`shared()`).

The caller's callbacks (progress bars, streamed text: anything that touches the caller's UI) are
marked with `on_caller` and run on the caller's thread, which waits for the call and serves them as
they come; an exception a callback raises there (a Stop pressed in the page, say) is raised inside
the GPU call at the point that made the callback, so the work ends the way it would have ended had
it run on the caller's thread. A callback must not itself hand work to the GPU thread (that work
would wait behind the call that waits for the callback): it raises instead. A generator's items are
handed over the same way (`iterate`); leaving the loop early closes the generator on the GPU thread.

The caller's thread-local torch settings (grad mode, autocast, the current device and stream) are
not carried over: the work sets what it needs, as the library's entry points do (inference mode).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator


class on_caller:  # noqa: N801 - a marker used like a function: on_caller(progress)
    """Mark a callable argument of `GpuThread.call` / `iterate` to run on the calling thread."""

    def __init__(self, fn: Callable):
        self.fn = fn


class _Channel:
    """The requests of one call's GPU-side work to its waiting caller (callbacks, items), and their
    answers. Once the caller stops serving (the call ended, or its wait was interrupted), requests
    already made are answered with an error and new ones raise one: the GPU thread never waits on a
    caller that is gone."""

    def __init__(self):
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.lock, self.open = threading.Lock(), True

    def ask(self, request: tuple) -> Future:
        answer: Future = Future()
        with self.lock:
            if not self.open:
                raise RuntimeError("the caller of this GPU call has stopped waiting for it")
            self.requests.put((*request, answer))
        return answer

    def relayed(self, values) -> list:
        """`on_caller` arguments as stand-ins that ask the caller to make the call."""

        def relay(fn: Callable) -> Callable:
            return lambda *args, **kwargs: self.ask(("call", fn, args, kwargs)).result()

        return [relay(v.fn) if isinstance(v, on_caller) else v for v in values]

    def close(self, why: BaseException) -> None:
        with self.lock:
            self.open = False
        while True:
            try:
                request = self.requests.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                request[-1].set_exception(why)


_serving = threading.local()  # a thread's waiting calls: callbacks they serve must not call the GPU thread


class GpuThread:
    """One worker thread for GPU work (see the module's docstring); `shared()` is the process's."""

    def __init__(self, name: str = "kitty-gpu"):
        # a daemon thread: a server stopped mid-run exits without waiting for the run to finish
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def on_thread(self) -> bool:
        """Is the current thread the GPU thread? (Calls made on it run inline, their callbacks too.)"""
        return threading.current_thread() is self._thread

    def call(self, fn: Callable, /, *args, **kwargs) -> Any:
        """fn(*args, **kwargs) on the GPU thread; its result, or its exception raised here. Arguments
        wrapped in `on_caller` are called back on this thread while it waits."""
        if self.on_thread():
            return fn(*_unwrapped(args), **dict(zip(kwargs, _unwrapped(kwargs.values()))))
        channel = self._channel()
        args, kwargs = channel.relayed(args), dict(zip(kwargs, channel.relayed(kwargs.values())))
        job = self._submit(fn, *args, **kwargs)
        job.add_done_callback(lambda _: channel.requests.put(None))
        with _waiting(channel):
            while (request := channel.requests.get()) is not None:
                _answer(request)
        return job.result()

    def iterate(self, fn: Callable[..., Iterator], /, *args, **kwargs) -> Iterator:
        """The items of the generator fn(*args, **kwargs), run on the GPU thread, one at a time: the
        GPU thread waits while this thread handles an item. Leaving the loop early (a break, an
        exception) closes the generator there; its exception ends the loop here. The GPU thread
        waits as long as this iterator is suspended: loop over it in a `for` statement, or close it."""
        if self.on_thread():
            yield from fn(*_unwrapped(args), **dict(zip(kwargs, _unwrapped(kwargs.values()))))
            return
        channel = self._channel()
        args, kwargs = channel.relayed(args), dict(zip(kwargs, channel.relayed(kwargs.values())))

        def produce() -> None:
            gen = fn(*args, **kwargs)
            try:
                for item in gen:
                    if not channel.ask(("item", item)).result():  # False: the consumer left the loop
                        return
            finally:
                gen.close()

        job = self._submit(produce)
        job.add_done_callback(lambda _: channel.requests.put(None))
        leaving = None
        with _waiting(channel):
            while (request := channel.requests.get()) is not None:  # None: the producer has ended
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
        if leaving is None or isinstance(leaving, GeneratorExit):
            job.result()  # the producer's exception, its cleanup's included, as a generator's close raises it
        if leaving is not None:
            raise leaving

    def _channel(self) -> _Channel:
        if getattr(_serving, "depth", 0):
            raise RuntimeError("a callback of a GPU call cannot hand work to the GPU thread: the thread is "
                               "busy with the call that waits for the callback")
        return _Channel()

    def _submit(self, fn: Callable, *args, **kwargs) -> Future:
        job: Future = Future()
        self._jobs.put((job, fn, args, kwargs))
        return job

    def _work(self) -> None:
        while True:
            job, fn, args, kwargs = self._jobs.get()
            job.set_running_or_notify_cancel()
            try:
                job.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 - the caller's to raise; the thread serves on
                job.set_exception(err)


class _waiting:
    """While a thread serves a call's channel: it is marked as serving, and however it stops (the
    call's end, an exception in its wait), the channel is closed."""

    def __init__(self, channel: _Channel):
        self.channel = channel

    def __enter__(self):
        _serving.depth = getattr(_serving, "depth", 0) + 1

    def __exit__(self, kind, err, tb):
        _serving.depth -= 1
        self.channel.close(err or RuntimeError("the GPU call's caller has stopped waiting for it"))


def _unwrapped(values) -> list:
    return [v.fn if isinstance(v, on_caller) else v for v in values]


def _answer(request: tuple) -> None:
    _, fn, args, kwargs, answer = request
    try:
        answer.set_result(fn(*args, **kwargs))
    except BaseException as err:  # noqa: BLE001 - handed to the GPU thread, which raises it in the work
        answer.set_exception(err)


_SHARED: GpuThread | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> GpuThread:
    """The process's GPU thread (made at the first call): one for the whole process, whatever caches
    a server clears."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = GpuThread()
        return _SHARED


__all__ = ["GpuThread", "on_caller", "shared"]
