"""Fused split-KV decode attention over a Kitty layer: packed pages + FP16 sink, q-buffer and window.

One program per (sequence, KV head, chunk). Chunk 0 is the FP16 sink; chunk 1 + c covers page slot
c, the G tokens [S + cG, S + (c+1)G) of the sequence. Its keys come from key page c if it is packed,
else from the FP16 key q-buffer; its values from value page c if packed, else from the FP16 value
window (which starts at token S + n_value_pages * G). Pages are dequantized in registers (Algorithm 1:
low plane | high plane << 2 through the boost index, times scale plus zero) and never written back.
All query heads of the GQA group share each load. Each program writes a partial softmax (max, sum,
weighted values); `_combine` merges the chunks (flash-decoding).

Layouts are those of `kitty_core.quant` (key pages [P, H, D, G/4] packed along tokens, value pages
[P, H, G, D/4] packed along channels) and of `kitty_core.cache` (FP16 regions [B, H, cap, D]).
`decode_attention_reference` is the same computation in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _dequant_pages_kernel(KD, KH, KI, KSC, KZ, sKDp, sKDh, sKDd, sKHp, sKHh, sKHr, sKIp, sKIh,
                          VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVSp, sVSh, O, sOp, sOh, sOt,
                          H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, V4: tl.constexpr,
                          KEYS: tl.constexpr):
    """One page and head per program; each 2-bit field of a byte is one plane, stored to its positions
    (tokens 4t + j of a key page, channels 4c + m of a value page)."""
    pid = tl.program_id(0)
    page = pid // H
    h = pid % H
    out = O + page * sOp + h * sOh
    if KEYS:
        d = tl.arange(0, D)
        t4 = tl.arange(0, G // 4)
        dense = tl.load(KD + page * sKDp + h * sKDh + d[:, None] * sKDd + t4[None, :]).to(tl.int32)  # [D, G/4]
        ibase = page * sKIp + h * sKIh
        idx = tl.load(KI + ibase + d).to(tl.int32)
        if NB > 0:
            boosted = idx < NB  # Algorithm 1: the boost index names the row of the compact high plane
            high = tl.load(KH + page * sKHp + h * sKHh + tl.where(boosted, idx, 0)[:, None] * sKHr + t4[None, :],
                           mask=boosted[:, None], other=0).to(tl.int32)
        else:
            high = tl.zeros_like(dense)
        scale = tl.load(KSC + ibase + d).to(tl.float32)[:, None]
        zero = tl.load(KZ + ibase + d).to(tl.float32)[:, None]
        for j in tl.static_range(4):
            x = _key_plane_codes(dense, high, j).to(tl.float32) * scale + zero  # [D, G/4]
            tl.store(out + (4 * t4 + j)[None, :] * sOt + d[:, None], x)
    else:
        t = tl.arange(0, G)
        c4 = tl.arange(0, D // 4)
        vbase = page * sVLp + h * sVLh
        sbase = page * sVSp + h * sVSh
        scale = tl.load(VSC + sbase + t).to(tl.float32)[:, None]
        zero = tl.load(VZ + sbase + t).to(tl.float32)[:, None]
        for m in tl.static_range(4):
            x = _value_plane(VL, VH, VSC, VZ, vbase, sbase, t, c4, sVLt, m, V4).to(tl.float32) * scale + zero
            tl.store(out + t[:, None] * sOt + (4 * c4 + m)[None, :], x)


def dequantize_pages(pages) -> torch.Tensor:
    """KeyPages or ValuePages [N, H, ...] -> float32 [N, H, G, D] (Algorithm 1, as a kernel)."""
    from kitty_core.quant import KeyPages

    keys = isinstance(pages, KeyPages)
    pages = type(pages)(**{k: v.contiguous() for k, v in vars(pages).items()})  # the kernel assumes unit last strides
    if keys:
        n, h, d, g4 = pages.dense.shape
        g = g4 * 4
        kd, kh, ki, ksc, kz = pages.dense, pages.high, pages.boost_idx, pages.scale, pages.zero
        vl = vh = vsc = vz = kd  # unused
        nb, v4 = pages.n_boost, False
    else:
        n, h, g, d4 = pages.low.shape
        d = d4 * 4
        vl, vh, vsc, vz = pages.low, pages.high, pages.scale, pages.zero
        kd = kh = ki = ksc = kz = vl  # unused
        nb, v4 = 0, pages.high.shape[-1] > 0
    out = torch.empty((n, h, g, d), dtype=torch.float32, device=(kd if keys else vl).device)
    _dequant_pages_kernel[(n * h,)](
        kd, kh, ki, ksc, kz, kd.stride(0), kd.stride(1), kd.stride(2),
        kh.stride(0), kh.stride(1), kh.stride(2) if kh.dim() > 2 else 0, ki.stride(0), ki.stride(1),
        vl, vh, vsc, vz, vl.stride(0), vl.stride(1), vl.stride(2), vsc.stride(0), vsc.stride(1),
        out, out.stride(0), out.stride(1), out.stride(2),
        H=h, D=d, G=g, NB=nb, V4=v4, KEYS=keys,
    )
    return out


@triton.jit
def _softmax_tile(q, k, v, valid, scaling):
    """Partial softmax of q [R, D] over keys k [T, D] / values v [T, D]: (max [R], sum [R], acc [R, D])."""
    s = tl.dot(q.to(tl.float16), tl.trans(k).to(tl.float16)) * scaling  # [R, T]
    s = tl.where(valid[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(s - m_safe[:, None])
    acc = tl.dot(p.to(tl.float16), v.to(tl.float16))  # [R, D]
    return m, tl.sum(p, 1), acc


@triton.jit
def _key_plane_codes(dense, high, J: tl.constexpr):
    """Codes of token plane J (tokens 4i + J) of a key page: low 2 bits + 4 x high 2 bits."""
    return ((dense >> (2 * J)) & 3) + (((high >> (2 * J)) & 3) << 2)


@triton.jit
def _value_plane(VL, VH, VSC, VZ, vbase, sbase, rows, c4, sVLt, M_: tl.constexpr, V4: tl.constexpr):
    """Codes of channel plane M_ (channels 4c + M_) for the value rows `rows` of a page: [len(rows), D/4]."""
    offs = vbase + rows[:, None] * sVLt + c4[None, :]
    low = tl.load(VL + offs).to(tl.int32)
    codes = (low >> (2 * M_)) & 3
    if V4:
        codes += ((tl.load(VH + offs).to(tl.int32) >> (2 * M_)) & 3) << 2
    return codes


@triton.jit
def _pv_packed(acc0, acc1, acc2, acc3, p, VL, VH, VSC, VZ, vbase, sbase, rows, c4, sVLt,
               V4: tl.constexpr):
    """acc_m += p @ V[rows, channels 4c + m] for a packed value page; per-token scales folded into p."""
    vs = tl.load(VSC + sbase + rows).to(tl.float32)
    vz = tl.load(VZ + sbase + rows).to(tl.float32)
    pw = (p * vs[None, :]).to(tl.float16)
    pz = tl.sum(p * vz[None, :], 1)[:, None]
    acc0 += tl.dot(pw, _value_plane(VL, VH, VSC, VZ, vbase, sbase, rows, c4, sVLt, 0, V4).to(tl.float16)) + pz
    acc1 += tl.dot(pw, _value_plane(VL, VH, VSC, VZ, vbase, sbase, rows, c4, sVLt, 1, V4).to(tl.float16)) + pz
    acc2 += tl.dot(pw, _value_plane(VL, VH, VSC, VZ, vbase, sbase, rows, c4, sVLt, 2, V4).to(tl.float16)) + pz
    acc3 += tl.dot(pw, _value_plane(VL, VH, VSC, VZ, vbase, sbase, rows, c4, sVLt, 3, V4).to(tl.float16)) + pz
    return acc0, acc1, acc2, acc3


@triton.jit
def _pv_fp16(acc0, acc1, acc2, acc3, p, VW, wbase, rows, ok, c4, sVWt):
    """acc_m += p @ V[rows, channels 4c + m] for FP16 values of the window."""
    offs = wbase + rows[:, None] * sVWt + 4 * c4[None, :]
    pf = p.to(tl.float16)
    acc0 += tl.dot(pf, tl.load(VW + offs + 0, mask=ok[:, None], other=0.0).to(tl.float16))
    acc1 += tl.dot(pf, tl.load(VW + offs + 1, mask=ok[:, None], other=0.0).to(tl.float16))
    acc2 += tl.dot(pf, tl.load(VW + offs + 2, mask=ok[:, None], other=0.0).to(tl.float16))
    acc3 += tl.dot(pf, tl.load(VW + offs + 3, mask=ok[:, None], other=0.0).to(tl.float16))
    return acc0, acc1, acc2, acc3


@triton.jit
def _decode_partial_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KD, KH, KI, KSC, KZ, sKDp, sKDh, sKDd, sKHp, sKHh, sKHr, sKIp, sKIh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    M, L, ACC, sMb, sMh, sAb, sAh, sAc,
    scaling,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, V4: tl.constexpr, PPP: tl.constexpr,
):
    """Chunk 0: the sink. Chunk 1 + i: page slots [i * PPP, (i + 1) * PPP), online softmax over them.

    A page is never unpacked into natural order: its tokens are taken as four planes (tokens 4t + j,
    one 2-bit field of each byte) and its value channels as four planes (channels 4c + m), so each
    plane is a plain dot product; per-channel key scales are folded into q and per-token value scales
    into the probabilities."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    r = tl.arange(0, REP_P)
    d = tl.arange(0, D)
    heads = h * REP + r
    q = tl.load(Q + b * sQb + heads[:, None] * sQh + d[None, :], mask=(r < REP)[:, None], other=0.0).to(tl.float32)
    q = q * scaling
    n = tl.load(LENS + b)
    out = b * sMb + heads * sMh + chunk
    if chunk == 0:  # names differ from the page branch: the two tiles have different shapes
        ts = tl.arange(0, S_P)
        in_sink = ts < tl.minimum(n, S)
        offs = b * sSb + h * sSh + ts[:, None] * sSt + d[None, :]
        k_sink = tl.load(KS + offs, mask=in_sink[:, None], other=0.0).to(tl.float32)
        v_sink = tl.load(VS + offs, mask=in_sink[:, None], other=0.0).to(tl.float32)
        m_s, l_s, acc_s = _softmax_tile(q, k_sink, v_sink, in_sink, 1.0)
        tl.store(M + out, m_s, mask=r < REP)
        tl.store(L + out, l_s, mask=r < REP)
        tl.store(ACC + b * sAb + heads[:, None] * sAh + chunk * sAc + d[None, :], acc_s, mask=(r < REP)[:, None])
    else:
        G4: tl.constexpr = G // 4
        D4: tl.constexpr = D // 4
        t4 = tl.arange(0, G4)
        c4 = tl.arange(0, D4)
        n_kp = tl.load(NKP + b)
        n_vp = tl.load(NVP + b)
        m_i = tl.full((REP_P,), float("-inf"), tl.float32)
        l_i = tl.zeros((REP_P,), tl.float32)
        acc0 = tl.zeros((REP_P, D4), tl.float32)
        acc1 = tl.zeros((REP_P, D4), tl.float32)
        acc2 = tl.zeros((REP_P, D4), tl.float32)
        acc3 = tl.zeros((REP_P, D4), tl.float32)
        for i in range(PPP):
            c = (chunk - 1) * PPP + i
            count = tl.minimum(n - (S + c * G), G)
            if count > 0:
                if c < n_kp:
                    page = tl.load(KT + b * sKT + c)
                    kbase = page * sKDp + h * sKDh
                    dense = tl.load(KD + kbase + d[:, None] * sKDd + t4[None, :]).to(tl.int32)  # [D, G/4]
                    ibase = page * sKIp + h * sKIh
                    idx = tl.load(KI + ibase + d).to(tl.int32)
                    if NB > 0:
                        boosted = idx < NB
                        high = tl.load(KH + page * sKHp + h * sKHh + tl.where(boosted, idx, 0)[:, None] * sKHr
                                       + t4[None, :], mask=boosted[:, None], other=0).to(tl.int32)
                    else:
                        high = tl.zeros_like(dense)
                    ks = tl.load(KSC + ibase + d).to(tl.float32)
                    kz = tl.load(KZ + ibase + d).to(tl.float32)
                    qk = (q * ks[None, :]).to(tl.float16)
                    qz = tl.sum(q * kz[None, :], 1)[:, None]
                    s0 = tl.dot(qk, _key_plane_codes(dense, high, 0).to(tl.float16)) + qz
                    s1 = tl.dot(qk, _key_plane_codes(dense, high, 1).to(tl.float16)) + qz
                    s2 = tl.dot(qk, _key_plane_codes(dense, high, 2).to(tl.float16)) + qz
                    s3 = tl.dot(qk, _key_plane_codes(dense, high, 3).to(tl.float16)) + qz
                else:  # the FP16 key q-buffer
                    qf = q.to(tl.float16)
                    kb = KB + b * sKBb + h * sKBh + d[None, :]
                    s0 = tl.dot(qf, tl.trans(tl.load(kb + (4 * t4 + 0)[:, None] * sKBt, mask=(4 * t4 + 0 < count)[:, None], other=0.0).to(tl.float16)))
                    s1 = tl.dot(qf, tl.trans(tl.load(kb + (4 * t4 + 1)[:, None] * sKBt, mask=(4 * t4 + 1 < count)[:, None], other=0.0).to(tl.float16)))
                    s2 = tl.dot(qf, tl.trans(tl.load(kb + (4 * t4 + 2)[:, None] * sKBt, mask=(4 * t4 + 2 < count)[:, None], other=0.0).to(tl.float16)))
                    s3 = tl.dot(qf, tl.trans(tl.load(kb + (4 * t4 + 3)[:, None] * sKBt, mask=(4 * t4 + 3 < count)[:, None], other=0.0).to(tl.float16)))
                s0 = tl.where((4 * t4 + 0 < count)[None, :], s0, float("-inf"))
                s1 = tl.where((4 * t4 + 1 < count)[None, :], s1, float("-inf"))
                s2 = tl.where((4 * t4 + 2 < count)[None, :], s2, float("-inf"))
                s3 = tl.where((4 * t4 + 3 < count)[None, :], s3, float("-inf"))
                top = tl.maximum(tl.maximum(tl.max(s0, 1), tl.max(s1, 1)), tl.maximum(tl.max(s2, 1), tl.max(s3, 1)))
                m_new = tl.maximum(m_i, top)
                alpha = tl.exp(m_i - m_new)
                p0 = tl.exp(s0 - m_new[:, None])
                p1 = tl.exp(s1 - m_new[:, None])
                p2 = tl.exp(s2 - m_new[:, None])
                p3 = tl.exp(s3 - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p0, 1) + tl.sum(p1, 1) + tl.sum(p2, 1) + tl.sum(p3, 1)
                acc0 = acc0 * alpha[:, None]
                acc1 = acc1 * alpha[:, None]
                acc2 = acc2 * alpha[:, None]
                acc3 = acc3 * alpha[:, None]
                m_i = m_new
                if c < n_vp:
                    vpage = tl.load(VT + b * sVT + c)
                    vbase = vpage * sVLp + h * sVLh
                    sbase = vpage * sVSp + h * sVSh
                    acc0, acc1, acc2, acc3 = _pv_packed(acc0, acc1, acc2, acc3, p0, VL, VH, VSC, VZ, vbase, sbase, 4 * t4 + 0, c4, sVLt, V4)
                    acc0, acc1, acc2, acc3 = _pv_packed(acc0, acc1, acc2, acc3, p1, VL, VH, VSC, VZ, vbase, sbase, 4 * t4 + 1, c4, sVLt, V4)
                    acc0, acc1, acc2, acc3 = _pv_packed(acc0, acc1, acc2, acc3, p2, VL, VH, VSC, VZ, vbase, sbase, 4 * t4 + 2, c4, sVLt, V4)
                    acc0, acc1, acc2, acc3 = _pv_packed(acc0, acc1, acc2, acc3, p3, VL, VH, VSC, VZ, vbase, sbase, 4 * t4 + 3, c4, sVLt, V4)
                else:  # the FP16 value window starts at the first value token not yet paged
                    wbase = b * sVWb + h * sVWh + (c - n_vp) * G * sVWt
                    acc0, acc1, acc2, acc3 = _pv_fp16(acc0, acc1, acc2, acc3, p0, VW, wbase, 4 * t4 + 0, 4 * t4 + 0 < count, c4, sVWt)
                    acc0, acc1, acc2, acc3 = _pv_fp16(acc0, acc1, acc2, acc3, p1, VW, wbase, 4 * t4 + 1, 4 * t4 + 1 < count, c4, sVWt)
                    acc0, acc1, acc2, acc3 = _pv_fp16(acc0, acc1, acc2, acc3, p2, VW, wbase, 4 * t4 + 2, 4 * t4 + 2 < count, c4, sVWt)
                    acc0, acc1, acc2, acc3 = _pv_fp16(acc0, acc1, acc2, acc3, p3, VW, wbase, 4 * t4 + 3, 4 * t4 + 3 < count, c4, sVWt)
        tl.store(M + out, m_i, mask=r < REP)
        tl.store(L + out, l_i, mask=r < REP)
        a = ACC + b * sAb + heads[:, None] * sAh + chunk * sAc + 4 * c4[None, :]
        keep = (r < REP)[:, None]
        tl.store(a + 0, acc0, mask=keep)
        tl.store(a + 1, acc1, mask=keep)
        tl.store(a + 2, acc2, mask=keep)
        tl.store(a + 3, acc3, mask=keep)


@triton.jit
def _combine_kernel(M, L, ACC, O, sMb, sMh, sAb, sAh, sAc, sOb, sOh,
                    HQ: tl.constexpr, C: tl.constexpr, C_P: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // HQ
    hq = pid % HQ
    c = tl.arange(0, C_P)
    d = tl.arange(0, D)
    ok = c < C
    m = tl.load(M + b * sMb + hq * sMh + c, mask=ok, other=float("-inf"))
    l = tl.load(L + b * sMb + hq * sMh + c, mask=ok, other=0.0)
    acc = tl.load(ACC + b * sAb + hq * sAh + c[:, None] * sAc + d[None, :], mask=ok[:, None], other=0.0)
    top = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(O + b * sOb + hq * sOh + d, o.to(O.dtype.element_ty))


def decode_attention(layer, query: torch.Tensor, scaling: float, workspace: dict | None = None,
                     state: dict | None = None, pages_per_program: int | None = None, num_warps: int = 4,
                     num_stages: int = 2) -> torch.Tensor:
    """Attention of one new query token per sequence over a Kitty layer's state.

    query [B, Hq, 1, D] -> [B, Hq, 1, D]. The layer must already hold the new token (FP16).
    `state` is `layer.kernel_state()` (built here if not given); `workspace` keeps the partials."""
    st = state if state is not None else layer.kernel_state()
    b, hq, _, d = query.shape
    hkv, rep = layer.heads, hq // layer.heads
    c = layer.config
    slots = st["max_slots"]
    # enough programs to fill the GPU (about 8 per SM of an H200), as few partials as that allows
    ppp = pages_per_program or max(1, min(16, b * hkv * slots // 1056))
    n_chunks = 1 + -(-slots // ppp)
    q = query[:, :, 0]
    ws = workspace if workspace is not None else {}
    if ws.get("shape") != (b, hq, n_chunks, d):
        ws.update(shape=(b, hq, n_chunks, d),
                  m=torch.empty((b, hq, n_chunks), device=q.device, dtype=torch.float32),
                  l=torch.empty((b, hq, n_chunks), device=q.device, dtype=torch.float32),
                  acc=torch.empty((b, hq, n_chunks, d), device=q.device, dtype=torch.float32))
    m, l, acc = ws["m"], ws["l"], ws["acc"]
    kp, vp = st["k_pages"], st["v_pages"]
    ks, vs, kb, vw = st["k_sink"], st["v_sink"], st["k_buffer"], st["v_window"]
    _decode_partial_kernel[(b * hkv, n_chunks)](
        q, q.stride(0), q.stride(1),
        ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        kb, kb.stride(0), kb.stride(1), kb.stride(2),
        vw, vw.stride(0), vw.stride(1), vw.stride(2),
        kp["dense"], kp["high"], kp["boost_idx"], kp["scale"], kp["zero"],
        kp["dense"].stride(0), kp["dense"].stride(1), kp["dense"].stride(2),
        kp["high"].stride(0), kp["high"].stride(1), kp["high"].stride(2),
        kp["scale"].stride(0), kp["scale"].stride(1),
        vp["low"], vp["high"], vp["scale"], vp["zero"],
        vp["low"].stride(0), vp["low"].stride(1), vp["low"].stride(2),
        vp["scale"].stride(0), vp["scale"].stride(1),
        st["k_table"], st["v_table"], st["k_table"].stride(0), st["v_table"].stride(0),
        st["lens"], st["n_kpages"], st["n_vpages"],
        m, l, acc, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        scaling,
        HKV=hkv, REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), D=d, G=c.group_size,
        S=c.sink, S_P=max(16, triton.next_power_of_2(max(c.sink, 1))), NB=layer.n_boost,
        V4=c.value_bits == 4, PPP=ppp, num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty((b, hq, 1, d), device=q.device, dtype=query.dtype)
    _combine_kernel[(b * hq,)](
        m, l, acc, out, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1), HQ=hq, C=n_chunks, C_P=triton.next_power_of_2(n_chunks), D=d,
    )
    return out


def decode_attention_reference(layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """The same attention in PyTorch: per sequence, the dequantized history, softmax, values."""
    b, hq, _, d = query.shape
    rep = hq // layer.heads
    outs = []
    for i in range(b):
        k, v = layer.sequence_history(i, torch.float32)  # [H, n, D]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        p = (query[i, :, 0].float()[:, None] @ k.transpose(-1, -2) * scaling).softmax(-1)  # [Hq, 1, n]
        outs.append((p @ v)[:, 0])
    return torch.stack(outs)[:, :, None].to(query.dtype)


__all__ = ["decode_attention", "decode_attention_reference", "dequantize_pages"]
