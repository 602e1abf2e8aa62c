"""The packed page format that the kernels read and the library writes (Kitty, section 4.1, Algorithm 1).

A page holds G tokens of one sequence for all H KV heads. Leading dims below are [N, H]: N pages.

Key page (per-channel asymmetric quantization over the page's G tokens):
    dense     uint8 [N, H, D, G/4]   low 2 bits of every channel's code (the whole code of INT2 channels)
    high      uint8 [N, H, Db, G/4]  high 2 bits of the Db boosted channels, rows in ascending channel order
    boost_ch  uint8 [N, H, Db]       the page's boost index: the channel of each row of `high`, ascending
                                     (int16 for head sizes over 256: `boost_index_dtype`)
    scale     fp16  [N, H, D]        x ~= code * scale + zero, code in [0, 3] or [0, 15] if boosted
    zero      fp16  [N, H, D]
Value page (per-token asymmetric quantization over the D channels):
    low       uint8 [N, H, G, D/4]   low 2 bits of every code
    high      uint8 [N, H, G, D/4]   high 2 bits (value_bits=4 only, else a [N, H, G, 0] tensor)
    scale     fp16  [N, H, G]
    zero      fp16  [N, H, G]

Bit order: a packed row of n codes is four planes of n/4 codes. Element j sits in byte j % (n/4) at
bits 2 * (j // (n/4)): byte i holds elements i, i + n/4, i + n/2, i + 3n/4 (shifts 0, 2, 4, 6, as in
the paper's Algorithm 1). Keys pack along tokens (a byte holds four tokens of one channel, G/4
apart), values along channels. Planes of contiguous elements, rather than four neighbours per byte,
let a kernel take a page's bytes in one load and use each plane, `(byte >> 2p) & 3`, as the code
tile of a contiguous quarter of the tokens (keys) or channels (values), with no shuffle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

_SHIFTS = (0, 2, 4, 6)


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] integer codes in [0, 3] -> [..., n/4] uint8."""
    n = codes.shape[-1]
    if n % 4:
        raise ValueError(f"the packed dimension must be a multiple of 4, got {n}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], 4, n // 4)
    return (c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)).contiguous()


def unpack_2bit(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/4] uint8 -> [..., n] uint8 codes in [0, 3]."""
    parts = [(packed >> s) & 3 for s in _SHIFTS]
    return torch.cat(parts, dim=-1)


@dataclass
class KeyPages:
    dense: torch.Tensor
    high: torch.Tensor
    boost_ch: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def n_boost(self) -> int:
        return self.high.shape[-2]


@dataclass
class ValuePages:
    low: torch.Tensor
    high: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def page_nbytes(pages: KeyPages | ValuePages) -> dict[str, int]:
    return {f.name: getattr(pages, f.name).numel() * getattr(pages, f.name).element_size() for f in fields(pages)}


def boost_index_dtype(head_dim: int) -> torch.dtype:
    """The boost index's dtype: one byte a channel number while they fit (head sizes up to 256, every
    published model's), two beyond, so that no channel number wraps."""
    return torch.uint8 if head_dim <= 256 else torch.int16
