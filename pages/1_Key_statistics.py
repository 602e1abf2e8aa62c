"""Key statistics: |K| per token and channel, per-channel magnitudes, outlier ratios across layers."""

import plotly.express as px
import streamlit as st

from kitty_app import cached_capture, cached_stats, prompt_ids, sidebar
from kitty_core import parse_method
from kitty_core.probe import boosted, heatmap

frame = sidebar()
st.title("Key statistics")
st.caption("A few key channels stand out in every layer (Kitty, Figure 2a); values have no such channels.")

shape = frame.lm.shape
cols = st.columns(4)
tokens = cols[0].number_input("Prompt tokens", 16, int(shape["context"] or 8192), 512, 128)
layer = cols[1].number_input("Layer", 0, shape["layers"] - 1, min(15, shape["layers"] - 1))
head = cols[2].number_input("KV head", 0, shape["kv_heads"] - 1, 0)
tensor = cols[3].selectbox("Tensor", ["key", "key_pre_rope", "value"],
                           format_func={"key": "keys after RoPE", "key_pre_rope": "keys before RoPE", "value": "values"}.get)
ids = prompt_ids(frame, int(tokens))
cap = cached_capture(frame.model_key, frame.text, int(tokens))
stats, ratios = cached_stats(frame.model_key, frame.text, int(tokens))

hm = heatmap(cap, int(layer), int(head), tensor, max_rows=256)
fig = px.imshow(hm.to_numpy(), aspect="auto", color_continuous_scale="Viridis", origin="lower",
                labels={"x": "channel", "y": "token block", "color": "|x|"},
                title=f"|{tensor}| of layer {layer}, KV head {head} ({ids.shape[1]} tokens)")
st.plotly_chart(fig, width="stretch")

config = parse_method(frame.method)
sel = stats[(stats.tensor == tensor) & (stats.layer == layer) & (stats["head"] == head)].copy()
mask = boosted(cap, int(layer), config)[int(head)].cpu().numpy() if tensor != "value" else None
sel["boosted"] = mask if mask is not None else False
bars = px.bar(sel, x="channel", y="mean_abs", color="boosted", title=f"Mean |{tensor}| per channel; "
              f"highlighted: the channels {frame.method} boosts on this prompt ({config.selection} rule)",
              color_discrete_map={True: "#d62728", False: "#1f77b4"})
st.plotly_chart(bars, width="stretch")

lines = px.line(ratios.groupby(["tensor", "layer"], as_index=False)["outlier_ratio"].mean(), x="layer",
                y="outlier_ratio", color="tensor", markers=True,
                title="Outlier ratio per layer: mean |x| of the top 12.5% channels over the rest")
st.plotly_chart(lines, width="stretch")
st.download_button("Download channel statistics (CSV)", stats.to_csv(index=False), "channel_stats.csv", "text/csv")
