"""Triton kernels against their PyTorch references. On CPU they run in Triton's interpreter
(TRITON_INTERPRET=1, set in conftest.py before any kernel is imported), with tiny shapes."""

import pytest
import torch
import triton
import triton.language as tl

from kernels.decode_fused import _page_scores_i8
from kernels.ptx import _key8_plane
from kernels.state import _store_token
from kitty_core.layer import KittyLayer
from kitty_core.reference_engine import ReferenceEngine
from kitty_core.config import parse_method

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tensor-core dots need every dimension >= 16: on a GPU the token and channel planes of a page
# (G/4 tokens, D/4 channels) must be 16 wide; the interpreter takes smaller, faster shapes
DIM, GROUP = (64, 64) if DEVICE == "cuda" else (16, 16)
SINK = 4


def _layer(spec, lens, heads=2, dim=DIM, seed=0, decode_steps=3):
    """A layer whose sequences hold `lens` real tokens after a left-padded prefill and decode steps,
    the last decode token stored in FP16 but not packed (the state a decode kernel sees)."""
    torch.manual_seed(seed)
    layer = KittyLayer(parse_method(spec), ReferenceEngine())
    b, t = len(lens), max(lens) - decode_steps
    layer.lazy_initialization(torch.zeros(b, heads, 0, dim, device=DEVICE), torch.zeros(b, heads, 0, dim, device=DEVICE))
    layer.pad = [t - (n - decode_steps) for n in lens]
    spread = torch.linspace(0.5, 4, dim, device=DEVICE)  # channels of different magnitude, as in real keys
    layer.insert(torch.randn(b, heads, t, dim, device=DEVICE) * spread, torch.randn(b, heads, t, dim, device=DEVICE))
    for step in range(decode_steps):
        k = torch.randn(b, heads, 1, dim, device=DEVICE) * spread
        v = torch.randn(b, heads, 1, dim, device=DEVICE)
        layer.insert(k, v, pack=step < decode_steps - 1)
    return layer


# ragged: sink only, sink + half-full q-buffer, several pages, a full q-buffer not yet packed, more
LENS = [3, SINK + GROUP // 2, SINK + 2 * GROUP + 5, SINK + 3 * GROUP, SINK + 4 * GROUP + 3]
SMALL = f"+sink={SINK}+group_size={GROUP}+local_window={GROUP}"


@pytest.mark.parametrize("spec", ["kivi-k2v2-sink", "kitty", "kitty-pro", "k4v2-sink", "k2v4-sink", "kivi-k2v2",
                                  "kitty-pro+tail_bits=8"])
def test_fused_decode_matches_reference(spec):
    from kernels.decode import decode_attention, decode_attention_reference
    from kernels.decode_unfused import decode_attention_unfused

    layer = _layer(spec + SMALL, LENS)
    assert layer.k_buffer.lens[3] == GROUP  # one sequence's q-buffer is full, not yet packed
    q = torch.randn(len(LENS), 4, 1, DIM, device=DEVICE)
    ref = decode_attention_reference(layer, q, 0.25)
    for out in (decode_attention(layer, q, 0.25), decode_attention(layer, q, 0.25, pages_per_program=2),
                decode_attention(layer, q, 0.25, unpack="convert"), decode_attention_unfused(layer, q, 0.25)):
        assert out.shape == (len(LENS), 4, 1, DIM)
        torch.testing.assert_close(out, ref, atol=5e-3, rtol=1e-2)  # fp16 operands in the dots


@pytest.mark.parametrize("tail", ["", "+tail_bits=8"])
@pytest.mark.parametrize("shape", ["wide window", "long sink"])
def test_the_tail_kernel_matches_reference_over_a_wide_window_and_a_long_sink(shape, tail):
    """The tail kernel past the presets' shapes: a value window of two and a half pages (four slots,
    more than one of them with packed keys), and a sink of G/2 + 1 tokens (its tile padded to the
    next power of two)."""
    from kernels.decode import decode_attention, decode_attention_reference

    extra = f"+local_window={5 * GROUP // 2}" if shape == "wide window" else f"+sink={GROUP // 2 + 1}"
    lens = [3, GROUP + 1, 2 * GROUP + 3, 4 * GROUP + 5, 6 * GROUP + 7]
    layer = _layer("kitty-pro" + tail + SMALL + extra, lens, seed=11)
    st = layer.kernel_state()
    if shape == "wide window":  # some sequence's window holds more than one slot of packed keys
        assert max((st["n_kpages"] - st["n_vpages"]).tolist()) >= 2
    q = torch.randn(len(lens), 4, 1, DIM, device=DEVICE)
    ref = decode_attention_reference(layer, q, 0.25)
    torch.testing.assert_close(decode_attention(layer, q, 0.25), ref, atol=5e-3, rtol=1e-2)


@pytest.mark.parametrize("tail", ["", "+tail_bits=8"])
@pytest.mark.parametrize("magnitude", [2.0**20, 2.0**-30])
def test_the_tail_takes_queries_outside_fp16s_range(tail, magnitude):
    """The tail's dots take fp16 operands where its tiles are not bf16 (an 8-bit tail's codes, an fp32
    model's tokens), and the queries go to fp16 on a power-of-two scale of their own. Queries 2^20
    or 2^-30 times as large, with the attention scale divided by as much, give the same scores: the
    same output. Without the queries' scale they overflow fp16 (NaN) or vanish in it (every tail
    token weighed alike)."""
    from kernels.decode import decode_attention, decode_attention_reference

    layer = _layer("kitty-pro" + tail + SMALL, LENS, seed=7)
    q = torch.randn(len(LENS), 4, 1, DIM, device=DEVICE)
    ref = decode_attention_reference(layer, q, 0.25)
    out = decode_attention(layer, q * magnitude, 0.25 / magnitude)
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=1e-2)


@pytest.mark.parametrize("key_dots", ["fp16", "int8"])
def test_fused_decode_with_a_softcap_matches_reference(key_dots):
    """Gemma 2's logit softcapping (softcap x tanh(scores / softcap)) in the tail kernel (sink, packed
    keys of the value window, the FP16 q-buffer) and the page kernel (base-2 scores), against the
    PyTorch reference. The queries are scaled so that the cap bends the scores (up to ~8, capped at
    2): without it the outputs are whole units off the capped reference."""
    from kernels.decode import decode_attention, decode_attention_reference

    layer = _layer("kitty-pro" + SMALL, LENS, seed=5)
    q = torch.randn(len(LENS), 4, 1, DIM, device=DEVICE) * 2
    ref = decode_attention_reference(layer, q, 0.25, softcap=2.0)
    assert (decode_attention_reference(layer, q, 0.25) - ref).abs().max() > 0.3  # the cap matters here
    tol = dict(atol=5e-3, rtol=1e-2) if key_dots == "fp16" else dict(atol=5e-2, rtol=5e-2)  # see the int8 test
    for ppp in (1, 2):
        out = decode_attention(layer, q, 0.25, pages_per_program=ppp, key_dots=key_dots, softcap=2.0)
        torch.testing.assert_close(out, ref, **tol)
    with pytest.raises(ValueError, match="softcap"):
        decode_attention(layer, q, 0.25, softcap=-1.0)


@pytest.mark.parametrize("rep", [1, 3, 4, 8])
def test_fused_decode_for_every_gqa_group_size(rep):
    """Query heads per KV head: MHA (1, padded to 4 rows), the demo model's 3, Qwen3/Llama 3's 4, and 8."""
    from kernels.decode import decode_attention, decode_attention_reference

    layer = _layer("kitty-pro" + SMALL, [SINK + 3 * GROUP + 5, SINK + GROUP + 1], seed=rep)
    q = torch.randn(2, 2 * rep, 1, DIM, device=DEVICE)
    ref = decode_attention_reference(layer, q, 0.25)
    for ppp in (1, 2):
        torch.testing.assert_close(decode_attention(layer, q, 0.25, pages_per_program=ppp), ref, atol=5e-3, rtol=1e-2)


@pytest.mark.parametrize("tail", ["", "+tail_bits=8"])
def test_a_token_the_kernels_write_gives_the_output_of_one_inserted_before_them(tail):
    """`new=`: a device-driven step hands its token to the kernels, which write it into the key
    q-buffer and the value window and attend to it. The output equals, bit for bit, that of the same
    token inserted first (the host's steps), and so do the buffers (an 8-bit tail's codes and scales:
    the kernel quantizes the token as the host does). A grid that spans more page slots than the
    sequences hold (a device step's, sized by the capacity) gives the same output."""
    import copy

    from kernels.decode import decode_attention

    # the new token: mid-slot, first of a slot, a q-buffer's last, after a few pages
    lens = [SINK + 5, SINK + GROUP + 1, SINK + 2 * GROUP, SINK + 3 * GROUP + GROUP // 2]
    before = _layer("kitty-pro" + SMALL + tail, [n - 1 for n in lens], seed=3)
    before.pack_full()  # as the host leaves it after each step
    k = torch.randn(len(lens), 2, 1, DIM, device=DEVICE) * 2
    v = torch.randn_like(k)
    q = torch.randn(len(lens), 4, 1, DIM, device=DEVICE)
    after = copy.deepcopy(before)
    after.insert(k, v, pack=False)
    want = decode_attention(after, q, 0.25)
    write = torch.tensor([before.k_buffer.lens, before.v_window.lens], device=DEVICE)
    state = before.kernel_state()
    state["lens"] = state["lens"] + 1
    wide = copy.deepcopy(before)
    got = decode_attention(before, q, 0.25, state=state, new=(k, v, write))
    assert torch.equal(got, want)
    for region in ("k_buffer", "v_window"):
        mine, host = getattr(before, region), getattr(after, region)
        assert len(mine.tensors()) == (2 if tail else 1)
        for b, n in enumerate(host.lens):
            for x, y in zip(mine.tensors(), host.tensors()):
                assert torch.equal(x[b, :, :n], y[b, :, :n])
    spanning = dict(wide.kernel_state(), lens=state["lens"], max_slots=state["max_slots"] + 5)
    torch.testing.assert_close(decode_attention(wide, q, 0.25, state=spanning, new=(k, v, write)), want,
                               atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="positions"):
        decode_attention(before, q, 0.25, state=state, new=(k, v, write[:1]))


@triton.jit
def _store_rows(X, C, S, D: tl.constexpr):
    row = tl.program_id(0)
    _store_token(C, S, row * D, tl.load(X + row * D + tl.arange(0, D)), D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_kernel_quantizes_a_token_as_the_host_does(dtype):
    """`_store_token` (a device-driven step's token into an 8-bit tail) against the host's
    `quantize_tokens`, bit for bit: codes and scales. On a GPU, 200,000 vectors of six decades of
    magnitude: an approximate division there changed a code in 7.5% of bf16 vectors."""
    from kitty_core.regions import quantize_tokens

    rows, dim = (200_000, 128) if DEVICE == "cuda" else (64, 16)
    torch.manual_seed(5)
    x = (torch.randn(rows, dim, device=DEVICE) * torch.logspace(-3, 3, rows, device=DEVICE)[:, None]).to(dtype)
    x[0] = 0  # a zero vector: scale 0, codes 0
    codes = torch.empty(rows, dim, dtype=torch.int8, device=DEVICE)
    scales = torch.empty(rows, dtype=torch.float32, device=DEVICE)
    _store_rows[(rows,)](x, codes, scales, dim)
    want_codes, want_scales = quantize_tokens(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes), f"{(codes != want_codes).any(1).float().mean():.2%} of vectors differ"


def test_chunks_past_a_sequence_are_ignored_whatever_the_workspace_holds():
    """A grid sized for more page slots than the sequences hold (a CUDA graph's) has chunks that
    store only their max; the combining kernel must not read their sums or values, which here are
    NaN left in a reused workspace."""
    from kernels.decode import decode_attention

    layer = _layer("kitty-pro" + SMALL, [SINK + 2, SINK + 3 * GROUP + 5], seed=4)
    q = torch.randn(2, 4, 1, DIM, device=DEVICE)
    want = decode_attention(layer, q, 0.25, pages_per_program=1)
    state = dict(layer.kernel_state(), max_slots=layer.kernel_state()["max_slots"] + 3)
    ws = {}
    decode_attention(layer, q, 0.25, ws, state, pages_per_program=1)
    for part in ("m", "l", "acc"):
        ws[part].fill_(float("nan"))
    got = decode_attention(layer, q, 0.25, ws, state, pages_per_program=1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_combine_split_over_channels_merges_as_one_program_a_row(monkeypatch):
    """Rows of many partials spread their channels over several combining programs (`combine_plan`):
    the same output as one program a row, and one log-sum-exp a row (the first channel block's). Key
    dots in fp16 (int8 is the default from head size 128, this test's on a GPU), so that the
    reference's tolerance is the fp16 dots'."""
    import kernels.decode as decode

    dim = 2 * DIM
    layer = _layer("kitty-pro" + SMALL, LENS, dim=dim, seed=5)
    q = torch.randn(len(LENS), 4, 1, dim, device=DEVICE)
    scale = dim**-0.5  # a model's: the other tests' 0.25 at 128 channels sharpens the scores past fp16 dots' tolerance
    run = dict(pages_per_program=1, key_dots="fp16")
    whole, whole_lse = decode.decode_attention(layer, q, scale, return_lse=True, **run)
    monkeypatch.setattr(decode, "COMBINE_TILE", 64)  # a handful of partials a row is then too many for one
    (*_, combine), _ = decode.decode_launches(layer, q, scale, **run)
    assert combine[1] == (len(LENS) * 4, dim // 16) and combine[3]["num_warps"] == 2  # 16 channels a program
    split, split_lse = decode.decode_attention(layer, q, scale, return_lse=True, **run)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(split_lse, whole_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(split, decode.decode_attention_reference(layer, q, scale), atol=5e-3, rtol=1e-2)


def test_a_grid_sized_for_the_capacity_spreads_each_sequence_over_all_its_chunks():
    """On a grid of more page chunks than the pages need (a CUDA graph's, sized for the cache's
    capacity), a sequence's packed slots are split evenly over the chunks: each chunk holds at most
    ceil(n / chunks) of a sequence's n slots, so the sequence fills ceil(n / that) chunks (not
    ceil(n / PPP), the first few), and the output is the reference's."""
    from kernels.decode import decode_attention, decode_attention_reference

    layer = _layer("kitty-pro" + SMALL, [SINK + 2, SINK + 3 * GROUP + 5, SINK + 7 * GROUP + 1], seed=5)
    q = torch.randn(3, 4, 1, DIM, device=DEVICE)
    exact = layer.kernel_state()
    wide = dict(exact, max_slots=exact["max_slots"] + 9)
    ws = {}
    got = decode_attention(layer, q, 0.25, ws, wide, pages_per_program=4)
    # fp16 operands in the dots: another split rounds differently, as close to the reference
    torch.testing.assert_close(got, decode_attention_reference(layer, q, 0.25), atol=5e-3, rtol=1e-2)
    chunks = -(-wide["max_slots"] // 4)
    first = ws["m"].shape[2] - chunks  # the page chunks' partials follow the tail's
    live = ws["m"][:, :, first:first + chunks].isfinite().all(1)  # [B, chunks]: a partial stored
    n_vp = exact["n_vpages"].tolist()
    assert max(n_vp) > 4 and chunks > -(-max(n_vp) // 4)  # a grid wider than the pages need
    for b, n in enumerate(n_vp):
        filled = -(-n // -(-n // chunks)) if n else 0
        assert live[b].tolist() == [c < filled for c in range(chunks)], (n, live[b])
    assert any(-(-n // 4) < -(-n // -(-n // chunks)) for n in n_vp if n)  # some sequence spreads wider


def test_the_benchmarks_grid_for_a_capacity_is_the_graph_steps():
    """`bench kernels --cuda --grid-tokens N` sizes the page grids as a CUDA graph's step over a cache
    of N tokens' capacity does (`capacity_slots`), and refuses a grid narrower than the sequences."""
    from kitty_core.kernel_bench import grid_state

    layer = _layer("kitty-pro" + SMALL, [SINK + 2, SINK + 3 * GROUP + 5], seed=6)
    assert grid_state(layer)["max_slots"] == layer.kernel_state()["max_slots"]
    for tokens in (SINK + 4 * GROUP, SINK + 9 * GROUP + 1, 10_000):
        layer.capacity = tokens
        assert grid_state(layer, tokens)["max_slots"] == layer.capacity_slots()
    with pytest.raises(ValueError, match="narrower"):
        grid_state(layer, SINK + 1)


@pytest.mark.gpu
def test_the_kernel_tables_time_graphs_of_several_steps():
    """`bench kernels` (the Triton table and its other modes) times each step as a CUDA graph of
    several calls in a row, divided among them: every step captures and replays so, and says how."""
    from kitty_core.kernel_bench import bench_kernels, fp16_attention, pack_cost

    torch.manual_seed(0)
    df = bench_kernels([(2, 600)], [0.25], steps_a_graph=3)
    assert (df["steps_a_graph"] == 3).all()
    assert (df[["fused_ms", "unfused_ms", "sdpa_fp16_ms"]] > 0).all(axis=None)
    assert (df["fused_max_abs_err"] < 0.1).all()  # a misplaced plane or scale is off by whole units
    assert pack_cost((2, 600), steps_a_graph=3)["pack_triton_ms"] > 0
    fp16 = fp16_attention((2, 600), steps_a_graph=3)["ms"]
    assert fp16.notna().any() and (fp16.dropna() > 0).all()


def test_a_step_is_timed_as_a_graph_of_several_calls_divided_among_them(monkeypatch):
    """`step_ms`: the median replay of one CUDA graph holding the calls back to back, divided by
    their number (no GPU needed: the capture and the timing are replaced by ones that record)."""
    from kitty_core import kernel_bench

    captured = []
    monkeypatch.setattr(kernel_bench, "graphed", lambda fn, repeat=1: captured.append((fn, repeat)) or "replay")
    monkeypatch.setattr(kernel_bench, "cuda_time", lambda replay, **timing: {"replay": 12.0}[replay])
    step = object()
    assert kernel_bench.step_ms(step, 4) == 3.0
    assert kernel_bench.step_ms(step) == 12.0 / kernel_bench.STEPS_A_GRAPH
    assert captured == [(step, 4), (step, kernel_bench.STEPS_A_GRAPH)]


def test_partials_of_a_16_bit_model_are_kept_in_its_dtype():
    """A bf16 query's chunks keep their outputs in bf16 between the decode kernels and the combine:
    the step agrees with the same step in fp32 to bf16 rounding, across many chunks."""
    from kernels.decode import decode_attention

    layer = _layer("kitty-pro" + SMALL, [SINK + 5 * GROUP + 3, SINK + 2 * GROUP + 1], seed=6)
    q = torch.randn(2, 4, 1, DIM, device=DEVICE)
    want = decode_attention(layer, q, 0.25, pages_per_program=1)
    ws = {}
    got = decode_attention(layer, q.to(torch.bfloat16), 0.25, ws, pages_per_program=1)
    assert ws["acc"].dtype == torch.bfloat16 and ws["acc"].shape[2] >= 6 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@triton.jit
def _key8_planes(X, Y, BIAS: tl.constexpr):
    """Every plane of 256 bytes, dense then high (`test_int8_key_planes_are_the_codes_at_their_weights`)."""
    i = tl.arange(0, 256)
    x = tl.load(X + i)
    for p in tl.static_range(4):
        tl.store(Y + p * 256 + i, _key8_plane(x, p, 0, BIAS))
        tl.store(Y + (p + 4) * 256 + i, _key8_plane(x, p, 1, BIAS))


@triton.jit
def _int8_scores(QT, QB, RAW, HRAW, KS, KZ, OUT, D: tl.constexpr, R: tl.constexpr, G4: tl.constexpr,
                 NB: tl.constexpr, BIAS: tl.constexpr):
    """`_page_scores_i8` of one page head from plain row-major tensors, four planes into OUT."""
    c, j, t, k = tl.arange(0, D), tl.arange(0, R), tl.arange(0, G4), tl.arange(0, NB)
    qt = tl.load(QT + c[:, None] * R + j[None, :])
    qb = tl.load(QB + k[:, None] * R + j[None, :])
    raw = tl.load(RAW + t[:, None] * D + c[None, :])
    hraw = tl.load(HRAW + t[:, None] * NB + k[None, :])
    s0, s1, s2, s3 = _page_scores_i8(qt, qb, raw, hraw, tl.load(KS + c), tl.load(KZ + c), NB, BIAS)
    at = OUT + t[:, None] * R + j[None, :]
    tl.store(at, s0)
    tl.store(at + G4 * R, s1)
    tl.store(at + 2 * G4 * R, s2)
    tl.store(at + 3 * G4 * R, s3)


def test_int8_key_planes_are_the_codes_at_their_weights():
    """`_key8_plane` over every byte value: dense plane P holds code P at weight 1 or 4 (planes 1, 3),
    the high plane 4x that, all as non-negative int8."""
    from kernels.state import _bias

    x = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    y = torch.zeros(8, 256, dtype=torch.int8, device=DEVICE)
    _key8_planes[(1,)](x, y, _bias(None, DEVICE == "cuda"))
    for p, weight in enumerate((1, 4, 1, 4)):
        code = (x.int() >> (2 * p)) & 3
        assert torch.equal(y[p].int(), code * weight)
        assert torch.equal(y[p + 4].int(), code * weight * 4)


def test_int8_page_scores_are_the_rounded_query_against_the_codes():
    """`_page_scores_i8` for one key page head: the scores of the queries rounded to int8 as its
    docstring says (127 steps of each head's largest magnitude, the boosted channels' on their own,
    the residuals' share at the codes' mean taken out), to fp32 rounding; and within the bound that
    rounding leaves of the exact scores of the dequantized page."""
    from kernels.state import _bias

    d, r, g4, nb = (64, 4, 32, 32) if DEVICE == "cuda" else (16, 4, 4, 4)
    gen = torch.Generator().manual_seed(7)
    qt = torch.randn(d, r, generator=gen) * torch.linspace(0.1, 3, d)[:, None]
    ks, kz = torch.rand(d, generator=gen) + 0.05, torch.randn(d, generator=gen)
    ch = torch.randperm(d, generator=gen)[:nb]  # the boosted channels
    qb = qt[ch] * ks[ch, None]
    raw = torch.randint(0, 256, (g4, d), dtype=torch.uint8, generator=gen)
    hraw = torch.randint(0, 256, (g4, nb), dtype=torch.uint8, generator=gen)
    out = torch.empty(4, g4, r, device=DEVICE)
    dev = [x.to(DEVICE) for x in (qt, qb, raw, hraw, ks, kz)]
    _int8_scores[(1,)](*dev, out, d, r, g4, nb, _bias(None, DEVICE == "cuda"))

    def rounded(x):
        step = x.abs().amax(0) / 127
        x8 = torch.round(x / step)
        assert x8.abs().max() <= 127
        return x8, step, x8 * step - x

    q8, step, res = rounded(qt * ks[:, None])
    b8, bstep, bres = rounded(qb)
    zero = (qt * kz[:, None]).sum(0) - 1.5 * res.sum(0) - 6 * bres.sum(0)
    for p in range(4):
        low = ((raw.int() >> (2 * p)) & 3).float()  # [G/4, D]
        high = ((hraw.int() >> (2 * p)) & 3).float()  # [G/4, NB]
        want = step * (low @ q8) + bstep * (4 * high @ b8) + zero
        torch.testing.assert_close(out[p].cpu(), want, atol=1e-4, rtol=1e-5)
        exact = low @ (qt * ks[:, None]) + 4 * high @ qb + (qt * kz[:, None]).sum(0)
        bound = (res.abs() * (low - 1.5).abs().max(0).values[:, None]).sum(0)  # per head, the worst token
        bound = bound + (bres.abs() * 4 * 1.5).sum(0)
        assert ((out[p].cpu() - exact).abs() <= bound + 1e-4).all()


@pytest.mark.parametrize("spec", ["kitty-pro", "kivi-k2v2", "kitty+boost_rate=1.0", "k2v4-sink"])
def test_fused_decode_with_int8_key_dots_matches_reference(spec):
    """The fused step with int8 key dots against softmax over the dequantized layer: the query's
    8-bit rounding moves the outputs by up to ~1e-2 in the interpreter and ~3e-2 on an H200 (head
    size 64, where one query head's scores span several units); a misplaced plane or scale moves
    them by whole units."""
    from kernels.decode import decode_attention, decode_attention_reference

    layer = _layer(spec + SMALL, LENS, seed=2)
    q = torch.randn(len(LENS), 4, 1, DIM, device=DEVICE)
    ref = decode_attention_reference(layer, q, 0.25)
    for ppp in (1, 2):
        torch.testing.assert_close(decode_attention(layer, q, 0.25, pages_per_program=ppp, key_dots="int8"), ref,
                                   atol=5e-2, rtol=5e-2)
    with pytest.raises(ValueError, match="key_dots"):
        decode_attention(layer, q, 0.25, key_dots="int4")


def test_launch_plan_takes_deep_settings_only_for_grids_of_several_waves():
    from kernels.decode import DEEP, REGISTER_CAP, launch_plan

    stages, cap = DEEP[4]
    assert launch_plan(64 * 8, 68, 4, 132) == (16, stages, cap)  # 64 x 8K: 32 pages leave under 2.5 waves
    assert launch_plan(489 * 8, 41, 4, 132) == (32, stages, cap)
    assert launch_plan(8 * 8, 260, 4, 132) == (16, 2, REGISTER_CAP[4])  # 8 x 32K: one wave
    assert launch_plan(8, 1024, 4, 132) == (8, 2, REGISTER_CAP[4])
    assert launch_plan(489 * 8, 41, 8, 132) == (16, 2, REGISTER_CAP[8])  # groups of 8: no deep settings


def test_boost_rates_0_to_100_percent():
    from kernels.decode import decode_attention, decode_attention_reference
    from kernels.decode_unfused import decode_attention_unfused

    for rate in (0.0, 0.125, 0.25, 1.0):
        layer = _layer(f"kitty+boost_rate={rate}" + SMALL, [SINK + 2 * GROUP + 4, SINK + 4 * GROUP + 2], seed=1)
        assert layer.n_boost == round(rate * DIM)
        q = torch.randn(2, 4, 1, DIM, device=DEVICE)
        ref = decode_attention_reference(layer, q, 0.25)
        torch.testing.assert_close(decode_attention(layer, q, 0.25), ref, atol=5e-3, rtol=1e-2)
        torch.testing.assert_close(decode_attention_unfused(layer, q, 0.25), ref, atol=5e-3, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_engine_agrees_with_reference_on_the_demo_model(dtype):
    from kitty_core import KittyCache, load_model

    lm = load_model("demo", device="cuda", dtype=dtype)
    tok, model = lm.tokenizer, lm.model
    enc = tok(["In the beginning God created the heaven and the earth. " * 40, "Tell me about cats."],
              return_tensors="pt", padding=True).to("cuda")
    logits = {}
    for engine in ("reference", "triton"):
        cache = KittyCache(model, "kitty-pro", engine=engine)
        with torch.inference_mode():
            model(**enc, past_key_values=cache)
            step = model(input_ids=enc.input_ids[:, -1:], past_key_values=cache,
                         attention_mask=torch.cat([enc.attention_mask, enc.attention_mask[:, -1:]], 1))
        logits[engine] = step.logits[:, -1].float()
    # the reference attends in the model dtype through SDPA, the kernels in fp32 with fp16 dot operands
    # for the pages (the FP16 tail's in the model dtype): bf16's 8-bit mantissa leaves more rounding
    # between the two than fp16's 11
    tol = 0.15 if dtype == torch.float16 else 0.6
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=tol, rtol=0.05)
    outs = {e: model.generate(**enc, max_new_tokens=128, do_sample=False,
                              past_key_values=KittyCache(model, "kitty-pro", engine=e)) for e in ("reference", "triton")}
    same = (outs["triton"] == outs["reference"]).all(0)
    first = int((~same).nonzero()[0]) if not same.all() else None
    print(f"{dtype}: greedy 128 tokens, first divergence at position {first}")


@pytest.mark.parametrize("n_boost", [0, 2, DIM])
@pytest.mark.parametrize("value_bits", [2, 4])
def test_dequantize_kernel_is_exact(n_boost, value_bits):
    from kernels.dequant import dequantize_pages
    from kitty_core.quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values

    x = torch.randn(3, 2, GROUP, DIM, device=DEVICE) * torch.linspace(0.5, 4, DIM, device=DEVICE)
    kp, vp = quantize_keys(x, n_boost), quantize_values(x, value_bits)
    assert torch.equal(dequantize_pages(kp), dequantize_keys(kp))
    assert torch.equal(dequantize_pages(vp), dequantize_values(vp))


@pytest.mark.parametrize("rule", ["magnitude", "range", "qk"])
@pytest.mark.parametrize("n_boost", [0, 2, DIM // 4, DIM])
def test_key_pack_kernel_gives_the_reference_pages(rule, n_boost):
    from kernels.pack import quantize_keys
    from kitty_core import quant

    torch.manual_seed(n_boost)
    x = (torch.randn(3, 2, GROUP, DIM, device=DEVICE) * torch.linspace(0.5, 4, DIM, device=DEVICE)).to(torch.bfloat16)
    rms = torch.rand(1, 2, DIM, device=DEVICE)
    got, want = quantize_keys(x, n_boost, rule, rms), quant.quantize_keys(x, n_boost, rule, None, rms)
    for field in ("dense", "high", "boost_ch", "scale", "zero"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


@pytest.mark.parametrize("bits", [2, 4])
def test_value_pack_kernel_gives_the_reference_pages(bits):
    from kernels.pack import quantize_values
    from kitty_core import quant

    torch.manual_seed(bits)
    x = torch.randn(3, 2, GROUP, DIM, device=DEVICE, dtype=torch.float16).transpose(0, 1)  # strided input
    x[0, 0, 1] = 0.5  # a constant token: scale 0, every code 0
    got, want = quantize_values(x, bits), quant.quantize_values(x, bits)
    for field in ("low", "high", "scale", "zero"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def _chunked_prefill(model, cache, ids, chunks):
    """Logits of the last token of each chunk of a prompt prefilled in pieces, then of one step."""
    out, at = [], 0
    with torch.inference_mode():
        for n in chunks:
            out.append(model(input_ids=ids[:, at : at + n], past_key_values=cache, use_cache=True).logits[:, -1])
            at += n
        out.append(model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1])
    return out


@pytest.mark.skipif(DEVICE == "cuda", reason="tiny shapes for the interpreter; the demo model's test covers a GPU")
def test_a_prompt_prefilled_in_chunks_attends_to_its_history_on_the_pages(monkeypatch):
    """Triton engine: chunks after the first attend to the packed history through the decode kernels
    (a 40-token chunk in five launches of 8 query tokens) and to themselves in FP16; the logits are
    those of the reference engine, which rebuilds the dense FP16 history for every chunk, and the
    state the chunks leave is the same."""
    from conftest import tiny_model

    import kitty_core.triton_engine as engine
    from kitty_core import KittyCache

    calls = []
    real = engine.prefill_attention
    monkeypatch.setattr(engine, "prefill_attention", lambda *a: calls.append(a[1].shape) or real(*a))
    model = tiny_model("qwen3")
    ids = torch.randint(3, 256, (3, 72))
    spec = "kitty-pro+sink=4+group_size=16+local_window=16"
    got = _chunked_prefill(model, KittyCache(model, spec, engine="triton"), ids, [20, 40, 11])
    ref_cache = KittyCache(model, spec, engine="reference")
    want = _chunked_prefill(model, ref_cache, ids, [20, 40, 11])
    assert [s[2] for s in calls] == [40, 40, 11, 11]  # two chunks with a history, two layers each
    # the second chunk's logits differ by rounding (~5e-5); the pages packed from its keys then differ
    # where a key sat on a rounding boundary of its 2-bit code, and later logits by up to ~3e-3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(DEVICE == "cuda", reason="tiny shapes for the interpreter")
def test_a_long_chunk_attends_over_the_dense_history_unless_it_does_not_fit(monkeypatch):
    """A chunk whose history would take more than SHORT_CHUNK_LAUNCHES launches attends over the
    dense FP16 history; when that copy runs out of memory, on the pages, with nothing lost."""
    from conftest import tiny_model

    import kitty_core.triton_engine as engine
    from kitty_core import KittyCache
    from kitty_core.reference_engine import ReferenceEngine

    model = tiny_model("qwen3")
    ids = torch.randint(3, 256, (2, 93))
    spec = "kitty-pro+sink=4+group_size=16+local_window=16"
    assert engine.prefill_launches(2, 72) > engine.SHORT_CHUNK_LAUNCHES  # 2 query heads a KV head
    want = _chunked_prefill(model, KittyCache(model, spec, engine="reference"), ids, [20, 72])
    calls = []
    real = engine.prefill_attention
    monkeypatch.setattr(engine, "prefill_attention", lambda *a: calls.append(a[1].shape[2]) or real(*a))
    dense = _chunked_prefill(model, KittyCache(model, spec, engine="triton"), ids, [20, 72])
    assert calls == []
    attend_dense = ReferenceEngine.attend_dense

    def out_of_memory(layer, *args, **kwargs):
        if layer.seen:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return attend_dense(layer, *args, **kwargs)

    monkeypatch.setattr(ReferenceEngine, "attend_dense", staticmethod(out_of_memory))
    cache = KittyCache(model, spec, engine="triton")
    pages = _chunked_prefill(model, cache, ids, [20, 72])
    assert calls == [72, 72] and cache.get_seq_length() == 93 and cache.layers[0]._view_k is None
    for d, w in zip(dense[:2], want[:2]):  # the chunks: the reference engine's own path
        torch.testing.assert_close(d, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense[2], want[2], atol=1e-2, rtol=1e-2)  # the decode step after them
    for g, w in zip(pages, want):
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)


def _gemma2(softcap: float | None, layer_types=("full_attention", "full_attention"), head_dim: int = 16,
            device: str = "cpu", dtype=torch.float32):
    """A tiny random Gemma 2 on its eager attention (which applies the softcap), with its queries
    scaled up (x 20, and query_pre_attn_scalar 1) so that a softcap of 1 bends the scores: the same
    weights for every `softcap`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma2", vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, sliding_window=64,
                               query_pre_attn_scalar=1, attn_logit_softcapping=softcap,
                               max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 20
    return model.to(device, dtype).eval()


@pytest.mark.skipif(DEVICE == "cuda", reason="tiny shapes for the interpreter; the gpu test below covers a GPU")
def test_a_softcapped_model_attends_on_the_pages_with_its_softcap():
    """Gemma 2 (softcap 1, every layer full attention) on the Triton engine: a later prefill chunk on
    the pages, then decode steps from device counters, give the reference engine's logits (whose
    eager attention softcaps); the same model without its softcap is far from both."""
    from kitty_core import KittyCache

    spec = "kitty-pro+sink=4+group_size=16+local_window=16"
    ids = torch.randint(3, 256, (2, 56), generator=torch.Generator().manual_seed(1))
    logits, caches = {}, {}
    for name, softcap, engine in (("triton", 1.0, "triton"), ("reference", 1.0, "reference"),
                                  ("uncapped", None, "reference")):
        model = _gemma2(softcap)
        caches[name] = KittyCache(model, spec, engine=engine)
        logits[name] = _chunked_prefill(model, caches[name], ids[:, :53], [40, 12])  # chunks, a step
        with torch.inference_mode():
            for i in range(53, 56):
                logits[name].append(model(input_ids=ids[:, i : i + 1], past_key_values=caches[name]).logits[:, -1])
    triton = caches["triton"]
    assert triton.layers[0].softcap == 1.0 and triton.is_compileable
    assert triton.layers[0].steps is not None  # the decode steps ran from device counters
    for got, want, uncapped in zip(logits["triton"], logits["reference"], logits["uncapped"]):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # as the chunked prefill test's
        assert (uncapped - want).abs().max() > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("layer_types", [("sliding_attention", "full_attention"), ("full_attention",) * 2])
def test_a_softcapped_model_generates_on_the_triton_engine_as_on_the_reference(layer_types):
    """Gemma 2 (softcap 1, head size 64, fp16) generating 48 greedy tokens with kitty-pro on both
    engines: its full layers on the kernels (with every layer full, from device counters in
    transformers' compiled decode), its sliding layers on the reference path. Its logits are ~0.7 at
    most, and without the softcap ~0.8 away (fp32, CPU): the logits of every step agree to within
    0.03; the tokens are the same, unless the reference's two best tokens were closer than 0.06 where
    they part (a random model's top two are often a few 1e-3 apart). Raw logits, not `scores`: the
    scores carry min_new_tokens' -inf at the end-of-sequence token, whose differences are NaN."""
    from kitty_core import KittyCache

    model = _gemma2(1.0, layer_types, head_dim=64, device="cuda", dtype=torch.float16)
    uncapped = _gemma2(None, layer_types, head_dim=64, device="cuda", dtype=torch.float16)
    ids = torch.randint(3, 256, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=48, min_new_tokens=48, do_sample=False,
               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    spec = "kitty-pro+sink=4+group_size=64+local_window=64"
    with torch.inference_mode():
        outs = {e: model.generate(input_ids=ids, past_key_values=KittyCache(model, spec, engine=e), **gen)
                for e in ("triton", "reference")}
        plain = uncapped.generate(input_ids=ids, past_key_values=KittyCache(uncapped, spec, engine="reference"), **gen)
    got, want = outs["triton"], outs["reference"]
    logits, ref_logits = torch.stack(got.logits).float(), torch.stack(want.logits).float()  # [steps, B, V]
    assert (torch.stack(plain.logits).float()[0] - ref_logits[0]).abs().max() > 0.2  # the cap matters
    same = (got.sequences == want.sequences).all(0)[ids.shape[1]:]
    first = int((~same).nonzero()[0]) if not same.all() else len(same)
    torch.testing.assert_close(logits[:first + 1], ref_logits[:first + 1], atol=0.03, rtol=0.03)
    if first < len(same):  # a near-tie decided differently
        top2 = ref_logits[first].topk(2, -1).values
        assert ((top2[:, 0] - top2[:, 1]) < 0.06).any(), f"the engines part at step {first} without a near-tie"


@pytest.mark.parametrize("spec, softcap", [("kitty-pro", None), ("kivi-k2v2", None), ("kitty-pro", 1.5)])
def test_prefill_attention_matches_attention_over_the_dense_history(spec, softcap):
    """`prefill_attention` (decode kernels over the state + the chunk over itself, merged by their
    log-sum-exps) against softmax attention over the dequantized history and the chunk, causal; with a
    softcap, on both sides."""
    from kernels.prefill import prefill_attention

    layer = _layer(spec + SMALL, [SINK + 3 * GROUP + 5] * 2, seed=7)
    layer.pad = [0, 0]  # no padding: a prompt's later chunk
    t, hq = 13, 4  # 2 query heads a KV head: 8 chunk tokens a launch, so two launches
    q = torch.randn(2, hq, t, DIM, device=DEVICE)
    k = torch.randn(2, 2, t, DIM, device=DEVICE)
    v = torch.randn(2, 2, t, DIM, device=DEVICE)
    past_k, past_v = layer.dense_history(torch.float32)
    keys = torch.cat([past_k, k], 2).repeat_interleave(2, 1)
    values = torch.cat([past_v, v], 2).repeat_interleave(2, 1)
    n = past_k.shape[2]
    mask = torch.ones(t, n + t, dtype=torch.bool, device=DEVICE).tril(n)
    scores = (q @ keys.transpose(-1, -2)) * 0.25
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ values
    torch.testing.assert_close(prefill_attention(layer, q, k, v, 0.25, softcap=softcap), want, atol=5e-3, rtol=1e-2)


# a 16-bit model's dtype: bf16 on a GPU; fp16 in the interpreter, whose bf16 dots are wrong (Triton 3.6)
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.parametrize("rep, t, softcap", [(1, 1, None), (3, 13, None), (4, 32, None), (2, 40, None), (8, 7, None),
                                             (2, 40, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_chunk_self_attention_matches_its_reference(rep, t, softcap, dtype):
    """The chunk's causal attention to itself, merged with attention elsewhere by log-sum-exps
    (`_chunk_self_kernel`), against the same in PyTorch: GQA groups of 1-8 (3 pads to 4 rows), chunks
    of one token to more than one key block, past sides from negligible to dominant; a softcap that
    bends the scores (up to ~10, capped at 1)."""
    from kernels.prefill import chunk_self_attention, chunk_self_attention_reference

    g = torch.Generator().manual_seed(rep * 100 + t)
    b, h = 2, 2

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    q, k, v = rand(b, h * rep, t, DIM), rand(b, h, t, DIM, scale=2.0), rand(b, h, t, DIM)
    past = rand(b, h * rep, t, DIM)
    past_lse = (torch.randn(b, h * rep, t, generator=g) * 4).to(DEVICE)  # weights of the past side from ~e-8 up
    got = chunk_self_attention(q, k, v, past, past_lse, 0.3, softcap)
    want = chunk_self_attention_reference(q, k, v, past, past_lse, 0.3, softcap)
    if softcap:
        uncapped = chunk_self_attention_reference(q, k, v, past, past_lse, 0.3)
        assert (uncapped.float() - want.float()).abs().max() > 0.1
    assert got.dtype == dtype and got.shape == q.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # the kernel reads the query and the chunk with any strides (here [B, t, H, D] transposed)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(chunk_self_attention(qt, k, v, past, past_lse, 0.3, softcap), got)


@pytest.mark.gpu
def test_chunked_prefill_on_the_pages_agrees_with_reference_on_the_demo_model():
    """The demo model (bf16) prefilled in a chunk of 96 tokens, then chunks of 32: those attend to the
    packed history through the kernels (7 launches a layer for 3 query heads a KV head); the logits
    agree with the reference engine's as the decode steps do
    (`test_triton_engine_agrees_with_reference_on_the_demo_model`)."""
    import kitty_core.triton_engine as engine

    from kitty_core import KittyCache, load_model

    lm = load_model("demo", device="cuda", dtype=torch.bfloat16)
    model = lm.model
    chunks = [96] + [32] * 12
    ids = lm.tokenizer(["In the beginning God created the heaven and the earth. " * 48] * 2,
                       return_tensors="pt").input_ids[:, : sum(chunks)].cuda()
    assert ids.shape[1] == sum(chunks)
    assert engine.prefill_launches(3, 32) <= engine.SHORT_CHUNK_LAUNCHES
    got = _chunked_prefill(model, KittyCache(model, "kitty-pro", engine="triton"), ids, chunks)
    want = _chunked_prefill(model, KittyCache(model, "kitty-pro", engine="reference"), ids, chunks)
    # bf16 logits: up to 0.63 apart (2 of 98,304) on an H200 after 12 chunks on the pages, each
    # merged with its own attention by log-sum-exp
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=0.75, rtol=0.05)


@triton.jit
def _add_one(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, tl.load(X + i) + 1)


def test_a_launch_keeps_no_tensor_of_its_slots():
    """`plan.Launch`: the tensors in its slots at construction and at each run die with their owner
    (a tensor a CUDA graph allocated while recording must not outlive its step), and each run
    launches with the tensors it is given."""
    import gc
    import weakref

    from kernels.plan import Launch

    x, y = torch.zeros(16, device=DEVICE), torch.zeros(16, device=DEVICE)
    launch = Launch(_add_one, (1,), (x, y), dict(N=16), slots=(0,))
    first = weakref.ref(x)
    del x
    gc.collect()
    assert first() is None
    for value in (1.0, 5.0):
        x = torch.full((16,), value, device=DEVICE)
        launch.run(x)
        assert torch.equal(y, torch.full((16,), value + 1, device=DEVICE))
        ran = weakref.ref(x)
        del x
        gc.collect()
        assert ran() is None


def test_engine_names_carry_the_key_dots():
    """`KittyCache(..., engine=...)`: "triton+key_dots=int8" reaches the kernels; a wrong option or
    value is a ValueError that names the choices, before any model runs."""
    from kitty_core.engines import make_engine

    assert make_engine("triton+key_dots=int8").key_dots == "int8"
    assert make_engine("triton+key_dots=fp16").pages == "triton"  # the option of the Triton page kernel
    assert make_engine("triton").key_dots is None  # by head size (`key_dots_of`)
    with pytest.raises(ValueError, match="one or the other"):
        make_engine("triton+key_dots=int8+pages=cuda")
    with pytest.raises(ValueError, match="fp16, int8"):
        make_engine("triton+key_dots=int4")
    with pytest.raises(ValueError, match="key_dots"):
        make_engine("triton+stages=3")
    with pytest.raises(ValueError, match="engine must be one of"):
        make_engine("reference+key_dots=int8")
