"""transformers glue, in one place so that an upgrade touches one file.

How a Kitty layer meets a transformers model (5.x):
  1. `KittyLayer.update()` stores nothing; it returns `(PendingKV, value_states)`. transformers hands
     both unchanged to the registered attention function.
  2. `kitty_attention` (registered as the `kitty` attention implementation) sees the PendingKV and
     lets the layer attend over its history plus the new tokens, then insert them (so the new
     tokens are attended in FP16 and packed afterwards, the paper's order).
  3. The `kitty` mask is transformers' SDPA mask; on a prefill its last row tells the cache which
     positions are left padding, so pads never enter the cache.
For anything that is not a Kitty layer (a DynamicCache, no cache) `kitty_attention` is plain SDPA,
so switching a model to `kitty` changes nothing else.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


_registered = False


def register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, kitty_attention)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True


def enable_kitty_attention(model) -> None:
    """Route the model's attention through `kitty_attention` (idempotent)."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
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
