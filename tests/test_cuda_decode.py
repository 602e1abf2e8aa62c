"""The CUDA page kernel (`kernels.cuda_decode`) against the PyTorch reference, on a GPU with nvcc."""

import re

import pandas as pd
import pytest
import torch

from kernels import cuda_decode
from kitty_core.layer import KittyLayer
from kitty_core.reference_engine import ReferenceEngine
from kitty_core.config import parse_method

SINK, G, D = 32, 128, 128
# a sequence with no pages yet (sink only), one with its q-buffer half full, one page, several pages,
# a full q-buffer not yet packed, and one long enough for several programs of pages
LENS = [5, SINK + G // 2, SINK + 2 * G + 5, SINK + 3 * G, SINK + 9 * G + 17, SINK + 40 * G + 3]
# The kernel's key dots are int8 (the query x key scale rounded to 8 bits per page and head), as the
# Triton kernel's at this head size, and its outputs are as far from the reference as those
# (tests/test_kernels.py: up to ~3e-2 on an H200). A misplaced plane or scale moves them by whole units.
TOL = dict(atol=5e-2, rtol=5e-2)


def _layer(spec, lens, heads, dtype, seed=0, decode_steps=3, spread=None):
    """A left-padded batch holding `lens` real tokens after decode steps, the last decode token stored
    in FP16 but not packed (the state a decode kernel sees). `spread`: the keys' scale per channel."""
    torch.manual_seed(seed)
    layer = KittyLayer(parse_method(spec), ReferenceEngine())
    b, t = len(lens), max(lens) - decode_steps
    empty = torch.zeros(b, heads, 0, D, device="cuda", dtype=dtype)
    layer.lazy_initialization(empty, empty)
    layer.pad = [t - (n - decode_steps) for n in lens]
    if spread is None:
        spread = torch.linspace(0.5, 4, D, device="cuda", dtype=dtype)
    layer.insert(torch.randn(b, heads, t, D, device="cuda", dtype=dtype) * spread,
                 torch.randn(b, heads, t, D, device="cuda", dtype=dtype))
    for step in range(decode_steps):
        k = torch.randn(b, heads, 1, D, device="cuda", dtype=dtype) * spread
        layer.insert(k, torch.randn_like(k), pack=step < decode_steps - 1)
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("boost", [0.0, 0.125, 0.25, 0.5])
def test_cuda_page_kernel_matches_reference(boost, dtype):
    layer = _layer(f"kitty+boost_rate={boost}", LENS, heads=2, dtype=dtype)
    why = cuda_decode.unsupported(D, G, layer.n_boost, 2, 4, dtype, layer.device) or cuda_decode.build(layer.n_boost)
    assert why is None, why
    from kernels.decode import decode_attention, decode_attention_reference

    q = torch.randn(len(LENS), 8, 1, D, device="cuda", dtype=dtype)
    ref = decode_attention_reference(layer, q, D**-0.5).float()
    triton = decode_attention(layer, q, D**-0.5, key_dots="int8").float()
    for ppp in (None, 1, 2, 32):
        for stages in (1, 2):  # the launch plan's two pipeline depths
            out = cuda_decode.decode_attention(layer, q, D**-0.5, pages_per_program=ppp, stages=stages).float()
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, **TOL)
            # as close to the reference as the Triton kernel (int8 key dots too), give or take the rounding
            assert (out - ref).abs().max() <= 2 * (triton - ref).abs().max() + 4e-3


def test_launch_plan_takes_one_stage_only_for_grids_of_several_waves():
    # Qwen3-8B heads (8 KV heads) on 132 SMs, packed pages ceil((tokens - 32) / 128): (pages per program, stages)
    assert cuda_decode.launch_plan(64 * 8, 64, 132) == (32, 2)  # 64 x 8K: one wave
    assert cuda_decode.launch_plan(8 * 8, 256, 132) == (16, 2)  # 8 x 32K
    assert cuda_decode.launch_plan(8, 1024, 132) == (8, 2)  # 1 x 128K
    assert cuda_decode.launch_plan(544 * 8, 37, 132) == (32, 1)  # 544 x 4.7K: eight waves
    assert cuda_decode.launch_plan(256 * 8, 128, 132) == (32, 1)  # 256 x 16K
    assert cuda_decode.launch_plan(544 * 8, 37, 132, pages_per_program=2) == (2, 1)
    # the boundary: 2 x 1,056 resident programs (two blocks of 4 warps on 132 SMs) stay at two stages
    assert cuda_decode.launch_plan(2112, 32, 132) == (32, 2)
    assert cuda_decode.launch_plan(2113, 32, 132) == (32, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("boost", [0.25, 0.5])
def test_large_boosted_keys_do_not_overflow_the_query_rounding(boost):
    # channels whose keys are a thousand times the others' (a model's outlier channels, the ones the
    # boost picks) and queries of 60 on every channel: a boosted product q x key scale is ~2e4, within
    # fp16, but a thread's boosted products summed in fp16 (4 or 8 of them) would pass fp16's largest
    spread = torch.ones(D, device="cuda", dtype=torch.float16)
    spread[: int(boost * D)] = 1000.0
    layer = _layer(f"kitty+boost_rate={boost}", LENS, heads=2, dtype=torch.float16, seed=3, spread=spread)
    why = cuda_decode.unsupported(D, G, layer.n_boost, 2, 4, torch.float16, layer.device) or cuda_decode.build(layer.n_boost)
    assert why is None, why
    state = layer.kernel_state()
    assert cuda_decode.pool_layout(state["k_pages"], state["v_pages"])  # the CUDA page kernel's path, not Triton's
    from kernels.decode import decode_attention_reference

    q = torch.full((len(LENS), 8, 1, D), 60.0, device="cuda", dtype=torch.float16)
    scaling = 1.0 / (60 * 1000 * (boost * D) ** 0.5)  # scores of about unit spread
    ref = decode_attention_reference(layer, q, scaling).float()
    for stages in (1, 2):
        out = cuda_decode.decode_attention(layer, q, scaling, stages=stages).float()
        assert out.isfinite().all()
        torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("rep", [1, 3, 8])
def test_cuda_page_kernel_for_gqa_groups(rep):
    layer = _layer("kitty", LENS[2:], heads=2, dtype=torch.bfloat16, seed=2)
    from kernels.decode import decode_attention_reference

    q = torch.randn(len(LENS) - 2, 2 * rep, 1, D, device="cuda", dtype=torch.bfloat16)
    ref = decode_attention_reference(layer, q, D**-0.5).float()
    out = cuda_decode.decode_attention(layer, q, D**-0.5).float()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.gpu
def test_a_grid_sized_for_the_capacity_spreads_each_sequence_over_all_its_chunks():
    """As the Triton page kernel (tests/test_kernels.py): on a grid wider than the pages need, a
    sequence of n slots fills ceil(n / ceil(n / chunks)) chunks, and the output is the reference's."""
    from kernels.decode import decode_attention_reference

    layer = _layer("kitty-pro", LENS, heads=2, dtype=torch.bfloat16, seed=5)
    q = torch.randn(len(LENS), 8, 1, D, device="cuda", dtype=torch.bfloat16)
    exact = layer.kernel_state()
    assert cuda_decode.pool_layout(exact["k_pages"], exact["v_pages"])  # the CUDA launch, not Triton's
    wide = dict(exact, max_slots=exact["max_slots"] + 23)
    ws = {}
    got = cuda_decode.decode_attention(layer, q, D**-0.5, ws, wide, pages_per_program=4)
    ref = decode_attention_reference(layer, q, D**-0.5).float()
    torch.testing.assert_close(got.float(), ref, **TOL)
    chunks = -(-wide["max_slots"] // 4)
    first = ws["m"].shape[2] - chunks  # the page chunks' partials follow the tail's
    live = ws["m"][:, :, first:first + chunks].isfinite().all(1)
    n_vp = exact["n_vpages"].tolist()
    for b, n in enumerate(n_vp):
        filled = -(-n // -(-n // chunks)) if n else 0
        assert live[b].tolist() == [c < filled for c in range(chunks)], (n, live[b])
    assert any(-(-n // 4) < -(-n // -(-n // chunks)) for n in n_vp if n)  # some sequence spreads wider


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tail", ["", "+tail_bits=8"])
@pytest.mark.parametrize("shape", ["presets", "wide window", "long sink"])
def test_cuda_tail_kernel_matches_reference(shape, tail, dtype):
    """The CUDA tail kernel (sink, window slots with keys in the q-buffer or packed) against the
    reference and as close to it as the Triton tail: the presets' shapes, a value window of two and a
    half pages (slots of packed keys beside window values), and a sink of G + G/2 + 1 tokens (more than
    one block of a program's token loop, the last one ragged)."""
    from kernels.decode import decode_attention_reference

    extra = {"presets": "", "wide window": f"+local_window={5 * G // 2}", "long sink": f"+sink={G + G // 2 + 1}"}[shape]
    layer = _layer("kitty-pro" + tail + extra, LENS, heads=2, dtype=dtype, seed=5)
    if shape == "wide window":
        st = layer.kernel_state()
        assert max((st["n_kpages"] - st["n_vpages"]).tolist()) >= 2
    assert cuda_decode.build(layer.n_boost) is None
    q = torch.randn(len(LENS), 8, 1, D, device="cuda", dtype=dtype)
    ref = decode_attention_reference(layer, q, D**-0.5).float()
    triton_tail = cuda_decode.decode_attention(layer, q, D**-0.5, tail="triton").float()
    out = cuda_decode.decode_attention(layer, q, D**-0.5, tail="cuda").float()
    torch.testing.assert_close(out, ref, **TOL)
    assert (out - ref).abs().max() <= 1.5 * (triton_tail - ref).abs().max() + 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tail", ["", "+tail_bits=8"])
def test_the_cuda_tail_writes_the_steps_token_as_the_triton_tail_does(tail):
    """`new=` through the CUDA tail kernel: it writes the step's token into the key q-buffer and the
    value window as the Triton tail kernel does (an 8-bit tail: the same codes and scales, bit for bit;
    `tests/test_kernels.py` checks those against the host's), and its output equals, bit for bit, that
    of the same state with the token stored before the step."""
    import copy

    from kernels.decode import decode_attention

    # the new token: mid-slot, first of a slot, a q-buffer's last, after a few pages
    lens = [SINK + 5, SINK + G + 1, SINK + 2 * G, SINK + 3 * G + G // 2]
    before = _layer("kitty-pro" + tail, [n - 1 for n in lens], heads=2, dtype=torch.bfloat16, seed=3)
    before.pack_full()
    k = torch.randn(len(lens), 2, 1, D, device="cuda", dtype=torch.bfloat16) * 2
    v = torch.randn_like(k)
    q = torch.randn(len(lens), 8, 1, D, device="cuda", dtype=torch.bfloat16)
    write = torch.tensor([before.k_buffer.lens, before.v_window.lens], device="cuda")
    by_triton, by_cuda = copy.deepcopy(before), copy.deepcopy(before)
    outs = {}
    for name, layer, attend in (("triton", by_triton, decode_attention),
                                ("cuda", by_cuda, cuda_decode.decode_attention)):
        state = layer.kernel_state()
        state["lens"] = state["lens"] + 1
        outs[name] = attend(layer, q, D**-0.5, state=state, new=(k, v, write))
    for region in ("k_buffer", "v_window"):
        for x, y in zip(getattr(by_cuda, region).tensors(), getattr(by_triton, region).tensors()):
            assert torch.equal(x, y), region
    state = by_triton.kernel_state()
    state["lens"] = state["lens"] + 1  # the token is stored: the same step without `new`
    assert torch.equal(outs["cuda"], cuda_decode.decode_attention(by_triton, q, D**-0.5, state=state))
    torch.testing.assert_close(outs["cuda"].float(), outs["triton"].float(), **TOL)


@pytest.mark.gpu
def test_dead_programs_are_skipped_whatever_the_workspace_holds():
    """Programs past a sequence's pages write only their max: stale sums and outputs in the
    workspace must not reach the result."""
    layer = _layer("kitty", LENS, heads=2, dtype=torch.bfloat16, seed=3)
    from kernels.decode import decode_attention_reference

    q = torch.randn(len(LENS), 8, 1, D, device="cuda", dtype=torch.bfloat16)
    ws = {}
    first = cuda_decode.decode_attention(layer, q, D**-0.5, ws, pages_per_program=1)
    ws["l"].fill_(float("nan"))
    ws["acc"].fill_(float("nan"))
    again = cuda_decode.decode_attention(layer, q, D**-0.5, ws, pages_per_program=1)
    torch.testing.assert_close(again, first)
    ref = decode_attention_reference(layer, q, D**-0.5).float()
    torch.testing.assert_close(again.float(), ref, **TOL)


@pytest.mark.gpu
def test_a_launch_for_a_profiler_runs_the_cuda_page_kernel_and_no_other_page_kernel():
    """`bench kernels --cuda --launch-once`: each setting's step once, its pages read by the CUDA
    kernel alone (a profiler filtering on `pages_kernel` finds the CUDA kernel, not Triton's)."""
    from torch.profiler import ProfilerActivity, profile

    from kitty_core.kernel_bench import launch_cuda_once

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launches = launch_cuda_once([(2, 2000)], [0.25], pages_per_program=(4, None), stages=(1,),
                                    tail_bits=(16, 8))
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum(re.search(r"\bkitty::(\(anonymous namespace\)::)?pages_kernel<", n) is not None for n in names) == 4, names
    assert not any("_decode_pages_kernel" in n for n in names), names
    assert launches["ppp"].tolist()[::2] == [4, 4] and launches["stages"].tolist() == [1] * 4
    assert launches["tail_bits"].tolist() == [16, 16, 8, 8]
    assert (launches["programs"] > 0).all()


@pytest.mark.gpu
def test_the_kernel_benchmark_runs_a_variant_beside_the_shipped_kernel(tmp_path):
    """`bench kernels --cuda --variants`: a variant's rows beside the shipped kernel's, named by their
    source, and computed by the variant: this one writes twice the output, so its error is large."""
    from kitty_core.kernel_bench import STEPS_A_GRAPH, bench_cuda, launch_cuda_once

    variant = tmp_path / "decode_variant.cu"
    shipped = cuda_decode.SOURCE.read_text()
    line = "const float r0 = 1.f / l0, r1 = 1.f / l1;"
    assert line in shipped
    variant.write_text(shipped.replace(line, "const float r0 = 2.f / l0, r1 = 2.f / l1;"))
    df = bench_cuda([(2, 2000)], [0.25], stages=(1, 2), rounds=1, sources=(None, variant))
    assert df["source"].tolist() == ["kernels/cuda/decode.cu"] * 2 + [str(variant)] * 2
    assert df["stages"].tolist() == [1, 2, 1, 2] and (df[["cuda_ms", "pages_ms", "combine_ms"]] > 0).all().all()
    assert (df["steps_a_graph"] == STEPS_A_GRAPH).all()
    err = df["cuda_max_abs_err"].tolist()
    assert max(err[:2]) < 0.1 < min(err[2:]), err
    once = launch_cuda_once([(2, 2000)], [0.25], sources=(None, variant))
    assert once["source"].tolist() == ["kernels/cuda/decode.cu", str(variant)]


@pytest.mark.gpu
def test_a_benchmark_graph_keeps_the_tensors_its_function_holds():
    """A graph outlives the names that held its function's tensors (`bench_cuda` with two sources goes
    on to the second before it times the first's graphs): its replay keeps them alive, or the next
    capture gives their memory back to the driver under the graph (an illegal address at a replay)."""
    import gc
    import weakref

    from kitty_core.kernel_bench import graphed

    def doubling():
        x = torch.ones(1 << 20, device="cuda")
        return (lambda: x.mul_(2.0)), weakref.ref(x)

    fn, alive = doubling()
    replay = graphed(fn)
    del fn
    gc.collect()
    torch.cuda.empty_cache()
    assert alive() is not None
    replay()
    assert alive()[0].item() == 4.0  # doubled by the call before the capture, then by the replay


def test_the_kernel_benchmark_takes_its_timing_from_the_command_line(monkeypatch):
    """`bench kernels --rounds N --steps-a-graph S` reach the timing (5 rounds of graphs of 10 steps
    without them), in the CUDA comparison and in every other table; no GPU needed: the tables
    themselves are replaced by ones that record what they were asked."""
    from kitty_core import bench

    asked = []

    def record(what, result):
        return lambda *args, **kw: asked.append((what, kw)) or result

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bench_cuda", record("cuda", pd.DataFrame()))
    monkeypatch.setattr(bench, "bench_kernels", record("triton", pd.DataFrame()))
    monkeypatch.setattr(bench, "pack_cost", record("pack", {}))
    monkeypatch.setattr(bench, "fp16_attention", record("fp16", pd.DataFrame()))
    monkeypatch.setattr(bench, "sweep_launch", record("sweep", pd.DataFrame()))
    monkeypatch.setattr(bench, "unpack_modes", record("unpack", pd.DataFrame()))
    assert bench.main(["kernels", "--cuda", "--rounds", "7", "--steps-a-graph", "1", "--shapes", "2x2000"]) == 0
    assert bench.main(["kernels", "--cuda", "--shapes", "2x2000"]) == 0
    assert [(kw["rounds"], kw["steps_a_graph"]) for _, kw in asked] == [(7, 1), (5, 10)]
    asked.clear()
    for mode in ([], ["--pack"], ["--fp16"], ["--sweep"], ["--unpack-modes"]):
        assert bench.main(["kernels", *mode, "--steps-a-graph", "3", "--shapes", "2x2000"]) == 0
        assert bench.main(["kernels", *mode, "--shapes", "2x2000"]) == 0
    assert [(what, kw["steps_a_graph"]) for what, kw in asked] == [
        (what, n) for what in ("triton", "pack", "fp16", "sweep", "unpack") for n in (3, 10)]


def test_a_pool_whose_page_stride_passes_2_31_is_refused_before_a_launch():
    """The kernel takes a pool's page stride as a 32-bit int (one IMAD.WIDE a page id): a larger one
    is an error that says so, before any build or launch (meta tensors: strides without memory)."""
    meta = dict(device="meta")
    big = 2**31 // 4096 + 1  # heads: a page stride of big x 32 x 128 elements
    kd = torch.empty_strided((2, big, 32, 128), (big * 4096, 4096, 1, 32), dtype=torch.uint8, **meta)
    kh = torch.empty((2, big, 0, 32), dtype=torch.uint8, **meta)  # no boosted channels
    kc = torch.empty((2, big, 0), dtype=torch.uint8, **meta)
    ks = torch.empty((2, big, 128), dtype=torch.float16, **meta)
    vl = torch.empty_strided((2, big, 32, 128), (big * 4096, 4096, 1, 32), dtype=torch.uint8, **meta)
    vs = torch.empty((2, big, 128), dtype=torch.float16, **meta)
    k_pages = dict(dense=kd, high=kh, boost_ch=kc, scale=ks, zero=ks)
    v_pages = dict(low=vl, scale=vs, zero=vs)
    q = torch.empty((1, 4 * big, D), dtype=torch.float16, **meta)
    table = torch.zeros((1, 2), dtype=torch.int32, **meta)
    m = torch.empty((1, 4 * big, 1), dtype=torch.float32, **meta)
    acc = torch.empty((1, 4 * big, 1, D), dtype=torch.float16, **meta)
    with pytest.raises(ValueError, match=r"a page's stride in a pool must be below 2\^31 elements, got 2147"):
        cuda_decode.page_partials(q, k_pages, v_pages, table, table, table[0], m, m, acc, rep=4, first_chunk=0,
                                  pages_per_program=1, chunks=1, scaling=1.0)


def test_unsupported_says_why_without_a_gpu_or_for_other_shapes():
    cpu = torch.device("cpu")
    assert cuda_decode.unsupported(D, G, 32, 2, 4, torch.bfloat16, cpu) == "no CUDA device"
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        assert "head size 64" in cuda_decode.unsupported(64, G, 16, 2, 4, torch.bfloat16, dev)
        assert "4-bit" in cuda_decode.unsupported(D, G, 32, 4, 4, torch.bfloat16, dev)
        assert "boosted" in cuda_decode.unsupported(D, G, 24, 2, 4, torch.bfloat16, dev)


def test_a_build_takes_both_depths_side_by_side_once_per_process(monkeypatch):
    """`cuda_decode.build` builds a boosted-channel count's two cp.async depths at the same time (each
    stand-in build below returns only once the other has started), and answers later calls from its
    first, a failure included: a broken toolchain is not tried again by every cache."""
    import threading

    calls, both = [], threading.Barrier(2, timeout=10)

    def side_by_side(n_boost, stages, source=None):
        calls.append((n_boost, stages))
        both.wait()

    def broken(n_boost, stages, source=None):
        raise RuntimeError("nvcc fatal: unsupported architecture\n")

    cuda_decode.build.cache_clear()
    try:
        monkeypatch.setattr(cuda_decode, "_build", side_by_side)
        assert cuda_decode.build(16) is None and sorted(calls) == [(16, 1), (16, 2)]
        assert cuda_decode.build(16) is None and len(calls) == 2
        monkeypatch.setattr(cuda_decode, "_build", broken)
        why = cuda_decode.build(64)
        assert why == "the CUDA build failed: nvcc fatal: unsupported architecture"
        monkeypatch.setattr(cuda_decode, "_build", side_by_side)
        assert cuda_decode.build(64) == why and len(calls) == 2
    finally:
        cuda_decode.build.cache_clear()


def test_a_variant_of_the_kernel_builds_beside_the_shipped_one(tmp_path, monkeypatch):
    """A variant of the kernel's source (`bench kernels --cuda --variants`) is compiled from its own
    text under a name of its own, which changes with that text, so that it and the shipped kernel
    load side by side in one process; `build` makes both depths of it."""
    import torch.utils.cpp_extension as ext

    variant = tmp_path / "decode_variant.cu"
    variant.write_text(cuda_decode.SOURCE.read_text() + "\n// a variant\n")
    compiled = []
    monkeypatch.setattr(ext, "load_inline", lambda **kw: compiled.append(kw) or kw["name"])
    shipped = cuda_decode._build.__wrapped__(32, 1)
    mine = cuda_decode._build.__wrapped__(32, 1, variant)
    assert shipped == "kitty_pages_nb32_s1" and mine.startswith("kitty_pages_nb32_s1_") and mine != shipped
    assert compiled[0]["cuda_sources"][0] == cuda_decode.SOURCE.read_text()
    assert compiled[1]["cuda_sources"][0].endswith("// a variant\n")
    assert compiled[1]["extra_cuda_cflags"] == compiled[0]["extra_cuda_cflags"]
    assert cuda_decode.extension_name(32, 1, variant) == mine
    variant.write_text(variant.read_text() + "// changed\n")
    assert cuda_decode.extension_name(32, 1, variant) != mine

    built = []
    monkeypatch.setattr(cuda_decode, "_build", lambda n, st, source=None: built.append((n, st, source)))
    cuda_decode.build.cache_clear()
    try:
        assert cuda_decode.build(32, variant) is None
        assert sorted(built, key=lambda b: b[1]) == [(32, 1, variant), (32, 2, variant)]
    finally:
        cuda_decode.build.cache_clear()


def _qwen3_head_128(initializer_range=0.02, dtype=torch.bfloat16):
    """A random two-layer decoder of Qwen3's head size (4 query heads a KV head) on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=D, max_position_embeddings=4096,
                               initializer_range=initializer_range)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).cuda().eval()


def _teacher_forced_logits(model, prompt: torch.Tensor, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits [T, B, V] of eager steps that feed `tokens` [B, T] one at a time after `prompt`: the
    logits a generation of those tokens saw, the first from the prompt's last position."""
    with torch.inference_mode():
        out = [model(input_ids=prompt, past_key_values=cache).logits[:, -1]]
        for t in range(tokens.shape[1] - 1):
            out.append(model(input_ids=tokens[:, t : t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out).float()


@pytest.mark.gpu
@pytest.mark.parametrize("device_steps", [False, True])
@pytest.mark.parametrize("deep_waves", [cuda_decode.DEEP_WAVES, 0])
@pytest.mark.parametrize("method", ["kitty-pro", "kitty-pro+tail_bits=8"])
def test_engine_with_cuda_pages_agrees_with_reference(method, device_steps, deep_waves, monkeypatch):
    """A random decoder of Qwen3's head size: logits of decode steps after a 700-token prompt (pages
    of keys and of values) through `triton+pages=cuda`, on the host's record and from device
    counters, against the reference engine; the CUDA kernel, not the fallback, read the pages, at
    the depth the launch plan picks for this small grid (two stages) and with one stage forced; a tail
    of 16 or 8 bits, read by the CUDA tail kernel (the default) or by Triton's (`+tail=triton`),
    which from device counters also writes each step's token. Layer 0's keys and values see the same
    inputs in every cache, so its key q-buffer and value window hold the same bits in each wherever
    the tokens went (logits at this tolerance would not see one token written at the wrong place)."""
    monkeypatch.setattr(cuda_decode, "DEEP_WAVES", deep_waves)

    from kitty_core import KittyCache

    model = _qwen3_head_128()
    ids = torch.randint(3, 512, (2, 703), device="cuda")
    logits, caches = {}, {}
    for engine in ("reference", "triton+pages=cuda", "triton+pages=cuda+tail=triton"):
        cache = caches[engine] = KittyCache(model, method, engine=engine, device_steps=device_steps)
        with torch.inference_mode():
            model(input_ids=ids[:, :700], past_key_values=cache)
            steps = [model(input_ids=ids[:, i : i + 1], past_key_values=cache).logits[:, -1].float()
                     for i in range(700, 703)]
        logits[engine] = torch.stack(steps)
    for name, tail in (("triton+pages=cuda", "cuda"), ("triton+pages=cuda+tail=triton", "triton")):
        engine = caches[name].engine
        assert engine.tail == tail and engine._cuda_ok and all(engine._cuda_ok.values())
        if device_steps:
            assert engine.steps and all(type(s).__module__ == "kernels.cuda_decode" and s.tail_kind == tail
                                        for s in engine.steps.values())
        torch.testing.assert_close(logits[name], logits["reference"], atol=0.6, rtol=0.05)
        for region in ("k_buffer", "v_window"):
            for x, y in zip(getattr(caches[name].layers[0], region).tensors(),
                            getattr(caches["reference"].layers[0], region).tensors()):
                n = min(x.shape[2], y.shape[2])  # (the regions' capacities may differ; unused slots hold zeros)
                assert torch.equal(x[:, :, :n], y[:, :, :n]), (name, region)


def test_engine_names_pick_the_tail_kernel():
    """`triton+tail=triton`: the Triton tail kernel beside the CUDA page kernel; the CUDA tail by
    default. Where Triton reads the pages its fused step reads the tail: the CUDA tail asked for
    there, or an unknown tail kernel, is a ValueError that says what to do, before any model runs."""
    from kitty_core.engines import make_engine

    assert make_engine("triton").tail == "cuda" and make_engine("triton+pages=cuda+tail=cuda").tail == "cuda"
    assert make_engine("triton+tail=triton").tail == "triton"
    for name in ("triton+pages=triton", "triton+pages=triton+tail=triton", "triton+key_dots=fp16"):
        assert make_engine(name).tail == "triton"
    with pytest.raises(ValueError, match="cuda, triton"):
        make_engine("triton+tail=tilelang")
    for name in ("triton+pages=triton+tail=cuda", "triton+key_dots=int8+tail=cuda"):
        with pytest.raises(ValueError, match="one or the other"):
            make_engine(name)


@pytest.mark.parametrize("pages, level", [("cuda", "WARNING"), ("auto", "INFO")])
def test_engine_falls_back_to_triton_with_one_log_line(pages, level, caplog):
    """Where the CUDA kernel does not apply (here: no GPU, or head size 64), Triton reads the pages
    and one line says why, once per layer shape: a warning where the CUDA kernel was asked for
    (`triton+pages=cuda`), at INFO by default (`triton`, pages "auto"). `triton+pages=triton` never
    tries it."""
    from types import SimpleNamespace

    from kitty_core.engines import make_engine

    engine = make_engine(f"triton+pages={pages}")
    assert engine.pages == pages and make_engine("triton").pages == "auto"
    with pytest.raises(ValueError, match="auto, cuda, triton"):
        make_engine("triton+pages=tilelang")
    layer = SimpleNamespace(head_dim=64, heads=2, n_boost=16, softcap=None,
                            config=SimpleNamespace(group_size=G, value_bits=2))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with caplog.at_level("INFO", logger="kitty_core.triton_engine"):
        assert not engine._cuda_pages(layer, 8, torch.bfloat16, device)
        assert not engine._cuda_pages(layer, 8, torch.bfloat16, device)
        assert not make_engine("triton+pages=triton")._cuda_pages(layer, 8, torch.bfloat16, device)
    lines = [r for r in caplog.records if r.name == "kitty_core.triton_engine"]
    assert len(lines) == 1 and "Triton" in lines[0].getMessage() and lines[0].levelname == level
    caplog.clear()
    capped = SimpleNamespace(head_dim=D, heads=2, n_boost=32, softcap=30.0,  # a shape the kernel takes, but capped
                             config=SimpleNamespace(group_size=G, value_bits=2))
    with caplog.at_level("INFO", logger="kitty_core.triton_engine"):
        assert not engine._cuda_pages(capped, 8, torch.bfloat16, device)
        assert not engine._cuda_pages(capped, 8, torch.bfloat16, device)
    lines = [r.getMessage() for r in caplog.records if r.name == "kitty_core.triton_engine"]
    assert len(lines) == 1 and "softcap" in lines[0]


@pytest.mark.gpu
def test_generate_reads_the_pages_with_the_cuda_kernel_by_default():
    """`model.generate` with a default cache on a decoder of Qwen3's head size: compiled steps
    (inductor, CUDA graphs) whose pages the CUDA kernel reads. 300 greedy tokens after a 700-token
    prompt (pages packed between replays), then the same tokens fed through eager steps whose pages
    the Triton kernel reads (`triton+pages=triton`): the logits agree at every step. Weights of
    std 0.1 make logits of std 1.6. On one H200 the compiled steps differ from the eager ones by at
    most 0.33 (median 0.07 over the steps), while eager steps after a prompt whose first 600 tokens
    are replaced differ by 4.9 or more at nine steps in ten: the tolerance sits between the two."""
    from kitty_core import KittyCache

    model = _qwen3_head_128(initializer_range=0.1, dtype=torch.float16)
    ids = torch.randint(3, 512, (2, 700), device="cuda")
    cache = KittyCache(model, "kitty-pro")
    out = model.generate(input_ids=ids, past_key_values=cache, do_sample=False, max_new_tokens=300,
                         min_new_tokens=300, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    assert cache.is_compileable and cache.layers[0].steps is not None
    assert cache.engine.steps and all(type(s).__module__ == "kernels.cuda_decode" for s in cache.engine.steps.values())
    triton = KittyCache(model, "kitty-pro", engine="triton+pages=triton")
    want = _teacher_forced_logits(model, ids, out.sequences[:, 700:], triton)
    assert triton.engine.steps and all(type(s).__module__ == "kernels.decode" for s in triton.engine.steps.values())
    torch.testing.assert_close(torch.stack(out.logits).float(), want, atol=1.0, rtol=0)
