"""Reading SASS, the GPU's machine code, as the disassemblers print it: instructions with their
addresses, the opcode families they fall in, the body of a kernel's longest loop, and where the
tools are (Triton's wheel ships cuobjdump and nvdisasm). Used by `kitty_core.compile` (the Triton
kernels) and `kitty_core.compile_cuda` (the CUDA page kernel)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

# SASS opcode families (the opcode before the first dot)
FAMILIES = {
    "tensor core": {"HMMA", "HGMMA", "IMMA", "IGMMA", "QMMA", "QGMMA"},
    "global load": {"LDG"},
    "shared": {"LDS", "STS", "LDSM", "STSM"},
    "integer/bit": {"LOP3", "SHF", "PRMT", "IADD3", "IMAD", "LEA", "SGXT", "BMSK", "ISETP", "SEL", "IMNMX", "VIMNMX"},
    "conversion": {"F2F", "I2F", "F2I", "I2FP", "F2FP", "I2I"},
    "float": {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "HADD2", "HFMA2", "HMUL2", "FMNMX3"},
    "exp": {"MUFU"},
    "shuffle": {"SHFL"},
}


def tools() -> Path:
    """The folder of Triton's CUDA binaries (ptxas, cuobjdump, nvdisasm)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")


def loop_body(sass: str) -> tuple[int, int] | None:
    """Address range of the longest loop: a branch back to a lower address, conditional or not (for
    sm_89 ptxas closes a loop with a plain branch and leaves it by a predicated call). Only branches
    before the code's last unconditional EXIT count: the blocks after it (the fallbacks of divergent
    shuffles) branch back into the body they were called from, and close no loop."""
    lines = list(SASS_LINE.finditer(sass))
    exits = [int(m.group(1), 16) for m in lines if m.group(3) == "EXIT" and not m.group(2)]
    end = max(exits, default=None)
    best = None
    for m in lines:
        target = re.search(r"0x([0-9a-f]+)", m.group(4))
        if m.group(3) == "BRA" and target:
            at, to = int(m.group(1), 16), int(target.group(1), 16)
            if to < at and (end is None or at < end) and (best is None or at - to > best[1] - best[0]):
                best = (to, at)
    return best


def family_mix(ops: Counter, prefix: str = "") -> dict:
    """Opcode counts summed by family (`FAMILIES`; the rest as "other"), keys prefixed."""
    family_of = {op: fam for fam, members in FAMILIES.items() for op in members}
    row = {f"{prefix}instructions": sum(ops.values())}
    for fam in FAMILIES:
        row[prefix + fam] = sum(n for op, n in ops.items() if family_of.get(op) == fam)
    row[prefix + "other"] = row[f"{prefix}instructions"] - sum(row[prefix + f] for f in FAMILIES)
    return row
