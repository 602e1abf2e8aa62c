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

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
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


ENGINES = ["reference"] + (["triton"] if INTERPRETER else [])


@pytest.mark.parametrize("engine", ENGINES)
def test_layer_sharded_generation_equals_unsharded_on_cpu(engine):
    layers = 3
    plain = tiny_model("llama", layers=layers)
    sharded = _dispatched(layers, ["cpu", "cpu"])
    assert hasattr(sharded.model.layers[1], "_hf_hook") and sharded.hf_device_map["model.layers.2"] == "cpu"
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
    two KV heads, and the tokens (fp16 preset and kitty-pro, a left-padded batch) equal the unsharded
    model's, which rank 0 generates too."""
    tiny_model("llama", layers=2).save_pretrained(tmp_path / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(29500 + os.getpid() % 1000),
                          str(TP_SCRIPT), str(tmp_path / "model"), str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / "out" / f"rank{rank}.txt").read_text().split("\n")
        assert "ranks 2, kv heads held 1" in lines, lines
        assert all(line.startswith(("ranks", "equal")) for line in lines if line), lines
        assert len([line for line in lines if line.startswith("equal")]) == 2
