"""KittyCache on models sharded by transformers: layer-sharded (accelerate's device map, hooks moving
each layer's inputs to its device) and tensor parallel (two processes, gloo, each rank attending
over its own KV heads). Greedy generations of the sharded model equal the unsharded ones token for
token; each layer's Kitty state is where its layer runs. On CPU every device of a map is "cpu" (the
hooks and the per-layer placement still run); the two-GPU test needs two CUDA devices."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_model
from kitty_core import KittyCache
from kitty_core.sharding import attention_devices, devices_used, local_kv_heads, placement_summary, tp_size

SMALL_KITTY = "kitty-pro+sink=4+group_size=16+local_window=16"  # pages fill within a short generation
METHODS = ("fp16", SMALL_KITTY)


def _layer_map(layers: int, devices: list) -> dict:
    """Embeddings on the first device, layers in equal runs over `devices`, norm and head on the last."""
    per = -(-layers // len(devices))
    dmap = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    dmap |= {f"model.layers.{i}": devices[i // per] for i in range(layers)}
    return dmap | {"model.norm": devices[-1], "lm_head": devices[-1]}


def _dispatched(layers: int, devices: list):
    """A tiny model (the same weights as `tiny_model(..., layers=layers)`) dispatched by accelerate as
    from_pretrained(device_map=...) dispatches it, with its hooks even where every device is the same."""
    from accelerate import dispatch_model

    return dispatch_model(tiny_model("llama", layers=layers), device_map=_layer_map(layers, devices), force_hooks=True)


def _batch(device) -> dict:
    """Two prompts, the second left-padded (8 pads): pages fill at different steps in each."""
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _greedy(model, method, engine, batch, new=24):
    cache = KittyCache(model, method, engine=engine)
    out = model.generate(**batch, past_key_values=cache, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                         pad_token_id=0)
    return out.cpu(), cache


def test_layer_sharded_generation_equals_unsharded_on_cpu():
    """The reference engine (the Triton engine's decode steps in the interpreter take minutes here;
    on two GPUs, the test below runs it)."""
    engine, layers = "reference", 2
    plain = tiny_model("llama", layers=layers)
    sharded = _dispatched(layers, ["cpu", "cpu"])
    assert hasattr(sharded.model.layers[1], "_hf_hook") and sharded.hf_device_map["model.layers.1"] == "cpu"
    for method in METHODS:
        want, _ = _greedy(plain, method, engine, _batch("cpu"))
        got, cache = _greedy(sharded, method, engine, _batch("cpu"))
        assert torch.equal(got, want), method
        assert [layer.device for layer in cache.layers] == attention_devices(sharded)
        if method != "fp16":
            assert all(layer.k_pages.pages_of(0) >= 2 for layer in cache.layers)  # the pages were used


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("engine", ["reference", "triton"])
def test_layer_sharded_generation_on_two_gpus(engine):
    """Layers 0-1 on cuda:0, 2-3 on cuda:1: each layer's pages and FP16 parts on its own GPU, the
    Triton kernels launched there, and the tokens of the model on one GPU. Head size 16 and pages of
    16 are below what the kernels take on a GPU, so the Triton engine's kernels run at head size 64."""
    from accelerate import dispatch_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64, pad_token_id=0)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).eval().cuda(0)
    torch.manual_seed(0)
    sharded = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).eval()
    sharded = dispatch_model(sharded, device_map=_layer_map(4, [0, 1]))
    method = "kitty-pro+sink=4+group_size=64+local_window=64"
    ids = torch.randint(3, 256, (2, 200), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["attention_mask"][1, :16] = 0
    for m in ("fp16", method):
        want, _ = _greedy(plain, m, engine, {k: v.cuda(0) for k, v in batch.items()}, new=80)
        got, cache = _greedy(sharded, m, engine, {k: v.cuda(0) for k, v in batch.items()}, new=80)
        assert torch.equal(got, want), m
        assert [layer.device.index for layer in cache.layers] == [0, 0, 1, 1]
        assert all(layer.k_sink.buf.device == layer.device for layer in cache.layers)
        if m != "fp16":
            assert all(t.device == layer.device for layer in cache.layers for t in layer.k_pages.store.values())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_demo_model_placed_over_two_gpus_generates_the_tokens_of_one():
    """The demo model, its 30 layers balanced over two GPUs by accelerate, against the model on one
    (kitty-pro, greedy, a left-padded batch). Its 3 KV heads do not split over two ranks: tensor
    parallel takes the tiny model above."""
    from kitty_core import load_model

    one = load_model("demo", device="cuda:0", dtype="float16")
    two = load_model("demo", dtype="float16", device_map="balanced")
    assert set(two.model.hf_device_map.values()) == {0, 1}
    enc = one.tokenizer(["The history of the printing press begins in", "Water boils at"], return_tensors="pt",
                        padding=True).to("cuda:0")
    for method in ("fp16", "kitty-pro"):
        want, _ = _greedy(one.model, method, None, enc, new=64)
        got, cache = _greedy(two.model, method, None, enc, new=64)
        assert torch.equal(got, want), method
        assert {layer.device.index for layer in cache.layers} == {0, 1}


def test_placement_summary():
    dmap = _layer_map(6, [0, 1])
    assert placement_summary(dmap) == ("layers 0-2 on cuda:0, 3-5 on cuda:1; embed_tokens and rotary_emb on "
                                       "cuda:0, norm and lm_head on cuda:1")
    assert devices_used(dmap) == ["cuda:0", "cuda:1"]
    # accelerate's own names for an offloaded part, and layers that are not in one run per device
    uneven = {"model.embed_tokens": "cpu", "model.layers.0": 0, "model.layers.1": "cpu", "model.layers.2": 0,
              "lm_head": "disk"}
    assert placement_summary(uneven) == "layers 0, 2 on cuda:0, 1 on cpu; embed_tokens on cpu, lm_head on disk"
    assert placement_summary(None) == "not layer-sharded: the whole model on one device"


def test_an_unsharded_model_has_one_rank_and_every_kv_head():
    model = tiny_model("llama")
    assert tp_size(model) == 1 and local_kv_heads(model) == 2
    assert attention_devices(model) == [torch.device("cpu")] * 2


TP_SCRIPT = Path(__file__).with_name("tp_generate.py")


def test_tensor_parallel_generation_equals_unsharded(tmp_path):
    """Two gloo ranks of `torchrun` on the tiny model saved here: every rank's cache holds one of the
    two KV heads (its sink holds that head of the whole model's keys), and the tokens (fp16 preset and
    kitty-pro, a left-padded batch) equal the unsharded model's, which every rank generates too. A model
    of random weights made sharded, as `bench e2e --tp` makes `random:` shapes, decodes alike on both
    ranks (the weights they replicate agree)."""
    tiny_model("llama", layers=2).save_pretrained(tmp_path / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(29500 + os.getpid() % 1000),
                          str(TP_SCRIPT), str(tmp_path / "model"), str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / "out" / f"rank{rank}.txt").read_text().splitlines()
        assert lines == ["ranks 2, kv heads held 1", "equal fp16", f"equal {SMALL_KITTY}", "random ranks agree"], lines


def test_random_shapes_of_70b_class_models():
    """The published shapes, counted on the meta device: 70.6B and 32.8B parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kitty_core.hf import model_shape
    from kitty_core.models import RANDOM_SHAPES

    counts = {}
    for name, want in (("llama-3.3-70b", (80, 64, 8, 128)), ("qwen3-32b", (64, 64, 8, 128))):
        kw = dict(RANDOM_SHAPES[name])
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
        shape = model_shape(cfg)
        assert (shape["layers"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]) == want
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert round(counts["llama-3.3-70b"] / 1e9, 1) == 70.6 and round(counts["qwen3-32b"] / 1e9, 1) == 32.8


def test_a_sharded_load_is_refused_clearly(monkeypatch):
    from kitty_core import bench
    from kitty_core.models import ModelLoadError, load_model

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ModelLoadError, match="start this under torchrun"):
        load_model("random:llama-3.3-70b", tp=True)
    with pytest.raises(ModelLoadError, match="choose one"):
        load_model("random:llama-3.3-70b", device_map="auto", tp=True)
    with pytest.raises(ModelLoadError, match="device_map must be one of"):
        load_model("random:qwen3-32b", device_map="everywhere")
    a = bench.arguments().parse_args(["e2e", "--tp", "--model", "random:llama-3.3-70b"])
    assert "torchrun --nproc-per-node 2 -m kitty_core.bench e2e --tp" in bench.refusal(a)
    assert bench.refusal(bench.arguments().parse_args(["e2e", "--device-map", "auto"])) is None
    with pytest.raises(SystemExit):
        bench.arguments().parse_args(["e2e", "--device-map", "auto", "--tp"])  # one way or the other
    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):  # as torchrun starts it
        monkeypatch.setenv(var, value)
    assert bench.refusal(a) is None


def test_a_random_model_sharded_by_a_device_map_matches_its_config():
    """`random_sharded` as `load_model("random:...", device_map=...)` calls it, on a tiny config: the
    layers are placed as the map says (on CPU, one device: no hooks), every weight is initialized."""
    from kitty_core.models import random_sharded

    config = tiny_model("llama").config
    model = random_sharded(config, torch.float32, {"device_map": _layer_map(2, ["cpu", "cpu"])})
    assert model.config.num_hidden_layers == 2 and attention_devices(model) == [torch.device("cpu")] * 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert float(model.model.layers[0].self_attn.k_proj.weight.detach().std()) > 0.005  # initialized, not left empty
