"""The architectures a KittyCache serves, and the ones it refuses: tiny random decoders (2 layers,
hidden size 64, 4 query / 2 KV heads of size 16) of each family, built here from transformers'
own configs on eager attention. For every supported one, the fp16 preset generates what
DynamicCache generates (a left-padded batch, sliding windows included), kitty-pro generates across
page boundaries (pages of 8 tokens), and each row of its left-padded batch is what that prompt
generates alone. Every refused one is refused when the cache is built, with a message that names
the architecture and what it lacks. The README's "Supported models" table is this file's result."""

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kitty_core import KittyCache, UnsupportedModelError

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
WINDOW = 24  # sliding windows shorter than the prompts and generations below, so that they matter
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SUPPORTED = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": MOE,
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=5.0),  # sliding, full; softcapped logits
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "phi3": {},
    "olmo2": {},
    "granite": {},
    "cohere": {},
}
SMALL_PAGES = "kitty-pro+sink=4+group_size=8+local_window=8"


def tiny(family: str, **changes):
    cfg = AutoConfig.for_model(family, **{**TINY, **SUPPORTED.get(family, {}), **changes})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _prompts():
    """Two prompts, the second shorter (left-padded in a batch): 40 and 27 tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    ids[1, :13] = 0
    return ids, mask


GEN = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family", SUPPORTED)
def test_supported_architecture(family):
    model = tiny(family)
    ids, mask = _prompts()
    ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), **GEN)
    fp16 = model.generate(input_ids=ids, attention_mask=mask, past_key_values=KittyCache(model, "fp16"), **GEN)
    assert torch.equal(fp16, ref), "fp16 preset differs from DynamicCache"

    cache = KittyCache(model, SMALL_PAGES)
    batch = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **GEN)
    for layer in cache.layers:
        if layer.is_sliding:  # no sink; pages dropped once out of the window, the newest W - 1 tokens kept
            held = layer.tokens(0) - int(layer.dropped[0, 0])
            assert layer.k_pages.free and WINDOW - 1 <= held < WINDOW - 1 + 8
        else:
            assert len(layer.k_pages.table[0]) >= 6  # (64 - 4) // 8 key pages
    n = ids.shape[1]
    for row in range(2):
        real = mask[row].bool()
        one = model.generate(input_ids=ids[row : row + 1, real], attention_mask=mask[row : row + 1, real],
                             past_key_values=KittyCache(model, SMALL_PAGES), **GEN)
        assert torch.equal(batch[row, n:], one[0, int(real.sum()):]), f"row {row} of the padded batch differs"


def _build(name):
    if name == "falcon":  # calls SDPA itself
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "falcon", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    if name == "deepseek_v3":  # multi-head latent attention
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "deepseek_v3", **{**TINY, **MOE}, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1))
    if name == "t5":  # encoder-decoder
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4))
    if name == "mllama":  # cross-attention layers
        return transformers.MllamaForCausalLM(transformers.MllamaTextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0))
    if name == "qwen3_next":  # linear-attention layers
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "qwen3_next", **{**TINY, **MOE}, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16))
    if name == "lfm2":  # convolution layers
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "lfm2", **TINY, layer_types=["conv", "full_attention"]))
    raise KeyError(name)


REFUSED = {
    "falcon": "FalconForCausalLM (falcon) is not supported by KittyCache: its attention code calls SDPA",
    "deepseek_v3": "DeepseekV3ForCausalLM (deepseek_v3) is not supported by KittyCache: it uses multi-head latent "
                   "attention",
    "t5": "T5ForConditionalGeneration (t5) is not supported by KittyCache: it is an encoder-decoder model",
    "mllama": "MllamaForCausalLM (mllama_text_model) is not supported by KittyCache: it has cross-attention layers",
    "qwen3_next": "Qwen3NextForCausalLM (qwen3_next) is not supported by KittyCache: qwen3_next has layers of type "
                  "['linear_attention'] without a key/value cache",
    "lfm2": "Lfm2ForCausalLM (lfm2) is not supported by KittyCache: lfm2 has layers of type ['conv'] without a "
            "key/value cache",
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_architecture(name):
    model = _build(name)
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError) as err:
        KittyCache(model, "kitty-pro")
    assert str(err.value).startswith(REFUSED[name])
    assert isinstance(err.value, ValueError)
    assert model.config._attn_implementation == before  # refused before anything was switched
