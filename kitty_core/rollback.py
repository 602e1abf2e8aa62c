"""Rolling a layer back by its newest tokens (`crop`), as speculative decoding asks of a cache.

A mixin of `KittyLayer`: it works on the layer's tail regions and page pools (`layer.py`), and keeps
the source of the pages the latest forward packed, as the tail stored it (16-bit tokens, or an 8-bit
tail's codes and scales), so that a page can be reopened exactly.
"""

from __future__ import annotations

import torch


class Rollback:
    """`crop` and past recording for `KittyLayer`."""

    def activate_past_recording(self) -> None:
        """From now on keep the tail's source of the newest page each forward packs, until the next forward
        or crop, so that `crop` can reopen it (speculative decoding calls this before it starts)."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove each sequence's newest tokens, as transformers' caches do for speculative decoding:
        a negative count removes that many, a positive one is the length to keep (the older spelling),
        0 removes nothing. Tokens in the tail go as they are; a page that the latest forward packed
        is reopened from its source as the tail stored it when past recording is on (its slot goes back to the pool),
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
                            " that cannot be unpacked exactly: it was packed before the latest forward, or without"
                            " past recording, or it is not among the newest pages a forward keeps the source of (one"
                            " of keys); call cache.activate_past_recording() before the forward to roll back, crop "
                            "only within the latest forward's newest tokens, or use the fp16 preset")
                    pool.pop(b)
                    self._dirty(b, base + sink.lens[b] + at * c.group_size)
                    keep = max(c.group_size - left, 0)
                    left -= c.group_size - keep
                    tail.append_stored(b, [s[:, :keep] for s in src])  # the tail is empty here: they are the newest
                # values leave the window for a page only once R newer ones follow: with fewer, the
                # pages that the forward packed too early open again
                while side == "v" and tail.lens[b] < c.local_window and pool.pages_of(b):
                    at = pool.pages_of(b) - 1
                    src = self._packed_source(side, b, at)
                    if src is None:
                        break
                    pool.pop(b)
                    self._dirty(b, base + sink.lens[b] + at * c.group_size)
                    tail.prepend_stored(b, src)
            if left > sink.lens[b]:
                raise RuntimeError("crop: the cache state machine is inconsistent")
            sink.lens[b] -= left

    def _record_packed(self, side: str, rows, stored: list[torch.Tensor], pages_held: int) -> None:
        """While past recording is on: the source of the n pages just packed for sequence `rows`, as
        the tail stored it (`TailRegion.encode`: [.., H, n * G, D] tokens, or codes and their scales
        [.., H, n * G]; None: every sequence, a leading batch dimension), which now holds
        `pages_held`. The newest pages only: as many as a rollback can reopen (one key page; values:
        the pages that a local window of R can take back, and one)."""
        if self.record_past:
            g, dim = self.config.group_size, 1 if rows is not None else 2
            n = stored[0].shape[dim]
            keep = min(n // g, 1 if side == "k" else 1 + -(-self.config.local_window // g))
            self._packed[side][rows] = (pages_held - keep, [t.narrow(dim, n - keep * g, keep * g).clone()
                                                            for t in stored])

    def _packed_source(self, side: str, b: int, at: int) -> list[torch.Tensor] | None:
        """The source of page `at` of sequence b as the tail stored it ([H, G, D], and an 8-bit tail's
        scales [H, G]), if the latest forward packed it and it was recorded."""
        g = self.config.group_size
        for rows in (b, None):
            held = self._packed[side].get(rows)
            if held is not None and held[0] <= at < held[0] + held[1][0].shape[-2] // g:
                src = held[1] if rows is not None else [t[b] for t in held[1]]
                return [t[:, (at - held[0]) * g : (at - held[0] + 1) * g] for t in src]
        return None
