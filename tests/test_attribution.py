"""Where the error comes from (`kitty_core.attribution`): per-layer KL, per-head attention error,
attention maps and page errors on tiny random decoders; the CLI on a tiny decoder with the demo
model's tokenizer; saved runs, whole, corrupt or missing."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from kitty_core import KittyCache
from kitty_core import attribution as A
from kitty_core.probe import capture
from kitty_core.results import ResultFileError

ROOT = Path(__file__).resolve().parent.parent
SAVED = ROOT / "data" / "results" / "attribution_demo_cpu"
CONTEXT = 300  # sink 32 + two key pages + a q-buffer of 12; one value page (window 128 + q-buffer 12)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", layers=3)
    ids = torch.randint(3, 256, (1, CONTEXT + 17), generator=torch.Generator().manual_seed(0))
    return model, ids, capture(model, ids)


def test_fp16_layers_keep_those_layers_in_fp16(tiny):
    model, ids, _ = tiny
    every = KittyCache(model, "kitty-pro", fp16_layers={0, 1, 2})
    mixed = KittyCache(model, "kitty-pro", fp16_layers={1})
    fp16 = KittyCache(model, "fp16")
    with torch.inference_mode():
        logits = [model(input_ids=ids[:, :CONTEXT], past_key_values=c).logits for c in (every, mixed, fp16)]
        steps = [model(input_ids=ids[:, CONTEXT:CONTEXT + 1], past_key_values=c).logits for c in (every, mixed, fp16)]
    assert [layer.config.quantize for layer in mixed.layers] == [True, False, True]
    assert not mixed.is_compileable and not mixed.device_steps
    parts = [set(layer.nbytes()) for layer in mixed.layers]
    assert "key dense plane" in parts[0] and "key dense plane" not in parts[1]
    torch.testing.assert_close(steps[0], steps[2])  # every layer FP16 is the FP16 cache
    assert (steps[1] - steps[2]).abs().max() > 1e-4  # two quantized layers move the next prediction
    torch.testing.assert_close(logits[1], logits[2])  # a prefill attends in FP16 whatever is stored
    with pytest.raises(ValueError, match=r"layer indices in \[0, 2\]"):
        KittyCache(model, "kitty-pro", fp16_layers={3})


@pytest.mark.parametrize("method", ["kitty-pro", "kivi-k2v2", "kitty+selection=qk"])
def test_cache_from_capture_is_the_state_a_prefill_leaves(tiny, method):
    model, ids, cap = tiny
    built = A.cache_from_capture(model, cap, method, CONTEXT)
    prefilled = KittyCache(model, method, device_steps=False)
    with torch.inference_mode():
        model(input_ids=ids[:, :CONTEXT], past_key_values=prefilled)
    assert built.memory_report().equals(prefilled.memory_report())
    torch.testing.assert_close(A._chunk_logprobs(model, ids, CONTEXT, built),
                               A._chunk_logprobs(model, ids, CONTEXT, prefilled), atol=1e-5, rtol=0)


def test_one_chunk_scores_as_decoding_does(tiny):
    """No page fills during these 16 tokens: the chunk sees what token-by-token decoding sees."""
    from kitty_core.evaluate import continuation_logprobs

    model, ids, cap = tiny
    decoded = continuation_logprobs(model, ids[:, : CONTEXT + 17], CONTEXT, "kitty-pro")  # [1, 17, V]
    chunk = A._chunk_logprobs(model, ids, CONTEXT, A.cache_from_capture(model, cap, "kitty-pro", CONTEXT))
    torch.testing.assert_close(chunk, decoded[:, 1:], atol=1e-4, rtol=0)


def test_layer_kl_per_layer_and_mode(tiny):
    model, ids, cap = tiny
    seen = []
    df = A.layer_kl(model, cap, ids, "kivi-k2v2", CONTEXT, progress=lambda d, n, label: seen.append((d, n)))
    assert seen[-1] == (8, 8) and len(seen) == 8  # FP16, every layer, 3 layers x 2 modes
    assert len(df) == 6 and set(df.quantized) == {"only", "all_but"} and (df.kl >= 0).all()
    assert df.attrs["kl_all"] > df.kl[df.quantized == "only"].max()
    # on three layers, "only layer 0" is not "all but layer 0"; "all but l" keeps more error than "only l"
    by = df.set_index(["quantized", "layer"]).kl
    assert all(by["all_but", i] > by["only", i] for i in range(3))
    with pytest.raises(ValueError, match="modes must be among"):
        A.layer_kl(model, cap, ids, "kivi-k2v2", CONTEXT, modes=("some",))


def test_head_error_sees_keys_in_the_probabilities_and_values_in_the_output(tiny):
    _, _, cap = tiny
    k2v2, k2v4, k4v2 = (A.head_error(cap, m, CONTEXT) for m in ("kivi-k2v2-sink", "k2v4-sink", "k4v2-sink"))
    assert len(k2v2) == 3 * 4 and set(k2v2.kv_head) == {0, 1}
    assert k2v2.moved.between(0, 1).all() and (k2v2.kl >= 0).all()
    # values never enter the probabilities: same keys, same probabilities, a smaller output error
    torch.testing.assert_close(torch.tensor(k2v2.moved.values), torch.tensor(k2v4.moved.values))
    assert k2v4.output_error.mean() < k2v2.output_error.mean()
    assert k4v2.moved.mean() < 0.5 * k2v2.moved.mean()  # 4-bit keys move far less attention


def test_attention_map_rows_are_distributions_and_parts_tile_the_sequence(tiny):
    _, _, cap = tiny
    amap, parts = A.attention_map(cap, "kitty-pro", 1, 2, CONTEXT)
    assert amap["query"].min() == CONTEXT and amap["query"].max() == CONTEXT + 15
    sums = amap.groupby("query")[["fp16", "quantized"]].sum()
    ones = torch.ones(16, 2, dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(sums.to_numpy()).double(), ones, atol=1e-5, rtol=0)
    assert (amap["key"] <= amap["query"]).all()
    for side, g in parts.groupby("side"):
        assert g.start.iloc[0] == 0 and g.end.iloc[-1] == CONTEXT + 16
        assert (g.start.iloc[1:].to_numpy() == g.end.iloc[:-1].to_numpy()).all(), g
    keys = parts[parts.side == "keys"].part.tolist()
    assert keys == ["sink (FP16)", "page 0 (2-bit)", "page 1 (2-bit)", "q-buffer (FP16)", "new tokens (FP16)"]
    sink = amap[amap["key"] < 32]
    torch.testing.assert_close(torch.tensor(sink.fp16.values), torch.tensor(sink.quantized.values), atol=0.05, rtol=0)
    with pytest.raises(ValueError, match="query head"):
        A.attention_map(cap, "kitty-pro", 1, 4, CONTEXT)


def test_page_error_marks_the_boosted_channels(tiny):
    _, _, cap = tiny
    err = A.page_error(cap, "kitty-pro", 0, 1, 0, CONTEXT)
    keys, values = err[err.side == "keys"], err[err.side == "values"]
    assert len(keys) == len(values) == 128 * 16 and keys.token.min() == 32 and keys.token.max() == 159
    assert keys.groupby("channel").boosted.first().sum() == 4  # 25% of 16 channels
    assert keys[keys.boosted].error.abs().mean() < 0.5 * keys[~keys.boosted].error.abs().mean()
    with pytest.raises(ValueError, match=r"holds 1 full pages.*\[0, 0\]"):
        A.page_error(cap, "kitty-pro", 0, 1, 1, CONTEXT)
    with pytest.raises(ValueError, match="no page"):
        A.page_error(cap, "kitty-pro", 0, 1, 0, 100)


def test_ranking_agreement_is_spearman_over_layers():
    import pandas as pd

    layers = pd.DataFrame({"layer": [0, 1, 2, 0], "quantized": ["only"] * 3 + ["all_but"], "kl": [0.1, 0.3, 0.2, 9]})
    sens = pd.DataFrame({"layer": [2, 1, 0], "probe_mse": [5.0, 7.0, 1.0]})
    assert A.ranking_agreement(layers, sens) == pytest.approx(1.0)
    assert A.ranking_agreement(layers.assign(kl=[0.3, 0.1, 0.2, 0]), sens) == pytest.approx(-1.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demo):
    """A 2-layer random decoder with the demo model's tokenizer, saved as a local model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=len(demo.tokenizer), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=2048)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    demo.tokenizer.save_pretrained(path)
    return path


def test_cli_writes_tables_the_reader_takes(tiny_dir, tmp_path, capsys):
    out = tmp_path / "attribution"
    code = A.main(["--model", str(tiny_dir), "--context", "300", "--continuation", "8", "--methods",
                   "kitty-pro,kivi-k2v2", "--device", "cpu", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "worst layers alone" in printed.out and "Spearman" in printed.out
    found = A.read_saved(out)
    s = found["settings"]
    assert s["methods"] == ["kitty-pro", "kivi-k2v2"] and set(s["spearman"]) == set(s["methods"])
    assert len(found["layer_kl"]) == 2 * 2 * 2 and len(found["layer_sensitivity"]) == 2
    assert set(found["head_error"].method) == set(s["methods"]) and len(found["head_error"]) == 2 * 2 * 4
    assert all(kl > 0 for kl in s["kl_all"].values())
    assert set(found["page_error"].side) == {"keys", "values"}
    # what was wrong is said, nothing is written
    bad = tmp_path / "bad"
    assert A.main(["--model", str(tiny_dir), "--methods", "kitty-turbo", "--out", str(bad)]) == 2
    assert "unknown method preset" in capsys.readouterr().err and not bad.exists()
    assert A.main(["--model", str(tiny_dir), "--context", "100000", "--out", str(bad)]) == 2
    assert "context + continuation" in capsys.readouterr().err


def test_saved_run_reads_and_a_broken_one_is_named(tmp_path):
    found = A.read_saved(SAVED)
    assert {"kitty-pro", "kivi-k2v2"} <= set(found["settings"]["methods"])
    assert found["layer_kl"].layer.nunique() == 30
    broken = tmp_path / "broken"
    shutil.copytree(SAVED, broken)
    (broken / "head_error.csv").write_text("not,a\ntable")
    with pytest.raises(ResultFileError, match="head_error.csv lacks the columns"):
        A.read_saved(broken)
    (broken / "layer_kl.csv").unlink()
    with pytest.raises(ResultFileError, match="layer_kl.csv cannot be read"):
        A.read_saved(broken)
    (broken / "settings.json").write_text(json.dumps({"model": "demo"}))
    with pytest.raises(ResultFileError, match="settings.json lacks"):
        A.read_saved(broken)
    (broken / "settings.json").write_text("{")
    with pytest.raises(ResultFileError, match="settings.json cannot be read"):
        A.read_saved(broken)


@pytest.mark.gpu
def test_cache_from_capture_on_the_triton_engine():
    """On a GPU the cache packs with the Triton kernels and a chunk reads the pages directly: the built
    state still scores as a real prefill's does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(3, 256, (1, CONTEXT + 17), generator=torch.Generator().manual_seed(0))
    cap = capture(model, ids)
    built = A.cache_from_capture(model, cap, "kitty-pro", CONTEXT, engine="triton")
    prefilled = KittyCache(model, "kitty-pro", engine="triton", device_steps=False)
    with torch.inference_mode():
        model(input_ids=ids[:, :CONTEXT].cuda(), past_key_values=prefilled)
    assert built.memory_report().equals(prefilled.memory_report())
    torch.testing.assert_close(A._chunk_logprobs(model, ids, CONTEXT, built),
                               A._chunk_logprobs(model, ids, CONTEXT, prefilled), atol=2e-2, rtol=0)
    layers = A.layer_kl(model, cap, ids, "kitty-pro", CONTEXT, modes=("only",), engine="triton")
    assert len(layers) == 2 and (layers.kl >= 0).all()
