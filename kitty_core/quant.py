"""The packed page format and its PyTorch reference quantizers (Kitty, section 4.1 and Algorithm 1).

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

Codes are computed against the FP16-rounded scale and zero that are stored, so dequantizing a page
reproduces exactly what the page encodes; the error of each element is at most scale / 2.
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


def _minmax_params(x: torch.Tensor, levels: torch.Tensor, dim: int):
    """FP16 scale/zero of asymmetric min-max quantization along `dim`, and the codes against them."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / levels).to(torch.float16)
    zero = lo.to(torch.float16)
    s32, z32 = scale.float(), zero.float()
    codes = torch.where(s32 > 0, torch.round((x - z32) / s32.clamp_min(1e-30)), torch.zeros_like(x))
    codes = torch.minimum(codes.clamp_min(0), levels).to(torch.uint8)
    return codes, scale.squeeze(dim).contiguous(), zero.squeeze(dim).contiguous()


def channel_scores(keys: torch.Tensor, rule: str, generator: torch.Generator | None = None,
                   query_rms: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each key channel of each page: [N, H, G, D] -> [N, H, D] (higher = boost first).

    magnitude  mean |k| of the channel over the page's tokens (the paper's rule)
    random     uniform scores (the paper's ablation)
    range      max - min of the channel over the page: its INT2 step, i.e. its quantization error
    qk         range x the RMS of the queries on that channel ([N or 1, H, D] `query_rms`): the size
               of the logit error q_d * e_d that leaving channel d at 2 bits causes
    """
    if rule == "magnitude":
        return keys.float().abs().mean(dim=-2)
    if rule == "random":
        n, h, _, d = keys.shape
        return torch.rand((n, h, d), generator=generator).to(keys.device)
    if rule in ("range", "qk"):
        x = keys.float()
        spread = x.amax(dim=-2) - x.amin(dim=-2)
        if rule == "range":
            return spread
        if query_rms is None:
            raise ValueError("the qk rule needs the RMS of the queries per channel (query_rms)")
        return spread * query_rms.to(spread.device, torch.float32)
    raise ValueError(f"unknown channel selection rule {rule!r}")


def boost_index_dtype(head_dim: int) -> torch.dtype:
    """The boost index's dtype: one byte a channel number while they fit (head sizes up to 256, every
    published model's), two beyond, so that no channel number wraps."""
    return torch.uint8 if head_dim <= 256 else torch.int16


def quantize_keys(
    keys: torch.Tensor, n_boost: int, rule: str = "magnitude", generator: torch.Generator | None = None,
    query_rms: torch.Tensor | None = None,
) -> KeyPages:
    """keys [N, H, G, D] (any float dtype) -> KeyPages with the top-`n_boost` channels of each page at 4 bits."""
    n, h, g, d = keys.shape
    if not 0 <= n_boost <= d:
        raise ValueError(f"n_boost must be in [0, {d}], got {n_boost}")
    x = keys.float().transpose(-1, -2)  # [N, H, D, G]
    boosted = torch.zeros((n, h, d), dtype=torch.bool, device=keys.device)
    if n_boost == d:
        boosted[:] = True
    elif n_boost > 0:
        top = channel_scores(keys, rule, generator, query_rms).topk(n_boost, dim=-1).indices
        boosted.scatter_(-1, top, True)
    levels = torch.where(boosted, 15.0, 3.0).unsqueeze(-1)  # [N, H, D, 1]
    codes, scale, zero = _minmax_params(x, levels, dim=-1)  # codes [N, H, D, G]
    # the boosted channels in ascending order: a stable sort puts True first without reordering them
    order = torch.sort((~boosted).to(torch.uint8), dim=-1, stable=True).indices[..., :n_boost]
    high_codes = torch.gather(codes >> 2, -2, order.unsqueeze(-1).expand(n, h, n_boost, g))
    return KeyPages(
        dense=pack_2bit(codes & 3), high=pack_2bit(high_codes), boost_ch=order.to(boost_index_dtype(d)), scale=scale,
        zero=zero,
    )


def key_codes(pages: KeyPages) -> torch.Tensor:
    """Full codes [N, H, D, G] of key pages: low | high << 2 through the boost index (Algorithm 1)."""
    low = unpack_2bit(pages.dense)  # [N, H, D, G]
    if pages.n_boost == 0:
        return low
    high = unpack_2bit(pages.high)  # [N, H, Db, G]
    rows = pages.boost_ch.long().unsqueeze(-1).expand_as(high)
    return low | torch.zeros_like(low).scatter_(-2, rows, high) << 2


def dequantize_keys(pages: KeyPages, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """KeyPages -> keys [N, H, G, D]."""
    x = key_codes(pages).float() * pages.scale.float().unsqueeze(-1) + pages.zero.float().unsqueeze(-1)
    return x.transpose(-1, -2).to(dtype)


def quantize_values(values: torch.Tensor, bits: int) -> ValuePages:
    """values [N, H, G, D] -> ValuePages with one scale/zero per token."""
    if bits not in (2, 4):
        raise ValueError(f"value bits must be 2 or 4, got {bits}")
    x = values.float()
    levels = torch.tensor(float(2**bits - 1), device=x.device)
    codes, scale, zero = _minmax_params(x, levels, dim=-1)  # codes [N, H, G, D]
    high = pack_2bit(codes >> 2) if bits == 4 else codes.new_zeros((*codes.shape[:-1], 0))
    return ValuePages(low=pack_2bit(codes & 3), high=high, scale=scale, zero=zero)


def dequantize_values(pages: ValuePages, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ValuePages -> values [N, H, G, D]."""
    codes = unpack_2bit(pages.low)
    if pages.high.shape[-1]:
        codes = codes | (unpack_2bit(pages.high) << 2)
    x = codes.float() * pages.scale.float().unsqueeze(-1) + pages.zero.float().unsqueeze(-1)
    return x.to(dtype)
