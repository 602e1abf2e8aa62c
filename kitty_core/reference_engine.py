"""The reference engine: attention over the dequantized history with transformers' SDPA."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .hf import base_attention
from .quant import quantize_keys, quantize_values

if TYPE_CHECKING:
    from .layer import KittyLayer


class ReferenceEngine:
    """Attention over the dequantized history with transformers' SDPA: the readable ground truth.

    It reads a dense view of what attention sees (pages dequantized, FP16 parts as stored) that the
    layer updates only where tokens arrived or were packed; the view is this engine's working copy,
    the memory report counts the packed state."""

    name = "reference"

    def quantize_keys(self, keys, n_boost, rule, generator, query_rms=None):
        return quantize_keys(keys, n_boost, rule, generator, query_rms)

    def quantize_values(self, values, bits):
        return quantize_values(values, bits)

    def attend(self, layer: "KittyLayer", module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        out = self.attend_dense(layer, module, query, key_new, value_new, attention_mask, scaling, **kwargs)
        layer.insert(key_new, value_new)  # after attention: the new tokens were attended as stored
        return out

    @staticmethod
    def attend_dense(layer: "KittyLayer", module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        """SDPA over the dense view of the history and the new tokens; the layer's state is left as
        it was (the new tokens are not inserted), so an out-of-memory here loses nothing."""
        past_k, past_v = layer.dense_history(key_new.dtype)  # [B, H, seen, D], right-aligned
        key_new, value_new = layer.as_stored(key_new, value_new)
        keys = torch.cat([past_k, key_new], dim=2)
        values = torch.cat([past_v, value_new], dim=2)
        kwargs.pop("dropout", None)
        return base_attention(module)(module, query, keys, values, attention_mask, dropout=0.0, scaling=scaling,
                                      **kwargs)
