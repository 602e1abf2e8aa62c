"""Algorithm 1 as a kernel: packed pages -> float32 tokens (`dequantize_pages`), for inspection and
tests; `kitty_core.quant.dequantize_keys` / `dequantize_values` are the same in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pages import KeyPages

from .ptx import _plane


@triton.jit
def _dequant_pages_kernel(KD, KH, KC, KSC, KZ, sKDp, sKDh, sKDd, sKDg, sKHp, sKHh, sKHr, sKHg, sKCp, sKCh, sKSp, sKSh,
                          VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVLc, sVSp, sVSh, O, sOp, sOh, sOt,
                          H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr,
                          V4: tl.constexpr, KEYS: tl.constexpr):
    """One page and head per program, written as [G, D] float32 tokens."""
    pid = tl.program_id(0)
    page = pid // H
    h = pid % H
    out = O + page * sOp + h * sOh
    if KEYS:
        G4: tl.constexpr = G // 4
        d = tl.arange(0, D)
        g = tl.arange(0, G4)
        ibase = page * sKSp + h * sKSh
        raw = tl.load(KD + page * sKDp + h * sKDh + d[:, None] * sKDd + g[None, :] * sKDg)  # [D, G/4]
        hraw = tl.zeros_like(raw)
        if NB > 0:  # the high plane row of every channel: its position in the boost index, if listed
            k = tl.arange(0, NB_P)
            ch = tl.load(KC + page * sKCp + h * sKCh + k, mask=k < NB, other=D)
            hit = ch[None, :] == d[:, None]  # [D, NB_P]
            row = tl.sum(tl.where(hit, k[None, :], 0), 1)
            boosted = tl.sum(hit.to(tl.int32), 1) > 0
            hraw = tl.load(KH + page * sKHp + h * sKHh + row[:, None] * sKHr + g[None, :] * sKHg,
                           mask=boosted[:, None], other=0)
        sc = tl.load(KSC + ibase + d).to(tl.float32)[:, None]
        z = tl.load(KZ + ibase + d).to(tl.float32)[:, None]
        for P in tl.static_range(4):  # plane P: tokens P*G/4 ..
            codes = _plane(raw, P) | (_plane(hraw, P) << 2)
            tl.store(out + (P * G4 + g)[None, :] * sOt + d[:, None], codes.to(tl.float32) * sc + z)
    else:
        D4: tl.constexpr = D // 4
        t = tl.arange(0, G)
        c = tl.arange(0, D4)
        sbase = page * sVSp + h * sVSh
        offs = page * sVLp + h * sVLh + t[:, None] * sVLt + c[None, :] * sVLc
        raw = tl.load(VL + offs)  # [G, D/4]
        hraw = tl.zeros_like(raw)
        if V4:
            hraw = tl.load(VH + offs)
        sc = tl.load(VSC + sbase + t).to(tl.float32)[:, None]
        z = tl.load(VZ + sbase + t).to(tl.float32)[:, None]
        for P in tl.static_range(4):  # plane P: channels P*D/4 ..
            codes = _plane(raw, P) | (_plane(hraw, P) << 2)
            tl.store(out + t[:, None] * sOt + (P * D4 + c)[None, :], codes.to(tl.float32) * sc + z)


def dequantize_pages(pages) -> torch.Tensor:
    """KeyPages or ValuePages [N, H, ...] -> float32 [N, H, G, D] (Algorithm 1, as a kernel)."""
    keys = isinstance(pages, KeyPages)
    # the code planes ([N, H, rows, bytes]) with any strides (a page pool stores them transposed); the
    # scales, zeros and boost index with unit last strides
    pages = type(pages)(**{k: v if v.dim() == 4 else v.contiguous() for k, v in vars(pages).items()})
    if keys:
        n, h, d, g4 = pages.dense.shape
        g = g4 * 4
        kd, kh, kc, ksc, kz = pages.dense, pages.high, pages.boost_ch, pages.scale, pages.zero
        vl = vh = vsc = vz = kd  # unused
        nb, v4 = pages.n_boost, False
    else:
        n, h, g, d4 = pages.low.shape
        d = d4 * 4
        vl, vh, vsc, vz = pages.low, pages.high, pages.scale, pages.zero
        if vh.numel() and vh.stride() != vl.stride():  # the kernel reads both planes with one set of strides
            vl, vh = vl.contiguous(), vh.contiguous()
        kd = kh = kc = ksc = kz = vl  # unused
        nb, v4 = 0, pages.high.shape[-1] > 0
    out = torch.empty((n, h, g, d), dtype=torch.float32, device=(kd if keys else vl).device)
    _dequant_pages_kernel[(n * h,)](
        kd, kh, kc, ksc, kz, *kd.stride(), *kh.stride(), kc.stride(0), kc.stride(1), ksc.stride(0), ksc.stride(1),
        vl, vh, vsc, vz, *vl.stride(), vsc.stride(0), vsc.stride(1),
        out, out.stride(0), out.stride(1), out.stride(2),
        H=h, D=d, G=g, NB=nb, NB_P=max(2, triton.next_power_of_2(max(nb, 1))), V4=v4, KEYS=keys,
    )
    return out
