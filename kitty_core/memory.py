"""The byte budget of a method on a model: what each token costs, and what fits in a memory budget.

Paged tokens cost `KittyConfig.token_bytes` per KV head (the page format of kernels/pages.py); FP16 tokens
cost 4D bytes (key and value). Beside its pages a sequence holds at most S + G tail keys (sink,
q-buffer) and S + R + G tail values (sink, local window, q-buffer): 2 bytes an element in FP16, or
1 and a 4-byte scale a vector in 8 bits (`tail_bits=8`).
"""

from __future__ import annotations

import pandas as pd

from .config import KittyConfig, parse_method


def tail_vector_bytes(config: KittyConfig, head_dim: int) -> int:
    """Bytes of one tail vector (a token's key or value, one head): 2 an element in FP16; in 8 bits
    1 an element and its fp32 scale (`kitty_core.regions`)."""
    return 2 * head_dim if config.tail_bits == 16 else head_dim + 4


def tail_bytes_per_sequence(config: KittyConfig, head_dim: int) -> int:
    """Most tail bytes per KV head a sequence holds beside its pages: S + G keys (sink, q-buffer)
    and S + R + G values (sink, window, q-buffer)."""
    if not config.quantize:
        return 0
    s, g, r = config.sink, config.group_size, config.local_window
    return tail_vector_bytes(config, head_dim) * ((s + g) + (s + r + g))


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
    t, tbits = ("FP16", 16) if config.tail_bits == 16 else ("INT8", 8)
    segments = {
        "keys": [(f"sink ({t})", sink, tbits), ("pages", k_pages * g, kbits),
                 (f"q-buffer ({t})", rest - k_pages * g, tbits)],
        "values": [(f"sink ({t})", sink, tbits), ("pages", v_pages * g, config.value_bits),
                   (f"q-buffer + local window ({t})", rest - v_pages * g, tbits)],
    }
    for side, parts in segments.items():
        start = 0
        for part, count, bits in parts:
            rows.append({"side": side, "part": part, "start": start, "tokens": count, "bits": bits})
            start += count
    return pd.DataFrame(rows)


def memory_table(shape: dict, methods, budget_gib: float = 80.0, context: int = 8192) -> pd.DataFrame:
    """Per method: bytes per token (whole model, with and without metadata), bits per element, the
    longest single sequence and the largest batch at `context` tokens that fit `budget_gib` of KV.
    The longest sequence is capped at the model's context (`shape["context"]`, where it has one);
    `max_context_budget` is what the budget alone would hold."""
    layers, heads, d = shape["layers"], shape["kv_heads"], shape["head_dim"]
    budget = budget_gib * 2**30
    rows = []
    for m in methods:
        c = parse_method(m)
        tb = c.token_bytes(d)
        per_token = (tb["payload"] + tb["metadata"]) * layers * heads
        fixed = tail_bytes_per_sequence(c, d) * layers * heads
        per_sequence = fixed + context * per_token
        longest = int(max(budget - fixed, 0) // per_token)
        rows.append({
            "method": m,
            "bits_per_element": c.bits_per_element(d),
            "bytes_per_token": per_token,
            "bytes_per_token_payload": tb["payload"] * layers * heads,
            "vs_fp16": 4 * d / (tb["payload"] + tb["metadata"]),
            "max_context": min(longest, shape["context"]) if shape.get("context") else longest,
            "max_context_budget": longest,
            "max_batch": int(budget // per_sequence),
        })
    return pd.DataFrame(rows)
