"""Boost rate: accuracy against FP16 as the share of 4-bit key channels grows (Kitty, Figure 4)."""


import plotly.express as px
import streamlit as st
from plotly.subplots import make_subplots

from kitty_app import DATA, gpu_lock, sidebar
from kitty_core.evaluate import boost_sweep
from kitty_core.results import ResultFileError, read_accuracy

frame = sidebar()
st.title("Boost rate")
st.caption("KL(FP16 || method), perplexity and top-1 agreement as the boost rate grows, one line per "
           "channel-selection rule; presets as reference points.")

saved = sorted(p.name for p in (DATA / "results").glob("*.json") if "accuracy" in p.name or "rules" in p.name)
source = st.radio("Results", ["saved run", "run now on this model"], horizontal=True)
if source == "saved run":
    name = st.selectbox("File", saved, index=saved.index("rules_demo_h200_fp32.json") if "rules_demo_h200_fp32.json" in saved else 0)
    try:
        df = read_accuracy(DATA / "results" / name)
    except ResultFileError as err:  # named, not fatal: another file can still be picked
        st.warning(f"{err}; skipped. `python -m kitty_core.evaluate --json` writes such files.")
        st.stop()
else:
    cols = st.columns(4)
    context = int(cols[0].number_input("Context tokens", 64, 8192, 256, 64))
    continuation = int(cols[1].number_input("Scored tokens", 4, 512, 16, 4))
    windows = int(cols[2].number_input("Windows", 1, 16, 1))
    rules = cols[3].multiselect("Rules", ["magnitude", "qk", "range", "random"], ["magnitude", "qk"])
    if not st.button("Run the sweep", type="primary"):
        st.info("Each point prefills the context and scores the continuation through that cache.")
        st.stop()
    try:
        with st.status("Scoring every method against FP16 ...") as status, gpu_lock():
            bar = st.progress(0.0)
            df = boost_sweep(frame.lm.model, frame.lm.tokenizer, rules=rules, text=frame.text, context=context,
                             continuation=continuation, windows=windows,
                             progress=lambda i, n, m: bar.progress(i / n, text=m))
            status.update(label="Done", state="complete")
    except ValueError as err:
        st.error(str(err))
        st.stop()

metric = st.radio("Metric", ["kl", "perplexity", "top1"], horizontal=True)
lines = df[df.rule != "preset"].sort_values("boost_rate")
fig = make_subplots(specs=[[{"secondary_y": True}]])
for trace in px.line(lines, x="boost_rate", y=metric, color="rule", markers=True).data:
    fig.add_trace(trace)
for trace in px.scatter(df[df.rule == "preset"], x="boost_rate", y=metric, text="method").data:
    trace.update(textposition="top center", name="presets", showlegend=True)
    fig.add_trace(trace)
fig.add_trace(px.line(lines.drop_duplicates("boost_rate"), x="boost_rate", y="bits_per_element").data[0]
              .update(name="bits / element", line_dash="dot", showlegend=True), secondary_y=True)
fig.update_layout(title=f"{metric} against FP16 vs boost rate", xaxis_title="boost rate")
fig.update_yaxes(title_text="bits per element", secondary_y=True)
st.plotly_chart(fig, width="stretch")
st.dataframe(df.drop(columns=["kl_per_window"], errors="ignore"), hide_index=True)
st.download_button("Download (CSV)", df.to_csv(index=False), "boost_rate.csv", "text/csv")
