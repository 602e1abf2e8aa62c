"""End-to-end memory and throughput of KV caches on one model: how large a batch fits, and how fast
it generates (the paper's Figure 5).

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
library from its own captured graphs; "eager". The largest batch is found by doubling until the GPU
runs out of memory (or a memory budget is exceeded), then bisecting to within 10%. Caches:

    dynamic         transformers DynamicCache (FP16/bf16, grows by concatenation)
    static          transformers StaticCache (preallocated to the full length), eager
    static-compiled the same, decoded through transformers' compiled forward as `generate` does
                    for a StaticCache (torch.compile, mode reduce-overhead: CUDA graphs on a GPU)
    quantized       transformers QuantizedCache, 2-bit quanto backend (when optimum-quanto is installed)
    fp16-prealloc   this library's FP16 baseline: preallocated per layer, the decode loop of the
                    Kitty caches; eager steps run SDPA on the filled prefix (without its cuDNN
                    backend, see `PreallocatedLayer.SDPA_BACKENDS`), steps from CUDA graphs run
                    cuDNN over a masked window (`PreallocatedCache`)
    <method>        a KittyCache preset (`kivi-k2v2`, `kitty`, `kitty-pro`, ...)

Cache bytes are those of the cache's tensors as allocated (reserved pools included); the reference
engine's dense FP16 working view (CPU) is reported apart, as `working_view_bytes`. The filled tokens are random (keys with uneven channel scales, like real ones): speed and memory do
not depend on their values. Prefill time is measured on a real prompt of random token ids, on the
second prefill of its shape in the process (the first compiles kernels).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import CompileConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, QuantizedCache, StaticCache

from .cache import KittyCache
from .layer import KittyLayer
from .config import parse_method
from .graphs import CompiledDecoder, GraphedDecoder, StepCounters, can_graph, cudagraph_trees_for_this_thread
from .hf import PendingKV, num_attention_layers
from .sharding import attention_devices, local_kv_heads
from .telemetry import sampled

BASELINES = ("dynamic", "static", "static-compiled", "quantized", "fp16-prealloc")


class CacheUnavailable(RuntimeError):
    """The cache cannot be built here (a missing optional backend)."""


class PreallocatedLayer(CacheLayerMixin):
    """FP16 keys and values preallocated to `max_length`, [B, H, max_length, D]; attention sees only the
    filled prefix.

    Eager steps run SDPA on the filled prefix, on these backends, the fastest for eager decoding:
    cuDNN's is faster on the GPU, but it builds an execution plan for each new key length, which a
    decode step always has (~30 ms of host time per step, Qwen3-8B at batch 64 on an H200). Steps from
    device counters (`PreallocatedCache`, graphs.py) write at the counters' position and run SDPA with
    cuDNN first over a window of `window` slots (a multiple of `PreallocatedCache.WINDOW`) with the
    unused ones masked: one execution plan and one captured graph per window, not per length."""

    is_compileable = False
    is_sliding = False
    SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    # with a mask (the window's unused slots): cuDNN's kernel, 4.4 TB/s at 64 x 8K on an H200 where
    # the flash backend reaches 2.7 (`python -m kitty_core.bench kernels --fp16`)
    MASKED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def __init__(self, max_length: int):
        super().__init__()
        self.max_length = max_length
        self.seen = 0
        self.steps = None  # StepCounters during device-driven steps
        self.window = max_length  # slots a device-driven step attends over (set per step by the cache)

    def lazy_initialization(self, key_states, value_states) -> None:
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros((b, h, self.max_length, d))
        self.values = value_states.new_zeros((b, h, self.max_length, d))
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.steps is not None and key_states.shape[2] == 1:
            return PendingKV(self, key_states), value_states  # to `attend`, through the kitty attention
        self.insert(key_states, value_states)
        return self.keys[:, :, : self.seen], self.values[:, :, : self.seen]

    def insert(self, key_states, value_states) -> None:
        """Append [B, H, t, D] keys and values at the host's position."""
        t = key_states.shape[2]
        if self.seen + t > self.max_length:
            raise ValueError(f"the cache holds {self.max_length} tokens; {self.seen + t} requested")
        self.keys[:, :, self.seen : self.seen + t] = key_states
        self.values[:, :, self.seen : self.seen + t] = value_states
        self.seen += t

    def attend(self, module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        """A device-driven step: the token at the counters' position, then attention over the window,
        its slots from the counters' lengths on masked."""
        at = self.steps.write[0, :1]  # every sequence holds the same tokens
        self.keys.index_copy_(2, at, key_new)
        self.values.index_copy_(2, at, value_new)
        w = self.window
        used = (torch.arange(w, device=query.device)[None, :] < self.steps.lens[:, None])[:, None, None]
        with sdpa_kernel(self.MASKED_BACKENDS):
            out = F.scaled_dot_product_attention(query, self.keys[:, :, :w], self.values[:, :, :w], attn_mask=used,
                                                 scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None  # [B, 1, Hq, D], as transformers expects

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return self.max_length


class PreallocatedCache(Cache):
    """This library's FP16 baseline: `PreallocatedLayer`s, decoded eagerly or from device counters
    (the protocol of graphs.py), like the Kitty caches."""

    WINDOW = 256  # a device-driven step reads keys in windows of this many slots: < 3% extra at 8K

    def __init__(self, config, max_length: int):
        super().__init__(layers=[PreallocatedLayer(max_length) for _ in range(num_attention_layers(config))])

    def begin_device_steps(self) -> None:
        first = self.layers[0]
        if not first.is_initialized:
            raise ValueError("this cache cannot decode from device counters: it is empty, prefill it first")
        if len({layer.keys.device for layer in self.layers}) > 1:  # counters on one device, a graph captures one
            raise ValueError("this cache cannot decode from device counters: its layers are on several devices")
        self.counters = StepCounters(first.keys.shape[0], 1, first.keys.device)
        for layer in self.layers:
            layer.steps = self.counters

    def held_tokens(self) -> list[int]:
        return [self.layers[0].seen] * self.layers[0].keys.shape[0]

    def sync_device_steps(self) -> None:
        n = self.layers[0].seen
        self.counters.set([[n] * len(self.counters.rows)], [n + 1] * len(self.counters.rows))

    def step_shape(self) -> int:
        """The window the next step attends over (the tokens it will hold, rounded up to `WINDOW`)."""
        first = self.layers[0]
        window = min(-(-(first.seen + 1) // self.WINDOW) * self.WINDOW, first.max_length)
        for layer in self.layers:
            layer.window = window
        return window

    def end_device_steps(self) -> None:
        for layer in self.layers:
            layer.steps = None

    def device_room(self) -> int:
        return self.layers[0].max_length - self.layers[0].seen

    def after_device_step(self) -> None:
        for layer in self.layers:
            layer.seen += 1


class CompiledStaticCache(StaticCache):
    """transformers' StaticCache, decoded as `generate` decodes one: a step of one token per sequence
    runs the model's compiled forward (`get_compiled_call`; by default torch.compile with mode
    reduce-overhead, CUDA graphs on a GPU), a prefill chunk runs eagerly. The first step at a new
    batch size compiles; the cache's position is a device tensor, so steps do not recompile."""

    def __init__(self, model, max_cache_len: int, compile_config: CompileConfig | None = None):
        super().__init__(config=model.config, max_cache_len=max_cache_len)
        self.decode_call = model.get_compiled_call(compile_config)
        cudagraph_trees_for_this_thread()


def release_compiled(model) -> None:
    """Drop the compiled forward and what torch.compile keeps for it (CUDA graphs hold memory pools
    of their own), so that the caches measured next have the GPU to themselves."""
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    torch.compiler.reset()
    _free()


def preset_kind(kind: str):
    """A preset cache kind, "method" or "method@engine" (e.g. "kitty-pro@triton+key_dots=fp16", to
    time one engine setting beside another in one sweep) -> (KittyConfig, engine name or None).
    ValueError for an unknown method or engine."""
    from .engines import make_engine

    method, _, engine = kind.partition("@")
    config = parse_method(method)
    if engine:
        make_engine(engine)
    return config, engine or None


def make_cache(kind: str, model, max_length: int) -> Cache:
    """A fresh, empty cache of one of the kinds above for `model`, sized for `max_length` tokens."""
    config = model.config
    if kind == "dynamic":
        return DynamicCache(config=config)
    if kind == "static":
        return StaticCache(config=config, max_cache_len=max_length)
    if kind == "static-compiled":
        return CompiledStaticCache(model, max_length)
    if kind == "quantized":
        try:
            return QuantizedCache(backend="quanto", config=config, nbits=2)
        except ImportError as err:
            raise CacheUnavailable(f"transformers' QuantizedCache needs a backend: {err}") from err
    if kind == "fp16-prealloc":
        return PreallocatedCache(config, max_length)
    config, engine = preset_kind(kind)
    return KittyCache(model, config, engine=engine, max_length=max_length)


def _kv_shape(model) -> tuple[int, int, torch.dtype, torch.device]:
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    p = next(model.parameters())
    return heads, dim, p.dtype, p.device


@torch.inference_mode()
def fill(cache: Cache, model, batch: int, tokens: int, chunk: int | None = None) -> None:
    """Append `tokens` random tokens per sequence to every layer of the cache, in chunks (by default
    about 2^26 elements each, so that the temporaries stay small next to the cache)."""
    _, dim, dtype, device = _kv_shape(model)
    heads, devices = local_kv_heads(model), attention_devices(model)  # a sharded model's (`sharding`)
    chunk = chunk or max(128, min(4096, (1 << 26) // (batch * heads * dim) // 128 * 128))
    spread = torch.linspace(0.2, 4.0, dim, device=device, dtype=dtype)
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        k = torch.randn(batch, heads, n, dim, device=device, dtype=dtype) * spread
        v = torch.randn_like(k)
        on = {device: (k, v)}  # the chunk copied once to each device that layers run on
        for i, layer in enumerate(cache.layers):
            if devices[i] not in on:
                on[devices[i]] = (k.to(devices[i]), v.to(devices[i]))
            ki, vi = on[devices[i]]
            if isinstance(layer, (KittyLayer, PreallocatedLayer)):
                if not layer.is_initialized:
                    layer.lazy_initialization(ki, vi)
                layer.insert(ki, vi)
            else:
                cache.update(ki, vi, i)
        done += n
        del k, v, on


def forward(model, cache: Cache, ids: torch.Tensor):
    """The model on token ids with this cache (last logits only), on the SDPA backends the cache's
    layers ask for (`SDPA_BACKENDS`), if any; decode steps of a `CompiledStaticCache` compiled."""
    backends = getattr(cache.layers[0], "SDPA_BACKENDS", None) if getattr(cache, "layers", None) else None
    compiled = isinstance(cache, CompiledStaticCache) and ids.shape[1] == 1
    with sdpa_kernel(backends) if backends else nullcontext():
        if not compiled:
            return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        try:
            return cache.decode_call(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        except Exception as err:  # torch.compile could not build it here: not a measurement, a missing part
            if _is_oom(err):
                # out of memory inside the compiled call leaves its CUDA graph trees unusable (the
                # next call, at any batch, fails an assertion): the next one compiles afresh
                release_compiled(model)
                raise
            raise CacheUnavailable(f"transformers' compiled decode failed here ({type(err).__name__}: "
                                   f"{str(err).splitlines()[0] if str(err) else ''})") from err


@torch.inference_mode()
def decode_step(model, cache: Cache, batch: int) -> None:
    """One decode step of the model for every sequence (token id 1: the value does not matter)."""
    forward(model, cache, torch.ones((batch, 1), dtype=torch.long, device=next(model.parameters()).device))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    """Seconds of fn(), GPU work included."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def allocated() -> int:
    """Bytes allocated on every GPU (a model sharded by a device map holds its layers on several)."""
    return sum(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()))


def reset_peak() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)


def peak_per_gpu() -> int:
    """The peak allocation of the fullest GPU since `reset_peak`: what decides whether a batch fits."""
    return max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))


WORKING_VIEWS = ("_view_k", "_view_v")  # the reference engine's dense FP16 working copy (dense_view.py)


def cache_bytes(cache: Cache, views: bool = False) -> int:
    """Bytes of every tensor the cache's layers hold (allocated, not just used), found by walking them.
    The reference engine's dense working view is left out, or counted alone with views=True."""
    seen, total = set(), 0

    def walk(x, depth=0):
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = (x.untyped_storage().data_ptr(), x.device)
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif depth < 4 and isinstance(x, dict):
            for v in x.values():
                walk(v, depth + 1)
        elif depth < 4 and isinstance(x, (list, tuple)):
            for v in x:
                walk(v, depth + 1)
        elif depth < 4 and hasattr(x, "__dict__") and not isinstance(x, (torch.nn.Module, type)):
            for name, v in vars(x).items():
                if name not in ("engine", "generator", "config") and (name in WORKING_VIEWS) == views:
                    walk(v, depth + 1)

    for layer in cache.layers:
        if views:
            for name in WORKING_VIEWS:
                walk(getattr(layer, name, None))
        else:
            walk(layer)
    return total


def fits(model, kind: str, batch: int, length: int, budget_bytes: int | None = None) -> tuple[bool, dict]:
    """Can `batch` sequences of `length` tokens be held and decoded? (ok, measurements). Out of memory
    (or more cache bytes than `budget_bytes`) is caught and released."""
    _free()
    base = allocated()
    reset_peak()
    cache = None
    try:
        cache = make_cache(kind, model, length)
        fill(cache, model, batch, length - 1)
        if budget_bytes is not None and cache_bytes(cache) > budget_bytes:
            return False, {"kv_bytes": cache_bytes(cache), "reason": "over budget"}
        decode_step(model, cache, batch)
        _sync()
        kv = cache_bytes(cache)
        if budget_bytes is not None and kv > budget_bytes:
            return False, {"kv_bytes": kv, "reason": "over budget"}
        peak = peak_per_gpu() if torch.cuda.is_available() else base + kv
        return True, {"kv_bytes": kv, "kv_bytes_allocated": allocated() - base, "peak_bytes": peak}
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not _is_oom(err):
            raise
        return False, {"reason": "out of memory"}
    finally:
        del cache
        _free()


def search(model, kind: str, length: int, start: int = 1, limit: int = 1 << 14, budget_bytes: int | None = None,
           stop: Callable[[], bool] | None = None):
    """Largest batch of `length`-token sequences that fits: doubling from `start`, then bisection to
    within 10% (or 1). A generator: yields each probe's row as it completes, returns
    (max batch, first batch that failed or None)."""
    lo, hi, b = 0, None, start
    while b <= limit and not (stop and stop()):
        ok, info = fits(model, kind, b, length, budget_bytes)
        yield {"cache": kind, "batch": b, "fits": ok, **info}
        if not ok:
            hi = b
            break
        lo, b = b, b * 2
    while hi is not None and lo and hi - lo > max(1, lo // 10) and not (stop and stop()):
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
    _free()
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
    _free()
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
    _free()
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
    _sync()
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        _sync()
    time_of = (lambda e: e.device_time_total) if gpu else (lambda e: e.self_cpu_time_total)  # noqa: E731
    rows = [{"kernel": e.key[:90], "calls": e.count // 3, "ms_per_step": time_of(e) / 3e3}
            for e in prof.key_averages() if time_of(e) > 0]
    table = pd.DataFrame(rows).sort_values("ms_per_step", ascending=False)
    total = float(table["ms_per_step"].sum()) if len(table) else 0.0
    wall_ms = _timed(lambda: [step() for _ in range(3)]) * 1e3 / 3
    del cache, step
    _free()
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
            if not _is_oom(err) or chunk == PREFILL_CHUNKS[-1]:
                raise
        _free()  # after the handler, which holds the failed attempt's frames


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
    _free()
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
                    if not _is_oom(err):
                        raise
                _free()
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

