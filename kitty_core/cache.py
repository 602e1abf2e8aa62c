"""The Kitty KV cache: per-layer state machine over FP16 buffers and packed pages (paper, section 4.3).

Per layer, every sequence b of the batch owns (n_b = real tokens it has seen; pads never enter):
    key   sink      FP16 [H, min(n_b, S), D]     the first S tokens
          q_buffer  FP16 [H, < G, D]             keys waiting to fill a page
          pages     KeyPages, G tokens each       mixed INT2/INT4 (see quant.py)
    value sink      FP16 [H, min(n_b, S), D]
          window    FP16 [H, < R + G, D]         the local window of the newest R values, plus the
                                                  value q_buffer of tokens that left it (oldest first)
          pages     ValuePages, G tokens each
Every step inserts the new tokens after attention has used them in FP16, and packs a buffer into a
page as soon as it holds G tokens, so a layer packs at most once every G decode steps.

Sequences of a left-padded batch are independent: each has its own sink, buffers and page
boundaries. The padded layout that transformers' masks expect is kept by right-aligning every
sequence's history when an engine needs it dense.

The state lives in tensors shared by all sequences ([B, H, cap, D] FP16 regions, page pools) plus
per-sequence integer counters; an engine (`ReferenceEngine` here, the Triton engine of
`triton_engine.py` over the kernels in `kernels/`) reads it to attend. The transformers glue
(attention function, mask) is in `hf.py`.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import fields

import numpy as np
import pandas as pd
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import calibrate, ops
from .config import KittyConfig, parse_method
from .graphs import StepCounters, cudagraph_trees_for_this_thread
from .hf import (
    PendingKV,
    base_attention,
    check_supported,
    enable_kitty_attention,
    layer_windows,
    model_shape,
    softcapping,
)
from .quant import (
    KeyPages,
    ValuePages,
    dequantize_keys,
    dequantize_values,
    page_nbytes,
    quantize_keys,
    quantize_values,
)


class Fp16Region:
    """Per-sequence FP16 token storage: buf [B, H, cap, D], lens[b] tokens used by sequence b."""

    def __init__(self, batch: int, heads: int, dim: int, dtype, device, capacity: int, growable: bool):
        self.buf = torch.zeros((batch, heads, capacity, dim), dtype=dtype, device=device)
        self.lens = [0] * batch
        self.growable = growable

    @property
    def capacity(self) -> int:
        return self.buf.shape[2]

    def room(self, b: int) -> int:
        return self.capacity - self.lens[b] if not self.growable else 1 << 62

    def _reserve(self, end: int) -> None:
        if end > self.capacity:
            if not self.growable:
                raise RuntimeError("FP16 region overflow: the cache state machine is inconsistent")
            grown = self.buf.new_zeros((*self.buf.shape[:2], max(end, 2 * self.capacity, 16), self.buf.shape[3]))
            grown[:, :, : self.capacity] = self.buf
            self.buf = grown

    def append(self, b: int, x: torch.Tensor) -> None:
        """x [H, n, D] -> after the tokens of sequence b."""
        n, start = x.shape[1], self.lens[b]
        self._reserve(start + n)
        self.buf[b, :, start : start + n] = x
        self.lens[b] = start + n

    def append_all(self, x: torch.Tensor) -> None:
        """x [B, H, n, D] -> after the tokens of every sequence (all sequences hold the same count)."""
        n, start = x.shape[2], self.lens[0]
        if n:
            self._reserve(start + n)
            self.buf[:, :, start : start + n] = x
            self.lens = [start + n] * len(self.lens)

    def append_rows(self, rows: list[int], x: torch.Tensor) -> None:
        """x [len(rows), H, D]: one token after the tokens of each listed sequence (own positions),
        in one indexed write."""
        if not rows:
            return
        self._reserve(max(self.lens[b] for b in rows) + 1)
        dev = self.buf.device
        pos = torch.tensor([self.lens[b] for b in rows], device=dev)
        self.buf[torch.tensor(rows, device=dev), :, pos] = x
        for b in rows:
            self.lens[b] += 1

    def tokens(self, b: int) -> torch.Tensor:
        return self.buf[b, :, : self.lens[b]]

    def tokens_all(self) -> torch.Tensor:
        """[B, H, n, D] when every sequence holds the same count n."""
        return self.buf[:, :, : self.lens[0]]

    def clear(self, b: int) -> None:
        self.lens[b] = 0

    def drop_oldest(self, b: int | None, n: int) -> None:
        """Drop the n oldest tokens of sequence b (None: of every sequence, which hold the same count);
        the rest move to the region's start."""
        rows = slice(None) if b is None else b
        held = self.lens[0 if b is None else b]
        self.buf[rows, :, : held - n] = self.buf[rows, :, n:held].clone()
        if b is None:
            self.lens = [held - n] * len(self.lens)
        else:
            self.lens[b] = held - n

    def clear_all(self) -> None:
        self.lens = [0] * len(self.lens)

    def nbytes(self) -> int:
        return sum(self.lens) * self.buf.shape[1] * self.buf.shape[3] * self.buf.element_size()


class PagePool:
    """Pages of one kind (KeyPages or ValuePages) in field-wise tensors [P, ...], grown by doubling.

    Each sequence keeps the ids of its pages in order, as a paged KV cache does: row b of a page
    table held twice, on the host (`ids` [B, width] and `n` [B], numpy) for the cache's own logic and
    on the device (`device_ids`, `device_n`, int32) for the kernels. Adding pages writes the new
    entries into both with a few vector operations, so a batch of hundreds of sequences packing a
    page each (every G decode steps) costs no Python per sequence and no rebuilt table.
    The packed code planes are stored with their last two dims swapped in memory and held as
    transposed views, so that they read as the page format does while the axis a decode kernel
    reduces over is the contiguous one: key channels (dense [D, G/4] is channel-contiguous, high
    [Db, G/4] likewise) and value tokens (low/high [G, D/4] are token-contiguous). A tensor-core
    operand then takes four codes' bytes with one 32-bit shared-memory read instead of four byte reads.
    """

    PLANES = ("dense", "high", "low")

    def __init__(self, kind: type, batch: int, device, width: int = 16):
        self.kind = kind
        self.store: dict[str, torch.Tensor] | None = None
        self.count = 0  # slots of the store ever used; those in `free` are held by no sequence
        self.free: list[int] = []  # slots of pages dropped (a crop, a sliding window), reused first
        self.n = np.zeros(batch, dtype=np.int64)
        self.ids = np.zeros((batch, width), dtype=np.int32)
        self.device_n = torch.zeros(batch, dtype=torch.int32, device=device)
        self.device_ids = torch.zeros((batch, width), dtype=torch.int32, device=device)

    @property
    def table(self) -> list[list[int]]:
        """Each sequence's page ids, in order (a copy)."""
        return [row[:k].tolist() for row, k in zip(self.ids, self.n)]

    def pages_of(self, b: int) -> int:
        return int(self.n[b])

    def reserve_slots(self, width: int) -> None:
        """Room for `width` pages per sequence in the tables. The device tables move only here, so
        a CUDA graph that captured them stays valid while no sequence outgrows the width."""
        if width <= self.ids.shape[1]:
            return
        ids = np.zeros((len(self.n), width), dtype=np.int32)
        ids[:, : self.ids.shape[1]] = self.ids
        device_ids = self.device_ids.new_zeros((len(self.n), width))
        device_ids[:, : self.ids.shape[1]] = self.device_ids
        self.ids, self.device_ids = ids, device_ids

    def _room(self, need: int) -> None:
        if need > self.ids.shape[1]:
            self.reserve_slots(max(need, 2 * self.ids.shape[1]))

    def add(self, b: int, pages: KeyPages | ValuePages) -> None:
        """pages [n, ...]: n new pages for sequence b."""
        ids = self._store(pages)
        n, at = len(ids), int(self.n[b])
        self._room(at + n)
        self.ids[b, at : at + n] = ids
        self.device_ids[b, at : at + n] = self._on_device(ids)
        self.n[b] += n
        self.device_n[b] += n

    def add_all(self, pages: KeyPages | ValuePages) -> None:
        """pages [B * n, ...], sequence-major: n new pages for every sequence, which all hold the
        same number of pages (a batch without padding)."""
        batch, at = len(self.n), int(self.n[0])
        if (self.n != at).any():
            raise RuntimeError("add_all needs every sequence at the same page count; use add_rows")
        ids = self._store(pages)
        per = len(ids) // batch
        self._room(at + per)
        self.ids[:, at : at + per] = ids.reshape(batch, per)
        self.device_ids[:, at : at + per] = self._on_device(ids).reshape(batch, per)
        self.n += per
        self.device_n += per

    def add_rows(self, rows: list[int], pages: KeyPages | ValuePages) -> None:
        """pages [len(rows), ...]: one new page for each listed sequence (distinct)."""
        if not len(rows):
            return
        ids = self._store(pages)
        rows_h = np.asarray(rows)
        at = self.n[rows_h]
        self._room(int(at.max()) + 1)
        self.ids[rows_h, at] = ids
        dev = self.device_ids.device
        rows_d = torch.from_numpy(rows_h).to(dev, non_blocking=True)
        self.device_ids[rows_d, torch.from_numpy(at).to(dev, non_blocking=True)] = self._on_device(ids)
        self.n[rows_h] += 1
        self.device_n[rows_d] += 1

    def _store(self, pages: KeyPages | ValuePages) -> np.ndarray:
        """Store pages [n, ...] in free slots first, then new ones; their slot ids (int32 [n])."""
        n = next(iter(vars(pages).values())).shape[0]
        if self.store is None:
            self.store = {f.name: self._zeros(f.name, getattr(pages, f.name), 0) for f in fields(pages)}
        reused, self.free = self.free[:n], self.free[n:]
        fresh = n - len(reused)
        cap = next(iter(self.store.values())).shape[0]
        if self.count + fresh > cap:
            self._grow(max(self.count + fresh, 2 * cap, 4))
        ids = np.array(reused + list(range(self.count, self.count + fresh)), dtype=np.int32)
        where = slice(self.count, self.count + n) if not reused else torch.from_numpy(ids).to(self.device_ids.device)
        for f in fields(pages):
            self.store[f.name][where] = getattr(pages, f.name)
        self.count += fresh
        return ids

    def _on_device(self, ids: np.ndarray) -> torch.Tensor:
        """Slot ids on the device; a run of new slots is made there (no copy from the host)."""
        dev = self.device_ids.device
        if len(ids) and ids[-1] - ids[0] == len(ids) - 1 and (np.diff(ids) == 1).all():
            return torch.arange(int(ids[0]), int(ids[-1]) + 1, dtype=torch.int32, device=dev)
        return torch.from_numpy(ids).to(dev)

    def drop_oldest(self, b: int | None, k: int) -> None:
        """Drop the k oldest pages of sequence b (None: of every sequence, which hold the same count);
        their slots go back to the pool."""
        rows = slice(None) if b is None else b
        n = int(self.n[0 if b is None else b])
        self.free += self.ids[rows, :k].flatten().tolist()
        self.ids[rows, : n - k] = self.ids[rows, k:n].copy()
        self.device_ids[rows, : n - k] = self.device_ids[rows, k:n].clone()
        self.n[rows] -= k
        self.device_n[rows] -= k

    def pop(self, b: int) -> None:
        """Drop sequence b's newest page; its slot goes back to the pool."""
        self.n[b] -= 1
        self.device_n[b] -= 1
        self.free.append(int(self.ids[b, self.n[b]]))

    def pages(self, b: int, first: int = 0) -> KeyPages | ValuePages | None:
        """Pages first, first+1, ... of sequence b, gathered (None if there are none)."""
        if first >= self.n[b]:
            return None
        index = self.device_ids[b, first : self.n[b]]
        return self.kind(**{name: t.index_select(0, index) for name, t in self.store.items()})

    def reserve(self, template: KeyPages | ValuePages, pages: int) -> None:
        """Room for `pages` pages in all, shaped like `template`, from now on (the pages held are kept):
        no doubling until they are used up."""
        if self.store is None:
            self.store = {f.name: self._zeros(f.name, getattr(template, f.name), pages) for f in fields(template)}
        elif pages > next(iter(self.store.values())).shape[0]:
            self._grow(pages)

    def _grow(self, pages: int) -> None:
        for name, t in self.store.items():
            grown = self._zeros(name, t, pages)
            grown[: self.count] = t[: self.count]
            self.store[name] = grown

    @classmethod
    def _zeros(cls, name: str, like: torch.Tensor, pages: int) -> torch.Tensor:
        """Zero storage for `pages` pages of field `name` shaped like `like` (see the class doc)."""
        shape = (pages, *like.shape[1:])
        if name in cls.PLANES:
            return like.new_zeros((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
        return like.new_zeros(shape)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the stored pages, per field."""
        if self.store is None:
            return {f.name: 0 for f in fields(self.kind)}
        per_page = page_nbytes(self.kind(**{k: v[:1] for k, v in self.store.items()}))
        return {name: per_page[name] * (self.count - len(self.free)) for name in per_page}


class ReferenceEngine:
    """Attention over the dequantized history with transformers' SDPA: the readable ground truth.

    It reads a dense view of what attention sees (pages dequantized, FP16 parts as stored) that the
    layer updates only where tokens arrived or were packed; the view is this engine's working copy,
    the memory report counts the packed state."""

    name = "reference"

    def quantize_keys(self, keys, n_boost, rule, generator, query_rms=None):
        return quantize_keys(keys, n_boost, rule, generator, query_rms)

    def quantize_values(self, values, bits):
        return quantize_values(values, bits)

    def attend(self, layer: "KittyLayer", module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        out = self.attend_dense(layer, module, query, key_new, value_new, attention_mask, scaling, **kwargs)
        layer.insert(key_new, value_new)  # after attention: the new tokens were attended in FP16
        return out

    @staticmethod
    def attend_dense(layer: "KittyLayer", module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        """SDPA over the dense view of the history and the new tokens; the layer's state is left as
        it was (the new tokens are not inserted), so an out-of-memory here loses nothing."""
        past_k, past_v = layer.dense_history(key_new.dtype)  # [B, H, seen, D], right-aligned
        keys = torch.cat([past_k, key_new], dim=2)
        values = torch.cat([past_v, value_new], dim=2)
        kwargs.pop("dropout", None)
        return base_attention(module)(module, query, keys, values, attention_mask, dropout=0.0, scaling=scaling,
                                      **kwargs)


ENGINES = {"reference": ReferenceEngine}


def make_engine(name: str):
    """An engine by name: "reference", or "triton" with options as "+name=value", e.g.
    "triton+key_dots=int8"."""
    base, *opts = name.split("+")
    if base == "triton":
        from .triton_engine import TritonEngine  # optional: needs a GPU build of Triton

        kwargs = {}
        for opt in opts:
            key, eq, value = opt.partition("=")
            if key not in ("key_dots", "pages") or not eq:
                raise ValueError(f"the triton engine takes the options key_dots=... and pages=..., got {opt!r} "
                                 f"in {name!r}")
            kwargs[key] = value
        return TritonEngine(**kwargs)
    if base not in ENGINES or opts:
        raise ValueError(f"engine must be one of {sorted([*ENGINES, 'triton'])} (triton with +key_dots=...), "
                         f"got {name!r}")
    return ENGINES[name]()


class KittyLayer(CacheLayerMixin):
    """One attention layer's Kitty state. Created empty; shaped by the first update."""

    is_compileable = False
    is_sliding = False
    is_croppable = True  # crop rolls back a forward's tokens exactly (see `crop`)

    def __init__(self, config: KittyConfig, engine, layer_idx: int = 0, max_length: int | None = None,
                 owner: "KittyCache | None" = None, window: int | None = None):
        """`window`: the layer's sliding window W (None: full attention). A sliding layer keeps only what
        its window can still attend to (each sequence's newest W - 1 tokens, page-granular): no FP16 sink
        (its first tokens leave the window like any other), pages dropped once wholly outside, and
        every token in FP16 (trimmed each step, as DynamicCache keeps it) when W is no longer than a
        page, where no page would ever fill inside the window."""
        super().__init__()
        if window is not None:
            config = config.replace(sink=0) if config.quantize and window > config.group_size else KittyConfig(
                quantize=False)
        self.window = window
        self.is_sliding = window is not None
        self.config = config
        self.engine = engine
        self.layer_idx = layer_idx
        self.max_length = max_length  # tokens per sequence to reserve page pools for (None: grow on demand)
        self.capacity = max_length  # tokens per sequence the pools and page tables hold without moving
        self.seen = 0  # tokens seen per sequence in the padded layout (pads included)
        self.steps = None  # StepCounters while decode steps run from device counters (graphs.py)
        self.owner = weakref.ref(owner) if owner is not None else lambda: None
        self.softcap = None  # the logit softcap the model's attention applies (Gemma 2 on eager), for the kernels
        self.boost = None  # key channels its pages boost, where an allocation sets them (else the config's rate)
        self.last = owner is None  # the model's last attention layer: it ends a device-driven step
        self.generator = torch.Generator().manual_seed(config.seed * 100_003 + layer_idx)
        self.record_past = False  # keep what `crop` needs to reopen a page the latest forward packed
        self._packed = {"k": {}, "v": {}}  # side -> {sequence (None: all): (page index, FP16 source [.., H, G, D])}

    # -- transformers CacheLayerMixin -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        c = self.config
        if d % 4:
            raise ValueError(f"head size must be a multiple of 4 to pack 2-bit codes, got {d}")
        self.batch, self.heads, self.head_dim = b, h, d
        self.dtype, self.device = key_states.dtype, key_states.device
        self.n_boost = c.boosted_channels(d) if self.boost is None else self.boost
        self.pad = [0] * b
        # the oldest real tokens of each sequence a sliding layer no longer holds: keys, values
        self.dropped = np.zeros((2, b), dtype=np.int64)
        mk = lambda cap, grow=False: Fp16Region(b, h, d, self.dtype, self.device, cap, grow)  # noqa: E731
        if not c.quantize:  # FP16 reference: one growing region per side, nothing else
            self.k_sink, self.v_sink = mk(64, True), mk(64, True)
            self.k_buffer = self.v_window = None
        else:
            self.k_sink, self.v_sink = mk(c.sink), mk(c.sink)
            self.k_buffer = mk(c.group_size)
            self.v_window = mk(c.local_window + c.group_size)
        width = self.capacity_slots() if self.max_length else 16
        self.k_pages = PagePool(KeyPages, b, self.device, width)
        self.v_pages = PagePool(ValuePages, b, self.device, width)
        if self.max_length:
            self.reserve(self.max_length)
        self._view_k = self._view_v = None  # dense view for the reference engine, see dense_history
        self._clean = np.zeros(b, dtype=np.int64)  # tokens of each sequence the dense view holds as they are now
        self._pads = None  # (pads, the same on the device) for kernel_state
        # running sum of squared queries per sequence, KV head and channel (for selection="qk")
        self.q_energy = torch.zeros((b, h, d), dtype=torch.float32, device=self.device)
        self.q_count = torch.zeros((b, 1, 1), dtype=torch.float32, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Defer: attention (hf.kitty_attention) inserts the new tokens after it has used them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch:
            raise ValueError(
                f"this KittyCache holds {self.batch} sequence(s) and the input has {key_states.shape[0]}: a KittyCache "
                "holds one batch's conversation, so new prompts need a new cache (past_key_values=KittyCache(model, "
                "method) for each call)")
        return PendingKV(self, key_states), value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.steps is not None and query_length == 1:
            # a device-driven step masks by its counters, not by this mask: a fixed [B, 1, 1, 1] stand-in
            # keeps a compiled step's inputs the same shape at every length
            return 1, 0
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.seen = 0
        self.steps = None

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("KittyCache does not support beam search; use greedy decoding or sampling")

    def activate_past_recording(self) -> None:
        """From now on keep the FP16 source of the newest page each forward packs, until the next forward
        or crop, so that `crop` can reopen it (speculative decoding calls this before it starts)."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove each sequence's newest tokens, as transformers' caches do for speculative decoding:
        a negative count removes that many, a positive one is the length to keep (the older spelling),
        0 removes nothing. Tokens in FP16 parts go as they are; a page that the latest forward packed
        is reopened from its FP16 source when past recording is on (its slot goes back to the pool),
        so a rollback leaves the state the shorter forward would have left. Anything older than the
        latest forward that is packed cannot be unpacked exactly: ValueError saying what to do.
        Query statistics (selection="qk") keep the rolled-back queries."""
        tokens_to_remove = int(tokens_to_remove)  # generate passes a 0-d tensor
        if tokens_to_remove > 0:
            tokens_to_remove = min(tokens_to_remove - self.seen, 0)
        remove = -tokens_to_remove
        if remove and self.is_initialized:
            if remove > self.seen:
                raise ValueError(f"cannot remove {remove} tokens from a cache of {self.seen}")
            owner = self.owner()
            if self.steps is not None and owner is not None:  # the host's record is exact: steps begin anew later
                owner.end_device_steps()
            for b in range(self.batch):
                self._remove_newest(b, min(remove, self.tokens(b)))
            self.seen -= remove
            self.pad = [min(p, self.seen) for p in self.pad]
        if tokens_to_remove == 0 or remove:
            self._packed = {"k": {}, "v": {}}
            if self.window is not None and self.is_initialized:  # what only the rolled-back queries saw goes
                self._slide()

    def _remove_newest(self, b: int, n: int) -> None:
        """Take sequence b's newest n real tokens out of both sides."""
        c = self.config
        start = self.tokens(b) - n
        self._dirty(b, start)
        for side, sink, pool, tail in (("k", self.k_sink, self.k_pages, self.k_buffer),
                                       ("v", self.v_sink, self.v_pages, self.v_window)):
            left, base = n, int(self.dropped[int(side == "v"), b])
            if tail is not None:
                cut = min(left, tail.lens[b])
                tail.lens[b] -= cut
                left -= cut
                while left and pool.pages_of(b):
                    at = pool.pages_of(b) - 1
                    src = self._packed_source(side, b, at)
                    if src is None:
                        bits = c.key_bits if side == "k" else c.value_bits
                        raise ValueError(
                            f"cannot remove the newest {n} tokens: {left} of them are in a {bits}-bit page"
                            " that was packed before the latest forward (or without past recording) and "
                            "cannot be unpacked exactly; call cache.activate_past_recording() before the forward "
                            "to roll back, crop only within the latest forward's tokens, or use the fp16 preset")
                    pool.pop(b)
                    self._dirty(b, base + sink.lens[b] + at * c.group_size)
                    keep = max(c.group_size - left, 0)
                    left -= c.group_size - keep
                    tail.append(b, src[:, :keep])  # the tail is empty here: the page's kept tokens are the newest
                # values leave the window for a page only once R newer ones follow: with fewer, the
                # pages that the forward packed too early open again
                while side == "v" and tail.lens[b] < c.local_window and pool.pages_of(b):
                    at = pool.pages_of(b) - 1
                    src = self._packed_source(side, b, at)
                    if src is None:
                        break
                    pool.pop(b)
                    self._dirty(b, base + sink.lens[b] + at * c.group_size)
                    newer = tail.tokens(b).clone()
                    tail.clear(b)
                    tail.append(b, src)
                    tail.append(b, newer)
            if left > sink.lens[b]:
                raise RuntimeError("crop: the cache state machine is inconsistent")
            sink.lens[b] -= left

    def _record_packed(self, side: str, rows, src: torch.Tensor, pages_held: int) -> None:
        """While past recording is on: the FP16 source [.., H, n * G, D] of the n pages just packed for
        sequence `rows` (None: every sequence, src [B, H, n * G, D]), which now holds `pages_held`.
        The newest pages only: as many as a rollback can reopen (one key page; values: the pages that
        a local window of R can take back, and one)."""
        if self.record_past:
            g = self.config.group_size
            keep = min(src.shape[-2] // g, 1 if side == "k" else 1 + -(-self.config.local_window // g))
            self._packed[side][rows] = (pages_held - keep, src[..., src.shape[-2] - keep * g :, :].clone())

    def _packed_source(self, side: str, b: int, at: int) -> torch.Tensor | None:
        """The FP16 source [H, G, D] of page `at` of sequence b, if the latest forward packed it and it was recorded."""
        g = self.config.group_size
        for rows in (b, None):
            held = self._packed[side].get(rows)
            if held is not None and held[0] <= at < held[0] + held[1].shape[-2] // g:
                src = held[1] if rows is not None else held[1][b]
                return src[:, (at - held[0]) * g : (at - held[0] + 1) * g]
        return None

    # -- the state machine -----------------------------------------------------------------------
    def tokens(self, b: int) -> int:
        """Real tokens held for sequence b."""
        return self.seen - self.pad[b]

    def attend(self, module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        """Attend over history + the new tokens (FP16), then insert them and pack full buffers.

        A decode step from device counters reads nothing from the host's record, so that torch.compile
        traces it into the model's graph (`ops`); every other call is host bookkeeping, which compiled
        code runs as it is (`_host_attend`)."""
        if self.steps is not None and key_new.shape[2] == 1:
            return self._device_attend(query, key_new, value_new, scaling)
        return self._host_attend(module, query, key_new, value_new, attention_mask, scaling, **kwargs)

    def _device_attend(self, query, key_new, value_new, scaling):
        lens = self.steps.lens
        scaling = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        out = torch.ops.kitty.decode_step(query, key_new, value_new, lens, self.layer_idx, scaling)
        if self.last and self.steps.by_operator:
            out = torch.ops.kitty.end_step(out, lens)
        return out, None

    @torch.compiler.disable
    def _host_attend(self, module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        owner = self.owner()
        if self.steps is not None and owner is not None:  # a prefill into a cache in device-driven steps
            owner.end_device_steps()
        with on_device(self.device):
            out = self._attend_from_host(module, query, key_new, value_new, attention_mask, scaling, **kwargs)
        if self.last and owner is not None:
            owner.begin_device_steps_if_possible()
        return out

    def _attend_from_host(self, module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        t = key_new.shape[2]
        if self.seen == 0 or (t > 1 and self.seen in self.pad):
            self._extend_padding(attention_mask, t)
        if self.config.selection == "qk":
            self._track_queries(query)
        if self.window is not None:  # the kernels take no window: a sliding layer attends through the reference path
            return ReferenceEngine.attend(self.engine, self, module, query, key_new, value_new, attention_mask, scaling,
                                          **kwargs)
        return self.engine.attend(self, module, query, key_new, value_new, attention_mask, scaling, **kwargs)

    def insert(self, key_new: torch.Tensor, value_new: torch.Tensor, pack: bool = True) -> None:
        """Store new tokens [B, H, t, D] (pads of a first call skipped). With pack=False (one decode
        token) a buffer may be left full, for `pack_full()` after attention.

        A batch without padding keeps every sequence in the same state: it is stored with whole-batch
        tensor operations (one page per sequence packed in one call). In a padded batch the sequences
        are in different states: a decode token is written to each sequence's own region and position
        in one indexed write; a prefill goes sequence by sequence."""
        with on_device(self.device):
            self._insert_tokens(key_new, value_new, pack)

    def _insert_tokens(self, key_new: torch.Tensor, value_new: torch.Tensor, pack: bool) -> None:
        self._packed = {"k": {}, "v": {}}  # a rollback reaches back to the latest forward only
        t = key_new.shape[2]
        if self.window is not None and t > 1 and not any(self.pad):
            key_new, value_new = self._skip_out_of_window(key_new, value_new)
        if not any(self.pad):
            self._insert_all(key_new, value_new, pack)
        elif self.seen and key_new.shape[2] == 1 and not pack:
            self._append_token_rows(key_new[:, :, 0], value_new[:, :, 0])
        else:
            for b in range(self.batch):
                skip = min(max(self.pad[b] - self.seen, 0), key_new.shape[2])  # pads of this chunk
                self._insert(b, key_new[b, :, skip:], value_new[b, :, skip:], pack)
        self.seen += t
        if self.window is not None:  # under past recording, what the latest forward's queries saw stays until a crop
            self._slide(key_new.shape[2] if self.record_past else 0)

    def _skip_out_of_window(self, key_new, value_new):
        """A sliding layer's chunk (no pads) that ends past the window of everything held: the held
        tokens and the chunk's first ones are out of it once the chunk is in, so they are dropped now
        and never stored (a long prompt is not packed to be dropped), down to a page boundary. The rest
        of the chunk, returned."""
        slack = key_new.shape[2] if self.record_past else 0
        skip = key_new.shape[2] - (self.window - 1) - slack
        if self.config.quantize:  # whole pages: key pages keep the boundaries they would have had
            skip = (self.seen + skip) // self.config.group_size * self.config.group_size - self.seen
        if skip <= 0:
            return key_new, value_new
        for pool in (self.k_pages, self.v_pages):
            if pool.pages_of(0):
                pool.drop_oldest(None, pool.pages_of(0))
        for region in (self.k_sink, self.v_sink, self.k_buffer, self.v_window):
            if region is not None:
                region.clear_all()
        self.dropped[:] = self.seen + skip
        return key_new[:, :, skip:], value_new[:, :, skip:]

    def _slide(self, slack: int = 0) -> None:
        """Drop what no later query of this sliding layer can attend: each sequence keeps its newest
        W - 1 real tokens (and `slack` more), down to whole pages (a page goes when all its tokens are
        out; the FP16 tail is trimmed once no page is left before it)."""
        w, g = self.window, self.config.group_size
        lockstep = not any(self.pad) and (self.dropped == self.dropped[:, :1]).all()
        for b in [None] if lockstep else range(self.batch):
            i = 0 if b is None else b
            keep_from = self.tokens(i) - (w - 1) - slack
            for side, (sink, pool, tail) in enumerate(((self.k_sink, self.k_pages, self.k_buffer),
                                                       (self.v_sink, self.v_pages, self.v_window))):
                cut = keep_from - int(self.dropped[side, i])
                if cut <= 0:
                    continue
                if tail is None:  # every token in FP16, in the "sink" region
                    sink.drop_oldest(b, cut)
                else:
                    pages = min(cut // g, pool.pages_of(i))
                    if pages:
                        pool.drop_oldest(b, pages)
                    cut -= pages * g
                    if pool.pages_of(i):
                        cut = 0  # the oldest page still holds tokens inside the window
                    if cut > 0:
                        tail.drop_oldest(b, cut)
                    cut += pages * g
                self.dropped[side, slice(None) if b is None else b] += cut

    def pack_full(self) -> None:
        """Pack every key q-buffer that holds G tokens, and the oldest G values of every full window."""
        c = self.config
        if not c.quantize:
            return
        if not any(self.pad):
            if self.k_buffer.lens[0] >= c.group_size or self.v_window.lens[0] >= c.local_window + c.group_size:
                nothing = self.k_buffer.buf[:, :, :0]
                self._insert_all(nothing, nothing, pack=True)
            return
        g, r = c.group_size, c.local_window
        for b in range(self.batch):  # more than one token past a page boundary: the general path
            if self.k_buffer.lens[b] > g or self.v_window.lens[b] > r + g:
                nothing = self.k_buffer.buf[b, :, :0]
                self._insert(b, nothing, nothing, pack=True)
        keys = [b for b in range(self.batch) if self.k_buffer.lens[b] == g]
        values = [b for b in range(self.batch) if self.v_window.lens[b] == r + g]
        if keys:  # one page for each of these sequences, packed in one call
            dev = self.device
            for b in keys:
                self._dirty(b, self.dropped[0, b] + self.k_sink.lens[b] + self.k_pages.pages_of(b) * g)
            rms = None
            if c.selection == "qk":
                idx = torch.tensor(keys, device=dev)
                rms = (self.q_energy[idx] / self.q_count[idx].clamp_min(1)).sqrt()
            pages = self.k_buffer.buf[torch.tensor(keys, device=dev)]  # [n, H, G, D]
            self.k_pages.add_rows(keys, self.engine.quantize_keys(pages, self.n_boost, c.selection, self.generator, rms))
            for b in keys:
                self.k_buffer.clear(b)
        if values:  # the oldest G values of each full window become a page; the newest R move up
            idx = torch.tensor(values, device=self.device)
            for b in values:
                self._dirty(b, self.dropped[1, b] + self.v_sink.lens[b] + self.v_pages.pages_of(b) * g)
            window = self.v_window.buf[idx]  # [n, H, R + G, D]
            self.v_pages.add_rows(values, self.engine.quantize_values(window[:, :, :g], c.value_bits))
            self.v_window.buf[idx, :, :r] = window[:, :, g:]
            for b in values:
                self.v_window.lens[b] = r

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens per sequence in the page pools and tables (their `capacity`), so
        that they do not move until a sequence holds more."""
        c = self.config
        self.capacity = max(tokens, self.capacity or 0)
        if c.quantize:
            pages = self.batch * max(0, self.capacity - c.sink) // c.group_size
            x = torch.zeros((1, self.heads, c.group_size, self.head_dim), device=self.device)
            self.k_pages.reserve(quantize_keys(x, self.n_boost), pages)
            self.v_pages.reserve(quantize_values(x, c.value_bits), pages)

    # -- decode steps from device counters (kitty_core.graphs) ------------------------------------
    def capacity_slots(self) -> int:
        """Page slots of a sequence of `capacity` tokens: the grid a device-driven step launches."""
        return -(-max(self.capacity - self.config.sink, 1) // self.config.group_size)

    def start_steps(self, counters) -> None:
        """Decode steps from `counters` (None: from the host's state again); `KittyCache.begin_device_steps`
        has made the page tables as wide as the capacity (they must not move while graphs hold them)."""
        self.steps = counters

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of this layer that a decode step reads or writes (what its CUDA graphs hold)."""
        regions = [r.buf for r in (self.k_sink, self.v_sink, self.k_buffer, self.v_window) if r is not None]
        pools = [t for pool in (self.k_pages, self.v_pages) if pool.store for t in pool.store.values()]
        tables = [self.k_pages.device_ids, self.v_pages.device_ids, self.k_pages.device_n, self.v_pages.device_n]
        return regions + pools + tables + [self.q_energy, self.q_count]

    def advance_host(self) -> bool:
        """The host's record of a token a device-driven step wrote into the key q-buffer and the value
        window (the Triton engine's kernels do, at the counters' positions); packs what became full.
        True if it packed."""
        c = self.config
        self._packed = {"k": {}, "v": {}}
        self.seen += 1
        self.k_buffer.lens = [n + 1 for n in self.k_buffer.lens]
        self.v_window.lens = [n + 1 for n in self.v_window.lens]
        if max(self.k_buffer.lens) < c.group_size and max(self.v_window.lens) < c.local_window + c.group_size:
            return False
        self.pack_full()
        return True

    def _append_token_rows(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One decode token per sequence, k, v [B, H, D], not packed: into the sink while it has room,
        else into the key q-buffer and the value window."""
        to_sink = [b for b in range(self.batch) if self.k_sink.room(b) > 0]
        rest = [b for b in range(self.batch) if self.k_sink.room(b) <= 0]
        for rows, kr, vr in ((to_sink, self.k_sink, self.v_sink), (rest, self.k_buffer, self.v_window)):
            if rows:
                pick = torch.tensor(rows, device=k.device) if len(rows) < self.batch else slice(None)
                kr.append_rows(rows, k[pick])
                vr.append_rows(rows, v[pick])

    def _extend_padding(self, mask, t: int) -> None:
        """Left pads from the mask of a prompt, or of a chunk of it (transformers' `prefill_chunk_size`):
        a sequence whose chunks so far were all padding carries on counting in the next one."""
        lead = leading_pads(mask, self.batch, t)
        if self.seen == 0:
            self.pad = lead
            return
        for b in range(self.batch):
            if self.pad[b] == self.seen:
                self.pad[b] += lead[b]
            elif lead[b]:
                raise ValueError(_LEFT_PADDING)

    def _track_queries(self, query: torch.Tensor) -> None:
        """Accumulate squared queries [B, Hq, t, D] per KV head and channel, pads excluded."""
        if self.seen >= max(self.pad):  # every query is real: no mask (nor its host-built tensor)
            self.track_step_queries(query)
            return
        b, hq, t, d = query.shape
        q2 = query.float().pow(2).reshape(b, self.heads, hq // self.heads, t, d)
        skip = torch.tensor([min(max(p - self.seen, 0), t) for p in self.pad], device=query.device)
        real = (torch.arange(t, device=query.device)[None] >= skip[:, None]).float()  # [B, t]
        self.q_energy += torch.einsum("bhrtd,bt->bhd", q2, real)
        self.q_count += (real.sum(1) * (hq // self.heads)).reshape(b, 1, 1)

    def track_step_queries(self, query: torch.Tensor) -> None:
        """`_track_queries` for a step from device counters: every sequence's one query is real."""
        b, hq, t, d = query.shape
        self.q_energy += query.float().pow(2).reshape(b, self.heads, hq // self.heads, t, d).sum((2, 3))
        self.q_count += t * (hq // self.heads)

    def _query_rms(self, b: int) -> torch.Tensor | None:
        if self.config.selection != "qk":
            return None
        return (self.q_energy[b] / self.q_count[b].clamp_min(1)).sqrt().unsqueeze(0)  # [1, H, D]

    def _insert(self, b: int, k: torch.Tensor, v: torch.Tensor, pack: bool = True) -> None:
        """k, v [H, n, D]: real new tokens of sequence b, in order."""
        c = self.config
        take = min(self.k_sink.room(b), k.shape[1])
        if take:
            self.k_sink.append(b, k[:, :take])
            self.v_sink.append(b, v[:, :take])
            k, v = k[:, take:], v[:, take:]
        if not self.config.quantize:
            return
        if not pack:
            self.k_buffer.append(b, k)
            self.v_window.append(b, v)
            return
        g = c.group_size
        # keys: fill the q_buffer; every G tokens become one page (several at once in a prefill)
        buffered = self.k_buffer.tokens(b)
        if buffered.shape[1]:
            k = torch.cat([buffered, k], dim=1)
            self.k_buffer.clear(b)
        full = k.shape[1] // g * g
        if full:
            self._dirty(b, self.dropped[0, b] + self.k_sink.lens[b] + self.k_pages.pages_of(b) * g)
            pages = k[:, :full].reshape(self.heads, -1, g, self.head_dim).transpose(0, 1)  # [N, H, G, D]
            self.k_pages.add(b, self.engine.quantize_keys(pages, self.n_boost, c.selection, self.generator,
                                                          self._query_rms(b)))
            self._record_packed("k", b, k[:, :full], self.k_pages.pages_of(b))
        self.k_buffer.append(b, k[:, full:])
        # values: the window keeps the newest R; older ones wait in the q_buffer until G of them
        window = torch.cat([self.v_window.tokens(b), v], dim=1)
        self.v_window.clear(b)
        full = max(window.shape[1] - c.local_window, 0) // g * g
        if full:
            self._dirty(b, self.dropped[1, b] + self.v_sink.lens[b] + self.v_pages.pages_of(b) * g)
            pages = window[:, :full].reshape(self.heads, -1, g, self.head_dim).transpose(0, 1)
            self.v_pages.add(b, self.engine.quantize_values(pages, c.value_bits))
            self._record_packed("v", b, window[:, :full], self.v_pages.pages_of(b))
        self.v_window.append(b, window[:, full:])

    def _insert_all(self, k: torch.Tensor, v: torch.Tensor, pack: bool = True) -> None:
        """`_insert` for every sequence at once: k, v [B, H, n, D], all sequences in the same state."""
        c = self.config
        take = min(self.k_sink.room(0), k.shape[2])
        if take:
            self.k_sink.append_all(k[:, :, :take])
            self.v_sink.append_all(v[:, :, :take])
            k, v = k[:, :, take:], v[:, :, take:]
        if not c.quantize:
            return
        if not pack:
            self.k_buffer.append_all(k)
            self.v_window.append_all(v)
            return
        g, bsz, h, d = c.group_size, self.batch, self.heads, self.head_dim

        def as_pages(x):  # [B, H, N * G, D] -> [B * N, H, G, D], sequence-major (a view for N = 1)
            return x.reshape(bsz, h, -1, g, d).transpose(1, 2).reshape(-1, h, g, d)

        def pack_keys(x):
            self._dirty_all(self.dropped[0, 0] + self.k_sink.lens[0] + self.k_pages.pages_of(0) * g)
            rms = self._query_rms_all(x.shape[2] // g)
            self.k_pages.add_all(self.engine.quantize_keys(as_pages(x), self.n_boost, c.selection, self.generator, rms))
            self._record_packed("k", None, x, self.k_pages.pages_of(0))

        def pack_values(x):
            self._dirty_all(self.dropped[1, 0] + self.v_sink.lens[0] + self.v_pages.pages_of(0) * g)
            self.v_pages.add_all(self.engine.quantize_values(as_pages(x), c.value_bits))
            self._record_packed("v", None, x, self.v_pages.pages_of(0))

        _fill_and_pack(self.k_buffer, k, 0, g, pack_keys)  # keys: every G tokens become a page
        _fill_and_pack(self.v_window, v, c.local_window, g, pack_values)  # values: the newest R stay

    def _query_rms_all(self, pages_per_sequence: int) -> torch.Tensor | None:
        if self.config.selection != "qk":
            return None
        rms = (self.q_energy / self.q_count.clamp_min(1)).sqrt()  # [B, H, D]
        return rms.repeat_interleave(pages_per_sequence, dim=0)

    def _dirty_all(self, token: int) -> None:
        np.minimum(self._clean, token, out=self._clean)

    def drop_dense_view(self) -> None:
        """Free the reference engine's dense working view (rebuilt from the packed state on demand)."""
        self._view_k = self._view_v = None
        self._clean[:] = 0

    def kernel_state(self) -> dict:
        """What a decode kernel reads: FP16 regions, page pools, page tables and per-sequence counts.
        During device-driven steps, the counts are the counters and the grid spans the capacity."""
        c, dev = self.config, self.device
        tables = self.page_tables()
        if self.steps is not None:
            slots, lens_t = self.capacity_slots(), self.steps.lens
        else:
            slots = -(-max(self.seen - min(self.pad) - c.sink, 0) // c.group_size)
            # lengths on the device from the pads kept there: no host list, no copy per step
            if self._pads is None or self._pads[0] != self.pad:
                self._pads = (list(self.pad), torch.tensor(self.pad, dtype=torch.int32, device=dev))
            lens_t = self.seen - self._pads[1]
        def store(pool, kind):
            if pool.store is not None:
                return pool.store
            x = torch.zeros((1, self.heads, c.group_size, self.head_dim), device=dev)  # a stand-in page
            pages = quantize_keys(x, self.n_boost) if kind == "k" else quantize_values(x, c.value_bits)
            return {f.name: getattr(pages, f.name) for f in fields(pages)}
        return {
            "lens": lens_t, "max_slots": slots, **tables,
            "k_pages": store(self.k_pages, "k"), "v_pages": store(self.v_pages, "v"),
            "k_sink": self.k_sink.buf, "v_sink": self.v_sink.buf,
            "k_buffer": self.k_buffer.buf, "v_window": self.v_window.buf,
        }

    def page_tables(self) -> dict:
        """The device page tables [B, width] and page counts [B] of both pools, as the pools keep them
        (`PagePool`; a slot beyond a sequence's pages holds 0, which kernels never read)."""
        return {"n_kpages": self.k_pages.device_n, "n_vpages": self.v_pages.device_n,
                "k_table": self.k_pages.device_ids, "v_table": self.v_pages.device_ids}

    def sequence_history(self, b: int, dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [H, n_b - start, D] of sequence b from token `start` on, as attention sees
        them: FP16 parts as stored, pages dequantized (only the pages that reach past `start`)."""
        c = self.config
        dk, dv = (int(x) for x in self.dropped[:, b])  # a sliding layer's tokens before these are gone (zeros)
        keys = [(dk, self.k_sink.tokens(b))]
        values = [(dv, self.v_sink.tokens(b))]
        if c.quantize:
            g = c.group_size
            for parts, pool, tail, dequant, base in ((keys, self.k_pages, self.k_buffer, dequantize_keys, dk),
                                                     (values, self.v_pages, self.v_window, dequantize_values, dv)):
                n_sink, n_pages = base + parts[0][1].shape[-2], pool.pages_of(b)
                first = max(start - n_sink, 0) // g if start > n_sink else 0
                if first < n_pages:
                    parts.append((n_sink + first * g, _flatten_pages(dequant(pool.pages(b, first), dtype))))
                parts.append((n_sink + n_pages * g, tail.tokens(b)))
        return _join_from(keys, start, dtype), _join_from(values, start, dtype)

    def block_history(self, rows: slice, dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`sequence_history` of a block of sequences at once, [len(rows), H, n - start, D], for a
        batch without padding (every sequence holds the same tokens in the same places): one page
        gather and one dequantization for the block instead of one per sequence."""
        c = self.config
        dk, dv = (int(x) for x in self.dropped[:, 0])  # the same in every sequence here
        keys = [(dk, self.k_sink.buf[rows, :, : self.k_sink.lens[0]])]
        values = [(dv, self.v_sink.buf[rows, :, : self.v_sink.lens[0]])]
        if c.quantize:
            g = c.group_size
            for parts, pool, tail, dequant, base in ((keys, self.k_pages, self.k_buffer, dequantize_keys, dk),
                                                     (values, self.v_pages, self.v_window, dequantize_values, dv)):
                n_sink, n_pages = base + parts[0][1].shape[-2], pool.pages_of(0)
                first = max(start - n_sink, 0) // g if start > n_sink else 0
                if first < n_pages:
                    ids = pool.device_ids[rows, first:n_pages].flatten()
                    pages = dequant(pool.kind(**{k: v.index_select(0, ids) for k, v in pool.store.items()}), dtype)
                    _, h, _, d = pages.shape  # [block x pages, H, G, D], sequence-major
                    per = n_pages - first
                    pages = pages.reshape(-1, per, h, g, d).transpose(1, 2).reshape(-1, h, per * g, d)
                    parts.append((n_sink + first * g, pages))
                parts.append((n_sink + n_pages * g, tail.buf[rows, :, : tail.lens[0]]))
        return _join_from(keys, start, dtype), _join_from(values, start, dtype)

    def dense_history(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H, seen, D] keys and values as attention sees them, each sequence right-aligned behind
        its pads (zeros). Kept as a view that is rebuilt only where tokens arrived or were packed
        since the last call, so a decode step costs O(new tokens), not O(history)."""
        if self._view_k is not None and self._view_k.dtype != dtype:
            self._view_k = self._view_v = None
            self._clean[:] = 0
        cap = 0 if self._view_k is None else self._view_k.shape[2]
        if self.seen == 0:
            empty = torch.zeros((self.batch, self.heads, 0, self.head_dim), dtype=dtype, device=self.device)
            return empty, empty
        if self.seen > cap:
            shape = (self.batch, self.heads, max(self.seen, 2 * cap, 256), self.head_dim)
            grown_k = torch.zeros(shape, dtype=dtype, device=self.device)
            grown_v = torch.zeros(shape, dtype=dtype, device=self.device)
            if cap:
                grown_k[:, :, :cap], grown_v[:, :, :cap] = self._view_k, self._view_v
            self._view_k, self._view_v = grown_k, grown_v
        lockstep = not any(self.pad) and (self._clean == self._clean[0]).all()
        if lockstep and self._clean[0] < self.seen:
            # blocks of sequences of about 2^24 elements on a GPU (few launches), 2^20 on a CPU (in cache)
            budget = 1 << (24 if self.device.type == "cuda" else 20)
            start, step = int(self._clean[0]), max(1, budget // (self.heads * self.head_dim * self.seen))
            for first in range(0, self.batch, step):
                rows = slice(first, min(first + step, self.batch))
                k, v = self.block_history(rows, dtype, start)
                self._view_k[rows, :, start : self.seen] = k
                self._view_v[rows, :, start : self.seen] = v
            self._clean[:] = self.seen
        for b in range(self.batch):
            start, n = int(self._clean[b]), self.tokens(b)
            if start < n:
                k, v = self.sequence_history(b, dtype, start)
                at = self.pad[b] + start
                self._view_k[b, :, at : at + k.shape[1]] = k
                self._view_v[b, :, at : at + v.shape[1]] = v
                self._clean[b] = n
        return self._view_k[:, :, : self.seen], self._view_v[:, :, : self.seen]

    def _dirty(self, b: int, token: int) -> None:
        """Tokens of sequence b from `token` on changed form (packed) since the dense view was built."""
        self._clean[b] = min(self._clean[b], token)

    def nbytes(self) -> dict[str, int]:
        """Stored bytes of this layer by part."""
        parts = {"key sink": self.k_sink.nbytes(), "value sink": self.v_sink.nbytes()}
        if self.config.quantize:
            parts["key q_buffer"] = self.k_buffer.nbytes()
            parts["value window + q_buffer"] = self.v_window.nbytes()
            k, v = self.k_pages.nbytes(), self.v_pages.nbytes()
            parts["key dense plane"] = k["dense"]
            parts["key high plane"] = k["high"]
            parts["key boost index"] = k["boost_ch"]
            parts["key scales/zeros"] = k["scale"] + k["zero"]
            parts["value planes"] = v["low"] + v["high"]
            parts["value scales/zeros"] = v["scale"] + v["zero"]
        if self.window is not None:
            if not self.config.quantize:  # every token in FP16 (the "sink" region holds them all)
                parts = {"keys": parts["key sink"], "values": parts["value sink"]}
            parts = {f"{SLIDING}{part}": n for part, n in parts.items() if not part.endswith(" sink") or n}
        return parts


def _fill_and_pack(region: Fp16Region, new: torch.Tensor, keep: int, g: int, pack) -> None:
    """Append `new` [B, H, n, D] to a region whose sequences all hold the same tokens, and pass its
    oldest whole pages of G tokens, all but at least `keep` of them, to `pack` ([B, H, N * G, D]).
    Tokens already held are read where they are: a decode step's packing, which brings no new
    tokens, copies only the tokens that stay, down to the region's start."""
    held = region.tokens_all()
    full = max(held.shape[2] + new.shape[2] - keep, 0) // g * g
    if not full:
        region.append_all(new)
        return
    x = torch.cat([held, new], dim=2) if held.shape[2] and new.shape[2] else (new if new.shape[2] else held)
    pack(x[:, :, :full])
    rest = x[:, :, full:]
    if x is held and rest.shape[2] > full:  # the tokens that stay would move down over themselves
        rest = rest.clone()
    region.clear_all()
    region.append_all(rest)


def _join_from(parts: list[tuple[int, torch.Tensor]], start: int, dtype) -> torch.Tensor:
    """Concatenate (first_token, [..., H, n, D]) parts along tokens, keeping tokens from `start` on;
    tokens before the first part (dropped by a sliding window, never attended again) read as zeros."""
    kept = [x[..., max(start - first, 0):, :] for first, x in parts if first + x.shape[-2] > start]
    gone = parts[0][0] - start
    if gone > 0:
        x = parts[0][1]
        kept.insert(0, x.new_zeros((*x.shape[:-2], gone, x.shape[-1])))
    return torch.cat(kept, dim=-2).to(dtype) if kept else parts[0][1][..., :0, :].to(dtype)


def _flatten_pages(x: torch.Tensor) -> torch.Tensor:
    """[N, H, G, D] -> [H, N*G, D]."""
    n, h, g, d = x.shape
    return x.transpose(0, 1).reshape(h, n * g, d)


_LEFT_PADDING = ("KittyCache expects left padding (pads first, then the real tokens); "
                 "set tokenizer.padding_side = 'left'")


def leading_pads(mask: torch.Tensor | None, batch: int, length: int) -> list[int]:
    """Pads at the start of each sequence's `length` new tokens, from the 4D mask of a prefill: the
    diagonal of its last `length` columns, where a real token sees itself and a pad is masked (the last
    row would not do: a sliding window hides real tokens from it). All `length` may be pads (a chunk
    of a longer prompt); a pad after a real token is an error."""
    if mask is None:
        return [0] * batch
    n = torch.arange(length, device=mask.device)
    row = mask[:, 0, n - length + mask.shape[2], n - length + mask.shape[3]]  # [B or 1, length]
    allowed = row if row.dtype == torch.bool else row == 0
    allowed = allowed.expand(batch, length).cpu()
    pads = []
    for b in range(batch):
        n_pad = int((~allowed[b]).sum())
        if bool((~allowed[b, n_pad:]).any()):
            raise ValueError(_LEFT_PADDING)
        pads.append(n_pad)
    return pads


SLIDING = "sliding window: "  # the memory report's parts of sliding-window layers
_STORED_AS = {  # what the packed parts are (quant.py); every other part holds the model's dtype
    "key dense plane": "2-bit codes", "key high plane": "2-bit codes", "value planes": "2-bit codes",
    "key boost index": "channel index", "key scales/zeros": "float16", "value scales/zeros": "float16",
}


class KittyCache(Cache):
    """A transformers `Cache` of Kitty layers. `KittyCache(model, "kitty-pro")`, then
    `model.generate(..., past_key_values=cache)`. Building one switches the model's attention to the
    `kitty` implementation (SDPA for everything that is not a KittyCache).

    On the Triton engine, decode steps run from device counters as soon as the prompt is stored
    (`begin_device_steps_if_possible`): they read nothing from the host's record, so the cache is
    compileable and `generate` decodes through transformers' compiled forward, replayed from CUDA
    graphs (`ops`). A prefill (a later turn of a conversation) goes back to host steps for itself."""

    def __init__(self, model, method: str | KittyConfig = "kitty", engine: str | None = None,
                 max_length: int | None = None, device_steps: bool = True, fp16_layers=()):
        """`max_length` (tokens per sequence, prompt included): reserve the page pools up front, so
        that memory use is known from the first step and pools never grow by doubling. Without it,
        device-driven steps reserve room for twice the tokens held when they begin, and begin anew
        (the compiled step records its CUDA graphs again) when that is used up. `device_steps=False`
        keeps every step on the host's record (eager only, as the reference engine runs).
        `fp16_layers`: indices of layers kept wholly in FP16 while the others use `method`, to see
        which layers a method's error comes from; such a cache steps from the host's record.

        A `max_length` beyond the model's context is refused. Without one, the cache cannot know how
        far a generation goes: past the context it goes on as transformers does (which warns)."""
        check_supported(model)
        context = model_shape(model.config)["context"]
        if max_length is not None and context and max_length > context:
            raise ValueError(f"max_length={max_length} is beyond the model's context of {context} tokens: keep the "
                             f"prompt and the new tokens within {context}")
        self.config = parse_method(method)
        fp16_layers = set(fp16_layers)
        self.device_steps = device_steps and not fp16_layers
        if engine is None:
            engine = "triton" if _on_cuda(model) and "triton" in available_engines() else "reference"
        self.engine = make_engine(engine)
        enable_kitty_attention(model)
        if _on_cuda(model):  # `generate` may compile its steps in this thread
            cudagraph_trees_for_this_thread()
        windows = layer_windows(model.config)
        n = len(windows)
        if not fp16_layers <= set(range(n)):
            raise ValueError(f"fp16_layers must be layer indices in [0, {n - 1}], got {sorted(fp16_layers)}")
        shape = model_shape(model.config)
        # query heads per KV head: under tensor parallel a rank's layers hold a slice of the KV heads
        # (`sharding`), and the kernels take that rank's query heads, this many per KV head it holds
        self.group = shape["q_heads"] // shape["kv_heads"]
        self.q_heads = shape["q_heads"]
        self.counters = None
        self._layout = None  # the state's addresses the counters' CUDA graphs were recorded against
        self.softcap = softcapping(model.config)
        fp16 = parse_method("fp16")
        layers = [KittyLayer(fp16 if i in fp16_layers else self.config, self.engine, i, max_length, owner=self,
                             window=w) for i, w in enumerate(windows)]
        layers[-1].last = True
        for layer in layers:
            layer.softcap = self.softcap
        if self.config.allocation:  # boosted channels per layer from a calibration of this model
            boosts = calibrate.check(self.config.allocation, self.config, model_shape(model.config))
            if len(boosts) != n:
                raise ValueError(f"{self.config.allocation} has {len(boosts)} layers' counts; this model has {n} "
                                 "attention layers")
            for layer, boost in zip(layers, boosts):
                layer.boost = boost
        super().__init__(layers=layers)

    @property
    def is_compileable(self) -> bool:
        """Can `generate` compile the decode step? On an engine that steps from device counters."""
        return (self.device_steps and self.config.quantize and getattr(self.engine, "device_steps", False)
                and not any(layer.is_sliding for layer in self.layers))

    def memory_report(self) -> pd.DataFrame:
        """Stored bytes by part, summed over layers, with bytes per real token and what each part is
        stored as: the FP16 parts (and every token of the "fp16" preset) hold the model's own dtype,
        float32 for a model loaded in fp32, twice an FP16 cache's bytes."""
        totals: dict[str, int] = {}
        for layer in self.layers:
            if layer.is_initialized:
                for part, n in layer.nbytes().items():
                    totals[part] = totals.get(part, 0) + n
        tokens = sum(self.layers[0].tokens(b) for b in range(self.layers[0].batch)) if self.is_initialized else 0
        df = pd.DataFrame({"part": list(totals), "bytes": list(totals.values())})
        df["bytes_per_token"] = df["bytes"] / max(tokens, 1)
        dtype = str(self.layers[0].dtype).removeprefix("torch.") if self.is_initialized else None
        df["stored_as"] = [_STORED_AS.get(part.removeprefix(SLIDING), dtype) for part in df["part"]]
        return df

    def nbytes(self) -> int:
        return int(self.memory_report()["bytes"].sum())

    def steps_to_pack(self) -> int | None:
        """Decode steps (one token per sequence) until the one that packs pages: 1 if the next step
        does. None for a cache that never packs (FP16) or a padded batch, whose sequences pack at
        different steps."""
        first = next((layer for layer in self.layers if not layer.is_sliding), self.layers[0])
        c = first.config
        if not c.quantize or not first.is_initialized or any(first.pad) or min(first.k_sink.lens) < c.sink:
            return None
        return min(c.group_size - first.k_buffer.lens[0], c.local_window + c.group_size - first.v_window.lens[0])

    # -- decode steps from device counters (the protocol of kitty_core.graphs) --------------------
    def device_steps_refusal(self, reserve: bool = False) -> str | None:
        """Why the next decode steps cannot run from device counters (None if they can). `reserve`:
        the pools may be reserved further when the steps begin."""
        first = self.layers[0]
        if not first.is_initialized:
            return "it is empty: prefill it first"
        if not self.config.quantize or not getattr(self.engine, "device_steps", False):
            return f"the {self.engine.name!r} engine attends from host state; the Triton engine (CUDA) can"
        if any(layer.is_sliding for layer in self.layers):
            return ("this model has sliding-window layers, which the Triton kernels do not take (they attend to every "
                    "token a layer holds): its steps attend through the reference path")
        devices = {layer.device for layer in self.layers if layer.is_initialized}
        if len(devices) > 1:
            # the counters a step reads live on one device, and one CUDA graph captures one device's work
            return (f"its layers are on {len(devices)} devices (a device_map): its steps attend from host state, "
                    "each layer on its own device")
        if not self.engine.takes(first, self.group * first.heads, first.device.type == "cuda"):
            return (f"the Triton kernels do not take this shape (page size {self.config.group_size}, head size "
                    f"{first.head_dim}: powers of two >= 64 on a GPU), so its steps attend from host state")
        if first.max_length is None and not reserve:
            return "it was built without max_length, so its page pools may grow (and move)"
        if min(first.k_sink.lens) < self.config.sink:
            return f"an FP16 sink is not full yet: every prompt needs at least {self.config.sink} tokens"
        if self.device_room() <= 0 and (not reserve or first.max_length is not None):
            # with max_length the pools are not reserved further ahead of need: a cache built for
            # the GPU's whole memory holds its last tokens on host steps, which grow it only if a
            # token more comes
            return "it holds the max_length it was built for"
        return None

    def begin_device_steps(self, by_operator: bool = False) -> None:
        """Decode steps from device counters from now on (ValueError saying why not). `by_operator`:
        each step ends with `kitty::end_step` (the model's forward does the host's part, `ops`), and
        the pools are reserved further if the held tokens fill them; otherwise the caller advances
        the counters and calls `after_device_step` (`GraphedDecoder`)."""
        why = self.device_steps_refusal(reserve=by_operator)
        if why:
            raise ValueError(f"this KittyCache cannot decode from device counters: {why}")
        first = self.layers[0]
        held = max(self.held_tokens())
        if first.capacity is None or held >= first.capacity:
            for layer in self.layers:  # twice what is held: as many re-recordings as doublings
                layer.reserve(max(2 * held, held + 2 * self.config.group_size))
        layout = []
        for layer in self.layers:  # what the steps' graphs will hold, where it is
            layer.k_pages.reserve_slots(layer.capacity_slots())
            layer.v_pages.reserve_slots(layer.capacity_slots())
            tensors = layer.state_tensors() + self.engine.prepare_steps(layer, self.group * layer.heads)
            layout += [t.data_ptr() for t in tensors]
        if self.counters is None or layout != self._layout or by_operator != self.counters.by_operator:
            if self.counters is not None:
                ops.unregister(self)
            # new counters, at a new address: a compiled step records its CUDA graphs again for them
            self.counters = StepCounters(first.batch, 2, first.device, by_operator)
            self._layout = layout
        ops.register(self)
        for layer in self.layers:
            layer.start_steps(self.counters)
        self.sync_device_steps()

    def begin_device_steps_if_possible(self) -> None:
        """After a forward from the host's record: steps from device counters from the next one, on an
        engine that can take them."""
        if self.device_steps and self.layers[0].steps is None and self.device_steps_refusal(reserve=True) is None:
            self.begin_device_steps(by_operator=True)

    def sync_device_steps(self) -> None:
        first = self.layers[0]
        self.counters.set([first.k_buffer.lens, first.v_window.lens], [n + 1 for n in self.held_tokens()])

    def end_device_steps(self) -> None:
        for layer in self.layers:
            layer.start_steps(None)

    def end_step(self) -> None:
        """The host's part of a decode step the model's forward ran from device counters
        (`kitty::end_step`): counters advanced, the host's record, packing. When the reserved room is
        used up, more is reserved and the steps begin anew (new counters: the next compiled step
        records its CUDA graphs again, without recompiling); a cache built with `max_length` ends its
        device-driven steps instead (the next compiled step, if any, is traced for the host path)."""
        self.counters.advance()
        self.after_device_step()
        if self.device_room() <= 0:
            if self.layers[0].max_length is None:
                self.begin_device_steps(by_operator=True)
            else:  # full at the length it was built for: a step more (if any) from the host's record
                self.end_device_steps()

    def step_shape(self) -> None:
        """Every device-driven step launches the same kernels (grids span the capacity): one graph."""
        return None

    def held_tokens(self) -> list[int]:
        first = self.layers[0]
        return [first.tokens(b) for b in range(first.batch)]

    def device_room(self) -> int:
        """Decode steps left before the longest sequence fills the room reserved for it."""
        return (self.layers[0].capacity or 0) - max(self.held_tokens())

    def after_device_step(self) -> None:
        packed = [layer.advance_host() for layer in self.layers]
        if any(packed):
            self.sync_device_steps()


def on_device(device: torch.device):
    """Make `device` current while a layer's kernels run: Triton launches on the current CUDA device, and
    the layers of a model split by a device_map are on several (a no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _on_cuda(model) -> bool:
    try:
        return next(model.parameters()).is_cuda
    except (StopIteration, AttributeError):
        return False


def available_engines() -> list[str]:
    engines = ["reference"]
    if torch.cuda.is_available():
        try:
            from . import triton_engine  # noqa: F401

            engines.append("triton")
        except ImportError:
            pass
    return engines
