"""End-to-end throughput of KV caches on one model: how fast each generates at the largest batch
that fits and at one equal batch (the paper's Figure 5), estimated from timed decode steps.

A point is one (cache, batch size). Its decode speed is measured on a cache filled to a few lengths
between the prompt and the end of the generation (`timed_lengths`), and integrated over the
generation length (a full 8K-token generation at every batch size would take hours); a preset's
steps that pack pages, one every G steps (`pack_steps`), add what one costs beyond a plain step
(`_packing_ms`). `validate` runs one real generation to check that estimate, at any batch (its prompt
in the chunks the estimate fitted). A batch that holds the GPU at its power limit decodes a little
slower over a whole generation than in the few consecutive steps timed at each length, so check
the largest batches that way (a validation records the SM clock and power meanwhile, `telemetry`).
Decode steps are taken as `decode` says (`_decoder`): "compiled", through the model's compiled
forward as `generate` takes them (the Kitty caches on the Triton engine, `static-compiled`), the
FP16 baseline `fp16-prealloc` from CUDA graphs it captures itself; "graph", every cache of this
library from its own captured graphs; "eager". `sweep` runs the whole comparison: per cache the
largest batch (`fitting.search`), then `measure` there and at the equal batch.

The caches and how they are filled and stepped are in `baselines`; the bytes they hold, and the peak
of the fullest GPU, in `gpu_memory`. Prefill time is measured on a real prompt of random token ids,
on the second prefill of its shape in the process (the first compiles kernels).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from transformers.cache_utils import Cache

from .baselines import (BASELINES, CacheUnavailable, CompiledStaticCache, PreallocatedCache, decode_step, fill,
                        forward, make_cache, preset_kind, release_compiled)
from .fitting import search
from .gpu_memory import allocated, cache_bytes, free, is_oom, peak_per_gpu, reset_peak, sync
from .graphs import CompiledDecoder, GraphedDecoder, can_graph
from .telemetry import sampled


def _timed(fn) -> float:
    """Seconds of fn(), GPU work included."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def timed_lengths(kind: str, prompt: int, generate: int, points: int, room: int = 0) -> list[int]:
    """Cache lengths at which `measure` times decode steps: evenly spread from the prompt to `room`
    tokens before the end of the generation (the steps taken at the last point stay inside the
    length the max-batch probe held). For a Kitty preset each one moves (by less than a page) to the
    middle of a page, so that the few steps timed there never include a page being packed,
    whatever the preset's sink: otherwise a preset whose page boundaries fall on these lengths
    would be timed packing every time, which a real generation does once every G steps. For
    fp16-prealloc each moves to the start of a window of its device-driven steps, so that the steps
    timed there replay one captured graph. A point moves down instead where up would pass the last
    length, and stays where it is if neither fits."""
    last = max(prompt, prompt + generate - room)
    lengths = [prompt + round(i * (last - prompt) / max(points - 1, 1)) for i in range(points)]
    if kind == "fp16-prealloc":  # at the start of a window of its device-driven steps (one graph for all)
        step, offset = PreallocatedCache.WINDOW, 0
    else:
        c = None if kind in BASELINES else preset_kind(kind)[0]
        if c is None or not c.quantize:
            return lengths
        step, offset = c.group_size, c.sink + c.group_size // 2

    def place(n: int) -> int:
        up = n + (offset - n) % step
        for m in (up, up - step):
            if prompt <= m <= last:
                return m
        return n

    return [place(n) for n in lengths]


def pack_steps(kind: str, start: int, end: int) -> int:
    """Decode steps that pack pages while a batch of sequences (no padding) grows from `start` to
    `end` tokens: a page of keys when the key q-buffer fills (n - S a multiple of G), a page of
    values when the window holds R + G (n - S - R a multiple of G, from n - S = R + G), at most one
    packing step each. 0 for a cache that does not pack."""
    c = None if kind in BASELINES else preset_kind(kind)[0]
    if c is None or not c.quantize:
        return 0
    s, g, r = c.sink, c.group_size, c.local_window
    return sum(1 for n in range(start + 1, end + 1)
               if n > s and ((n - s) % g == 0 or (n - s - r >= g and (n - s - r) % g == 0)))


PREFILL_CHUNKS = (512, 128, 32)  # prompt tokens per prefill forward, tried in this order


DECODES = ("compiled", "graph", "eager")  # how `measure` and `validate` take decode steps (`_decoder`)
# steps before timing: CUDA graph trees run a compiled step's first call eagerly, record the second
# and replay from the third (a graphed loop captures on the second)
WARMUP = 3


def _decoder(model, cache: Cache, batch: int, decode: str):
    """How `measure` and `validate` decode. "compiled": a cache that `generate` compiles (a
    `KittyCache` on the Triton engine) decodes through the model's compiled forward, as `generate`
    does (`CompiledDecoder`); another cache that steps from device counters is "graph"ed; "graph":
    such a cache replays steps it captured itself (`GraphedDecoder`; eagerly from the counters
    without CUDA); any other cache, and every cache under "eager", takes eager steps (token id 1; a
    `CompiledStaticCache` through its compiled forward). Returns (one step, sync after the host
    changed the cache, how it decodes: "compiled", "graph", "device counters, eager", "eager" or
    "eager (why not from device counters)")."""
    if decode not in DECODES:
        raise ValueError(f"decode={decode!r}: one of {', '.join(DECODES)}")
    eager = (lambda: decode_step(model, cache, batch)), (lambda: None)  # noqa: E731
    if isinstance(cache, CompiledStaticCache):
        return (*eager, "compiled")
    if decode == "eager" or not can_graph(cache):
        return (*eager, "eager")
    try:
        if decode == "compiled" and getattr(cache, "is_compileable", False):
            decoder = CompiledDecoder(model, cache, batch)
            return decoder.step, decoder.sync, "compiled" if decoder.use_graph else "device counters, eager"
        decoder = GraphedDecoder(model, cache, batch)
    except ValueError as err:  # this cache cannot step from device counters: eager, and why
        return (*eager, f"eager ({err})")
    return decoder.step, decoder.sync, "graph" if decoder.use_graph else "device counters, eager"


@torch.inference_mode()
def measure(model, kind: str, batch: int, prompt: int, generate: int, points: int = 4, steps: int = 3,
            prefill_chunk: int = PREFILL_CHUNKS[0], decode: str = "eager") -> dict:
    """Prefill time (real forward on random ids, timed on its second run), decode step time at
    `points` cache lengths from the prompt to the end of the generation, their integral over the
    generation, peak memory.
    `decode`: how steps are taken where the cache allows ("compiled", "graph" or "eager", `_decoder`)."""
    free()
    device = next(model.parameters()).device
    reset_peak()
    base = allocated()
    room = WARMUP + steps  # warm-up and timed steps after each point
    lengths = timed_lengths(kind, prompt, generate, points, room)
    held = prompt
    for n in lengths:
        held = max(held, n) + room
    # the length the max-batch probe held (`fits`), so that a max batch that fitted there fits here
    # (more only for generations too short to hold every point's steps)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), device=device)

    def prefill(into: Cache) -> None:
        for s in range(0, prompt, prefill_chunk):
            forward(model, into, ids[:, s : s + prefill_chunk])

    # the prefill is timed on its second run, into a fresh cache: the first builds what a process
    # builds once per shape (Triton kernels, inductor's fused norms, cuDNN plans) and a server has
    # built before it serves. On an H200 the first took 9.7 s against 1.2 s (FP16, batch 96) and
    # 24.4 s against 9.7 s (kitty-pro, batch 544, 32-token chunks)
    cache = make_cache(kind, model, max(prompt + generate, held))
    prefill(cache)
    del cache
    free()
    cache = make_cache(kind, model, max(prompt + generate, held))
    prefill_s = _timed(lambda: prefill(cache))
    step_ms, step, sync, mode = [], None, None, "eager"
    pack_ms, packs = None, pack_steps(kind, prompt, prompt + generate)
    for i, n in enumerate(lengths):
        grow = n - cache.get_seq_length()
        if grow > 0:
            fill(cache, model, batch, grow)
        if step is None:
            step, sync, mode = _decoder(model, cache, batch, decode)
        sync()
        for _ in range(WARMUP):
            step()  # warm-up at this length (a graph's first step at a new shape runs eagerly, then it is captured)
        # consecutive steps, one sync: the host runs ahead of the GPU as in a real decode loop
        step_ms.append(1e3 * _timed(lambda: [step() for _ in range(steps)]) / steps)
        if packs and pack_ms is None:
            until = lengths[i + 1] if i + 1 < len(lengths) else prompt + generate
            pack_ms = _packing_ms(cache, step, steps, until)
    # KV bytes per token as a whole generation holds them: filled to the end (a preallocated cache's
    # allocations do not change; one that grows, or packs, takes its last tokens)
    rest = prompt + generate - cache.get_seq_length()
    if rest > 0:
        fill(cache, model, batch, rest)
    peak = peak_per_gpu() if torch.cuda.is_available() else None
    kv, view = cache_bytes(cache), cache_bytes(cache, views=True)
    tokens_held = int(cache.get_seq_length())
    del cache, step, sync
    free()
    decode_s = integrate(lengths, step_ms, prompt, prompt + generate) / 1e3
    if packs and pack_ms is not None:
        decode_s += packs * max(pack_ms, 0.0) / 1e3
    return {"cache": kind, "batch": batch, "prompt": prompt, "generate": generate, "prefill_chunk": prefill_chunk,
            "decode": mode, "prefill_s": prefill_s, "packing_steps": packs, "packing_ms": pack_ms,
            "decode_s": decode_s, "tokens_per_s": batch * generate / (prefill_s + decode_s),
            "decode_tokens_per_s": batch * generate / decode_s, "peak_bytes": peak, "base_bytes": base,
            "kv_bytes": kv, "kv_bytes_per_token": kv / (batch * tokens_held), "working_view_bytes": view,
            **{f"step_ms@{n}": ms for n, ms in zip(lengths, step_ms)}}


def _packing_ms(cache, step, steps: int, until: int) -> float | None:
    """What a decode step that packs pages costs beyond one that does not, in ms: steps (untimed) up
    to the next one that packs, that one timed alone, then `steps` more timed one by one, each
    between two synchronizations, so both sides pay the same. Serial: in a generation the host's
    share of the packing overlaps steps already queued, so this is an upper bound. None where the
    steps to it would pass `until` tokens (the next timed length, or the cache's end) or the cache
    cannot say when it packs."""
    k = cache.steps_to_pack() if hasattr(cache, "steps_to_pack") else None
    if k is None or cache.get_seq_length() + k + steps > until:
        return None
    for _ in range(k - 1):
        step()
    packing = _timed(step)
    plain = sorted(_timed(step) for _ in range(steps))[steps // 2]
    return 1e3 * (packing - plain)


@torch.inference_mode()
def profile_step(model, kind: str, batch: int, length: int, top: int = 12, decode: str = "eager"):
    """Where one decode step's GPU time goes, for one cache at `batch` sequences of `length` tokens:
    (total GPU ms, wall ms, a table of the `top` CUDA kernels by time) from torch.profiler over 3
    steps, and the wall time of 3 more without it. Without a GPU, the same for the CPU ops.
    `decode`: how the steps are taken where the cache allows (`_decoder`)."""
    import pandas as pd
    from torch.profiler import ProfilerActivity, profile

    cache = make_cache(kind, model, length + 16)
    fill(cache, model, batch, length)
    step, _, _ = _decoder(model, cache, batch, decode)
    for _ in range(WARMUP):
        step()  # compile, allocate, capture
    sync()
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        sync()
    time_of = (lambda e: e.device_time_total) if gpu else (lambda e: e.self_cpu_time_total)  # noqa: E731
    rows = [{"kernel": e.key[:90], "calls": e.count // 3, "ms_per_step": time_of(e) / 3e3}
            for e in prof.key_averages() if time_of(e) > 0]
    table = pd.DataFrame(rows).sort_values("ms_per_step", ascending=False)
    total = float(table["ms_per_step"].sum()) if len(table) else 0.0
    wall_ms = _timed(lambda: [step() for _ in range(3)]) * 1e3 / 3
    del cache, step
    free()
    return total, wall_ms, table.head(top)


def integrate(lengths, step_ms, start: int, end: int) -> float:
    """Milliseconds to decode every token from cache length `start` to `end`: the trapezoid rule over
    the measured (length, step time) points, step times held constant beyond the first and last."""
    xs = np.unique(np.clip([start, *lengths, end], start, end)).astype(float)
    ys = np.interp(xs, lengths, step_ms)
    return float(((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2).sum())


def _measure_fitting(model, kind: str, batch: int, prompt: int, generate: int, points: int, steps: int,
                     decode: str) -> dict:
    """`measure`, its prompt prefilled in the largest of `PREFILL_CHUNKS` whose activations fit beside
    the cache, as a server would chunk it: an out-of-memory tries the next, and the smallest one's
    is raised."""
    for chunk in PREFILL_CHUNKS:
        try:
            return measure(model, kind, batch, prompt, generate, points, steps, prefill_chunk=chunk, decode=decode)
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not is_oom(err) or chunk == PREFILL_CHUNKS[-1]:
                raise
        free()  # after the handler, which holds the failed attempt's frames


@torch.inference_mode()
def validate(model, kind: str, batch: int, prompt: int, generate: int, points: int = 4, decode: str = "eager",
             steps: int = 3) -> dict:
    """One real generation of `generate` tokens against the integrated estimate of `measure`. The
    prompt is prefilled in the chunks the estimate could fit (`_measure_fitting`, as the sweep
    does), so a max batch, whose cache leaves room only for small chunks, can be checked too."""
    estimate = _measure_fitting(model, kind, batch, prompt, generate, points, steps, decode)
    chunk = estimate["prefill_chunk"]
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (batch, prompt), device=device)
    cache = make_cache(kind, model, prompt + generate + 1)
    mode = []

    def run():
        for s in range(0, prompt, chunk):
            forward(model, cache, ids[:, s : s + chunk])
        step, _, how = _decoder(model, cache, batch, decode)
        mode.append(how)
        for _ in range(generate):
            step()

    with sampled(device=device) as gpu:  # the clock over the whole run: a power-bound decode slows as it goes
        real_s = _timed(run)
    del cache
    free()
    est_s = estimate["prefill_s"] + estimate["decode_s"]
    return {"cache": kind, "batch": batch, "prompt": prompt, "generate": generate, "prefill_chunk": chunk,
            "decode": mode[0], "measured_s": real_s, "estimated_s": est_s, "estimate_error": est_s / real_s - 1,
            **gpu}


def sweep(model, caches, prompt: int, generate: int, equal_batch: int | None = None, budget_bytes: int | None = None,
          points: int = 4, start: int = 1, limit: int = 1 << 14, stop: Callable[[], bool] | None = None,
          decode: str = "eager", steps: int = 3) -> Iterator[tuple[str, dict]]:
    """Per cache: the max-batch search, then `measure` at the max batch (and at `equal_batch`), timing
    `steps` decode steps at each of `points` lengths.
    Yields ("probe", row), ("point", row) or ("skip", row) as each completes, so a caller can chart
    them live; `stop()` ends the sweep between steps. An out-of-memory while measuring is a row too."""
    length = prompt + generate
    for kind in caches:
        if stop and stop():
            return
        if kind not in BASELINES:
            preset_kind(kind)  # a clear error for an unknown method or engine before any work
        gen = search(model, kind, length, start, limit, budget_bytes, stop)
        try:
            while True:
                yield "probe", next(gen)
        except StopIteration as done:
            best = done.value[0]
        except CacheUnavailable as err:
            yield "skip", {"cache": kind, "reason": str(err)}
            continue
        batches = [best] if best else []
        if equal_batch and equal_batch not in batches:
            batches.append(equal_batch)
        for b in batches:
            if stop and stop():
                return
            # the prefill needs activations the fit probe did not: if they do not fit, prefill in
            # smaller chunks (`_measure_fitting`), and only then back the batch off by 10%, where
            # the chunks start from the largest again (a smaller batch may take them)
            at, tries = b, 0
            while True:
                try:
                    row = _measure_fitting(model, kind, at, prompt, generate, points, steps, decode)
                    break
                except (torch.OutOfMemoryError, RuntimeError) as err:
                    if not is_oom(err):
                        raise
                free()
                tries += 1
                if b != best or tries > 3:
                    row = {"cache": kind, "batch": at, "reason": "out of memory"}
                    break
                at = at * 9 // 10
            row["at"] = "max batch" if b == best else "equal batch"
            row["max_batch"] = best
            yield "point", row
        if kind == "static-compiled":
            release_compiled(model)

