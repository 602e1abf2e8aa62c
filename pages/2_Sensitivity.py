"""Sensitivity: what quantizing one key channel to INT2 does to each query head's attention (Figure 2b)."""

import plotly.express as px
import streamlit as st

from kitty_app import cached_capture, cached_sensitivity, prompt_ids, sidebar
from kitty_core.config import SELECTION_RULES
from kitty_core.probe import agreement, check_measurable, measurable_tokens, rule_scores

frame = sidebar()
st.title("Per-channel sensitivity")
st.caption("Each key channel alone is quantized to INT2 as the cache would (per page, sink kept FP16); "
           "the bars are the MSE of each query head's causal attention probabilities against FP16.")

shape = frame.lm.shape
cols = st.columns(3)
tokens = cols[0].number_input("Prompt tokens", measurable_tokens(), int(shape["context"] or 8192), 512, 128,
                              help="the sink and at least one page after it")
layer = int(cols[1].number_input("Layer", 0, shape["layers"] - 1, min(15, shape["layers"] - 1)))
kv_head = int(cols[2].number_input("KV head", 0, shape["kv_heads"] - 1, 0))
ids = prompt_ids(frame, int(tokens))
try:
    check_measurable(ids.shape[1])
except ValueError as err:
    st.error(f"The prompt source: {err}, or pick the shipped text.")
    st.stop()
if ids.shape[1] < tokens:
    st.caption(f"The prompt source has {ids.shape[1]:,} tokens, fewer than the {int(tokens):,} asked: all of them are measured.")
cap = cached_capture(frame.model_key, frame.text, int(tokens))
sens = cached_sensitivity(frame.model_key, frame.text, int(tokens), layer)

group = sens[sens.kv_head == kv_head]
fig = px.bar(group, x="channel", y="mse", color=group.q_head.astype(str), barmode="group",
             labels={"color": "query head", "mse": "MSE of attention probabilities", "channel": "key channel"},
             title=f"Layer {layer}, KV head {kv_head}: attention MSE when one channel is INT2")
st.plotly_chart(fig, width="stretch")

agree = agreement(cap, sens, rules=SELECTION_RULES)
rule = st.selectbox("Selection rule", SELECTION_RULES, index=SELECTION_RULES.index("qk"))

scatter = group.groupby("channel", as_index=False)["mse"].sum()
scatter["score"] = rule_scores(cap, layer, rule)[kv_head].cpu().numpy()
row = agree[(agree.rule == rule) & (agree.kv_head == kv_head)].iloc[0]
fig2 = px.scatter(scatter, x="score", y="mse", hover_data=["channel"], log_y=True,
                  labels={"score": f"the {rule} rule's score", "mse": "measured MSE, summed over query heads"},
                  title=f"The {rule} rule's score against measured sensitivity: Spearman {row.spearman:.2f}; of the "
                        f"most sensitive 12.5% of channels it picks {row['overlap@0.125']:.0%}, of the top 25% "
                        f"{row['overlap@0.25']:.0%}")
st.plotly_chart(fig2, width="stretch")
st.markdown("**Every rule, averaged over layer {}'s KV heads**".format(layer))
st.dataframe(agree.groupby("rule", as_index=False)[["spearman", "overlap@0.125", "overlap@0.25"]].mean(),
             width="stretch", hide_index=True,
             column_config={
                 "rule": st.column_config.TextColumn("selection rule"),
                 "spearman": st.column_config.NumberColumn("Spearman (score vs MSE)", format="%.2f"),
                 "overlap@0.125": st.column_config.NumberColumn("picks of the top 12.5%", format="percent"),
                 "overlap@0.25": st.column_config.NumberColumn("picks of the top 25%", format="percent"),
             })
st.download_button("Download sensitivity (CSV)", sens.to_csv(index=False), f"sensitivity_layer{layer}.csv", "text/csv")
