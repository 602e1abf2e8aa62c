"""Benchmarks (scripts, not tests). Every speed figure is a ratio measured in one run against a
baseline of the same shape.

    python -m kitty_core.bench kernels --shapes 64x8192,8x32768,1x131072 --boost 0,0.125,0.25
    python -m kitty_core.bench e2e --model random:qwen3-8b --prompt 512 --generate 8192 --out e2e.json
    python -m kitty_core.bench profile --caches fp16-prealloc,kitty-pro --batch 64 --length 4096
    python -m kitty_core.bench generate --model random:qwen3-8b --batch 64,8 --calls --second
    python -m kitty_core.bench app      # the lab in chromium: first and later render of every page

`kernels`: decode attention alone (fused, unfused, SDPA on FP16), with the bandwidth it implies next
to a device-to-device copy (`kitty_core.kernel_bench`). `e2e`: a whole model generating
(`kitty_core.throughput`): per cache the largest batch that fits, peak memory, prefill time and
decode throughput at that batch and at an equal batch. `generate`: transformers' `generate` with
each cache, compiled and eager, against the graphed greedy loop (`kitty_core.generate_speed`).
`app`: seconds until each page of a freshly started lab has rendered in chromium, on the first
visit and on later ones, or with --headless every page and live button through AppTest
(`kitty_core.lab_timing`). `profile`: the CUDA kernels one decode step runs, by GPU time
(`throughput.profile_step`).

This module is the command line alone: it parses (before torch loads, so that `--help` and usage
errors answer at once), checks what it is asked before any model loads, runs the measuring module
and writes what it returns in the result file's format (`results`: `e2e_result`, `kernel_result`).
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
    k.add_argument("--stages", default=None, help="with --cuda: the CUDA kernel's cp.async stages, 1, 2 or 1,2 "
                   "(default: its launch plan)")
    k.add_argument("--launch-once", action="store_true", help="with --cuda: instead, launch each setting's CUDA "
                   "step once, untimed, with no other page kernel: for Nsight Compute, e.g. ncu --kernel-name "
                   "regex:pages_kernel --set full -o pages python -m kitty_core.bench kernels --cuda --launch-once ...")
    k.add_argument("--variants", default=None, help="with --cuda: also the CUDA page kernel built from these "
                   "variants of kernels/cuda/decode.cu (.cu files, comma-separated), each setting of each timed in "
                   "the same rounds as the shipped kernel's and named in a source column: an A/B in one process")
    k.add_argument("--rounds", type=count(1), default=None, help="with --cuda: interleaved timing rounds (default 5; "
                   "each setting's time is the median of its rounds' medians): more for an A/B of close variants")
    k.add_argument("--steps-a-graph", type=count(1), default=None, help="calls of each step a CUDA graph holds, "
                   "back to back, its time divided among them (default 10): the GPU's wait for a replay's launch, "
                   "several microseconds, spread over them; 1 times it whole")
    k.add_argument("--grid-tokens", type=count(1), default=None, help="with --cuda: size the page kernels' grids "
                   "for sequences of this many tokens, as a CUDA graph's step over a cache of that capacity "
                   "(default: each shape's length)")
    k.add_argument("--tail-bits", default="16", help="with --cuda: the tail's width, 16 (FP16), 8 (tail_bits=8) "
                   "or 16,8: each timed in the same run")
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
    e.add_argument("--start", type=count(1), default=8,
                   help="first batch size of the doubling (one that does not fit: bisect below it)")
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


def variant_files(variants: str) -> list[Path]:
    """The files of `--variants` (comma-separated, empty entries skipped)."""
    return [Path(v.strip()) for v in variants.split(",") if v.strip()]


def refusal(a) -> str | None:
    """What the command line asks that this process cannot do, known before torch loads."""
    if getattr(a, "tp", False) and not all(v in os.environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return (f"--tp runs one process per GPU, started by torchrun: torchrun --nproc-per-node 2 -m "
                f"kitty_core.bench {a.what} --tp ... (or --device-map auto in one process)")
    if getattr(a, "tail_bits", "16") != "16":
        widths = a.tail_bits.split(",")
        if not a.cuda:
            return "--tail-bits applies to the CUDA comparison: give it with --cuda"
        if any(w not in ("16", "8") for w in widths) or len(set(widths)) < len(widths):
            return f"--tail-bits takes 16, 8 or 16,8 (the tail's width), not {a.tail_bits!r}"
    if getattr(a, "launch_once", False) and not a.cuda:
        return "--launch-once launches the CUDA page kernel: give it with --cuda"
    if getattr(a, "launch_once", False):
        timed = [flag for flag, given in (("--out", a.out), ("--rounds", a.rounds is not None),
                                          ("--steps-a-graph", a.steps_a_graph is not None)) if given]
        if timed:
            return f"--launch-once times nothing and writes no table: drop {timed[0]}"
    if getattr(a, "variants", None) is not None:
        if not a.cuda:
            return "--variants are variants of the CUDA page kernel: give them with --cuda"
        files = variant_files(a.variants)
        missing = [str(f) for f in files if not f.is_file()]
        if not files or missing:
            return (f"no file {', '.join(missing) or repr(a.variants)} (--variants takes .cu files of "
                    "kernels/cuda/decode.cu's interface, comma-separated)")
        shipped = Path(__file__).resolve().parents[1] / "kernels" / "cuda" / "decode.cu"
        if len({f.resolve() for f in files} | {shipped}) != len(files) + 1:
            return "--variants names a file twice, or the shipped kernel (timed anyway): give each variant once"
    if getattr(a, "rounds", None) is not None and not a.cuda:
        return "--rounds sets the timing rounds of the CUDA comparison: give it with --cuda"
    grid = getattr(a, "grid_tokens", None)
    if grid is not None:
        if not a.cuda:
            return "--grid-tokens sizes the grids of the CUDA comparison: give it with --cuda"
        longest = max(int(s.split("x")[1]) for s in a.shapes.split(","))
        if grid < longest:
            return f"--grid-tokens {grid} is shorter than the longest shape's {longest} tokens: give at least {longest}"
    return None


if __name__ == "__main__":
    # --help, usage errors and what this process cannot do answer here, before the imports below load torch
    _why = refusal(arguments().parse_args())
    if _why:
        print(f"error: {_why}", file=sys.stderr)
        sys.exit(2)

import json  # noqa: E402
import shlex  # noqa: E402

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from .kernel_bench import (STEPS_A_GRAPH, bench_cuda, bench_kernels, fp16_attention, launch_cuda_once,  # noqa: E402
                           launch_defaults, pack_cost, sweep_launch, unpack_modes)
from .results import (PAGE_KERNEL_RULE, ResultFileError, e2e_result, e2e_table, kernel_result, read_e2e,  # noqa: E402
                      real_table, setup_differences)


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
                "page_kernel": PAGE_KERNEL_RULE,
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
        differ = setup_differences(earlier["settings"], settings)
        if differ:
            print(f"error: {a.out} holds a run of other settings ({', '.join(differ)} differ); --merge needs the same: "
                  f"write this run to a file of its own", file=sys.stderr)
            return 2

    def current() -> dict:  # this command's rows, added to the earlier file's with --merge
        return e2e_result(settings, points, probes, skipped, checks, earlier, command)

    def save():  # after every row, so that an interrupted run keeps what it measured
        if a.out and rank == 0:
            write_text(a.out, json.dumps(current(), indent=1, default=float))

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


def run_app(a) -> int:
    from .lab_timing import time_app, time_lab

    if a.headless:
        with progress_bar("lab steps", "step") as progress:
            steps = time_lab(progress=progress)
        print(steps.round(1).to_string(index=False), flush=True)
        if a.out:
            write_csv(a.out, steps)
        return 0 if (steps["outcome"] == "ok").all() else 1
    with progress_bar("page visits", "page") as progress:
        times = time_app(a.chromium, a.log, a.visits, progress)
    print(times.pivot(index="page", columns="visit", values="seconds").round(1).to_string(), flush=True)
    return 0


def _each(shapes):
    """The shapes one at a time, counted by a bar on stderr."""
    with progress_bar("kernel shapes", "shape") as progress:
        for done, shape in enumerate(shapes):
            progress(done, len(shapes), "x".join(map(str, shape)))
            yield shape


def run_kernels(a) -> int:
    if not torch.cuda.is_available():
        print("error: the kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    steps = a.steps_a_graph or STEPS_A_GRAPH
    if a.unpack_modes:
        for shape in _each(shapes):
            print(unpack_modes(shape, steps_a_graph=steps).to_string(index=False), flush=True)
        return 0
    if a.pack:
        print(pd.DataFrame([pack_cost(shape, steps_a_graph=steps) for shape in _each(shapes)]).to_string(index=False),
              flush=True)
        return 0
    if a.fp16:
        print(pd.concat([fp16_attention(shape, steps_a_graph=steps) for shape in _each(shapes)]).to_string(index=False),
              flush=True)
        return 0
    if a.sweep:
        for shape in _each(shapes):
            print(sweep_launch(shape, steps_a_graph=steps).head(8).to_string(index=False), flush=True)
        return 0
    if a.cuda:
        ppps = [int(x) for x in a.ppp.split(",")] if a.ppp else [None]
        stages = [int(x) for x in a.stages.split(",")] if a.stages else [None]
        sources = (None, *variant_files(a.variants)) if a.variants else (None,)
        tail_bits = [int(x) for x in a.tail_bits.split(",")]
        if a.launch_once:
            launches = launch_cuda_once(shapes, [float(x) for x in a.boost.split(",")], ppps, stages,
                                        grid_tokens=a.grid_tokens, sources=sources, tail_bits=tail_bits)
            print(launches.to_string(index=False), flush=True)
            return 0
        with progress_bar("kernels", "setting") as progress:
            df = bench_cuda(shapes, [float(x) for x in a.boost.split(",")], ppps, stages,
                            rounds=a.rounds or 5, grid_tokens=a.grid_tokens, progress=progress, sources=sources,
                            steps_a_graph=steps, tail_bits=tail_bits)
        if a.out:
            write_csv(a.out, df.assign(device=torch.cuda.get_device_name(), torch=torch.__version__))
        return 0
    with progress_bar("kernels", "setting") as progress:
        df = bench_kernels(shapes, [float(x) for x in a.boost.split(",")],
                           key_dots=a.key_dots.split(",") if a.key_dots else (None,), progress=progress,
                           steps_a_graph=steps)
    if a.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        if a.out.suffix == ".json":
            meta["launch"] = launch_defaults()
            write_text(a.out, json.dumps(kernel_result(meta, df), indent=2))
        else:
            write_csv(a.out, df.assign(**meta))
    return 0


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
    if a.what == "app":
        return run_app(a)
    return run_kernels(a)


if __name__ == "__main__":
    sys.exit(main())
