"""A Kitty decode step as PyTorch operators, so that `torch.compile` traces a model's forward through
a `KittyCache` in one graph and CUDA graphs replay it: the path of transformers' compiled `generate`.

    kitty::decode_step(query [B, Hq, 1, D], key [B, H, 1, D], value [B, H, 1, D], lens [B] int32,
                       layer: int, scaling: float) -> [B, 1, Hq, D]
        layer `layer`'s attention over its packed pages, its FP16 parts and the step's token, which
        the kernels also store (at the positions of the cache's `StepCounters`), in the layout
        transformers' attention functions return
    kitty::end_step(x, lens) -> a copy of x
        the host's part of the step, after the last layer's attention: the host's record of the new
        token, the counters advanced, and any buffer that became full packed into a page

The packing runs outside the captured graphs, on the host, once every G steps. `end_step` is tagged
cudagraph-unsafe, so inductor partitions the step's CUDA graphs around it (two replays a step) and
runs it eagerly between them, and the packing is an ordinary eager call on the same stream. A
captured conditional would put the pack kernels and their page-slot bookkeeping into every replay
for a branch taken once in G steps, and would need the host's record (which `memory_report`,
`get_seq_length` and a later prefill read) rebuilt from device counters; the host path keeps that
record exact at every step for the price of one short eager call.

Neither operator is traced inside: compiled code sees their fake implementations, and at run time
calls them with real tensors. The cache they serve is found from `lens`, its device counter of
tokens per sequence, which a compiled graph takes as a static input (`torch._dynamo.mark_static_address`):
a graph replays the cache it was recorded with, and a new cache, whose counters live elsewhere, makes
CUDA graph trees record anew instead of replaying kernels aimed at another cache's pages.
"""

from __future__ import annotations

import weakref

import torch

_CACHES: dict[int, weakref.ref] = {}  # lens.data_ptr() -> the KittyCache stepping from those counters


def register(cache) -> None:
    """Serve `cache` (whose `counters` are set) from these operators; marks its counters static."""
    for t in (cache.counters.lens, cache.counters.write):
        torch._dynamo.mark_static_address(t)
    for key in [k for k, ref in _CACHES.items() if ref() is None]:
        del _CACHES[key]
    _CACHES[cache.counters.lens.data_ptr()] = weakref.ref(cache)


def unregister(cache) -> None:
    key = cache.counters.lens.data_ptr()
    if key in _CACHES and _CACHES[key]() is cache:
        del _CACHES[key]


def _cache_of(lens: torch.Tensor):
    ref = _CACHES.get(lens.data_ptr())
    cache = ref() if ref is not None else None
    if cache is None:
        raise RuntimeError("kitty::decode_step was called with counters that no KittyCache steps from: the cache "
                           "left device-driven steps (or was freed) after this graph was built; call the model "
                           "with the cache again (a prefill or an eager step re-enters them)")
    return cache


@torch.library.custom_op("kitty::decode_step", mutates_args=())
def decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: torch.Tensor, layer: int,
                scaling: float) -> torch.Tensor:
    cache = _cache_of(lens)
    return cache.engine.device_step(cache.layers[layer], query, key, value, scaling)


@decode_step.register_fake
def _(query, key, value, lens, layer, scaling):
    b, hq, t, d = query.shape
    return query.new_empty((b, hq, t, d)).transpose(1, 2)


@torch.library.custom_op("kitty::end_step", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def end_step(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    _cache_of(lens).end_step()
    return x.clone()


@end_step.register_fake
def _(x, lens):
    return torch.empty_like(x)
