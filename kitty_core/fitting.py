"""The largest batch of a cache kind that a model holds and decodes: doubling the batch from `start`
until the GPU runs out of memory (or the cache's bytes pass a budget, the way to run it on a CPU),
then bisecting to within 10% (`search`). A probe (`fits`) fills a fresh cache to all but one token
of the length and takes one decode step, so the batch that fits holds the whole generation; an
out-of-memory is caught and released, and is a row like any other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .baselines import decode_step, fill, make_cache
from .gpu_memory import allocated, cache_bytes, free, is_oom, peak_per_gpu, reset_peak, sync


def fits(model, kind: str, batch: int, length: int, budget_bytes: int | None = None) -> tuple[bool, dict]:
    """Can `batch` sequences of `length` tokens be held and decoded? (ok, measurements). Out of memory
    (or more cache bytes than `budget_bytes`) is caught and released."""
    free()
    base = allocated()
    reset_peak()
    cache = None
    try:
        cache = make_cache(kind, model, length)
        fill(cache, model, batch, length - 1)
        if budget_bytes is not None and cache_bytes(cache) > budget_bytes:
            return False, {"kv_bytes": cache_bytes(cache), "reason": "over budget"}
        decode_step(model, cache, batch)
        sync()
        kv = cache_bytes(cache)
        if budget_bytes is not None and kv > budget_bytes:
            return False, {"kv_bytes": kv, "reason": "over budget"}
        peak = peak_per_gpu() if torch.cuda.is_available() else base + kv
        return True, {"kv_bytes": kv, "kv_bytes_allocated": allocated() - base, "peak_bytes": peak}
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_oom(err):
            raise
        return False, {"reason": "out of memory"}
    finally:
        del cache
        free()


def search(model, kind: str, length: int, start: int = 1, limit: int = 1 << 14, budget_bytes: int | None = None,
           stop: Callable[[], bool] | None = None):
    """Largest batch of `length`-token sequences that fits: doubling from `start`, then bisection to
    within 10% (or 1); below `start` where `start` itself does not fit (an FP16 cache on a smaller
    GPU). A generator: yields each probe's row as it completes, returns (max batch, 0 where not even
    one sequence fits; first batch that failed or None)."""
    lo, hi, b = 0, None, start
    while b <= limit and not (stop and stop()):
        ok, info = fits(model, kind, b, length, budget_bytes)
        yield {"cache": kind, "batch": b, "fits": ok, **info}
        if not ok:
            hi = b
            break
        lo, b = b, b * 2
    while hi is not None and hi - lo > max(1, lo // 10) and not (stop and stop()):
        mid = (lo + hi) // 2
        ok, info = fits(model, kind, mid, length, budget_bytes)
        yield {"cache": kind, "batch": mid, "fits": ok, **info}
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, hi


def max_batch(model, kind: str, length: int, **kwargs) -> dict:
    """`search` run to the end: {"max_batch", "first_fail", "probes"}."""
    gen, probes = search(model, kind, length, **kwargs), []
    while True:
        try:
            probes.append(next(gen))
        except StopIteration as done:
            lo, hi = done.value
            return {"max_batch": lo, "first_fail": hi, "probes": probes}

