"""The page and tail parts of fused decode attention as CUDA C++ kernels (`kernels/cuda/decode.cu`),
built at first use with `torch.utils.cpp_extension.load_inline` and cached by torch's extension cache.

The page kernel reads the library's packed pages as they are stored (`kitty_core.page_pool.PagePool`)
and writes the same partial softmaxes as the Triton page kernel; the tail kernel (`tail_partials`:
the sink, q-buffer and value window, 16-bit or 8-bit) writes the Triton tail kernel's, and the
Triton combine merges them: `decode_attention` is the Triton step with its page launch and (unless
`tail="triton"`) its tail launch replaced. Why the layout is chosen there (tensor-core fragments built from
codes in registers, query heads as the narrow operand, the score tile transposed into the value
operand with `movmatrix`, cp.async stages per warp, key dots in 8 bits) is written at the top of the
.cu file. Its key dots are int8, rounded as the Triton kernel's int8 key dots are (the library's
choice at this head size, `kernels.decode.INT8_KEY_DOTS_FROM`), so the two kernels agree to within
that rounding.

It takes head and page size 128, two-bit values, 0, 16, 32 or 64 boosted channels (0%, 12.5%, 25%,
50% of 128), up to 8 query heads per KV head, fp16 or bf16 queries, on a GPU of compute capability
8.0 or more with nvcc. `unsupported` says why not otherwise; callers then use the Triton kernel.
Importing this module needs neither CUDA nor nvcc.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cuda" / "decode.cu"
HEAD_DIM = GROUP = 128
BOOSTED = (0, 16, 32, 64)  # boosted channel counts with a build
MAX_REP = 8  # query heads per KV head (the n = 8 operand)
WARPS = 4  # programs (warps) per block: 2 blocks an SM at two cp.async stages, 3 at one
# Grids of more than DEEP_WAVES waves (at two blocks an SM) take one stage (a page buffer whose key
# and value halves are pipelined). On one H200 (Qwen3-8B heads, bf16, 25% boost, `docs/engine.md`)
# one stage, then at four blocks an SM, took 5.6% and 7.2% off the step at 544 x 4,704 and
# 256 x 16,384 tokens (8 waves) and added 2-9% on the grids of about one wave, each at its best pages
# per program (64 x 8,192, 8 x 32,768, 1 x 131,072). At one stage every build now fits three blocks
# an SM (168 registers a thread, `__launch_bounds__`; 48-65 KiB of shared memory a block), which took
# another 5-6% off both deep grids
DEEP_WAVES = 2
NVCC_FLAGS = ["-O3"]  # besides torch's own (`torch.utils.cpp_extension.COMMON_NVCC_FLAGS`)
# a `build` slower than this ran nvcc (on one H200: 27 s a build; a whole process that loaded one from
# torch's extension cache, 4 s)
BUILT_AFTER_S = 10.0
TAILS = ("cuda", "triton")  # the kernels that can read the tail beside the CUDA page kernel

_BINDING = r"""
#include <vector>
int64_t page_partials(std::vector<int64_t> p, std::vector<int64_t> n, double scaling) {
  kitty::PageArgs a;
  a.q = reinterpret_cast<const void*>(p[0]);
  a.kd = reinterpret_cast<const uint8_t*>(p[1]); a.kh = reinterpret_cast<const uint8_t*>(p[2]);
  a.kc = reinterpret_cast<const uint8_t*>(p[3]);
  a.ks = reinterpret_cast<const half*>(p[4]); a.kz = reinterpret_cast<const half*>(p[5]);
  a.vl = reinterpret_cast<const uint8_t*>(p[6]);
  a.vs = reinterpret_cast<const half*>(p[7]); a.vz = reinterpret_cast<const half*>(p[8]);
  a.kt = reinterpret_cast<const int*>(p[9]); a.vt = reinterpret_cast<const int*>(p[10]);
  a.nvp = reinterpret_cast<const int*>(p[11]);
  a.m = reinterpret_cast<float*>(p[12]); a.l = reinterpret_cast<float*>(p[13]);
  a.acc = reinterpret_cast<void*>(p[14]);
  a.sQb = n[0]; a.sQh = n[1]; a.sKDp = (int)n[2]; a.sKDh = n[3]; a.sKHp = (int)n[4]; a.sKHh = n[5];
  a.sKCp = (int)n[6]; a.sKCh = n[7]; a.sKSp = (int)n[8]; a.sKSh = n[9]; a.sVLp = (int)n[10]; a.sVLh = n[11];
  a.sVSp = (int)n[12]; a.sVSh = n[13]; a.sKT = n[14]; a.sVT = n[15];
  a.sMb = n[16]; a.sMh = n[17]; a.sAb = n[18]; a.sAh = n[19]; a.sAc = n[20];
  a.batch = n[21]; a.hkv = n[22]; a.rep = n[23]; a.ppp = n[24]; a.chunks = n[25]; a.chunk0 = n[26];
  a.scaling = (float)scaling;
  return kitty_pages_launch(a, (int)n[27], (int)n[28], reinterpret_cast<void*>(p[15]));
}

int64_t tail_partials(std::vector<int64_t> p, std::vector<int64_t> n, double scaling) {
  kitty::TailArgs t{};
  kitty::PageArgs& a = t.p;
  a.q = reinterpret_cast<const void*>(p[0]);
  a.kd = reinterpret_cast<const uint8_t*>(p[1]); a.kh = reinterpret_cast<const uint8_t*>(p[2]);
  a.kc = reinterpret_cast<const uint8_t*>(p[3]);
  a.ks = reinterpret_cast<const half*>(p[4]); a.kz = reinterpret_cast<const half*>(p[5]);
  a.kt = reinterpret_cast<const int*>(p[6]); a.nvp = reinterpret_cast<const int*>(p[7]);
  a.m = reinterpret_cast<float*>(p[8]); a.l = reinterpret_cast<float*>(p[9]); a.acc = reinterpret_cast<void*>(p[10]);
  t.ks = reinterpret_cast<const void*>(p[11]); t.vs = reinterpret_cast<const void*>(p[12]);
  t.kb = reinterpret_cast<void*>(p[13]); t.vw = reinterpret_cast<void*>(p[14]);
  t.kss = reinterpret_cast<const float*>(p[15]); t.vss = reinterpret_cast<const float*>(p[16]);
  t.kbs = reinterpret_cast<float*>(p[17]); t.vws = reinterpret_cast<float*>(p[18]);
  t.lens = reinterpret_cast<const int*>(p[19]); t.nkp = reinterpret_cast<const int*>(p[20]);
  t.kn = reinterpret_cast<const void*>(p[21]); t.vn = reinterpret_cast<const void*>(p[22]);
  t.w = reinterpret_cast<const long long*>(p[23]);
  a.sQb = n[0]; a.sQh = n[1]; a.sKDp = (int)n[2]; a.sKDh = n[3]; a.sKHp = (int)n[4]; a.sKHh = n[5];
  a.sKCp = (int)n[6]; a.sKCh = n[7]; a.sKSp = (int)n[8]; a.sKSh = n[9]; a.sKT = n[10];
  a.sMb = n[11]; a.sMh = n[12]; a.sAb = n[13]; a.sAh = n[14]; a.sAc = n[15];
  t.sSb = n[16]; t.sSh = n[17]; t.sSt = n[18]; t.sKBb = n[19]; t.sKBh = n[20]; t.sKBt = n[21];
  t.sVWb = n[22]; t.sVWh = n[23]; t.sVWt = n[24]; t.sKNb = n[25]; t.sKNh = n[26]; t.sVNb = n[27]; t.sVNh = n[28];
  t.sW = n[29];
  a.batch = n[30]; a.hkv = n[31]; a.rep = n[32]; t.sink = n[33]; t.nt = n[34]; t.fresh = n[35];
  a.scaling = (float)scaling;
  return kitty_tail_launch(t, (int)n[36], (int)n[37], (int)n[38], reinterpret_cast<void*>(p[24]));
}
"""


def unsupported(head_dim: int, group_size: int, n_boost: int, value_bits: int, rep: int, dtype: torch.dtype,
                device: torch.device) -> str | None:
    """Why the CUDA page kernel does not take this layer and query (None: it does)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < 8.0 (no cp.async / mma m16n8k16, m16n8k32)"
    if (head_dim, group_size) != (HEAD_DIM, GROUP):
        return f"built for head and page size {HEAD_DIM}, got head size {head_dim}, page size {group_size}"
    if value_bits != 2:
        return f"built for 2-bit values, got {value_bits}-bit"
    if n_boost not in BOOSTED:
        return f"built for {BOOSTED} boosted channels, got {n_boost}"
    if rep > MAX_REP:
        return f"at most {MAX_REP} query heads per KV head, got {rep}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"fp16 or bf16 queries, got {dtype}"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) found"
    return None


def extension_name(n_boost: int, stages: int, source: Path | None = None) -> str:
    """The name a build is cached under: a variant of the kernel's source (`source`, a file of the same
    interface as SOURCE) gets one of its own from its text, so that it and the shipped kernel load
    side by side in one process (`bench kernels --cuda --variants`)."""
    name = f"kitty_pages_nb{n_boost}_s{stages}"
    if source is None:
        return name
    return f"{name}_{hashlib.sha1(Path(source).read_bytes()).hexdigest()[:12]}"


@functools.lru_cache(maxsize=None)
def _build(n_boost: int, stages: int, source: Path | None = None):
    """The extension for `n_boost` boosted channels and `stages` cp.async stages, from SOURCE or a
    variant of it (built once, then loaded from torch's extension cache)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=extension_name(n_boost, stages, source),
        cpp_sources="int64_t page_partials(std::vector<int64_t> p, std::vector<int64_t> n, double scaling);\n"
                    "int64_t tail_partials(std::vector<int64_t> p, std::vector<int64_t> n, double scaling);",
        cuda_sources=[Path(source or SOURCE).read_text(), _BINDING],
        functions=["page_partials", "tail_partials"],
        extra_cuda_cflags=[*NVCC_FLAGS, f"-DKITTY_NB={n_boost}", f"-DKITTY_STAGES={stages}"],
    )


@functools.lru_cache(maxsize=None)
def build(n_boost: int, source: Path | None = None) -> str | None:
    """Build (or load) the kernel for `n_boost` at both pipeline depths the launch plan picks from, so
    that no build falls inside a CUDA graph's capture; the error's text where that fails, else None.
    Once per process, a failure included: a broken toolchain is not tried again by every cache. The
    two depths build side by side (two nvcc processes; torch locks each build's own directory). A
    build that ran nvcc (not a load from torch's extension cache) is reported at WARNING, with its time.
    `source`: a variant of the kernel's source instead (`extension_name`)."""
    log.info("loading the CUDA page kernel for %d boosted channels (nvcc builds it on first use)", n_boost)
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda stages: _build(n_boost, stages, source), (1, 2)))  # as page_partials calls it
    except Exception as e:  # noqa: BLE001 - any toolchain failure means: use Triton
        return f"the CUDA build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    took = time.perf_counter() - start
    if took > BUILT_AFTER_S:
        log.warning("built the CUDA page kernel for %d boosted channels with nvcc in %.0f s; torch's extension "
                    "cache keeps it for later processes", n_boost, took)
    return None


def _planes_ok(name: str, t: torch.Tensor) -> None:
    """A pool plane [P, H, rows, width] (logical) must be stored [P, H, width, rows], contiguous per page
    and head, as `PagePool` stores it."""
    if t.stride(2) != 1 or t.stride(3) != max(t.shape[2], 1) or t.data_ptr() % 16:
        raise ValueError(f"{name}: expected the pool's transposed, 16-byte aligned planes, got strides {t.stride()}")


def pool_layout(k_pages: dict, v_pages: dict) -> bool:
    """Are the planes stored as `PagePool` stores them (the layout `page_partials` reads)?"""
    try:
        _planes_ok("key dense plane", k_pages["dense"])
        if k_pages["high"].shape[2]:
            _planes_ok("key high plane", k_pages["high"])
        _planes_ok("value plane", v_pages["low"])
    except ValueError:
        return False
    return True


def page_partials(q: torch.Tensor, k_pages: dict, v_pages: dict, k_table: torch.Tensor, v_table: torch.Tensor,
                  n_vpages: torch.Tensor, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, *, rep: int,
                  first_chunk: int, pages_per_program: int, chunks: int, scaling: float, stages: int = 2,
                  source: Path | None = None) -> None:
    """Launch the page kernel on the current stream: program (sequence, KV head, c) for c < `chunks`
    attends query heads [B, h*rep .. (h+1)*rep) of q [B, Hq, D] to its share of the n = n_vpages[b]
    packed slots, split evenly over the chunks (slots c*k .. (c+1)*k - 1 below n, k = ceil(n / chunks)),
    and writes partial `first_chunk` + c of m, l [B, Hq, C] (fp32) and acc [B, Hq, C, D] (q's dtype).
    The caller sizes `chunks` at ceil(slots / `pages_per_program`) for slots >= every n (as
    `decode_attention` and `DecodeStep` do), so that no program takes more than `pages_per_program`
    <= 32: a warp holds its run's page ids one a lane. k_pages / v_pages: the pools' field tensors
    (dense, high, boost_ch, scale, zero / low, scale, zero), tables [B, width] and counts [B] int32.
    `source`: a variant of the kernel's source, built by `build(n_boost, source)` first."""
    kd, kh, kc, ks, kz = (k_pages[f] for f in ("dense", "high", "boost_ch", "scale", "zero"))
    vl, vs, vz = (v_pages[f] for f in ("low", "scale", "zero"))
    nb = kh.shape[2]
    b, hq, d = q.shape
    hkv = kd.shape[1]
    if not 1 <= pages_per_program <= 32:
        raise ValueError(f"pages_per_program must be in [1, 32], got {pages_per_program}")
    if stages not in (1, 2):  # the depths `build` compiles ahead of any graph capture
        raise ValueError(f"stages must be 1 or 2, got {stages}")
    _planes_ok("key dense plane", kd)
    if nb:
        _planes_ok("key high plane", kh)
    _planes_ok("value plane", vl)
    for name, t in (("q", q), ("boost index", kc), ("key scale", ks), ("key zero", kz), ("value scale", vs),
                    ("value zero", vz), ("m", m), ("l", l), ("acc", acc)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if k_table.dtype != torch.int32 or v_table.dtype != torch.int32 or n_vpages.dtype != torch.int32:
        raise ValueError("page tables and counts must be int32")
    if acc.dtype != q.dtype or m.dtype != torch.float32 or l.dtype != torch.float32:
        raise ValueError(f"partials: m, l float32 and acc in the query's dtype, got {m.dtype}, {l.dtype}, {acc.dtype}")
    page_strides = (kd.stride(0), kh.stride(0), kc.stride(0), ks.stride(0), vl.stride(0), vs.stride(0))
    if max(page_strides) >= 2**31:  # the kernel takes them as int (one IMAD.WIDE a page id)
        raise ValueError(f"a page's stride in a pool must be below 2^31 elements, got {max(page_strides)}")
    ext = _build(nb, stages, source)
    ptrs = [q.data_ptr(), kd.data_ptr(), kh.data_ptr() if nb else kd.data_ptr(), kc.data_ptr() if nb else kd.data_ptr(),
            ks.data_ptr(), kz.data_ptr(), vl.data_ptr(), vs.data_ptr(), vz.data_ptr(), k_table.data_ptr(),
            v_table.data_ptr(), n_vpages.data_ptr(), m.data_ptr(), l.data_ptr(), acc.data_ptr(),
            torch.cuda.current_stream(q.device).cuda_stream]
    sizes = [q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), kh.stride(0), kh.stride(1),
             kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), vl.stride(0), vl.stride(1),
             vs.stride(0), vs.stride(1), k_table.stride(0), v_table.stride(0),
             m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
             b, hkv, rep, pages_per_program, chunks, first_chunk, int(q.dtype == torch.bfloat16), WARPS]
    err = ext.page_partials(ptrs, sizes, scaling * 1.4426950408889634)  # scores in base 2
    if err:
        raise RuntimeError(f"the CUDA page kernel did not launch (error {err})")


def tail_partials(q: torch.Tensor, state: dict, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, *, rep: int,
                  sink: int, window_slots: int, scaling: float, new: tuple | None = None,
                  source: Path | None = None, stream: torch.cuda.Stream | None = None) -> None:
    """Launch the tail kernel on the current stream: program (sequence, KV head, c) for c <= `window_slots`
    attends query heads [B, h*rep .. (h+1)*rep) of q [B, Hq, D] to the sink (c = 0) or to window slot
    n_vpages[b] + c - 1 (values from the value window, keys from the key q-buffer or, once packed, the
    key page), and writes partial c of m, l, acc (as `page_partials`). `state`: the layer's
    `kernel_state()` (16-bit or 8-bit tail buffers, its `tail_scales`). `new` = (keys [B, H, D], values
    [B, H, D], write positions [2, B]): the step's token, which the program of its slot writes into the
    key q-buffer and the value window first, as the Triton tail kernel does (positions int64, as
    `KittyLayer.steps.write` keeps them). `stream`: where to launch (None: the current stream)."""
    kp = state["k_pages"]
    kd, kh, kc, ks, kz = (kp[f] for f in ("dense", "high", "boost_ch", "scale", "zero"))
    sk, sv, kb, vw = tail = state["k_sink"], state["v_sink"], state["k_buffer"], state["v_window"]
    scales = state.get("tail_scales")
    tail8 = scales is not None
    if tail8 and not all(t.is_contiguous() for t in (*tail, *scales)):
        raise ValueError("an 8-bit tail's codes and scales must be contiguous tensors")
    kn, vn, write = new if new is not None else (q, q, state["k_table"])  # (not read)
    for name, t in (("q", q), ("key sink", sk), ("value sink", sv), ("key q-buffer", kb), ("value window", vw),
                    ("the step's keys", kn), ("the step's values", vn)):
        rows = 16 // t.element_size()  # the kernel loads rows 16 bytes at a time
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(x % rows for x in t.stride()[:-1]):
            raise ValueError(f"{name} must be contiguous in its last dim with 16-byte aligned rows, got strides "
                             f"{t.stride()} of {t.dtype}")
    if not tail8 and sk.dtype != q.dtype:
        raise ValueError(f"a 16-bit tail is stored in the query's dtype, got {sk.dtype} and {q.dtype}")
    if new is not None and (write.dtype != torch.int64 or write.stride(-1) != 1):
        raise ValueError(f"the write positions must be int64 and contiguous per row, got {write.dtype}, {write.stride()}")
    b, hkv = q.shape[0], kd.shape[1]
    nb = kh.shape[2]
    ext = _build(nb, 1, source)  # the tail is in every build of the source: the one-stage build's
    kt, lens, nkp, nvp = state["k_table"], state["lens"], state["n_kpages"], state["n_vpages"]
    if any(t.dtype != torch.int32 for t in (kt, lens, nkp, nvp)):
        raise ValueError("the key page table, lengths and page counts must be int32")
    sc = scales if tail8 else (sk, sk, sk, sk)  # (16-bit tail: not read)
    ptrs = [q.data_ptr(), kd.data_ptr(), kh.data_ptr() if nb else kd.data_ptr(), kc.data_ptr() if nb else kd.data_ptr(),
            ks.data_ptr(), kz.data_ptr(), kt.data_ptr(), nvp.data_ptr(), m.data_ptr(), l.data_ptr(), acc.data_ptr(),
            sk.data_ptr(), sv.data_ptr(), kb.data_ptr(), vw.data_ptr(), *(t.data_ptr() for t in sc),
            lens.data_ptr(), nkp.data_ptr(), kn.data_ptr(), vn.data_ptr(), write.data_ptr(),
            (stream or torch.cuda.current_stream(q.device)).cuda_stream]
    sizes = [q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), kh.stride(0), kh.stride(1), kc.stride(0),
             kc.stride(1), ks.stride(0), ks.stride(1), kt.stride(0), m.stride(0), m.stride(1), acc.stride(0),
             acc.stride(1), acc.stride(2), sk.stride(0), sk.stride(1), sk.stride(2), kb.stride(0), kb.stride(1),
             kb.stride(2), vw.stride(0), vw.stride(1), vw.stride(2), kn.stride(0), kn.stride(1), vn.stride(0),
             vn.stride(1), write.stride(0), b, hkv, rep, sink, window_slots, int(new is not None),
             int(q.dtype == torch.bfloat16), int(tail8), WARPS]
    err = ext.tail_partials(ptrs, sizes, scaling * 1.4426950408889634)  # scores in base 2
    if err:
        raise RuntimeError(f"the CUDA tail kernel did not launch (error {err})")


def launch_plan(pairs: int, slots: int, sms: int, pages_per_program: int | None = None) -> tuple[int, int]:
    """(pages per program, cp.async stages) for `pairs` (sequence, KV head) runs of up to `slots` packed
    pages on `sms` SMs. Pages per program, unless given: the largest power of two up to 32 that still
    fills about one wave of programs (an SM holds 2 x WARPS of them at two stages): long runs keep the
    pipeline full and write few partials, and one wave keeps every SM streaming. Stages: two (each
    warp's next page in flight while it computes one) where the grid is up to DEEP_WAVES waves; one
    on deeper grids, where a block's 61 KiB instead of 101 KiB of shared memory (at 25% boost) and 168
    registers a thread let three blocks share an SM instead of two, and each warp still copies one half of a page while it
    computes the other. `python -m kitty_core.bench kernels --cuda --ppp 4,8,16,32 --stages 1,2` times others."""
    resident = sms * 2 * WARPS
    ppp = pages_per_program
    if ppp is None:
        ppp = next((p for p in (32, 16, 8, 4) if pairs * -(-slots // p) >= 0.9 * resident), 2)
    return ppp, 1 if pairs * -(-slots // ppp) > DEEP_WAVES * resident else 2


@functools.lru_cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def step_launches(layer, query: torch.Tensor, scaling: float, workspace: dict | None = None,
                  state: dict | None = None, pages_per_program: int | None = None, new: tuple | None = None,
                  stages: int | None = None, source: Path | None = None, tail: str = "cuda"):
    """The three launches of `decode_attention` as callables on the current stream, (tail, pages,
    combine), and the output the combine writes: what the benchmark times one by one. Pages per
    program and stages from `launch_plan` unless given; `source`: a variant of the kernel's source;
    `tail`: "cuda" (`tail_partials`) or "triton" (the Triton tail kernel)."""
    from .decode import _new_token, _tail_slots, decode_launches

    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    st = state if state is not None else layer.kernel_state()
    b, hq = query.shape[:2]
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    ppp, planned = launch_plan(b * layer.heads, st["max_slots"], sms, pages_per_program)
    (tail_launch, pages, combine), out = decode_launches(layer, query, scaling, workspace, st, pages_per_program=ppp,
                                                         new=new)
    m, l, acc = pages[2][-9:-6]  # the partials, as decode_launches passes them
    chunks = pages[1][1]

    def launch(kernel, grid, args, options):
        return lambda: kernel[grid](*args, **options)

    if pool_layout(st["k_pages"], st["v_pages"]):
        def run_pages():
            page_partials(query[:, :, 0], st["k_pages"], st["v_pages"], st["k_table"], st["v_table"],
                          st["n_vpages"], m, l, acc, rep=hq // layer.heads, first_chunk=m.shape[2] - chunks,
                          pages_per_program=ppp, chunks=chunks, scaling=scaling, stages=stages or planned,
                          source=source)
    else:  # a layer with no pages yet holds a stand-in page, not the pool's layout: Triton's launch
        run_pages = launch(*pages)
    if tail == "cuda":
        token = _new_token(layer, new, b) if new is not None else None

        def run_tail():
            tail_partials(query[:, :, 0], st, m, l, acc, rep=hq // layer.heads, sink=layer.config.sink,
                          window_slots=_tail_slots(layer.config), scaling=scaling, new=token, source=source)
    else:
        run_tail = launch(*tail_launch)
    return (run_tail, run_pages, launch(*combine)), out


def decode_attention(layer, query: torch.Tensor, scaling: float, workspace: dict | None = None,
                     state: dict | None = None, pages_per_program: int | None = None,
                     new: tuple | None = None, stages: int | None = None, source: Path | None = None,
                     tail: str = "cuda") -> torch.Tensor:
    """`kernels.decode.decode_attention` with its page launch done by the CUDA kernel, and its tail by
    the CUDA tail kernel (`tail="cuda"`, on a second stream) or the Triton one ("triton"); the Triton
    combine. Pages per program and stages from `launch_plan` unless given; `source`: a variant of the
    kernel's source to build and launch instead. The caller checks `unsupported` first."""
    (tail, pages, combine), out = step_launches(layer, query, scaling, workspace, state, pages_per_program, new,
                                                stages, source, tail)
    main, side = torch.cuda.current_stream(query.device), _side_stream(query.device)
    side.wait_stream(main)
    pages()
    with torch.cuda.stream(side):
        tail()
    main.wait_stream(side)
    combine()
    return out


def _plan(layer, slots: int) -> tuple[int, int]:
    sms = torch.cuda.get_device_properties(layer.device).multi_processor_count
    return launch_plan(layer.batch * layer.heads, slots, sms)


def step_workspace(layer, q_heads: int, workspace: dict) -> list[torch.Tensor]:
    """`kernels.decode.step_workspace` for `DecodeStep`: the partials of steps whose grid spans the
    layer's capacity, allocated now (before any graph is captured). Returns them."""
    from .decode import decode_launches

    slots = layer.capacity_slots()
    state = dict(layer.kernel_state(), max_slots=slots)
    q = torch.zeros(layer.batch, q_heads, 1, layer.head_dim, device=layer.device, dtype=layer.dtype)
    decode_launches(layer, q, 1.0, workspace, state, pages_per_program=_plan(layer, slots)[0])
    return [workspace["m"], workspace["l"], workspace["acc"]]


class DecodeStep:
    """`kernels.decode.DecodeStep` (steps from device counters, launches planned once) with the page
    launch done by the CUDA kernel and the tail (which writes the step's token) by the CUDA tail
    kernel (the default) or by the Triton one (`tail="triton"`), replayed through `plan.Launch`; the
    Triton combine, replayed."""

    def __init__(self, layer, workspace: dict, tail: str = "cuda"):
        if tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
        self.layer, self.workspace, self.tail_kind = layer, workspace, tail
        self.key, self.launches, self.pages, self.tail = None, None, None, None

    def __call__(self, query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                 scaling: float) -> torch.Tensor:
        """query [B, Hq, 1, D], key_new and value_new [B, H, 1, D] -> [B, Hq, 1, D]."""
        from .decode import _tail_slots, decode_launches
        from .plan import Launch

        q, kn, vn = query[:, :, 0], key_new[:, :, 0], value_new[:, :, 0]
        key = (query.shape, query.dtype, q.stride(), kn.stride(), vn.stride(), scaling)
        if key != self.key or kn.stride(-1) != 1 or vn.stride(-1) != 1:
            st = self.layer.kernel_state()
            ppp, stages = _plan(self.layer, st["max_slots"])
            (tail, pages, combine), out = decode_launches(self.layer, query, scaling, self.workspace, st,
                                                          pages_per_program=ppp,
                                                          new=(key_new, value_new, self.layer.steps.write))
            n = len(pages[2])  # the tail's arguments are the pages' and the token's
            triton_tail = Launch(*tail, slots=(0, n, n + 3)) if self.tail_kind == "triton" else None
            self.launches = (triton_tail, Launch(*combine, slots=(3,)))
            m, l, acc = pages[2][-9], pages[2][-8], pages[2][-7]
            chunks = pages[1][1]
            rep = query.shape[1] // self.layer.heads
            self.pages = dict(k_pages=st["k_pages"], v_pages=st["v_pages"], k_table=st["k_table"],
                              v_table=st["v_table"], n_vpages=st["n_vpages"], m=m, l=l, acc=acc,
                              rep=rep, first_chunk=m.shape[2] - chunks,
                              pages_per_program=ppp, chunks=chunks, scaling=scaling, stages=stages)
            self.tail = dict(state=st, m=m, l=l, acc=acc, rep=rep, sink=self.layer.config.sink,
                             window_slots=_tail_slots(self.layer.config), scaling=scaling)
            self.key, kn, vn = key, tail[2][n], tail[2][n + 3]
        else:
            out = torch.empty(query.shape, device=query.device, dtype=query.dtype)  # as decode_launches makes it
        tail, combine = self.launches
        main, side = torch.cuda.current_stream(query.device), _side_stream(query.device)
        side.wait_stream(main)
        page_partials(q, **self.pages)
        if self.tail_kind == "cuda":
            tail_partials(q, **self.tail, new=(kn, vn, self.layer.steps.write), stream=side)
        else:
            tail.run(q, kn, vn, stream=side)
        main.wait_stream(side)
        combine.run(out)
        return out


__all__ = ["unsupported", "build", "page_partials", "tail_partials", "launch_plan", "step_launches",
           "decode_attention", "DecodeStep", "step_workspace"]
