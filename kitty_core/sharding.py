"""Models sharded by transformers, two ways, and what a KittyCache needs to know about them.

Layer sharding (`from_pretrained(..., device_map="auto")`, accelerate): whole decoder layers on
different devices, run one after the other. Each `KittyLayer` takes its device from the keys that
reach it, so its FP16 parts and page pools live beside the layer's weights; `attention_devices`
says where each attention layer runs before any key exists (to fill a cache in a benchmark), and
`placement_summary` says in one line how `hf_device_map` placed the layers.

Tensor parallel (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` under
`torchrun`): every rank holds a slice of every layer's attention heads (q/k/v projections split by
columns, the output projection by rows), so its attention, and its KittyCache, sees only its own KV
heads: each rank's pages hold its heads, and the output projection's all-reduce is the only traffic,
as it is for FP16 attention. `tp_size` and `local_kv_heads` say how many heads that is.
"""

from __future__ import annotations

import os
import re
from contextlib import nullcontext

import torch

from .hf import model_shape, num_attention_layers

# what torchrun sets in every process it starts
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def torchrun_world() -> int | None:
    """Processes of the torchrun job this one belongs to (None: not started by torchrun)."""
    if not all(v in os.environ for v in TORCHRUN_VARIABLES):
        return None
    return int(os.environ["WORLD_SIZE"])


def tp_size(model) -> int:
    """Ranks a tensor-parallel model is split over (1: not split)."""
    return int(getattr(model, "_tp_size", None) or 1)


def local_kv_heads(model) -> int:
    """KV heads the attention of this rank (of a tensor-parallel model) computes."""
    heads, ranks = model_shape(model.config)["kv_heads"], tp_size(model)
    if heads % ranks:
        raise ValueError(f"{heads} KV heads do not split over {ranks} ranks; use a number of ranks that divides them")
    return heads // ranks


def _device_of(module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)  # accelerate runs an offloaded module on its execution device
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return None


def attention_devices(model) -> list[torch.device]:
    """The device each attention layer runs on, in layer order (the model's first parameter's device
    for a layer whose module says nothing)."""
    found: dict[int, torch.device] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and idx not in found and hasattr(module, "k_proj"):
            device = _device_of(module)
            if device is not None:
                found[idx] = device
    first = next(model.parameters()).device
    n = num_attention_layers(model.config)
    return [found.get(i, first) for i in range(n)]


def _device_name(where) -> str:
    return f"cuda:{where}" if isinstance(where, int) else str(where)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> "0-2, 5-6"."""
    out, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def placement_summary(device_map: dict | None) -> str:
    """One line on how a `device_map` (module name -> device, as `model.hf_device_map` holds it) placed
    the model: its decoder layers by device, in order, then the modules outside them, e.g.
    "layers 0-39 on cuda:0, 40-79 on cuda:1; embed_tokens on cuda:0, norm and lm_head on cuda:1"."""
    if not device_map:
        return "not layer-sharded: the whole model on one device"
    layers: dict[str, list[int]] = {}
    others: dict[str, list[str]] = {}
    for name, where in device_map.items():
        match = _LAYER.search(name)
        if match:
            layers.setdefault(_device_name(where), []).append(int(match.group(1)))
        else:
            others.setdefault(_device_name(where), []).append(name.rsplit(".", 1)[-1] or "model")
    order = sorted(layers, key=lambda d: min(layers[d]))
    parts = [f"{_ranges(sorted(layers[d]))} on {d}" for d in order]
    line = ("layers " + ", ".join(parts)) if parts else "no decoder layers named in the map"
    rest = [f"{' and '.join(names)} on {d}" for d, names in others.items()]
    return line + ("; " + ", ".join(rest) if rest else "")


def devices_used(device_map: dict | None) -> list[str]:
    """The distinct devices of a device map, in the order they first appear."""
    return list(dict.fromkeys(_device_name(w) for w in (device_map or {}).values()))


def on_device(device: torch.device):
    """Make `device` current while a layer's kernels run: Triton launches on the current CUDA device, and
    the layers of a model split by a device_map are on several (a no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
