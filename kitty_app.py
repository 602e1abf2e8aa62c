"""The lab's shared frame: the sidebar every page calls, the loaded models, cached analyses.

Streamlit discovers `pages/` by itself; each page starts with `frame = sidebar()`, so every page
gets the same sidebar whichever page a user opens first. The sidebar's choices live in the session
(`st.session_state`), so moving to another page keeps them and does not reload the model.

Models: the last `MODELS_KEPT` (model, device, dtype) choices stay loaded, shared by every browser
tab (`st.cache_resource`); a further choice drops the least recently used. A tab that is running on
a model that another tab's choice dropped keeps its own reference, so its run finishes on it (the
memory is freed when it does), and its next run loads the model again. Model runs are serialized by
one process-wide lock (`gpu_turn`): a run that waits for it says so. They are made on one
long-lived thread (`kitty_core.gpu_thread`), not on the script run's own thread, which Streamlit
starts afresh for every run; progress bars and streamed text are called back on the script's
thread. Loading a model, and small tensor operations on results already computed (statistics,
heatmaps), stay on the script's thread: a tab can load a model while another tab's run goes on.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import traceback
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import streamlit as st
import torch

from kitty_core import PRESETS, ModelLoadError, gpu_thread, load_model, parse_method
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


MODELS_KEPT = max(1, int(os.environ.get("KITTY_LAB_MODELS", "2")))  # models kept loaded at once (see above)


@st.cache_resource
def gpu_lock() -> threading.Lock:
    return threading.Lock()


TAILS = {"model's dtype": 16, "8-bit": 8}  # the sidebar's tail choices: their `tail_bits`
ALL_GPUS = "all GPUs"  # the device choice, where several are visible, of a model split by layers over them


@contextmanager
def gpu_turn(what: str = "This run", tell_wait: bool = True):
    """Hold the GPU lock for a run; yields the `GpuThread` to make the run's calls on
    (`gpu.call(fn, ..., progress=on_caller(bar))`). If another tab's run holds the lock, say so
    while waiting (and, once the turn comes, how long it waited: `tell_wait`, off inside a cached
    function, whose elements Streamlit replays on every later hit), rather than show the old output
    greyed with no word."""
    lock = gpu_lock()
    if not lock.acquire(blocking=False):
        t0 = time.monotonic()
        note = st.empty()
        note.info(f"{what} waits for another run on this server to finish (one run at a time) ...", icon="⏳")
        while not lock.acquire(timeout=1.0):
            # an element update each second: a Stop pressed meanwhile ends the wait here
            note.info(f"{what} waits for another run on this server to finish (one run at a time): "
                      f"{duration(time.monotonic() - t0)} so far ...", icon="⏳")
        if tell_wait:
            note.caption(f"{what} waited {duration(time.monotonic() - t0)} for another run to finish.")
        else:
            note.empty()
    try:
        yield gpu_thread.shared()  # the process's, whatever caches Streamlit clears
    finally:
        lock.release()


@st.cache_resource
def _models() -> tuple[OrderedDict, threading.Lock]:
    """The loaded models, least recently used first, and the lock that serializes loading."""
    return OrderedDict(), threading.Lock()


def get_model(name: str, device: str, dtype: str) -> LoadedModel:
    """The model of a (name, device, dtype) choice: one already loaded as it is, else loaded, dropping
    the least recently used beyond `MODELS_KEPT` (GPU memory freed once no run holds it)."""
    key = (name, device, dtype)
    models, loading = _models()
    with loading:  # two tabs asking for the same new model load it once
        if key in models:
            models.move_to_end(key)
            return models[key]
        while len(models) >= MODELS_KEPT:
            models.popitem(last=False)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if device == ALL_GPUS:  # whole layers placed across the GPUs by accelerate (`kitty_core.sharding`)
            models[key] = load_model(name, dtype=dtype, device_map="auto")
        else:
            models[key] = load_model(name, device=device, dtype=dtype)
        return models[key]


def loaded_models() -> list[tuple]:
    """The (name, device, dtype) choices loaded now, least recently used first."""
    return list(_models()[0])


def _kept(key: str, default=None, on_change=None) -> dict:
    """Keyword arguments for a sidebar widget whose value outlives the page: Streamlit forgets the
    state of a widget that a run does not draw, and a page switch draws a new page's widgets, so
    the value is also kept under a key of its own and handed back to the widget when a page draws
    it again. The widget gets its value from the session alone (no default beside it)."""
    ss = st.session_state
    # a widget's new value is in the session before the run; set again here so that the widget a
    # new page draws (a new widget to Streamlit) starts from it
    value = ss[key] if key in ss else ss.get(f"kept:{key}", default)
    ss[key] = ss[f"kept:{key}"] = value
    return {"key": key, "on_change": on_change}


def _new_preset() -> None:
    """A new method starts at its own boost rate."""
    for key in ("sb_boost", "kept:sb_boost"):
        st.session_state.pop(key, None)


def sidebar() -> Frame:
    st.set_page_config(page_title="Kitty Lab", layout="wide")
    sb = st.sidebar
    sb.title("Kitty Lab")
    name = sb.text_input("Model", help="demo | hub id | local directory | file.gguf", **_kept("sb_model", "demo"))
    name = name.strip()
    cols = sb.columns(2)
    several = [ALL_GPUS] if torch.cuda.device_count() > 1 else []
    device = cols[0].selectbox("Device", ["auto", "cpu", "cuda", *several],
                               help=f"{ALL_GPUS}: a model too large for one GPU, its layers placed across them"
                               if several else None, **_kept("sb_device", "auto"))
    dtype = cols[1].selectbox("Dtype", ["auto", "float32", "bfloat16", "float16"], **_kept("sb_dtype", "auto"))
    preset = sb.selectbox("Method", list(PRESETS), **_kept("sb_method", "kitty-pro", on_change=_new_preset))
    config = PRESETS[preset]
    boost = sb.slider("Boost rate (key channels at 4 bits)", 0.0, 1.0, step=0.0625,
                      disabled=not config.quantize or config.key_bits == 4,
                      **_kept("sb_boost", float(config.boost_rate)))
    tail = sb.radio("Tail (sink, q-buffer, window)", list(TAILS), horizontal=True, disabled=not config.quantize,
                    help="The tokens kept beside the pages: in the model's dtype as the paper keeps them, or int8 "
                    "on a scale a vector (`tail_bits=8`): about half their bytes, a few percent more batch; "
                    "docs/engine.md measures its accuracy and speed", **_kept("sb_tail", next(iter(TAILS))))
    method = preset if boost == config.boost_rate else f"{preset}+boost_rate={boost:g}"
    if config.quantize and TAILS[tail] != config.tail_bits:
        method += f"+tail_bits={TAILS[tail]}"
    source = sb.radio("Prompt source", ["Genesis (KJV, shipped)", "My text"], horizontal=True,
                      **_kept("sb_source", "Genesis (KJV, shipped)"))
    text = TEXT.read_text() if source.startswith("Genesis") else sb.text_area("Text", height=150,
                                                                              **_kept("sb_text", ""))
    try:
        with st.spinner(f"Loading {name} (a GGUF converts once, tens of seconds) ..."):
            lm = get_model(name, device, dtype)
    except ModelLoadError as err:
        st.error(str(err))
        st.stop()
    except Exception as err:  # noqa: BLE001  (a load failure the library did not foresee: said, not raised)
        failed(err, f"Loading {name} failed")
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
    sb.caption(f"Models kept loaded: at most {MODELS_KEPT} (model, device, dtype) choices, shared by every tab; "
               "a further one drops the least recently used, after any run on it ends.")
    return Frame(lm, (name, device, dtype), method, text)


@st.cache_resource(max_entries=4, show_spinner="Capturing queries, keys and values of every layer ...")
def cached_capture(model_key: tuple, text: str, tokens: int):
    """probe.capture of the first `tokens` tokens of `text`, kept for the pages that read it."""
    from kitty_core.probe import capture

    lm = get_model(*model_key)
    ids = lm.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
    with gpu_turn("The capture", tell_wait=False) as gpu:
        return gpu.call(capture, lm.model, ids)


@st.cache_data(max_entries=4, show_spinner="Channel statistics ...")
def cached_stats(model_key: tuple, text: str, tokens: int):
    from kitty_core.probe import channel_stats, outlier_ratios

    stats = channel_stats(cached_capture(model_key, text, tokens))
    return stats, outlier_ratios(stats)


@st.cache_data(max_entries=16, show_spinner="Probing every channel of the layer ...")
def cached_sensitivity(model_key: tuple, text: str, tokens: int, layer: int):
    from kitty_core.probe import sensitivity

    cap = cached_capture(model_key, text, tokens)
    with gpu_turn("The sensitivity probe", tell_wait=False) as gpu:
        return gpu.call(sensitivity, cap, layer)


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


def failed(err: BaseException, what: str = "Something went wrong") -> None:
    """An unexpected error as the browser shows it: one line, the traceback folded in an expander."""
    st.error(f"{what}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}. The lab runs on; the "
             "details below help a bug report.")
    with st.expander("Details"):
        st.code("".join(traceback.format_exception(err)), language="text")
