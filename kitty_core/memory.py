"""The byte budget of a method on a model: what each token costs, and what fits in a memory budget.

Per KV head and token (head size D, page size G, b boosted key channels), from the page format in
quant.py: keys D/4 + b/4 bytes of planes, plus D/G (boost index) + 4D/G (FP16 scale and zero per
channel per page); values D * value_bits / 8 bytes plus 4 (FP16 scale and zero per token). FP16
tokens cost 4D bytes (key and value). A sequence also holds at most S + G + (R + G) FP16 tokens
beside its pages (sink, key q-buffer, value window and q-buffer).
"""

from __future__ import annotations

import pandas as pd

from .config import KittyConfig, parse_method


def token_bytes(config: KittyConfig, head_dim: int) -> dict[str, float]:
    """Bytes per paged token and KV head: payload (the planes) and metadata (index, scales, zeros)."""
    d = head_dim
    if not config.quantize:
        return {"payload": 4.0 * d, "metadata": 0.0}
    g, nb = config.group_size, config.boosted_channels(d)
    payload = d / 4 + nb / 4 + d * config.value_bits / 8
    metadata = d / g + 4 * d / g + 4
    return {"payload": payload, "metadata": metadata}


def fp16_tokens_per_sequence(config: KittyConfig) -> int:
    """The most FP16 tokens a sequence holds beside its pages (keys and values counted as one token)."""
    if not config.quantize:
        return 0
    return config.sink + config.group_size + config.local_window


def layout_segments(config: KittyConfig, n_tokens: int) -> pd.DataFrame:
    """Where each of a sequence's n tokens lives, for keys and for values: one row per segment."""
    rows = []
    if not config.quantize:
        for side in ("keys", "values"):
            rows.append({"side": side, "part": "FP16", "start": 0, "tokens": n_tokens, "bits": 16})
        return pd.DataFrame(rows)
    s, g, r = config.sink, config.group_size, config.local_window
    sink = min(n_tokens, s)
    rest = n_tokens - sink
    kbits = 4 if config.key_bits == 4 else 2 + 2 * config.boost_rate
    k_pages, v_pages = rest // g, max(rest - r, 0) // g
    segments = {
        "keys": [("sink (FP16)", sink, 16), ("pages", k_pages * g, kbits), ("q-buffer (FP16)", rest - k_pages * g, 16)],
        "values": [("sink (FP16)", sink, 16), ("pages", v_pages * g, config.value_bits),
                   ("q-buffer + local window (FP16)", rest - v_pages * g, 16)],
    }
    for side, parts in segments.items():
        start = 0
        for part, count, bits in parts:
            rows.append({"side": side, "part": part, "start": start, "tokens": count, "bits": bits})
            start += count
    return pd.DataFrame(rows)


def memory_table(shape: dict, methods, budget_gib: float = 80.0, context: int = 8192) -> pd.DataFrame:
    """Per method: bytes per token (whole model, with and without metadata), bits per element, the
    longest single sequence and the largest batch at `context` tokens that fit `budget_gib` of KV."""
    layers, heads, d = shape["layers"], shape["kv_heads"], shape["head_dim"]
    budget = budget_gib * 2**30
    rows = []
    for m in methods:
        c = parse_method(m)
        tb = token_bytes(c, d)
        per_token = (tb["payload"] + tb["metadata"]) * layers * heads
        fixed = fp16_tokens_per_sequence(c) * 4 * d * layers * heads
        per_sequence = fixed + context * per_token
        rows.append({
            "method": m,
            "bits_per_element": c.bits_per_element(d),
            "bytes_per_token": per_token,
            "bytes_per_token_payload": tb["payload"] * layers * heads,
            "vs_fp16": 4 * d / (tb["payload"] + tb["metadata"]),
            "max_context": int(max(budget - fixed, 0) // per_token),
            "max_batch": int(budget // per_sequence),
        })
    return pd.DataFrame(rows)
