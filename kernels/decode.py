"""Decode attention over a Kitty layer: packed pages + FP16 sink, key q-buffer and value window.

`decode_attention` is one attention step (one new query token per sequence), fused: one split-KV
pass (flash-decoding) whose kernels are in `decode_fused`: a tail kernel (the FP16 sink and the
slots of the value window), a page kernel (the fully packed page slots, several a program) and a
combine of their partial softmaxes. Here: how the step is launched (`launch_plan`, `decode_launches`),
its workspace, and steps from device counters planned once (`DecodeStep`). On a GPU the tail kernel
runs on a second stream beside the pages kernel (they share no output).
`softcap`: Gemma 2's attention logit softcapping, scores -> softcap x tanh(scores / softcap).

The other decode paths: `decode_unfused` (the paper's qk -> softmax -> sv, a baseline for
`bench kernels`), `prefill` (a chunk of new tokens over the pages), `dequant` (Algorithm 1).
`decode_attention_reference` is the same attention in PyTorch.
"""

from __future__ import annotations

import functools

import torch
import triton

from .decode_fused import _combine_kernel, _decode_pages_kernel, _decode_tail_kernel
from .plan import Launch
from .state import PagedLayer, _bias, _check, _constants, _kernel_args


def _tail_slots(config) -> int:
    """Page slots the FP16 value window can span: it holds at most R + G tokens, aligned to pages."""
    return -(-(config.local_window + config.group_size) // config.group_size)


# page kernel register cap by query-tile rows (REP_P) for a grid of few waves: 128 at 4 rows ran
# fastest on an H200 (`bench kernels --sweep`; it spills a few registers in the loop, which measured
# faster than 160 or no cap); 192 is the least that keeps the page loop of 8 rows free of spills on
# sm_90, and 16 rows need every register (`python -m kitty_core.compile --q-heads 64` / `128`)
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


# The combine is launched as a programmatic dependent of the kernel before it where the GPU has it
# (compute capability 9.0: Hopper and later): it may be scheduled before the page grid ends, and waits
# in `gdc_wait` for the partials. The CUDA page kernel lets dependents launch as its blocks start. On
# one H100 this took the combine alone from 3.0-3.6 to 2.5-3.3 us and the step 0.7-1.5% (`docs/engine.md`).
COMBINE_PDL = True


@functools.lru_cache
def _dependent_launch(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)


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


def _softcap_of(softcap: float | None) -> float:
    """The kernels' SOFTCAP constant: the cap as a float, 0.0 for none."""
    if not softcap:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    return float(softcap)


def decode_launches(layer: PagedLayer, query: torch.Tensor, scaling: float, workspace: dict | None = None,
                    state: dict | None = None, pages_per_program: int | None = None, num_warps: int = 2,
                    num_stages: int | None = None, unpack: str | None = None,
                    max_registers: int | str | None = "auto", cuda: bool | None = None, new: tuple | None = None,
                    lse: torch.Tensor | None = None, key_dots: str | None = None, softcap: float | None = None):
    """The fused step as kernel launches: ([(kernel, grid, args, options), ...], output tensor).
    `cuda` (default: where the query is) picks the CUDA code paths; `kitty_core.compile` builds the
    launches for a CUDA target on a machine without a GPU. `new`: see `decode_attention`. `lse`: a
    float32 tensor of B x Hq elements the combine fills with each row's log-sum-exp. `key_dots`: the
    page kernel's key dots, "fp16" (`_page_scores_s`) or "int8" (`_page_scores_i8`: the query rounded
    to 8 bits per page and head); None: int8 for head sizes of at least `INT8_KEY_DOTS_FROM`. `softcap`:
    see `decode_attention`."""
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
    consts = dict(**shape, NT=nt, BIAS=_bias(unpack, cuda), SOFTCAP=_softcap_of(softcap))
    # the tail and the pages are two launches: the FP16 sink and tail would otherwise size every page
    # program's registers and shared memory, and so how many of them an SM holds. They share no
    # output, and `decode_attention` runs them side by side (the tail on a second stream): the tail's
    # short programs fill the SMs that the page grid's last wave leaves idle
    pages = dict(consts, PPP=ppp, KEY8=int(key_dots_of(key_dots, d) == "int8"), num_warps=num_warps,
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
    block_d, combine_warps = combine_plan(c_p, d)
    pdl = COMBINE_PDL and cuda and _dependent_launch(q.device)
    return [
        (_decode_tail_kernel, (b * layer.heads, 1 + nt), args + fresh, dict(consts, NEW=int(new is not None))),
        (_decode_pages_kernel, (b * layer.heads, n_chunks - 1 - nt), args, pages),
        (_combine_kernel, (b * hq, d // block_d), (m, l, acc, out, m.stride(0), m.stride(1), acc.stride(0),
                                                   acc.stride(1), acc.stride(2), out.stride(0), out.stride(1),
                                                   n_chunks, m if lse is None else lse),
         dict(HQ=hq, C_P=c_p, BLOCK_D=block_d, WITH_LSE=lse is not None, num_warps=combine_warps, GDC=pdl,
              **({"launch_pdl": True} if pdl else {}))),
    ], out


def _partials(ws: dict, b: int, hq: int, n_chunks: int, d: int, dtype, device):
    """The chunks' partial softmax state (max, sum, output) in workspace `ws`, allocated on a new shape."""
    if ws.get("shape") != (b, hq, n_chunks, d, dtype):
        ws.update(shape=(b, hq, n_chunks, d, dtype),
                  m=torch.empty((b, hq, n_chunks), device=device, dtype=torch.float32),
                  l=torch.empty((b, hq, n_chunks), device=device, dtype=torch.float32),
                  acc=torch.empty((b, hq, n_chunks, d), device=device, dtype=partial_dtype(dtype)))
    return ws["m"], ws["l"], ws["acc"]


def step_workspace(layer: PagedLayer, q_heads: int, workspace: dict) -> list[torch.Tensor]:
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


# The combine's tile: at most this many (partial, channel) values a warp, 64 a thread
COMBINE_TILE = 2048


def combine_plan(c_p: int, d: int) -> tuple[int, int]:
    """(channels a program, warps a program) of the combine for C_P partials of D channels. A row's
    D channels are split over programs of at most COMBINE_TILE values a warp, at least 16 channels
    each: up to 16 partials (deep grids) a row is one program of one warp, as many as an SM holds of
    these short, latency-bound programs (on an H200 one warp instead of four made the combine 3x
    faster at batch 489: 0.017 ms vs 0.052); long sequences' many partials spread over more programs
    instead of into one program's registers (1 x 131,072 tokens: 256 partials a row, 32 rows)."""
    block_d = min(d, max(16, COMBINE_TILE // c_p))
    return block_d, max(1, c_p * block_d // COMBINE_TILE)


def _new_token(layer, new: tuple, batch: int):
    """(keys [B, H, D], values [B, H, D], write positions [2, B]) of a step's token, checked."""
    k, v, write = new
    want = (batch, layer.heads, 1, layer.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or tuple(write.shape) != (2, batch):
        raise ValueError(f"new=(keys, values, positions) must be {want}, {want} and (2, {batch}); got "
                         f"{tuple(k.shape)}, {tuple(v.shape)} and {tuple(write.shape)}")
    k, v = k[:, :, 0], v[:, :, 0]
    return (k if k.stride(-1) == 1 else k.contiguous()), (v if v.stride(-1) == 1 else v.contiguous()), write


def decode_attention(layer: PagedLayer, query: torch.Tensor, scaling: float, workspace: dict | None = None,
                     state: dict | None = None, pages_per_program: int | None = None, num_warps: int = 2,
                     num_stages: int | None = None, unpack: str | None = None,
                     max_registers: int | str | None = "auto", new: tuple | None = None,
                     return_lse: bool = False, key_dots: str | None = None, softcap: float | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per sequence over a Kitty layer's state, fused.

    query [B, Hq, 1, D] -> [B, Hq, 1, D]. The layer must already hold the new token (FP16), unless
    `new` = (keys [B, H, 1, D], values [B, H, 1, D], positions [2, B]) brings it: the layer's counts
    include it, and the tail kernel writes it into the key q-buffer and the value window at those
    positions as it attends (a step from device counters: `KittyLayer.steps.write`), which spares
    the step two indexed copies.
    `state` is `layer.kernel_state()` (built here if not given); `workspace` keeps the partials.
    `return_lse`: also return each row's log-sum-exp of its scores, [B, Hq] float32 (to merge this
    attention over the layer's state with attention over other keys: `prefill.prefill_attention`).
    `softcap`: the model's attention logit softcap (Gemma 2's `attn_logit_softcapping`; None or 0:
    none): every score s becomes softcap x tanh(s / softcap) before the softmax.
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
                                                  num_warps, num_stages, unpack, max_registers, new=new,
                                                  lse=lse, key_dots=key_dots, softcap=softcap)
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

    def __init__(self, layer: PagedLayer, workspace: dict, key_dots: str | None = None, softcap: float | None = None):
        self.layer, self.workspace, self.key_dots, self.softcap = layer, workspace, key_dots, softcap
        self.key, self.launches = None, None

    def __call__(self, query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                 scaling: float) -> torch.Tensor:
        """query [B, Hq, 1, D], key_new and value_new [B, H, 1, D] -> [B, Hq, 1, D]."""
        q, kn, vn = query[:, :, 0], key_new[:, :, 0], value_new[:, :, 0]
        key = (query.shape, query.dtype, q.stride(), kn.stride(), vn.stride(), scaling)
        if key != self.key or kn.stride(-1) != 1 or vn.stride(-1) != 1:
            (tail, pages, combine), out = decode_launches(self.layer, query, scaling, self.workspace,
                                                          new=(key_new, value_new, self.layer.steps.write),
                                                          key_dots=self.key_dots, softcap=self.softcap)
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


@functools.lru_cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a device's tail kernels run on, beside the page kernel (one per device: a graph
    capture forks to it and joins it back like any other work)."""
    return torch.cuda.Stream(device)


def decode_attention_reference(layer: PagedLayer, query: torch.Tensor, scaling: float, softcap: float | None = None
                               ) -> torch.Tensor:
    """The same attention in PyTorch: per sequence, the dequantized history, softmax (of softcapped
    scores, with `softcap`), values."""
    b, hq, _, d = query.shape
    rep = hq // layer.heads
    outs = []
    for i in range(b):
        k, v = layer.sequence_history(i, torch.float32)  # [H, n, D]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        s = query[i, :, 0].float()[:, None] @ k.transpose(-1, -2) * scaling  # [Hq, 1, n]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        p = s.softmax(-1)
        outs.append((p @ v)[:, 0])
    return torch.stack(outs)[:, :, None].to(query.dtype)


__all__ = ["decode_attention", "decode_launches", "DecodeStep", "decode_attention_reference"]
