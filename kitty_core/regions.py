"""The tail's token storage: per-sequence regions in one [B, H, cap, D] tensor (sink, key q-buffer,
value window), and the whole-batch fill of a region that packs its oldest whole pages.

A region keeps its tokens as the model computed them (16 bits: FP16 or BF16), or in 8 bits
(`KittyConfig.tail_bits=8`): each vector (one token, one head) as int8 codes on a symmetric scale of
its largest magnitude, 127 steps, with the scale in fp32 beside it ([B, H, cap]). An element's error
is at most scale / 2, that is 1/254 of its vector's largest magnitude. Every reader gets the
dequantized tokens in the model's dtype; kernels read both tensors (`tensors`).
"""

from __future__ import annotations

import math

import torch

INT8_STEPS = 127.0  # codes in [-127, 127]: the scale is the vector's largest magnitude / 127


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 codes [..., D], fp32 scales [...]): round to nearest (ties to even) on the
    scale max|x| / 127 of each vector; an all-zero vector has scale 0 and codes 0. The decode kernel
    that writes a step's token computes the same numbers (`kernels/state._store_token`)."""
    xf = x.float()
    scale = xf.abs().amax(-1) / INT8_STEPS
    codes = torch.round(xf / scale.clamp_min(1e-30)[..., None]).clamp_(-INT8_STEPS, INT8_STEPS)
    return codes.to(torch.int8), scale


def dequantize_tokens(codes: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return (codes.float() * scale[..., None]).to(dtype)


class TailRegion:
    """Per-sequence token storage: buf [B, H, cap, D] (the model's dtype, or int8 codes with scales
    [B, H, cap] in fp32 when `bits` is 8), lens[b] tokens used by sequence b."""

    def __init__(self, batch: int, heads: int, dim: int, dtype, device, capacity: int, growable: bool,
                 bits: int = 16):
        if bits not in (8, 16):
            raise ValueError(f"a tail region stores 8 or 16 bits a value, got {bits}")
        self.dtype = dtype  # what readers get back
        self.buf = torch.zeros((batch, heads, capacity, dim), dtype=dtype if bits == 16 else torch.int8,
                               device=device)
        self.scale = None if bits == 16 else torch.zeros((batch, heads, capacity), dtype=torch.float32,
                                                         device=device)
        self.lens = [0] * batch
        self.growable = growable

    @property
    def capacity(self) -> int:
        return self.buf.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        """What the region stores: the buffer, and the scales of an 8-bit one."""
        return [self.buf] if self.scale is None else [self.buf, self.scale]

    def room(self, b: int) -> int:
        return self.capacity - self.lens[b] if not self.growable else 1 << 62

    def _reserve(self, end: int) -> None:
        if end > self.capacity:
            if not self.growable:
                raise RuntimeError("tail region overflow: the cache state machine is inconsistent")
            new = max(end, 2 * self.capacity, 16)
            grown = self.buf.new_zeros((*self.buf.shape[:2], new, self.buf.shape[3]))
            grown[:, :, : self.capacity] = self.buf
            if self.scale is not None:
                scale = self.scale.new_zeros((*self.scale.shape[:2], new))
                scale[:, :, : self.capacity] = self.scale
                self.scale = scale
            self.buf = grown

    def _write(self, index: tuple, x: torch.Tensor) -> None:
        """buf[index] = x ([..., D], stored as the region stores), and the scales of an 8-bit region."""
        if self.scale is None:
            self.buf[index] = x
        else:
            self.buf[index], self.scale[index] = quantize_tokens(x)

    def _read(self, index: tuple) -> torch.Tensor:
        if self.scale is None:
            return self.buf[index]
        return dequantize_tokens(self.buf[index], self.scale[index], self.dtype)

    def append(self, b: int, x: torch.Tensor) -> None:
        """x [H, n, D] -> after the tokens of sequence b."""
        n, start = x.shape[1], self.lens[b]
        self._reserve(start + n)
        self._write((b, slice(None), slice(start, start + n)), x)
        self.lens[b] = start + n

    def append_all(self, x: torch.Tensor) -> None:
        """x [B, H, n, D] -> after the tokens of every sequence (all sequences hold the same count)."""
        n, start = x.shape[2], self.lens[0]
        if n:
            self._reserve(start + n)
            self._write((slice(None), slice(None), slice(start, start + n)), x)
            self.lens = [start + n] * len(self.lens)

    def append_rows(self, rows: list[int], x: torch.Tensor) -> None:
        """x [len(rows), H, D]: one token after the tokens of each listed sequence (own positions),
        in one indexed write."""
        if not rows:
            return
        self._reserve(max(self.lens[b] for b in rows) + 1)
        dev = self.buf.device
        pos = torch.tensor([self.lens[b] for b in rows], device=dev)
        self._write((torch.tensor(rows, device=dev), slice(None), pos), x)
        for b in rows:
            self.lens[b] += 1

    def tokens(self, b: int) -> torch.Tensor:
        """[H, n, D]: sequence b's tokens, in the model's dtype."""
        return self._read((b, slice(None), slice(0, self.lens[b])))

    def tokens_all(self) -> torch.Tensor:
        """[B, H, n, D] when every sequence holds the same count n."""
        return self._read((slice(None), slice(None), slice(0, self.lens[0])))

    def block(self, rows, n: int) -> torch.Tensor:
        """[len(rows), H, n, D]: the first n tokens of the sequences `rows` (a slice or an index tensor)."""
        return self._read((rows, slice(None), slice(0, n)))

    def shift_down(self, rows: torch.Tensor, n: int, keep: int) -> None:
        """In the sequences `rows`, the `keep` tokens after the first n move to the region's start
        (the caller sets `lens`)."""
        for t in self.tensors():
            t[rows, :, :keep] = t[rows, :, n : n + keep]

    def clear(self, b: int) -> None:
        self.lens[b] = 0

    def drop_oldest(self, b: int | None, n: int) -> None:
        """Drop the n oldest tokens of sequence b (None: of every sequence, which hold the same count);
        the rest move to the region's start."""
        if not n:
            return
        rows = slice(None) if b is None else b
        held = self.lens[0 if b is None else b]
        for t in self.tensors():
            t[rows, :, : held - n] = t[rows, :, n:held].clone()
        if b is None:
            self.lens = [held - n] * len(self.lens)
        else:
            self.lens[b] = held - n

    def clear_all(self) -> None:
        self.lens = [0] * len(self.lens)

    def fill(self, b: int, x: torch.Tensor, keep: int, g: int, pack) -> None:
        """Append x [H, n, D] to sequence b's tokens, and pass their oldest whole pages of G tokens,
        all but at least `keep` tokens, to `pack` ([H, N * G, D], the model's dtype) before they
        leave. The tokens that stay move as stored: an 8-bit region never quantizes a token twice."""
        held, n = self.lens[b], x.shape[1]
        full = max(held + n - keep, 0) // g * g
        if full:
            pack(torch.cat([self.tokens(b), x], dim=1)[:, :full] if held else x[:, :full])
        if full <= held:
            self.drop_oldest(b, full)
            self.append(b, x)
        else:
            self.clear(b)
            self.append(b, x[:, full - held :])

    def fill_all(self, x: torch.Tensor, keep: int, g: int, pack) -> None:
        """`fill` for every sequence at once, x [B, H, n, D], all sequences holding the same count. A
        decode step's packing, which brings no new tokens, reads the page where it lies and copies
        only the tokens that stay, down to the region's start."""
        held, n = self.lens[0], x.shape[2]
        full = max(held + n - keep, 0) // g * g
        if full:
            src = self.tokens_all() if not n else torch.cat([self.tokens_all(), x], dim=2) if held else x
            pack(src[:, :, :full])
        if full <= held:
            self.drop_oldest(None, full)
            self.append_all(x)
        else:
            self.clear_all()
            self.append_all(x[:, :, full - held :])

    def nbytes(self) -> int:
        """Bytes of the tokens held (codes, and an 8-bit region's scales)."""
        per_token = self.buf.shape[1] * sum(math.prod(t.shape[3:]) * t.element_size() for t in self.tensors())
        return sum(self.lens) * per_token
