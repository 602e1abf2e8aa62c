"""Fused RMSNorm and rotary embedding (kitty_core.fusion): the same numbers from fewer kernels on a
GPU, and nothing changed anywhere else."""

import pytest
import torch

from conftest import FAMILIES, tiny_model
from kitty_core.fusion import _modeling_modules, _norms, fuse, is_fused, rms_norm, unfuse


@pytest.mark.parametrize("family", FAMILIES)
def test_rms_norm_is_the_modules_formula(family):
    """Bit for bit in eager PyTorch, for every supported family, in bf16 as in fp32."""
    model = tiny_model(family, dtype=torch.bfloat16)
    norms = list(_norms(model))
    assert len(norms) >= 2 * model.config.num_hidden_layers + 1
    for module in norms:
        torch.nn.init.normal_(module.weight)
        x = torch.randn(3, 5, module.weight.shape[0], dtype=torch.bfloat16) * 4
        assert torch.equal(rms_norm(x, module.weight, module.variance_epsilon), module(x))


def test_fuse_changes_nothing_on_a_cpu():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 256, (2, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert fuse(model) == {"norms": 0, "rotary": 0}
        after = model(input_ids=ids).logits
    assert not is_fused(model)
    assert torch.equal(before, after)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_model_gives_the_same_logits_on_a_gpu(family):
    model = tiny_model(family, dtype=torch.bfloat16).cuda()
    ids = torch.randint(3, 256, (4, 33), device="cuda")
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        want_step = model(input_ids=ids[:, :1]).logits.float()
        done = fuse(model)
        got = model(input_ids=ids).logits.float()
        step = model(input_ids=ids[:, :1]).logits.float()  # another shape: compiled again, same numbers
    assert done["norms"] == 2 * model.config.num_hidden_layers + 1 + (2 * model.config.num_hidden_layers
                                                                       if family == "qwen3" else 0)
    assert done["rotary"] == 1 and is_fused(model)
    assert all(hasattr(m.apply_rotary_pos_emb, "original") for m in _modeling_modules(model))
    # bf16 rounding: inductor keeps float32 between the ops that eager PyTorch rounds after each
    for fused, eager in ((got, want), (step, want_step)):
        assert (fused - eager).abs().max() <= 0.05 * eager.abs().max()
        assert (fused.argmax(-1) == eager.argmax(-1)).float().mean() > 0.9
    unfuse(model)
    assert not is_fused(model)
    assert not any(hasattr(m.apply_rotary_pos_emb, "original") for m in _modeling_modules(model))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits.float(), want)
