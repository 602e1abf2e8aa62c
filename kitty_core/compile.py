"""Compile the decode kernels for a CUDA GPU on any machine, GPU or not, and read what ptxas made
of them: registers, spills, shared memory and the SASS instruction mix of each kernel.

    python -m kitty_core.compile                           # Qwen3-8B attention, kitty-pro, sm_90
    python -m kitty_core.compile --unpack bits,ptx --method kitty+boost_rate=0
    python -m kitty_core.compile --key-dots fp16,int8 --unpack ptx --stages 3 --max-registers 168 \
        --pages-per-program 32                             # a deep grid's settings (batch 489)
    python -m kitty_core.compile --warps 4 --max-registers 0
    python -m kitty_core.compile --new-token --unpack ptx  # the tail as graph-replayed steps launch it
    python -m kitty_core.compile --cuda --parts            # the CUDA page kernel (needs nvcc): kitty_core.compile_cuda
    python -m kitty_core.compile --cuda --tail             # the CUDA tail kernel, 16- and 8-bit tails
    kitty-compile ...                                      # the same, installed

Triton's wheel ships ptxas and cuobjdump, so this needs neither a GPU nor a CUDA install. It shows
what a kernel change does to the instruction stream before any GPU time is spent; the speed itself
is measured on a GPU (`python -m kitty_core.bench kernels`).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from .cli import parser
from .sass import SASS_LINE, family_mix, loop_body, tools


def compile_launch(kernel, args, options: dict, arch: int = 90):
    """One launch (`decode.decode_launches`) compiled for sm_`arch`, specialized exactly as a launch
    with these arguments would be (strides of 1, 16-byte alignment), without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, opts = binder(*args, **options)
    opts, signature, constexprs, attrs = fn._pack_args(backend, options, bound, specialization, opts)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)


def inspect(compiled) -> dict:
    """Registers, spills, shared memory, SASS opcode counts of a compiled kernel, and the same counts
    for its longest loop's body (per page, for the page kernel: `loop_*`)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([tools() / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([tools() / "cuobjdump", "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    reg = re.search(r"REG:(\d+)", usage)
    lines = [(int(m.group(1), 16), m.group(3)) for m in SASS_LINE.finditer(sass)]
    loop = loop_body(sass)
    ops = Counter(op.split(".")[0] for _, op in lines)
    row = {"registers": int(reg.group(1)) if reg else None, "spill_ops": ops["STL"] + ops["LDL"],
           "shared_bytes": compiled.metadata.shared, **family_mix(ops)}
    if loop:
        loop_ops = Counter(op.split(".")[0] for at, op in lines if loop[0] <= at <= loop[1])
        row.update(family_mix(loop_ops, "loop_"), loop_spill_ops=loop_ops["STL"] + loop_ops["LDL"])
    row["sass"] = sass
    return row


def layer_for(method: str, batch: int = 2, length: int = 2048, kv_heads: int = 8, head_dim: int = 128,
              dtype=None):
    """A CPU layer with the shapes of a model's attention (bf16 unless `dtype`): compiling needs its
    tensors' dtypes, strides and alignment, not their values or a GPU."""
    import torch

    from .layer import KittyLayer
    from .reference_engine import ReferenceEngine
    from .config import parse_method

    dtype = dtype or torch.bfloat16
    layer = KittyLayer(parse_method(method), ReferenceEngine())
    empty = torch.zeros(batch, kv_heads, 0, head_dim, dtype=dtype)
    layer.lazy_initialization(empty, empty)
    k = torch.randn(batch, kv_heads, length, head_dim, dtype=dtype)
    layer.insert(k[:, :, :-1], k[:, :, :-1])
    layer.insert(k[:, :, -1:], k[:, :, -1:], pack=False)
    return layer


def report(method: str = "kitty-pro", unpacks=("ptx",), q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
           arch: int = 90, dtype=None, key_dots=(None,), new_token: bool = False, **launch) -> pd.DataFrame:
    """Per kernel of the fused decode step, unpack mode and page-kernel key dots: ptxas resources and
    the SASS mix (the tail kernel once per unpack mode: it has no key dots of its own).
    `new_token`: the tail kernel as a step from device counters launches it, writing the step's token."""
    import pandas as pd
    import torch

    from kernels.decode import decode_launches, key_dots_of

    dtype = dtype or torch.bfloat16
    layer = layer_for(method, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    batch = layer.k_sink.buf.shape[0]
    q = torch.randn(batch, q_heads, 1, head_dim, dtype=dtype)
    if new_token:
        token = torch.zeros(batch, kv_heads, 1, head_dim, dtype=dtype)
        launch["new"] = (token, token.clone(), torch.zeros(2, batch, dtype=torch.long))
    launch.setdefault("pages_per_program", 8)  # a page loop, as at long context
    rows = []
    for unpack in unpacks:
        for i, dots in enumerate(key_dots):
            launches, _ = decode_launches(layer, q, head_dim**-0.5, unpack=unpack, cuda=True, key_dots=dots, **launch)
            for kernel, _grid, args, options in launches[:2] if i == 0 else launches[1:2]:
                info = inspect(compile_launch(kernel, args, options, arch))
                info.pop("sass")
                warps = options.get("num_warps", 4)
                pages = kernel is launches[1][0]
                rows.append({"kernel": kernel.fn.__name__, "unpack": unpack,
                             "key_dots": key_dots_of(dots, head_dim) if pages else None, "warps": warps, **info,
                             "warp_instructions_per_page": info.get("loop_instructions", 0) * warps if pages else None})
    return pd.DataFrame(rows)


def arguments():
    p = parser("kitty_core.compile", __doc__.split("\n\n")[0])
    p.add_argument("--method", default="kitty-pro")
    p.add_argument("--unpack", default="ptx,bits")
    p.add_argument("--key-dots", default=None, help="the page kernel's key dots: fp16, int8 or both "
                   "(fp16,int8; default: the library's default)")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--warps", type=int, default=None, help="page kernel warps (default: the launch default)")
    p.add_argument("--max-registers", type=int, default=None, help="page kernel cap (default: the launch "
                   "default; 0: none)")
    p.add_argument("--stages", type=int, default=None, help="page kernel pipeline stages (default: the launch "
                   "default)")
    p.add_argument("--pages-per-program", type=int, default=8)
    p.add_argument("--new-token", action="store_true", help="the tail kernel as a graph-replayed step launches it "
                   "(it writes the step's token)")
    c = p.add_argument_group("the CUDA page kernel (kernels/cuda/decode.cu, compiled by nvcc: kitty_core.compile_cuda)")
    c.add_argument("--cuda", action="store_true", help="report the CUDA page kernel instead of the Triton kernels")
    c.add_argument("--boosted", default=None, help="boosted channel counts, one build each (default 0,16,32,64)")
    c.add_argument("--cuda-stages", default=None, help="cp.async stages, one build each (default 1,2)")
    c.add_argument("--cuda-source", default=None, help="a variant of decode.cu to compile instead")
    c.add_argument("--dtype", choices=("bf16", "fp16"), default=None, help="the queries' dtype (default bf16)")
    c.add_argument("--cuda-arch", default=None, help="the GPU to compile for (default sm_90a)")
    c.add_argument("--parts", action="store_true", help="the page loop's instructions by part of the kernel")
    c.add_argument("--tail", action="store_true", help="the CUDA tail kernel instead (16- and 8-bit tails; "
                   "--boosted default 32)")
    p.add_argument("--columns", default="kernel,unpack,key_dots,warps,registers,spill_ops,loop_spill_ops,shared_bytes,instructions,"
                   "loop_instructions,warp_instructions_per_page,"
                   "loop_tensor core,loop_integer/bit,loop_shared,loop_float,loop_shuffle,loop_other")
    return p


def main(argv=None) -> int:
    p = arguments()
    a = p.parse_args(argv)  # before torch and Triton load
    if a.cuda:
        return cuda_main(a, p)
    given = [f"--{k.replace('_', '-')}" for k in ("boosted", "cuda_stages", "cuda_source", "dtype", "cuda_arch", "parts",
                                                  "tail") if getattr(a, k)]
    if given:
        p.error(f"{', '.join(given)}: options of the CUDA page kernel's report, which --cuda asks for")
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter does not compile")
    launch = {} if a.max_registers is None else {"max_registers": a.max_registers or None}
    if a.warps:
        launch["num_warps"] = a.warps
    if a.stages:
        launch["num_stages"] = a.stages
    launch["pages_per_program"] = a.pages_per_program
    key_dots = a.key_dots.split(",") if a.key_dots else (None,)
    df = report(a.method, a.unpack.split(","), a.q_heads, a.kv_heads, a.head_dim, a.arch, key_dots=key_dots,
                new_token=a.new_token, **launch)
    print(df[[c for c in a.columns.split(",") if c in df]].to_string(index=False))
    return 0


def cuda_main(a, p) -> int:
    from kernels.cuda_decode import BOOSTED

    from .compile_cuda import cuda_report, parts_table, tail_report

    def counts(text: str, what: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            p.error(f"{what}: a comma-separated list of integers, got {text!r}")

    boosted = counts(a.boosted or ("32" if a.tail else "0,16,32,64"), "--boosted")
    stages = counts(a.cuda_stages or "1,2", "--cuda-stages")
    if not set(boosted) <= set(BOOSTED):
        p.error(f"--boosted: the kernel is built for {', '.join(map(str, BOOSTED))} boosted channels, got {a.boosted}")
    if not set(stages) <= {1, 2}:
        p.error(f"--cuda-stages: the kernel is built for 1 or 2 cp.async stages, got {a.cuda_stages}")
    source = Path(a.cuda_source) if a.cuda_source else None
    if source is not None and not source.is_file():
        p.error(f"--cuda-source: no file {source}")
    if a.tail:
        try:
            df = tail_report(boosted, source, a.dtype or "bf16", a.cuda_arch or "sm_90a")
        except RuntimeError as e:
            p.exit(2, f"kitty_core.compile: {e}\n")
        cols = ["boosted", "tail_bits", "registers", "spill_ops", "instructions", "loop_instructions",
                "loop_tensor core", "loop_integer/bit", "loop_float", "loop_conversion", "loop_shared", "loop_other",
                "loop_global load", "loop_loads_after_mma"]
        print(df[cols].to_string(index=False))
        return 0
    try:
        df = cuda_report(boosted, stages, source, a.dtype or "bf16", a.cuda_arch or "sm_90a")
    except RuntimeError as e:
        p.exit(2, f"kitty_core.compile: {e}\n")
    cols = ["boosted", "stages", "registers", "spill_ops", "loop_spill_ops", "loop_instructions", "loop_tensor core",
            "loop_integer/bit", "loop_float", "loop_conversion", "loop_shared", "loop_shuffle", "loop_exp", "loop_other"]
    print(df[cols].to_string(index=False))
    if a.parts:
        print("\nthe page loop's instructions (one page slot) by part of the kernel:")
        print(parts_table(df).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
