"""Where the error comes from: which layers, heads, tokens and key channels a method's error against
FP16 comes from (`kitty_core.attribution`)."""

import time

import numpy as np
import plotly.express as px
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from kitty_app import DATA, TEXT, gpu_turn, sidebar
from kitty_core import parse_method
from kitty_core.attribution import MODES, analyse, attention_map, page_error, read_saved
from kitty_core.gpu_thread import on_caller
from kitty_core.results import ResultFileError

frame = sidebar()
st.title("Where the error comes from")
st.caption("The context is put through the method's cache as a prefill would leave it (sink, 2-bit pages, "
           "FP16 buffers); the continuation after it is scored against FP16. Which layers matter, which heads' "
           "attention moves, where in the sequence, and which channels of a page carry the error. "
           "`python -m kitty_core.attribution` writes the same tables.")
SAVED = DATA / "results" / "attribution_demo_cpu"
METRICS = {"moved": "attention moved (% of the probability mass)", "kl": "KL of the attention rows (nats)",
           "output_error": "attention output error (relative, %)"}

method = frame.method
if not parse_method(method).quantize:
    st.info("FP16 is the reference everything here is measured against: pick a quantized method in the sidebar.")
    st.stop()


@st.cache_resource
def finished() -> dict:
    """Live runs, shared by every tab: (model, text, method, context, continuation, modes) -> tables."""
    return {}


source = st.radio("Results", ["saved run", "run on the loaded model"], horizontal=True)
if source == "saved run":
    try:
        saved = read_saved(SAVED)
    except ResultFileError as err:  # named, not fatal: a live run still works
        st.warning(f"{err}; `python -m kitty_core.attribution` writes this folder. Run on the loaded model instead.")
        st.stop()
    s = saved["settings"]
    if method not in s["methods"]:
        st.info(f"The saved run holds {', '.join(s['methods'])}; pick one in the sidebar, or run {method} on the "
                "loaded model.")
        st.stop()
    context, continuation = int(s["context"]), int(s["continuation"])
    layers, heads = saved["layer_kl"], saved["head_error"]
    layers, heads = layers[layers.method == method], heads[heads.method == method]
    kl_all = s["kl_all"][method]
    st.caption(f"Saved run: {s['model']} on {s.get('device', '?')} ({s.get('dtype', '?')}), the first {context} "
               f"tokens of {s.get('text', 'the shipped text')} in the cache, the next {continuation} scored.")
    run_key = None
else:
    with st.form("live"):
        c = st.columns(3)
        context = int(c[0].number_input("Context tokens (in the cache)", 64, int(frame.lm.shape["context"] or 8192),
                                        1024, 128))
        continuation = int(c[1].number_input("Scored tokens after them", 1, 512, 32, 8))
        modes = c[2].multiselect("Per-layer runs", list(MODES), list(MODES), format_func=MODES.get)
        go_live = st.form_submit_button("Run on the loaded model", type="primary")
    run_key = (frame.model_key, frame.text, method, context, continuation, tuple(modes))
    if go_live and run_key not in finished():
        try:
            with (st.status(f"Scoring {method} layer by layer against FP16 ...") as status,
                  gpu_turn("The scoring") as gpu):
                bar, t0 = st.progress(0.0), time.perf_counter()

                def progress(done: int, total: int, label: str) -> None:
                    left = (time.perf_counter() - t0) / done * (total - done)
                    bar.progress(done / total, text=f"{label} ({done}/{total}, about {left:.0f} s left)")

                found = gpu.call(analyse, frame.lm.model, frame.lm.tokenizer, frame.text, [method], context,
                                 continuation, modes, progress=on_caller(progress))
                status.update(label="Done", state="complete")
        except ValueError as err:
            st.error(str(err))
            st.stop()
        done = finished()
        done[run_key] = found
        while len(done) > 4:  # each holds a capture of every layer's queries, keys and values
            done.pop(next(iter(done)))
    if run_key not in finished():
        st.info("Each per-layer run scores the continuation through a cache with some layers in FP16: "
                "2 runs per layer and mode; the progress bar counts them.")
        st.stop()
    found = finished()[run_key]
    layers, heads, kl_all = found["layer_kl"], found["head_error"], found["kl_all"][method]

# -- KL per layer ---------------------------------------------------------------------------------------
# both bars read as one layer's share: its KL alone, and the KL that keeping it alone in FP16 removes
SHARES = {"only": "KL with only this layer quantized",
          "all_but": "KL removed when only this layer stays FP16 (all layers' KL minus all but this one's)"}
bars = layers.assign(runs=layers.quantized.map(SHARES),
                     share=layers.kl.where(layers.quantized == "only", kl_all - layers.kl))
fig = px.bar(bars, x="layer", y="share", color="runs", barmode="group", hover_data={"kl": ":.5f"},
             labels={"share": "KL(FP16 || method), nats per token", "layer": "layer", "runs": "",
                     "kl": "KL of this run"},
             title=f"{method}: each layer's share of the KL against FP16 ({kl_all:.4f} with every layer quantized, "
                   f"{continuation} scored tokens)")
fig.update_layout(legend=dict(orientation="h", y=-0.25))
st.plotly_chart(fig, width="stretch")
only = layers[layers.quantized == "only"].sort_values("kl", ascending=False)
if len(only):
    worst = ", ".join(f"{int(r.layer)} ({r.kl:.4f})" for r in only.head(3).itertuples())
    line = (f"Alone, layers {worst} cost the most; the single layers add up to {only.kl.sum():.4f} against "
            f"{kl_all:.4f} with every layer quantized.")
    rho = saved["settings"].get("spearman", {}).get(method, {}).get("only") if source == "saved run" else None
    if rho is not None:
        line += f" Spearman of this ranking against the probe's per-layer sensitivity: {rho:.2f}."
    st.caption(line)

# -- layers x KV heads ----------------------------------------------------------------------------------
metric = st.radio("Attention error", list(METRICS), format_func=METRICS.get, horizontal=True)
scale = 1.0 if metric == "kl" else 100.0
grid = (heads.groupby(["layer", "kv_head"])[metric].mean() * scale).unstack("kv_head").sort_index()
fig = px.imshow(grid.to_numpy(), aspect="auto", origin="lower", color_continuous_scale="Reds",
                x=[f"KV head {h}" for h in grid.columns], y=list(grid.index),
                labels={"x": "", "y": "layer", "color": METRICS[metric].split(" (")[0]},
                title=f"{METRICS[metric].capitalize()}, mean over each KV head's query heads and the scored tokens")
st.plotly_chart(fig, width="stretch")

# -- one layer and head ---------------------------------------------------------------------------------
shape = frame.lm.shape
defaults = saved["settings"] if source == "saved run" else {}
worst_layer = int(heads.groupby("layer")["moved"].mean().idxmax())
c = st.columns(3)
layer = int(c[0].number_input("Layer", 0, shape["layers"] - 1, int(defaults.get("layer", worst_layer))))
in_layer = heads[heads.layer == layer]
q_head = int(c[1].number_input("Query head", 0, shape["q_heads"] - 1,
                               int(defaults.get("q_head", in_layer.loc[in_layer.moved.idxmax(), "q_head"]))))
kv_head = q_head // (shape["q_heads"] // shape["kv_heads"])


@st.cache_resource(max_entries=2, show_spinner="Capturing queries, keys and values of every layer ...")
def capture_for(model_key: tuple, text: str, context: int, continuation: int):
    from kitty_app import get_model
    from kitty_core.attribution import token_ids
    from kitty_core.probe import capture

    lm = get_model(*model_key)
    with gpu_turn("The probe", tell_wait=False) as gpu:
        return gpu.call(capture, lm.model, token_ids(lm.tokenizer, text, context, continuation))


def current_capture():
    if run_key is not None:
        return finished()[run_key]["cap"]
    return capture_for(frame.model_key, TEXT.read_text(), context, continuation)


use_saved = source == "saved run" and (layer, q_head) == (int(defaults["layer"]), int(defaults["q_head"]))
try:
    if use_saved:
        amap = saved["attention_map"][saved["attention_map"].method == method]
        spans = saved["parts"][saved["parts"].method == method]
    else:
        amap, spans = attention_map(current_capture(), method, layer, q_head, context)
except ValueError as err:
    st.error(str(err))
    amap = None
if amap is not None and source == "saved run" and not use_saved:
    st.caption(f"Layer {layer}, query head {q_head} is not the saved run's: computed here on {frame.lm.name} "
               f"over the shipped text's first {context + continuation + 1} tokens.")
if amap is not None:
    first, last = int(amap["key"].min()), int(amap["key"].max())
    lo, hi = st.slider("Key positions shown", first, last, (first, last))
    window = amap[(amap["key"] >= lo) & (amap["key"] <= hi)]
    p_ref = window.pivot(index="query", columns="key", values="fp16")
    p_m = window.pivot(index="query", columns="key", values="quantized").reindex_like(p_ref)
    diff = p_m - p_ref
    top = float(np.nanquantile(p_ref.to_numpy(), 0.99)) or 1.0
    edge = float(np.nanmax(np.abs(diff.to_numpy()))) or 1.0
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, horizontal_spacing=0.09,
                        subplot_titles=("FP16", method, f"{method} minus FP16"))
    keys, queries = list(p_ref.columns), list(p_ref.index)
    for col, z, kw in ((1, p_ref, dict(colorscale="Viridis", zmin=0, zmax=top, showscale=False)),
                       (2, p_m, dict(colorscale="Viridis", zmin=0, zmax=top,
                                     colorbar=dict(x=0.645, xanchor="left", thickness=12, title="probability"))),
                       (3, diff, dict(colorscale="RdBu_r", zmid=0, zmin=-edge, zmax=edge,
                                      colorbar=dict(title="difference")))):
        fig.add_trace(go.Heatmap(z=z.to_numpy(), x=keys, y=queries, **kw), row=1, col=col)
    colors = {"sink": "#2ca02c", "page": "#d62728", "q-buffer": "#1f77b4", "new": "#9467bd", "FP16": "#2ca02c"}
    for r in spans[spans.side == "keys"].itertuples():
        if r.end <= lo or r.start > hi:
            continue
        color = next(v for k, v in colors.items() if r.part.startswith(k))
        for col in (1, 2, 3):
            fig.add_vrect(x0=max(r.start, lo) - 0.5, x1=min(r.end, hi + 1) - 0.5, line_width=0, fillcolor=color,
                          opacity=0.08, row=1, col=col)
            fig.add_vline(x=r.start - 0.5, line_width=1, line_color=color, opacity=0.6, row=1, col=col)
    fig.update_xaxes(title_text="key position")
    fig.update_yaxes(title_text="query position (scored token)", col=1)
    fig.update_layout(title=f"Layer {layer}, query head {q_head} (KV head {kv_head}): attention over the keys",
                      height=420)
    st.plotly_chart(fig, width="stretch")
    st.caption("Shaded key spans: " + "; ".join(f"{r.part} {r.start}-{r.end - 1}"
                                                for r in spans[spans.side == "keys"].itertuples())
               + ". Values: " + "; ".join(f"{r.part} {r.start}-{r.end - 1}"
                                          for r in spans[spans.side == "values"].itertuples()) + ".")

# -- one page -------------------------------------------------------------------------------------------
pages = int(spans[(spans.side == "values") & spans.part.str.startswith("page")].shape[0]) if amap is not None else 0
if pages:
    page = int(st.number_input("Page", 0, pages - 1, min(int(defaults.get("page", 0)), pages - 1)))
    try:
        if use_saved and page == int(defaults["page"]):
            err = saved["page_error"][saved["page_error"].method == method]
        else:
            err = page_error(current_capture(), method, layer, kv_head, page, context)
    except ValueError as e:
        st.error(str(e))
        err = None
    if err is not None:
        keys = err[err.side == "keys"].pivot(index="channel", columns="token", values="error")
        boosted = sorted(set(err[(err.side == "keys") & err.boosted.astype(bool)].channel))
        edge = float(np.abs(err.error).max()) or 1.0
        cols = st.columns(2)
        fig = go.Figure(go.Heatmap(z=keys.to_numpy(), x=list(keys.columns), y=list(keys.index), colorscale="RdBu_r",
                                   zmid=0, zmin=-edge, zmax=edge, colorbar=dict(title="error")))
        fig.add_trace(go.Scatter(x=[keys.columns[0] - 3] * len(boosted), y=boosted, mode="markers",
                                 marker=dict(symbol="triangle-right", color="black", size=7),
                                 name="boosted channel (4-bit)", showlegend=False))
        fig.update_layout(title=f"Keys of page {page}: dequantized minus FP16; ▶ the {len(boosted)} channels at 4 bits",
                          xaxis_title="token position", yaxis_title="channel")
        cols[0].plotly_chart(fig, width="stretch")
        values = err[err.side == "values"].pivot(index="token", columns="channel", values="error")
        fig = go.Figure(go.Heatmap(z=values.to_numpy(), x=list(values.columns), y=list(values.index),
                                   colorscale="RdBu_r", zmid=0, zmin=-edge, zmax=edge, colorbar=dict(title="error")))
        fig.update_layout(title=f"Values of page {page}: dequantized minus FP16", xaxis_title="channel",
                          yaxis_title="token position")
        cols[1].plotly_chart(fig, width="stretch")
        k, v = err[err.side == "keys"], err[err.side == "values"]
        split = (f" (boosted channels {k[k.boosted.astype(bool)].error.abs().mean():.4f}, the rest "
                 f"{k[~k.boosted.astype(bool)].error.abs().mean():.4f})") if boosted else ""
        st.caption(f"Mean |error|: keys {k.error.abs().mean():.4f}{split}, values {v.error.abs().mean():.4f}.")
elif amap is not None:
    st.info(f"{method} holds no full page of keys and values after {context} tokens: a longer context fills one.")
st.download_button("Download per-layer KL (CSV)", layers.to_csv(index=False), "layer_kl.csv", "text/csv")
