import pytest
import torch

from conftest import tiny_model
from kitty_core import KittyCache
from kitty_core.config import KittyConfig
from kitty_core.probe import (
    Capture,
    agreement,
    capture,
    channel_stats,
    heatmap,
    int2_channel_error,
    outlier_ratios,
    sensitivity,
    spearman,
)

CFG = KittyConfig(sink=4, group_size=16)


@pytest.fixture(scope="module")
def tiny_capture():
    model = tiny_model("llama")
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (1, 70))
    seen = {}
    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.setdefault("k", o))
    cap = capture(model, ids)
    hook.remove()
    return model, cap, seen["k"]


def test_capture_shapes_and_pre_rope_keys(tiny_capture):
    model, cap, k_proj_out = tiny_capture
    assert cap.layers == 2 and cap.queries[0].shape == (4, 70, 16) and cap.keys[0].shape == (2, 70, 16)
    pre = k_proj_out[0].reshape(70, 2, 16).transpose(0, 1)  # [Hkv, T, D] before RoPE
    assert torch.allclose(cap.keys_pre_rope[1], pre, atol=1e-5)
    assert not torch.allclose(cap.keys[1], pre, atol=1e-3)  # RoPE did move them
    assert cap.scaling == pytest.approx(16 ** -0.5)
    assert model.config._attn_implementation != "kitty_capture"  # restored


def test_vectorized_probe_equals_a_loop_over_channels(tiny_capture):
    _, cap, _ = tiny_capture
    fast = sensitivity(cap, 1, CFG, rows_per_block=16)
    q, k = cap.queries[1], cap.keys[1]
    err = int2_channel_error(k, CFG)
    t = k.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    def probs(keys):
        logits = torch.einsum("hrd,hcd->hrc", q, keys.repeat_interleave(2, 0)) * cap.scaling
        return logits.masked_fill(~causal, float("-inf")).softmax(-1)

    base = probs(k)
    for d in range(k.shape[-1]):
        k_d = k.clone()
        k_d[..., d] += err[..., d]  # only channel d quantized
        mse = (probs(k_d) - base).pow(2).sum((-1, -2)) / (t * (t + 1) / 2)  # [Hq]
        got = fast[fast.channel == d].sort_values("q_head").mse.to_numpy()
        assert torch.allclose(torch.tensor(got).double(), mse.double(), rtol=1e-3, atol=1e-10)
    assert (fast.mse > 0).any()


def test_int2_error_spares_sink_and_partial_page():
    x = torch.randn(2, 45, 8)
    err = int2_channel_error(x, CFG)
    assert not err[:, :4].any() and not err[:, 4 + 32 :].any() and err[:, 4:36].abs().sum() > 0


def test_statistics_find_hand_made_outlier_channels():
    torch.manual_seed(0)
    keys = torch.randn(2, 100, 16)
    keys[:, :, [5, 9]] *= 10
    cap = Capture([torch.randn(4, 100, 16)], [keys], [keys], [torch.randn(2, 100, 16)], 0.25)
    stats = channel_stats(cap)
    top = stats[stats.tensor == "key"].sort_values("mean_abs", ascending=False).groupby("head").head(2)
    assert set(top.channel) == {5, 9}
    ratios = outlier_ratios(stats).set_index(["tensor", "head"])["outlier_ratio"]
    assert ratios[("key", 0)] > 5 and ratios[("value", 0)] < 2
    hm = heatmap(cap, 0, 1, "key", max_rows=25)
    assert hm.shape == (25, 16) and hm[5].mean() > 5 * hm[0].mean()


def test_spearman_and_agreement(tiny_capture):
    assert spearman(torch.arange(10.0), torch.arange(10.0) ** 3) == pytest.approx(1.0)
    assert spearman(torch.arange(10.0), -torch.arange(10.0)) == pytest.approx(-1.0)
    _, cap, _ = tiny_capture
    sens = sensitivity(cap, 1, CFG)
    agree = agreement(cap, sens, rules=("magnitude", "random", "range", "qk"), config=CFG)
    assert len(agree) == 2 * 4 and agree["overlap@0.25"].between(0, 1).all()


def test_qk_rule_in_the_cache():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 256, (2, 60))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    cache = KittyCache(model, "kitty-pro+selection=qk+sink=4+group_size=8+local_window=8")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                         past_key_values=cache, pad_token_id=0)
    assert out.shape == (2, 70)
    layer = cache.layers[0]
    assert layer.q_count[0].item() == (53 + 9) * 2 and layer.q_count[1].item() == (60 + 9) * 2  # pads excluded
