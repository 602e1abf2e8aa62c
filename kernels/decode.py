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

from kitty_core.quant import dequantize_keys, dequantize_values


@triton.jit
def _interleave4(c0, c1, c2, c3, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Four [ROWS, COLS/4] planes -> [ROWS, COLS] with plane j at columns 4i + j."""
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (ROWS, COLS))


@triton.jit
def _key_page(KD, KH, KI, KSC, KZ, page, h, sKDp, sKDh, sKDd, sKHp, sKHh, sKHr, sKIp, sKIh,
              D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr):
    """Dequantized key page [G, D] (fp32) of KV head h."""
    d = tl.arange(0, D)
    t4 = tl.arange(0, G // 4)
    dense = tl.load(KD + page * sKDp + h * sKDh + d[:, None] * sKDd + t4[None, :]).to(tl.int32)  # [D, G/4]
    idx = tl.load(KI + page * sKIp + h * sKIh + d).to(tl.int32)
    if NB > 0:
        boosted = idx < NB
        row = tl.where(boosted, idx, 0)
        high = tl.load(KH + page * sKHp + h * sKHh + row[:, None] * sKHr + t4[None, :],
                       mask=boosted[:, None], other=0).to(tl.int32)
    else:
        high = tl.zeros_like(dense)
    c0 = (dense & 3) | ((high & 3) << 2)
    c1 = ((dense >> 2) & 3) | (((high >> 2) & 3) << 2)
    c2 = ((dense >> 4) & 3) | (((high >> 4) & 3) << 2)
    c3 = ((dense >> 6) & 3) | (((high >> 6) & 3) << 2)
    codes = _interleave4(c0, c1, c2, c3, D, G).to(tl.float32)  # [D, G]
    scale = tl.load(KSC + page * sKIp + h * sKIh + d).to(tl.float32)
    zero = tl.load(KZ + page * sKIp + h * sKIh + d).to(tl.float32)
    return tl.trans(codes * scale[:, None] + zero[:, None])


@triton.jit
def _value_page(VL, VH, VSC, VZ, page, h, sVLp, sVLh, sVLt, sVSp, sVSh,
                D: tl.constexpr, G: tl.constexpr, V4: tl.constexpr):
    """Dequantized value page [G, D] (fp32) of KV head h."""
    t = tl.arange(0, G)
    c4 = tl.arange(0, D // 4)
    offs = page * sVLp + h * sVLh + t[:, None] * sVLt + c4[None, :]
    low = tl.load(VL + offs).to(tl.int32)  # [G, D/4]
    if V4:
        high = tl.load(VH + offs).to(tl.int32)
    else:
        high = tl.zeros_like(low)
    c0 = (low & 3) | ((high & 3) << 2)
    c1 = ((low >> 2) & 3) | (((high >> 2) & 3) << 2)
    c2 = ((low >> 4) & 3) | (((high >> 4) & 3) << 2)
    c3 = ((low >> 6) & 3) | (((high >> 6) & 3) << 2)
    codes = _interleave4(c0, c1, c2, c3, G, D).to(tl.float32)
    scale = tl.load(VSC + page * sVSp + h * sVSh + t).to(tl.float32)
    zero = tl.load(VZ + page * sVSp + h * sVSh + t).to(tl.float32)
    return codes * scale[:, None] + zero[:, None]


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
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, V4: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    r = tl.arange(0, REP_P)
    d = tl.arange(0, D)
    heads = h * REP + r
    q = tl.load(Q + b * sQb + heads[:, None] * sQh + d[None, :], mask=(r < REP)[:, None], other=0.0).to(tl.float32)
    n = tl.load(LENS + b)
    n_sink = tl.minimum(n, S)
    out = b * sMb + heads * sMh + chunk
    out_acc = ACC + b * sAb + heads[:, None] * sAh + chunk * sAc + d[None, :]
    if chunk == 0:  # names differ from the page branch: the two tiles have different shapes
        ts = tl.arange(0, S_P)
        in_sink = ts < n_sink
        offs = b * sSb + h * sSh + ts[:, None] * sSt + d[None, :]
        k_sink = tl.load(KS + offs, mask=in_sink[:, None], other=0.0).to(tl.float32)
        v_sink = tl.load(VS + offs, mask=in_sink[:, None], other=0.0).to(tl.float32)
        m, l, acc = _softmax_tile(q, k_sink, v_sink, in_sink, scaling)
    else:
        c = chunk - 1
        first = S + c * G
        count = tl.minimum(n - first, G)
        t = tl.arange(0, G)
        ok = t < count
        if count > 0:
            n_kp = tl.load(NKP + b)
            n_vp = tl.load(NVP + b)
            if c < n_kp:
                k = _key_page(KD, KH, KI, KSC, KZ, tl.load(KT + b * sKT + c), h, sKDp, sKDh, sKDd,
                              sKHp, sKHh, sKHr, sKIp, sKIh, D, G, NB)
            else:  # the FP16 key q-buffer holds this slot's tokens
                k = tl.load(KB + b * sKBb + h * sKBh + t[:, None] * sKBt + d[None, :],
                            mask=ok[:, None], other=0.0).to(tl.float32)
            if c < n_vp:
                v = _value_page(VL, VH, VSC, VZ, tl.load(VT + b * sVT + c), h, sVLp, sVLh, sVLt, sVSp, sVSh, D, G, V4)
            else:  # the FP16 value window starts at the first value token not yet paged
                w = (c - n_vp) * G + t
                v = tl.load(VW + b * sVWb + h * sVWh + w[:, None] * sVWt + d[None, :],
                            mask=ok[:, None], other=0.0).to(tl.float32)
            m, l, acc = _softmax_tile(q, k, v, ok, scaling)
        else:
            m = tl.full((REP_P,), float("-inf"), tl.float32)
            l = tl.zeros((REP_P,), tl.float32)
            acc = tl.zeros((REP_P, D), tl.float32)
    tl.store(M + out, m, mask=r < REP)
    tl.store(L + out, l, mask=r < REP)
    tl.store(out_acc, acc, mask=(r < REP)[:, None])


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
                     state: dict | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over a Kitty layer's state.

    query [B, Hq, 1, D] -> [B, Hq, 1, D]. The layer must already hold the new token (FP16).
    `state` is `layer.kernel_state()` (built here if not given); `workspace` keeps the partials."""
    st = state if state is not None else layer.kernel_state()
    b, hq, _, d = query.shape
    hkv, rep = layer.heads, hq // layer.heads
    c = layer.config
    n_chunks = 1 + st["max_slots"]
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
        V4=c.value_bits == 4,
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


__all__ = ["decode_attention", "decode_attention_reference", "dequantize_keys", "dequantize_values"]
