"""Boost rate: accuracy against FP16 as the share of 4-bit key channels grows (Kitty, Figure 4)."""

import plotly.express as px
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from kitty_app import DATA, Progress, gpu_turn, sidebar
from kitty_core.evaluate import boost_sweep, curve_rule, pareto_front, rule_curves
from kitty_core.gpu_thread import on_caller
from kitty_core.results import ResultFileError, read_accuracy

DEFAULT_FILE = "rules_demo_cpu.json"  # a dense sweep on the demo model, CPU: every rule, boost 0 to 1
DEFAULT_COMMAND = ("python -m kitty_core.evaluate --device cpu --context 256 --continuation 16 --windows 2 "
                   "--methods fp16,kitty+boost_rate=0+selection=magnitude,<kitty+boost_rate=R+selection=RULE for R in "
                   "0.125, 0.25, 0.375, 0.5, 0.75 and every rule>,kitty+boost_rate=1+selection=magnitude,kivi-k2v2,"
                   "k4v2-sink --json data/results/rules_demo_cpu.json")
METRICS = {"kl": "KL(FP16 ‖ method), nats per token", "perplexity": "perplexity of the text",
           "top1": "top-1 agreement with FP16"}

frame = sidebar()
st.title("Boost rate")
st.caption("How close each cache's next-token predictions stay to FP16's as the share of key channels "
           "stored at 4 bits grows, one curve per channel-selection rule; presets as reference points.")

saved = sorted(p.name for p in (DATA / "results").glob("*.json") if "accuracy" in p.name or "rules" in p.name)
source = st.radio("Results", ["saved run", "run on the loaded model"], horizontal=True, key="results_source")
if source == "saved run":
    if not saved:
        st.info("No saved accuracy runs in data/results. `python -m kitty_core.evaluate --json` writes them.")
        st.stop()
    name = st.selectbox("File", saved, index=saved.index(DEFAULT_FILE) if DEFAULT_FILE in saved else 0)
    try:
        df = read_accuracy(DATA / "results" / name)
    except ResultFileError as err:  # named, not fatal: another file can still be picked
        st.warning(f"{err}; skipped. `python -m kitty_core.evaluate --json` writes such files.")
        st.stop()
    df["rule"] = [curve_rule(m) for m in df.method]
    if name == DEFAULT_FILE:
        st.caption(f"The demo model on a CPU, written by `{DEFAULT_COMMAND}`.")
else:
    cols = st.columns(5)
    context = int(cols[0].number_input("Context tokens", 64, 8192, 256, 64))
    continuation = int(cols[1].number_input("Scored tokens", 4, 512, 16, 4))
    windows = int(cols[2].number_input("Windows", 1, 16, 1))
    rules = cols[3].multiselect("Rules", ["magnitude", "qk", "range", "random"], ["magnitude", "qk"])
    rates = cols[4].multiselect("Boost rates", [0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0], [0.0, 0.125, 0.25, 0.5],
                                format_func=lambda r: f"{r:.1%}")
    if not st.button("Run the sweep", type="primary"):
        st.info("Each point prefills the context and scores the continuation through that cache. On a CPU a "
                "point takes tens of seconds: the saved run above has every rule.")
        st.stop()
    if not rules or not rates:
        st.error("Pick at least one rule and one boost rate.")
        st.stop()
    try:
        with st.status("Scoring every method against FP16 ...") as status, gpu_turn("The sweep") as gpu:
            df = gpu.call(boost_sweep, frame.lm.model, frame.lm.tokenizer, rates=sorted(rates), rules=rules,
                          text=frame.text, context=context, continuation=continuation, windows=windows,
                          progress=on_caller(Progress("Methods scored")))
            status.update(label="Done", state="complete")
    except ValueError as err:
        st.error(str(err))
        st.stop()

metric = st.radio("Metric", list(METRICS), horizontal=True, format_func=lambda m: METRICS[m].split(",")[0])
lines = rule_curves(df)
presets = df[(df.rule == "preset") & (df.method != "fp16")]
fig = make_subplots(specs=[[{"secondary_y": True}]])
for trace in px.line(lines, x="boost_rate", y=metric, color="rule", markers=True,
                     hover_data={"method": True}).data:
    fig.add_trace(trace)
for trace in px.scatter(presets, x="boost_rate", y=metric, text="method").data:
    trace.update(textposition="top center", name="presets", showlegend=True, marker_symbol="diamond",
                 marker_size=10)
    fig.add_trace(trace)
ref = float(df.loc[df.method == "fp16", metric].iloc[0]) if "fp16" in set(df.method) else None
if ref is not None and metric != "kl":  # FP16 is the reference: KL 0, agreement 1
    fig.add_hline(y=ref, line_dash="dash", line_color="gray", annotation_text="FP16")
bits = lines.drop_duplicates("boost_rate").sort_values("boost_rate")
fig.add_trace(go.Scatter(x=bits.boost_rate, y=bits.bits_per_element, name="bits per element", mode="lines",
                         line={"dash": "dot", "color": "gray"}), secondary_y=True)
shown = df[df.method != "fp16"][metric]
log = metric == "kl" and (shown > 0).all()  # KL spans decades from no boost to all channels
fig.update_layout(title=f"{METRICS[metric].split(',')[0]} against the boost rate", legend_title_text="")
fig.update_xaxes(title_text="boost rate (share of key channels at 4 bits)", tickformat=".0%",
                 range=[-0.04, 1.04])
fig.update_yaxes(title_text=METRICS[metric], type="log" if log else "linear",
                 tickformat=".0%" if metric == "top1" else None, secondary_y=False)
fig.update_yaxes(title_text="bits per element (keys and values)", secondary_y=True, showgrid=False, tickformat=".1f")
st.plotly_chart(fig, width="stretch")

# the same points against what they cost: which rule (or allocation, or preset) is best at each budget
costed = df[df.method != "fp16"]
front = pareto_front(costed, error=metric, lower_is_better=metric != "top1")
cost_fig = go.Figure()
for rule, points in costed.groupby("rule", sort=False):
    preset = rule == "preset"
    cost_fig.add_trace(go.Scatter(
        x=points.bits_per_element, y=points[metric], name="presets" if preset else rule,
        mode="markers+text" if preset else "markers", text=points.method if preset else None,
        textposition="top center", customdata=points.method, hovertemplate="%{customdata}<br>%{x:.2f} bits, %{y:.4g}",
        marker={"symbol": "diamond", "size": 10} if preset else {"size": 8}))
cost_fig.add_trace(go.Scatter(x=front.bits_per_element, y=front[metric], name="best at each budget", mode="lines",
                              line={"shape": "hv", "dash": "dash", "color": "gray"}, hoverinfo="skip"))
if ref is not None and metric != "kl":
    cost_fig.add_hline(y=ref, line_dash="dash", line_color="gray", annotation_text="FP16")
cost_fig.update_layout(title=f"{METRICS[metric].split(',')[0]} against memory (bits per element)", legend_title_text="")
cost_fig.update_xaxes(title_text="bits per element of a page (keys and values, metadata included)", tickformat=".1f")
cost_fig.update_yaxes(title_text=METRICS[metric], type="log" if log else "linear",
                      tickformat=".0%" if metric == "top1" else None)
st.plotly_chart(cost_fig, width="stretch")
on_front = ", ".join(f"{m} ({b:.2f} bits)" for m, b in zip(front.method, front.bits_per_element))
st.caption(f"The dashed line is the best {METRICS[metric].split(',')[0]} any point reaches at or below each "
           f"budget: {on_front}.")
st.dataframe(df[["method", "rule", "boost_rate", "kl", "perplexity", "top1", "bits_per_element", "seconds"]],
             hide_index=True, column_config={
                 "rule": st.column_config.TextColumn("selection rule"),
                 "boost_rate": st.column_config.NumberColumn("boost rate", format="percent"),
                 "kl": st.column_config.NumberColumn("KL (nats / token)", format="%.4f"),
                 "perplexity": st.column_config.NumberColumn("perplexity", format="%.3f"),
                 "top1": st.column_config.NumberColumn("top-1 agreement", format="percent"),
                 "bits_per_element": st.column_config.NumberColumn("bits / element", format="%.2f"),
                 "seconds": st.column_config.NumberColumn("seconds", format="%.1f"),
             })
st.download_button("Download (CSV)", df.to_csv(index=False), "boost_rate.csv", "text/csv")
