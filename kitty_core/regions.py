"""The tail's token storage: per-sequence regions in one [B, H, cap, D] tensor (sink, key q-buffer,
value window), and the whole-batch fill of a region that packs its oldest whole pages.

A region keeps its tokens as the model computed them (16 bits: FP16 or BF16), or in 8 bits
(`KittyConfig.tail_bits=8`): each vector (one token, one head) as int8 codes on a symmetric scale of
its largest magnitude, 127 steps, with the scale in fp32 beside it ([B, H, cap]). An element's error
is at most scale / 2, that is 1/254 of its vector's largest magnitude. Every reader gets the
dequantized tokens in the model's dtype; kernels read both tensors (`tensors`).

A token is quantized once, when it enters a region, and from then on moves as stored: the tokens
that stay when pages pack, the pages' sources a rollback reopens (`stored` form: the region's
tensors' slices, codes and scales or 16-bit tokens). A page that began in the region is packed from
the stored values of all its tokens, the one that completes it included, whichever engine or kernel
wrote that one; a page that a chunk of new tokens fills by itself (a prefill's) is packed from the
tokens as the model computed them. So an 8-bit tail's pages depend on how a prompt was cut into
chunks (a 16-bit tail's do not): a page that one chunk begins and the next completes holds rounded
tokens, where the whole prompt in one chunk would have packed them as computed.
"""

from __future__ import annotations

import math

import torch

INT8_STEPS = 127.0  # codes in [-127, 127]: the scale is the vector's largest magnitude / 127


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 codes [..., D], fp32 scales [...]): round to nearest (ties to even) on the
    scale max|x| x (1/127) of each vector; an all-zero vector has scale 0 and codes 0. The decode kernel
    that writes a step's token computes the same numbers (`kernels/state._store_token`)."""
    xf = x.float()
    # a product and a correctly rounded division (IEEE, as torch divides on CPU and CUDA): the
    # kernel's `tl.math.div_rn` gives the same codes, where Triton's `/` on a GPU is approximate
    scale = xf.abs().amax(-1) * (1.0 / INT8_STEPS)
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

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Tokens x [..., n, D] in stored form: [x] in the region's dtype, or an 8-bit region's
        [codes [..., n, D], scales [..., n]]."""
        return [x.to(self.buf.dtype)] if self.scale is None else list(quantize_tokens(x))

    def decode(self, stored: list[torch.Tensor]) -> torch.Tensor:
        """Tokens in stored form -> [..., n, D] in the model's dtype."""
        return stored[0] if self.scale is None else dequantize_tokens(*stored, self.dtype)

    def _stored(self, index: tuple) -> list[torch.Tensor]:
        return [t[index] for t in self.tensors()]

    def _write(self, index: tuple, stored: list[torch.Tensor]) -> None:
        for t, part in zip(self.tensors(), stored):
            t[index] = part

    def _read(self, index: tuple) -> torch.Tensor:
        return self.decode(self._stored(index))

    def append(self, b: int, x: torch.Tensor) -> None:
        """x [H, n, D] -> after the tokens of sequence b."""
        self.append_stored(b, self.encode(x))

    def append_stored(self, b: int, stored: list[torch.Tensor]) -> None:
        """Tokens in stored form ([H, n, D] and [H, n]) -> after the tokens of sequence b, as they are."""
        n, start = stored[0].shape[1], self.lens[b]
        self._reserve(start + n)
        self._write((b, slice(None), slice(start, start + n)), stored)
        self.lens[b] = start + n

    def prepend_stored(self, b: int, stored: list[torch.Tensor]) -> None:
        """Tokens in stored form -> before the tokens of sequence b (which move up as stored)."""
        n, held = stored[0].shape[1], self.lens[b]
        self._reserve(held + n)
        for t, part in zip(self.tensors(), stored):
            t[b, :, n : n + held] = t[b, :, :held].clone()
            t[b, :, :n] = part
        self.lens[b] = held + n

    def stored(self, b: int) -> list[torch.Tensor]:
        """Sequence b's tokens in stored form."""
        return self._stored((b, slice(None), slice(0, self.lens[b])))

    def append_all(self, x: torch.Tensor) -> None:
        """x [B, H, n, D] -> after the tokens of every sequence (all sequences hold the same count)."""
        self._append_all_stored(self.encode(x))

    def _append_all_stored(self, stored: list[torch.Tensor]) -> None:
        n, start = stored[0].shape[2], self.lens[0]
        if n:
            self._reserve(start + n)
            self._write((slice(None), slice(None), slice(start, start + n)), stored)
            self.lens = [start + n] * len(self.lens)

    def append_rows(self, rows: list[int], x: torch.Tensor) -> None:
        """x [len(rows), H, D]: one token after the tokens of each listed sequence (own positions),
        in one indexed write."""
        if not rows:
            return
        self._reserve(max(self.lens[b] for b in rows) + 1)
        dev = self.buf.device
        pos = torch.tensor([self.lens[b] for b in rows], device=dev)
        self._write((torch.tensor(rows, device=dev), slice(None), pos), self.encode(x))
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

    def _computed_span(self, held: int, n: int, keep: int, g: int) -> tuple[int, int]:
        """Of n new tokens that a fill appends to `held` tokens (keeping at least `keep`), the span
        [start, end) that it packs as the model computed them: an 8-bit region's pages that the new
        tokens fill by themselves. (0, 0) where there are none (and always for a 16-bit region, whose
        stored tokens are the computed ones)."""
        full, begun = max(held + n - keep, 0) // g * g, -(-held // g) * g
        if self.scale is None or begun >= full:
            return 0, 0
        return begun - held, full - held

    def _page_tokens(self, src: list[torch.Tensor], x: torch.Tensor, held: int, span: tuple[int, int],
                     dim: int) -> torch.Tensor:
        """The tokens to pack from src (stored form: the held tokens, then x's) in the model's dtype:
        the pages that began in the region as stored, x's span that fills pages by itself as x brought
        it (`_computed_span`)."""
        start, end = span
        if start == end:
            return self.decode(src)
        begun = held + start
        stored = [s.narrow(dim, 0, begun) for s in src]
        return torch.cat([self.decode(stored), x.narrow(dim, start, end - start)], dim=dim)

    def fill(self, b: int, x: torch.Tensor, keep: int, g: int, pack) -> None:
        """Append x [H, n, D] to sequence b's tokens, and pass their oldest whole pages of G tokens,
        all but at least `keep` tokens, to `pack` before they leave: pack(tokens [H, N * G, D] in the
        model's dtype (`_page_tokens`), the same in stored form). x is stored once; the tokens that
        stay move as stored."""
        held, new = self.lens[b], self.encode(x)
        full = max(held + x.shape[1] - keep, 0) // g * g
        if full:
            src = [torch.cat([h, s], dim=1)[:, :full] for h, s in zip(self.stored(b), new)] if held else \
                [s[:, :full] for s in new]
            pack(self._page_tokens(src, x, held, self._computed_span(held, x.shape[1], keep, g), 1), src)
        if full <= held:
            self.drop_oldest(b, full)
            self.append_stored(b, new)
        else:
            self.clear(b)
            self.append_stored(b, [s[:, full - held :] for s in new])

    def fill_all(self, x: torch.Tensor, keep: int, g: int, pack) -> None:
        """`fill` for every sequence at once, x [B, H, n, D], all sequences holding the same count. A
        decode step's packing, which brings no new tokens, reads the page where it lies and copies
        only the tokens that stay, down to the region's start."""
        held, n = self.lens[0], x.shape[2]
        new = self.encode(x)
        full = max(held + n - keep, 0) // g * g
        if full:
            mine = self._stored((slice(None), slice(None), slice(0, held)))
            src = mine if not n else [torch.cat([h, s], dim=2) for h, s in zip(mine, new)] if held else new
            src = [s[:, :, :full] for s in src]
            pack(self._page_tokens(src, x, held, self._computed_span(held, n, keep, g), 2), src)
        if full <= held:
            self.drop_oldest(None, full)
            self._append_all_stored(new)
        else:
            self.clear_all()
            self._append_all_stored([s[:, :, full - held :] for s in new])

    def nbytes(self) -> int:
        """Bytes of the tokens held (codes, and an 8-bit region's scales)."""
        per_token = self.buf.shape[1] * sum(math.prod(t.shape[3:]) * t.element_size() for t in self.tensors())
        return sum(self.lens) * per_token
