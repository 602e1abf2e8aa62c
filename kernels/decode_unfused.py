"""Decode attention as the paper runs it, unfused: a qk kernel writes every score of a Kitty layer's
state to memory, torch takes the softmax, an sv kernel reads the probabilities back (partials summed
by torch). Grid: (sequence x KV head, slot). Not used by the engine: `bench kernels` times it as the
paper-style baseline beside the fused step (`decode.decode_attention`), and the tests hold it to the
same reference. Values are read as the keys (`state`): a [G/4, D/4] byte tile per token quarter, one
dot per channel plane into four accumulators [heads, D/4].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ptx import _value_plane
from .state import (PagedLayer, _bias, _cat4, _check, _constants, _kernel_args, _kv_scales, _kv_tile, _mask_part,
                    _page_scores, _query_rows, _query_tile)


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
def _fp16_tile(X, XS, base, s_t, count, T: tl.constexpr, D: tl.constexpr):
    """`_kv_tile` in fp16 (the unfused kernels' operands); an 8-bit tail's dequantized."""
    x = _kv_tile(X, base, s_t, count, T, D, 0)
    if X.dtype.element_ty == tl.int8:
        x = x.to(tl.float32) * _kv_scales(X, XS, base, s_t, count, T, D)[:, None]
    return x.to(tl.float16)


@triton.jit
def _fp16_part_scores(q16, X, XS, base, s_t, count, T: tl.constexpr, G4: tl.constexpr, D: tl.constexpr):
    """Scores [R, G/4] of FP16 keys T*G/4 .. (T+1)*G/4 - 1 of a slot (rows >= count: -inf)."""
    s = tl.dot(q16, tl.trans(_fp16_tile(X, XS, base + T * G4 * s_t, s_t, count - T * G4, G4, D)))
    return _mask_part(s, count, T, G4)


@triton.jit
def _qk_kernel(
    Q, sQb, sQh,
    KS, VS, sSb, sSh, sSt,
    KB, sKBb, sKBh, sKBt,
    VW, sVWb, sVWh, sVWt,
    KSS, VSS, KBS, VWS,
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
        s_sink = tl.dot(q.to(tl.float16), tl.trans(_fp16_tile(KS, KSS, b * sSb + h * sSh, sSt, n_sink, S_P, D)))
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
            s0 = _fp16_part_scores(q16, KB, KBS, kb, sKBt, count, 0, G4, D)
            s1 = _fp16_part_scores(q16, KB, KBS, kb, sKBt, count, 1, G4, D)
            s2 = _fp16_part_scores(q16, KB, KBS, kb, sKBt, count, 2, G4, D)
            s3 = _fp16_part_scores(q16, KB, KBS, kb, sKBt, count, 3, G4, D)
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
    KSS, VSS, KBS, VWS,
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
        acc = tl.dot(p_sink.to(tl.float16), _fp16_tile(VS, VSS, b * sSb + h * sSh, sSt, n_sink, S_P, D))
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
                vw = _fp16_tile(VW, VWS, b * sVWb + h * sVWh + (slot - n_vp) * G * sVWt, sVWt, count, G, D)
                acc = tl.dot(p.to(tl.float16), vw)
    tl.store(OUT + b * sOb + heads[:, None] * sOh + (slot + 1) * sOc + d[None, :], acc, mask=keep)


def decode_attention_unfused(layer: PagedLayer, query: torch.Tensor, scaling: float, state: dict | None = None,
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
