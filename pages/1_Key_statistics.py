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
NAMES = {"key": "keys after RoPE", "key_pre_rope": "keys before RoPE", "value": "values"}
tensor = cols[3].selectbox("Tensor", list(NAMES), format_func=NAMES.get)
what = NAMES[tensor]
ids = prompt_ids(frame, int(tokens))
cap = cached_capture(frame.model_key, frame.text, int(tokens))
stats, ratios = cached_stats(frame.model_key, frame.text, int(tokens))

hm = heatmap(cap, int(layer), int(head), tensor, max_rows=256)
block = int(hm.index.step) if len(hm) > 1 else 1
fig = px.imshow(hm.to_numpy(), x=list(hm.columns), y=list(hm.index), aspect="auto", color_continuous_scale="Viridis",
                origin="lower", labels={"x": "channel", "y": "token position" + (f" (mean of {block} tokens a row)"
                                                                                 if block > 1 else ""),
                                        "color": "|value|"},
                title=f"Magnitude of the {what}, layer {layer}, KV head {head} ({ids.shape[1]} tokens)")
st.plotly_chart(fig, width="stretch")

config = parse_method(frame.method)
sel = stats[(stats.tensor == tensor) & (stats.layer == layer) & (stats["head"] == head)].copy()
mask = boosted(cap, int(layer), config)[int(head)].cpu().numpy() if tensor != "value" else None
# the channel's precision in the method's pages, in words (values are never boosted)
if not config.quantize:
    sel["precision"] = "FP16: nothing is quantized"
elif mask is None:
    sel["precision"] = "values: no channel is boosted"
else:
    sel["precision"] = [f"boosted ({config.key_bits + 2 if config.key_bits == 2 else config.key_bits} bits)" if b
                        else f"not boosted ({config.key_bits} bits)" for b in mask]
bars = px.bar(sel, x="channel", y="mean_abs", color="precision",
              labels={"mean_abs": "mean |value| over the prompt", "precision": ""},
              title=f"Mean magnitude of the {what} per channel; in red the channels {frame.method} boosts on this "
                    f"prompt ({config.selection} rule)",
              color_discrete_map={"boosted (4 bits)": "#d62728", "not boosted (2 bits)": "#1f77b4",
                                  "not boosted (4 bits)": "#1f77b4", "values: no channel is boosted": "#1f77b4",
                                  "FP16: nothing is quantized": "#1f77b4"})
st.plotly_chart(bars, width="stretch")

per_layer = ratios.groupby(["tensor", "layer"], as_index=False)["outlier_ratio"].mean()
per_layer["tensor"] = per_layer["tensor"].map(NAMES)
lines = px.line(per_layer, x="layer", y="outlier_ratio", color="tensor", markers=True,
                labels={"outlier_ratio": "top 12.5% channels' mean |value| / the rest's", "tensor": ""},
                title="Outlier ratio per layer (mean over KV heads): how far the largest channels stand out")
st.plotly_chart(lines, width="stretch")
st.download_button("Download channel statistics (CSV)", stats.to_csv(index=False), "channel_stats.csv", "text/csv")
