"""Decode attention over a Kitty layer: packed pages + FP16 sink, key q-buffer and value window.

Two implementations of one attention step (one new query token per sequence), and Algorithm 1:

fused (`decode_attention`)  one split-KV pass (flash-decoding). Program (sequence, KV head, chunk):
    tail kernel   chunk 0: the FP16 sink; chunks 1 .. NT: page slots from the first one whose values
                  are still FP16 (the value window), keys from a packed page or the FP16 q-buffer;
    pages kernel  chunks NT+1 ..: up to PPP fully packed page slots each, in a loop over the live
                  ones, free of branches (a chunk past a sequence's pages exits at once).
    Each writes a partial softmax (max, sum, weighted values); `_combine_kernel` merges the chunks.
    On a GPU the tail kernel runs on a second stream beside the pages kernel (they share no output).
    A step from device counters may hand its token to the tail kernel (`new=`), which writes it into
    the FP16 buffers as it attends to it. The tail's tiles of those buffers enter its dots in their
    own dtype (bf16 for a bf16 model: no conversion), with the queries unscaled (`_operand`).
unfused (`decode_attention_unfused`)  the paper's three steps: a qk kernel writes every score to
    memory, torch softmax, an sv kernel reads the probabilities back (partials summed by torch).
`dequantize_pages`  pages -> float32 tokens (inspection and tests).

Key dots in int8 (`key_dots`, the default for head sizes of 128 and more). The page kernel can take a
page's key scores on int8 tensor cores: the query times the page's key scales is rounded to int8 per
query head (127 steps of its largest magnitude; the boosted channels' queries on a scale of their
own), and a code plane becomes int8 operands with one or two 32-bit instructions per four codes,
masked in the byte where it lies (`_key8_plane`), where the fp16 operands below take one per two
after two byte permutes per four. Each int8 dot covers 32 channels, an fp16 dot 16. The rounding's
error at the codes' mean is the same for every token of a page and is taken out exactly
(`_page_scores_i8`). The values' dots stay fp16.

How a page is read. A packed row of n codes is four planes of n/4 contiguous elements (byte i
holds elements i, i + n/4, i + n/2, i + 3n/4; `kitty_core.quant`). A key page head is one [D, G/4]
byte load whose plane P, `(byte >> 2P) & 3`, is the [D, G/4] code tile of tokens P*G/4 .. (P+1)*G/4;
so a page costs four tensor-core dots q [heads, D] @ plane [D, G/4], for all query heads of the GQA
group at once, with no shuffle of unpacked values. The compact high plane ([Db, G/4]) adds four more
dots against the queries of the boosted channels x 4: the page's boost index lists those channels,
so their queries are a gathered load of Db values per head from the query rows (cached), where a
one-hot [D, Db] dot built per page had cost as much as the rest of the key side. Values mirror
the keys: a [G/4, D/4] byte tile per token quarter, one dot per channel plane into four
accumulators [heads, D/4], joined once per program.
Codes become fp16 without a conversion instruction: `code | 0x6400` is the bit pattern of the fp16
number 1024 + code, and the 1024 is taken out after the dot (1024 x the row sum of the other
operand). On CUDA, inline PTX builds these patterns four codes at a time (a shift, a mask, two byte
permutes; `_unpack_ptx`). Per-channel key scales are folded into the query
(q.k = sum (q_d s_d) c_d + sum q_d z_d), per-token value scales into the probabilities.
The page kernel works on transposed tiles: page rows (tokens for the keys, channels for the
values) are the 16 rows of a tensor-core tile and the GQA group's query heads its column operand,
padded to 8 rather than 16, and no longer duplicated into every row block: half the tensor-core
instructions, none of the register moves that assembled a padded query operand, and softmax and
rescaling on [G/4, 4] tiles. Query tiles elsewhere are 4 rows (Triton pads the dot).
It also leaves the plane's bits where they lie: bytes widened to 16 bits (two byte permutes per
four), `(x & 3 << 2P) | 0x6400` is 1024 + 4^P x code, exact in fp16, one `lop3` for two codes
(`_scaled_plane`); the 4^P comes out with the 1024 in the multiply-add that scales the scores and,
for the values, once per program; the 1024 x sums themselves come from a dot of a tile of ones with
the same query operands, already in the scores' layout. Its softmax runs in base 2 (the queries
carry log2 e; one `ex2.approx.ftz` a weight), and slots past a sequence's pages are masked through
the [R] vector of zero terms. And it issues each page's small loads (boost index one page
ahead, the boosted queries, the value scales) before the work that precedes their use, so that
their latency overlaps it.
The kernels take every stride of the planes: `kitty_core.cache.PagePool` stores them with the
reduced axis contiguous (key channels, value tokens), so that a tensor-core operand reads four codes'
bytes at once from shared memory. `python -m kernels.compile` shows what ptxas makes of all this.

`decode_attention_reference` is the same attention in PyTorch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .plan import Launch

# ---------------------------------------------------------------------------------------------------
# planes


def _unpack_ptx(plane: int, high: bool) -> str:
    """PTX for four packed bytes ($2, and the high-bit bytes $3) -> the fp16 bit patterns of
    1024 + code of their plane `plane`, two per register ($0: bytes 0, 1; $1: bytes 2, 3).
    Four codes cost a shift, a mask and two byte permutes, where element-wise integer code spends
    about five instructions on each one."""
    lines = [f"shr.b32 a, $2, {2 * plane};", "and.b32 a, a, 0x03030303;"]
    if high:
        lines += [f"shr.b32 b, $3, {2 * plane};", "and.b32 b, b, 0x03030303;", "shl.b32 b, b, 2;", "or.b32 a, a, b;"]
    # prmt picks bytes of {a, 0x64646464}: selector nibble 0-3 a byte of a, 4 the constant 0x64
    lines += ["prmt.b32 $0, a, 0x64646464, 0x4140;", "prmt.b32 $1, a, 0x64646464, 0x4342;"]
    return "{ .reg .b32 a, b; " + " ".join(lines) + " }"


_PTX_LOW0, _PTX_LOW1, _PTX_LOW2, _PTX_LOW3 = [tl.constexpr(_unpack_ptx(p, False)) for p in range(4)]
_PTX_FULL0, _PTX_FULL1, _PTX_FULL2, _PTX_FULL3 = [tl.constexpr(_unpack_ptx(p, True)) for p in range(4)]


@triton.jit
def _to_f16(codes, BIAS: tl.constexpr):
    """Integer codes in [0, 15] -> fp16: 1024 + code by bit pattern (BIAS) or code by conversion."""
    if BIAS:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return codes.to(tl.float16)


@triton.jit
def _plane(raw, P: tl.constexpr):
    """Codes of plane P (bits 2P and 2P + 1) of packed bytes, as int32 in [0, 3]."""
    return (raw.to(tl.int32) >> (2 * P)) & 3


@triton.jit
def _ptx(raw, hraw, ASM: tl.constexpr, HIGH: tl.constexpr):
    if HIGH:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r,r", [raw, hraw], dtype=tl.float16, is_pure=True, pack=4)
    return tl.inline_asm_elementwise(ASM, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _ptx_plane(raw, hraw, P: tl.constexpr, HIGH: tl.constexpr):
    """fp16 1024 + code of plane P of the bytes raw (| the high bits of hraw << 2), four at a time."""
    if P == 0:
        return _ptx(raw, hraw, _PTX_FULL0 if HIGH else _PTX_LOW0, HIGH)
    elif P == 1:
        return _ptx(raw, hraw, _PTX_FULL1 if HIGH else _PTX_LOW1, HIGH)
    elif P == 2:
        return _ptx(raw, hraw, _PTX_FULL2 if HIGH else _PTX_LOW2, HIGH)
    return _ptx(raw, hraw, _PTX_FULL3 if HIGH else _PTX_LOW3, HIGH)


@triton.jit
def _plane_f16(raw, P: tl.constexpr, BIAS: tl.constexpr):
    """Plane P of packed bytes as fp16 operands: codes (BIAS 0), or 1024 + code built per element
    (BIAS 1) or four codes at a time in PTX (BIAS 2, CUDA only)."""
    if BIAS == 2:
        return _ptx_plane(raw, raw, P, False)
    return _to_f16(_plane(raw, P), BIAS)


def _scaled_ptx(plane: int) -> str:
    """PTX for two codes widened to 16 bits each ($1) -> the fp16 bit patterns of 1024 + 4^plane x
    code ($0): plane `plane`'s two bits masked where they lie, under the exponent of 1024. One
    instruction for two codes."""
    mask = 0x00030003 << (2 * plane)
    return f"lop3.b32 $0, $1, {mask:#010x}, 0x64006400, 0xea;"  # (a & b) | c


_SCALED0, _SCALED1, _SCALED2, _SCALED3 = [tl.constexpr(_scaled_ptx(p)) for p in range(4)]


@triton.jit
def _widen(raw, BIAS: tl.constexpr):
    """Packed bytes -> int16, zero-extended: in PTX two byte permutes for four bytes (BIAS 2), where
    the compiler's own conversion spends three instructions on two."""
    if BIAS == 2:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, $2, z, 0x4140; prmt.b32 $1, $2, z, 0x4342; }",
            "=r,=r,r", [raw], dtype=tl.int16, is_pure=True, pack=4)
    return raw.to(tl.int16)


@triton.jit
def _plane_asm(x, P: tl.constexpr, A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
               DTYPE: tl.constexpr, PACK: tl.constexpr):
    """x through the one-register PTX of plane P (A0..A3: one string per plane, chosen at compile
    time), PACK elements a register, results of type DTYPE."""
    if P == 0:
        asm: tl.constexpr = A0
    elif P == 1:
        asm: tl.constexpr = A1
    elif P == 2:
        asm: tl.constexpr = A2
    else:
        asm: tl.constexpr = A3
    return tl.inline_asm_elementwise(asm, "=r,r", [x], dtype=DTYPE.value, is_pure=True, pack=PACK)


@triton.jit
def _scaled_plane(wide, P: tl.constexpr, BIAS: tl.constexpr):
    """Plane P of packed bytes widened to int16 (`wide`), as the fp16 numbers 1024 + 4^P x code:
    the plane's bits are masked in place, not shifted down (the 4^P is taken out after the dot).
    BIAS 2: two codes per instruction in PTX (CUDA only); else element by element."""
    if BIAS == 2:
        return _plane_asm(wide, P, _SCALED0, _SCALED1, _SCALED2, _SCALED3, tl.float16, 2)
    return ((wide & (3 << (2 * P))) | 0x6400).to(tl.float16, bitcast=True)


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
def _value_plane(raw, hraw, P: tl.constexpr, V4: tl.constexpr, BIAS: tl.constexpr):
    if BIAS == 2:
        return _ptx_plane(raw, hraw, P, V4)
    c = _plane(raw, P)
    if V4:
        c = c | (_plane(hraw, P) << 2)
    return _to_f16(c, BIAS)


@triton.jit
def _page_values_part(p, a0, a1, a2, a3, shift, VL, VH, VSC, VZ, vbase, sbase, sVLt, sVLc, T: tl.constexpr,
                      D: tl.constexpr, G: tl.constexpr, V4: tl.constexpr, BIAS: tl.constexpr):
    """Add p [R, G/4] (the probabilities of tokens T*G/4 ..) times those tokens' values of one head
    of a value page to the channel-plane accumulators a0..a3 [R, D/4]; per-token scales folded
    into p, the zero (and bias) terms into the tile shift [R, G/4] (summed over its columns once, at
    the end: a row sum per page and quarter would cost shuffles across lanes)."""
    G4: tl.constexpr = G // 4
    D4: tl.constexpr = D // 4
    t = T * G4 + tl.arange(0, G4)
    vs = tl.load(VSC + sbase + t).to(tl.float32)
    vz = tl.load(VZ + sbase + t).to(tl.float32)
    pw = (p * vs[None, :]).to(tl.float16)
    shift += p * vz[None, :]
    if BIAS:
        shift -= 1024.0 * pw.to(tl.float32)
    offs = vbase + t[:, None] * sVLt + tl.arange(0, D4)[None, :] * sVLc
    raw = tl.load(VL + offs)
    hraw = raw
    if V4:
        hraw = tl.load(VH + offs)
    a0 = tl.dot(pw, _value_plane(raw, hraw, 0, V4, BIAS), a0)
    a1 = tl.dot(pw, _value_plane(raw, hraw, 1, V4, BIAS), a1)
    a2 = tl.dot(pw, _value_plane(raw, hraw, 2, V4, BIAS), a2)
    a3 = tl.dot(pw, _value_plane(raw, hraw, 3, V4, BIAS), a3)
    return a0, a1, a2, a3, shift


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


# The int8 key dots (`key_dots="int8"`): a plane's codes become int8 operands with one 32-bit
# instruction or two per four codes, where the fp16 planes take one per two (after two byte permutes
# per four), and each dot covers 32 channels, where an fp16 dot covers 16. A plane's two bits are
# masked where they lie (weight 1) or in the next pair up (weight 4), shifted first where they lie
# too high: the int8 operands stay below 64, non-negative. The high plane's codes land one pair above
# the dense plane's weight: x 4, the high bits' weight, with no multiply after the dot.
#   (right shift, mask) for the dense plane P, and for the high plane P (negative: left shift)
_KEY8_DENSE = ((0, 0x03), (0, 0x0C), (4, 0x03), (4, 0x0C))
_KEY8_HIGH = ((-2, 0x0C), (-2, 0x30), (2, 0x0C), (2, 0x30))


def _key8_ptx(shift: int, mask: int) -> str:
    """PTX for four packed bytes ($1) -> four int8 codes ($0): shifted, then masked in every byte."""
    mask = mask * 0x01010101
    if shift == 0:
        return f"and.b32 $0, $1, {mask:#010x};"
    op = "shr" if shift > 0 else "shl"
    return f"{{ .reg .b32 t; {op}.b32 t, $1, {abs(shift)}; and.b32 $0, t, {mask:#010x}; }}"


_K8D0, _K8D1, _K8D2, _K8D3 = [tl.constexpr(_key8_ptx(*sm)) for sm in _KEY8_DENSE]
_K8H0, _K8H1, _K8H2, _K8H3 = [tl.constexpr(_key8_ptx(*sm)) for sm in _KEY8_HIGH]


@triton.jit
def _key8_plane(raw, P: tl.constexpr, HIGH: tl.constexpr, BIAS: tl.constexpr):
    """Plane P of packed key bytes as int8 codes at the weight `_KEY8_DENSE` / `_KEY8_HIGH` give.
    BIAS 2: four codes per one or two PTX instructions (CUDA only); else element by element."""
    if BIAS == 2:
        if HIGH:
            return _plane_asm(raw, P, _K8H0, _K8H1, _K8H2, _K8H3, tl.int8, 4)
        return _plane_asm(raw, P, _K8D0, _K8D1, _K8D2, _K8D3, tl.int8, 4)
    w = raw.to(tl.int32)
    if HIGH:
        if P < 2:
            w = (w << 2) & (0x0C << (2 * P))
        else:
            w = (w >> 2) & (0x0C << (2 * (P - 2)))
    else:
        w = (w >> (4 * (P // 2))) & (0x03 << (2 * (P % 2)))
    return w.to(tl.int8)


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
def _value_scaled_plane(wide, hwide, P: tl.constexpr, V4: tl.constexpr, BIAS: tl.constexpr):
    if V4:  # 1024 + 4^P x (low + 4 high): at most 1024 + 64 x 15, still exact
        m: tl.constexpr = 3 << (2 * P)
        return ((wide & m) | ((hwide & m) << 2) | 0x6400).to(tl.float16, bitcast=True)
    return _scaled_plane(wide, P, BIAS)


@triton.jit
def _page_values_s(p, vs, vz, a0, a1, a2, a3, zt, bt, raw, hraw, V4: tl.constexpr, BIAS: tl.constexpr,
                   HOLD_P: tl.constexpr):
    """Add p [G/4, R] (probabilities of a quarter's tokens) times their values to the channel-plane
    accumulators a0..a3 [D/4, R] (raw, hraw: the quarter's value bytes [D/4, G/4]). Accumulator P
    gathers 4^P x the weighted codes plus 1024 x the weights: the per-token scales vs are folded
    into the weights, and the zero terms (zt) and weights (bt) are kept as [G/4, R] tiles for the
    end of the loop. HOLD_P (a diagnostic, wrong outputs): the dots take a constant operand instead
    of the weights, which spares the weights' move from the scores' layout (rows split across the
    warps by token) into the dots' operand layout (every token in each warp)."""
    pw = (p * vs[:, None]).to(tl.float16)
    zt += p * vz[:, None]
    bt += pw.to(tl.float32)
    if HOLD_P:
        pw = tl.full(pw.shape, 1.0, tl.float16)
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
def _exp2(x, FTZ: tl.constexpr):
    """2^x; FTZ (CUDA): one `ex2.approx.ftz`, where `tl.exp2` guards against results below 2^-126
    with a compare and two multiplies (a probability that small is 0 either way)."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.exp2(x)


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
def _kv_tile(X, base, s_t, count, T: tl.constexpr, D: tl.constexpr):
    """Tokens [T, D] of an FP16 buffer from base (token stride s_t), rows >= count zero, as a dot
    operand (`_operand`)."""
    t = tl.arange(0, T)
    d = tl.arange(0, D)
    return _operand(tl.load(X + base + t[:, None] * s_t + d[None, :], mask=(t < count)[:, None], other=0.0), X)


@triton.jit
def _fp16_tile(X, base, s_t, count, T: tl.constexpr, D: tl.constexpr):
    """`_kv_tile` in fp16 (the unfused kernels' operands)."""
    return _kv_tile(X, base, s_t, count, T, D).to(tl.float16)


@triton.jit
def _fp16_part_scores(q16, X, base, s_t, count, T: tl.constexpr, G4: tl.constexpr, D: tl.constexpr):
    """Scores [R, G/4] of FP16 keys T*G/4 .. (T+1)*G/4 - 1 of a slot (rows >= count: -inf)."""
    s = tl.dot(q16, tl.trans(_fp16_tile(X, base + T * G4 * s_t, s_t, count - T * G4, G4, D)))
    return _mask_part(s, count, T, G4)


@triton.jit
def _kv_part_scores(qn, scaling, X, base, s_t, count, T: tl.constexpr, G4: tl.constexpr, D: tl.constexpr):
    """Scores [R, G/4] of FP16 keys T*G/4 .. (T+1)*G/4 - 1 of a slot (rows >= count: -inf) for the
    unscaled queries qn (`_operand`)."""
    s = tl.dot(qn, tl.trans(_kv_tile(X, base + T * G4 * s_t, s_t, count - T * G4, G4, D)))
    return _mask_part(s * scaling, count, T, G4)


@triton.jit
def _mask_part(s, count, T: tl.constexpr, G4: tl.constexpr):
    return tl.where((T * G4 + tl.arange(0, G4) < count)[None, :], s, float("-inf"))


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


# ---------------------------------------------------------------------------------------------------
# fused


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
    KD, KH, KC, KSC, KZ, sKDp, sKDh, sKDd, sKDg, sKHp, sKHh, sKHr, sKHg, sKCp, sKCh, sKSp, sKSh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVLc, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    M, L, ACC, sMb, sMh, sAb, sAh, sAc,
    scaling,
    KN, sKNb, sKNh, VN, sVNb, sVNh, W, sW,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, V4: tl.constexpr,
    PPP: tl.constexpr, NT: tl.constexpr, BIAS: tl.constexpr, ABLATE: tl.constexpr, NEW: tl.constexpr,
):
    """Chunk 0: the FP16 sink; chunk c in 1 .. NT: slot n_vp + c - 1, values from the FP16 window.
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
    # the FP16 keys' dots take the queries as they are (their scaling after the dot) and in the
    # buffers' dtype: bf16 tiles need no conversion; the packed keys take them pre-scaled, fp32
    qraw = tl.load(QG + tl.arange(0, D)[None, :], mask=qkeep, other=0.0)
    q = qraw.to(tl.float32) * scaling
    qn = _operand(qraw, KS)
    n = tl.load(LENS + b)
    n_vp = tl.load(NVP + b)
    if NEW:
        if (chunk > 0) & (n_vp + chunk - 1 == (n - 1 - S) // G):  # the new token is in this slot
            dd = tl.arange(0, D)
            tl.store(KB + b * sKBb + h * sKBh + tl.load(W + b) * sKBt + dd,
                     tl.load(KN + b * sKNb + h * sKNh + dd).to(KB.dtype.element_ty))
            tl.store(VW + b * sVWb + h * sVWh + tl.load(W + sW + b) * sVWt + dd,
                     tl.load(VN + b * sVNb + h * sVNh + dd).to(VW.dtype.element_ty))
            tl.debug_barrier()
    m_i = tl.full((REP_P,), float("-inf"), tl.float32)
    l_i = tl.zeros((REP_P,), tl.float32)
    acc = tl.zeros((REP_P, D), tl.float32)
    if chunk == 0:  # the sink
        n_sink = tl.minimum(n, S)
        base = b * sSb + h * sSh
        s = tl.dot(qn, tl.trans(_kv_tile(KS, base, sSt, n_sink, S_P, D))) * scaling
        s = tl.where((tl.arange(0, S_P) < n_sink)[None, :], s, float("-inf"))
        live = n_sink > 0
        m_i, l_i, acc, p = _online_update(m_i, l_i, acc, s)
        acc += tl.dot(_operand(p, VS), _kv_tile(VS, base, sSt, n_sink, S_P, D))
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
                s0 = _mask_part(s0, count, 0, G4)
                s1 = _mask_part(s1, count, 1, G4)
                s2 = _mask_part(s2, count, 2, G4)
                s3 = _mask_part(s3, count, 3, G4)
            else:
                kb = b * sKBb + h * sKBh
                s0 = _kv_part_scores(qn, scaling, KB, kb, sKBt, count, 0, G4, D)
                s1 = _kv_part_scores(qn, scaling, KB, kb, sKBt, count, 1, G4, D)
                s2 = _kv_part_scores(qn, scaling, KB, kb, sKBt, count, 2, G4, D)
                s3 = _kv_part_scores(qn, scaling, KB, kb, sKBt, count, 3, G4, D)
            m_i, lt, alpha, p0, p1, p2, p3 = _online_update4(m_i, tl.zeros((REP_P, G4), tl.float32), s0, s1, s2, s3)
            l_i = tl.sum(lt, 1)
            vw = b * sVWb + h * sVWh + (chunk - 1) * G * sVWt
            acc = acc * alpha
            acc = tl.dot(_operand(p0, VW), _kv_tile(VW, vw, sVWt, count, G4, D), acc)
            acc = tl.dot(_operand(p1, VW), _kv_tile(VW, vw + G4 * sVWt, sVWt, count - G4, G4, D), acc)
            acc = tl.dot(_operand(p2, VW), _kv_tile(VW, vw + 2 * G4 * sVWt, sVWt, count - 2 * G4, G4, D), acc)
            acc = tl.dot(_operand(p3, VW), _kv_tile(VW, vw + 3 * G4 * sVWt, sVWt, count - 3 * G4, G4, D), acc)
    _store_partial(M, L, ACC, sMb, sMh, sAb, sAh, sAc, b, h, chunk, m_i, l_i, acc, live, REP, REP_P, D)


@triton.jit
def _decode_pages_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KD, KH, KC, KSC, KZ, sKDp, sKDh, sKDd, sKDg, sKHp, sKHh, sKHr, sKHg, sKCp, sKCh, sKSp, sKSh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVLc, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    M, L, ACC, sMb, sMh, sAb, sAh, sAc,
    scaling,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, V4: tl.constexpr,
    PPP: tl.constexpr, NT: tl.constexpr, BIAS: tl.constexpr, ABLATE: tl.constexpr, KEY8: tl.constexpr,
):
    """PPP page slots whose keys and values are both packed, from slot program_id(1) * PPP, into
    partial NT + 1 + program_id(1). ABLATE (diagnostics for `bench kernels --ablate`, 0 in use):
    1 keys only, 2 plain loads of the packed planes (no unpacking, no dots), 3 the value dots on a
    constant operand instead of the probabilities (`_page_values_s`)."""
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
    first = chunk * PPP
    # the run's page ids in one load, ahead of the page loop (no table round trip per page)
    slots = tl.arange(0, PPP)
    kpages = tl.load(KT + b * sKT + first + slots, mask=first + slots < n_vp, other=0)
    vpages = tl.load(VT + b * sVT + first + slots, mask=first + slots < n_vp, other=0)
    if first < n_vp:
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
        if ABLATE == 2:
            kseen = tl.zeros((G4, D), tl.int32)
            vseen = tl.zeros((D4, G), tl.int32)
        # Small per-page loads are issued early: each page's boost index one page ahead, the boosted
        # queries it selects and the page's value scales at the top of its iteration, so that their
        # latency overlaps work instead of stalling it (the planes are pipelined by Triton).
        ch = tl.zeros((NB_P,), tl.int32)
        if NB > 0:
            ch = _boost_index(KC, _pick(kpages, slots, 0) * sKCp + h * sKCh, NB, NB_P)
        # as many iterations as the run has live slots: a grid that spans the cache's capacity (one
        # CUDA graph for every length) then costs a short sequence only its dead programs' exits
        for i in range(0, tl.minimum(n_vp - first, PPP)):
            kpage = _pick(kpages, slots, i)
            vpage = _pick(vpages, slots, i)
            if ABLATE == 2:  # diagnostic: the same planes, plain loads
                kraw = tl.load(KD + kpage * sKDp + h * sKDh + g[:, None] * sKDg + d[None, :] * sKDd)
                vraw = tl.load(VL + vpage * sVLp + h * sVLh + c[:, None] * sVLc + tl.arange(0, G)[None, :] * sVLt)
                kseen += kraw.to(tl.int32)  # element-wise: no reduction per page
                vseen += vraw.to(tl.int32)
            else:
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
                m_i, lt, alpha, p0, p1, p2, p3 = _online_update4_t(m_i, lt, s0, s1, s2, s3, BIAS == 2)
                a0 = a0 * alpha
                a1 = a1 * alpha
                a2 = a2 * alpha
                a3 = a3 * alpha
                zt = zt * alpha
                bt = bt * alpha
                if ABLATE == 0 or ABLATE == 3:  # this page's values, a quarter of tokens at a time
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
                    a0, a1, a2, a3, zt, bt = _page_values_s(p0, vs0, vz0, a0, a1, a2, a3, zt, bt, vr0, vh0, V4,
                                                            BIAS, ABLATE == 3)
                    a0, a1, a2, a3, zt, bt = _page_values_s(p1, vs1, vz1, a0, a1, a2, a3, zt, bt, vr1, vh1, V4,
                                                            BIAS, ABLATE == 3)
                    a0, a1, a2, a3, zt, bt = _page_values_s(p2, vs2, vz2, a0, a1, a2, a3, zt, bt, vr2, vh2, V4,
                                                            BIAS, ABLATE == 3)
                    a0, a1, a2, a3, zt, bt = _page_values_s(p3, vs3, vz3, a0, a1, a2, a3, zt, bt, vr3, vh3, V4,
                                                            BIAS, ABLATE == 3)
                ch = ch_next
        l_i += tl.sum(lt, 0)
        if ABLATE == 2:
            l_i += (tl.sum(tl.sum(kseen, 1), 0) + tl.sum(tl.sum(vseen, 1), 0)).to(tl.float32)
        # accumulator P holds 4^P x the weighted codes + 1024 x the weights
        zs = tl.sum(zt, 0)[None, :]
        bs = 1024.0 * tl.sum(bt, 0)[None, :]
        acc = _cat4(tl.trans(a0 - bs + zs), tl.trans((a1 - bs) * 0.25 + zs), tl.trans((a2 - bs) * 0.0625 + zs),
                    tl.trans((a3 - bs) * 0.015625 + zs))
    _store_partial(M, L, ACC, sMb, sMh, sAb, sAh, sAc, b, h, NT + 1 + chunk, m_i * 0.6931471805599453, l_i, acc,
                   first < n_vp, REP, REP_P, D)


@triton.jit
def _combine_kernel(M, L, ACC, O, sMb, sMh, sAb, sAh, sAc, sOb, sOh, C, LSE,
                    HQ: tl.constexpr, C_P: tl.constexpr, D: tl.constexpr, WITH_LSE: tl.constexpr):
    """Merge the C partial softmaxes of each (sequence, query head): the chunks' outputs weighted by
    their sums, rescaled to a common max. C is a runtime value (only its power-of-two bound C_P is
    compiled in): it grows by one every few pages of a generation. WITH_LSE: the log of the whole
    softmax denominator as well, LSE [B * HQ] (to merge this attention with attention elsewhere)."""
    pid = tl.program_id(0)
    b = pid // HQ
    hq = pid % HQ
    c = tl.arange(0, C_P)
    d = tl.arange(0, D)
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
        tl.store(LSE + pid, tl.max(m, 0) + tl.log(tl.sum(w, 0)))


def _tail_slots(config) -> int:
    """Page slots the FP16 value window can span: it holds at most R + G tokens, aligned to pages."""
    return -(-(config.local_window + config.group_size) // config.group_size)


def _check(layer, query, cuda: bool):
    d, g, rep = layer.head_dim, layer.config.group_size, query.shape[1] // layer.heads
    least = 64 if cuda else 4  # tensor-core dots take planes >= 16 wide; the interpreter any
    if g & (g - 1) or d & (d - 1) or min(g, d) < least:
        raise ValueError(f"the kernels need power-of-two group and head sizes >= {least}, got G={g}, D={d}")
    if rep > 64:
        raise ValueError(f"at most 64 query heads per KV head, got {rep}")


# page kernel register cap by query-tile rows (REP_P) for a grid of few waves: 128 at 4 rows ran
# fastest on an H200 (`bench kernels --sweep`; it spills a few registers in the loop, which measured
# faster than 160 or no cap); 192 is the least that keeps the page loop of 8 rows free of spills on
# sm_90, and 16 rows need every register (`python -m kernels.compile --q-heads 64` / `128`)
REGISTER_CAP = {4: 128, 8: 192}
# ... and for a deep grid (at least DEEP_WAVES waves of programs at DEEP's occupancy): a third
# pipeline stage (two pages in flight) and the 168 registers that keep that loop free of spills, at
# 6 programs an SM instead of 8. On an H200 the fused step ran 1.03-1.06x faster so at batch 489
# (0.6K-8.4K tokens) and 1.005-1.03x at 64 x 8K, and 3-10% slower on grids of one or two waves
# (8 x 32K)
DEEP = {4: (3, 168)}
DEEP_WAVES = 2.5


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200, for compiling without a GPU


def launch_plan(pairs: int, slots: int, rep_p: int, sms: int) -> tuple[int, int, int | None]:
    """(pages per program, pipeline stages, register cap) of the page kernel for `pairs` (sequence,
    KV head) runs of up to `slots` packed pages each, on `sms` SMs. Deep grids take DEEP's settings
    and as many pages per program (up to 32) as still leave DEEP_WAVES waves of programs: fewer
    partials to write and combine. Other grids keep two stages and REGISTER_CAP, with up to 16 pages
    a program and about 4 programs an SM."""
    if rep_p in DEEP:
        stages, cap = DEEP[rep_p]
        resident = sms * (65536 // (64 * cap))  # programs of two warps an SM's registers hold
        for ppp in (32, 16):
            if pairs * -(-slots // ppp) >= DEEP_WAVES * resident:
                return ppp, stages, cap
    ppp = 1 << (max(1, min(16, pairs * slots // (4 * sms))).bit_length() - 1)
    return ppp, 2, REGISTER_CAP.get(rep_p)


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


KEY_DOTS = ("fp16", "int8")  # the page kernel's key dots (`_page_scores_s`, `_page_scores_i8`)
# head sizes from which the key dots are int8 by default. On an H200 (kitty-pro, bf16, one layer's
# fused step from a CUDA graph) int8 took 3-7% off the step at head size 128 (the page kernel 7-9%:
# 64 x 8192 and 489 x 608-8672 tokens) and was 7-21% slower at head size 64 (64 x 2048, 256 x 4096),
# where the query's rounding is a larger share of a page's work
INT8_KEY_DOTS_FROM = 128


def key_dots_of(key_dots: str | None, head_dim: int) -> str:
    """The page kernel's key dots: `key_dots` checked, or the default for the head size."""
    if key_dots is None:
        return "int8" if head_dim >= INT8_KEY_DOTS_FROM else "fp16"
    if key_dots not in KEY_DOTS:
        raise ValueError(f"key_dots must be one of {', '.join(KEY_DOTS)}, got {key_dots!r}")
    return key_dots


def _kernel_args(layer, st):
    kp, vp = st["k_pages"], st["v_pages"]
    ks, vs, kb, vw = st["k_sink"], st["v_sink"], st["k_buffer"], st["v_window"]
    return (
        ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        kb, kb.stride(0), kb.stride(1), kb.stride(2),
        vw, vw.stride(0), vw.stride(1), vw.stride(2),
        kp["dense"], kp["high"], kp["boost_ch"], kp["scale"], kp["zero"],
        *kp["dense"].stride(), *kp["high"].stride(),
        kp["boost_ch"].stride(0), kp["boost_ch"].stride(1), kp["scale"].stride(0), kp["scale"].stride(1),
        vp["low"], vp["high"], vp["scale"], vp["zero"],
        *vp["low"].stride(), vp["scale"].stride(0), vp["scale"].stride(1),
        st["k_table"], st["v_table"], st["k_table"].stride(0), st["v_table"].stride(0),
        st["lens"], st["n_kpages"], st["n_vpages"],
    )


def _constants(layer, query):
    c, rep = layer.config, query.shape[1] // layer.heads
    return dict(HKV=layer.heads, REP=rep, REP_P=max(4, triton.next_power_of_2(rep)), D=layer.head_dim,
                G=c.group_size, S=c.sink, S_P=max(16, triton.next_power_of_2(max(c.sink, 1))),
                NB=layer.n_boost, NB_P=max(16, triton.next_power_of_2(max(layer.n_boost, 1))),
                V4=c.value_bits == 4)


def decode_launches(layer, query: torch.Tensor, scaling: float, workspace: dict | None = None,
                    state: dict | None = None, pages_per_program: int | None = None, num_warps: int = 2,
                    num_stages: int | None = None, unpack: str | None = None, ablate: int = 0,
                    max_registers: int | str | None = "auto", cuda: bool | None = None, new: tuple | None = None,
                    lse: torch.Tensor | None = None, key_dots: str | None = None):
    """The fused step as kernel launches: ([(kernel, grid, args, options), ...], output tensor).
    `cuda` (default: where the query is) picks the CUDA code paths; `kernels.compile` builds the
    launches for a CUDA target on a machine without a GPU. `new`: see `decode_attention`. `lse`: a
    float32 tensor of B x Hq elements the combine fills with each row's log-sum-exp. `key_dots`: the
    page kernel's key dots, "fp16" (`_page_scores_s`) or "int8" (`_page_scores_i8`: the query rounded
    to 8 bits per page and head); None: int8 for head sizes of at least `INT8_KEY_DOTS_FROM`."""
    cuda = query.is_cuda if cuda is None else cuda
    _check(layer, query, cuda)
    st = state if state is not None else layer.kernel_state()
    b, hq, _, d = query.shape
    slots, nt = st["max_slots"], _tail_slots(layer.config)
    shape = _constants(layer, query)
    plan = launch_plan(b * layer.heads, slots, shape["REP_P"], _sm_count(query.device) if cuda else 132)
    ppp = pages_per_program or plan[0]
    if ppp & (ppp - 1):
        raise ValueError(f"pages_per_program must be a power of two, got {ppp}")
    n_chunks = 1 + nt + -(-slots // ppp)
    q = query[:, :, 0]
    ws = workspace if workspace is not None else {}
    m, l, acc = _partials(ws, b, hq, n_chunks, d, query.dtype, q.device)
    args = (q, q.stride(0), q.stride(1), *_kernel_args(layer, st),
            m, l, acc, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), scaling)
    consts = dict(**shape, PPP=ppp, NT=nt, BIAS=_bias(unpack, cuda), ABLATE=ablate)
    # the tail and the pages are two launches: the FP16 sink and tail would otherwise size every page
    # program's registers and shared memory, and so how many of them an SM holds. They share no
    # output, and `decode_attention` runs them side by side (the tail on a second stream): the tail's
    # short programs fill the SMs that the page grid's last wave leaves idle
    pages = dict(consts, KEY8=int(key_dots_of(key_dots, d) == "int8"), num_warps=num_warps,
                 num_stages=num_stages or plan[1])
    if pages["KEY8"] and cuda:  # an int8 dot takes 32 channels at a time: the high plane's rows too
        pages["NB_P"] = max(32, pages["NB_P"])
    if max_registers == "auto":
        max_registers = plan[2]
    if max_registers and cuda:
        pages["maxnreg"] = max_registers
    out = torch.empty((b, hq, 1, d), device=q.device, dtype=query.dtype)
    if new is None:
        kn = vn = q  # not read
        write = st["lens"][None]
    else:
        kn, vn, write = _new_token(layer, new, b)
    fresh = (kn, kn.stride(0), kn.stride(1), vn, vn.stride(0), vn.stride(1), write, write.stride(0))
    c_p = triton.next_power_of_2(n_chunks)
    return [
        # PPP and ABLATE are not read by the tail kernel
        (_decode_tail_kernel, (b * layer.heads, 1 + nt), args + fresh,
         dict(consts, PPP=1, ABLATE=0, NEW=int(new is not None))),
        (_decode_pages_kernel, (b * layer.heads, n_chunks - 1 - nt), args, pages),
        (_combine_kernel, (b * hq,), (m, l, acc, out, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1),
                                      acc.stride(2), out.stride(0), out.stride(1), n_chunks,
                                      m if lse is None else lse),
         dict(HQ=hq, C_P=c_p, D=d, WITH_LSE=lse is not None, num_warps=combine_warps(c_p))),
    ], out


def _partials(ws: dict, b: int, hq: int, n_chunks: int, d: int, dtype, device):
    """The chunks' partial softmax state (max, sum, output) in workspace `ws`, allocated on a new shape."""
    if ws.get("shape") != (b, hq, n_chunks, d, dtype):
        ws.update(shape=(b, hq, n_chunks, d, dtype),
                  m=torch.empty((b, hq, n_chunks), device=device, dtype=torch.float32),
                  l=torch.empty((b, hq, n_chunks), device=device, dtype=torch.float32),
                  acc=torch.empty((b, hq, n_chunks, d), device=device, dtype=partial_dtype(dtype)))
    return ws["m"], ws["l"], ws["acc"]


def step_workspace(layer, q_heads: int, workspace: dict) -> list[torch.Tensor]:
    """Allocate in `workspace` the partials that decode steps from device counters will use (grids
    over the layer's capacity, queries in the layer's dtype), before any graph is captured: a graph
    must not keep tensors it allocated while recording. Returns them."""
    rep_p = max(4, triton.next_power_of_2(q_heads // layer.heads))
    slots = layer.capacity_slots()
    cuda = layer.device.type == "cuda"
    ppp = launch_plan(layer.batch * layer.heads, slots, rep_p, _sm_count(layer.device) if cuda else 132)[0]
    n_chunks = 1 + _tail_slots(layer.config) + -(-slots // ppp)
    return list(_partials(workspace, layer.batch, q_heads, n_chunks, layer.head_dim, layer.dtype, layer.device))


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the chunks' outputs are kept in between the decode kernels and the combine: the
    model's own for bf16/fp16 (as the output itself will be), else fp32. Each chunk's output is
    rounded once more than a merge in fp32 would round it; at batch 489 and 4,704 tokens (Qwen3-8B
    attention) the partials are ~5% of the step's memory traffic, and this halves them."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def combine_warps(c_p: int) -> int:
    """Warps of a combining program for C_P partials: one up to 16 (a [16, 128] fp32 tile is 64
    values a thread), so that an SM holds many of these short, latency-bound programs; more for
    long sequences' many partials. On an H200, one warp instead of four made the combine 3x faster
    at batch 489 (0.017 ms vs 0.052) and four were still the fastest at 131 partials."""
    return 1 if c_p <= 16 else 2 if c_p <= 32 else 4


def _new_token(layer, new: tuple, batch: int):
    """(keys [B, H, D], values [B, H, D], write positions [2, B]) of a step's token, checked."""
    k, v, write = new
    want = (batch, layer.heads, 1, layer.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or tuple(write.shape) != (2, batch):
        raise ValueError(f"new=(keys, values, positions) must be {want}, {want} and (2, {batch}); got "
                         f"{tuple(k.shape)}, {tuple(v.shape)} and {tuple(write.shape)}")
    k, v = k[:, :, 0], v[:, :, 0]
    return (k if k.stride(-1) == 1 else k.contiguous()), (v if v.stride(-1) == 1 else v.contiguous()), write


def decode_attention(layer, query: torch.Tensor, scaling: float, workspace: dict | None = None,
                     state: dict | None = None, pages_per_program: int | None = None, num_warps: int = 2,
                     num_stages: int | None = None, unpack: str | None = None, ablate: int = 0,
                     max_registers: int | str | None = "auto", new: tuple | None = None,
                     return_lse: bool = False, key_dots: str | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per sequence over a Kitty layer's state, fused.

    query [B, Hq, 1, D] -> [B, Hq, 1, D]. The layer must already hold the new token (FP16), unless
    `new` = (keys [B, H, 1, D], values [B, H, 1, D], positions [2, B]) brings it: the layer's counts
    include it, and the tail kernel writes it into the key q-buffer and the value window at those
    positions as it attends (a step from device counters: `KittyLayer.steps.write`), which spares
    the step two indexed copies.
    `state` is `layer.kernel_state()` (built here if not given); `workspace` keeps the partials.
    `return_lse`: also return each row's log-sum-exp of its scores, [B, Hq] float32 (to merge this
    attention over the layer's state with attention over other keys: `prefill_attention`).
    Launch settings (page kernel): two warps per program (faster than one or four on an H200);
    pages per program, pipeline stages and the register cap from `launch_plan` unless given: for
    GQA groups of 4, deep grids (batch x KV heads x page slots of at least 2.5 waves of programs)
    run three stages at 168 registers and up to 32 pages a program, others two stages at 128 and
    up to 16 (`python -m kitty_core.bench kernels --sweep`). `max_registers`: "auto", a number, or
    None. On a GPU the tail kernel runs on a second stream, concurrently with the page kernel, and
    the combine waits for both: on an H200 (graph replays of one layer's step) that and the one-warp
    combine made the step 1.12x faster at batch 64 and 8K tokens and 1.05-1.15x at batch 489.
    """
    lse = torch.empty(query.shape[:2], device=query.device, dtype=torch.float32) if return_lse else None
    (tail, pages, combine), out = decode_launches(layer, query, scaling, workspace, state, pages_per_program,
                                                  num_warps, num_stages, unpack, ablate, max_registers, new=new,
                                                  lse=lse, key_dots=key_dots)
    if query.is_cuda:  # the tail beside the pages, on a second stream: see `decode_launches`
        main, side = torch.cuda.current_stream(query.device), _side_stream(query.device)
        side.wait_stream(main)
        _launch(pages)
        with torch.cuda.stream(side):
            _launch(tail)
        main.wait_stream(side)
    else:
        _launch(tail)
        _launch(pages)
    _launch(combine)
    return (out, lse) if return_lse else out


class DecodeStep:
    """`decode_attention` of steps from device counters (`new` given), planned once: such steps
    launch the same kernels with the same arguments but for the query, the step's token and the
    output, so the launches are built on the first call and replayed with those (`plan.Launch`),
    rebuilt only when the query's shape, strides or dtype change. The layer's state must not move
    meanwhile (its pools and tables are reserved while steps run from device counters)."""

    def __init__(self, layer, workspace: dict, key_dots: str | None = None):
        self.layer, self.workspace, self.key_dots = layer, workspace, key_dots
        self.key, self.launches = None, None

    def __call__(self, query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                 scaling: float) -> torch.Tensor:
        """query [B, Hq, 1, D], key_new and value_new [B, H, 1, D] -> [B, Hq, 1, D]."""
        q, kn, vn = query[:, :, 0], key_new[:, :, 0], value_new[:, :, 0]
        key = (query.shape, query.dtype, q.stride(), kn.stride(), vn.stride(), scaling)
        if key != self.key or kn.stride(-1) != 1 or vn.stride(-1) != 1:
            (tail, pages, combine), out = decode_launches(self.layer, query, scaling, self.workspace,
                                                          new=(key_new, value_new, self.layer.steps.write),
                                                          key_dots=self.key_dots)
            n = len(pages[2])  # the tail's arguments are the pages' and the token's
            self.launches = (Launch(*tail, slots=(0, n, n + 3)), Launch(*pages, slots=(0,)),
                             Launch(*combine, slots=(3,)))
            self.key, kn, vn = key, tail[2][n], tail[2][n + 3]
        else:
            out = torch.empty(query.shape, device=query.device, dtype=query.dtype)  # as decode_launches makes it
        tail, pages, combine = self.launches
        if query.is_cuda:  # as decode_attention: the tail beside the pages, on a second stream
            main, side = torch.cuda.current_stream(query.device), _side_stream(query.device)
            side.wait_stream(main)
            pages.run(q)
            tail.run(q, kn, vn, stream=side)
            main.wait_stream(side)
        else:
            tail.run(q, kn, vn)
            pages.run(q)
        combine.run(out)
        return out


def _launch(launch) -> None:
    kernel, grid, args, options = launch
    kernel[grid](*args, **options)


def _prefill_tokens_per_launch(rep: int) -> int:
    """Chunk tokens per decode-kernel launch in `prefill_attention`: up to 16 query rows a GQA group
    (at 32 or 64 the page kernel spills: on sm_90 ptxas makes 498 spill instructions of 32 rows,
    `python -m kernels.compile --q-heads 256`)."""
    return max(1, 16 // rep)


def prefill_launches(rep: int, tokens: int) -> int:
    """Decode-kernel launches `prefill_attention` makes a layer for a chunk of `tokens` tokens and
    GQA groups of `rep` query heads."""
    return -(-tokens // _prefill_tokens_per_launch(rep))


def prefill_attention(layer, query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                      scaling: float, key_dots: str | None = None) -> torch.Tensor:
    """Causal attention of a chunk of new tokens over a Kitty layer's state and over the chunk itself:
    query [B, Hq, t, D], key_new and value_new [B, H, t, D] (the chunk, not yet in the layer) ->
    [B, Hq, t, D] in the query's dtype. For a prompt prefilled in chunks, with no padding.

    The history is read where it lies, packed, by the decode kernels: the chunk's t tokens are t more
    query rows of each GQA group (up to 16 rows a launch, so a long chunk takes several launches),
    and the combine returns each row's log-sum-exp. `_chunk_self_kernel` then attends each token to
    the chunk's own (FP16) keys, causal, and merges the two softmaxes by their log-sum-exps, in one
    pass that writes the output. Neither the history's dense FP16 copy nor its memory is needed.
    `key_dots`: see `decode_launches`."""
    b, hq, t, d = query.shape
    h = layer.heads
    rep = hq // h
    per = _prefill_tokens_per_launch(rep)
    past = torch.empty_like(query)
    past_lse = torch.empty((b, hq, t), device=query.device, dtype=torch.float32)
    state = layer.kernel_state()
    for i in range(0, t, per):
        rows = query[:, :, i : i + per]
        n = rows.shape[2]
        o, lse = decode_attention(layer, rows.contiguous().view(b, hq * n, 1, d), scaling, state=state,
                                  return_lse=True, key_dots=key_dots)
        past[:, :, i : i + n] = o.view(b, hq, n, d)
        past_lse[:, :, i : i + n] = lse.view(b, hq, n)
    return chunk_self_attention(query, key_new, value_new, past, past_lse, scaling)


def chunk_self_attention(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor, past: torch.Tensor,
                         past_lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """Each of a chunk's tokens attends to the chunk's keys up to itself, and the result is merged
    with its attention elsewhere (`past` [B, Hq, t, D], with the log-sum-exps `past_lse` [B, Hq, t] of
    its scores): query [B, Hq, t, D], key_new / value_new [B, H, t, D] -> [B, Hq, t, D] in the query's
    dtype. `_chunk_self_kernel`; `chunk_self_attention_reference` is the same in PyTorch."""
    b, hq, t, d = query.shape
    h = key_new.shape[1]
    rep = hq // h
    rep_p = max(1, triton.next_power_of_2(rep))
    least = 16 if query.is_cuda else 1  # tensor-core dots take tiles of at least 16 rows and columns
    bt = max(1, min(triton.next_power_of_2(t), 64 // rep_p))  # chunk tokens a program: up to 64 rows
    bt = max(bt, -(-least // rep_p))
    bk = max(least, min(32, triton.next_power_of_2(t)))
    out = torch.empty_like(query)
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (key_new, value_new))
    _chunk_self_kernel[(b * h, triton.cdiv(t, bt))](
        query, *query.stride(), k, *k.stride(), v, *v.stride(), past, *past.stride(), past_lse, *past_lse.stride(),
        out, *out.stride(), t, scaling,
        H=h, REP=rep, REP_P=rep_p, D=d, BT=bt, BK=bk, num_warps=4)
    return out


@triton.jit
def _chunk_self_kernel(Q, sQb, sQh, sQt, sQd, K, sKb, sKh, sKt, sKd, V, sVb, sVh, sVt, sVd,
                       P, sPb, sPh, sPt, sPd, PL, sLb, sLh, sLt, O, sOb, sOh, sOt, sOd, T, scaling,
                       H: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr):
    """Program (sequence x KV head, block of BT chunk tokens): rows (query head j, token i) of the
    GQA group, REP_P x BT of them. A causal online softmax over the chunk's keys in blocks of BK, in
    float32 (the scores' dots exact products of the model's dtype, the values' dots fp32 operands at
    three tf32 passes' precision), then merged with the row's softmax elsewhere (P, PL): each side
    weighted by its share of the joint denominator."""
    R: tl.constexpr = REP_P * BT
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    t0 = tl.program_id(1) * BT
    r = tl.arange(0, R)
    j = r // BT  # query head within the group
    i = t0 + r % BT  # chunk token
    real = (j < REP) & (i < T)
    heads = h * REP + j
    d = tl.arange(0, D)
    q = tl.load(Q + b * sQb + heads[:, None] * sQh + i[:, None] * sQt + d[None, :] * sQd, mask=real[:, None], other=0.0)
    m = tl.full((R,), float("-inf"), tl.float32)
    l = tl.zeros((R,), tl.float32)
    acc = tl.zeros((R, D), tl.float32)
    kv = b * sKb + h * sKh
    for k0 in range(0, tl.minimum(t0 + BT, T), BK):
        kt = k0 + tl.arange(0, BK)
        keys = tl.load(K + kv + kt[:, None] * sKt + d[None, :] * sKd, mask=(kt < T)[:, None], other=0.0)
        vals = tl.load(V + b * sVb + h * sVh + kt[:, None] * sVt + d[None, :] * sVd, mask=(kt < T)[:, None],
                       other=0.0)
        if Q.dtype.element_ty == tl.float32:
            s = tl.dot(q, tl.trans(keys), input_precision="tf32x3")
        else:
            s = tl.dot(q, tl.trans(keys.to(Q.dtype.element_ty)))
        s = tl.where((kt[None, :] <= i[:, None]) & (kt < T)[None, :], s * scaling, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = tl.dot(p, vals.to(tl.float32), acc * alpha[:, None], input_precision="tf32x3")
        m = m_new
    own_lse = m + tl.log(tl.where(l > 0, l, 1.0))
    past_lse = tl.load(PL + b * sLb + heads * sLh + i * sLt, mask=real, other=float("-inf"))
    top = tl.maximum(past_lse, own_lse)
    w_past = tl.exp(past_lse - top)
    w_own = tl.exp(own_lse - top)
    past = tl.load(P + b * sPb + heads[:, None] * sPh + i[:, None] * sPt + d[None, :] * sPd, mask=real[:, None],
                   other=0.0)
    own = acc / tl.where(l > 0, l, 1.0)[:, None]
    o = (past.to(tl.float32) * w_past[:, None] + own * w_own[:, None]) / (w_past + w_own)[:, None]
    tl.store(O + b * sOb + heads[:, None] * sOh + i[:, None] * sOt + d[None, :] * sOd, o.to(O.dtype.element_ty),
             mask=real[:, None])


def chunk_self_attention_reference(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                                   past: torch.Tensor, past_lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """`chunk_self_attention` in PyTorch, float32."""
    b, hq, t, d = query.shape
    h = key_new.shape[1]
    q = query.float().view(b, h, hq // h, t, d)
    scores = (q @ key_new.float()[:, :, None].transpose(-1, -2)) * scaling
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    own = (torch.exp(scores - lse[..., None]) @ value_new.float()[:, :, None]).view(b, hq, t, d)
    lse = lse.view(b, hq, t)
    top = torch.maximum(past_lse, lse)
    w_past, w_own = torch.exp(past_lse - top)[..., None], torch.exp(lse - top)[..., None]
    return ((past.float() * w_past + own * w_own) / (w_past + w_own)).to(query.dtype)


@functools.lru_cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a device's tail kernels run on, beside the page kernel (one per device: a graph
    capture forks to it and joins it back like any other work)."""
    return torch.cuda.Stream(device)


# ---------------------------------------------------------------------------------------------------
# unfused: qk -> memory -> softmax -> memory -> sv


@triton.jit
def _qk_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KD, KH, KC, KSC, KZ, sKDp, sKDh, sKDd, sKDg, sKHp, sKHh, sKHr, sKHg, sKCp, sKCh, sKSp, sKSh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVLc, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    SC, sSCb, sSCh,
    scaling,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, V4: tl.constexpr,
    BIAS: tl.constexpr,
):
    """Scores of slot program_id(1) - 1 (-1: the sink) into SC [B, Hq, S + slots * G], -inf if empty."""
    pid = tl.program_id(0)
    slot = tl.program_id(1) - 1
    b = pid // HKV
    h = pid % HKV
    heads = h * REP + tl.arange(0, REP_P)
    QG, keep = _query_rows(Q, sQb, sQh, b, h, REP, REP_P)
    q = _query_tile(QG, keep, scaling, D)
    n = tl.load(LENS + b)
    row = SC + b * sSCb + heads[:, None] * sSCh
    if slot < 0:
        n_sink = tl.minimum(n, S)
        ts = tl.arange(0, S_P)
        s_sink = tl.dot(q.to(tl.float16), tl.trans(_fp16_tile(KS, b * sSb + h * sSh, sSt, n_sink, S_P, D)))
        s_sink = tl.where((ts < n_sink)[None, :], s_sink, float("-inf"))
        tl.store(row + ts[None, :], s_sink, mask=keep & (ts < S)[None, :])
    else:
        G4: tl.constexpr = G // 4
        count = tl.minimum(n - (S + slot * G), G)
        row = row + S + slot * G
        if slot < tl.load(NKP + b):
            page = tl.load(KT + b * sKT + slot)
            s0, s1, s2, s3 = _page_scores(q, QG, keep, scaling, KD, KH, KC, KSC, KZ, page * sKDp + h * sKDh,
                                          page * sKHp + h * sKHh, page * sKSp + h * sKSh, page * sKCp + h * sKCh,
                                          sKDd, sKDg, sKHr, sKHg, D, G, NB, NB_P, BIAS)
        else:
            kb = b * sKBb + h * sKBh
            q16 = q.to(tl.float16)
            s0 = _fp16_part_scores(q16, KB, kb, sKBt, count, 0, G4, D)
            s1 = _fp16_part_scores(q16, KB, kb, sKBt, count, 1, G4, D)
            s2 = _fp16_part_scores(q16, KB, kb, sKBt, count, 2, G4, D)
            s3 = _fp16_part_scores(q16, KB, kb, sKBt, count, 3, G4, D)
        t = tl.arange(0, G4)[None, :]
        tl.store(row + t, _mask_part(s0, count, 0, G4), mask=keep)
        tl.store(row + G4 + t, _mask_part(s1, count, 1, G4), mask=keep)
        tl.store(row + 2 * G4 + t, _mask_part(s2, count, 2, G4), mask=keep)
        tl.store(row + 3 * G4 + t, _mask_part(s3, count, 3, G4), mask=keep)


@triton.jit
def _sv_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KD, KH, KC, KSC, KZ, sKDp, sKDh, sKDd, sKDg, sKHp, sKHh, sKHr, sKHg, sKCp, sKCh, sKSp, sKSh,
    VL, VH, VSC, VZ, sVLp, sVLh, sVLt, sVLc, sVSp, sVSh,
    KT, VT, sKT, sVT,
    LENS, NKP, NVP,
    P, sPb, sPh, OUT, sOb, sOh, sOc,
    HKV: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    S: tl.constexpr, S_P: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, V4: tl.constexpr,
    BIAS: tl.constexpr,
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
            row = row + S + slot * G
            if slot < n_vp:
                G4: tl.constexpr = G // 4
                D4: tl.constexpr = D // 4
                page = tl.load(VT + b * sVT + slot)
                vbase = page * sVLp + h * sVLh
                sbase = page * sVSp + h * sVSh
                tq = tl.arange(0, G4)[None, :]
                a0 = tl.zeros((REP_P, D4), tl.float32)
                a1 = tl.zeros((REP_P, D4), tl.float32)
                a2 = tl.zeros((REP_P, D4), tl.float32)
                a3 = tl.zeros((REP_P, D4), tl.float32)
                shift = tl.zeros((REP_P, G4), tl.float32)
                pq = tl.load(row + tq, mask=keep, other=0.0)
                a0, a1, a2, a3, shift = _page_values_part(pq, a0, a1, a2, a3, shift, VL, VH, VSC, VZ, vbase, sbase,
                                                          sVLt, sVLc, 0, D, G, V4, BIAS)
                pq = tl.load(row + G4 + tq, mask=keep, other=0.0)
                a0, a1, a2, a3, shift = _page_values_part(pq, a0, a1, a2, a3, shift, VL, VH, VSC, VZ, vbase, sbase,
                                                          sVLt, sVLc, 1, D, G, V4, BIAS)
                pq = tl.load(row + 2 * G4 + tq, mask=keep, other=0.0)
                a0, a1, a2, a3, shift = _page_values_part(pq, a0, a1, a2, a3, shift, VL, VH, VSC, VZ, vbase, sbase,
                                                          sVLt, sVLc, 2, D, G, V4, BIAS)
                pq = tl.load(row + 3 * G4 + tq, mask=keep, other=0.0)
                a0, a1, a2, a3, shift = _page_values_part(pq, a0, a1, a2, a3, shift, VL, VH, VSC, VZ, vbase, sbase,
                                                          sVLt, sVLc, 3, D, G, V4, BIAS)
                acc = _cat4(a0, a1, a2, a3) + tl.sum(shift, 1)[:, None]
            else:
                t = tl.arange(0, G)
                p = tl.load(row + t[None, :], mask=keep & (t < count)[None, :], other=0.0)
                vw = _fp16_tile(VW, b * sVWb + h * sVWh + (slot - n_vp) * G * sVWt, sVWt, count, G, D)
                acc = tl.dot(p.to(tl.float16), vw)
    tl.store(OUT + b * sOb + heads[:, None] * sOh + (slot + 1) * sOc + d[None, :], acc, mask=keep)


def decode_attention_unfused(layer, query: torch.Tensor, scaling: float, state: dict | None = None,
                             num_warps: int = 4, unpack: str | None = None) -> torch.Tensor:
    """The same attention as the paper runs it: scores to memory, torch softmax, weighted values."""
    _check(layer, query, query.is_cuda)
    st = state if state is not None else layer.kernel_state()
    b, hq, _, d = query.shape
    c, slots = layer.config, st["max_slots"]
    q = query[:, :, 0]
    scores = torch.empty((b, hq, c.sink + slots * c.group_size), device=q.device, dtype=torch.float32)
    args, consts, bias = _kernel_args(layer, st), _constants(layer, query), _bias(unpack, q.is_cuda)
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
    from kitty_core.cache import PagePool
    from kitty_core.quant import KeyPages

    keys = isinstance(pages, KeyPages)
    # code planes with any strides (a page pool stores them transposed); the rest with unit last strides
    pages = type(pages)(**{k: v if k in PagePool.PLANES else v.contiguous() for k, v in vars(pages).items()})
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


__all__ = ["decode_attention", "decode_launches", "decode_attention_unfused", "decode_attention_reference",
           "dequantize_pages", "prefill_attention", "chunk_self_attention", "chunk_self_attention_reference"]
