"""Inline PTX for the decode kernels, each beside the element-wise code that stands in for it (off
CUDA, in Triton's interpreter, or by choice: `decode_attention(unpack=...)`).

Code planes (`kernels/pages.py`): a packed byte holds four 2-bit codes, one per plane; plane P is bits
2P and 2P + 1. Codes become fp16 operands without a conversion instruction: `code | 0x6400` is the
bit pattern of the fp16 number 1024 + code, and the 1024 is taken out after the dot (1024 x the row
sum of the other operand). On CUDA, inline PTX builds these patterns four codes at a time (a shift, a
mask, two byte permutes; `_unpack_ptx`). The fused page kernel leaves a plane's bits where they lie:
bytes widened to 16 bits (two byte permutes per four), `(x & 3 << 2P) | 0x6400` is 1024 + 4^P x code,
exact in fp16, one `lop3` for two codes (`_scaled_plane`). Its int8 key dots take a plane's codes as
int8 operands with one or two 32-bit instructions per four codes (`_key8_plane`).

The kernels' BIAS picks the path: 0 int -> fp16 conversions, 1 the 1024 + code pattern per element,
2 the same in PTX (CUDA only; `state._bias`).
"""

from __future__ import annotations

import triton
import triton.language as tl


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


# int8 codes -> fp16, four a time: the bytes offset by 128 (one xor) land in the low byte of the fp16
# pattern 0x64XX, which is 1024 + code + 128, and one subtraction of 1152 takes the offset out of
# two at once (exact: every number on the way is an integer below 2048).
_INT8_F16 = tl.constexpr(
    "{ .reg .b32 u, c; xor.b32 u, $2, 0x80808080; mov.b32 c, 0x64806480;"
    " prmt.b32 $0, u, 0x64646464, 0x4140; prmt.b32 $1, u, 0x64646464, 0x4342;"
    " sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; }")


@triton.jit
def _int8_f16(codes, BIAS: tl.constexpr):
    """int8 codes -> fp16 (exact): in PTX five instructions for four codes, in the registers the codes
    were loaded into (BIAS 2, CUDA only), or by conversion. Triton moves a conversion of a dot's
    operand, inline PTX included, past the move of the tile to the dot's layout, which for int8
    codes goes one byte a shared-memory load (`LDS.U8`). The PTX is declared impure so that it stays
    where it is written: the tile then moves as fp16, with `ldmatrix`."""
    if BIAS == 2:
        return tl.inline_asm_elementwise(_INT8_F16, "=r,=r,r", [codes], dtype=tl.float16, is_pure=False, pack=4)
    return codes.to(tl.float16)


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
def _value_plane(raw, hraw, P: tl.constexpr, V4: tl.constexpr, BIAS: tl.constexpr):
    if BIAS == 2:
        return _ptx_plane(raw, hraw, P, V4)
    c = _plane(raw, P)
    if V4:
        c = c | (_plane(hraw, P) << 2)
    return _to_f16(c, BIAS)


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
def _value_scaled_plane(wide, hwide, P: tl.constexpr, V4: tl.constexpr, BIAS: tl.constexpr):
    if V4:  # 1024 + 4^P x (low + 4 high): at most 1024 + 64 x 15, still exact
        m: tl.constexpr = 3 << (2 * P)
        return ((wide & m) | ((hwide & m) << 2) | 0x6400).to(tl.float16, bitcast=True)
    return _scaled_plane(wide, P, BIAS)


@triton.jit
def _exp2(x, FTZ: tl.constexpr):
    """2^x; FTZ (CUDA): one `ex2.approx.ftz`, where `tl.exp2` guards against results below 2^-126
    with a compare and two multiplies (a probability that small is 0 either way)."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.exp2(x)
