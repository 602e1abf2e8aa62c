"""FP16 token storage of a layer: per-sequence regions in one [B, H, cap, D] tensor (sink, q-buffer,
value window), and the whole-batch fill of a region that packs its oldest whole pages."""

from __future__ import annotations

import torch


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


def fill_and_pack(region: Fp16Region, new: torch.Tensor, keep: int, g: int, pack) -> None:
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
