"""The decode kernels compiled for an H100/H200 (sm_90) by Triton's own ptxas, without a GPU: the
page kernel's spills stay few (the 128-register cap it runs with for GQA groups of 4 spills some in
its loop, which measured faster than 160 registers or no cap; groups of 8 run spill-free in the loop
at 192), and unpacking codes in PTX must cost well under half the integer work of unpacking them
element by element. Run in a subprocess: the test session runs kernels in the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (
    "import json; from kitty_core.compile import report; "
    "print(json.dumps(report('kitty-pro', ('ptx', 'bits')).to_dict(orient='records') "
    "+ report('kitty-pro', ('ptx',), q_heads=64).iloc[1:].assign(kernel='pages, groups of 8')"
    ".to_dict(orient='records')))"
)


def test_page_kernel_compiles_for_sm90_without_spills_in_its_loop():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["kernel"], r["unpack"]): r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    pages = rows[("_decode_pages_kernel", "ptx")]
    assert pages["loop_spill_ops"] <= 32 and pages["spill_ops"] <= 80 and pages["registers"] <= 128
    assert rows[("_decode_tail_kernel", "ptx")]["spill_ops"] == 0
    assert rows[("pages, groups of 8", "ptx")]["loop_spill_ops"] == 0  # GQA groups of 8 heads: a higher cap
    assert pages["loop_instructions"] > 0  # the page loop was found
    bits = rows[("_decode_pages_kernel", "bits")]
    assert pages["loop_integer/bit"] < 0.5 * bits["loop_integer/bit"]


KEY_DOTS_SCRIPT = (
    "import json; from kitty_core.compile import report; "
    "print(json.dumps(report('kitty-pro', ('ptx',), key_dots=('fp16', 'int8'), num_stages=3, max_registers=168, "
    "pages_per_program=32).iloc[1:].to_dict(orient='records')))"
)


def test_int8_key_dots_compile_to_int8_tensor_cores_without_spills_at_a_deep_grids_settings():
    """The int8 key dots at batch 489's launch settings (3 stages, 168 registers): spill-free, with
    fewer tensor-core and integer instructions per page than the fp16 dots (the key unpacking)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", KEY_DOTS_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["key_dots"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    fp16, int8 = rows["fp16"], rows["int8"]
    assert int8["spill_ops"] == 0 and fp16["spill_ops"] == 0
    assert int8["loop_tensor core"] < fp16["loop_tensor core"]
    assert int8["loop_integer/bit"] < 0.8 * fp16["loop_integer/bit"]


NEW_TOKEN_SCRIPT = (
    "import json; from kitty_core.compile import report; "
    "print(json.dumps([report('kitty-pro', ('ptx',), new_token=new).iloc[0].to_dict() for new in (False, True)]))"
)


def test_the_tail_that_writes_a_steps_token_keeps_the_plain_tails_registers():
    """A graph-replayed step's tail kernel stores the step's token and reads it back after a barrier
    of the program's threads: a few registers more than the plain tail, not the 25 more that taking
    the token into its tiles from registers cost (five programs an SM where the plain tail fits
    seven)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", NEW_TOKEN_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    plain, new = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain["kernel"] == new["kernel"] == "_decode_tail_kernel"
    assert new["spill_ops"] == 0 and new["registers"] <= plain["registers"] + 4
    assert 65536 // (new["registers"] * 128) >= 7  # seven programs of four warps an SM
