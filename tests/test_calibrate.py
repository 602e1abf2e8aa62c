"""Budgeted boost allocation (kitty_core.calibrate): the counts spend the budget where the probe
says the error is, a cache boosts each layer's count, and a file for another model or rate is refused."""

import json

import pytest
import torch

from conftest import tiny_model
from kitty_core import KittyCache
from kitty_core.allocation import FORMAT, read
from kitty_core.calibrate import allocate, allocate_measured, channel_costs, count_grid, layer_costs, main


def test_allocation_follows_the_costs_within_the_budget():
    costs = torch.zeros(3, 2, 8)  # layers x KV heads x channels; budget 2 a layer (rate 0.25): 6
    costs[0, 0, :4] = torch.tensor([9.0, 8.0, 7.0, 6.0])
    costs[1, 1, :2] = torch.tensor([6.5, 1.0])
    assert allocate(costs, 0.25) == [4, 2, 0]
    assert allocate(torch.ones(3, 2, 8), 0.25) == [2, 2, 2]  # equal costs: the paper's uniform rate
    assert allocate(costs, 0.0) == [0, 0, 0] and sum(allocate(costs, 1.0)) == 24


def test_measured_allocation_minimizes_the_summed_kl_within_the_budget():
    import pandas as pd

    grid = [0, 2, 4, 8]
    kl = {0: [1.0, 0.5, 0.3, 0.2], 1: [0.2, 0.19, 0.18, 0.17], 2: [0.6, 0.2, 0.1, 0.05]}  # by grid count
    costs = pd.DataFrame([{"layer": i, "boosted": c, "kl": v[j]} for i, v in kl.items() for j, c in enumerate(grid)])
    # 4 a layer, 12 in all: layer 1 gains little, so it gives its channels to layers 0 and 2
    assert allocate_measured(costs, 4) == [8, 0, 4]  # 0.2 + 0.2 + 0.1 = 0.5 against 0.58 uniform, 0.55 [4, 0, 8]
    assert allocate_measured(costs, 0) == [0, 0, 0]
    with pytest.raises(ValueError, match="sum to 27 channels"):
        allocate_measured(costs, 9)
    assert count_grid(16, 64) == [0, 8, 16, 32, 64] and count_grid(8, 16) == [0, 4, 8, 16]


def test_layer_costs_measure_each_layer_alone():
    """A tiny llama (2 layers, head size 16): every channel boosted (INT4 keys) moves the predictions
    less than none, layer by layer, and a layer's KL alone is not the other's."""
    from kitty_core.probe import capture

    model = tiny_model("llama")
    with torch.no_grad():  # peaked attention over keys whose channels differ in scale, as a trained model's do
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 4
            layer.self_attn.k_proj.weight *= torch.linspace(1, 8, 32)[:, None]
    ids = torch.randint(3, 256, (1, 200 + 9), generator=torch.Generator().manual_seed(0))
    costs = layer_costs(model, capture(model, ids), ids, "kitty-pro", 200, [0, 4, 16])
    assert len(costs) == 6 and set(costs["boosted"]) == {0, 4, 16}
    kl = costs.set_index(["layer", "boosted"])["kl"]
    assert kl[0, 16] < kl[0, 4] < kl[0, 0] and kl[1, 16] < kl[1, 4] < kl[1, 0]
    assert kl[0, 0] != kl[1, 0] and (kl > 0).all()


def test_costs_sum_the_query_heads_of_a_kv_head():
    import pandas as pd

    sens = pd.DataFrame({"layer": [0] * 8, "kv_head": [0, 0, 1, 1] * 2, "q_head": [0, 1, 2, 3] * 2,
                         "channel": [0] * 4 + [1] * 4, "mse": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]})
    assert channel_costs(sens).tolist() == [[[3.0, 11.0], [7.0, 15.0]]]


def _file(tmp_path, counts, rate=0.25, head_dim=16, layers=2, kv_heads=2, name="a.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": FORMAT, "model": "tiny", "method": "kitty-pro", "boost_rate": rate,
                                "shape": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
                                "channels_per_layer": counts}))
    return str(path)


def test_a_cache_boosts_each_layers_count(tmp_path):
    """tiny llama: 2 layers, 2 KV heads, head size 16; kitty-pro's 4 channels a layer spent as 7 + 1."""
    model = tiny_model("llama")
    method = f"kitty-pro+sink=4+group_size=16+local_window=16+allocation={_file(tmp_path, [7, 1])}"
    cache = KittyCache(model, method)
    ids = torch.randint(3, 256, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 64
    assert [layer.n_boost for layer in cache.layers] == [7, 1]
    assert [layer.k_pages.store["high"].shape[-2] for layer in cache.layers] == [7, 1]


@pytest.mark.parametrize("spec, message", [
    (dict(counts=[8, 8], head_dim=32), "calibrated on 'tiny'"),
    (dict(counts=[2, 2], rate=0.125), "spends boost_rate 0.125"),
    (dict(counts=[5, 4]), "summing to the budget"),
])
def test_an_allocation_for_another_model_or_rate_is_refused(tmp_path, spec, message):
    model = tiny_model("llama")
    path = _file(tmp_path, **spec, name=f"{message[:6]}.json")
    with pytest.raises(ValueError, match=message):
        KittyCache(model, f"kitty-pro+allocation={path}")


def test_a_file_that_is_not_an_allocation_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the allocation file"):
        read(str(bad))
    bad.write_text(json.dumps({"format": "other"}))
    read.cache_clear()
    with pytest.raises(ValueError, match="not an allocation file"):
        read(str(bad))


def test_calibrate_writes_a_file_a_method_can_name(tmp_path, capsys):
    """The demo model on 200 tokens of the shipped text (one page after the sink a layer)."""
    from kitty_core import load_model

    out = tmp_path / "demo.json"
    assert main(["--model", "demo", "--tokens", "200", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["shape"] == {"layers": 30, "kv_heads": 3, "head_dim": 64} and sum(data["channels_per_layer"]) == 30 * 16
    assert len(set(data["channels_per_layer"])) > 1  # the probe's costs are not uniform over layers
    lm = load_model("demo")
    cache = KittyCache(lm.model, f"kitty-pro+allocation={out}")
    assert [layer.boost for layer in cache.layers] == data["channels_per_layer"]
    assert main(["--model", "demo", "--method", "kivi-k2v2", "--out", str(out)]) == 0  # rate 0: all zero
    measured = tmp_path / "measured.json"
    assert main(["--model", "demo", "--source", "kl", "--tokens", "160", "--scored", "2", "--counts", "0,16,32",
                 "--out", str(measured)]) == 0
    data = json.loads(measured.read_text())
    assert sum(data["channels_per_layer"]) == 30 * 16 and set(data["channels_per_layer"]) <= {0, 16, 32}
    assert len(data["calibration"]["measured"]) == 30 * 3
    assert main(["--model", "demo", "--source", "kl", "--counts", "0,8", "--out", str(measured)]) == 2
    assert "must hold the method's 16 channels" in capsys.readouterr().err
    assert main(["--model", "demo", "--method", "k4v2-sink", "--out", str(out)]) == 2
    assert "boosts no key channels" in capsys.readouterr().err
