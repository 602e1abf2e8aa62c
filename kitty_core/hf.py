"""transformers glue, in one place so that an upgrade touches one file.

How a Kitty layer meets a transformers model (5.x):
  1. `KittyLayer.update()` stores nothing; it returns `(PendingKV, value_states)`. transformers hands
     both unchanged to the registered attention function.
  2. `kitty_attention` (registered as the `kitty` attention implementation) sees the PendingKV and
     lets the layer attend over its history plus the new tokens, then insert them (so the new
     tokens are attended as the model computed them, a decode step's token under `tail_bits=8` as
     the tail stores it, and packed afterwards: the paper's order).
  3. The `kitty` mask is the mask of the attention the model ran before (SDPA's, or eager's); on a
     prefill its last row tells the cache which positions are left padding, so pads never enter it.
For anything that is not a Kitty layer (a DynamicCache, no cache) `kitty_attention` is the
attention the model ran before the switch if that was its own eager code (which for Gemma 2 applies
its logit softcapping), else SDPA (`base_attention`), so switching a model to `kitty` does not change
its attention math; the reference engine attends with the same function.
"""

from __future__ import annotations

import sys
import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTN_NAME = "kitty"


class PendingKV:
    """New keys of one layer, on their way from `update()` to the attention function."""

    __slots__ = ("layer", "keys")

    def __init__(self, layer, keys: torch.Tensor):
        self.layer, self.keys = layer, keys

    @property
    def shape(self):  # some model code reads key.shape after update
        return self.keys.shape


def kitty_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if isinstance(key, PendingKV):
        return key.layer.attend(module, query, key.keys, value, attention_mask, scaling, **kwargs)
    return base_attention(module)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


_BASE: dict[int, str] = {}  # id(config) -> the attention implementation its model had before `kitty`


def _base(config) -> str:
    """"eager" for a model that ran its own eager attention before `kitty`, else "sdpa": the two whose
    4D masks a Kitty layer reads its pads from (flash and flex kernels take other masks)."""
    return "eager" if _BASE.get(id(config)) == "eager" else "sdpa"


def base_attention(module):
    """The attention function `module`'s model used before it was switched to `kitty`: for "eager",
    the model's own (`eager_attention_forward` of its modeling module, as transformers' attention
    layers call it), else SDPA."""
    if _base(getattr(module, "config", None)) == "eager":
        return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", sdpa_attention_forward)
    return sdpa_attention_forward


def kitty_mask(*args, config=None, **kwargs):
    """The mask of the attention the model ran before `kitty` (SDPA's boolean mask, eager's additive
    one ...): `base_attention` reads it as that attention would. A Kitty layer reads its pads from the
    diagonal of either kind (`leading_pads`).

    A 2D mask shorter than the cache's tokens and the new ones is what `generate` makes of a prompt no
    longer than what the cache already holds (a cache reused for another prompt): it would feed a
    slice of the prompt, or none of it, as the continuation. Refused here, before attention runs, as
    is an input of no tokens."""
    mask, kv = kwargs.get("attention_mask"), kwargs.get("kv_length", 0) + kwargs.get("kv_offset", 0)
    if mask is not None and mask.dim() == 2 and mask.shape[-1] < kv:
        raise ValueError(
            f"the attention mask covers {mask.shape[-1]} positions, but the cache and the new tokens make {kv}: "
            "the input does not continue what the cache holds. A KittyCache holds one conversation (generate "
            "continues it), so a new prompt needs a new cache: pass past_key_values=KittyCache(model, method) to "
            "each call (a pipeline over several prompts: one call per prompt, or all of them in one batch with "
            "batch_size=len(prompts))")
    if kwargs.get("q_length") == 0:  # else the model's own reshape of 0 tokens fails, in its words
        raise ValueError("the input has no tokens (an empty prompt?): give at least one token")
    return ALL_MASK_ATTENTION_FUNCTIONS[_base(config)](*args, config=config, **kwargs)


def softcapping(config) -> float | None:
    """The attention logit softcap that a model's attention applies: its `attn_logit_softcapping`
    (Gemma 2) where it ran its own eager attention before `kitty` (read after `enable_kitty_attention`),
    None on SDPA, which has no softcap, so that a Kitty layer's kernels compute what `base_attention`
    computes."""
    cap = getattr(text_config(config), "attn_logit_softcapping", None)
    return cap if cap and _base(config) == "eager" else None


_registered = False


def register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, kitty_attention)
        AttentionMaskInterface.register(ATTN_NAME, kitty_mask)
        _registered = True


def enable_kitty_attention(model) -> None:
    """Route the model's attention through `kitty_attention` (idempotent), remembering the attention
    it ran before for everything that is not a Kitty layer."""
    register()
    before = getattr(model.config, "_attn_implementation", None)
    if before != ATTN_NAME:
        configs = {id(c): c for c in (model.config, text_config(model.config))}
        configs.update({id(m.config): m.config for m in model.modules() if hasattr(m, "config")})
        for key, config in configs.items():
            _BASE[key] = before or "sdpa"
            weakref.finalize(config, _BASE.pop, key, None)
        model.set_attn_implementation(ATTN_NAME)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class UnsupportedModelError(ValueError):
    """A model whose attention a KittyCache cannot serve exactly; the message names the architecture
    and what it needs that the cache does not do."""


def check_supported(model) -> None:
    """Refuse, before anything is switched, a model whose attention a KittyCache cannot hold or reach:
    encoder-decoders and cross-attention (a second, fixed KV per layer), multi-head latent attention
    (keys and values of different head sizes, the compressed KV never reaches the cache), layers
    without a KV cache (linear attention, convolutions, chunked attention, shared KV), and models whose
    attention code calls SDPA or its own kernels itself instead of transformers' attention interface
    (`_supports_attention_backend`), where the `kitty` function would never see its queries."""
    cfg = text_config(model.config)
    name = f"{type(model).__name__} ({getattr(cfg, 'model_type', '?')})"
    why = None
    if getattr(model.config, "is_encoder_decoder", False):
        why = "it is an encoder-decoder model; the Kitty cache holds a decoder's self-attention only"
    elif getattr(cfg, "cross_attention_layers", None) or getattr(cfg, "add_cross_attention", False):
        why = "it has cross-attention layers, whose keys and values come from another input"
    elif getattr(cfg, "kv_lora_rank", None):
        why = (f"it uses multi-head latent attention (MLA, kv_lora_rank={cfg.kv_lora_rank}): compressed KV, keys "
               "and values of different head sizes; the Kitty cache stores per-head keys and values of one size")
    else:
        try:
            layer_windows(cfg)
        except ValueError as err:
            why = str(err)
    if why is None and not getattr(type(model), "_supports_attention_backend", False):
        why = ("its attention code calls SDPA (or its own kernels) itself instead of transformers' attention "
               "interface, so the `kitty` attention function would never see its queries")
    if why:
        raise UnsupportedModelError(
            f"{name} is not supported by KittyCache: {why}. KittyCache serves decoder-only models whose every layer "
            "is full or sliding-window attention through transformers' attention interface (Llama, Mistral, Qwen2/3, "
            "Gemma 2/3, Phi-3 ...; the README lists them)")


def layer_windows(config) -> list[int | None]:
    """Per layer, its sliding window (None: full attention), as transformers' own caches read the
    config (`get_layer_types_and_kwargs`: `layer_types`, else a `sliding_window` for every layer).
    ValueError naming the kinds of layers that keep no key/value cache a Kitty layer could hold."""
    cfg = text_config(config)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    unsupported = set(types) - {"full_attention", "sliding_attention"}
    if unsupported:
        raise ValueError(
            f"{cfg.model_type} has layers of type {sorted(unsupported)} without a key/value cache Kitty can hold "
            "(every layer must be full or sliding-window attention)")
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"{cfg.model_type} shares key/value caches between layers ({len(types)} caches for "
                         f"{cfg.num_hidden_layers} layers), which Kitty does not do")
    return [kwargs["sliding_window"] if t == "sliding_attention" else None for t in types]


def num_attention_layers(config) -> int:
    return len(layer_windows(config))


def model_shape(config) -> dict:
    """Layers, heads, head size and context of a decoder config."""
    cfg = text_config(config)
    heads = cfg.num_attention_heads
    return {
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "q_heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "context": getattr(cfg, "max_position_embeddings", None),
    }


LEFT_PADDING = ("KittyCache expects left padding (pads first, then the real tokens); "
                 "set tokenizer.padding_side = 'left'")


def leading_pads(mask: torch.Tensor | None, batch: int, length: int) -> list[int]:
    """Pads at the start of each sequence's `length` new tokens, from the 4D mask of a prefill: the
    diagonal of its last `length` columns, where a real token sees itself and a pad is masked (the last
    row would not do: a sliding window hides real tokens from it). All `length` may be pads (a chunk
    of a longer prompt); a pad after a real token is an error."""
    if mask is None:
        return [0] * batch
    n = torch.arange(length, device=mask.device)
    row = mask[:, 0, n - length + mask.shape[2], n - length + mask.shape[3]]  # [B or 1, length]
    allowed = row if row.dtype == torch.bool else row == 0
    allowed = allowed.expand(batch, length).cpu()
    pads = []
    for b in range(batch):
        n_pad = int((~allowed[b]).sum())
        if bool((~allowed[b, n_pad:]).any()):
            raise ValueError(LEFT_PADDING)
        pads.append(n_pad)
    return pads
