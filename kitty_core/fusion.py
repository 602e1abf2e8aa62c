"""Fused norms and rotary embedding for decoding on a GPU: the same model, fewer and larger kernels.

A decode step of a transformers Llama-family model spends much of its non-attention time in small
element-wise kernels. RMSNorm runs as eight (cast up, square, mean, add eps, rsqrt, multiply, cast
down, multiply by the weight), four times a layer for Qwen3 (before attention and MLP, and the
per-head query and key norms); the rotary embedding as about ten (two products, a slice, a negation
and a concatenation, a sum, for the queries and again for the keys). `fuse` has torch.compile
(inductor) build one kernel for each:
- each RMSNorm module is pointed at a compiled `rms_norm` where its own forward computes the same
  thing (checked once per module class; Gemma's `1 + weight`, say, is left alone);
- the modeling module's `apply_rotary_pos_emb` is replaced by a compiled copy of itself. It is a
  module-level function in transformers, so this serves every model of that architecture in the
  process; `unfuse` puts it back.
Inputs on a CPU take the original code, so nothing changes there.

It is a property of the runtime, not of a cache: `python -m kitty_core.bench e2e` and `profile`
apply it before any cache is measured, so every cache, the FP16 baselines included, decodes through
the same fused model (`--no-fuse` to measure transformers' modules as they are).
"""

from __future__ import annotations

import sys
import types

import torch

_compiled = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama, Qwen2/3, Mistral ...): normalized in float32, cast back to the
    input's dtype, then scaled by the weight."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _fused_rms_norm():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(rms_norm, fullgraph=True)  # shapes: static first, dynamic on a change
    return _compiled


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.is_cuda:
        return _fused_rms_norm()(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def _norms(model):
    for module in model.modules():
        if (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
                and isinstance(getattr(module, "variance_epsilon", None), float)):
            yield module


def _same_formula(module) -> bool:
    """Does the module's own forward compute `rms_norm` (on a random input, to bf16/fp16 rounding)?"""
    w = module.weight
    x = torch.randn(2, 3, w.shape[-1], device=w.device, dtype=w.dtype)
    with torch.no_grad():
        return torch.allclose(type(module).forward(module, x).float(), rms_norm(x, w, module.variance_epsilon).float(),
                              rtol=1e-2, atol=1e-2)


def _compiled_rotary(original):
    compiled = torch.compile(original, fullgraph=True)

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if q.is_cuda:
            return compiled(q, k, cos, sin, *args, **kwargs)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def _modeling_modules(model):
    """The transformers modeling modules of the model's attention classes."""
    names = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("Attention")}
    return [sys.modules[n] for n in sorted(names) if n.startswith("transformers.") and n in sys.modules]


def fuse(model) -> dict:
    """Run the model's RMSNorms and rotary embedding as one compiled kernel each when their input is
    on a GPU. Returns what was fused: {"norms": modules, "rotary": modeling modules} (none without CUDA
    parameters). Idempotent; `unfuse` undoes it."""
    norms, rotary, checked = 0, 0, {}
    if not any(p.is_cuda for p in model.parameters()):
        return {"norms": 0, "rotary": 0}
    for module in _norms(model):
        kind = type(module)
        if kind not in checked:
            checked[kind] = _same_formula(module)
        if checked[kind]:
            module.forward = types.MethodType(_fused_forward, module)
            norms += 1
    for mod in _modeling_modules(model):
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if callable(fn) and not hasattr(fn, "original"):
            mod.apply_rotary_pos_emb = _compiled_rotary(fn)
        rotary += callable(fn)
    return {"norms": norms, "rotary": rotary}


def unfuse(model) -> None:
    """Back to each module's own forward and transformers' own rotary embedding."""
    for module in _norms(model):
        module.__dict__.pop("forward", None)
    for mod in _modeling_modules(model):
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if hasattr(fn, "original"):
            mod.apply_rotary_pos_emb = fn.original


def is_fused(model) -> bool:
    return any("forward" in module.__dict__ for module in _norms(model))
