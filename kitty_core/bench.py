"""Benchmarks (scripts, not tests). Every speed figure is a ratio measured in one run against a
baseline of the same shape.

    python -m kitty_core.bench kernels --shapes 64x8192,8x32768,1x131072 --boost 0,0.125,0.25
    python -m kitty_core.bench e2e --model random:qwen3-8b --prompt 512 --generate 8192 --out e2e.json
    python -m kitty_core.bench profile --caches fp16-prealloc,kitty-pro --batch 64 --length 4096
    python -m kitty_core.bench generate --model random:qwen3-8b --batch 64,8 --calls --second
    python -m kitty_core.bench app      # the lab in chromium: first and later render of every page

`kernels`: decode attention alone (fused, unfused, SDPA on FP16), with the bandwidth it implies next
to a device-to-device copy. `e2e`: a whole model generating (`kitty_core.throughput`): per cache the
largest batch that fits, peak memory, prefill time and decode throughput at that batch and at an
equal batch. `generate`: transformers' `generate` with each cache, compiled and eager, against the
graphed greedy loop (`kitty_core.generate_speed`). `app`: seconds until each page of a freshly started lab has rendered in chromium, on
the first visit and on later ones. `profile`: the CUDA kernels one decode step runs, by GPU time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .cli import count, parser, positive, progress_bar, writable, write_csv, write_text


def _model_options(p) -> None:
    """--model, --device and --dtype: the model a subcommand loads (`models.load_model`)."""
    p.add_argument("--model", default="random:qwen3-8b", help="demo | hub id | path | random:qwen3-8b ...")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU, bfloat16 "
                   "or float16 on a GPU)")
    shard = p.add_mutually_exclusive_group()
    shard.add_argument("--device-map", default=None, choices=("auto", "balanced", "sequential"),
                       help="whole layers placed across the visible GPUs by accelerate (auto fills the first GPUs "
                       "first, balanced evens them out), for a model larger than one: random:llama-3.3-70b ...")
    shard.add_argument("--tp", action="store_true", help="tensor parallel over the GPUs of a torchrun job: "
                       "torchrun --nproc-per-node 2 -m kitty_core.bench e2e --tp ...")


def arguments():
    p = parser("kitty_core.bench", __doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="fused decode attention vs SDPA on FP16, Qwen3-8B attention shapes",
                       formatter_class=p.formatter_class)
    k.add_argument("--shapes", default="64x8192,8x32768,1x131072", help="BATCHxLENGTH,...")
    k.add_argument("--boost", default="0,0.125,0.25", help="boost rates, comma-separated")
    k.add_argument("--key-dots", default=None, help="the page kernel's key dots, fp16, int8 or fp16,int8 "
                   "(default: the library's for the head size)")
    k.add_argument("--out", type=Path, default=None, help="CSV or JSON file")
    k.add_argument("--sweep", action="store_true", help="instead: time launch settings of the fused kernel")
    k.add_argument("--unpack-modes", action="store_true", help="instead: time the fused kernel with each way of "
                   "unpacking codes")
    k.add_argument("--pack", action="store_true", help="instead: packing time against decode time")
    k.add_argument("--fp16", action="store_true", help="instead: FP16 attention on each SDPA backend")
    k.add_argument("--cuda", action="store_true", help="instead: the CUDA page kernel beside the Triton fused "
                   "kernel and cuDNN SDPA on FP16")
    k.add_argument("--ppp", default=None, help="with --cuda: the CUDA kernel's pages per program, comma-separated "
                   "(default: its launch plan)")
    e = sub.add_parser("e2e", help="a whole model generating: max batch, memory, throughput per cache",
                       formatter_class=p.formatter_class)
    _model_options(e)
    e.add_argument("--caches", default="dynamic,static,static-compiled,quantized,fp16-prealloc,kivi-k2v2,kitty,kitty-pro",
                   help="transformers' caches, fp16-prealloc and methods (METHOD@ENGINE too), comma-separated")
    e.add_argument("--prompt", type=count(1), default=512, help="prompt tokens per sequence")
    e.add_argument("--generate", type=count(1), default=8192, help="tokens generated per sequence")
    e.add_argument("--equal-batch", type=count(0), default=64, help="also measure every cache at this batch (0: no)")
    e.add_argument("--budget-gib", type=positive, default=None, help="cache bytes allowed (default: until OOM)")
    e.add_argument("--points", type=count(1), default=4, help="cache lengths at which decode steps are timed")
    e.add_argument("--steps", type=count(1), default=10, help="consecutive decode steps timed at each length "
                   "(their mean; more steps, less noise from run to run)")
    e.add_argument("--start", type=count(1), default=8, help="first batch size of the doubling")
    e.add_argument("--validate", default="", help="CACHE:BATCH:TOKENS,... real generations to check the estimate "
                   "(after the sweep; with --caches \"\" and --merge, added to an earlier run's file)")
    e.add_argument("--decode", choices=("compiled", "graph", "eager"), default="compiled",
                   help="compiled: as generate decodes (torch.compile, CUDA graphs) where a cache allows, the FP16 "
                   "baseline from its own graphs; graph: this library's caches from their own captured graphs; eager")
    e.add_argument("--no-fuse", dest="fuse", action="store_false",
                   help="keep transformers' RMSNorm and rotary code (default: one compiled kernel each on a GPU, for every "
                   "cache: kitty_core.fusion)")
    e.add_argument("--expandable-segments", action="store_true",
                   help="PyTorch's allocator in expandable segments: less fragmentation near a full GPU")
    e.add_argument("--out", type=Path, default=None, help="JSON file")
    e.add_argument("--merge", action="store_true", help="add to --out: this run's caches replace theirs there, "
                   "the others stay (same model and settings), and the file lists both commands")
    f = sub.add_parser("profile", help="the CUDA kernels of one decode step per cache, by GPU time",
                       formatter_class=p.formatter_class)
    _model_options(f)
    f.add_argument("--caches", default="fp16-prealloc,kitty-pro", help="caches, comma-separated (as for e2e)")
    f.add_argument("--batch", type=count(1), default=64, help="sequences")
    f.add_argument("--length", type=count(1), default=4096, help="tokens in the cache")
    f.add_argument("--decode", choices=("compiled", "graph", "eager"), default="compiled", help="as for e2e")
    f.add_argument("--no-fuse", dest="fuse", action="store_false", help="keep transformers' RMSNorm and rotary code")
    g = sub.add_parser("generate", help="transformers' generate with each cache against the graphed loop",
                       formatter_class=p.formatter_class)
    _model_options(g)
    g.add_argument("--paths", default="dynamic,kitty-pro:host,kitty-pro:eager,kitty-pro,kitty-pro:graphed",
                   help="see kitty_core.generate_speed")
    g.add_argument("--batch", default="64", help="batch sizes, comma-separated")
    g.add_argument("--prompt", type=count(1), default=512, help="prompt tokens per sequence")
    g.add_argument("--new", type=count(2), default=192, help="tokens generated per sequence")
    g.add_argument("--second", action="store_true", help="also: a compiled path's calls at another prompt "
                   "length and batch")
    g.add_argument("--calls", action="store_true", help="also: host time of one eager decode-attention call")
    g.add_argument("--out", type=Path, default=None, help="CSV file")
    w = sub.add_parser("app", help="seconds to first and later renders of every lab page in chromium",
                       formatter_class=p.formatter_class)
    w.add_argument("--chromium", default="/usr/bin/chromium", help="the browser Playwright drives")
    w.add_argument("--visits", type=count(1), default=2, help="visits of every page (the first loads)")
    w.add_argument("--log", type=Path, default=Path("/tmp/kitty-app-timing.log"), help="the server's output")
    w.add_argument("--headless", action="store_true", help="no browser: every page through Streamlit's AppTest "
                   "in one process, on the device the sidebar picks (the GPU where there is one), then every "
                   "button that runs on the loaded model")
    w.add_argument("--out", type=Path, default=None, help="CSV file of the --headless steps")
    return p


def refusal(a) -> str | None:
    """What the command line asks that this process cannot do, known before torch loads."""
    if getattr(a, "tp", False) and not all(v in os.environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return (f"--tp runs one process per GPU, started by torchrun: torchrun --nproc-per-node 2 -m "
                f"kitty_core.bench {a.what} --tp ... (or --device-map auto in one process)")
    return None


if __name__ == "__main__":
    # --help, usage errors and what this process cannot do answer here, before the imports below load torch
    _why = refusal(arguments().parse_args())
    if _why:
        print(f"error: {_why}", file=sys.stderr)
        sys.exit(2)

import json  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from .cache import KittyLayer, ReferenceEngine  # noqa: E402
from .config import parse_method  # noqa: E402
from .results import ResultFileError, read_e2e, stamp  # noqa: E402


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


def graphed(fn):
    """fn captured in a CUDA graph: replaying it costs the GPU work alone, without the host's
    per-launch cost (Triton's Python launcher takes ~50 us a kernel, more than a small call runs)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time(lambda: y.copy_(x))
    return 2 * nbytes / (ms / 1e3)


def synthetic_layer(method: str, batch: int, length: int, kv_heads: int, head_dim: int, dtype) -> KittyLayer:
    """A layer holding `length` tokens per sequence (random keys with uneven channel scales), the
    last one stored in FP16 and not yet packed: the state a decode step attends over."""
    layer = KittyLayer(parse_method(method), ReferenceEngine())
    empty = torch.zeros(batch, kv_heads, 0, head_dim, device="cuda", dtype=dtype)
    layer.lazy_initialization(empty, empty)
    spread = torch.linspace(0.2, 4.0, head_dim, device="cuda", dtype=dtype)
    for s in range(0, length - 1, 8192):  # prefill in chunks to bound the temporary FP16 tensors
        n = min(8192, length - 1 - s)
        k = torch.randn(batch, kv_heads, n, head_dim, device="cuda", dtype=dtype) * spread
        layer.insert(k, torch.randn_like(k))
    k = torch.randn(batch, kv_heads, 1, head_dim, device="cuda", dtype=dtype) * spread
    layer.insert(k, torch.randn_like(k), pack=False)
    return layer


def launch_defaults() -> dict:
    """The fused kernel's launch settings a default call uses (recorded beside its timings)."""
    import inspect

    from kernels.decode import DEEP, DEEP_WAVES, INT8_KEY_DOTS_FROM, REGISTER_CAP, combine_warps, decode_attention

    params = inspect.signature(decode_attention).parameters
    return {"num_warps": params["num_warps"].default, "num_stages": 2, "register_cap_by_query_rows": REGISTER_CAP,
            "pages_per_program": "up to 16, by occupancy",
            "deep_grids": {"min_waves": DEEP_WAVES, "stages_and_cap_by_query_rows": DEEP, "pages_per_program": "up to 32"},
            "tail_kernel": "on a second stream, beside the page kernel",
            "combine_warps_by_partials": {c: combine_warps(c) for c in (8, 16, 32, 64)},
            "key_dots": f"int8 from head size {INT8_KEY_DOTS_FROM}, fp16 below"}


def bench_kernels(shapes, boosts, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                  key_dots=(None,), progress=None) -> pd.DataFrame:
    """Per shape, boost rate and page-kernel key dots (None: the default): the fused kernel, the
    unfused qk -> softmax -> sv path and SDPA on an FP16 cache of the same shape, timed in this
    process as CUDA-graph replays (GPU time; `*_eager_ms`: plain calls, host launch cost included);
    bytes the fused kernel must read; the fused output's largest difference from
    `decode_attention_reference`."""
    from kernels.decode import decode_attention, decode_attention_reference, key_dots_of
    from kernels.decode_unfused import decode_attention_unfused

    bw_copy = copy_bandwidth()
    rows = []
    for batch, length in shapes:
        q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=dtype)
        k16 = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=dtype)
        v16 = torch.randn_like(k16)
        scale = head_dim**-0.5
        sdpa = lambda: F.scaled_dot_product_attention(q, k16, v16, scale=scale, enable_gqa=True)  # noqa: E731
        sdpa_ms, sdpa_eager_ms = cuda_time(graphed(sdpa)), cuda_time(sdpa)
        sdpa_bytes = 2 * k16.numel() * k16.element_size()
        del k16, v16, sdpa
        for boost in boosts:
            if progress:
                progress(len(rows) // len(key_dots), len(shapes) * len(boosts), f"{batch}x{length}, boost {boost:g}")
            layer = synthetic_layer(f"kitty+boost_rate={boost}", batch, length, kv_heads, head_dim, dtype)
            state = layer.kernel_state()
            unfused = lambda: decode_attention_unfused(layer, q, scale, state)  # noqa: E731
            unfused_ms = cuda_time(graphed(unfused))
            ref = decode_attention_reference(layer, q, scale).float()
            parts = layer.nbytes()
            read = sum(parts.values()) + q.numel() * q.element_size()
            for dots in key_dots:
                ws = {}
                fused = lambda: decode_attention(layer, q, scale, ws, state, key_dots=dots)  # noqa: E731
                err = (fused().float() - ref).abs().max().item()
                fused_ms, fused_eager_ms = cuda_time(graphed(fused)), cuda_time(fused)
                rows.append({
                    "batch": batch, "length": length, "boost_rate": boost, "key_dots": key_dots_of(dots, head_dim),
                    "fused_ms": fused_ms, "unfused_ms": unfused_ms, "sdpa_fp16_ms": sdpa_ms,
                    "fused_vs_sdpa": sdpa_ms / fused_ms, "fused_vs_unfused": unfused_ms / fused_ms,
                    "fused_eager_ms": fused_eager_ms, "sdpa_eager_ms": sdpa_eager_ms,
                    "fused_bytes": read, "fused_TBps": read / fused_ms / 1e9, "sdpa_TBps": sdpa_bytes / sdpa_ms / 1e9,
                    "copy_TBps": bw_copy / 1e12, "fused_max_abs_err": err,
                })
                print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1,
                                                        float_format=lambda x: f"{x:.3f}"), flush=True)
                del ws, fused
            del layer, state, unfused, ref
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def bench_cuda(shapes, boosts, pages_per_program=(None,), q_heads=32, kv_heads=8, head_dim=128,
               dtype=torch.bfloat16, rounds=5, progress=None) -> pd.DataFrame:
    """Per shape and boost rate: the fused step with the CUDA page kernel (`kernels.cuda_decode`, per
    pages-per-program setting), the Triton fused step and SDPA on an FP16 cache forced to cuDNN, as
    CUDA-graph replays timed in `rounds` interleaved rounds (the median of the rounds' medians); the
    packed bytes each step reads and both outputs' largest difference from the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import cuda_decode
    from kernels.decode import decode_attention, decode_attention_reference

    rows = []
    for batch, length in shapes:
        q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=dtype)
        k16 = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=dtype)
        v16 = torch.randn_like(k16)
        scale = head_dim**-0.5

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k16, v16, scale=scale, enable_gqa=True)

        cudnn_g = graphed(cudnn)
        for boost in boosts:
            if progress:
                progress(len(rows), len(shapes) * len(boosts), f"{batch}x{length}, boost {boost:g}")
            layer = synthetic_layer(f"kitty+boost_rate={boost}", batch, length, kv_heads, head_dim, dtype)
            state = layer.kernel_state()
            why = cuda_decode.unsupported(head_dim, layer.config.group_size, layer.n_boost, layer.config.value_bits,
                                          q_heads // kv_heads, dtype, q.device) or cuda_decode.build(layer.n_boost)
            if why:
                raise RuntimeError(f"the CUDA page kernel does not apply: {why}")
            ref = decode_attention_reference(layer, q, scale).float()
            ws_t = {}
            triton = lambda: decode_attention(layer, q, scale, ws_t, state)  # noqa: E731
            err_t = (triton().float() - ref).abs().max().item()
            fns = {"triton": graphed(triton), "cudnn": cudnn_g}
            errs = {}
            for ppp in pages_per_program:
                ws = {}
                fn = lambda ws=ws, ppp=ppp: cuda_decode.decode_attention(layer, q, scale, ws, state, ppp)  # noqa: E731
                errs[ppp] = (fn().float() - ref).abs().max().item()
                fns[ppp] = graphed(fn)
            times = {name: [] for name in fns}
            for _ in range(rounds):
                for name, g in fns.items():
                    times[name].append(cuda_time(g, warmup=2, iters=20))
            ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            read = sum(layer.nbytes().values()) + q.numel() * q.element_size()
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            for ppp in pages_per_program:
                rows.append({
                    "batch": batch, "length": length, "boost_rate": boost,
                    "ppp": ppp or cuda_decode.launch_plan(batch * kv_heads, state["max_slots"], sms),
                    "cuda_ms": ms[ppp], "triton_ms": ms["triton"], "cudnn_ms": ms["cudnn"],
                    "cuda_vs_cudnn": ms["cudnn"] / ms[ppp], "triton_vs_cudnn": ms["cudnn"] / ms["triton"],
                    "cuda_vs_triton": ms["triton"] / ms[ppp], "packed_bytes": read,
                    "cuda_TBps": read / ms[ppp] / 1e9, "triton_TBps": read / ms["triton"] / 1e9,
                    "cudnn_TBps": 2 * k16.numel() * k16.element_size() / ms["cudnn"] / 1e9,
                    "cuda_max_abs_err": errs[ppp], "triton_max_abs_err": err_t,
                })
                print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1,
                                                        float_format=lambda x: f"{x:.3f}"), flush=True)
            del layer, state, fns, ref, triton
            torch.cuda.empty_cache()
        del k16, v16, cudnn_g
    return pd.DataFrame(rows)


def sweep_launch(shape, boost=0.25, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16) -> pd.DataFrame:
    """Fused kernel GPU time over launch settings (pages per program, warps, stages, register cap)."""
    from kernels.decode import decode_attention

    batch, length = shape
    layer = synthetic_layer(f"kitty+boost_rate={boost}", batch, length, kv_heads, head_dim, dtype)
    q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=dtype)
    state, rows = layer.kernel_state(), []
    for ppp in (16, 32):
        for warps in (2, 4):
            for stages in (2, 3):
                for regs in (None, 128, 160):
                    ws = {}
                    ms = cuda_time(graphed(lambda: decode_attention(layer, q, 0.088, ws, state, ppp, warps, stages,
                                                                    max_registers=regs)), iters=10)
                    rows.append({"batch": batch, "length": length, "ppp": ppp, "warps": warps, "stages": stages,
                                 "max_registers": regs or "-", "ms": ms})
    return pd.DataFrame(rows).sort_values("ms")


def fp16_attention(shape, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16) -> pd.DataFrame:
    """FP16 decode attention, one shape, on each SDPA backend that runs it, and as the FP16 baseline's
    captured decode step runs it (cuDNN over a window of up to `PreallocatedCache.WINDOW` slots more,
    masked); GPU time of CUDA-graph replays, and the bandwidth each implies (of the used keys and
    values)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .baselines import PreallocatedCache

    batch, length = shape
    q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    nbytes, scale, rows = 2 * k.numel() * k.element_size(), head_dim**-0.5, []

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
            ms = cuda_time(graphed(fn))
        except RuntimeError as err:  # a backend that does not take this call here
            rows.append({"batch": batch, "length": length, "attention": what, "ms": None,
                         "note": str(err).splitlines()[0][:80]})
            continue
        rows.append({"batch": batch, "length": length, "attention": what, "ms": ms, "TBps": nbytes / ms / 1e9})
    return pd.DataFrame(rows)


def pack_cost(shape, boost=0.25, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16) -> dict:
    """Packing against decoding, one shape: a page fills every G decode steps, when each sequence
    packs G tokens of keys and values per layer. Share = pack / (G x fused decode step + pack)."""
    from kernels import pack
    from kernels.decode import decode_attention
    from .quant import quantize_keys, quantize_values

    batch, length = shape
    layer = synthetic_layer(f"kitty+boost_rate={boost}", batch, length, kv_heads, head_dim, dtype)
    q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=dtype)
    state, ws, g = layer.kernel_state(), {}, layer.config.group_size
    fused_ms = cuda_time(graphed(lambda: decode_attention(layer, q, 0.088, ws, state)))
    x = torch.randn(batch, kv_heads, g, head_dim, device="cuda", dtype=dtype) * torch.linspace(
        0.2, 4.0, head_dim, device="cuda", dtype=dtype)
    nb = layer.n_boost
    triton_ms = cuda_time(graphed(lambda: (pack.quantize_keys(x, nb), pack.quantize_values(x, 2))))
    torch_ms = cuda_time(lambda: (quantize_keys(x, nb), quantize_values(x, 2)))
    return {"batch": batch, "length": length, "boost_rate": boost, "fused_ms": fused_ms,
            "pack_triton_ms": triton_ms, "pack_torch_ms": torch_ms,
            "pack_share": triton_ms / (g * fused_ms + triton_ms), "pack_share_torch": torch_ms / (g * fused_ms + torch_ms)}


def unpack_modes(shape, boost=0.25, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                 **launch) -> pd.DataFrame:
    """The fused kernel's GPU time by how codes become operands, one shape: four at a time in PTX,
    element by element, and (in the tail) by int -> fp16 conversions (`decode_attention(unpack=...)`)."""
    from kernels.decode import decode_attention

    batch, length = shape
    layer = synthetic_layer(f"kitty+boost_rate={boost}", batch, length, kv_heads, head_dim, dtype)
    q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=dtype)
    state, rows = layer.kernel_state(), []
    read = sum(layer.nbytes().values())
    variants = [("full kernel, PTX unpack", {}), ("full kernel, per-element unpack", {"unpack": "bits"}),
                ("full kernel, int->fp16 conversions in the tail (pages: per element)", {"unpack": "convert"})]
    for what, kw in variants:
        ws = {}
        ms = cuda_time(graphed(lambda: decode_attention(layer, q, 0.088, ws, state, **kw, **launch)))
        rows.append({"batch": batch, "length": length, "variant": what, "ms": ms, "TBps_of_cache": read / ms / 1e9})
    return pd.DataFrame(rows)


def time_app(chromium: str, log: Path, visits: int = 2, progress=None) -> pd.DataFrame:
    """Seconds from opening each page of a freshly started lab (demo model) until its script has
    finished, in one tab, moving through the sidebar's navigation as a user does, visit after visit:
    the first visit pays for loading the model and the page's analyses, later ones find them in
    Streamlit's caches."""
    from playwright.sync_api import sync_playwright

    from .browser import PAGES, serve_app, settle

    rows = []
    with serve_app(log) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        for visit in range(1, visits + 1):
            for path, title in PAGES:
                if progress:
                    progress(len(rows), visits * len(PAGES), f"visit {visit}: {title}")
                start = time.time()
                if visit == 1 and not path:
                    page.goto(url)
                else:
                    page.locator('[data-testid="stSidebarNav"] a', has_text=title).first.click()
                page.wait_for_url(f"{url}/{path}", timeout=60_000)
                page.wait_for_selector(".js-plotly-plot", timeout=300_000)
                done = settle(page, timeout_s=300, quiet_s=0.5)
                rows.append({"page": title, "visit": visit, "seconds": done - start})
                print(f"visit {visit} {title}: {done - start:.1f} s", flush=True)
        browser.close()
    return pd.DataFrame(rows)


def e2e_table(points: pd.DataFrame) -> pd.DataFrame:
    """Per cache: max batch, peak memory, throughput at max and at equal batch, and ratios against
    the transformers caches and the same-runtime FP16 baseline."""
    if "tokens_per_s" not in points:
        return pd.DataFrame()
    ok = points[points["tokens_per_s"].notna()]
    rows = []
    for cache, g in ok.groupby("cache", sort=False):
        at_max, at_eq = g[g["at"] == "max batch"], g[g["at"] == "equal batch"]
        rows.append({
            "cache": cache, "max_batch": int(g["max_batch"].iloc[0]),
            "peak_GiB": float(at_max["peak_bytes"].iloc[0]) / 2**30 if len(at_max) and at_max["peak_bytes"].notna().all() else None,
            "kv_bytes_per_token": float(at_max["kv_bytes_per_token"].iloc[0]) if len(at_max) else None,
            "tokens_per_s_max_batch": float(at_max["tokens_per_s"].iloc[0]) if len(at_max) else None,
            # a step that packs pages, beyond one that does not (presets; once every G steps)
            "packing_ms_max_batch": float(at_max["packing_ms"].iloc[0])
            if len(at_max) and "packing_ms" in at_max and at_max["packing_ms"].notna().all() else None,
            # the batch that throughput was measured at: below the max batch if the prefill needed room
            "measured_at_batch": int(at_max["batch"].iloc[0]) if len(at_max) else None,
            "equal_batch": int(at_eq["batch"].iloc[0]) if len(at_eq) else (int(at_max["batch"].iloc[0]) if len(at_max) else None),
            "tokens_per_s_equal_batch": float(at_eq["tokens_per_s"].iloc[0]) if len(at_eq) else (
                float(at_max["tokens_per_s"].iloc[0]) if len(at_max) else None),
        })
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    t = table.set_index("cache")
    for ref in ("dynamic", "static", "static-compiled", "fp16-prealloc"):
        if ref in t.index:
            t[f"batch_vs_{ref}"] = t["max_batch"] / t.loc[ref, "max_batch"]
            t[f"tput_vs_{ref}"] = t["tokens_per_s_max_batch"] / t.loc[ref, "tokens_per_s_max_batch"]
            t[f"equal_batch_vs_{ref}"] = t["tokens_per_s_equal_batch"] / t.loc[ref, "tokens_per_s_equal_batch"]
    return t.reset_index()


def real_table(checks: list[dict], points: pd.DataFrame) -> pd.DataFrame:
    """Real generations (`e2e --validate`), one row each: the time, the tokens per second (every
    sequence's generated tokens over the whole run, prefill included), the estimate's error and, on
    a GPU, the mean SM clock and power meanwhile (`telemetry`). A
    generation at its cache's max batch (from `points`) is compared with each baseline's real
    generation of the same length at the baseline's max batch: the throughput target measured
    instead of estimated."""
    if not checks:
        return pd.DataFrame()
    rows = pd.DataFrame(checks)
    rows["tokens_per_s"] = rows["batch"] * rows["generate"] / rows["measured_s"]
    best = points.groupby("cache")["max_batch"].first() if "max_batch" in points else pd.Series(dtype=int)
    rows["at_max_batch"] = [best.get(c) == b for c, b in zip(rows["cache"], rows["batch"])]
    for ref in ("dynamic", "static", "static-compiled", "fp16-prealloc"):
        base = rows[(rows["cache"] == ref) & rows["at_max_batch"]].groupby("generate")["tokens_per_s"].last()
        if len(base):
            rows[f"tput_vs_{ref}"] = [tps / base[g] if at and g in base else None
                                      for tps, g, at in zip(rows["tokens_per_s"], rows["generate"], rows["at_max_batch"])]
    shown = ["cache", "batch", "at_max_batch", "prompt", "generate", "prefill_chunk", "measured_s", "tokens_per_s",
             "estimated_s", "estimate_error", "sm_clock_mhz", "power_w"]
    return rows[[c for c in shown if c in rows] + [c for c in rows if c.startswith("tput_vs_")]]


SETUP = ("model", "shape", "gpu", "dtype", "torch", "transformers", "prompt", "generate", "budget_gib", "points",
         "steps", "decode", "fused", "alloc_conf", "sharding")


def same_setup(a: dict, b: dict) -> bool:
    """Two e2e runs measured the same thing (model, GPU, versions, lengths, budget, points and steps
    timed, decoding)."""
    return all(a.get(k, False) == b.get(k, False) for k in SETUP)  # runs from before fusion: False


def merge_runs(earlier: dict, run: dict, command: str) -> dict:
    """An e2e result file with `run` added to `earlier`: the caches `run` measured replace their rows
    in `earlier`, the others stay; settings list the commands and what each measured."""
    mine = set(run["settings"]["caches"])
    keep = lambda rows: [r for r in rows if r["cache"] not in mine]  # noqa: E731
    settings = dict(run["settings"])
    before = earlier["settings"].get("runs") or [{"command": None, "caches": earlier["settings"]["caches"]}]
    # a command stays listed while a cache it measured does, or if it measured none (it validated)
    runs = [dict(r, caches=[c for c in r["caches"] if c not in mine]) for r in before]
    runs = [r for r, was in zip(runs, before) if r["caches"] or not was["caches"]]
    settings["runs"] = runs + [{"command": command, "caches": run["settings"]["caches"]}]
    settings["caches"] = [c for r in settings["runs"] for c in r["caches"]]
    return {"settings": settings, "points": keep(earlier["points"]) + run["points"],
            "probes": keep(earlier["probes"]) + run["probes"], "skipped": keep(earlier["skipped"]) + run["skipped"],
            "validation": keep(earlier.get("validation", [])) + run["validation"]}


def _caches(spec: str) -> list[str]:
    """Cache kinds from a comma list; ValueError naming the choices for one that is neither a
    baseline nor a method (optionally "@engine": `baselines.preset_kind`)."""
    from .baselines import BASELINES, preset_kind

    kinds = [c.strip() for c in spec.split(",") if c.strip()]
    for kind in kinds:
        if kind not in BASELINES:
            try:
                preset_kind(kind)
            except ValueError as err:
                raise ValueError(f"cache {kind!r}: not one of {', '.join(BASELINES)}, and {err}") from err
    return kinds


def _validation(spec: str) -> tuple[str, int, int]:
    """CACHE:BATCH:TOKENS -> (cache, batch, tokens)."""
    parts = spec.split(":")
    if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()) or min(int(parts[1]), int(parts[2])) < 1:
        raise ValueError(f"--validate takes CACHE:BATCH:TOKENS with positive integers, e.g. kitty-pro:64:8192; got {spec!r}")
    return _caches(parts[0])[0], int(parts[1]), int(parts[2])


def _setup(a):
    """(cache kinds, validation specs, loaded model) from the command line, checked before the
    model loads; None after printing one error line for anything that cannot be used."""
    from .models import ModelLoadError, load_model

    try:
        caches = _caches(a.caches)
        checks = [_validation(spec) for spec in filter(None, getattr(a, "validate", "").split(","))]
        lm = load_model(a.model, device=a.device, dtype=a.dtype, device_map=a.device_map, tp=a.tp)
    except (ValueError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    if a.fuse:
        from .fusion import fuse

        fuse(lm.model)  # before any cache: every one decodes through the same model
    return caches, checks, lm


def _sharding(model) -> str | None:
    """How the model is split over GPUs, in words (None: on one device)."""
    from .sharding import placement_summary, tp_size

    if tp_size(model) > 1:
        return f"tensor parallel over {tp_size(model)} ranks"
    dmap = getattr(model, "hf_device_map", None)
    return f"device map: {placement_summary(dmap)}" if dmap else None


def run_e2e(a) -> int:
    import platform

    import transformers

    from .fusion import is_fused
    from .throughput import sweep, validate

    if a.merge and not a.out:
        print("error: --merge adds to the file named by --out; give one", file=sys.stderr)
        return 2
    setup = _setup(a)
    if setup is None:
        return 2
    caches, checks_asked, lm = setup
    context = lm.shape.get("context")
    if context and a.prompt + a.generate > context:
        print(f"error: --prompt {a.prompt} + --generate {a.generate} is beyond {lm.name}'s context of {context} "
              f"tokens: give --generate {max(1, context - a.prompt)} or less", file=sys.stderr)
        return 2
    budget = int(a.budget_gib * 2**30) if a.budget_gib else None
    probes, points, skipped, checks = [], [], [], []
    settings = {"model": lm.name, "shape": lm.shape, "device": str(lm.device),
                "gpu": torch.cuda.get_device_name() if lm.device.type == "cuda" else platform.processor(),
                "dtype": str(lm.dtype).removeprefix("torch."), "torch": torch.__version__,
                "transformers": transformers.__version__, "prompt": a.prompt, "generate": a.generate,
                "budget_gib": a.budget_gib, "points": a.points, "steps": a.steps, "decode": a.decode, "caches": caches,
                "fused": is_fused(lm.model), "launch": launch_defaults(),
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    sharding = _sharding(lm.model)
    if sharding:  # absent for a model on one device, as in the files of runs from before sharding
        settings["sharding"] = sharding
    rank = int(os.environ.get("RANK", 0)) if a.tp else 0  # every rank measures; rank 0 writes the file

    command = "python -m kitty_core.bench " + shlex.join(a.argv)  # quoted as a shell takes it back
    settings["runs"] = [{"command": command, "caches": caches}]
    earlier = None
    if a.merge and a.out and a.out.exists():
        try:
            read_e2e(a.out)  # --merge adds only to a whole e2e result file
        except ResultFileError as err:
            print(f"error: {err}; --merge adds to a file `bench e2e --out` wrote", file=sys.stderr)
            return 2
        earlier = json.loads(a.out.read_text())
        if not same_setup(earlier["settings"], settings):
            print(f"error: {a.out} holds a run of another model or settings; --merge needs the same", file=sys.stderr)
            return 2

    def current() -> dict:  # this command's rows, added to the earlier file's with --merge
        run = {"settings": settings, "points": points, "probes": probes, "skipped": skipped, "validation": checks}
        run = merge_runs(earlier, run, command) if earlier else run
        run["summary"] = e2e_table(pd.DataFrame(run["points"])).to_dict(orient="records")
        return run

    def save():  # after every row, so that an interrupted run keeps what it measured
        if a.out and rank == 0:
            write_text(a.out, json.dumps(stamp(current()), indent=1, default=float))

    with progress_bar("e2e sweep", "row") as progress:  # rows to come are not known: the bar counts them
        rows = sweep(lm.model, caches, a.prompt, a.generate, a.equal_batch, budget, a.points, a.start,
                     decode=a.decode, steps=a.steps)
        for done, (what, row) in enumerate(rows, 1):
            {"probe": probes, "point": points, "skip": skipped}[what].append(row)
            brief = {k: v for k, v in row.items() if not k.startswith("step_ms")}
            print(what, json.dumps(brief, default=float), flush=True)
            save()
            progress(done, None, f"{row.get('cache')} batch {row.get('batch')}")
    if points:  # none when the command only validates (--caches "")
        table = e2e_table(pd.DataFrame(points))
        print(table.to_string(index=False, float_format=lambda x: f"{x:.2f}"), flush=True)
    with progress_bar("validations", "generation") as progress:
        for done, (cache, batch, gen) in enumerate(checks_asked):
            progress(done, len(checks_asked), f"{cache} batch {batch}")
            checks.append(validate(lm.model, cache, batch, a.prompt, gen, a.points, decode=a.decode, steps=a.steps))
            print("validate", json.dumps(checks[-1], default=float), flush=True)
            save()
    if checks:  # the real generations, the file's earlier ones too, against the baselines' (`real_table`)
        run = current()
        real = real_table(run["validation"], pd.DataFrame(run["points"]))
        print(real.to_string(index=False, float_format=lambda x: f"{x:.3f}"), flush=True)
    return 0


def run_profile(a) -> int:
    from .throughput import profile_step

    setup = _setup(a)
    if setup is None:
        return 2
    caches, _, lm = setup
    with progress_bar("profiles", "cache") as progress:
        for done, kind in enumerate(caches):
            progress(done, len(caches), kind)
            total, wall, table = profile_step(lm.model, kind, a.batch, a.length, decode=a.decode)
            where = "GPU kernels" if torch.cuda.is_available() else "CPU ops"
            print(f"{kind}: batch {a.batch}, {a.length} tokens: {total:.2f} ms of {where}, {wall:.2f} ms wall per decode step")
            print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"), flush=True)
    return 0


def run_generate(a) -> int:
    from . import generate_speed as gs
    from .models import ModelLoadError, load_model

    try:
        batches = [int(b) for b in a.batch.split(",")]
        lm = load_model(a.model, device=a.device, dtype=a.dtype, device_map=a.device_map, tp=a.tp)
    except (ValueError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    paths = a.paths.split(",")
    tables = []
    with progress_bar("generate calls", "path") as progress:
        for i, b in enumerate(batches):
            tables.append(gs.measure(lm.model, paths, b, a.prompt, a.new,
                                     progress=lambda done, n, path: progress(i * n + done, len(batches) * n,
                                                                             f"{path} batch {b}")))
    table = pd.concat(tables, ignore_index=True)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"), flush=True)
    if a.out:
        write_csv(a.out, table)
    if a.second:
        for path in (p for p in paths if ":" not in p and p != "dynamic"):
            print(gs.second_requests(lm.model, path, batches[-1], a.prompt, a.new).to_string(index=False), flush=True)
    if a.calls:
        for method in dict.fromkeys(p.partition(":")[0] for p in paths if p != "dynamic"):
            print(method, gs.attention_call_us(lm.model, method, batches[-1], a.prompt), flush=True)
    return 0


def _each(shapes):
    """The shapes one at a time, counted by a bar on stderr."""
    with progress_bar("kernel shapes", "shape") as progress:
        for done, shape in enumerate(shapes):
            progress(done, len(shapes), "x".join(map(str, shape)))
            yield shape


def main(argv=None) -> int:
    a = arguments().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if refusal(a):
        print(f"error: {refusal(a)}", file=sys.stderr)
        return 2
    if getattr(a, "out", None):
        try:
            writable(a.out)  # before any model loads or kernel runs
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if a.what == "e2e":
        if a.expandable_segments:  # read when CUDA's allocator starts, which nothing here has done yet
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
        return run_e2e(a)
    if a.what == "profile":
        return run_profile(a)
    if a.what == "generate":
        return run_generate(a)
    if a.what == "app" and a.headless:
        from .lab_timing import time_lab

        with progress_bar("lab steps", "step") as progress:
            steps = time_lab(progress=progress)
        print(steps.round(1).to_string(index=False), flush=True)
        if a.out:
            write_csv(a.out, steps)
        return 0 if (steps["outcome"] == "ok").all() else 1
    if a.what == "app":
        with progress_bar("page visits", "page") as progress:
            times = time_app(a.chromium, a.log, a.visits, progress)
        print(times.pivot(index="page", columns="visit", values="seconds").round(1).to_string(), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("error: the kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if a.unpack_modes:
        for shape in _each(shapes):
            print(unpack_modes(shape).to_string(index=False), flush=True)
        return 0
    if a.pack:
        print(pd.DataFrame([pack_cost(shape) for shape in _each(shapes)]).to_string(index=False), flush=True)
        return 0
    if a.fp16:
        print(pd.concat([fp16_attention(shape) for shape in _each(shapes)]).to_string(index=False), flush=True)
        return 0
    if a.sweep:
        for shape in _each(shapes):
            print(sweep_launch(shape).head(8).to_string(index=False), flush=True)
        return 0
    if a.cuda:
        ppps = [int(x) for x in a.ppp.split(",")] if a.ppp else [None]
        with progress_bar("kernels", "setting") as progress:
            df = bench_cuda(shapes, [float(x) for x in a.boost.split(",")], ppps, progress=progress)
        if a.out:
            write_csv(a.out, df.assign(device=torch.cuda.get_device_name(), torch=torch.__version__))
        return 0
    with progress_bar("kernels", "setting") as progress:
        df = bench_kernels(shapes, [float(x) for x in a.boost.split(",")],
                           key_dots=a.key_dots.split(",") if a.key_dots else (None,), progress=progress)
    if a.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        if a.out.suffix == ".json":
            meta["launch"] = launch_defaults()
            write_text(a.out, json.dumps(stamp({"settings": meta, "results": df.to_dict(orient="records")}), indent=2))
        else:
            write_csv(a.out, df.assign(**meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
