"""One layer of the Kitty KV cache: a state machine over FP16 regions and packed pages (paper, section 4.3).

Per layer, every sequence b of the batch owns (n_b = real tokens it has seen; pads never enter):
    key   sink      FP16 [H, min(n_b, S), D]     the first S tokens
          q_buffer  FP16 [H, < G, D]             keys waiting to fill a page
          pages     KeyPages, G tokens each       mixed INT2/INT4 (kernels/pages.py)
    value sink      FP16 [H, min(n_b, S), D]
          window    FP16 [H, < R + G, D]         the local window of the newest R values, plus the
                                                  value q_buffer of tokens that left it (oldest first)
          pages     ValuePages, G tokens each
The FP16 parts (the tail) hold the model's dtype, or int8 with a scale a vector under `tail_bits=8`
(`regions.py`). Every step inserts the new tokens after attention has used them (`as_stored`), and packs
a buffer into a page as soon as it holds G tokens, so a layer packs at most once every G decode
steps.

Sequences of a left-padded batch are independent: each has its own sink, buffers and page
boundaries. The padded layout that transformers' masks expect is kept by right-aligning every
sequence's history when an engine needs it dense.

The state lives in tensors shared by all sequences ([B, H, cap, D] tail regions of `regions.py`,
page pools of `page_pool.py`) plus per-sequence integer counters; an engine (`reference_engine.py`,
or the Triton engine of `triton_engine.py` over the kernels in `kernels/`) reads it to attend. The
layer's other jobs have their own modules: the history read back dense (`dense_view.py`), a rollback
by the newest tokens (`rollback.py`). The transformers glue (attention function, mask) is in `hf.py`.
"""

from __future__ import annotations

import weakref
from dataclasses import fields
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from kernels.pages import KeyPages, ValuePages

from .config import KittyConfig
from .dense_view import DenseHistory
from .hf import LEFT_PADDING, PendingKV, leading_pads
from .page_pool import PagePool
from .quant import quantize_keys, quantize_values
from .reference_engine import ReferenceEngine
from .regions import TailRegion
from .rollback import Rollback
from .sharding import on_device

if TYPE_CHECKING:
    from .cache import KittyCache

SLIDING = "sliding window: "  # the memory report's parts of sliding-window layers
# the memory report's tail parts (FP16, or 8 bits with tail_bits=8): what a decode step reads beside the pages
TAIL_PARTS = ("key sink", "value sink", "key q_buffer", "value window + q_buffer")


class KittyLayer(Rollback, DenseHistory, CacheLayerMixin):
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
        self._packed = {"k": {}, "v": {}}  # side -> {sequence (None: all): (page index, source in stored form)}

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
        bits = c.tail_bits if c.quantize else 16
        mk = lambda cap, grow=False: TailRegion(b, h, d, self.dtype, self.device, cap, grow, bits)  # noqa: E731
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

    # -- the state machine -----------------------------------------------------------------------
    def tokens(self, b: int) -> int:
        """Real tokens held for sequence b."""
        return self.seen - self.pad[b]

    def attend(self, module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        """Attend over history + the new tokens (`as_stored`), then insert them and pack full buffers.

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

    def as_stored(self, key_new: torch.Tensor, value_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens [B, H, t, D] as a forward's attention reads them. A decode step (t = 1) reads
        its token as the tail stores it (`as_tail_holds`): the decode kernel writes the token before
        it reads it, and every engine reads the same. A forward of several tokens (a prefill chunk,
        the tokens speculative decoding verifies) reads them as the model computed them, the paper's
        FP16 prefill: rounding a prompt's own tokens inside its prefill would move every later
        layer's keys and values, which the pages and the tail then hold (measured in
        docs/engine.md, "An 8-bit tail")."""
        if key_new.shape[2] > 1:
            return key_new, value_new
        return self.as_tail_holds(key_new, value_new)

    def as_tail_holds(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [..., n, D] as the tail stores them, in the model's dtype: rounded to int8 and back
        under `tail_bits=8`, as they are otherwise."""
        if self.k_sink.scale is None:
            return keys, values
        return self.k_sink.decode(self.k_sink.encode(keys)), self.v_sink.decode(self.v_sink.encode(values))

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
                nothing = self._no_tokens(self.batch)
                self._insert_all(nothing, nothing, pack=True)
            return
        g, r = c.group_size, c.local_window
        for b in range(self.batch):  # more than one token past a page boundary: the general path
            if self.k_buffer.lens[b] > g or self.v_window.lens[b] > r + g:
                nothing = self._no_tokens()
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
            pages = self.k_buffer.block(torch.tensor(keys, device=dev), g)  # [n, H, G, D]
            self.k_pages.add_rows(keys, self.engine.quantize_keys(pages, self.n_boost, c.selection, self.generator, rms))
            for b in keys:
                self._record_packed("k", b, self.k_buffer.stored(b), self.k_pages.pages_of(b))
                self.k_buffer.clear(b)
        if values:  # the oldest G values of each full window become a page; the newest R move up
            idx = torch.tensor(values, device=self.device)
            for b in values:
                self._dirty(b, self.dropped[1, b] + self.v_sink.lens[b] + self.v_pages.pages_of(b) * g)
            self.v_pages.add_rows(values, self.engine.quantize_values(self.v_window.block(idx, g), c.value_bits))
            for b in values:
                self._record_packed("v", b, [s[:, :g] for s in self.v_window.stored(b)], self.v_pages.pages_of(b))
            self.v_window.shift_down(idx, g, r)
            for b in values:
                self.v_window.lens[b] = r

    def _no_tokens(self, *batch: int) -> torch.Tensor:
        """Zero tokens [*batch, H, 0, D] in the model's dtype: an insert that only packs."""
        return torch.empty((*batch, self.heads, 0, self.head_dim), dtype=self.dtype, device=self.device)

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
        return self.slots_for(self.capacity)

    def slots_for(self, tokens: int) -> int:
        """Page slots of a sequence of `tokens` tokens (at least one)."""
        return -(-max(tokens - self.config.sink, 1) // self.config.group_size)

    def start_steps(self, counters) -> None:
        """Decode steps from `counters` (None: from the host's state again); `KittyCache.begin_device_steps`
        has made the page tables as wide as the capacity (they must not move while graphs hold them)."""
        self.steps = counters

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of this layer that a decode step reads or writes (what its CUDA graphs hold)."""
        regions = [t for r in (self.k_sink, self.v_sink, self.k_buffer, self.v_window) if r is not None
                   for t in r.tensors()]
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
                raise ValueError(LEFT_PADDING)

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

        def pack_keys(x, stored):  # [H, N * G, D]: every G keys become one page (several at once in a prefill)
            self._dirty(b, self.dropped[0, b] + self.k_sink.lens[b] + self.k_pages.pages_of(b) * g)
            pages = x.reshape(self.heads, -1, g, self.head_dim).transpose(0, 1)  # [N, H, G, D]
            self.k_pages.add(b, self.engine.quantize_keys(pages, self.n_boost, c.selection, self.generator,
                                                          self._query_rms(b)))
            self._record_packed("k", b, stored, self.k_pages.pages_of(b))

        def pack_values(x, stored):
            self._dirty(b, self.dropped[1, b] + self.v_sink.lens[b] + self.v_pages.pages_of(b) * g)
            pages = x.reshape(self.heads, -1, g, self.head_dim).transpose(0, 1)
            self.v_pages.add(b, self.engine.quantize_values(pages, c.value_bits))
            self._record_packed("v", b, stored, self.v_pages.pages_of(b))

        self.k_buffer.fill(b, k, 0, g, pack_keys)  # keys: the q-buffer packs whole pages
        self.v_window.fill(b, v, c.local_window, g, pack_values)  # values: the window keeps the newest R

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

        def pack_keys(x, stored):
            self._dirty_all(self.dropped[0, 0] + self.k_sink.lens[0] + self.k_pages.pages_of(0) * g)
            rms = self._query_rms_all(x.shape[2] // g)
            self.k_pages.add_all(self.engine.quantize_keys(as_pages(x), self.n_boost, c.selection, self.generator, rms))
            self._record_packed("k", None, stored, self.k_pages.pages_of(0))

        def pack_values(x, stored):
            self._dirty_all(self.dropped[1, 0] + self.v_sink.lens[0] + self.v_pages.pages_of(0) * g)
            self.v_pages.add_all(self.engine.quantize_values(as_pages(x), c.value_bits))
            self._record_packed("v", None, stored, self.v_pages.pages_of(0))

        self.k_buffer.fill_all(k, 0, g, pack_keys)  # keys: every G tokens become a page
        self.v_window.fill_all(v, c.local_window, g, pack_values)  # values: the newest R stay

    def _query_rms_all(self, pages_per_sequence: int) -> torch.Tensor | None:
        if self.config.selection != "qk":
            return None
        rms = (self.q_energy / self.q_count.clamp_min(1)).sqrt()  # [B, H, D]
        return rms.repeat_interleave(pages_per_sequence, dim=0)

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
            # an 8-bit tail's scales, one per token of each region (None: the regions hold 16-bit tokens)
            "tail_scales": None if self.k_sink.scale is None else
            (self.k_sink.scale, self.v_sink.scale, self.k_buffer.scale, self.v_window.scale),
        }

    def page_tables(self) -> dict:
        """The device page tables [B, width] and page counts [B] of both pools, as the pools keep them
        (`PagePool`; a slot beyond a sequence's pages holds 0, which kernels never read)."""
        return {"n_kpages": self.k_pages.device_n, "n_vpages": self.v_pages.device_n,
                "k_table": self.k_pages.device_ids, "v_table": self.v_pages.device_ids}

    def nbytes(self) -> dict[str, int]:
        """Stored bytes of this layer by part (TAIL_PARTS, then the packed pages')."""
        k_sink, v_sink, k_buffer, v_window = TAIL_PARTS
        parts = {k_sink: self.k_sink.nbytes(), v_sink: self.v_sink.nbytes()}
        if self.config.quantize:
            parts[k_buffer] = self.k_buffer.nbytes()
            parts[v_window] = self.v_window.nbytes()
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
