"""Decode attention alone on one GPU, timed (what `bench kernels` runs): the fused page kernel on a
layer of packed pages against the unfused qk -> softmax -> sv path and SDPA on an FP16 cache of the
same shape, with the bandwidth each implies next to a device-to-device copy; and the variants that
chose the kernel's design: its launch settings (`sweep_launch`), how codes are unpacked
(`unpack_modes`), the CUDA page kernel (`bench_cuda`), each SDPA backend on FP16 (`fp16_attention`)
and packing against decoding (`pack_cost`).

Every figure is measured in one process against a baseline of the same shape: GPU time of
CUDA-graph replays (`graphed`, so that Triton's per-launch host cost does not count), the median of
a run of calls (`cuda_time`), each graph holding STEPS_A_GRAPH calls in a row (`step_ms`). The layers
are synthetic (`synthetic_layer`): random keys with uneven channel scales, the state a decode step
attends over. Qwen3-8B attention shapes by default (32 query heads, 8 KV heads, head size 128, bf16).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from .layer import TAIL_PARTS, KittyLayer
from .reference_engine import ReferenceEngine
from .config import parse_method


# calls of a step a CUDA graph holds where every `bench kernels` table times it (`step_ms`, `bench_cuda`)
STEPS_A_GRAPH = 10


def cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(fn, repeat: int = 1):
    """fn captured `repeat` times in a row in one CUDA graph: replaying it costs the GPU work alone,
    without the host's per-launch cost (Triton's Python launcher takes ~50 us a kernel, more than a
    small call runs). A replay's time still holds the GPU's wait for the graph's launch: on one H200
    an elementwise op timed 10 us as a replay of its own and 1 us a call at 20 calls a graph. A
    layer's attention inside a model's decode graph does not wait for it. A replay's time divided
    by `repeat` is a call's time with that wait spread over `repeat` calls.

    The replay holds fn, and so every tensor its closure holds (inputs, workspaces): the graph keeps
    only raw pointers to them, and memory freed under it goes back to the driver at the next capture
    (`torch.cuda.graph` empties the allocator's cache), after which a replay writes to an unmapped
    address."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()

    def replay() -> None:
        graph.replay()

    replay.fn = fn
    return replay


def step_ms(fn, steps_a_graph: int = STEPS_A_GRAPH, **timing) -> float:
    """Milliseconds of GPU time a call of fn takes: the median replay (`cuda_time`, with `timing`) of a
    CUDA graph of `steps_a_graph` calls in a row (`graphed`), divided among them."""
    return cuda_time(graphed(fn, steps_a_graph), **timing) / steps_a_graph


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time(lambda: y.copy_(x))
    return 2 * nbytes / (ms / 1e3)


def synthetic_layer(method: str, batch: int, length: int, kv_heads: int, head_dim: int, dtype) -> KittyLayer:
    """A layer holding `length` tokens per sequence (random keys with uneven channel scales), the
    last one in the tail and not yet packed: the state a decode step attends over."""
    layer = KittyLayer(parse_method(method), ReferenceEngine())
    empty = torch.zeros(batch, kv_heads, 0, head_dim, device="cuda", dtype=dtype)
    layer.lazy_initialization(empty, empty)
    spread = torch.linspace(0.2, 4.0, head_dim, device="cuda", dtype=dtype)
    # prefill in chunks of up to 2^22 token rows (whole pages) to bound the temporary tensors
    chunk = max(128, min(8192, (1 << 22) // (batch * kv_heads) // 128 * 128))
    for s in range(0, length - 1, chunk):
        n = min(chunk, length - 1 - s)
        k = torch.randn(batch, kv_heads, n, head_dim, device="cuda", dtype=dtype) * spread
        layer.insert(k, torch.randn_like(k))
    k = torch.randn(batch, kv_heads, 1, head_dim, device="cuda", dtype=dtype) * spread
    layer.insert(k, torch.randn_like(k), pack=False)
    return layer


def grid_state(layer: KittyLayer, grid_tokens: int | None = None) -> dict:
    """The layer's kernel state, its grid (`max_slots`) sized for sequences of `grid_tokens` tokens
    as a CUDA graph's step over a cache of that capacity sizes it (None: for what the layer holds)."""
    state = layer.kernel_state()
    if grid_tokens is None:
        return state
    slots = layer.slots_for(grid_tokens)
    if slots < state["max_slots"]:
        raise ValueError(f"a grid for {grid_tokens} tokens ({slots} page slots) is narrower than the "
                         f"{state['max_slots']} slots the sequences hold: give at least their length")
    return dict(state, max_slots=slots)


def fp16_step(batch: int, length: int, q_heads: int, kv_heads: int, head_dim: int, dtype):
    """A decode step over an FP16 cache, random, on the GPU: the query [batch, q_heads, 1, D], the
    keys and values [batch, kv_heads, length, D], and the attention scale 1/sqrt(D)."""
    q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=dtype)
    return q, k, torch.randn_like(k), head_dim**-0.5


def packed_step(shape, boost: float, q_heads: int, kv_heads: int, head_dim: int, dtype, tail_bits: int = 16):
    """A decode step over packed pages: a `synthetic_layer` of kitty at `boost` (its tail `tail_bits`
    wide) holding `shape` (batch, length), a random query [batch, q_heads, 1, D] on the GPU and the
    attention scale."""
    batch, length = shape
    layer = synthetic_layer(f"kitty+boost_rate={boost}+tail_bits={tail_bits}", batch, length, kv_heads, head_dim,
                            dtype)
    return layer, torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=dtype), head_dim**-0.5


def launch_defaults() -> dict:
    """The fused kernel's launch settings a default call uses (recorded beside its timings)."""
    import inspect

    from kernels.decode import DEEP, DEEP_WAVES, INT8_KEY_DOTS_FROM, REGISTER_CAP, combine_plan, decode_attention

    params = inspect.signature(decode_attention).parameters
    return {"num_warps": params["num_warps"].default, "num_stages": 2, "register_cap_by_query_rows": REGISTER_CAP,
            "pages_per_program": "up to 16, by occupancy",
            "deep_grids": {"min_waves": DEEP_WAVES, "stages_and_cap_by_query_rows": DEEP, "pages_per_program": "up to 32"},
            "tail_kernel": "on a second stream, beside the page kernel",
            "combine_channels_and_warps_by_partials": {c: combine_plan(c, 128) for c in (8, 16, 32, 64, 128, 256)},
            "key_dots": f"int8 from head size {INT8_KEY_DOTS_FROM}, fp16 below"}


def bench_kernels(shapes, boosts, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                  key_dots=(None,), progress=None, steps_a_graph=STEPS_A_GRAPH) -> pd.DataFrame:
    """Per shape, boost rate and page-kernel key dots (None: the default): the fused kernel, the
    unfused qk -> softmax -> sv path and SDPA on an FP16 cache of the same shape, timed in this
    process as CUDA-graph replays of `steps_a_graph` calls each (`step_ms`: GPU time; `*_eager_ms`:
    plain calls, host launch cost included);
    bytes the fused kernel must read; the fused output's largest difference from
    `decode_attention_reference`."""
    from kernels.decode import decode_attention, decode_attention_reference, key_dots_of
    from kernels.decode_unfused import decode_attention_unfused

    bw_copy = copy_bandwidth()
    rows = []
    for batch, length in shapes:
        q, k16, v16, scale = fp16_step(batch, length, q_heads, kv_heads, head_dim, dtype)
        sdpa = lambda: F.scaled_dot_product_attention(q, k16, v16, scale=scale, enable_gqa=True)  # noqa: E731
        sdpa_ms, sdpa_eager_ms = step_ms(sdpa, steps_a_graph), cuda_time(sdpa)
        sdpa_bytes = 2 * k16.numel() * k16.element_size()
        del k16, v16, sdpa
        for boost in boosts:
            if progress:
                progress(len(rows) // len(key_dots), len(shapes) * len(boosts), f"{batch}x{length}, boost {boost:g}")
            layer = synthetic_layer(f"kitty+boost_rate={boost}", batch, length, kv_heads, head_dim, dtype)
            state = layer.kernel_state()
            unfused = lambda: decode_attention_unfused(layer, q, scale, state)  # noqa: E731
            unfused_ms = step_ms(unfused, steps_a_graph)
            ref = decode_attention_reference(layer, q, scale).float()
            parts = layer.nbytes()
            read = sum(parts.values()) + q.numel() * q.element_size()
            for dots in key_dots:
                ws = {}
                fused = lambda: decode_attention(layer, q, scale, ws, state, key_dots=dots)  # noqa: E731
                err = (fused().float() - ref).abs().max().item()
                fused_ms, fused_eager_ms = step_ms(fused, steps_a_graph), cuda_time(fused)
                rows.append({
                    "batch": batch, "length": length, "boost_rate": boost, "key_dots": key_dots_of(dots, head_dim),
                    "fused_ms": fused_ms, "unfused_ms": unfused_ms, "sdpa_fp16_ms": sdpa_ms,
                    "fused_vs_sdpa": sdpa_ms / fused_ms, "fused_vs_unfused": unfused_ms / fused_ms,
                    "fused_eager_ms": fused_eager_ms, "sdpa_eager_ms": sdpa_eager_ms,
                    "fused_bytes": read, "fused_TBps": read / fused_ms / 1e9, "sdpa_TBps": sdpa_bytes / sdpa_ms / 1e9,
                    "copy_TBps": bw_copy / 1e12, "fused_max_abs_err": err, "steps_a_graph": steps_a_graph,
                })
                print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1,
                                                        float_format=lambda x: f"{x:.3f}"), flush=True)
                del ws, fused
            del layer, state, unfused, ref
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def _cuda_kernel_for(layer: KittyLayer, q_heads: int, kv_heads: int, head_dim: int, dtype, device,
                     source: Path | None = None) -> None:
    """Build (or load) the CUDA page kernel for `layer` (from `source`, a variant of its source, if
    given); raises where it does not apply."""
    from kernels import cuda_decode

    why = cuda_decode.unsupported(head_dim, layer.config.group_size, layer.n_boost, layer.config.value_bits,
                                  q_heads // kv_heads, dtype, device)
    if why is None:  # `build`'s cache keys its arguments as given: the shipped kernel as every caller asks
        why = cuda_decode.build(layer.n_boost) if source is None else cuda_decode.build(layer.n_boost, source)
    if why:
        raise RuntimeError(f"the CUDA page kernel does not apply{f' ({source})' if source else ''}: {why}")


def source_name(source: Path | None) -> str:
    """A `source` column's entry: the variant's path, or the shipped kernel's."""
    return str(source) if source is not None else "kernels/cuda/decode.cu"


def _cuda_launch(batch: int, kv_heads: int, state: dict, ppp: int | None, stages: int | None) -> dict:
    """The CUDA page launch a setting makes: pages per program and stages (the launch plan's where
    None) and its programs."""
    from kernels import cuda_decode

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    planned_ppp, planned_st = cuda_decode.launch_plan(batch * kv_heads, state["max_slots"], sms, ppp)
    return {"ppp": planned_ppp, "stages": stages or planned_st,
            "programs": batch * kv_heads * -(-state["max_slots"] // planned_ppp)}


def bench_cuda(shapes, boosts, pages_per_program=(None,), stages=(None,), q_heads=32, kv_heads=8, head_dim=128,
               dtype=torch.bfloat16, rounds=5, grid_tokens=None, progress=None, sources=(None,),
               steps_a_graph=STEPS_A_GRAPH, tail_bits=(16,)) -> pd.DataFrame:
    """Per shape, boost rate and tail width (`tail_bits`: 16, the FP16 tail; 8, `tail_bits=8`): the
    fused step with the CUDA page kernel (`kernels.cuda_decode`, per pages-per-program and
    cp.async-stages setting, None: the launch plan's), the Triton fused step and SDPA on an FP16 cache
    forced to cuDNN, as CUDA graphs of `steps_a_graph` calls in a row (`graphed`: a replay's launch
    wait spread over them), timed in `rounds` interleaved rounds (the median of the rounds' medians); the packed bytes each step reads and both outputs'
    largest difference from the reference. `grid_tokens`: both page kernels' grids sized for
    sequences of that many tokens, as the step of a CUDA graph over a cache of that capacity is
    (`KittyLayer.capacity_slots`; None: for the shape's length). cuDNN reads the shape's length.
    Beside them, each CUDA setting's tail kernel alone (the sink, q-buffer and value window, which
    runs beside the page kernel) and the FP16 parts' bytes: its share of the step's time against
    their share of the step's bytes; the Triton tail kernel alone (the Triton step's); and each CUDA
    setting's page kernel and combine alone, which with the tail say where the step's time goes
    (`fp16_bytes`: the tail's, at its width); and each CUDA setting's step with the Triton tail kernel
    beside its page kernel instead (`cuda_triton_tail_ms`). `sources`: the CUDA kernel built from each
    (None: the shipped source; a path: a variant of it), every setting of each timed in the same
    rounds, named in `source`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import cuda_decode
    from kernels.decode import decode_attention, decode_attention_reference, decode_launches

    rows = []
    for batch, length in shapes:
        q, k16, v16, scale = fp16_step(batch, length, q_heads, kv_heads, head_dim, dtype)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k16, v16, scale=scale, enable_gqa=True)

        cudnn_g = graphed(cudnn, steps_a_graph)
        for boost, bits in [(boost, bits) for boost in boosts for bits in tail_bits]:
            if progress:
                per_setting = len(sources) * len(pages_per_program) * len(stages)
                progress(len(rows) // per_setting, len(shapes) * len(boosts) * len(tail_bits),
                         f"{batch}x{length}, boost {boost:g}, tail {bits} bits")
            layer = synthetic_layer(f"kitty+boost_rate={boost}+tail_bits={bits}", batch, length, kv_heads, head_dim,
                                    dtype)
            state = grid_state(layer, grid_tokens)
            for src in sources:
                _cuda_kernel_for(layer, q_heads, kv_heads, head_dim, dtype, q.device, src)
            ref = decode_attention_reference(layer, q, scale).float()
            ws_t = {}
            triton = lambda: decode_attention(layer, q, scale, ws_t, state)  # noqa: E731
            err_t = (triton().float() - ref).abs().max().item()
            tail_k, tail_grid, tail_args, tail_opts = decode_launches(layer, q, scale, {}, state)[0][0]
            tail = lambda: tail_k[tail_grid](*tail_args, **tail_opts)  # noqa: E731
            fns = {"triton": graphed(triton, steps_a_graph), "cudnn": cudnn_g,
                   "triton_tail": graphed(tail, steps_a_graph)}
            errs, runs = {}, [(src, ppp, st) for src in sources for ppp in pages_per_program for st in stages]
            for src, ppp, st in runs:
                ws = {}
                fn = lambda ws=ws, src=src, ppp=ppp, st=st: cuda_decode.decode_attention(  # noqa: E731
                    layer, q, scale, ws, state, ppp, stages=st, source=src)
                errs[src, ppp, st] = (fn().float() - ref).abs().max().item()
                fns[src, ppp, st] = graphed(fn, steps_a_graph)
                # the same step with the Triton tail kernel beside the CUDA page kernel
                fns["triton_tail_step", src, ppp, st] = graphed(
                    lambda ws=ws, src=src, ppp=ppp, st=st: cuda_decode.decode_attention(
                        layer, q, scale, ws, state, ppp, stages=st, source=src, tail="triton"), steps_a_graph)
                # the step's parts alone: the CUDA tail kernel, the page kernel and the combine
                (tail_c, pages, combine), _ = cuda_decode.step_launches(layer, q, scale, ws, state, ppp, stages=st,
                                                                        source=src)
                fns["tail", src, ppp, st] = graphed(tail_c, steps_a_graph)
                fns["pages", src, ppp, st] = graphed(pages, steps_a_graph)
                fns["combine", src, ppp, st] = graphed(combine, steps_a_graph)
            times = {name: [] for name in fns}
            for _ in range(rounds):
                for name, g in fns.items():
                    times[name].append(cuda_time(g, warmup=2, iters=20) / steps_a_graph)
            ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            parts = layer.nbytes()
            read = sum(parts.values()) + q.numel() * q.element_size()
            fp16 = sum(parts[name] for name in TAIL_PARTS)
            for src, ppp, st in runs:
                launch, t = _cuda_launch(batch, kv_heads, state, ppp, st), ms[src, ppp, st]
                rows.append({
                    "batch": batch, "length": length, "grid_tokens": grid_tokens or length, "boost_rate": boost,
                    "tail_bits": bits, "ppp": launch["ppp"], "stages": launch["stages"],
                    "cuda_ms": t, "triton_ms": ms["triton"], "cudnn_ms": ms["cudnn"],
                    "cuda_vs_cudnn": ms["cudnn"] / t, "triton_vs_cudnn": ms["cudnn"] / ms["triton"],
                    "cuda_vs_triton": ms["triton"] / t, "packed_bytes": read,
                    "cuda_TBps": read / t / 1e9, "triton_TBps": read / ms["triton"] / 1e9,
                    "cudnn_TBps": 2 * k16.numel() * k16.element_size() / ms["cudnn"] / 1e9,
                    "tail_ms": ms["tail", src, ppp, st], "tail_time_share": ms["tail", src, ppp, st] / t,
                    "triton_tail_ms": ms["triton_tail"], "cuda_triton_tail_ms": ms["triton_tail_step", src, ppp, st],
                    "cuda_tail_vs_triton_tail": ms["triton_tail_step", src, ppp, st] / t,
                    "pages_ms": ms["pages", src, ppp, st], "combine_ms": ms["combine", src, ppp, st],
                    "fp16_bytes": fp16, "fp16_byte_share": fp16 / read,
                    "cuda_max_abs_err": errs[src, ppp, st], "triton_max_abs_err": err_t,
                    "steps_a_graph": steps_a_graph,
                    **({"source": source_name(src)} if any(sources) else {}),
                })
                print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1,
                                                        float_format=lambda x: f"{x:.3f}"), flush=True)
            del layer, state, fns, ref, triton
            torch.cuda.empty_cache()
        del k16, v16, cudnn_g
    return pd.DataFrame(rows)


def launch_cuda_once(shapes, boosts, pages_per_program=(None,), stages=(None,), q_heads=32, kv_heads=8,
                     head_dim=128, dtype=torch.bfloat16, grid_tokens=None, sources=(None,),
                     tail_bits=(16,)) -> pd.DataFrame:
    """Per shape, boost rate, tail width and launch setting: the fused step with the CUDA page kernel launched
    once, eagerly and untimed, and nothing else that reads pages (no Triton page kernel, no cuDNN):
    a process for a profiler to attach to, `ncu --kernel-name regex:pages_kernel ...` (`docs/engine.md`).
    `sources`, `tail_bits`: as for `bench_cuda`. Returns the launches (shape, boost, tail width, pages
    per program, stages, programs, and the source where variants are given)."""
    from kernels import cuda_decode

    rows = []
    for batch, length in shapes:
        for boost, bits in [(boost, bits) for boost in boosts for bits in tail_bits]:
            layer, q, scale = packed_step((batch, length), boost, q_heads, kv_heads, head_dim, dtype, bits)
            state = grid_state(layer, grid_tokens)
            for src in sources:
                _cuda_kernel_for(layer, q_heads, kv_heads, head_dim, dtype, q.device, src)
                for ppp in pages_per_program:
                    for st in stages:
                        cuda_decode.decode_attention(layer, q, scale, {}, state, ppp, stages=st, source=src)
                        torch.cuda.synchronize()
                        rows.append({"batch": batch, "length": length, "grid_tokens": grid_tokens or length,
                                     "boost_rate": boost, "tail_bits": bits, **_cuda_launch(batch, kv_heads, state, ppp, st),
                                     **({"source": source_name(src)} if any(sources) else {})})
            del layer, state, q
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def sweep_launch(shape, boost=0.25, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                 steps_a_graph=STEPS_A_GRAPH) -> pd.DataFrame:
    """Fused kernel GPU time over launch settings (pages per program, warps, stages, register cap)."""
    from kernels.decode import decode_attention

    batch, length = shape
    layer, q, scale = packed_step(shape, boost, q_heads, kv_heads, head_dim, dtype)
    state, rows = layer.kernel_state(), []
    for ppp in (16, 32):
        for warps in (2, 4):
            for stages in (2, 3):
                for regs in (None, 128, 160):
                    ws = {}
                    ms = step_ms(lambda: decode_attention(layer, q, scale, ws, state, ppp, warps, stages,
                                                          max_registers=regs), steps_a_graph, iters=10)
                    rows.append({"batch": batch, "length": length, "ppp": ppp, "warps": warps, "stages": stages,
                                 "max_registers": regs or "-", "ms": ms})
    return pd.DataFrame(rows).sort_values("ms")


def fp16_attention(shape, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                   steps_a_graph=STEPS_A_GRAPH) -> pd.DataFrame:
    """FP16 decode attention, one shape, on each SDPA backend that runs it, and as the FP16 baseline's
    captured decode step runs it (cuDNN over a window of up to `PreallocatedCache.WINDOW` slots more,
    masked); GPU time of CUDA-graph replays, and the bandwidth each implies (of the used keys and
    values)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .baselines import PreallocatedCache

    batch, length = shape
    q, k, v, scale = fp16_step(batch, length, q_heads, kv_heads, head_dim, dtype)
    nbytes, rows = 2 * k.numel() * k.element_size(), []

    def sdpa_on(backend):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        return run

    variants = [(f"SDPA, {b.name.lower()} backend", sdpa_on(b)) for b in
                (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)]
    w = PreallocatedCache.WINDOW  # as the FP16 baseline's step after `length` tokens reads them (the most unused)
    window = -(-length // w) * w + w
    kw = torch.cat([k, torch.zeros_like(k[:, :, : window - length])], 2)
    vw = torch.cat([v, torch.zeros_like(v[:, :, : window - length])], 2)
    used = (torch.arange(window, device="cuda") < length)[None, None, None]

    def masked():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, kw, vw, attn_mask=used, scale=scale, enable_gqa=True)

    variants.append((f"SDPA, cudnn_attention backend, {window}-slot window, masked", masked))
    for what, fn in variants:
        try:
            ms = step_ms(fn, steps_a_graph)
        except RuntimeError as err:  # a backend that does not take this call here
            rows.append({"batch": batch, "length": length, "attention": what, "ms": None,
                         "note": str(err).splitlines()[0][:80]})
            continue
        rows.append({"batch": batch, "length": length, "attention": what, "ms": ms, "TBps": nbytes / ms / 1e9})
    return pd.DataFrame(rows)


def pack_cost(shape, boost=0.25, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
              steps_a_graph=STEPS_A_GRAPH) -> dict:
    """Packing against decoding, one shape: a page fills every G decode steps, when each sequence
    packs G tokens of keys and values per layer. Share = pack / (G x fused decode step + pack)."""
    from kernels import pack
    from kernels.decode import decode_attention
    from .quant import quantize_keys, quantize_values

    batch, length = shape
    layer, q, scale = packed_step(shape, boost, q_heads, kv_heads, head_dim, dtype)
    state, ws, g = layer.kernel_state(), {}, layer.config.group_size
    fused_ms = step_ms(lambda: decode_attention(layer, q, scale, ws, state), steps_a_graph)
    x = torch.randn(batch, kv_heads, g, head_dim, device="cuda", dtype=dtype) * torch.linspace(
        0.2, 4.0, head_dim, device="cuda", dtype=dtype)
    nb = layer.n_boost
    triton_ms = step_ms(lambda: (pack.quantize_keys(x, nb), pack.quantize_values(x, 2)), steps_a_graph)
    torch_ms = cuda_time(lambda: (quantize_keys(x, nb), quantize_values(x, 2)))
    return {"batch": batch, "length": length, "boost_rate": boost, "fused_ms": fused_ms,
            "pack_triton_ms": triton_ms, "pack_torch_ms": torch_ms,
            "pack_share": triton_ms / (g * fused_ms + triton_ms), "pack_share_torch": torch_ms / (g * fused_ms + torch_ms)}


def unpack_modes(shape, boost=0.25, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                 steps_a_graph=STEPS_A_GRAPH, **launch) -> pd.DataFrame:
    """The fused kernel's GPU time by how codes become operands, one shape: four at a time in PTX,
    element by element, and (in the tail) by int -> fp16 conversions (`decode_attention(unpack=...)`)."""
    from kernels.decode import decode_attention

    batch, length = shape
    layer, q, scale = packed_step(shape, boost, q_heads, kv_heads, head_dim, dtype)
    state, rows = layer.kernel_state(), []
    read = sum(layer.nbytes().values())
    variants = [("full kernel, PTX unpack", {}), ("full kernel, per-element unpack", {"unpack": "bits"}),
                ("full kernel, int->fp16 conversions in the tail (pages: per element)", {"unpack": "convert"})]
    for what, kw in variants:
        ws = {}
        ms = step_ms(lambda: decode_attention(layer, q, scale, ws, state, **kw, **launch), steps_a_graph)
        rows.append({"batch": batch, "length": length, "variant": what, "ms": ms, "TBps_of_cache": read / ms / 1e9})
    return pd.DataFrame(rows)

