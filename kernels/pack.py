"""Quantize-and-pack kernels: G tokens of FP16/bf16 keys or values -> the page format of `pages.py`,
bit for bit what the PyTorch quantizers of `kitty_core.quant` produce.

One program per (page, KV head). The page is loaded as a [rows, 4, n/4] tile whose middle axis is
the code plane (element j of a packed row sits in plane j // (n/4)), so a byte is the sum over that
axis of `code << 2 * plane`, with no shuffle.

keys    per-channel min/max over the page's tokens, the top-k channels by the selection rule
        (a rank from pairwise comparisons, ties to the lower channel) get 15 levels, the others 3;
        dense plane = low 2 bits of every channel, high plane = high 2 bits of the boosted
        channels in ascending channel order (row = running count of boosted channels), and the
        boost index lists each row's channel.
values  per-token min/max over the channels, 3 or 15 levels.

Rounding matches torch exactly: the division is IEEE (`div_rn`), and round-half-to-even comes from
adding and subtracting 1.5 * 2**23, which leaves an fp32 number its nearest integer.

Tested bit for bit against the torch quantizers (in Triton's interpreter on CPU, compiled on a GPU);
the Triton engine packs with them. `python -m kitty_core.bench kernels --pack` times them against
the decode step they serve.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pages import KeyPages, ValuePages, boost_index_dtype

RULES = {"magnitude": 0, "range": 1, "qk": 2}  # channel scores the key kernel computes itself


@triton.jit
def _round_even(y):
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _codes(x, lo, scale, levels):
    """x [.., 4, n/4] fp32, per-row fp16-rounded zero `lo` and `scale`, `levels` -> int32 codes."""
    y = tl.math.div_rn(x - lo, tl.maximum(scale, 1e-30))
    y = tl.minimum(tl.maximum(_round_even(y), 0.0), levels)
    return tl.where(scale > 0, y, 0.0).to(tl.int32)


@triton.jit
def _bytes(codes, SHIFT: tl.constexpr):
    """Bits SHIFT, SHIFT + 1 of codes [rows, 4, n/4] -> packed bytes [rows, n/4]."""
    plane = tl.arange(0, 4)[None, :, None]
    return tl.sum(((codes >> SHIFT) & 3) << (2 * plane), 1).to(tl.uint8)


@triton.jit
def _pack_keys_kernel(X, sXn, sXh, sXt, sXd, QR, sQRn, sQRh,
                      KD, KH, KC, KSC, KZ, sKDn, sKDh, sKDd, sKHn, sKHh, sKHr, sKCn, sKCh, sKSn, sKSh,
                      H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, RULE: tl.constexpr,
                      J: tl.constexpr):
    """Two passes over the page, both reading the keys as they lie (a token's channels side by
    side): the channels' statistics over [G, D], then the codes J packed columns at a time, each
    [4, J, D] reloaded (from L2) and turned to [D, 4, J]. The whole page is never live in registers
    while the channels are ranked or coded: 128 registers a thread at 8 warps and J = 4 (head size
    128) where one pass over the page took 255. On an H200, 544 x 8 pages of [128, 128] bf16 keys
    took 0.66 ms instead of 0.96 (J = 8: 0.82; 16 warps: 0.85-1.23), the same bytes."""
    G4: tl.constexpr = G // 4
    n = tl.program_id(0) // H
    h = tl.program_id(0) % H
    d = tl.arange(0, D)
    page = X + n * sXn + h * sXh
    t = tl.arange(0, G)
    x = tl.load(page + t[:, None] * sXt + d[None, :] * sXd).to(tl.float32)  # [G, D]
    lo = tl.min(x, 0)
    hi = tl.max(x, 0)
    if NB == D:
        boosted = d >= 0
    elif NB == 0:
        boosted = d < 0
    else:
        if RULE == 0:  # mean |k| (the sum ranks the same: G is a power of two)
            score = tl.sum(tl.abs(x), 0)
        else:  # range, or range x query RMS
            score = hi - lo
            if RULE == 2:
                score = score * tl.load(QR + n * sQRn + h * sQRh + d).to(tl.float32)
        # rank = channels scoring higher, or equal and earlier; the top NB are boosted
        si, sj = score[:, None], score[None, :]
        ahead = (sj > si) | ((sj == si) & (d[None, :] < d[:, None]))
        boosted = tl.sum(ahead.to(tl.int32), 1) < NB
    levels = tl.where(boosted, 15.0, 3.0)
    scale = tl.math.div_rn(hi - lo, levels).to(tl.float16)
    zero = lo.to(tl.float16)
    row = tl.cumsum(boosted.to(tl.int32), 0) - 1
    row = tl.where(boosted, row, 0)
    p = tl.arange(0, 4)
    j = tl.arange(0, J)
    for j0 in tl.static_range(0, G4, J):
        tok = p[:, None, None] * G4 + j0 + j[None, :, None]
        xs = tl.permute(tl.load(page + tok * sXt + d[None, None, :] * sXd), (2, 0, 1)).to(tl.float32)  # [D, 4, J]
        codes = _codes(xs, zero.to(tl.float32)[:, None, None], scale.to(tl.float32)[:, None, None],
                       levels[:, None, None])
        tl.store(KD + n * sKDn + h * sKDh + d[:, None] * sKDd + j0 + j[None, :], _bytes(codes, 0))
        if NB > 0:
            tl.store(KH + n * sKHn + h * sKHh + row[:, None] * sKHr + j0 + j[None, :], _bytes(codes, 2),
                     mask=boosted[:, None])
    if NB > 0:
        tl.store(KC + n * sKCn + h * sKCh + row, d.to(KC.dtype.element_ty), mask=boosted)
    tl.store(KSC + n * sKSn + h * sKSh + d, scale)
    tl.store(KZ + n * sKSn + h * sKSh + d, zero)


@triton.jit
def _pack_values_kernel(X, sXn, sXh, sXt, sXd, VL, VH, VSC, VZ, sVLn, sVLh, sVLt, sVSn, sVSh,
                        H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, V4: tl.constexpr):
    D4: tl.constexpr = D // 4
    n = tl.program_id(0) // H
    h = tl.program_id(0) % H
    t = tl.arange(0, G)
    c = tl.arange(0, D4)
    chan = tl.arange(0, 4)[None, :, None] * D4 + c[None, None, :]
    x = tl.load(X + n * sXn + h * sXh + t[:, None, None] * sXt + chan * sXd).to(tl.float32)  # [G, 4, D/4]
    lo = tl.min(tl.min(x, 2), 1)
    hi = tl.max(tl.max(x, 2), 1)
    levels = tl.full((G,), 15.0 if V4 else 3.0, tl.float32)
    scale = tl.math.div_rn(hi - lo, levels).to(tl.float16)
    zero = lo.to(tl.float16)
    codes = _codes(x, zero.to(tl.float32)[:, None, None], scale.to(tl.float32)[:, None, None],
                   levels[:, None, None])
    offs = n * sVLn + h * sVLh + t[:, None] * sVLt + c[None, :]
    tl.store(VL + offs, _bytes(codes, 0))
    if V4:
        tl.store(VH + offs, _bytes(codes, 2))
    tl.store(VSC + n * sVSn + h * sVSh + t, scale)
    tl.store(VZ + n * sVSn + h * sVSh + t, zero)


def supported(x: torch.Tensor, rule: str | None = None) -> bool:
    """The kernels take power-of-two page and head sizes (>= 4) and the rules they can score."""
    *_, g, d = x.shape
    pow2 = lambda v: v >= 4 and v & (v - 1) == 0  # noqa: E731
    return pow2(g) and pow2(d) and (rule is None or rule in RULES)


def quantize_keys(keys: torch.Tensor, n_boost: int, rule: str = "magnitude",
                  query_rms: torch.Tensor | None = None) -> KeyPages:
    """keys [N, H, G, D] -> KeyPages, as `kitty_core.quant.quantize_keys` (rules: magnitude, range, qk)."""
    n, h, g, d = keys.shape
    if not 0 <= n_boost <= d:
        raise ValueError(f"n_boost must be in [0, {d}], got {n_boost}")
    if rule not in RULES:
        raise ValueError(f"the pack kernel scores channels by {sorted(RULES)}, not {rule!r}")
    if rule == "qk" and query_rms is None and 0 < n_boost < d:
        raise ValueError("the qk rule needs the RMS of the queries per channel (query_rms)")
    dev = keys.device
    dense = torch.empty((n, h, d, g // 4), dtype=torch.uint8, device=dev)
    high = torch.empty((n, h, n_boost, g // 4), dtype=torch.uint8, device=dev)
    chans = torch.empty((n, h, n_boost), dtype=boost_index_dtype(d), device=dev)
    scale = torch.empty((n, h, d), dtype=torch.float16, device=dev)
    zero = torch.empty_like(scale)
    scored = rule == "qk" and 0 < n_boost < d
    qr = query_rms.to(dev, torch.float32).expand(n, h, d) if scored else scale  # read only by the qk rule
    if n:
        _pack_keys_kernel[(n * h,)](
            keys, *keys.stride(), qr, qr.stride(0), qr.stride(1),
            dense, high if n_boost else dense, chans if n_boost else dense, scale, zero, *dense.stride()[:3],
            *high.stride()[:3], chans.stride(0), chans.stride(1), scale.stride(0), scale.stride(1), H=h, D=d, G=g, NB=n_boost,
            RULE=RULES[rule], J=min(g // 4, 4), num_warps=8)
    return KeyPages(dense=dense, high=high, boost_ch=chans, scale=scale, zero=zero)


def quantize_values(values: torch.Tensor, bits: int) -> ValuePages:
    """values [N, H, G, D] -> ValuePages, as `kitty_core.quant.quantize_values`."""
    if bits not in (2, 4):
        raise ValueError(f"value bits must be 2 or 4, got {bits}")
    n, h, g, d = values.shape
    dev = values.device
    low = torch.empty((n, h, g, d // 4), dtype=torch.uint8, device=dev)
    high = torch.empty((n, h, g, d // 4 if bits == 4 else 0), dtype=torch.uint8, device=dev)
    scale = torch.empty((n, h, g), dtype=torch.float16, device=dev)
    zero = torch.empty_like(scale)
    if n:
        _pack_values_kernel[(n * h,)](
            values, *values.stride(), low, high if bits == 4 else low, scale, zero, *low.stride()[:3],
            scale.stride(0), scale.stride(1), H=h, D=d, G=g, V4=bits == 4, num_warps=8)
    return ValuePages(low=low, high=high, scale=scale, zero=zero)


__all__ = ["quantize_keys", "quantize_values", "supported", "RULES"]
