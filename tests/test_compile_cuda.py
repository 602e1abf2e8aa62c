"""The CUDA page kernel read as machine code (`kitty_core.compile_cuda`): instructions counted where
they were written, through inlined helpers, and the page loop's tensor-core instructions matching
the kernel's structure. The compiled checks need nvcc and are skipped without it."""

import shutil
import textwrap

import pytest

from kitty_core.compile_cuda import SOURCE, _resolve_labels, cuda_report, located, part_lines, parts_table

LISTING = textwrap.dedent("""\
    .L_x_3:
    \t//## File "/usr/include/sm_20_intrinsics.hpp", line 151 inlined at "/src/decode.cu", line 84
    \t//## File "/src/decode.cu", line 84 inlined at "/src/decode.cu", line 250
            /*0010*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
    \t//## File "/src/decode.cu", line 300
            /*0020*/                   IMMA.16832.U8.S8 R8, R12, R16, R8 ;
            /*0030*/              @!P0 BRA `(.L_x_3) ;
    """)


def test_an_instruction_counts_at_its_outermost_line_in_the_kernels_source():
    assert located(LISTING, "/src/decode.cu") == [(0x10, "LDGSTS", 250), (0x20, "IMMA", 300), (0x30, "BRA", 300)]
    assert "@!P0 BRA 0x0010" in _resolve_labels(LISTING)


def test_the_kernels_parts_are_its_marked_sections_in_source_order():
    source = textwrap.dedent("""\
        __device__ int helper() { return 1; }
        __global__ void pages_kernel(const PageArgs a) {
          for (int i = 0; i < n; ++i) {
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
    assert (parts[4], parts[6], parts[8]) == ("page copies", "scores", "online softmax")
    assert 1 not in parts and 11 not in parts


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_the_page_loop_holds_the_kernels_mmas_and_every_instruction_has_a_part():
    """A page is 4 token quarters x 2 halves: keys 4 k-tiles of m16n8k32 each (+1 for the boosted
    channels' high codes at 32 boosted), values 2 channel tiles x 4 code planes of m16n8k16 each."""
    df = cuda_report(boosted=(0, 32), stages=(1,))
    assert df["loop_tensor core"].tolist() == [8 * 4 + 8 * 8, 8 * 5 + 8 * 8]
    table = parts_table(df)
    assert "elsewhere" not in table.index  # every instruction of the loop is in the kernel's own lines
    assert (table.drop("whole loop").sum() == table.loc["whole loop"]).all()
    named = [p for p in part_lines(SOURCE.read_text()).values()]
    assert list(table.index[:-1]) == list(dict.fromkeys(p for p in named if p in table.index))
    assert (df["registers"] <= 128).all()  # one stage: four blocks an SM


@pytest.mark.parametrize("args, said", [
    (["--boosted", "7"], "built for 0, 16, 32, 64 boosted channels"),
    (["--cuda-stages", "3"], "1 or 2 cp.async stages"),
    (["--cuda-source", "/no/such/decode.cu"], "no file /no/such/decode.cu"),
])
def test_a_build_the_kernel_does_not_have_is_a_one_line_error(args, said, capsys):
    from kitty_core.compile import main

    with pytest.raises(SystemExit) as exit_:
        main(["--cuda", *args])
    assert exit_.value.code == 2 and said in capsys.readouterr().err
