"""A layer's history read back as attention sees it: pages dequantized, FP16 parts as stored.

A mixin of `KittyLayer`. `sequence_history` and `block_history` rebuild it from the packed state;
`dense_history` keeps a [B, H, seen, D] view for the reference engine that is rebuilt only where
tokens arrived or were packed (`_dirty`), so a decode step costs O(new tokens), not O(history).
The view is the engine's working copy: the memory report counts the packed state.
"""

from __future__ import annotations

import numpy as np
import torch

from .quant import dequantize_keys, dequantize_values


class DenseHistory:
    """Dense views of `KittyLayer`'s history."""

    def _dirty_all(self, token: int) -> None:
        np.minimum(self._clean, token, out=self._clean)

    def drop_dense_view(self) -> None:
        """Free the reference engine's dense working view (rebuilt from the packed state on demand)."""
        self._view_k = self._view_v = None
        self._clean[:] = 0

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
        keys = [(dk, self.k_sink.block(rows, self.k_sink.lens[0]))]
        values = [(dv, self.v_sink.block(rows, self.v_sink.lens[0]))]
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
                parts.append((n_sink + n_pages * g, tail.block(rows, tail.lens[0])))
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
