"""Compile the decode kernels for a CUDA GPU on any machine, GPU or not, and read what ptxas made
of them: registers, spills, shared memory and the SASS instruction mix of each kernel.

    python -m kernels.compile                          # Qwen3-8B attention, kitty-pro, sm_90
    python -m kernels.compile --unpack bits,ptx --method kitty+boost_rate=0

Triton's wheel ships ptxas and cuobjdump, so this needs neither a GPU nor a CUDA install. It shows
what a kernel change does to the instruction stream before any GPU time is spent; the speed itself
is measured on a GPU (`python -m kitty_core.bench kernels`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pandas as pd
import torch
import triton

# SASS opcode families (the opcode before the first dot)
FAMILIES = {
    "tensor core": {"HMMA", "HGMMA"},
    "global load": {"LDG"},
    "shared": {"LDS", "STS", "LDSM", "STSM"},
    "integer/bit": {"LOP3", "SHF", "PRMT", "IADD3", "IMAD", "LEA", "SGXT", "BMSK", "ISETP", "SEL", "IMNMX", "VIMNMX"},
    "conversion": {"F2F", "I2F", "F2I", "I2FP", "F2FP", "I2I"},
    "float": {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "HADD2", "HFMA2", "HMUL2", "FMNMX3"},
    "exp": {"MUFU"},
    "shuffle": {"SHFL"},
}


def _tools() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_launch(kernel, args, options: dict, arch: int = 90):
    """One launch (`decode.decode_launches`) compiled for sm_`arch`, specialized exactly as a launch
    with these arguments would be (strides of 1, 16-byte alignment), without a GPU."""
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
    """Registers, spills, shared memory and SASS opcode counts of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tools() / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tools() / "cuobjdump", "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    reg = re.search(r"REG:(\d+)", usage)
    ops = Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
    spill = sum(n for op, n in ops.items() if op in ("STL", "LDL"))
    row = {"registers": int(reg.group(1)) if reg else None, "spill_ops": spill,
           "shared_bytes": compiled.metadata.shared, "instructions": sum(ops.values())}
    family_of = {op: fam for fam, members in FAMILIES.items() for op in members}
    for fam in FAMILIES:
        row[fam] = sum(n for op, n in ops.items() if family_of.get(op) == fam)
    row["other"] = row["instructions"] - sum(row[f] for f in FAMILIES)
    row["sass"] = sass
    return row


def layer_for(method: str, batch: int = 2, length: int = 2048, kv_heads: int = 8, head_dim: int = 128,
              dtype=torch.bfloat16):
    """A CPU layer with the shapes of a model's attention: compiling needs its tensors' dtypes,
    strides and alignment, not their values or a GPU."""
    from kitty_core.cache import KittyLayer, ReferenceEngine
    from kitty_core.config import parse_method

    layer = KittyLayer(parse_method(method), ReferenceEngine())
    empty = torch.zeros(batch, kv_heads, 0, head_dim, dtype=dtype)
    layer.lazy_initialization(empty, empty)
    k = torch.randn(batch, kv_heads, length, head_dim, dtype=dtype)
    layer.insert(k[:, :, :-1], k[:, :, :-1])
    layer.insert(k[:, :, -1:], k[:, :, -1:], pack=False)
    return layer


def report(method: str = "kitty-pro", unpacks=("ptx",), q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
           arch: int = 90, dtype=torch.bfloat16, **launch) -> pd.DataFrame:
    """Per kernel of the fused decode step and unpack mode: ptxas resources and the SASS mix."""
    from .decode import decode_launches

    layer = layer_for(method, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    q = torch.randn(2, q_heads, 1, head_dim, dtype=dtype)
    rows = []
    for unpack in unpacks:
        launches, _ = decode_launches(layer, q, head_dim**-0.5, unpack=unpack, cuda=True, **launch)
        for kernel, _grid, args, options in launches[:2]:
            info = inspect(compile_launch(kernel, args, options, arch))
            info.pop("sass")
            rows.append({"kernel": kernel.fn.__name__, "unpack": unpack, **info})
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="kitty-pro")
    p.add_argument("--unpack", default="ptx,bits")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter does not compile")
    df = report(a.method, a.unpack.split(","), a.q_heads, a.kv_heads, a.head_dim, a.arch)
    print(df.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
