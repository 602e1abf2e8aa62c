"""Prefill on the pages: a chunk of new tokens attends to a Kitty layer's packed history through the
decode kernels (`prefill_attention`) and to itself in FP16 (`chunk_self_attention`), the two softmaxes
merged by their log-sum-exps. For a prompt prefilled in chunks: no dense FP16 copy of the history.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import _softcap_of, decode_attention
from .state import PagedLayer, _softcap


def _prefill_tokens_per_launch(rep: int) -> int:
    """Chunk tokens per decode-kernel launch in `prefill_attention`: up to 16 query rows a GQA group
    (at 32 or 64 the page kernel spills: on sm_90 ptxas makes 498 spill instructions of 32 rows,
    `python -m kitty_core.compile --q-heads 256`)."""
    return max(1, 16 // rep)


def prefill_launches(rep: int, tokens: int) -> int:
    """Decode-kernel launches `prefill_attention` makes a layer for a chunk of `tokens` tokens and
    GQA groups of `rep` query heads."""
    return -(-tokens // _prefill_tokens_per_launch(rep))


def prefill_attention(layer: PagedLayer, query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                      scaling: float, key_dots: str | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of a chunk of new tokens over a Kitty layer's state and over the chunk itself:
    query [B, Hq, t, D], key_new and value_new [B, H, t, D] (the chunk, not yet in the layer) ->
    [B, Hq, t, D] in the query's dtype. For a prompt prefilled in chunks, with no padding.

    The history is read where it lies, packed, by the decode kernels: the chunk's t tokens are t more
    query rows of each GQA group (up to 16 rows a launch, so a long chunk takes several launches),
    and the combine returns each row's log-sum-exp. `_chunk_self_kernel` then attends each token to
    the chunk's own (FP16) keys, causal, and merges the two softmaxes by their log-sum-exps, in one
    pass that writes the output. Neither the history's dense FP16 copy nor its memory is needed.
    `key_dots`: see `decode.decode_launches`; `softcap`: see `decode.decode_attention` (both sides
    apply it)."""
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
                                  return_lse=True, key_dots=key_dots, softcap=softcap)
        past[:, :, i : i + n] = o.view(b, hq, n, d)
        past_lse[:, :, i : i + n] = lse.view(b, hq, n)
    return chunk_self_attention(query, key_new, value_new, past, past_lse, scaling, softcap)


def chunk_self_attention(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor, past: torch.Tensor,
                         past_lse: torch.Tensor, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Each of a chunk's tokens attends to the chunk's keys up to itself, and the result is merged
    with its attention elsewhere (`past` [B, Hq, t, D], with the log-sum-exps `past_lse` [B, Hq, t] of
    its scores): query [B, Hq, t, D], key_new / value_new [B, H, t, D] -> [B, Hq, t, D] in the query's
    dtype. `softcap`: the scores' softcap (None: none). `_chunk_self_kernel`;
    `chunk_self_attention_reference` is the same in PyTorch."""
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
        H=h, REP=rep, REP_P=rep_p, D=d, BT=bt, BK=bk, SOFTCAP=_softcap_of(softcap), num_warps=4)
    return out


@triton.jit
def _chunk_self_kernel(Q, sQb, sQh, sQt, sQd, K, sKb, sKh, sKt, sKd, V, sVb, sVh, sVt, sVd,
                       P, sPb, sPh, sPt, sPd, PL, sLb, sLh, sLt, O, sOb, sOh, sOt, sOd, T, scaling,
                       H: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, SOFTCAP: tl.constexpr):
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
        s = _softcap(s * scaling, SOFTCAP, 1.0)
        s = tl.where((kt[None, :] <= i[:, None]) & (kt < T)[None, :], s, float("-inf"))
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
                                   past: torch.Tensor, past_lse: torch.Tensor, scaling: float,
                                   softcap: float | None = None) -> torch.Tensor:
    """`chunk_self_attention` in PyTorch, float32."""
    b, hq, t, d = query.shape
    h = key_new.shape[1]
    q = query.float().view(b, h, hq // h, t, d)
    scores = (q @ key_new.float()[:, :, None].transpose(-1, -2)) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    own = (torch.exp(scores - lse[..., None]) @ value_new.float()[:, :, None]).view(b, hq, t, d)
    lse = lse.view(b, hq, t)
    top = torch.maximum(past_lse, lse)
    w_past, w_own = torch.exp(past_lse - top)[..., None], torch.exp(lse - top)[..., None]
    return ((past.float() * w_past + own * w_own) / (w_past + w_own)).to(query.dtype)
