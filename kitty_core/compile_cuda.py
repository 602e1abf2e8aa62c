"""The CUDA page kernel (`kernels/cuda/decode.cu`) compiled by nvcc on any machine, GPU or not, and
read as machine code: registers, spills and the SASS of one trip of its page loop (one page slot of
one sequence and KV head), in all and by part of the kernel (the `// ---- part: ...` sections of its
source), each instruction counted where it was written, not where a helper it calls was defined;
and the tail kernel of the same file (`inspect_tail`): its registers, spills and the SASS of one
32-token block of its token loop.

    python -m kitty_core.compile --cuda                         # 0/16/32/64 boosted channels, 1 and 2 stages
    python -m kitty_core.compile --cuda --boosted 32 --cuda-stages 1 --parts
    python -m kitty_core.compile --cuda --cuda-source my_variant.cu --parts   # price a change before timing it
    python -m kitty_core.compile --cuda --tail                  # the tail kernel: a 32-token block's SASS

It needs nvcc (the CUDA toolkit); the disassembler comes with Triton's wheel. The count is static,
the instructions of the loop's body, which a warp issues once a page (what the few branches inside
it guard, the next page's copy, runs on almost every trip). Nsight Compute's count per page on a GPU
(`docs/engine.md`) is within a few percent of it; the time itself is measured on a GPU
(`python -m kitty_core.bench kernels --cuda`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pandas as pd
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

from kernels.cuda_decode import NVCC_FLAGS, SOURCE

from .sass import FAMILIES, SASS_LINE, family_mix, loop_body, tools
DTYPES = {"bf16": "__nv_bfloat16", "fp16": "__half"}
_PART = re.compile(r"^\s*// ---- ([^:(]+?)\s*(?::|\(|----)")
_LOCATION = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')


def nvcc() -> str:
    """The nvcc to compile with, or an error that says what to install."""
    found = shutil.which("nvcc")
    if found is None:
        raise RuntimeError("nvcc not found: install the CUDA toolkit (or put its bin/ on PATH) to compile the "
                           "CUDA page kernel; the Triton kernels compile without it (drop --cuda)")
    return found


def build_cubin(source: Path, n_boost: int, stages: int, arch: str = "sm_90a") -> bytes:
    """`source` compiled as `kernels.cuda_decode` builds it for `n_boost` boosted channels and `stages`
    cp.async stages, with line information (which does not change the code)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "pages.cubin"
        out = subprocess.run([nvcc(), f"-arch={arch}", "-cubin", "-lineinfo", *COMMON_NVCC_FLAGS, *NVCC_FLAGS,
                              f"-DKITTY_NB={n_boost}",
                              f"-DKITTY_STAGES={stages}", "-o", str(cubin), str(source)],
                             check=False, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"nvcc failed on {source}:\n{out.stderr[-3000:]}")
        return cubin.read_bytes()


def _function(listing: str, dtype: str) -> str:
    """The part of an nvdisasm listing that holds pages_kernel<dtype, ...>."""
    name = DTYPES[dtype]
    parts = re.split(r"(?=//-+ \.text\.)", listing)
    found = [p for p in parts if "pages_kernel" in p.split("\n", 1)[0] and name in p.split("\n", 1)[0]]
    if not found:
        raise RuntimeError(f"no pages_kernel<{name}, ...> in the compiled code: is it a variant of decode.cu?")
    return found[0]


def part_lines(source_text: str) -> dict[int, str]:
    """Source line -> the part of pages_kernel it belongs to: the `// ---- name: ...` sections inside
    the kernel, and "set-up" for its lines before the first section (in the page loop: values of
    the set-up, such as thread indices, recomputed where registers ran short)."""
    lines = source_text.split("\n")
    start = next((i for i, text in enumerate(lines) if "pages_kernel(" in text and "__global__" in text), None)
    if start is None:
        raise RuntimeError("no `__global__ ... pages_kernel(` in the source")
    part, parts = "set-up", {}
    for i in range(start, len(lines)):
        m = _PART.match(lines[i])
        if m:
            part = m.group(1)
        parts[i + 1] = part
        if lines[i].startswith("}"):
            break
    return parts


def located(disassembly: str, source: str) -> list[tuple[int, str, int | None]]:
    """(address, opcode, line of `source` where it was written) of each instruction of an `nvdisasm -gi`
    listing: the outermost call site in `source` of the inlined helpers the instruction came from."""
    rows, block, line = [], [], None
    for text in disassembly.split("\n"):
        if "//##" in text:
            block.append(text)
            continue
        m = SASS_LINE.search(text)
        if not m:
            continue
        if block:  # a new location: the outermost frame in `source` of the chain, innermost first
            line = None
            for loc in _LOCATION.finditer("\n".join(block)):
                for file, at in ((loc.group(1), loc.group(2)), (loc.group(3), loc.group(4))):
                    if file and Path(file).name == Path(source).name:
                        line = int(at)
            block = []
        rows.append((int(m.group(1), 16), m.group(3).split(".")[0], line))
    return rows


def _read(cubin: bytes) -> tuple[str, str]:
    """(cuobjdump's resource usage, nvdisasm's listing with line information) of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.cubin"
        path.write_bytes(cubin)
        try:
            usage = subprocess.run([tools() / "cuobjdump", "--dump-resource-usage", path], capture_output=True,
                                   text=True, check=True).stdout
            listing = subprocess.run([tools() / "nvdisasm", "-gi", "-c", path], capture_output=True, text=True,
                                     check=True).stdout
        except (ImportError, OSError, subprocess.CalledProcessError) as e:
            raise RuntimeError(f"reading the compiled kernel needs Triton's cuobjdump and nvdisasm: {e}") from e
    return usage, listing


def inspect_cuda(cubin: bytes, source: Path, dtype: str = "bf16") -> dict:
    """Registers, spills and the page loop's SASS (per page: `loop_*`, and `part:<name>` by part) of
    the CUDA page kernel for one dtype of the queries."""
    usage, listing = _read(cubin)
    fn = _function(listing, dtype)
    name = DTYPES[dtype]
    reg = re.search(rf"Function [^\n]*pages_kernel[^\n]*{name}[^\n]*:\s*\n\s*REG:(\d+)", usage)
    if reg is None:
        raise RuntimeError(f"cuobjdump reported no registers for pages_kernel<{name}, ...>")
    body = page_loop(fn, source)
    ops = Counter(op for _, op, _ in located(fn, str(source)))
    loop_ops = Counter(op for op, _ in body)
    by_part = Counter(part for _, part in body)
    return {"registers": int(reg.group(1)), "spill_ops": ops["STL"] + ops["LDL"],
            "loop_spill_ops": loop_ops["STL"] + loop_ops["LDL"], **family_mix(ops), **family_mix(loop_ops, "loop_"),
            **{f"part:{p}": n for p, n in by_part.items()}}


# the mangled template arguments of tail_kernel<T, X, NB>: T by dtype; X int8 ("a") or T again ("S...")
_MANGLED = {"bf16": "13__nv_bfloat16", "fp16": "6__half"}


def inspect_tail(cubin: bytes, dtype: str = "bf16", tail_bits: int = 8) -> dict:
    """Registers, spills and SASS of the CUDA tail kernel for one dtype of the queries and one tail
    width: in all, and in the body of its longest loop (`loop_*`: a 32-token block of the token loop
    of a program whose keys are in the q-buffer or the sink)."""
    usage, listing = _read(cubin)
    name = f"tail_kernelI{_MANGLED[dtype]}{'a' if tail_bits == 8 else 'S'}"
    found = [p for p in re.split(r"(?=//-+ \.text\.)", listing) if name in p.split("\n", 1)[0]]
    reg = re.search(rf"Function [^\n]*{name}[^\n]*:\s*\n\s*REG:(\d+)", usage)
    if not found or reg is None:
        raise RuntimeError(f"no tail_kernel<{DTYPES[dtype]}, {tail_bits}-bit> in the compiled code")
    fn = _resolve_labels(found[0])
    lines = [(int(m.group(1), 16), m.group(3).split(".")[0]) for m in SASS_LINE.finditer(fn)]
    loop = loop_body(fn)
    if loop is None:
        raise RuntimeError("no token loop (a branch back) in tail_kernel")
    ops = Counter(op for _, op in lines)
    body = [op for at, op in lines if loop[0] <= at <= loop[1]]
    loop_ops = Counter(body)
    return {"registers": int(reg.group(1)), "spill_ops": ops["STL"] + ops["LDL"],
            "loop_spill_ops": loop_ops["STL"] + loop_ops["LDL"], **family_mix(ops), **family_mix(loop_ops, "loop_"),
            "loop_loads_after_mma": late_loads(body)}


def late_loads(body: list[str]) -> int:
    """Global loads a loop body issues after its first tensor-core instruction. That instruction waits
    for the loads it reads, so a load issued after it goes out on a later trip to memory: zero means
    every load of the block is in flight at once."""
    first = next((i for i, op in enumerate(body) if op in FAMILIES["tensor core"]), len(body))
    return sum(op == "LDG" for op in body[first:])


def tail_report(boosted=(32,), source: Path | None = None, dtype: str = "bf16", arch: str = "sm_90a") -> pd.DataFrame:
    """Per boosted-channel count (a build) and tail width (16, 8): `inspect_tail` of the tail kernel."""
    source = Path(source or SOURCE)
    rows = []
    for nb in boosted:
        cubin = build_cubin(source, nb, 1, arch)
        for bits in (16, 8):
            rows.append({"kernel": "tail_kernel (CUDA)", "boosted": nb, "tail_bits": bits, "dtype": dtype,
                         **inspect_tail(cubin, dtype, bits)})
    return pd.DataFrame(rows)


def page_loop(fn: str, source: Path) -> list[tuple[str, str]]:
    """(opcode, part of the kernel) of each instruction of the page loop in one function's listing;
    "elsewhere" for an instruction that no line of the kernel's body wrote."""
    loop = loop_body(_resolve_labels(fn))
    if loop is None:
        raise RuntimeError("no page loop (a branch back) in pages_kernel")
    parts = part_lines(source.read_text())
    return [(op, parts.get(line, "elsewhere")) for at, op, line in located(fn, str(source)) if loop[0] <= at <= loop[1]]


def _resolve_labels(listing: str) -> str:
    """nvdisasm names branch targets `(.L_x_N)`; write them as the addresses cuobjdump would."""
    labels, pending = {}, []
    for text in listing.split("\n"):
        label = re.match(r"^\s*(\.L_x_\d+):", text)
        if label:
            pending.append(label.group(1))
            continue
        m = SASS_LINE.search(text)
        if m and pending:
            labels.update(dict.fromkeys(pending, m.group(1)))
            pending = []
    def address(m: re.Match) -> str:
        if m.group(1) not in labels:
            raise RuntimeError(f"nvdisasm's label {m.group(1)} names no instruction")
        return "0x" + labels[m.group(1)]

    return re.sub(r"`\((\.L_x_\d+)\)", address, listing)


def cuda_report(boosted=(0, 16, 32, 64), stages=(1, 2), source: Path | None = None, dtype: str = "bf16",
                arch: str = "sm_90a") -> pd.DataFrame:
    """Per boosted-channel count and stage count: `inspect_cuda` of the CUDA page kernel's build."""
    source = Path(source or SOURCE)
    rows = []
    for nb in boosted:
        for st in stages:
            info = inspect_cuda(build_cubin(source, nb, st, arch), source, dtype)
            rows.append({"kernel": "pages_kernel (CUDA)", "boosted": nb, "stages": st, "dtype": dtype, **info})
    df = pd.DataFrame(rows)
    order = [f"part:{p}" for p in dict.fromkeys([*part_lines(source.read_text()).values(), "elsewhere"])]
    df[[c for c in order if c in df]] = df[[c for c in order if c in df]].fillna(0)
    return df[[c for c in df.columns if not c.startswith("part:")] + [c for c in order if c in df.columns]]


def parts_table(df: pd.DataFrame) -> pd.DataFrame:
    """The page loop's instructions by part (rows, in source order) for each build (columns)."""
    cols = [c for c in df.columns if c.startswith("part:")]
    table = df.set_index(["boosted", "stages"])[cols].T.astype(int)
    table.index = [c.removeprefix("part:") for c in cols]
    table.loc["whole loop"] = df.set_index(["boosted", "stages"])["loop_instructions"].astype(int)
    return table
