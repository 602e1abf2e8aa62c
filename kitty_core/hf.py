"""transformers glue, in one place so that an upgrade touches one file.

How a Kitty layer meets a transformers model (5.x):
  1. `KittyLayer.update()` stores nothing; it returns `(PendingKV, value_states)`. transformers hands
     both unchanged to the registered attention function.
  2. `kitty_attention` (registered as the `kitty` attention implementation) sees the PendingKV and
     lets the layer attend over its history plus the new tokens, then insert them (so the new
     tokens are attended in FP16 and packed afterwards, the paper's order).
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
    last row of either kind (`cache.leading_pads`)."""
    return ALL_MASK_ATTENTION_FUNCTIONS[_base(config)](*args, config=config, **kwargs)


def softcapping(config) -> float | None:
    """The attention logits' softcap of a model (Gemma 2), which the Triton kernels do not apply."""
    return getattr(text_config(config), "attn_logit_softcapping", None)


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


def num_attention_layers(config) -> int:
    cfg = text_config(config)
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    unsupported = kinds - {"full_attention", "sliding_attention"}
    if unsupported:
        raise ValueError(
            f"{cfg.model_type} has layers of type {sorted(unsupported)} without a key/value cache; "
            "Kitty needs a decoder whose every layer is attention (Llama, Mistral, Qwen2, Qwen3 ...)"
        )
    return cfg.num_hidden_layers


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
