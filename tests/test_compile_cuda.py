"""The CUDA page kernel read as machine code (`kitty_core.compile_cuda`): instructions counted where
they were written, through inlined helpers, and the page loop's tensor-core instructions matching
the kernel's structure, each in its part; and the tail kernel's token loop. The compiled checks need nvcc and are skipped without it."""

import shutil
import subprocess
import tempfile
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from kitty_core import compile_cuda
from kitty_core.compile_cuda import SOURCE, _function, _resolve_labels, build_cubin, located, page_loop, part_lines
from kitty_core.sass import loop_body, tools

# as `nvdisasm -gi` prints it: a location is a chain, innermost frame first, the outermost on its own line
LISTING = textwrap.dedent("""\
    .L_x_3:
    \t//## File "/usr/include/sm_20_intrinsics.hpp", line 151 inlined at "/src/decode.cu", line 84
    \t//## File "/src/decode.cu", line 84 inlined at "/src/decode.cu", line 250
    \t//## File "/src/decode.cu", line 250
            /*0010*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
    \t//## File "/src/decode.cu", line 300
            /*0020*/                   IMMA.16832.U8.S8 R8, R12, R16, R8 ;
            /*0030*/              @!P0 BRA `(.L_x_3) ;
    \t//## File "/usr/include/cuda_fp16.hpp", line 980
            /*0040*/                   HADD2.F32 R1, -RZ, R2.H0_H0 ;
    """)


def test_an_instruction_counts_at_its_outermost_line_in_the_kernels_source():
    assert located(LISTING, "/src/decode.cu") == [(0x10, "LDGSTS", 250), (0x20, "IMMA", 300), (0x30, "BRA", 300),
                                                  (0x40, "HADD2", None)]
    assert "@!P0 BRA 0x0010" in _resolve_labels(LISTING)
    with pytest.raises(RuntimeError, match="names no instruction"):
        _resolve_labels(LISTING.replace("BRA `(.L_x_3)", "BRA `(.L_x_9)"))


# a loop as ptxas closes it for sm_89: a plain branch back, left by a predicated call; after the last
# EXIT, a divergent shuffle's fallback that branches back into the body
CLOSED_BY_A_PLAIN_BRANCH = textwrap.dedent("""\
            /*0000*/                   MOV R1, c[0x0][0x28] ;
            /*0010*/                   LDS R2, [R3] ;
            /*0020*/                   BRA.DIV ~URZ, 0x0080 ;
            /*0030*/                   SHFL.BFLY PT, R4, R2, 0x1, 0x1f ;
            /*0040*/               @P0 CALL.REL.NOINC 0x0060 ;
            /*0050*/                   BRA 0x0010 ;
            /*0060*/                   EXIT ;
            /*0070*/                   BRA 0x0070 ;
            /*0080*/                   CALL.REL.NOINC 0x0100 ;
            /*0090*/                   BRA 0x0030 ;
    """)


def test_the_loop_is_the_longest_branch_back_before_the_last_exit():
    assert loop_body(CLOSED_BY_A_PLAIN_BRANCH) == (0x10, 0x50)
    assert loop_body(_resolve_labels(LISTING)) == (0x10, 0x30)  # closed by a conditional branch
    assert loop_body(CLOSED_BY_A_PLAIN_BRANCH.replace("BRA 0x0010", "BRA 0x0060")) is None


def test_the_kernels_parts_are_its_marked_sections():
    source = textwrap.dedent("""\
        __device__ int helper() { return 1; }
        __global__ void pages_kernel(const PageArgs a) {
          for (int i = 0; i < n; ++i) {
            // ---- page copies: the next page ----
            cp_wait<0>();
            // ---- scores: tiles ----
            x = 1;
            // ---- online softmax (base 2) ----
            y = 2;
          }
        }
        int after;
        """)
    parts = part_lines(source)
    assert (parts[3], parts[5], parts[7], parts[9]) == ("set-up", "page copies", "scores", "online softmax")
    assert 1 not in parts and 12 not in parts


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")


@needs_nvcc
@pytest.mark.parametrize("n_boost, arch", [(0, "sm_90a"), (32, "sm_90a"), (32, "sm_89")])
def test_each_mma_of_the_page_loop_is_counted_in_its_part(n_boost, arch):
    """A page is 4 token quarters x 2 halves: keys 4 k-tiles of m16n8k32 each (+1 for the boosted
    channels' high codes), values 2 channel tiles x 4 code planes of m16n8k16 each and one for the
    weights' sums and zero dots; the queries' zero and scale dots one m16n8k16 per 16 channels. The
    MMAs are written in a helper (`mma`, `mma_u8s8`)
    far from the kernel, and the key scores in another (`page_key_scores`, which the tail kernel
    shares): each must count where the kernel calls it. At one stage a page's key half and value
    half are copied at two places of the loop. The same for Ada, whose loop ptxas closes otherwise."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "pages.cubin"
        cubin.write_bytes(build_cubin(SOURCE, n_boost, 1, arch))
        listing = subprocess.run([tools() / "nvdisasm", "-gi", "-c", cubin], capture_output=True, text=True,
                                 check=True).stdout
    body = page_loop(_function(listing, "bf16"), SOURCE)
    mmas = {(op, part) for op, part in body if op in ("HMMA", "IMMA")}
    assert mmas == {("HMMA", "values"), ("HMMA", "key scores"), ("IMMA", "key scores")}
    assert sum(op == "HMMA" for op, part in body if part == "values") == 8 * (8 + 1)
    assert sum(op == "HMMA" for op, part in body if part != "values") == 128 // 16
    assert sum(op == "IMMA" for op, _ in body) == 8 * (4 + (n_boost > 0))
    copies = Counter(part for op, part in body if op == "LDGSTS")
    assert set(copies) == {"page copies, at one stage"}
    assert copies["page copies, at one stage"] == 2 * 8 + 2 + n_boost // 16 + (n_boost > 0)  # planes, scales
    assert all(part != "elsewhere" for _, part in body)


@needs_nvcc
def test_the_tail_kernels_token_loop_holds_a_32_token_blocks_mmas():
    """The tail kernel's longest loop is a 32-token block of a program whose keys are in a buffer: two
    score tiles of 8 k-steps each and two weight tiles over 8 channel tiles, 32 m16n8k16 in all, at
    either tail width, and at 8 bits one more a weight tile for the codes' offset; an 8-bit tail's codes
    add their conversions to the loop (byte permutes and LOP3s) and their scales (fp32 products)."""
    report = compile_cuda.tail_report((32,))
    assert list(report["tail_bits"]) == [16, 8]
    assert list(report["loop_tensor core"]) == [32, 32 + 2]
    wide, narrow = report.iloc[0], report.iloc[1]
    assert narrow["loop_integer/bit"] > wide["loop_integer/bit"] and narrow["loop_float"] > wide["loop_float"]
    # a lane's loads a block: 4 key rows (tokens of rows g, g + 8, twice) and 8 value rows, in 16-byte pieces:
    # at 16 bits 4 a key row, 2 a value row (32); at 8 bits 2 and 1, and the 8 rows' scales (24)
    assert list(report["loop_global load"]) == [32, 24]
    assert ((0 <= report["loop_loads_after_mma"]) & (report["loop_loads_after_mma"] <= report["loop_global load"])).all()


def test_late_loads_counts_the_loads_after_the_first_mma():
    assert compile_cuda.late_loads(["LDG", "LDG", "IMAD", "HMMA", "LDG", "HMMA", "LDG", "SHFL"]) == 2
    assert compile_cuda.late_loads(["LDG", "LDG", "HMMA", "HMMA"]) == 0
    assert compile_cuda.late_loads(["LDG", "FADD"]) == 0  # no MMA: nothing waits


@pytest.mark.parametrize("args, said", [
    (["--cuda", "--boosted", "7"], "built for 0, 16, 32, 64 boosted channels"),
    (["--cuda", "--cuda-stages", "3"], "1 or 2 cp.async stages"),
    (["--cuda", "--cuda-source", "/no/such/decode.cu"], "no file /no/such/decode.cu"),
    (["--parts"], "which --cuda asks for"),
])
def test_a_build_the_kernel_does_not_have_is_a_one_line_error(args, said, capsys):
    from kitty_core.compile import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_without_nvcc_the_report_says_what_to_install(monkeypatch, capsys):
    from kitty_core.compile import main

    monkeypatch.setattr(compile_cuda.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as exit_:
        main(["--cuda", "--boosted", "0", "--cuda-stages", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "nvcc not found: install the CUDA toolkit" in err and "Traceback" not in err
