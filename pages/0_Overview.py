"""Overview: the cache layout of the chosen method, and what fits in memory."""

import plotly.express as px
import streamlit as st

from kitty_app import sidebar
from kitty_core import PRESETS, parse_method
from kitty_core.memory import layout_segments, memory_table

frame = sidebar()
shape = frame.lm.shape
st.title("Kitty: 2-bit KV cache with channel-wise precision boost")
st.markdown(
    "Keys and values are stored at 2 bits in pages of G tokens; in every page the key channels that "
    "matter most are boosted to 4 bits. The first tokens (the sink) and the newest values (the local "
    "window) stay in FP16. Pick a method and a boost rate in the sidebar."
)

n = st.slider("Tokens in the sequence", 1, int(shape["context"] or 8192), min(1000, int(shape["context"] or 8192)))
seg = layout_segments(parse_method(frame.method), n)
fig = px.bar(seg, y="side", x="tokens", color="part", orientation="h", hover_data=["start", "bits"],
             labels={"tokens": "tokens of the sequence", "side": "", "part": "", "start": "first token",
                     "bits": "bits per element"},
             title=f"Where the {n:,} tokens of one sequence live ({frame.method})")
fig.update_layout(barmode="stack", height=260, legend_title_text="")
st.plotly_chart(fig, width="stretch")

st.subheader("Memory calculator")
cols = st.columns(2)
budget = cols[0].number_input("KV memory budget (GiB)", 0.1, 4096.0, 80.0, 1.0)
context = cols[1].number_input("Tokens per sequence", 1, 10_000_000, int(shape["context"] or 8192), 1024)
methods = list(PRESETS) + ([frame.method] if frame.method not in PRESETS else [])
table = memory_table(shape, methods, budget, context)
limit = shape["context"]
st.dataframe(table, hide_index=True, column_config={
    "bits_per_element": st.column_config.NumberColumn("bits / element", format="%.2f"),
    "bytes_per_token": st.column_config.NumberColumn("bytes / token (all layers)", format="%.0f"),
    "bytes_per_token_payload": st.column_config.NumberColumn("... planes only", format="%.0f"),
    "vs_fp16": st.column_config.NumberColumn("smaller than FP16", format="%.1fx"),
    "max_context": st.column_config.NumberColumn(
        "longest sequence (tokens)" + (f", at most the model's {limit:,}" if limit else ""), format="%d",
        help="the longest single sequence the budget holds, capped at the model's context"),
    "max_context_budget": st.column_config.NumberColumn("... the budget alone (tokens)", format="%d"),
    "max_batch": st.column_config.NumberColumn(f"sequences of {int(context):,} tokens that fit", format="%d"),
})
st.download_button("Download CSV", table.to_csv(index=False), "kitty_memory.csv", "text/csv")
