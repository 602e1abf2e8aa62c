"""What the decode kernels read of a Kitty layer, and the pieces both decode pipelines (fused,
unfused) build from it.

The kernels take tensors and sizes. A layer reaches them as anything with the attributes of
`PagedLayer` (`kitty_core.layer.KittyLayer` is one): its sizes, and `kernel_state()`, a dict of the
tensors a step reads (`_kernel_args` lists them): the tail's sink, key q-buffer and value window
[B, H, cap, D] (the model's dtype, or int8 codes with `tail_scales` [B, H, cap] in fp32); the page
pools' fields [P, H, ...]; the page tables [B, width] and counts [B] (int32);
the real tokens per sequence `lens` [B]; and `max_slots`, the page slots of the longest sequence.
The kernels take every stride of the planes: `kitty_core.page_pool.PagePool` stores them with the
reduced axis contiguous (key channels, value tokens), so that a tensor-core operand reads four
codes' bytes at once from shared memory.

How a key page is read (the tail kernel and the unfused qk kernel; the fused page kernel reads its
pages transposed, `decode_fused`). A packed row of n codes is four planes of n/4 contiguous elements
(byte i holds elements i, i + n/4, i + n/2, i + 3n/4; `pages.py`). A key page head is one
[D, G/4] byte load whose plane P, `(byte >> 2P) & 3`, is the [D, G/4] code tile of tokens
P*G/4 .. (P+1)*G/4; so a page costs four tensor-core dots q [heads, D] @ plane [D, G/4], for all query
heads of the GQA group at once, with no shuffle of unpacked values. The compact high plane
([Db, G/4]) adds four more dots against the queries of the boosted channels x 4: the page's boost
index lists those channels, so their queries are a gathered load of Db values per head from the query
rows. Per-channel key scales are folded into the query (q.k = sum (q_d s_d) c_d + sum q_d z_d).
"""

from __future__ import annotations

from typing import Protocol

import triton
import triton.language as tl

from .ptx import _int8_f16, _plane_f16

class PagedLayer(Protocol):
    """What the kernels read of a layer (duck-typed: `kitty_core.layer.KittyLayer`)."""

    config: object  # group_size, sink, local_window, value_bits (`kitty_core.config.KittyConfig`)
    heads: int  # KV heads
    head_dim: int
    n_boost: int  # boosted key channels a page

    def kernel_state(self) -> dict: ...

    # steps from device counters (`decode.DecodeStep`, `decode.step_workspace`) read as well: batch,
    # dtype, device, capacity_slots() and steps.write (the step's token positions [2, B])


@triton.jit
def _key_plane_scores(qk, qb, raw, hraw, P: tl.constexpr, NB: tl.constexpr, BIAS: tl.constexpr):
    """Scores [R, G/4] of the tokens of plane P: low codes, plus the boosted channels' high codes."""
    s = tl.dot(qk, _plane_f16(raw, P, BIAS))
    if NB > 0:
        s = tl.dot(qb, _plane_f16(hraw, P, BIAS), s)
    return s


@triton.jit
def _page_scores(q, QG, qkeep, scaling, KD, KH, KC, KSC, KZ, kbase, hbase, sbase, cbase, sKDd, sKDg, sKHr, sKHg,
                 D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, BIAS: tl.constexpr):
    """Scores of the pre-scaled queries q [R, D] (fp32) against one head of a key page, as four
    tiles [R, G/4]: tile P holds tokens P*G/4 .. (P+1)*G/4 - 1, the page's code plane P.

    The dense plane is one [D, G/4] byte load; the compact high plane one [NB, G/4] load, met by the
    queries of the boosted channels x 4, read through the page's boost index from the query rows in
    memory (QG [R, 1] pointers, rows where qkeep; a cached gather of NB values per row)."""
    G4: tl.constexpr = G // 4
    d = tl.arange(0, D)
    g = tl.arange(0, G4)
    ks = tl.load(KSC + sbase + d).to(tl.float32)
    kz = tl.load(KZ + sbase + d).to(tl.float32)
    qk = (q * ks[None, :]).to(tl.float16)
    if BIAS:  # the zero and bias terms in one row sum
        shift = tl.sum(q * kz[None, :] - 1024.0 * qk.to(tl.float32), 1)
    else:
        shift = tl.sum(q * kz[None, :], 1)
    raw = tl.load(KD + kbase + d[:, None] * sKDd + g[None, :] * sKDg)
    qb = qk
    hraw = raw
    if NB > 0:
        k = tl.arange(0, NB_P)
        listed = k < NB
        ch = tl.load(KC + cbase + k, mask=listed, other=0).to(tl.int32)  # channel of each high row
        qg = tl.load(QG + ch[None, :], mask=qkeep & listed[None, :], other=0.0).to(tl.float32) * scaling
        # x 4 after the fp16 rounding, as (4 * fp16 qk) of the same channel: exact
        qb = ((qg * tl.load(KSC + sbase + ch).to(tl.float32)[None, :]).to(tl.float16) * 4.0).to(tl.float16)
        if BIAS:
            shift -= 1024.0 * tl.sum(qb.to(tl.float32), 1)
        hraw = tl.load(KH + hbase + k[:, None] * sKHr + g[None, :] * sKHg, mask=listed[:, None], other=0)
    s0 = _key_plane_scores(qk, qb, raw, hraw, 0, NB, BIAS) + shift[:, None]
    s1 = _key_plane_scores(qk, qb, raw, hraw, 1, NB, BIAS) + shift[:, None]
    s2 = _key_plane_scores(qk, qb, raw, hraw, 2, NB, BIAS) + shift[:, None]
    s3 = _key_plane_scores(qk, qb, raw, hraw, 3, NB, BIAS) + shift[:, None]
    return s0, s1, s2, s3


@triton.jit
def _cat(a, b):
    """[R, n] and [R, n] -> [R, 2n], a then b along the last dim."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _cat4(a0, a1, a2, a3):
    return _cat(_cat(a0, a1), _cat(a2, a3))


@triton.jit
def _operand(x, X):
    """x as a tensor-core operand beside tiles of the FP16 buffer X (the model's dtype): bf16 where X
    holds bf16, so that its tiles enter the dots as stored; fp16 otherwise."""
    BF16: tl.constexpr = X.dtype.element_ty == tl.bfloat16
    return x.to(tl.bfloat16) if BF16 else x.to(tl.float16)


@triton.jit
def _tail_query(qraw, X, Q):
    """The queries qraw [R, D] (unscaled) as the operand of dots with tiles of the tail buffer X, and
    the factor [R, 1] those dots take after: in the tiles' operand dtype (`_kv_tile`: bf16 for a bf16
    16-bit tail, as stored), factor 1. Where that operand is fp16 and the queries are not (an 8-bit
    tail's codes beside bf16 queries, an fp32 model's tiles), each row on a power-of-two scale that
    puts its largest magnitude in [2^14, 2^15), the inverse the factor: no overflow, and a bf16 entry
    exact unless it is 2^28 times smaller than its row's largest (fp16's subnormals)."""
    F16: tl.constexpr = (X.dtype.element_ty != tl.bfloat16) & (Q.dtype.element_ty != tl.float16)
    if F16:
        top = (tl.max(tl.abs(qraw.to(tl.float32)), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
        top = tl.minimum(tl.maximum(top, 15), 254)  # the biased exponent of the largest magnitude
        scale = ((268 - top) << 23).to(tl.float32, bitcast=True)  # 2^(141 - e)
        factor = ((top - 14) << 23).to(tl.float32, bitcast=True)  # 2^(e - 141)
        return (qraw.to(tl.float32) * scale[:, None]).to(tl.float16), factor[:, None]
    return _operand(qraw, X), tl.full((qraw.shape[0], 1), 1.0, tl.float32)


@triton.jit
def _kv_tile(X, base, s_t, count, T: tl.constexpr, D: tl.constexpr, BIAS: tl.constexpr):
    """Tokens [T, D] of a tail buffer from base (token stride s_t), rows >= count zero, as a dot
    operand: the tokens of a 16-bit tail (`_operand`), the codes of an 8-bit one as fp16 (exact;
    `ptx._int8_f16`), whose scales `_kv_scales` reads."""
    t = tl.arange(0, T)
    d = tl.arange(0, D)
    x = tl.load(X + base + t[:, None] * s_t + d[None, :], mask=(t < count)[:, None], other=0)
    if X.dtype.element_ty == tl.int8:
        return _int8_f16(x, BIAS)
    return _operand(x, X)


@triton.jit
def _kv_scales(X, XS, base, s_t, count, T: tl.constexpr, D: tl.constexpr):
    """The scales [T] (fp32, rows >= count zero) of an 8-bit tail's tokens whose codes `_kv_tile`
    reads from X: each at its token's element offset / D (both tensors contiguous, `_kernel_args`).
    Only for an int8 X."""
    t = tl.arange(0, T)
    return tl.load(XS + (base + t * s_t) // D, mask=t < count, other=0.0)


@triton.jit
def _store_token(X, XS, at, x, D: tl.constexpr):
    """Store one token x [D] (as loaded, the model's dtype) at element offset `at` of a tail buffer,
    as the buffer stores it: as it is, or (int8) codes round(x / s) on s = max|x| x (1 / 127), ties
    to even, with s at XS + at / D: the numbers `kitty_core.regions.quantize_tokens` computes, bit
    for bit (the division correctly rounded, as torch's: Triton's `/` is approximate on a GPU)."""
    d = tl.arange(0, D)
    if X.dtype.element_ty == tl.int8:
        y = x.to(tl.float32)
        s = tl.max(tl.abs(y), 0) * (1.0 / 127.0)
        y = tl.math.div_rn(y, tl.maximum(s, 1e-30))
        y = (y + 12582912.0) - 12582912.0  # round to nearest even (|y| <= 127 < 2^22)
        tl.store(X + at + d, tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8))
        tl.store(XS + at // D, s)
    else:
        tl.store(X + at + d, x.to(X.dtype.element_ty))


@triton.jit
def _softcap(s, CAP: tl.constexpr, UNIT: tl.constexpr):
    """Gemma 2's logit softcapping of scores s in units of UNIT (1: natural, log2 e: the base-2 scores
    of the fused page kernel): C x tanh(s / C) for C = CAP x UNIT, the same as CAP x tanh(s_e / CAP)
    of the natural scores s_e = s / UNIT; CAP 0: s as it is. tanh(y) = 1 - 2 / (e^2y + 1) takes one
    exp2 and one division, saturates to +-1 without overflow, and is off by at most ~C x 1e-7 near 0.
    Masked (-inf) scores must be masked after it: a capped -inf is -C."""
    if CAP > 0:
        C: tl.constexpr = CAP * UNIT
        return C - (2.0 * C) / (tl.exp2(s * (2.8853900817779268 / C)) + 1.0)  # 2 log2 e / C
    return s


@triton.jit
def _mask_part(s, count, T: tl.constexpr, G4: tl.constexpr):
    return tl.where((T * G4 + tl.arange(0, G4) < count)[None, :], s, float("-inf"))


@triton.jit
def _query_rows(Q, sQb, sQh, b, h, REP: tl.constexpr, REP_P: tl.constexpr):
    """The GQA group's query rows: pointers [REP_P, 1] and which of them are real (rows < REP)."""
    r = tl.arange(0, REP_P)[:, None]
    return Q + b * sQb + (h * REP + r) * sQh, r < REP


@triton.jit
def _query_tile(QG, qkeep, scaling, D: tl.constexpr):
    """The GQA group's queries [REP_P, D] (rows >= REP zero), pre-scaled, fp32."""
    q = tl.load(QG + tl.arange(0, D)[None, :], mask=qkeep, other=0.0)
    return q.to(tl.float32) * scaling


UNPACK = {"convert": 0, "bits": 1, "ptx": 2}  # how codes become fp16 operands (the kernels' BIAS)


def _bias(unpack: str | None, cuda: bool) -> int:
    """`unpack`: "convert" (int -> fp16 conversions), "bits" (the 1024 + code bit pattern, per
    element) or "ptx" (the same pattern four codes at a time; CUDA only). None: the fastest here.
    The page kernel's planes (1024 + 4^P x code) need no conversion: it builds them per element
    unless "ptx"."""
    unpack = unpack or ("ptx" if cuda else "bits")
    if unpack not in UNPACK or (unpack == "ptx" and not cuda):
        raise ValueError(f"unpack must be one of {sorted(UNPACK)} ('ptx' on CUDA only), got {unpack!r}")
    return UNPACK[unpack]


def _check(layer: PagedLayer, query, cuda: bool):
    d, g, rep = layer.head_dim, layer.config.group_size, query.shape[1] // layer.heads
    least = 64 if cuda else 4  # tensor-core dots take planes >= 16 wide; the interpreter any
    if g & (g - 1) or d & (d - 1) or min(g, d) < least:
        raise ValueError(f"the kernels need power-of-two group and head sizes >= {least}, got G={g}, D={d}")
    if rep > 64:
        raise ValueError(f"at most 64 query heads per KV head, got {rep}")


def _kernel_args(layer: PagedLayer, st: dict) -> tuple:
    kp, vp = st["k_pages"], st["v_pages"]
    ks, vs, kb, vw = tail = st["k_sink"], st["v_sink"], st["k_buffer"], st["v_window"]
    scales = st.get("tail_scales")
    if scales is not None:  # an 8-bit tail: a token's scale sits at its codes' element offset / D
        if not all(t.is_contiguous() for t in (*tail, *scales)):
            raise ValueError("an 8-bit tail's codes and scales must be contiguous tensors")
    return (
        ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        kb, kb.stride(0), kb.stride(1), kb.stride(2),
        vw, vw.stride(0), vw.stride(1), vw.stride(2),
        *(scales if scales is not None else tail),  # (16-bit tail: not read)
        kp["dense"], kp["high"], kp["boost_ch"], kp["scale"], kp["zero"],
        *kp["dense"].stride(), *kp["high"].stride(),
        kp["boost_ch"].stride(0), kp["boost_ch"].stride(1), kp["scale"].stride(0), kp["scale"].stride(1),
        vp["low"], vp["high"], vp["scale"], vp["zero"],
        *vp["low"].stride(), vp["scale"].stride(0), vp["scale"].stride(1),
        st["k_table"], st["v_table"], st["k_table"].stride(0), st["v_table"].stride(0),
        st["lens"], st["n_kpages"], st["n_vpages"],
    )


def _constants(layer: PagedLayer, query) -> dict:
    c, rep = layer.config, query.shape[1] // layer.heads
    return dict(HKV=layer.heads, REP=rep, REP_P=max(4, triton.next_power_of_2(rep)), D=layer.head_dim,
                G=c.group_size, S=c.sink, S_P=max(16, triton.next_power_of_2(max(c.sink, 1))),
                NB=layer.n_boost, NB_P=max(16, triton.next_power_of_2(max(layer.n_boost, 1))),
                V4=c.value_bits == 4)
