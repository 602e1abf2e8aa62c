"""Run by tests/test_sharding.py under torchrun (two ranks, gloo on CPU): greedy generations of a
model loaded tensor-parallel (`models.sharding_kwargs(tp=True)`), each rank's KittyCache holding its
own KV heads, against the same model loaded whole in this process. Each rank writes what it found
to OUT/rank{RANK}.txt: "ranks N, kv heads held H", then "equal METHOD" or "differ METHOD ...".

    torchrun --nproc-per-node 2 tests/tp_generate.py MODEL_DIR OUT
"""

import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kitty_core import KittyCache
from kitty_core.models import sharding_kwargs
from kitty_core.sharding import local_kv_heads, tp_size

METHODS = ("fp16", "kitty-pro+sink=4+group_size=16+local_window=16")


def main(model_dir: str, out: str) -> None:
    sharded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **sharding_kwargs(None, True))
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    lines = []
    for method in METHODS:
        got = []
        for model in (sharded, whole):
            cache = KittyCache(model, method)
            got.append(model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                      max_new_tokens=24, min_new_tokens=24, pad_token_id=0))
            if model is sharded:
                heads = {layer.heads for layer in cache.layers}
                lines.append(f"ranks {tp_size(model)}, kv heads held {','.join(map(str, sorted(heads)))}")
                assert heads == {local_kv_heads(model)}
        lines.append(f"equal {method}" if torch.equal(*got) else f"differ {method}: {got[0].tolist()} {got[1].tolist()}")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{os.environ['RANK']}.txt").write_text("\n".join(dict.fromkeys(lines)) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
