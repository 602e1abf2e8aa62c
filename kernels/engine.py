"""The Triton engine: decode steps attend directly on packed pages through `decode.decode_attention`.

Prefill (several new tokens) attends in FP16 over the prompt as the reference engine does; a decode
step stores the new token in FP16, runs the fused kernel over the layer's state, then packs any
buffer that became full (at most once every G steps).
"""

from __future__ import annotations

from kitty_core.cache import ReferenceEngine

from .decode import decode_attention


class TritonEngine(ReferenceEngine):
    name = "triton"

    def __init__(self):
        self.workspaces: dict[int, dict] = {}

    @staticmethod
    def supports(layer, query) -> bool:
        """Tensor-core tiles need G/4 and D/4 >= 16; a GQA group must fit one 16-row tile."""
        c = layer.config
        return (c.quantize and c.group_size % 64 == 0 and layer.head_dim % 64 == 0
                and query.shape[1] // layer.heads <= 16 and query.is_cuda)

    def attend(self, layer, module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        if key_new.shape[2] != 1 or not self.supports(layer, query):
            return super().attend(layer, module, query, key_new, value_new, attention_mask, scaling, **kwargs)
        layer.insert(key_new, value_new, pack=False)
        ws = self.workspaces.setdefault(layer.layer_idx, {})
        out = decode_attention(layer, query, scaling if scaling is not None else query.shape[-1] ** -0.5, ws)
        layer.pack_full()
        return out.transpose(1, 2), None  # transformers expects [B, t, Hq, D]
