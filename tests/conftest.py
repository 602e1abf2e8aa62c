"""Shared fixtures: the real demo model (CPU, fp32) and tiny random decoders of each supported family."""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub
if not torch.cuda.is_available():  # Triton kernels run in its interpreter; must be set before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    # Triton's interpreter takes a loop bound loaded from memory with int() of a 1-element array
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0 to a scalar")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo():
    from kitty_core import load_model

    return load_model("demo", device="cpu", dtype="float32")


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_model(family: str, dtype=torch.float32, seed: int = 0, layers: int = 2):
    """A 2-layer decoder of the family with GQA (4 query / 2 KV heads, head size 16), random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        family, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return model
