"""Decode attention over a Kitty layer: packed pages + FP16 sink, key q-buffer and value window.

Two implementations of one attention step (one new query token per sequence), and Algorithm 1:

fused (`decode_attention`)  one split-KV pass (flash-decoding). Program (sequence, KV head, chunk):
    chunk 0             the FP16 sink;
    chunks 1 .. NT      the tail: page slots from the first one whose values are still FP16 (the
                        value window), keys from a packed page or the FP16 key q-buffer;
    chunks NT+1 ..      PPP fully packed page slots each, in a branch-free loop the compiler pipelines.
    Each writes a partial softmax (max, sum, weighted values); `_combine_kernel` merges the chunks.
unfused (`decode_attention_unfused`)  the paper's three steps: a qk kernel writes every score to
    memory, torch softmax, an sv kernel reads the probabilities back (partials summed by torch).
`dequantize_pages`  pages -> float32 tokens (inspection and tests).

How a page is read. Thanks to the plane layout of `kitty_core.quant` (byte i of a row of n codes
holds elements i, i + n/4, i + n/2, i + 3n/4), a page loads as one natural-order tile: column j
reads byte j % (n/4) and shifts by 2 * (j // (n/4)); the four reads of a byte hit L1. Key pages give
a [D, G] tile (channels x tokens), value pages a [G, D] tile, so each page costs two tensor-core dots,
q [heads, D] @ K [D, G] and p [heads, G] @ V [G, D], for all query heads of the GQA group at once.
Codes become fp16 without a conversion instruction: `code | 0x6400` is the bit pattern of the fp16
number 1024 + code, and the 1024 is taken out after the dot (1024 x the row sum of the other
operand). Per-channel key scales are folded into the query (q.k = sum (q_d s_d) c_d + sum q_d z_d),
per-token value scales into the probabilities.

`decode_attention_reference` is the same attention in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------------
# tiles


@triton.jit
def _to_f16(codes, BIAS: tl.constexpr):
    """Integer codes in [0, 15] -> fp16: 1024 + code by bit pattern (BIAS) or code by conversion."""
    if BIAS:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return codes.to(tl.float16)


@triton.jit
def _key_codes_tile(KD, KH, KI, kbase, hbase, ibase, sKDd, sKHr, D: tl.constexpr, G: tl.constexpr,
                    NB: tl.constexpr):
    """Codes [D, G] (channels x tokens, natural order) of one head of a key page: low plane, plus the
    high plane (x 4) on the rows the boost index names (Algorithm 1)."""
    G4: tl.constexpr = G // 4
    d = tl.arange(0, D)
    n = tl.arange(0, G)
    col = (n % G4)[None, :]
    shift = (2 * (n // G4))[None, :]
    codes = (tl.load(KD + kbase + d[:, None] * sKDd + col).to(tl.int32) >> shift) & 3
    if NB > 0:
        idx = tl.load(KI + ibase + d).to(tl.int32)
        boosted = (idx < NB)[:, None]
        high = tl.load(KH + hbase + tl.where(idx < NB, idx, 0)[:, None] * sKHr + col, mask=boosted, other=0)
        codes = codes | (((high.to(tl.int32) >> shift) & 3) << 2)
    return codes


@triton.jit
def _value_codes_tile(VL, VH, vbase, sVLt, D: tl.constexpr, G: tl.constexpr, V4: tl.constexpr):
    """Codes [G, D] (tokens x channels, natural order) of one head of a value page."""
    D4: tl.constexpr = D // 4
    t = tl.arange(0, G)
    n = tl.arange(0, D)
    offs = vbase + t[:, None] * sVLt + (n % D4)[None, :]
    shift = (2 * (n // D4))[None, :]
    codes = (tl.load(VL + offs).to(tl.int32) >> shift) & 3
    if V4:
        codes = codes | (((tl.load(VH + offs).to(tl.int32) >> shift) & 3) << 2)
    return codes


@triton.jit
def _page_scores(q, KD, KH, KI, KSC, KZ, kbase, hbase, ibase, sKDd, sKHr,
                 D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, BIAS: tl.constexpr):
    """Scores [R, G] of the pre-scaled queries q [R, D] (fp32) against one head of a key page."""
    d = tl.arange(0, D)
    ks = tl.load(KSC + ibase + d).to(tl.float32)
    kz = tl.load(KZ + ibase + d).to(tl.float32)
    qk = (q * ks[None, :]).to(tl.float16)
    shift = tl.sum(q * kz[None, :], 1)
    if BIAS:
        shift -= 1024.0 * tl.sum(qk.to(tl.float32), 1)
    k = _to_f16(_key_codes_tile(KD, KH, KI, kbase, hbase, ibase, sKDd, sKHr, D, G, NB), BIAS)
    return tl.dot(qk, k) + shift[:, None]


@triton.jit
def _page_values(p, VL, VH, VSC, VZ, vbase, sbase, sVLt, D: tl.constexpr, G: tl.constexpr,
                 V4: tl.constexpr, BIAS: tl.constexpr):
    """p [R, G] (fp32) @ one head of a value page -> [R, D] fp32, per-token scales folded into p."""
    t = tl.arange(0, G)
    vs = tl.load(VSC + sbase + t).to(tl.float32)
    vz = tl.load(VZ + sbase + t).to(tl.float32)
    pw = (p * vs[None, :]).to(tl.float16)
    shift = tl.sum(p * vz[None, :], 1)
    if BIAS:
        shift -= 1024.0 * tl.sum(pw.to(tl.float32), 1)
    v = _to_f16(_value_codes_tile(VL, VH, vbase, sVLt, D, G, V4), BIAS)
    return tl.dot(pw, v) + shift[:, None]


@triton.jit
def _fp16_tile(X, base, s_t, count, T: tl.constexpr, D: tl.constexpr):
    """FP16 tokens [T, D] from base (token stride s_t), rows >= count zero."""
    t = tl.arange(0, T)
    d = tl.arange(0, D)
    return tl.load(X + base + t[:, None] * s_t + d[None, :], mask=(t < count)[:, None], other=0.0).to(tl.float16)


@triton.jit
def _online_update(m_i, l_i, acc, s):
    """Fold scores s [R, T] into a running softmax: returns (m, l, acc rescaled, p)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None], p


# ---------------------------------------------------------------------------------------------------
# fused


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
    NT: tl.constexpr, BIAS: tl.constexpr, ABLATE: tl.constexpr,
):
    """ABLATE (diagnostics for `bench kernels --ablate`, 0 in use): 1 keys only, 2 unpacking without
    dots, 3 plain loads of the packed bytes."""
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
    n_vp = tl.load(NVP + b)
    m_i = tl.full((REP_P,), float("-inf"), tl.float32)
    l_i = tl.zeros((REP_P,), tl.float32)
    acc = tl.zeros((REP_P, D), tl.float32)
    if chunk == 0:  # the sink
        n_sink = tl.minimum(n, S)
        base = b * sSb + h * sSh
        s = tl.dot(q.to(tl.float16), tl.trans(_fp16_tile(KS, base, sSt, n_sink, S_P, D)))
        s = tl.where((tl.arange(0, S_P) < n_sink)[None, :], s, float("-inf"))
        m_i, l_i, acc, p = _online_update(m_i, l_i, acc, s)
        acc += tl.dot(p.to(tl.float16), _fp16_tile(VS, base, sSt, n_sink, S_P, D))
    elif chunk <= NT:  # one slot of the tail: values from the FP16 window
        c = n_vp + chunk - 1
        count = tl.minimum(n - (S + c * G), G)
        if count > 0:
            if c < tl.load(NKP + b):
                page = tl.load(KT + b * sKT + c)
                s = _page_scores(q, KD, KH, KI, KSC, KZ, page * sKDp + h * sKDh, page * sKHp + h * sKHh,
                                 page * sKIp + h * sKIh, sKDd, sKHr, D, G, NB, BIAS)
            else:
                kb = _fp16_tile(KB, b * sKBb + h * sKBh, sKBt, count, G, D)
                s = tl.dot(q.to(tl.float16), tl.trans(kb))
            s = tl.where((tl.arange(0, G) < count)[None, :], s, float("-inf"))
            m_i, l_i, acc, p = _online_update(m_i, l_i, acc, s)
            vw = _fp16_tile(VW, b * sVWb + h * sVWh + (chunk - 1) * G * sVWt, sVWt, count, G, D)
            acc += tl.dot(p.to(tl.float16), vw)
    else:  # PPP page slots whose keys and values are both packed
        first = (chunk - 1 - NT) * PPP
        if first < n_vp:
            # a fixed trip count: slots past the sequence's last page read page 0 and weigh nothing
            for i in range(PPP):
                live = first + i < n_vp
                kpage = tl.load(KT + b * sKT + first + i, mask=live, other=0)
                vpage = tl.load(VT + b * sVT + first + i, mask=live, other=0)
                if ABLATE == 0 or ABLATE == 1:
                    s = _page_scores(q, KD, KH, KI, KSC, KZ, kpage * sKDp + h * sKDh, kpage * sKHp + h * sKHh,
                                     kpage * sKIp + h * sKIh, sKDd, sKHr, D, G, NB, BIAS)
                    m_i, l_i, acc, p = _online_update(m_i, l_i, acc, tl.where(live, s, float("-inf")))
                    if ABLATE == 0:
                        acc += _page_values(p, VL, VH, VSC, VZ, vpage * sVLp + h * sVLh, vpage * sVSp + h * sVSh,
                                            sVLt, D, G, V4, BIAS)
                elif ABLATE == 2:  # diagnostic: unpack both tiles, no dots
                    kc = _key_codes_tile(KD, KH, KI, kpage * sKDp + h * sKDh, kpage * sKHp + h * sKHh,
                                         kpage * sKIp + h * sKIh, sKDd, sKHr, D, G, NB)
                    vc = _value_codes_tile(VL, VH, vpage * sVLp + h * sVLh, sVLt, D, G, V4)
                    l_i += (tl.sum(tl.sum(kc, 1), 0) + tl.sum(tl.sum(vc, 1), 0)).to(tl.float32)
                else:  # diagnostic: the same bytes as contiguous plane rows, no unpacking, no dots
                    g4 = tl.arange(0, G // 4)
                    d4 = tl.arange(0, D // 4)
                    kraw = tl.load(KD + kpage * sKDp + h * sKDh + d[:, None] * sKDd + g4[None, :])
                    vraw = tl.load(VL + vpage * sVLp + h * sVLh + tl.arange(0, G)[:, None] * sVLt + d4[None, :])
                    l_i += (tl.sum(tl.sum(kraw.to(tl.int32), 1), 0) + tl.sum(tl.sum(vraw.to(tl.int32), 1), 0)).to(tl.float32)
    out = b * sMb + heads * sMh + chunk
    keep = r < REP
    tl.store(M + out, m_i, mask=keep)
    tl.store(L + out, l_i, mask=keep)
    tl.store(ACC + b * sAb + heads[:, None] * sAh + chunk * sAc + d[None, :], acc, mask=keep[:, None])


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


def _tail_slots(config) -> int:
    """Page slots the FP16 value window can span: it holds at most R + G tokens, aligned to pages."""
    return -(-(config.local_window + config.group_size) // config.group_size)


def _check(layer, query):
    d, rep = layer.head_dim, query.shape[1] // layer.heads
    if layer.config.group_size & (layer.config.group_size - 1) or d & (d - 1) or d < 16:
        raise ValueError(f"the kernels need a power-of-two group size and head size >= 16, got "
                         f"G={layer.config.group_size}, D={d}")
    if rep > 64:
        raise ValueError(f"at most 64 query heads per KV head, got {rep}")


def _kernel_args(layer, st):
    kp, vp = st["k_pages"], st["v_pages"]
    ks, vs, kb, vw = st["k_sink"], st["v_sink"], st["k_buffer"], st["v_window"]
    return (
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
    )


def _constants(layer, query):
    c, rep = layer.config, query.shape[1] // layer.heads
    return dict(HKV=layer.heads, REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), D=layer.head_dim,
                G=c.group_size, S=c.sink, S_P=max(16, triton.next_power_of_2(max(c.sink, 1))),
                NB=layer.n_boost, V4=c.value_bits == 4)


def decode_attention(layer, query: torch.Tensor, scaling: float, workspace: dict | None = None,
                     state: dict | None = None, pages_per_program: int | None = None, num_warps: int = 4,
                     num_stages: int = 2, bias: bool = True, ablate: int = 0) -> torch.Tensor:
    """Attention of one new query token per sequence over a Kitty layer's state, fused.

    query [B, Hq, 1, D] -> [B, Hq, 1, D]. The layer must already hold the new token (FP16).
    `state` is `layer.kernel_state()` (built here if not given); `workspace` keeps the partials."""
    _check(layer, query)
    st = state if state is not None else layer.kernel_state()
    b, hq, _, d = query.shape
    slots, nt = st["max_slots"], _tail_slots(layer.config)
    # enough programs to fill the GPU (about 8 per SM of an H200), as few partials as that allows
    ppp = pages_per_program or max(1, min(16, b * layer.heads * slots // 1056))
    n_chunks = 1 + nt + -(-slots // ppp)
    q = query[:, :, 0]
    ws = workspace if workspace is not None else {}
    if ws.get("shape") != (b, hq, n_chunks, d):
        ws.update(shape=(b, hq, n_chunks, d),
                  m=torch.empty((b, hq, n_chunks), device=q.device, dtype=torch.float32),
                  l=torch.empty((b, hq, n_chunks), device=q.device, dtype=torch.float32),
                  acc=torch.empty((b, hq, n_chunks, d), device=q.device, dtype=torch.float32))
    m, l, acc = ws["m"], ws["l"], ws["acc"]
    _decode_partial_kernel[(b * layer.heads, n_chunks)](
        q, q.stride(0), q.stride(1), *_kernel_args(layer, st),
        m, l, acc, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        scaling, **_constants(layer, query), PPP=ppp, NT=nt, BIAS=bias, ABLATE=ablate,
        num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty((b, hq, 1, d), device=q.device, dtype=query.dtype)
    _combine_kernel[(b * hq,)](
        m, l, acc, out, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1), HQ=hq, C=n_chunks, C_P=triton.next_power_of_2(n_chunks), D=d,
    )
    return out


# ---------------------------------------------------------------------------------------------------
# unfused: qk -> memory -> softmax -> memory -> sv


@triton.jit
def _qk_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KD, KH, KI, KSC, KZ, sKDp, sKDh, sKDd, sKHp, sKHh, sKHr, sKIp, sKIh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    SC, sSCb, sSCh,
    scaling,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, V4: tl.constexpr, BIAS: tl.constexpr,
):
    """Scores of slot program_id(1) - 1 (-1: the sink) into SC [B, Hq, S + slots * G], -inf if empty."""
    pid = tl.program_id(0)
    slot = tl.program_id(1) - 1
    b = pid // HKV
    h = pid % HKV
    r = tl.arange(0, REP_P)
    d = tl.arange(0, D)
    heads = h * REP + r
    keep = (r < REP)[:, None]
    q = tl.load(Q + b * sQb + heads[:, None] * sQh + d[None, :], mask=keep, other=0.0).to(tl.float32) * scaling
    n = tl.load(LENS + b)
    row = SC + b * sSCb + heads[:, None] * sSCh
    if slot < 0:
        n_sink = tl.minimum(n, S)
        ts = tl.arange(0, S_P)
        s_sink = tl.dot(q.to(tl.float16), tl.trans(_fp16_tile(KS, b * sSb + h * sSh, sSt, n_sink, S_P, D)))
        s_sink = tl.where((ts < n_sink)[None, :], s_sink, float("-inf"))
        tl.store(row + ts[None, :], s_sink, mask=keep & (ts < S)[None, :])
    else:
        count = tl.minimum(n - (S + slot * G), G)
        t = tl.arange(0, G)
        if slot < tl.load(NKP + b):
            page = tl.load(KT + b * sKT + slot)
            s = _page_scores(q, KD, KH, KI, KSC, KZ, page * sKDp + h * sKDh, page * sKHp + h * sKHh,
                             page * sKIp + h * sKIh, sKDd, sKHr, D, G, NB, BIAS)
        else:
            kb = _fp16_tile(KB, b * sKBb + h * sKBh, sKBt, count, G, D)
            s = tl.dot(q.to(tl.float16), tl.trans(kb))
        s = tl.where((t < count)[None, :], s, float("-inf"))
        tl.store(row + S + slot * G + t[None, :], s, mask=keep)


@triton.jit
def _sv_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KD, KH, KI, KSC, KZ, sKDp, sKDh, sKDd, sKHp, sKHh, sKHr, sKIp, sKIh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    P, sPb, sPh, OUT, sOb, sOh, sOc,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, V4: tl.constexpr, BIAS: tl.constexpr,
):
    """Probabilities of slot program_id(1) - 1 (-1: the sink) times its values -> OUT[:, :, slot + 1]."""
    pid = tl.program_id(0)
    slot = tl.program_id(1) - 1
    b = pid // HKV
    h = pid % HKV
    r = tl.arange(0, REP_P)
    d = tl.arange(0, D)
    heads = h * REP + r
    keep = (r < REP)[:, None]
    n = tl.load(LENS + b)
    n_vp = tl.load(NVP + b)
    row = P + b * sPb + heads[:, None] * sPh
    acc = tl.zeros((REP_P, D), tl.float32)
    if slot < 0:
        n_sink = tl.minimum(n, S)
        ts = tl.arange(0, S_P)
        p_sink = tl.load(row + ts[None, :], mask=keep & (ts < n_sink)[None, :], other=0.0)
        acc = tl.dot(p_sink.to(tl.float16), _fp16_tile(VS, b * sSb + h * sSh, sSt, n_sink, S_P, D))
    else:
        count = tl.minimum(n - (S + slot * G), G)
        if count > 0:
            t = tl.arange(0, G)
            p = tl.load(row + S + slot * G + t[None, :], mask=keep & (t < count)[None, :], other=0.0)
            if slot < n_vp:
                page = tl.load(VT + b * sVT + slot)
                acc = _page_values(p, VL, VH, VSC, VZ, page * sVLp + h * sVLh, page * sVSp + h * sVSh,
                                   sVLt, D, G, V4, BIAS)
            else:
                vw = _fp16_tile(VW, b * sVWb + h * sVWh + (slot - n_vp) * G * sVWt, sVWt, count, G, D)
                acc = tl.dot(p.to(tl.float16), vw)
    tl.store(OUT + b * sOb + heads[:, None] * sOh + (slot + 1) * sOc + d[None, :], acc, mask=keep)


def decode_attention_unfused(layer, query: torch.Tensor, scaling: float, state: dict | None = None,
                             num_warps: int = 4, bias: bool = True) -> torch.Tensor:
    """The same attention as the paper runs it: scores to memory, torch softmax, weighted values."""
    _check(layer, query)
    st = state if state is not None else layer.kernel_state()
    b, hq, _, d = query.shape
    c, slots = layer.config, st["max_slots"]
    q = query[:, :, 0]
    scores = torch.empty((b, hq, c.sink + slots * c.group_size), device=q.device, dtype=torch.float32)
    args, consts = _kernel_args(layer, st), _constants(layer, query)
    grid = (b * layer.heads, 1 + slots)
    _qk_kernel[grid](q, q.stride(0), q.stride(1), *args, scores, scores.stride(0), scores.stride(1), scaling,
                     **consts, BIAS=bias, num_warps=num_warps)
    probs = torch.softmax(scores, dim=-1)
    parts = torch.empty((b, hq, 1 + slots, d), device=q.device, dtype=torch.float32)
    _sv_kernel[grid](q, q.stride(0), q.stride(1), *args, probs, probs.stride(0), probs.stride(1),
                     parts, parts.stride(0), parts.stride(1), parts.stride(2), **consts, BIAS=bias,
                     num_warps=num_warps)
    return parts.sum(2, keepdim=True).to(query.dtype)


# ---------------------------------------------------------------------------------------------------
# Algorithm 1 as a kernel


@triton.jit
def _dequant_pages_kernel(KD, KH, KI, KSC, KZ, sKDp, sKDh, sKDd, sKHp, sKHh, sKHr, sKIp, sKIh,
                          VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVSp, sVSh, O, sOp, sOh, sOt,
                          H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, V4: tl.constexpr,
                          KEYS: tl.constexpr):
    """One page and head per program, written as [G, D] float32 tokens."""
    pid = tl.program_id(0)
    page = pid // H
    h = pid % H
    out = O + page * sOp + h * sOh
    d = tl.arange(0, D)
    t = tl.arange(0, G)
    if KEYS:
        ibase = page * sKIp + h * sKIh
        codes = _key_codes_tile(KD, KH, KI, page * sKDp + h * sKDh, page * sKHp + h * sKHh, ibase, sKDd, sKHr,
                                D, G, NB)  # [D, G]
        x = codes.to(tl.float32) * tl.load(KSC + ibase + d).to(tl.float32)[:, None] \
            + tl.load(KZ + ibase + d).to(tl.float32)[:, None]
        tl.store(out + t[None, :] * sOt + d[:, None], x)
    else:
        sbase = page * sVSp + h * sVSh
        codes = _value_codes_tile(VL, VH, page * sVLp + h * sVLh, sVLt, D, G, V4)  # [G, D]
        x = codes.to(tl.float32) * tl.load(VSC + sbase + t).to(tl.float32)[:, None] \
            + tl.load(VZ + sbase + t).to(tl.float32)[:, None]
        tl.store(out + t[:, None] * sOt + d[None, :], x)


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


# ---------------------------------------------------------------------------------------------------
# reference


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


__all__ = ["decode_attention", "decode_attention_unfused", "decode_attention_reference", "dequantize_pages"]
