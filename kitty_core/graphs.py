"""Decode steps replayed from CUDA graphs: the compiled forward `generate` runs, and a captured loop.

Decoding an 8B model eagerly is bound by the host at any batch that fits a GPU: each step launches
about a thousand kernels from Python (40-70 ms a step for Qwen3-8B at batch 64 on an H200, whatever
the cache), so the GPU time that a smaller KV cache saves never shows. A CUDA graph replays a
captured step's kernels with one launch. Capture needs a step whose kernels and arguments stay the
same from one step to the next, so a cache that decodes this way (`KittyCache`, and this library's
FP16 baseline `PreallocatedCache`) keeps what changes in device tensors (`StepCounters`: where the
new token is written, how many tokens each sequence holds), which the captured step reads and
advances. It launches the same grids at every length (the Kitty kernels span the capacity; the FP16
baseline reads keys in windows, one graph per window), and does the rest between replays on the
host: its bookkeeping, and packing full buffers into pages (once every G steps, outside the graph).

The protocol such a cache implements:
    begin_device_steps()   check that it can (else ValueError saying why), create its counters
    sync_device_steps()    counters <- host state (after the host changed the cache)
    held_tokens()          real tokens each sequence holds (its next position)
    step_shape()           what the next step's kernels depend on (one captured graph per value)
    after_device_step()    host bookkeeping for one step run from the counters, packing if due
    device_room()          steps left before the cache is full
    end_device_steps()     back to eager steps from the host's state

Two decoders take such steps, one token per sequence, greedy: `CompiledDecoder` through the model's
compiled forward, as `generate` decodes a `KittyCache` (the cache ends each step itself, `ops`), and
`GraphedDecoder`, a loop that captures whole steps itself, for a cache that torch.compile does not
serve (this library's FP16 baseline).
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from .hf import enable_kitty_attention


def cudagraph_trees_for_this_thread() -> None:
    """Set up the compiled forward's CUDA-graph state in the calling thread, where torch has not.

    Inductor keeps its CUDA-graph trees per thread. torch 2.13 creates that state in any thread that
    first needs it; earlier releases create it only in the importing thread (and in autograd's),
    and fail with a bare AssertionError in `cudagraph_trees.get_obj` when a compiled step runs in
    another one: in a web server's worker, or the thread of each Streamlit script run. This does
    what torch 2.13 does, once per thread; the thread's graphs are recorded in its own trees."""
    try:
        from torch._inductor import cudagraph_trees as trees
    except ImportError:  # a torch without inductor compiles nothing
        return
    if hasattr(trees.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", trees.local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", trees.local.tree_manager_locks)


class StepCounters:
    """Device-side state of a decode step, per sequence.

    write  int64 [k, B]: where sequence b's new token goes in each of a cache's k FP16 regions
    lens   int32 [B]: tokens each sequence holds, the new one included
    """

    def __init__(self, batch: int, regions: int, device, by_operator: bool = False):
        """`by_operator`: the model's forward ends each step itself (`kitty_core.ops`); else the
        caller advances the counters and does the cache's host bookkeeping (`GraphedDecoder`)."""
        self.write = torch.zeros((regions, batch), dtype=torch.long, device=device)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, device=device)
        self.by_operator = by_operator

    def set(self, write: list[list[int]], lens: list[int]) -> None:
        """From the host's values: copies of a few integers that do not wait for the GPU (a pageable
        source is staged before the call returns), in stream order with the steps around them."""
        self.write.copy_(torch.tensor(write, dtype=torch.long), non_blocking=True)
        self.lens.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)

    def advance(self) -> None:
        self.write += 1
        self.lens += 1


def can_graph(cache) -> bool:
    """Does this cache implement the device-step protocol?"""
    return hasattr(cache, "begin_device_steps")


class _Greedy:
    """What both decoders share: a step's inputs as device tensors (the previous step's token ids, the
    position in the padded layout, each sequence's own position), taken up from the cache's host state."""

    def _inputs(self, model, cache, batch: int, first_ids: torch.Tensor | None) -> None:
        device = next(model.parameters()).device
        self.model, self.cache, self.batch = model, cache, batch
        self.ids = torch.ones((batch, 1), dtype=torch.long, device=device)
        if first_ids is not None:
            self.ids.copy_(first_ids.reshape(batch, 1))
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # in the padded layout
        self.position_ids = torch.zeros((batch, 1), dtype=torch.long, device=device)  # each sequence's own

    def _greedy(self, forward) -> torch.Tensor:
        """`forward` (the model, or its compiled call) at the next position over the current ids, whose
        argmax becomes the next ids; returns the last-position logits [B, vocab]."""
        out = forward(input_ids=self.ids, position_ids=self.position_ids, cache_position=self.position,
                      past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        self.position += 1
        self.position_ids += 1
        return logits

    @torch.inference_mode()
    def sync(self) -> None:
        """Take up the cache's host state (after tokens were added to it outside this decoder)."""
        self.position.fill_(self.cache.get_seq_length())
        held = torch.tensor(self.cache.held_tokens(), dtype=torch.long)[:, None]
        self.position_ids.copy_(held, non_blocking=True)  # as generate counts them: pads left out
        self.cache.sync_device_steps()

    def close(self) -> None:
        self.cache.end_device_steps()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GraphedDecoder(_Greedy):
    """Greedy decode steps of `model` over `cache`, one token per sequence, replayed from CUDA graphs.

    A step embeds the previous step's token ids (`ids`; at first `first_ids`), runs the model at the next
    position, writes the argmax back as the next ids and advances the counters. The first step at a
    new `step_shape()` runs eagerly, on a side stream (the warm-up a capture needs: Triton compiles,
    cuDNN builds its plan), and the steps after it replay the graph then captured. Every call to
    `step` is exactly one decode step. Without CUDA (`graph=False`) every step runs eagerly from the
    device counters, which is how this is tested on a CPU. `close()` (or leaving a `with` block)
    frees the graph and hands the cache back to eager steps, `model(...)` or `generate`.
    """

    @torch.inference_mode()
    def __init__(self, model, cache, batch: int, graph: bool | None = None, first_ids: torch.Tensor | None = None):
        """`first_ids` [B, 1]: the tokens the first step embeds (say, the prefill's argmax); default id 1."""
        self.use_graph = next(model.parameters()).device.type == "cuda" if graph is None else graph
        enable_kitty_attention(model)  # a device-driven step reaches its cache's layers through it
        cache.begin_device_steps()
        held = len(cache.held_tokens())
        if held != batch or (first_ids is not None and first_ids.numel() != batch):
            cache.end_device_steps()
            got = f"first_ids of {first_ids.numel()} tokens" if held == batch else f"a cache of {held} sequences"
            raise ValueError(f"batch={batch} sequences, but {got}: one token per sequence of the prefilled cache")
        self._inputs(model, cache, batch, first_ids)
        self.graph, self.shape, self.logits = None, None, None
        self.captures = 0
        # one side stream for every warm-up, not one per shape: the caching allocator reuses a block
        # freed on a stream only on that stream, until it empties its cache
        self.side = torch.cuda.Stream() if self.use_graph else None
        self.sync()

    def _body(self) -> torch.Tensor:
        logits = self._greedy(self.model)
        self.cache.counters.advance()
        return logits

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """One decode step; returns its last-position logits [B, vocab] (a replayed graph's output
        buffer, which the next step overwrites)."""
        if self.cache.device_room() <= 0:
            raise ValueError("the cache is full: it holds the max_length it was built for; build it larger")
        shape = self.cache.step_shape()
        if self.graph is not None and shape == self.shape:
            self.graph.replay()
            self.cache.after_device_step()
            return self.logits
        if not self.use_graph:
            logits = self._body()
            self.cache.after_device_step()
            return logits
        self.graph = None  # a new shape: this step runs eagerly, as the capture's warm-up
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            logits = self._body()
        torch.cuda.current_stream().wait_stream(self.side)
        self.cache.after_device_step()
        if self.cache.device_room() > 0 and self.cache.step_shape() == shape:  # the next step is warmed up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._body()
            self.graph, self.shape = graph, shape
            self.captures += 1
        return logits

    def close(self) -> None:
        self.graph = None
        super().close()


class CompiledDecoder(_Greedy):
    """Greedy decode steps of `model` over a compileable `cache` (`KittyCache.is_compileable`), through
    the compiled forward `generate` itself calls (`model.get_compiled_call`: torch.compile, mode
    reduce-overhead, CUDA graph trees on a GPU), so that a benchmark times the steps users get.

    The cache decodes from device counters that the forward's operators advance, and does its host
    bookkeeping (packing included) inside the forward, between the step's graphs (`kitty_core.ops`).
    The first step compiles (tens of seconds for an 8B model); a new cache records new graphs without
    recompiling. Same interface as `GraphedDecoder`."""

    @torch.inference_mode()
    def __init__(self, model, cache, batch: int, compile_config=None, first_ids: torch.Tensor | None = None):
        if not getattr(cache, "is_compileable", False):
            raise ValueError(f"{type(cache).__name__} is not compileable here: "
                             f"{getattr(cache, 'device_steps_refusal', lambda: 'not a KittyCache')()}")
        self.use_graph = next(model.parameters()).device.type == "cuda"
        if self.use_graph:
            cudagraph_trees_for_this_thread()
        enable_kitty_attention(model)
        cache.begin_device_steps(by_operator=True)
        if len(cache.held_tokens()) != batch:
            cache.end_device_steps()
            raise ValueError(f"batch={batch} sequences, but a cache of {len(cache.held_tokens())}")
        self.call = model.get_compiled_call(compile_config)
        self._inputs(model, cache, batch, first_ids)
        self.sync()

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """One decode step; returns its last-position logits [B, vocab]."""
        return self._greedy(self.call)
