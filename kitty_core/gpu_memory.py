"""What the GPUs hold while a benchmark runs: bytes allocated and at peak over every visible GPU (a
model sharded by a device map holds its layers on several), the bytes of a cache's own tensors, an
out-of-memory error told apart from other failures, and the allocator's unused blocks handed back
between measurements.

Cache bytes are those of the cache's tensors as allocated (reserved pools included, not only the
filled part), found by walking the layers' attributes; the reference engine's dense FP16 working
view (`WORKING_VIEWS`, on the CPU) is counted apart, since the Triton engine on a GPU has none.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers.cache_utils import Cache


def sync() -> None:
    """Wait for the GPU's queued work (nothing without CUDA): before a clock or a peak is read."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    """Collect what Python no longer references and hand the allocator's unused blocks back, so that
    the next measurement starts from what is really held."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    """Whether `err` is running out of memory (torch's own error, or a RuntimeError that says so)."""
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
