"""The lab's shared frame: the sidebar every page calls, the one loaded model, cached analyses.

Streamlit discovers `pages/` by itself; each page starts with `frame = sidebar()`, so every page
gets the same sidebar whichever page a user opens first. One model serves all browser tabs
(`st.cache_resource`); GPU work is serialized by one process-wide lock.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import streamlit as st
import torch

from kitty_core import PRESETS, ModelLoadError, load_model, parse_method
from kitty_core.models import LoadedModel
from kitty_core.sharding import placement_summary

DATA = Path(__file__).resolve().parent / "data"
TEXT = DATA / "genesis_kjv.txt"


@dataclass
class Frame:
    lm: LoadedModel
    model_key: tuple  # (name, device, dtype) as chosen: the cache key of everything computed on the model
    method: str  # the chosen preset with the dial's boost rate, in `preset+field=value` spelling
    text: str  # the prompt source


@st.cache_resource
def gpu_lock() -> threading.Lock:
    return threading.Lock()


ALL_GPUS = "all GPUs"  # the device choice, where several are visible, of a model split by layers over them


@st.cache_resource(max_entries=1, show_spinner=False)
def _model(name: str, device: str, dtype: str) -> LoadedModel:
    if device == ALL_GPUS:  # whole layers placed across the GPUs by accelerate (`kitty_core.sharding`)
        return load_model(name, dtype=dtype, device_map="auto")
    return load_model(name, device=device, dtype=dtype)


@st.cache_resource
def _current() -> dict:
    return {}


def get_model(name: str, device: str, dtype: str) -> LoadedModel:
    """The loaded model; a switch frees the old one (GPU memory included) before loading the new."""
    key = (name, device, dtype)
    current = _current()
    if current.get("key") not in (None, key):
        _model.clear()
        current.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    lm = _model(name, device, dtype)
    current["key"] = key
    return lm


def sidebar() -> Frame:
    st.set_page_config(page_title="Kitty Lab", layout="wide")
    sb = st.sidebar
    sb.title("Kitty Lab")
    name = sb.text_input("Model", "demo", help="demo | hub id | local directory | file.gguf").strip()
    cols = sb.columns(2)
    several = [ALL_GPUS] if torch.cuda.device_count() > 1 else []
    device = cols[0].selectbox("Device", ["auto", "cpu", "cuda", *several],
                               help=f"{ALL_GPUS}: a model too large for one GPU, its layers placed across them"
                               if several else None)
    dtype = cols[1].selectbox("Dtype", ["auto", "float32", "bfloat16", "float16"])
    preset = sb.selectbox("Method", list(PRESETS), index=list(PRESETS).index("kitty-pro"))
    config = PRESETS[preset]
    boost = sb.slider("Boost rate (key channels at 4 bits)", 0.0, 1.0, float(config.boost_rate), 0.0625,
                      disabled=not config.quantize or config.key_bits == 4)
    method = preset if boost == config.boost_rate else f"{preset}+boost_rate={boost:g}"
    source = sb.radio("Prompt source", ["Genesis (KJV, shipped)", "My text"], horizontal=True)
    text = TEXT.read_text() if source.startswith("Genesis") else sb.text_area("Text", height=150)
    try:
        with st.spinner(f"Loading {name} (a GGUF converts once, tens of seconds) ..."):
            lm = get_model(name, device, dtype)
    except ModelLoadError as err:
        st.error(str(err))
        st.stop()
    shape = lm.shape
    sb.caption(f"**{lm.name}** on {lm.device}, {str(lm.dtype).removeprefix('torch.')}: {shape['layers']} layers, "
               f"{shape['q_heads']} query / {shape['kv_heads']} KV heads, head size {shape['head_dim']}, "
               f"context {shape['context']}")
    if getattr(lm.model, "hf_device_map", None):
        sb.caption(f"Placed by layers: {placement_summary(lm.model.hf_device_map)}")
    if lm.device.type == "cuda":
        used = [f"{torch.cuda.memory_allocated(i) / 2**30:.2f}" for i in range(torch.cuda.device_count())]
        sb.caption(f"GPU memory in use: {' + '.join(used)} GiB")
    elif not torch.cuda.is_available():
        sb.caption("No GPU here: the reference engine runs on the CPU.")
    return Frame(lm, (name, device, dtype), method, text)


@st.cache_resource(max_entries=4, show_spinner="Capturing queries, keys and values of every layer ...")
def cached_capture(model_key: tuple, text: str, tokens: int):
    """probe.capture of the first `tokens` tokens of `text`, kept for the pages that read it."""
    from kitty_core.probe import capture

    lm = get_model(*model_key)
    ids = lm.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
    with gpu_lock():
        return capture(lm.model, ids)


@st.cache_data(max_entries=4, show_spinner="Channel statistics ...")
def cached_stats(model_key: tuple, text: str, tokens: int):
    from kitty_core.probe import channel_stats, outlier_ratios

    stats = channel_stats(cached_capture(model_key, text, tokens))
    return stats, outlier_ratios(stats)


@st.cache_data(max_entries=16, show_spinner="Probing every channel of the layer ...")
def cached_sensitivity(model_key: tuple, text: str, tokens: int, layer: int):
    from kitty_core.probe import sensitivity

    cap = cached_capture(model_key, text, tokens)
    with gpu_lock():
        return sensitivity(cap, layer)


def duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 1 h 02 min: for a reader, not a log."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s // 60 % 60:02d} min"


class Progress:
    """The library's `progress(done, total, label)` convention as a Streamlit bar: done/total, the
    label, time so far and an estimate of the time left (elapsed x remaining / done, so it settles
    as the steps come in). `Progress("Scoring")` where a bar belongs; pass it as `progress=`."""

    def __init__(self, what: str, where=None):
        self.what, self.t0 = what, time.monotonic()
        self.bar = (where or st).progress(0.0, text=f"{what}: starting ...")

    def __call__(self, done: int, total: int, label: str = "") -> None:
        elapsed = time.monotonic() - self.t0
        left = f", about {duration(elapsed * (total - done) / done)} left" if 0 < done < total else ""
        self.bar.progress(min(max(done / total, 0.0), 1.0) if total else 0.0,
                          text=f"{self.what}: {done:,} of {total:,}" + (f" ({label})" if label else "")
                          + f", {duration(elapsed)} so far{left}")

    def clear(self) -> None:
        self.bar.empty()


def prompt_ids(frame: Frame, tokens: int) -> torch.Tensor:
    """The first `tokens` tokens of the prompt source; a clear message if it is empty or too long."""
    if not frame.text.strip():
        st.warning("The prompt is empty: type some text in the sidebar, or pick the shipped text.")
        st.stop()
    ids = frame.lm.tokenizer(frame.text, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
    limit = frame.lm.shape["context"]
    if limit and ids.shape[1] > limit:
        st.error(f"The prompt has {ids.shape[1]} tokens; this model's context is {limit}.")
        st.stop()
    return ids
