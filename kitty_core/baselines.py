"""The caches a benchmark compares, made by name (`make_cache`), and what a benchmark does with one:
fill it with random tokens (`fill`), run the model on token ids through it as `generate` would for
that cache (`forward`), take one decode step (`decode_step`). Kinds:

    dynamic         transformers DynamicCache (FP16/bf16, grows by concatenation)
    static          transformers StaticCache (preallocated to the full length), eager
    static-compiled the same, decoded through transformers' compiled forward as `generate` does
                    for a StaticCache (torch.compile, mode reduce-overhead: CUDA graphs on a GPU)
    quantized       transformers QuantizedCache, 2-bit quanto backend (when optimum-quanto is installed)
    fp16-prealloc   this library's FP16 baseline: preallocated per layer, the decode loop of the
                    Kitty caches; eager steps run SDPA on the filled prefix (without its cuDNN
                    backend, see `PreallocatedLayer.SDPA_BACKENDS`), steps from CUDA graphs run
                    cuDNN over a masked window (`PreallocatedCache`)
    <method>        a KittyCache preset (`kivi-k2v2`, `kitty`, `kitty-pro`, ...), optionally on a
                    named engine ("kitty-pro@triton+key_dots=fp16", `preset_kind`)

A kind that cannot be built here (a missing optional backend, a compiled decode that fails to
build) raises `CacheUnavailable`: a sweep skips it with the reason. The filled tokens are random
(keys with uneven channel scales, like real ones): speed and memory do not depend on their values.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import CompileConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, QuantizedCache, StaticCache

from .cache import KittyCache
from .layer import KittyLayer
from .config import parse_method
from .gpu_memory import free, is_oom
from .graphs import StepCounters, cudagraph_trees_for_this_thread
from .hf import PendingKV, num_attention_layers
from .sharding import attention_devices, local_kv_heads

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
    free()


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
            if is_oom(err):
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

