"""What a user of `model.generate` gets: tokens per second of transformers' own `generate` with each
cache, against this library's graphed greedy loop, in one process on one model.

    python -m kitty_core.bench generate --model random:qwen3-8b --batch 8,64 --prompt 512 --new 192

Each path generates `new` tokens for `batch` prompts of `prompt` random token ids (no EOS: every
sequence generates exactly `new` tokens) and is timed from the call to its return, prefill included:
tokens/s = batch x new / seconds. Paths:

    dynamic            generate + transformers' DynamicCache, eager
    <method>:host      generate + KittyCache(method, device_steps=False): every step eager, from the host's record
    <method>:eager     generate + KittyCache(method), compile disabled: eager steps from device counters
    <method>           generate + KittyCache(method): transformers compiles the decode step (inductor,
                       CUDA graphs); timed on a second call of the same shape, after a first that compiles
    <method>:graphed   prefill + `GraphedDecoder` (this library's greedy loop of captured steps)

The compiled path's first call (compile + capture) is reported apart (`first_call_s`). With
`--second`, each compiled path then takes calls at another prompt length and at another batch, with
the graphs torch.compile traced meanwhile (`compiled_graphs`): what a second request costs. With
`--calls`, the host time of one eager decode-attention call (`attention_call_us`).
"""

from __future__ import annotations

import time

import pandas as pd
import torch
from transformers import DynamicCache

from .cache import KittyCache
from .gpu_memory import sync
from .graphs import GraphedDecoder


def compiled_graphs() -> int:
    """Graphs torch.compile has traced in this process."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _inputs(model, batch: int, prompt: int, seed: int = 0) -> dict:
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _cache(model, path: str, length: int):
    method, _, how = path.partition(":")
    if method == "dynamic":
        return DynamicCache(config=model.config)
    return KittyCache(model, method, max_length=length, device_steps=how != "host")


@torch.inference_mode()
def timed_generate(model, path: str, batch: int, prompt: int, new: int, seed: int = 0) -> tuple[float, torch.Tensor]:
    """(seconds, generated ids [batch, new]) of one path, prefill included."""
    enc = _inputs(model, batch, prompt, seed)
    cache = _cache(model, path, prompt + new)
    sync()
    start = time.perf_counter()
    if path.endswith(":graphed"):
        logits = model(**enc, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        first = logits[:, -1].argmax(-1, keepdim=True)
        with GraphedDecoder(model, cache, batch, first_ids=first) as decoder:
            tokens = [first]
            for _ in range(new - 1):
                decoder.step()
                tokens.append(decoder.ids.clone())
            out = torch.cat(tokens, 1)
    else:
        extra = {"disable_compile": True} if path.endswith(":eager") else {}
        out = model.generate(**enc, past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, **extra)[:, prompt:]
    sync()
    return time.perf_counter() - start, out


def measure(model, paths: list[str], batch: int, prompt: int, new: int, progress=None) -> pd.DataFrame:
    """One row per path: seconds and tokens/s of a whole `generate` call (see the module doc)."""
    rows = []
    for i, path in enumerate(paths):
        if progress:
            progress(i, len(paths), path)
        row = {"path": path, "batch": batch, "prompt": prompt, "new_tokens": new}
        compiled = ":" not in path and path != "dynamic"
        if compiled:  # the first call compiles and captures; the timed one is the second
            graphs = compiled_graphs()
            row["first_call_s"], _ = timed_generate(model, path, batch, prompt, new)
            row["graphs_compiled_first_call"] = compiled_graphs() - graphs
        seconds, _ = timed_generate(model, path, batch, prompt, new)
        row.update(seconds=seconds, tokens_per_s=batch * new / seconds)
        rows.append(row)
        print(row, flush=True)
    df = pd.DataFrame(rows)
    base = df.loc[df.path.str.endswith(":graphed"), "tokens_per_s"]
    if len(base):
        df["vs_graphed"] = df.tokens_per_s / base.iloc[0]
    return df


def second_requests(model, path: str, batch: int, prompt: int, new: int) -> pd.DataFrame:
    """What a compiled path's later calls cost: another prompt length, then another batch; each with
    the graphs torch.compile traced meanwhile."""
    rows = []
    for b, p in ((batch, prompt + 64), (max(1, batch // 2), prompt)):
        graphs = compiled_graphs()
        seconds, _ = timed_generate(model, path, b, p, new, seed=1)
        again, _ = timed_generate(model, path, b, p, new, seed=2)
        rows.append({"path": path, "batch": b, "prompt": p, "new_tokens": new, "first_s": seconds,
                     "again_s": again, "graphs_compiled": compiled_graphs() - graphs})
        print(rows[-1], flush=True)
    return pd.DataFrame(rows)


@torch.inference_mode()
def attention_call_us(model, method: str, batch: int, prompt: int, calls: int = 1000) -> dict:
    """Wall microseconds per eager decode-attention call of one layer (1,000 calls, one synchronize:
    the host's time per call wherever the GPU's is shorter), from the host's record (what every eager
    step ran before steps from device counters) and as `kitty::decode_step` from device counters."""
    from . import ops  # noqa: F401

    enc = _inputs(model, batch, prompt)
    out = {}
    for how in ("host", "device"):
        cache = KittyCache(model, method, max_length=prompt + calls + 8, device_steps=how == "device")
        model(**enc, past_key_values=cache, use_cache=True, logits_to_keep=1)
        layer = cache.layers[0]
        hq, d = cache.q_heads, layer.head_dim
        q = torch.randn(batch, hq, 1, d, device=layer.device, dtype=layer.dtype)
        k = torch.randn(batch, layer.heads, 1, d, device=layer.device, dtype=layer.dtype)
        module = model.model.layers[0].self_attn
        if how == "host":
            call = lambda: layer.attend(module, q, k, k, None, d**-0.5)  # noqa: E731
        else:
            call = lambda: torch.ops.kitty.decode_step(q, k, k, layer.steps.lens, 0, d**-0.5)  # noqa: E731
        for _ in range(10):
            call()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        out[f"{how}_us"] = 1e6 * (time.perf_counter() - start) / calls
        del cache
    return out
