"""Run by tests/test_sharding.py under torchrun (two ranks: gloo on CPU, NCCL where two GPUs are):
greedy generations of a model loaded tensor-parallel (`models.sharding_kwargs(tp=True)`), each
rank's KittyCache holding its own KV heads, against the same model loaded whole in this process;
then a model of the same config with random weights made sharded (`models.random_sharded`, as
`bench e2e --tp` loads `random:` shapes). Each rank writes what it found to OUT/rank{RANK}.txt, one
finding a line.

    torchrun --nproc-per-node 2 tests/tp_generate.py MODEL_DIR OUT
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from kitty_core import KittyCache
from kitty_core.models import random_sharded, sharding_kwargs
from kitty_core.sharding import local_kv_heads, tp_size

METHODS = ("fp16", "kitty-pro+sink=4+group_size=16+local_window=16")


def _generate(model, method, ids, mask):
    cache = KittyCache(model, method)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                         max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
    return out, cache


def main(model_dir: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    sharded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **sharding_kwargs(None, True))
    device = next(sharded.parameters()).device  # cpu under gloo; this rank's GPU where NCCL runs it
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    ids, mask = ids.to(device), mask.to(device)
    lines = [f"ranks {tp_size(sharded)}, kv heads held {local_kv_heads(sharded)}"]
    for method in METHODS:
        got, cache = _generate(sharded, method, ids, mask)
        want, full = _generate(whole, method, ids, mask)
        same = torch.equal(got, want)
        lines.append(f"equal {method}" if same else f"differ {method}: {got.tolist()} {want.tolist()}")
        heads = {layer.heads for layer in cache.layers}
        if heads != {local_kv_heads(sharded)}:
            lines.append(f"cache holds {heads} kv heads")
        # this rank's sink holds the keys of its own KV head of the whole model's, the rank-th
        mine, all_heads = cache.layers[0].k_sink.tokens(0), full.layers[0].k_sink.tokens(0)
        if not torch.allclose(mine, all_heads[rank : rank + 1], atol=1e-5):
            lines.append(f"{method}: the sink does not hold KV head {rank} of the whole model's")
    model = random_sharded(whole.config, torch.float32, sharding_kwargs(None, True))
    tokens, _ = _generate(model, METHODS[1], ids, mask)
    every = [None] * tp_size(model)
    dist.all_gather_object(every, tokens.tolist())
    lines.append("random ranks agree" if all(t == every[0] for t in every) else f"random ranks differ: {every}")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
