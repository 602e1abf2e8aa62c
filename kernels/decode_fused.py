"""The fused decode step's kernels: one split-KV pass (flash-decoding) over a Kitty layer's state.
Launched by `decode.decode_launches`; program (sequence x KV head, chunk):

    `_decode_tail_kernel`   chunk 0: the FP16 sink; chunks 1 .. NT: page slots from the first one
                            whose values are still FP16 (the value window), keys from a packed page or
                            the FP16 q-buffer;
    `_decode_pages_kernel`  chunks NT+1 ..: a sequence's fully packed page slots split evenly over
                            them, up to PPP each, in a loop free of branches (a chunk with no slot
                            exits at once).
Each writes a partial softmax (max, sum, weighted values); `_combine_kernel` merges the chunks.
A step from device counters may hand its token to the tail kernel (NEW), which writes it into the
tail's buffers as it attends to it. The tail's tiles of those buffers enter its dots in their own
dtype (bf16 for a bf16 model: no conversion), with the queries unscaled (`state._tail_query`). An
8-bit tail (`tail_bits=8`) holds int8 codes and a scale a token, which multiplies the token's dots
and its weight (`_tail_scores`, `_tail_values`): half the bytes, no dequantized tile. Its codes become
fp16 operands (exact) in the registers they are loaded into, four with five instructions
(`ptx._int8_f16`), and the queries fp16 on a power-of-two scale of their own.
SOFTCAP (a constexpr, 0: none): the scores become SOFTCAP x tanh(scores / SOFTCAP) before the softmax,
as Gemma 2's attention computes them (`state._softcap`).

The page kernel works on transposed tiles: page rows (tokens for the keys, channels for the values)
are the 16 rows of a tensor-core tile and the GQA group's query heads its column operand, padded to 8
rather than 16, and not duplicated into every row block: half the tensor-core instructions, none of
the register moves that assemble a padded query operand, and softmax and rescaling on [G/4, 4] tiles.
Query tiles elsewhere are 4 rows (Triton pads the dot). A page is four code planes (`state`): the
key planes' bits stay where they lie (1024 + 4^P x code, `ptx._scaled_plane`); the 4^P comes out with
the 1024 in the multiply-add that scales the scores and, for the values, once per program; the
1024 x sums themselves come from a dot of a tile of ones with the same query operands, already in
the scores' layout. Values mirror the keys: a [D/4, G/4] byte tile per token quarter, one dot per
channel plane into four accumulators [D/4, heads], joined once per program; per-token value scales
are folded into the probabilities. Its softmax runs in base 2 (the queries carry log2 e; one
`ex2.approx.ftz` a weight), and slots past a sequence's pages are masked through the [R] vector of
zero terms. It issues each page's small loads (boost index one page ahead, the boosted queries, the
value scales) before the work that precedes their use, so that their latency overlaps it.

Key dots in int8 (KEY8, the default for head sizes of 128 and more). The page kernel can take a
page's key scores on int8 tensor cores: the query times the page's key scales is rounded to int8 per
query head (127 steps of its largest magnitude; the boosted channels' queries on a scale of their
own), and a code plane becomes int8 operands with one or two 32-bit instructions per four codes,
masked in the byte where it lies (`ptx._key8_plane`), where the fp16 operands take one per two after
two byte permutes per four. Each int8 dot covers 32 channels, an fp16 dot 16. The rounding's error at
the codes' mean is the same for every token of a page and is taken out exactly (`_page_scores_i8`).
The values' dots stay fp16. `python -m kitty_core.compile` shows what ptxas makes of all this.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ptx import _exp2, _key8_plane, _scaled_plane, _value_scaled_plane, _widen
from .state import (_cat4, _kv_scales, _kv_tile, _mask_part, _operand, _page_scores, _query_rows, _query_tile,
                    _softcap, _store_token, _tail_query)


@triton.jit
def _boost_index(KC, base, NB: tl.constexpr, NB_P: tl.constexpr):
    """A page head's boost index: its NB boosted channels ([NB_P], rows >= NB: channel 0)."""
    k = tl.arange(0, NB_P)
    return tl.load(KC + base + k, mask=k < NB, other=0).to(tl.int32)


@triton.jit
def _boosted_query(QGT, qkeep, scaling, KSC, ch, kpage, sKSp, sbase_h, NB: tl.constexpr, NB_P: tl.constexpr,
                   KEY8: tl.constexpr):
    """The queries [NB_P, R] of a page's boosted channels ch, times their key scales: in fp32 for the
    int8 dots (KEY8, rounded there), else times 4 (the high bits' weight) in fp16."""
    listed = (tl.arange(0, NB_P) < NB)[:, None]
    qg = tl.load(QGT + ch[:, None], mask=qkeep & listed, other=0.0).to(tl.float32) * scaling
    sc = tl.load(KSC + kpage * sKSp + sbase_h + ch).to(tl.float32)
    qs = qg * sc[:, None]
    if not KEY8:  # x 4 after the fp16 rounding, as (4 * fp16 qk) of the same channel: exact
        qs = (qs.to(tl.float16) * 4.0).to(tl.float16)
    return qs


@triton.jit
def _page_scores_s(qt, qb, raw, hraw, ks, kz, NB: tl.constexpr, BIAS: tl.constexpr):
    """Scores [G/4, R] of the four token quarters of a key page head (dense plane raw [G/4, D], high
    plane hraw [G/4, NB_P]) for the queries qt [D, R] (fp32, pre-scaled): quarter P is code plane
    P, whose dots come out as 1024 x (sum of the operand) + 4^P x the code dot, and are scaled back
    with a subtract and a multiply-add per score. qb: `_boosted_query` of the page.
    The 1024 x sums come from one more dot, of a tile of ones with the same operands: already in the
    layout of the scores, where a sum down the channels would cross lanes and warps."""
    G4: tl.constexpr = raw.shape[0]
    qk = (qt * ks[:, None]).to(tl.float16)
    bias = tl.dot(tl.full((G4, qt.shape[0]), 1.0, tl.float16), qk)
    if NB > 0:
        bias = tl.dot(tl.full((G4, qb.shape[0]), 1.0, tl.float16), qb, bias)
    bias = 1024.0 * bias
    zero = tl.sum(qt * kz[:, None], 0)[None, :]
    wide = _widen(raw, BIAS)
    hwide = _widen(hraw, BIAS)
    s0 = tl.dot(_scaled_plane(wide, 0, BIAS), qk)
    s1 = tl.dot(_scaled_plane(wide, 1, BIAS), qk)
    s2 = tl.dot(_scaled_plane(wide, 2, BIAS), qk)
    s3 = tl.dot(_scaled_plane(wide, 3, BIAS), qk)
    if NB > 0:  # the high planes last: their queries are the page's latest load
        s0 = tl.dot(_scaled_plane(hwide, 0, BIAS), qb, s0)
        s1 = tl.dot(_scaled_plane(hwide, 1, BIAS), qb, s1)
        s2 = tl.dot(_scaled_plane(hwide, 2, BIAS), qb, s2)
        s3 = tl.dot(_scaled_plane(hwide, 3, BIAS), qb, s3)
    s0 = (s0 - bias) + zero
    s1 = (s1 - bias) * 0.25 + zero
    s2 = (s2 - bias) * 0.0625 + zero
    s3 = (s3 - bias) * 0.015625 + zero
    return s0, s1, s2, s3


@triton.jit
def _int8_query(x):
    """Queries x [n, R] (fp32) as int8 on a scale of their largest magnitude per column (127 steps),
    rounded to nearest: adding 1.5 x 2^23 puts the integer in the low mantissa bits, whose low byte
    is its two's complement. Returns (int8 values, step [1, R], rounding residuals x^ - x)."""
    amax = tl.max(tl.abs(x), 0)
    step = (amax * (1.0 / 127.0))[None, :]
    y = x * (127.0 / tl.maximum(amax, 1e-30))[None, :]  # a column of zeros stays zeros
    t = y + 12582912.0
    return t.to(tl.int32, bitcast=True).to(tl.int8), step, ((t - 12582912.0) - y) * step


@triton.jit
def _page_scores_i8(qt, qb, raw, hraw, ks, kz, NB: tl.constexpr, BIAS: tl.constexpr):
    """`_page_scores_s` on int8 tensor cores. The queries times the page's key scales, qt [D, R], are
    rounded to int8 on a scale of their largest magnitude per query head (`_int8_query`), and the
    boosted channels' queries qb [NB_P, R] (fp32, `_boosted_query`, no x 4) on a scale of their own:
    a boosted channel's high codes weigh 4 x its scale, which may be far below the others'.
    Every plane's dot is exact in int32. The rounding's error in a score is sum_d e_d c_d (e: the
    residuals, c: the token's codes); its part at the codes' mean, 1.5 x sum_d e_d (and 6 x the
    boosted queries' residuals, for high codes of weight 4), is the same for every token of the page
    and is taken out with the zero term. What is left, sum_d e_d (c_d - 1.5), is 1.7x smaller for
    uniform codes."""
    qk = qt * ks[:, None]
    q8, step, res = _int8_query(qk)
    zero = tl.sum(qt * kz[:, None] - 1.5 * res, 0)[None, :]
    s0 = tl.dot(_key8_plane(raw, 0, 0, BIAS), q8, out_dtype=tl.int32).to(tl.float32) * step
    s1 = tl.dot(_key8_plane(raw, 1, 0, BIAS), q8, out_dtype=tl.int32).to(tl.float32) * step
    s2 = tl.dot(_key8_plane(raw, 2, 0, BIAS), q8, out_dtype=tl.int32).to(tl.float32) * step
    s3 = tl.dot(_key8_plane(raw, 3, 0, BIAS), q8, out_dtype=tl.int32).to(tl.float32) * step
    if NB > 0:
        qb8, bstep, bres = _int8_query(qb)
        zero -= 6.0 * tl.sum(bres, 0)[None, :]
        s0 += tl.dot(_key8_plane(hraw, 0, 1, BIAS), qb8, out_dtype=tl.int32).to(tl.float32) * bstep
        s1 += tl.dot(_key8_plane(hraw, 1, 1, BIAS), qb8, out_dtype=tl.int32).to(tl.float32) * bstep
        s2 += tl.dot(_key8_plane(hraw, 2, 1, BIAS), qb8, out_dtype=tl.int32).to(tl.float32) * bstep
        s3 += tl.dot(_key8_plane(hraw, 3, 1, BIAS), qb8, out_dtype=tl.int32).to(tl.float32) * bstep
    # planes 1 and 3 carry their codes x 4 (`_KEY8_DENSE`)
    return s0 + zero, s1 * 0.25 + zero, s2 + zero, s3 * 0.25 + zero


@triton.jit
def _page_values_s(p, vs, vz, a0, a1, a2, a3, zt, bt, raw, hraw, V4: tl.constexpr, BIAS: tl.constexpr):
    """Add p [G/4, R] (probabilities of a quarter's tokens) times their values to the channel-plane
    accumulators a0..a3 [D/4, R] (raw, hraw: the quarter's value bytes [D/4, G/4]). Accumulator P
    gathers 4^P x the weighted codes plus 1024 x the weights: the per-token scales vs are folded
    into the weights, and the zero terms (zt) and weights (bt) are kept as [G/4, R] tiles for the
    end of the loop."""
    pw = (p * vs[:, None]).to(tl.float16)
    zt += p * vz[:, None]
    bt += pw.to(tl.float32)
    wide = _widen(raw, BIAS)
    hwide = _widen(hraw, BIAS)
    a0 = tl.dot(_value_scaled_plane(wide, hwide, 0, V4, BIAS), pw, a0)
    a1 = tl.dot(_value_scaled_plane(wide, hwide, 1, V4, BIAS), pw, a1)
    a2 = tl.dot(_value_scaled_plane(wide, hwide, 2, V4, BIAS), pw, a2)
    a3 = tl.dot(_value_scaled_plane(wide, hwide, 3, V4, BIAS), pw, a3)
    return a0, a1, a2, a3, zt, bt


@triton.jit
def _value_scales(VSC, VZ, sbase, T: tl.constexpr, G4: tl.constexpr):
    t = T * G4 + tl.arange(0, G4)
    return tl.load(VSC + sbase + t).to(tl.float32), tl.load(VZ + sbase + t).to(tl.float32)


@triton.jit
def _pick(ids, slots, j):
    """ids[j] of a small vector held in registers (0 past its end)."""
    return tl.sum(tl.where(slots == j, ids, 0))


@triton.jit
def _online_update4_t(m_i, lt, s0, s1, s2, s3, FTZ: tl.constexpr):
    """`_online_update4` on transposed tiles [G/4, R] of a live page (every score finite), in base 2:
    the max runs down the columns."""
    m_new = tl.maximum(m_i, tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 0))
    alpha = _exp2(m_i - m_new, FTZ)[None, :]
    m = m_new[None, :]
    p0 = _exp2(s0 - m, FTZ)
    p1 = _exp2(s1 - m, FTZ)
    p2 = _exp2(s2 - m, FTZ)
    p3 = _exp2(s3 - m, FTZ)
    return m_new, lt * alpha + ((p0 + p1) + (p2 + p3)), alpha, p0, p1, p2, p3


@triton.jit
def _tail_scores(qn, X, XS, base, s_t, count, T: tl.constexpr, D: tl.constexpr, BIAS: tl.constexpr):
    """Dots [R, T] of the queries qn (`_tail_query`) with T tail keys from base: an 8-bit tail's dots
    with the codes, times each token's scale."""
    s = tl.dot(qn, tl.trans(_kv_tile(X, base, s_t, count, T, D, BIAS)))
    if X.dtype.element_ty == tl.int8:
        s = s * _kv_scales(X, XS, base, s_t, count, T, D)[None, :]
    return s


@triton.jit
def _tail_values(acc, p, X, XS, base, s_t, count, T: tl.constexpr, D: tl.constexpr, BIAS: tl.constexpr):
    """acc + p [R, T] @ T tail values from base (rows >= count: zero): an 8-bit tail's codes, with
    each token's scale taken into its weights."""
    if X.dtype.element_ty == tl.int8:
        p = p * _kv_scales(X, XS, base, s_t, count, T, D)[None, :]
    return tl.dot(_operand(p, X), _kv_tile(X, base, s_t, count, T, D, BIAS), acc)


@triton.jit
def _kv_part_scores(qn, scaling, X, XS, base, s_t, count, T: tl.constexpr, G4: tl.constexpr, D: tl.constexpr,
                    SOFTCAP: tl.constexpr, BIAS: tl.constexpr):
    """Scores [R, G/4] of the tail's keys T*G/4 .. (T+1)*G/4 - 1 of a slot (rows >= count: -inf),
    softcapped; `scaling` [R, 1] takes `_tail_query`'s factor."""
    s = _tail_scores(qn, X, XS, base + T * G4 * s_t, s_t, count - T * G4, G4, D, BIAS)
    return _mask_part(_softcap(s * scaling, SOFTCAP, 1.0), count, T, G4)


@triton.jit
def _online_update(m_i, l_i, acc, s):
    """Fold scores s [R, T] into a running softmax: returns (m, l, acc rescaled, p)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None], p


@triton.jit
def _online_update4(m_i, lt, s0, s1, s2, s3):
    """Fold a page's four score tiles [R, G/4] into a running softmax whose denominator is kept as a
    tile lt [R, G/4], summed over its columns once by the caller: per page the only reduction across
    lanes is the row max. Returns (m, lt, alpha [R, 1], p0, p1, p2, p3)."""
    m_new = tl.maximum(m_i, tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)[:, None]
    alpha = tl.exp(m_i[:, None] - m_safe)
    p0 = tl.exp(s0 - m_safe)
    p1 = tl.exp(s1 - m_safe)
    p2 = tl.exp(s2 - m_safe)
    p3 = tl.exp(s3 - m_safe)
    return m_new, lt * alpha + ((p0 + p1) + (p2 + p3)), alpha, p0, p1, p2, p3


@triton.jit
def _store_partial(M, L, ACC, sMb, sMh, sAb, sAh, sAc, b, h, chunk, m_i, l_i, acc, live,
                   REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr):
    """A chunk's partial softmax: its max, its sum and its output (the weighted values over the sum),
    the output in ACC's dtype (the model's for a 16-bit model: half the bytes of fp32 to write here
    and to read in the combine). A dead chunk (no tokens) stores only its max, -inf, which tells
    `_combine_kernel` to skip its sum and output."""
    r = tl.arange(0, REP_P)
    heads = h * REP + r
    keep = r < REP
    tl.store(M + b * sMb + heads * sMh + chunk, m_i, mask=keep)
    tl.store(L + b * sMb + heads * sMh + chunk, l_i, mask=keep & live)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(ACC + b * sAb + heads[:, None] * sAh + chunk * sAc + tl.arange(0, D)[None, :],
             out.to(ACC.dtype.element_ty), mask=(keep & live)[:, None])


@triton.jit
def _decode_tail_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KSS, VSS, KBS, VWS,
    KD, KH, KC, KSC, KZ, sKDp, sKDh, sKDd, sKDg, sKHp, sKHh, sKHr, sKHg, sKCp, sKCh, sKSp, sKSh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVLc, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    M, L, ACC, sMb, sMh, sAb, sAh, sAc,
    scaling,
    KN, sKNb, sKNh, VN, sVNb, sVNh, W, sW,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, V4: tl.constexpr,
    NT: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr, NEW: tl.constexpr,
):
    """Chunk 0: the sink; chunk c in 1 .. NT: slot n_vp + c - 1, values from the window. The tail's
    buffers hold 16-bit tokens, or int8 codes with a scale a token (`tail_bits=8`: `_tail_scores`,
    `_tail_values`).
    NEW: the step's token (KN, VN [B, H, D]) is counted in LENS but not yet in the buffers. The
    program of its slot writes it into the key q-buffer and the value window at W [2, B], then
    waits at a barrier of its threads, after which their loads of the slot's tiles see it: the
    same numbers as a token stored before the launch. (Taking it into the tiles from registers
    instead, with a select in the tile that holds it, cost 23 registers a thread: 94 against 71,
    five programs an SM instead of seven.)"""
    G4: tl.constexpr = G // 4
    b = tl.program_id(0) // HKV
    h = tl.program_id(0) % HKV
    chunk = tl.program_id(1)
    QG, qkeep = _query_rows(Q, sQb, sQh, b, h, REP, REP_P)
    # the tail keys' dots take the queries unscaled (their scaling after the dot) and in the tiles'
    # operand dtype (`_tail_query`): bf16 tiles need no conversion; the packed keys take them
    # pre-scaled, fp32
    qraw = tl.load(QG + tl.arange(0, D)[None, :], mask=qkeep, other=0.0)
    q = qraw.to(tl.float32) * scaling
    qn, qf = _tail_query(qraw, KS, Q)
    tail_scaling = qf * scaling
    n = tl.load(LENS + b)
    n_vp = tl.load(NVP + b)
    if NEW:
        if (chunk > 0) & (n_vp + chunk - 1 == (n - 1 - S) // G):  # the new token is in this slot
            dd = tl.arange(0, D)
            k_at, v_at = b * sKBb + h * sKBh + tl.load(W + b) * sKBt, b * sVWb + h * sVWh + tl.load(W + sW + b) * sVWt
            _store_token(KB, KBS, k_at, tl.load(KN + b * sKNb + h * sKNh + dd), D)
            _store_token(VW, VWS, v_at, tl.load(VN + b * sVNb + h * sVNh + dd), D)
            tl.debug_barrier()
    m_i = tl.full((REP_P,), float("-inf"), tl.float32)
    l_i = tl.zeros((REP_P,), tl.float32)
    acc = tl.zeros((REP_P, D), tl.float32)
    if chunk == 0:  # the sink
        n_sink = tl.minimum(n, S)
        base = b * sSb + h * sSh
        s = _softcap(_tail_scores(qn, KS, KSS, base, sSt, n_sink, S_P, D, BIAS) * tail_scaling, SOFTCAP, 1.0)
        s = tl.where((tl.arange(0, S_P) < n_sink)[None, :], s, float("-inf"))
        live = n_sink > 0
        m_i, l_i, acc, p = _online_update(m_i, l_i, acc, s)
        acc = _tail_values(acc, p, VS, VSS, base, sSt, n_sink, S_P, D, BIAS)
    else:  # one slot of the tail
        c = n_vp + chunk - 1
        count = tl.minimum(n - (S + c * G), G)
        live = count > 0
        if live:
            if c < tl.load(NKP + b):
                page = tl.load(KT + b * sKT + c)
                s0, s1, s2, s3 = _page_scores(q, QG, qkeep, scaling, KD, KH, KC, KSC, KZ, page * sKDp + h * sKDh,
                                              page * sKHp + h * sKHh, page * sKSp + h * sKSh, page * sKCp + h * sKCh,
                                              sKDd, sKDg, sKHr, sKHg, D, G, NB, NB_P, BIAS)
                s0 = _mask_part(_softcap(s0, SOFTCAP, 1.0), count, 0, G4)
                s1 = _mask_part(_softcap(s1, SOFTCAP, 1.0), count, 1, G4)
                s2 = _mask_part(_softcap(s2, SOFTCAP, 1.0), count, 2, G4)
                s3 = _mask_part(_softcap(s3, SOFTCAP, 1.0), count, 3, G4)
            else:
                kb = b * sKBb + h * sKBh
                s0 = _kv_part_scores(qn, tail_scaling, KB, KBS, kb, sKBt, count, 0, G4, D, SOFTCAP, BIAS)
                s1 = _kv_part_scores(qn, tail_scaling, KB, KBS, kb, sKBt, count, 1, G4, D, SOFTCAP, BIAS)
                s2 = _kv_part_scores(qn, tail_scaling, KB, KBS, kb, sKBt, count, 2, G4, D, SOFTCAP, BIAS)
                s3 = _kv_part_scores(qn, tail_scaling, KB, KBS, kb, sKBt, count, 3, G4, D, SOFTCAP, BIAS)
            m_i, lt, alpha, p0, p1, p2, p3 = _online_update4(m_i, tl.zeros((REP_P, G4), tl.float32), s0, s1, s2, s3)
            l_i = tl.sum(lt, 1)
            vw = b * sVWb + h * sVWh + (chunk - 1) * G * sVWt
            acc = acc * alpha
            acc = _tail_values(acc, p0, VW, VWS, vw + 0 * G4 * sVWt, sVWt, count - 0 * G4, G4, D, BIAS)
            acc = _tail_values(acc, p1, VW, VWS, vw + 1 * G4 * sVWt, sVWt, count - 1 * G4, G4, D, BIAS)
            acc = _tail_values(acc, p2, VW, VWS, vw + 2 * G4 * sVWt, sVWt, count - 2 * G4, G4, D, BIAS)
            acc = _tail_values(acc, p3, VW, VWS, vw + 3 * G4 * sVWt, sVWt, count - 3 * G4, G4, D, BIAS)
    _store_partial(M, L, ACC, sMb, sMh, sAb, sAh, sAc, b, h, chunk, m_i, l_i, acc, live, REP, REP_P, D)


@triton.jit
def _decode_pages_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KSS, VSS, KBS, VWS,
    KD, KH, KC, KSC, KZ, sKDp, sKDh, sKDd, sKDg, sKHp, sKHh, sKHr, sKHg, sKCp, sKCh, sKSp, sKSh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVLc, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    M, L, ACC, sMb, sMh, sAb, sAh, sAc,
    scaling,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, V4: tl.constexpr,
    PPP: tl.constexpr, NT: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr, KEY8: tl.constexpr,
):
    """Chunk program_id(1) of the sequence's fully packed page slots (at most PPP of them: the live
    slots split evenly over the grid's chunks), into partial NT + 1 + program_id(1)."""
    G4: tl.constexpr = G // 4
    D4: tl.constexpr = D // 4
    b = tl.program_id(0) // HKV
    h = tl.program_id(0) % HKV
    chunk = tl.program_id(1)
    QG, qkeep = _query_rows(Q, sQb, sQh, b, h, REP, REP_P)
    # scores in base 2 (the queries times log2 e): the softmax takes exp2 of them; the partial's max
    # goes back to base e when it is stored
    scaling = scaling * 1.4426950408889634
    q = _query_tile(QG, qkeep, scaling, D)
    d = tl.arange(0, D)
    g = tl.arange(0, G4)
    c = tl.arange(0, D4)
    n_vp = tl.load(NVP + b)
    m_i = tl.full((REP_P,), float("-inf"), tl.float32)
    l_i = tl.zeros((REP_P,), tl.float32)
    acc = tl.zeros((REP_P, D), tl.float32)
    # the sequence's live slots spread evenly over the grid's chunks, at most PPP each (the grid has
    # ceil(slots / PPP) chunks for the longest run): a grid sized for the cache's capacity (one CUDA
    # graph for every length) then keeps all its chunks busy at any length, not the first few
    per = tl.cdiv(n_vp, tl.num_programs(1))
    first = chunk * per
    count = tl.minimum(n_vp - first, per)
    # the run's page ids in one load, ahead of the page loop (no table round trip per page)
    slots = tl.arange(0, PPP)
    kpages = tl.load(KT + b * sKT + first + slots, mask=slots < count, other=0)
    vpages = tl.load(VT + b * sVT + first + slots, mask=slots < count, other=0)
    if count > 0:
        # query heads across the tiles, tokens (keys) or channels (values) down: the tensor-core
        # tile's 16 rows are page rows, and the 4 query heads are its (8-wide) column operand
        r = tl.arange(0, REP_P)
        QGT = Q + b * sQb + (h * REP + r)[None, :] * sQh
        keept = (r < REP)[None, :]
        qt = tl.trans(q)
        a0 = tl.zeros((D4, REP_P), tl.float32)
        a1 = tl.zeros((D4, REP_P), tl.float32)
        a2 = tl.zeros((D4, REP_P), tl.float32)
        a3 = tl.zeros((D4, REP_P), tl.float32)
        # the softmax denominator, the values' zero terms and their weights stay [G/4, R] tiles,
        # rescaled with the accumulators and summed down their columns once after the loop
        lt = tl.zeros((G4, REP_P), tl.float32)
        zt = tl.zeros((G4, REP_P), tl.float32)
        bt = tl.zeros((G4, REP_P), tl.float32)
        # Small per-page loads are issued early: each page's boost index one page ahead, the boosted
        # queries it selects and the page's value scales at the top of its iteration, so that their
        # latency overlaps work instead of stalling it (the planes are pipelined by Triton).
        ch = tl.zeros((NB_P,), tl.int32)
        if NB > 0:
            ch = _boost_index(KC, _pick(kpages, slots, 0) * sKCp + h * sKCh, NB, NB_P)
        for i in range(0, count):
            kpage = _pick(kpages, slots, i)
            vpage = _pick(vpages, slots, i)
            qb = tl.zeros((NB_P, REP_P), tl.float32 if KEY8 else tl.float16)
            ch_next = ch
            if NB > 0:
                qb = _boosted_query(QGT, keept, scaling, KSC, ch, kpage, sKSp, h * sKSh, NB, NB_P, KEY8)
                ch_next = _boost_index(KC, _pick(kpages, slots, i + 1) * sKCp + h * sKCh, NB, NB_P)
            vsbase = vpage * sVSp + h * sVSh
            vs0, vz0 = _value_scales(VSC, VZ, vsbase, 0, G4)
            vs1, vz1 = _value_scales(VSC, VZ, vsbase, 1, G4)
            vs2, vz2 = _value_scales(VSC, VZ, vsbase, 2, G4)
            vs3, vz3 = _value_scales(VSC, VZ, vsbase, 3, G4)
            # this page's keys
            sbase = kpage * sKSp + h * sKSh
            ks = tl.load(KSC + sbase + d).to(tl.float32)
            kz = tl.load(KZ + sbase + d).to(tl.float32)
            raw = tl.load(KD + kpage * sKDp + h * sKDh + g[:, None] * sKDg + d[None, :] * sKDd)  # [G/4, D]
            hraw = raw
            if NB > 0:
                k = tl.arange(0, NB_P)
                hraw = tl.load(KH + kpage * sKHp + h * sKHh + g[:, None] * sKHg + k[None, :] * sKHr,
                               mask=(k < NB)[None, :], other=0)
            if KEY8:
                s0, s1, s2, s3 = _page_scores_i8(qt, qb, raw, hraw, ks, kz, NB, BIAS)
            else:
                s0, s1, s2, s3 = _page_scores_s(qt, qb, raw, hraw, ks, kz, NB, BIAS)
            # softcapped in base 2: (cap x log2 e) x tanh(s / (cap x log2 e)) is log2 e x the natural one
            s0 = _softcap(s0, SOFTCAP, 1.4426950408889634)
            s1 = _softcap(s1, SOFTCAP, 1.4426950408889634)
            s2 = _softcap(s2, SOFTCAP, 1.4426950408889634)
            s3 = _softcap(s3, SOFTCAP, 1.4426950408889634)
            m_i, lt, alpha, p0, p1, p2, p3 = _online_update4_t(m_i, lt, s0, s1, s2, s3, BIAS == 2)
            a0 = a0 * alpha
            a1 = a1 * alpha
            a2 = a2 * alpha
            a3 = a3 * alpha
            zt = zt * alpha
            bt = bt * alpha
            # this page's values, a quarter of tokens at a time
            vb = vpage * sVLp + h * sVLh + c[:, None] * sVLc
            t = g[None, :] * sVLt
            vr0 = tl.load(VL + vb + t)
            vr1 = tl.load(VL + vb + G4 * sVLt + t)
            vr2 = tl.load(VL + vb + 2 * G4 * sVLt + t)
            vr3 = tl.load(VL + vb + 3 * G4 * sVLt + t)
            vh0 = vr0
            vh1 = vr1
            vh2 = vr2
            vh3 = vr3
            if V4:
                vh0 = tl.load(VH + vb + t)
                vh1 = tl.load(VH + vb + G4 * sVLt + t)
                vh2 = tl.load(VH + vb + 2 * G4 * sVLt + t)
                vh3 = tl.load(VH + vb + 3 * G4 * sVLt + t)
            a0, a1, a2, a3, zt, bt = _page_values_s(p0, vs0, vz0, a0, a1, a2, a3, zt, bt, vr0, vh0, V4, BIAS)
            a0, a1, a2, a3, zt, bt = _page_values_s(p1, vs1, vz1, a0, a1, a2, a3, zt, bt, vr1, vh1, V4, BIAS)
            a0, a1, a2, a3, zt, bt = _page_values_s(p2, vs2, vz2, a0, a1, a2, a3, zt, bt, vr2, vh2, V4, BIAS)
            a0, a1, a2, a3, zt, bt = _page_values_s(p3, vs3, vz3, a0, a1, a2, a3, zt, bt, vr3, vh3, V4, BIAS)
            ch = ch_next
        l_i += tl.sum(lt, 0)
        # accumulator P holds 4^P x the weighted codes + 1024 x the weights
        zs = tl.sum(zt, 0)[None, :]
        bs = 1024.0 * tl.sum(bt, 0)[None, :]
        acc = _cat4(tl.trans(a0 - bs + zs), tl.trans((a1 - bs) * 0.25 + zs), tl.trans((a2 - bs) * 0.0625 + zs),
                    tl.trans((a3 - bs) * 0.015625 + zs))
    _store_partial(M, L, ACC, sMb, sMh, sAb, sAh, sAc, b, h, NT + 1 + chunk, m_i * 0.6931471805599453, l_i, acc,
                   count > 0, REP, REP_P, D)


@triton.jit
def _combine_kernel(M, L, ACC, O, sMb, sMh, sAb, sAh, sAc, sOb, sOh, C, LSE,
                    HQ: tl.constexpr, C_P: tl.constexpr, BLOCK_D: tl.constexpr,
                    WITH_LSE: tl.constexpr, GDC: tl.constexpr = False):
    """Merge the C partial softmaxes of each (sequence, query head): the chunks' outputs weighted by
    their sums, rescaled to a common max. Program (row, j) merges channels j*BLOCK_D .. (j+1)*BLOCK_D - 1
    of its row. C is a runtime value (only its power-of-two bound C_P is compiled in): it grows by one
    every few pages of a generation. WITH_LSE: the log of the whole softmax denominator as well, LSE
    [B * HQ] (to merge this attention with attention elsewhere). GDC: launched as a programmatic
    dependent (`launch_pdl`), it waits here for the partials' writers."""
    if GDC:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    b = pid // HQ
    hq = pid % HQ
    c = tl.arange(0, C_P)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # the three loads are issued together; dead chunks (past a sequence's tokens) stored only their
    # max, so their sums and outputs are whatever the workspace held, and are selected away
    m = tl.load(M + b * sMb + hq * sMh + c, mask=c < C, other=float("-inf"))
    l = tl.load(L + b * sMb + hq * sMh + c, mask=c < C, other=0.0)
    part = tl.load(ACC + b * sAb + hq * sAh + c[:, None] * sAc + d[None, :], mask=(c < C)[:, None], other=0.0)
    ok = m > float("-inf")
    w = tl.where(ok, tl.exp(m - tl.max(m, 0)) * l, 0.0)  # each chunk's share of the whole sum
    o = tl.sum(tl.where(ok[:, None], part.to(tl.float32), 0.0) * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * sOb + hq * sOh + d, o.to(O.dtype.element_ty))
    if WITH_LSE:
        if tl.program_id(1) == 0:
            tl.store(LSE + pid, tl.max(m, 0) + tl.log(tl.sum(w, 0)))
