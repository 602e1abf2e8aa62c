import os

import pytest
import torch
from transformers import DynamicCache

from conftest import FAMILIES, tiny_model
from kitty_core import KittyCache, parse_method
from kitty_core.layer import KittyLayer
from kitty_core.reference_engine import ReferenceEngine


class _NoAttention(ReferenceEngine):
    """Stores what arrives and attends to nothing: drives the state machine alone."""

    def attend(self, layer, module, query, key_new, value_new, *args, **kwargs):
        layer.insert(key_new, value_new)


def _layer(spec, batch=1, heads=2, dim=16):
    layer = KittyLayer(parse_method(spec), _NoAttention())
    layer.lazy_initialization(torch.zeros(batch, heads, 0, dim), torch.zeros(batch, heads, 0, dim))
    return layer


def _feed(layer, keys, values, chunk):
    """Insert [B, H, n, D] in chunks of `chunk` tokens, as a prefill (first chunk) and decode steps."""
    for s in range(0, keys.shape[2], chunk):
        layer.attend(None, None, keys[:, :, s : s + chunk], values[:, :, s : s + chunk], None, None)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_state_machine_parts_and_page_cadence(chunk):
    S, G, R = 4, 8, 12
    layer = _layer(f"kitty-pro+sink={S}+group_size={G}+local_window={R}")
    torch.manual_seed(0)
    n = 61
    k, v = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    _feed(layer, k, v, chunk)
    assert layer.tokens(0) == n
    assert layer.k_sink.lens[0] == S and torch.equal(layer.k_sink.tokens(0), k[0, :, :S])
    assert len(layer.k_pages.table[0]) == (n - S) // G  # 7 key pages, 1 token in the q_buffer
    assert layer.k_buffer.lens[0] == (n - S) % G
    assert len(layer.v_pages.table[0]) == (n - S - R) // G  # 5 value pages
    assert layer.v_window.lens[0] == n - S - 5 * G and layer.v_window.lens[0] >= R
    # the FP16 parts hold the exact newest tokens; the pages dequantize close to the inputs
    assert torch.equal(layer.v_window.tokens(0), v[0, :, -layer.v_window.lens[0]:])
    hk, hv = layer.sequence_history(0, torch.float32)
    assert torch.equal(hk[:, :S], k[0, :, :S]) and torch.equal(hk[:, -1], k[0, :, -1])
    assert (hk - k[0]).abs().max() < 0.5 * (k.abs().max())
    assert (hk - k[0]).abs().mean() < 0.2 and (hv - v[0]).abs().mean() < 0.4


def test_a_page_is_packed_exactly_every_G_decode_steps():
    S, G, R = 2, 8, 8
    layer = _layer(f"kitty+sink={S}+group_size={G}+local_window={R}")
    counts = []
    for _ in range(50):
        x = torch.randn(1, 2, 1, 16)
        layer.attend(None, None, x, x, None, None)
        counts.append(len(layer.k_pages.table[0]))
    steps = [i + 1 for i in range(1, 50) if counts[i] != counts[i - 1]]  # tokens seen when a page appeared
    assert steps == [S + G * j for j in range(1, 7)]


def test_page_tables_on_host_and_device_follow_every_way_of_adding_pages():
    """A PagePool's page tables, kept on the host and on the device and updated in place, list each
    sequence's pages in the order they were added, whichever call added them, through regrowth of
    the tables; reserved width is kept, so a captured graph's table does not move."""
    from kitty_core.page_pool import PagePool
    from kitty_core.quant import quantize_values

    def pages(n):
        return quantize_values(torch.randn(n, 2, 8, 16), 2)

    pool, want, next_id = PagePool(type(pages(1)), 3, "cpu", width=2), [[], [], []], 0
    for op, arg in [("all", 1), ("rows", [2, 0]), ("one", (1, 3)), ("rows", [1]), ("rows", [0, 2]), ("all", 2)]:
        if op == "all":
            if len({len(w) for w in want}) > 1:  # add_all needs sequences in step
                with pytest.raises(RuntimeError, match="same page count"):
                    pool.add_all(pages(3 * arg))
                continue
            pool.add_all(pages(3 * arg))
            for b in range(3):
                want[b] += list(range(next_id + b * arg, next_id + (b + 1) * arg))
            next_id += 3 * arg
        elif op == "rows":
            pool.add_rows(arg, pages(len(arg)))
            for i, b in enumerate(arg):
                want[b].append(next_id + i)
            next_id += len(arg)
        else:
            b, n = arg
            pool.add(b, pages(n))
            want[b] += list(range(next_id, next_id + n))
            next_id += n
        assert pool.table == want and pool.count == next_id
        assert pool.device_n.tolist() == [len(w) for w in want]
        assert [row[: len(w)] for row, w in zip(pool.device_ids.tolist(), want)] == want
    pool.reserve_slots(64)
    held = pool.device_ids
    pool.add_rows([0, 1, 2], pages(3))
    assert pool.device_ids is held and pool.table == [w + [next_id + i] for i, w in enumerate(want)]


def test_bytes_by_part_follow_the_layout():
    S, G, R, D, H = 4, 16, 16, 16, 2
    layer = _layer(f"kitty-pro+sink={S}+group_size={G}+local_window={R}", heads=H, dim=D)
    x = torch.randn(1, H, 100, D)
    _feed(layer, x, x, 100)
    parts = layer.nbytes()
    kp, vp = len(layer.k_pages.table[0]), len(layer.v_pages.table[0])
    assert parts["key sink"] == S * H * D * 4  # fp32 model dtype here
    assert parts["key dense plane"] == kp * H * D * G // 4
    assert parts["key high plane"] == kp * H * (D // 4) * G // 4
    assert parts["key boost index"] == kp * H * (D // 4)  # a byte per boosted channel
    assert parts["key scales/zeros"] == kp * H * D * 4
    assert parts["value planes"] == vp * H * G * D // 4
    assert parts["value scales/zeros"] == vp * H * G * 4


def test_fp16_preset_keeps_every_token_exact():
    layer = _layer("fp16")
    x = torch.randn(1, 2, 300, 16)
    _feed(layer, x, -x, 37)
    hk, hv = layer.sequence_history(0, torch.float32)
    assert torch.equal(hk, x[0]) and torch.equal(hv, -x[0])


def test_padding_is_read_from_the_mask_and_never_stored():
    layer = _layer("kitty+sink=2+group_size=4+local_window=4", batch=2)
    x = torch.randn(2, 2, 6, 16)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :, :3] = False  # sequence 1: three pads
    layer.attend(None, None, x, x, mask, None)
    assert layer.pad == [0, 3] and layer.tokens(0) == 6 and layer.tokens(1) == 3
    assert torch.equal(layer.k_sink.tokens(1), x[1, :, 3:5])
    bad = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    bad[0, :, :, 4] = False  # a hole after real tokens: right padding
    with pytest.raises(ValueError, match="left padding"):
        _layer("kitty", batch=2).attend(None, None, x, x, bad, None)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_families_and_dtypes_generate(family, dtype):
    model = tiny_model(family, dtype)
    ids = torch.randint(3, 256, (2, 50))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0, min_new_tokens=20)
    ref = model.generate(**kw, do_sample=False, past_key_values=DynamicCache(config=model.config))
    out = model.generate(**kw, do_sample=False, past_key_values=KittyCache(model, "fp16"))
    assert torch.equal(out, ref)
    small = "kitty-pro+sink=4+group_size=8+local_window=8"  # pages form within this short run
    greedy = model.generate(**kw, do_sample=False, past_key_values=KittyCache(model, small))
    torch.manual_seed(0)
    sampled = model.generate(**kw, do_sample=True, top_k=20, past_key_values=KittyCache(model, small))
    assert greedy.shape == sampled.shape == (2, 70)


def test_fp16_equals_dynamic_cache_on_the_demo_model(demo):
    tok, model = demo.tokenizer, demo.model
    enc = tok(["The capital of France is", "In the beginning God created the heaven and the earth. " * 12],
              return_tensors="pt", padding=True)
    kw = dict(**enc, max_new_tokens=48, min_new_tokens=48, do_sample=False)
    ref = model.generate(**kw, past_key_values=DynamicCache(config=model.config))
    out = model.generate(**kw, past_key_values=KittyCache(model, "fp16"))
    assert torch.equal(out, ref)


PROMPTS = [
    "In the beginning God created the heaven and the earth. And the earth was without form, and void. " * 14,
    "Write a short story about a cat who learns to play the piano.",
    "The quick brown fox jumps over the lazy dog. " * 30,
]


@pytest.mark.parametrize("method", ["fp16", "kivi-k4v4", "kivi-k2v2", "kivi-k2v2-sink", "k4v2-sink", "k2v4-sink",
                                    "kitty", "kitty-pro"])
def test_padded_batch_equals_single_runs(demo, method):
    tok, model = demo.tokenizer, demo.model
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    n = enc.input_ids.shape[1]
    assert n > 32 + 128 + 128  # the longest prompt has key and value pages, the others fewer
    batch = model.generate(**enc, **kw, past_key_values=KittyCache(model, method))
    for i, p in enumerate(PROMPTS):
        one = tok([p], return_tensors="pt")
        single = model.generate(**one, **kw, past_key_values=KittyCache(model, method))
        assert torch.equal(batch[i, n:], single[0, one.input_ids.shape[1]:]), f"sequence {i} differs"


def test_chunked_prefill_with_pads_longer_than_a_chunk(demo):
    """transformers' prefill_chunk_size feeds a long padded prompt in chunks: a sequence whose first
    chunks are all padding keeps counting its pads, and FP16 generates exactly as unchunked."""
    tok, model = demo.tokenizer, demo.model
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    pads = (enc.attention_mask == 0).sum(1).tolist()
    assert max(pads) > 2 * 64  # some sequence is all padding for two chunks
    for method in ("fp16", "kitty-pro"):
        whole, chunked = KittyCache(model, method), KittyCache(model, method)
        a = model.generate(**enc, **kw, past_key_values=whole)
        b = model.generate(**enc, **kw, past_key_values=chunked, prefill_chunk_size=64)
        assert chunked.layers[0].pad == whole.layers[0].pad == pads
        if method == "fp16":
            assert torch.equal(a, b)


def test_bytes_per_token_at_8k_match_the_formula(demo):
    """kitty-pro on the demo model (3 KV heads, D=64, G=128), 8192 tokens: pages cost the DESIGN formula."""
    model = demo.model
    cache = KittyCache(model, "kitty-pro")
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (1, 8192))
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    report = cache.memory_report().set_index("part")["bytes"]
    layers, H, D, G, f = 30, 3, 64, 128, 0.25
    key_pages = (8192 - 32) // G
    value_pages = (8192 - 32 - 128) // G
    per_token_head = {  # DESIGN.md: keys D/4 + f*D/4 + D/G + 4D/G, values D/4 + 4 bytes
        "key dense plane": D / 4, "key high plane": f * D / 4, "key boost index": f * D / G, "key scales/zeros": 4 * D / G,
    }
    for part, per in per_token_head.items():
        assert report[part] / (layers * H * key_pages * G) == pytest.approx(per)
    assert report["value planes"] / (layers * H * value_pages * G) == pytest.approx(D / 4)
    assert report["value scales/zeros"] / (layers * H * value_pages * G) == pytest.approx(4)
    paged = sum(report[p] for p in per_token_head) / (layers * key_pages * G)
    assert paged == pytest.approx(H * (16 + 4 + 0.125 + 2))  # 66.375 bytes per token per layer for keys
    k_buffer = (8192 - 32) % G  # 96 keys wait for the next page
    v_window = 8192 - 32 - value_pages * G  # 224 values: the window of 128 and 96 waiting
    fp_parts = report[["key sink", "value sink", "key q_buffer", "value window + q_buffer"]].sum()
    assert fp_parts == layers * H * D * 4 * (2 * 32 + k_buffer + v_window)  # 4 bytes: fp32 model on CPU


def test_dense_view_matches_a_rebuild_from_the_packed_state():
    layer = _layer("kitty+sink=3+group_size=8+local_window=8", batch=2)
    torch.manual_seed(1)
    x = torch.randn(2, 2, 5, 16)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False
    layer.attend(None, None, x, x, mask, None)
    for step in range(40):
        y = torch.randn(2, 2, 1, 16)
        layer.attend(None, None, y, -y, None, None)
        k, v = layer.dense_history(torch.float32)  # incremental
        for b in range(2):
            hk, hv = layer.sequence_history(b, torch.float32)  # from scratch
            assert torch.equal(k[b, :, layer.pad[b]:], hk) and torch.equal(v[b, :, layer.pad[b]:], hv)
            assert not k[b, :, : layer.pad[b]].any()


@pytest.mark.parametrize("spec", ["kitty-pro", "kivi-k2v2+local_window=0", "k2v4-sink+group_size=8+local_window=4"])
def test_whole_batch_path_equals_sequence_by_sequence(spec):
    """A batch without padding is stored with whole-batch operations; it must hold exactly what the
    sequence-by-sequence path stores: same pages, same FP16 parts, same bytes."""
    torch.manual_seed(0)
    fast, slow = (KittyLayer(parse_method(spec + "+sink=5+group_size=16"), ReferenceEngine()) for _ in range(2))
    b, h, d = 3, 2, 16
    for layer in (fast, slow):
        layer.lazy_initialization(torch.zeros(b, h, 0, d), torch.zeros(b, h, 0, d))
    for t, pack in [(37, True), (1, True), (20, True), (1, False), (1, False)]:
        k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
        fast.insert(k, v, pack=pack)
        for i in range(b):
            slow._insert(i, k[i], v[i], pack)
        slow.seen += t
    fast.pack_full()
    for i in range(b):
        slow._insert(i, k[i, :, :0], v[i, :, :0], True)
    assert fast.nbytes() == slow.nbytes()
    for i in range(b):
        for x, y in zip(fast.sequence_history(i, torch.float32), slow.sequence_history(i, torch.float32)):
            assert torch.equal(x, y)
    state = fast.kernel_state()
    assert state["k_table"].tolist() == [ids + [0] * (state["k_table"].shape[1] - len(ids)) for ids in slow.k_pages.table]


@pytest.mark.parametrize("spec", ["kitty-pro", "kitty+selection=qk", "k2v4-sink", "kivi-k2v2", "fp16"])
def test_padded_decode_steps_equal_sequence_by_sequence(spec):
    """Decode steps of a padded batch write each sequence's token at its own position in one indexed
    write, and pack the sequences whose buffers filled in one call; the result must be what the
    sequence-by-sequence path stores, while some sequences still fill their sink and others pack."""
    torch.manual_seed(1)
    config = parse_method(spec if spec == "fp16" else spec + "+sink=5+group_size=16+local_window=16")  # fp16 has no pages
    fast, slow = (KittyLayer(config, ReferenceEngine()) for _ in range(2))
    b, h, d, t = 3, 2, 16, 40
    pad = [37, 0, 20]  # 3, 40 and 20 real prompt tokens: the first is still in its sink
    energy = torch.rand(b, h, d)  # as if queries had been seen (selection=qk)
    for layer in (fast, slow):
        layer.lazy_initialization(torch.zeros(b, h, 0, d), torch.zeros(b, h, 0, d))
        layer.pad = list(pad)
        layer.q_energy += energy
        layer.q_count += 3
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    fast.insert(k, v)
    slow.insert(k, v)
    for _ in range(40):  # crosses page boundaries of every sequence at different steps
        k, v = torch.randn(b, h, 1, d), torch.randn(b, h, 1, d)
        fast.insert(k, v, pack=False)
        fast.pack_full()
        for i in range(b):
            slow._insert(i, k[i], v[i], True)
        slow.seen += 1
    assert fast.nbytes() == slow.nbytes()
    assert fast.k_pages.table == slow.k_pages.table and fast.v_pages.table == slow.v_pages.table
    for i in range(b):
        for x, y in zip(fast.sequence_history(i, torch.float32), slow.sequence_history(i, torch.float32)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("spec", ["kitty-pro+sink=4+group_size=16+local_window=16", "kivi-k2v2+group_size=16", "fp16"])
def test_dense_view_of_an_unpadded_batch_is_built_in_blocks_as_each_sequence_reads(spec):
    """Without pads the dense view is rebuilt for blocks of sequences at once (one page gather and
    dequantization per block): it must equal each sequence's own history, chunk after chunk, also
    after the view was dropped (as the Triton engine does after a prefill chunk)."""
    torch.manual_seed(0)
    layer = _layer(spec, batch=5)
    for i, n in enumerate((37, 1, 20, 64, 3)):
        x = torch.randn(5, 2, n, 16)
        layer.insert(x, x * 0.5)
        keys, values = layer.dense_history(torch.float32)
        assert keys.shape == (5, 2, layer.seen, 16)
        for b in range(5):
            k, v = layer.sequence_history(b, torch.float32)
            assert torch.equal(keys[b], k) and torch.equal(values[b], v)
        if i == 2:
            layer.drop_dense_view()


def test_a_kitty_cache_keeps_the_models_attention_math():
    """Gemma 2 on eager attention softcaps its logits, SDPA does not: after a KittyCache switches the
    model to `kitty`, a DynamicCache still runs the eager code, the fp16 preset generates what
    DynamicCache generates, and a quantized preset attends with the softcap too (reference engine; the
    Triton engine's kernels on the full layers: `test_kernels.py` holds them to it where the cap bends
    the scores)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                               attn_logit_softcapping=5.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(3, 256, (1, 40))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        want = model.generate(input_ids=ids, past_key_values=DynamicCache(config=model.config), **gen)
        engine = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"
        kitty = KittyCache(model, "kitty-pro+sink=4+group_size=16+local_window=16", engine=engine)
        assert model.config._attn_implementation == "kitty"
        torch.testing.assert_close(model(input_ids=ids, past_key_values=DynamicCache(config=model.config)).logits, eager)
        assert torch.equal(model.generate(input_ids=ids, past_key_values=KittyCache(model, "fp16"), **gen), want)
        # the prompt attends in FP16 (no history yet): a quantized preset's prefill is the eager model's
        torch.testing.assert_close(model(input_ids=ids, past_key_values=kitty).logits, eager)
        assert not kitty.is_compileable
        if engine == "triton":  # the full layer's steps on the kernels (softcapped), the sliding one's by reference
            assert kitty.layers[1].softcap == 5.0 and "sliding-window layers" in kitty.device_steps_refusal()
            ref = KittyCache(model, "kitty-pro+sink=4+group_size=16+local_window=16", engine="reference")
            model(input_ids=ids, past_key_values=ref)
            for token in (5, 9, 17):
                tok = torch.tensor([[token]])
                torch.testing.assert_close(model(input_ids=tok, past_key_values=kitty).logits,
                                           model(input_ids=tok, past_key_values=ref).logits, atol=1e-3, rtol=1e-3)


def _same_state(a, b):
    """Two layers hold the same tokens in the same form: bytes by part, pages per sequence, histories."""
    assert a.nbytes() == b.nbytes() and a.seen == b.seen and a.pad == b.pad
    assert [len(t) for t in a.k_pages.table] == [len(t) for t in b.k_pages.table]
    assert [len(t) for t in a.v_pages.table] == [len(t) for t in b.v_pages.table]
    for i in range(a.batch):
        for x, y in zip(a.sequence_history(i, torch.float32), b.sequence_history(i, torch.float32)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("spec", ["kitty-pro+sink=4+group_size=8+local_window=8",
                                  "kivi-k2v2+sink=4+group_size=8+local_window=0", "fp16",
                                  "kitty-pro+sink=4+group_size=8+local_window=8+tail_bits=8"])
@pytest.mark.parametrize("padded", [False, True])
def test_crop_rolls_a_forward_back_as_if_it_had_been_shorter(spec, padded):
    """A forward of 6 tokens that packs a page (of keys; of values too without a local window), cut
    back by 4 under past recording (into that page: tokens 19-22 of a page of 12-19 and a q-buffer),
    leaves what a forward of its first 2 tokens leaves: same bytes, pages, histories, then the same after more steps; the reopened page's slot is reused. Without
    past recording a packed token cannot come back: a clear error."""
    torch.manual_seed(0)
    batch = 2 if padded else 1
    mask = torch.ones(batch, 1, 17, 17, dtype=torch.bool).tril()
    if padded:
        mask[1, :, :, :5] = False  # sequence 1: five pads
    prompt, chunk, more = torch.randn(batch, 2, 17, 16), torch.randn(batch, 2, 6, 16), torch.randn(batch, 2, 9, 16)
    cut, whole = _layer(spec, batch), _layer(spec, batch)
    for layer in (cut, whole):
        layer.attend(None, None, prompt, -prompt, mask, None)
    cut.activate_past_recording()
    cut.attend(None, None, chunk, -chunk, None, None)
    if spec != "fp16":
        assert len(cut.k_pages.table[0]) == len(whole.k_pages.table[0]) + 1  # keys 12-19 became a page
    cut.crop(-4)
    whole.attend(None, None, chunk[:, :, :2], -chunk[:, :, :2], None, None)
    _same_state(cut, whole)
    for t in range(more.shape[2]):
        for layer in (cut, whole):
            layer.attend(None, None, more[:, :, t : t + 1], -more[:, :, t : t + 1], None, None)
    _same_state(cut, whole)
    if spec != "fp16":
        assert cut.k_pages.count == whole.k_pages.count  # the freed slot held the next page
        late = _layer(spec, batch)
        late.attend(None, None, prompt, -prompt, mask, None)
        late.attend(None, None, chunk, -chunk, None, None)  # no past recording
        with pytest.raises(ValueError, match="activate_past_recording"):
            late.crop(-4)


def test_speculative_decoding_with_a_kitty_cache():
    """Prompt lookup and an assistant model verify several tokens a forward and crop the rest: the
    fp16 preset generates exactly what plain greedy decoding generates; kitty-pro with pages of 8
    runs through rollbacks that reopen pages, and with an 8-bit tail generates what its own plain
    greedy decoding does."""
    model, draft = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(0)).repeat(1, 3)  # lookups hit
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30,
              do_sample=False, pad_token_id=0)
    plain = model.generate(**kw)
    spec = "kitty-pro+sink=4+group_size=8+local_window=8"
    plain8 = model.generate(**kw, past_key_values=KittyCache(model, spec + "+tail_bits=8"))
    for extra in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=draft)):
        assert torch.equal(model.generate(**kw, **extra, past_key_values=KittyCache(model, "fp16")), plain)
        cache = KittyCache(model, spec)
        out = model.generate(**kw, **extra, past_key_values=cache)
        assert out.shape == plain.shape and cache.get_seq_length() == out.shape[1] - 1
        assert cache.layers[0].tokens(0) == cache.get_seq_length()
        # an 8-bit tail: rollbacks put tokens back as codes; the verified tokens are read as computed,
        # a decode step's as stored, which on this model moves no greedy choice
        assert torch.equal(model.generate(**kw, **extra, past_key_values=KittyCache(model, spec + "+tail_bits=8")),
                           plain8)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="tiny shapes for Triton's interpreter")
def test_crop_ends_device_steps_and_they_begin_again():
    """A cache decoding from device counters, cropped, goes back to the host's record (exact), and its
    later steps run from counters again: the tokens of a cache that never left host steps."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    spec = "kitty-pro+sink=4+group_size=16+local_window=16"
    outs = []
    for device_steps in (True, False):
        cache = KittyCache(model, spec, engine="triton", device_steps=device_steps)
        cache.activate_past_recording()
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache).logits
            for _ in range(5):
                step = logits[:, -1:].argmax(-1)
                logits = model(input_ids=step, past_key_values=cache).logits
            assert (cache.layers[0].steps is not None) == device_steps
            cache.crop(-2)
            assert cache.layers[0].steps is None and cache.get_seq_length() == 33
            turn = torch.cat([ids, ids[:, :4]], 1)
            out = model.generate(input_ids=turn, attention_mask=torch.ones_like(turn), past_key_values=cache,
                                 max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert (cache.layers[0].steps is not None) == device_steps
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_a_used_cache_refuses_a_new_prompt_or_batch():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    cache = KittyCache(model, "kitty-pro")
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **kw)
    with pytest.raises(ValueError, match="a new prompt needs a new cache"):  # a prompt no longer than the cache
        model.generate(input_ids=ids[:, :20], attention_mask=torch.ones_like(ids[:, :20]), past_key_values=cache, **kw)
    longer = torch.cat([ids[:1], ids[:1]], 1)  # one sequence, longer than the cache: it reaches the layers
    with pytest.raises(ValueError, match="holds 2 sequence"):
        model.generate(input_ids=longer, attention_mask=torch.ones_like(longer), past_key_values=cache, **kw)


def test_a_pipeline_over_prompts_one_cache_per_call(demo):
    """The text-generation pipeline calls generate once per batch: one cache for two prompts in two
    calls is refused; a fresh cache per call, or both prompts in one batch, generates what each prompt
    generates alone."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=demo.model, tokenizer=demo.tokenizer)
    prompts = ["The capital of France is Paris. The capital of Spain is", "Cats are"]
    kw = dict(max_new_tokens=8, do_sample=False, return_full_text=False)
    with pytest.raises(ValueError, match="a new prompt needs a new cache"):
        pipe(prompts, past_key_values=KittyCache(demo.model, "kitty-pro"), **kw)
    alone = [pipe(p, past_key_values=KittyCache(demo.model, "fp16"), **kw)[0]["generated_text"] for p in prompts]
    batched = pipe(prompts, batch_size=2, past_key_values=KittyCache(demo.model, "fp16"), **kw)
    assert [r[0]["generated_text"] for r in batched] == alone


def test_the_memory_report_says_what_each_part_is_stored_as():
    """The fp16 preset keeps the model's dtype: on an fp32 model every token costs 4 bytes an element."""
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 40))
    for spec in ("fp16", "kitty-pro+sink=4+group_size=8+local_window=8"):
        cache = KittyCache(model, spec)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
        report = cache.memory_report().set_index("part")
        assert report.loc["key sink", "stored_as"] == "float32"
        if spec == "fp16":
            assert report["bytes"].sum() == 2 * 2 * 2 * 40 * 16 * 4  # layers, K and V, heads, tokens, D, fp32
        else:
            assert report.loc["key dense plane", "stored_as"] == "2-bit codes"
            assert report.loc["key scales/zeros", "stored_as"] == "float16"


def _windowed(family, window, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                               sliding_window=window, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def test_sliding_window_layers_hold_only_their_window():
    """Mistral with a 32-token window over 210 tokens: the fp16 preset holds DynamicCache's bytes (the
    newest W - 1 tokens) and generates its tokens, also with prompt lookup's rollbacks; kitty-pro
    with pages of 8 drops every page wholly out of the window (its slot reused), holds a bounded
    number of tokens, and generates what the same cache generates when it keeps them all (a dropped
    token is never attended). Gemma 3: the sliding layer slides, the full layer keeps everything."""
    model = _windowed("mistral", 32)
    ids = torch.randint(3, 256, (1, 180), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30,
              do_sample=False, pad_token_id=0)
    dynamic = DynamicCache(config=model.config)
    want = model.generate(**kw, past_key_values=dynamic)
    fp16 = KittyCache(model, "fp16")
    assert torch.equal(model.generate(**kw, past_key_values=fp16), want)
    assert fp16.nbytes() == sum(x.keys.nbytes + x.values.nbytes for x in dynamic.layers) == 2 * 2 * 2 * 31 * 16 * 4
    assert set(fp16.memory_report()["part"]) == {"sliding window: keys", "sliding window: values"}
    looked = KittyCache(model, "fp16")
    lookup = model.generate(**{**kw, "input_ids": ids[:, :20].repeat(1, 9)}, prompt_lookup_num_tokens=3,
                            past_key_values=looked)
    assert torch.equal(lookup, model.generate(**{**kw, "input_ids": ids[:, :20].repeat(1, 9)}))
    assert looked.layers[0].k_sink.lens[0] == 31

    spec = "kitty-pro+sink=4+group_size=8+local_window=8"
    sliding, keeping = KittyCache(model, spec), KittyCache(model, spec)
    for layer in keeping.layers:  # the same layout, nothing dropped
        layer._slide = lambda slack=0: None
        layer._skip_out_of_window = lambda k, v: (k, v)
    assert torch.equal(model.generate(**kw, past_key_values=sliding), model.generate(**kw, past_key_values=keeping))
    for layer, kept in zip(sliding.layers, keeping.layers):
        assert layer.config.sink == 0 and layer.k_sink.lens[0] == 0  # a window has no FP16 sink
        assert len(layer.k_pages.table[0]) <= 4 and len(kept.k_pages.table[0]) == 209 // 8
        assert layer.k_pages.count <= 6  # dropped pages' slots hold the new ones
        assert 31 <= layer.tokens(0) - layer.dropped[0, 0] < 31 + 8
        assert 31 <= layer.tokens(0) - layer.dropped[1, 0] < 31 + 8 + 8
    assert sliding.nbytes() < keeping.nbytes() / 3

    gemma = _windowed("gemma3_text", 32, layer_types=["sliding_attention", "full_attention"])
    cache = KittyCache(gemma, spec)
    gemma.generate(**kw, past_key_values=cache)
    assert [layer.is_sliding for layer in cache.layers] == [True, False]
    assert len(cache.layers[0].k_pages.table[0]) <= 4 and len(cache.layers[1].k_pages.table[0]) == (209 - 4) // 8
    parts = set(cache.memory_report()["part"])
    assert "sliding window: key dense plane" in parts and "key dense plane" in parts and "key sink" in parts



@pytest.mark.parametrize("tail", ["", "+tail_bits=8"])
def test_crop_reopens_pages_a_padded_batchs_step_packed_after_attention(tail):
    """In a left-padded batch a decode step stores its token, then `pack_full` packs each sequence's
    full buffers one row at a time (the Triton engine's order). Under past recording a crop of a step
    that packed pages reopens them: the state of a cache that never took the step."""
    spec = "kitty-pro+sink=4+group_size=8+local_window=8" + tail
    torch.manual_seed(3)
    mask = torch.ones(2, 1, 20, 20, dtype=torch.bool).tril()
    mask[1, :, :, :3] = False  # sequence 1: three pads, so the sequences' pages fill at different steps
    prompt, tokens = torch.randn(2, 2, 20, 16), torch.randn(2, 2, 12, 16)

    def step(layer, t):
        layer.insert(tokens[:, :, t : t + 1], -tokens[:, :, t : t + 1], pack=False)
        layer.pack_full()

    packed = []
    for n in range(tokens.shape[2]):
        cut, whole = _layer(spec, 2), _layer(spec, 2)
        for layer in (cut, whole):
            layer.attend(None, None, prompt, -prompt, mask, None)
            for t in range(n):
                step(layer, t)
        cut.activate_past_recording()
        pages = [(cut.k_pages.pages_of(b), cut.v_pages.pages_of(b)) for b in range(2)]
        step(cut, n)
        grew = [(cut.k_pages.pages_of(b), cut.v_pages.pages_of(b)) != pages[b] for b in range(2)]
        if any(grew):
            packed.append(grew)
            cut.crop(-1)
            _same_state(cut, whole)
    # steps that packed a key page or a value page for one of the two sequences only (row by row)
    assert [True, False] in packed and [False, True] in packed
