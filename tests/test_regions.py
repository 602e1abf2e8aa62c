"""The tail's token storage (kitty_core.regions): 16-bit as computed, or 8 bits (`tail_bits=8`)."""

import pytest
import torch

from conftest import tiny_model
from kitty_core import KittyCache
from kitty_core.config import parse_method
from kitty_core.layer import KittyLayer
from kitty_core.memory import memory_table, tail_bytes_per_sequence
from kitty_core.reference_engine import ReferenceEngine
from kitty_core.regions import TailRegion, dequantize_tokens, quantize_tokens


def test_int8_tokens_round_to_their_own_scale():
    """Each vector on max|x| / 127: its largest element exact, every element within scale / 2; a zero
    vector stays zero (scale 0, no division by it)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * torch.logspace(-3, 3, 5)[None, :, None]  # vectors six decades apart
    x[1, 2] = 0
    codes, scale = quantize_tokens(x)
    assert codes.dtype == torch.int8 and scale.shape == (3, 5) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    assert codes.abs().amax(-1)[scale > 0].eq(127).all() and not codes[1, 2].any() and scale[1, 2] == 0
    err = (dequantize_tokens(codes, scale, torch.float32) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()


def _bf16_layer(spec, batch=2, heads=2, dim=16):
    layer = KittyLayer(parse_method(spec), ReferenceEngine())
    z = torch.zeros(batch, heads, 0, dim, dtype=torch.bfloat16)
    layer.lazy_initialization(z, z)
    return layer


@pytest.mark.parametrize("padded", [False, True])
def test_an_8_bit_tail_stores_each_token_once(padded):
    """Tokens that stay in the tail while pages pack (a prefill's remainder, the window sliding by a
    page, decode steps, the general path of a padded batch) keep, in order, the codes and scales
    they got on arrival."""
    spec = "kitty-pro+sink=4+group_size=8+local_window=8+tail_bits=8"
    layer = _bf16_layer(spec)
    if padded:
        layer.pad = [0, 3]
    torch.manual_seed(1)
    tokens = torch.randn(2, 2, 61, 16).to(torch.bfloat16) * torch.linspace(0.1, 9, 16).to(torch.bfloat16)
    layer.insert(tokens[:, :, :29], tokens[:, :, :29] * -2)
    for t in range(29, 61):  # decode steps: the host packs after each
        layer.insert(tokens[:, :, t : t + 1], tokens[:, :, t : t + 1] * -2)
    assert layer.k_pages.pages_of(0) >= 5 and layer.v_pages.pages_of(0) >= 4
    for b in range(2):
        first = layer.pad[b]
        for region, side in ((layer.k_sink, 1), (layer.v_sink, -2)):
            codes, scale = quantize_tokens(tokens[b, :, first : first + region.lens[b]] * side)
            assert torch.equal(region.buf[b, :, : region.lens[b]], codes)
            assert torch.equal(region.scale[b, :, : region.lens[b]], scale)
        for region, side in ((layer.k_buffer, 1), (layer.v_window, -2)):
            n = region.lens[b]
            codes, scale = quantize_tokens(tokens[b, :, 61 - n :] * side)
            assert n and torch.equal(region.buf[b, :, :n], codes) and torch.equal(region.scale[b, :, :n], scale)


def test_regions_grow_and_drop_with_their_scales():
    region = TailRegion(2, 3, 8, torch.float32, "cpu", 2, growable=True, bits=8)
    x = torch.randn(3, 5, 8)
    region.append(1, x)
    assert region.capacity >= 5 and region.scale.shape[2] == region.capacity
    torch.testing.assert_close(region.tokens(1), x, atol=x.abs().max().item() / 254, rtol=0)
    want = region.tokens(1)[:, 2:]
    region.drop_oldest(1, 2)
    assert torch.equal(region.tokens(1), want) and region.lens == [0, 3]
    assert region.nbytes() == 3 * 3 * (8 + 4)  # int8 codes and an fp32 scale a vector
    with pytest.raises(ValueError, match="8 or 16"):
        TailRegion(1, 1, 8, torch.float32, "cpu", 2, growable=False, bits=4)


def test_an_8_bit_tail_halves_the_tail_in_the_memory_model_and_the_cache():
    """The budget's formula and a real cache agree on the tail's bytes: D + 4 a vector against 2D in
    FP16 (4D for a model in fp32, as here)."""
    c16, c8 = parse_method("kitty-pro"), parse_method("kitty-pro+tail_bits=8")
    assert tail_bytes_per_sequence(c8, 128) == (128 + 4) * (2 * 32 + 2 * 128 + 128)
    assert tail_bytes_per_sequence(c8, 128) / tail_bytes_per_sequence(c16, 128) == pytest.approx(132 / 256)
    shape = {"layers": 36, "kv_heads": 8, "head_dim": 128}
    table = memory_table(shape, ["kitty-pro", "kitty-pro+tail_bits=8"], budget_gib=120, context=8704).set_index("method")
    assert table.max_batch["kitty-pro+tail_bits=8"] > table.max_batch["kitty-pro"]

    model, d = tiny_model("llama"), 16
    ids = torch.randint(3, 200, (1, 300))
    parts = {}
    for spec in ("kitty-pro", "kitty-pro+tail_bits=8"):
        cache = KittyCache(model, spec)
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        report = cache.memory_report().set_index("part")
        parts[spec] = report
    for part in ("key sink", "value sink", "key q_buffer", "value window + q_buffer"):
        assert parts["kitty-pro+tail_bits=8"].bytes[part] * 4 * d == parts["kitty-pro"].bytes[part] * (d + 4)
        assert parts["kitty-pro+tail_bits=8"].stored_as[part].startswith("int8")
    assert parts["kitty-pro+tail_bits=8"].bytes["value planes"] == parts["kitty-pro"].bytes["value planes"]


def test_the_memory_report_names_each_layers_storage_of_the_tail():
    """Layers kept in full precision (`fp16_layers`) hold their tail in the model's dtype beside the
    other layers' int8: the report says both, and the bytes are each layer's own."""
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (1, 300))
    reports = {}
    for layers in ((), (0,)):
        cache = KittyCache(model, "kitty-pro+tail_bits=8", fp16_layers=layers)
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        reports[layers] = cache.memory_report().set_index("part")
    assert reports[()].stored_as["key sink"] == "int8, an fp32 scale a vector"
    assert reports[(0,)].stored_as["key sink"] == "float32 or int8, an fp32 scale a vector"
    assert reports[(0,)].stored_as["key dense plane"] == "2-bit codes"
    # the full-precision layer's "sink" holds all 300 tokens in fp32; the other keeps its int8 sink
    heads, d = model.config.num_key_value_heads, 16
    assert reports[(0,)].bytes["key sink"] == reports[()].bytes["key sink"] // 2 + 300 * heads * d * 4


@pytest.mark.parametrize("padded", [False, True])
def test_an_8_bit_tails_pages_are_the_same_in_both_engines_orders(padded):
    """A page that began in an 8-bit tail is packed from its tokens' codes, the token that completes
    it included: the history attention sees is the same, bit for bit, whether each decode step packs
    what it completes (the reference engine's order) or stores first and packs after attention
    (`pack=False`, then `pack_full`: the Triton engine's, whose kernels write the token as codes). A
    page that a prefill chunk fills by itself is packed from the tokens as they came: the same pages
    as with a 16-bit tail."""
    spec = "kitty-pro+sink=4+group_size=8+local_window=8"
    torch.manual_seed(2)
    tokens = torch.randn(2, 2, 53, 16).to(torch.bfloat16) * torch.linspace(0.1, 9, 16).to(torch.bfloat16)
    histories = {}
    for path in ("packing as they complete", "packing after", "16-bit tail"):
        layer = _bf16_layer(spec + ("" if path == "16-bit tail" else "+tail_bits=8"))
        if padded:
            layer.pad = [0, 3]
        layer.insert(tokens[:, :, :37], -tokens[:, :, :37])
        for t in range(37, 53):
            packing = path != "packing after"
            layer.insert(tokens[:, :, t : t + 1], -tokens[:, :, t : t + 1], pack=packing)
            if not packing:
                layer.pack_full()
        assert layer.k_pages.pages_of(0) == (53 - 4) // 8
        histories[path] = [layer.sequence_history(b, torch.float32) for b in range(2)]
    for b in range(2):
        (k, v), (k0, v0) = histories["packing after"][b], histories["packing as they complete"][b]
        assert torch.equal(k, k0) and torch.equal(v, v0)
        # the pages the prompt filled (after the sink of 4) as a 16-bit tail's
        k16, _ = histories["16-bit tail"][b]
        prompt = slice(4, 4 + (37 - layer.pad[b] - 4) // 8 * 8)
        assert prompt.stop > 20 and torch.equal(k[:, prompt], k16[:, prompt])
        # pages that began in the tail hold rounded tokens: not a 16-bit tail's
        assert not torch.equal(k[:, 36:44], k16[:, 36:44])


def test_a_step_attends_to_its_own_token_as_the_tail_stores_it():
    """The reference engine attends before it inserts, the Triton engine's kernels after they write
    the token: with an 8-bit tail both read the step's own key and value as codes (`as_stored`), so
    a step's output is attention over the state it leaves."""
    from kernels.decode import decode_attention_reference

    layer = KittyLayer(parse_method("kitty-pro+sink=4+group_size=8+local_window=8+tail_bits=8"), ReferenceEngine())
    torch.manual_seed(4)
    prompt = torch.randn(1, 2, 21, 16)
    layer.lazy_initialization(prompt[:, :, :0], prompt[:, :, :0])
    layer.insert(prompt, -prompt)
    k, v = torch.randn(1, 2, 1, 16) * 3, torch.randn(1, 2, 1, 16) * 3
    q = k  # the step's own token takes most of the weight: its value's rounding would show
    out, _ = ReferenceEngine.attend_dense(layer, None, q, k, v, None, 0.25)
    layer.insert(k, v)
    want = decode_attention_reference(layer, q, 0.25)
    torch.testing.assert_close(out.transpose(1, 2), want, atol=1e-6, rtol=1e-5)



def test_a_prompt_attends_to_its_own_tokens_as_computed():
    """A forward of several tokens reads them as the model computed them (the paper's FP16 prefill):
    an 8-bit tail's first chunk attends exactly as a 16-bit tail's, though it stores them rounded;
    a chunk after it reads the history as stored and itself as computed."""
    spec = "kitty-pro+sink=4+group_size=8+local_window=8"
    torch.manual_seed(5)
    x = torch.randn(1, 2, 40, 16).to(torch.bfloat16) * torch.linspace(0.1, 9, 16).to(torch.bfloat16)
    q = torch.randn(1, 2, 40, 16).to(torch.bfloat16)
    eight, sixteen = _bf16_layer(spec + "+tail_bits=8", batch=1), _bf16_layer(spec, batch=1)
    mask = torch.ones(27, 27, dtype=torch.bool).tril()[None, None]
    first = [ReferenceEngine.attend_dense(layer, None, q[:, :, :27], x[:, :, :27], -x[:, :, :27], mask, 0.25)[0]
             for layer in (eight, sixteen)]
    assert torch.equal(first[0], first[1])
    for layer in (eight, sixteen):
        layer.insert(x[:, :, :27], -x[:, :, :27])
    k_held, v_held = eight.dense_history(torch.bfloat16)
    assert not torch.equal(k_held[:, :, :4], x[:, :, :4])  # the sink, stored rounded
    chunk = x[:, :, 27:]
    mask = torch.ones(13, 40, dtype=torch.bool).tril(27)[None, None]
    out, _ = ReferenceEngine.attend_dense(eight, None, q[:, :, 27:], chunk, -chunk, mask, 0.25)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, 27:], torch.cat([k_held, chunk], 2), torch.cat([v_held, -chunk], 2), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=0, rtol=0)
