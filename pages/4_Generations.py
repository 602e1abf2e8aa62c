"""Generations: one prompt, the chosen methods beside FP16, where each first departs, KL per step."""

import html

import plotly.express as px
import streamlit as st

from kitty_app import gpu_lock, sidebar
from kitty_core import PRESETS
from kitty_core.generate import compare_generations

frame = sidebar()
st.title("Generations against FP16")

prompt = st.text_area("Prompt", "Explain in three sentences why the sky is blue.", height=80)
cols = st.columns([3, 1])
methods = cols[0].multiselect("Methods", sorted(set(PRESETS) - {"fp16"} | {frame.method}),
                              default=["kivi-k2v2", frame.method])
new_tokens = int(cols[1].number_input("New tokens", 1, 1024, 48, 16))


@st.cache_data(max_entries=16, show_spinner="Generating with every method ...")
def run(model_key: tuple, prompt: str, methods: tuple, new_tokens: int):
    from kitty_app import get_model

    lm = get_model(*model_key)
    with gpu_lock():
        return compare_generations(lm.model, lm.tokenizer, prompt, list(methods), new_tokens, chat=True)


try:
    texts, kl = run(frame.model_key, prompt, tuple(methods), new_tokens)
except ValueError as err:
    st.error(str(err))
    st.stop()

tok = frame.lm.tokenizer
for col, row in zip(st.columns(len(texts)), texts.itertuples()):
    col.markdown(f"**{row.method}**")
    d = row.first_divergence
    if d is None:
        col.caption("same tokens as FP16")
        col.markdown(html.escape(row.text))
    else:
        same = tok.decode(row.tokens[:d], skip_special_tokens=True)
        rest = tok.decode(row.tokens[d:], skip_special_tokens=True)
        col.caption(f"departs from FP16 at token {d}")
        col.markdown(f"{html.escape(same)}<mark>{html.escape(rest)}</mark>", unsafe_allow_html=True)
if len(kl):
    fig = px.line(kl, x="step", y="kl", color="method", markers=True,
                  title="KL(FP16 || method) per step, along FP16's own continuation")
    st.plotly_chart(fig, width="stretch")
    if not kl.kl.abs().gt(1e-9).any():
        st.caption("KL is zero throughout: this short a prompt still sits in the FP16 sink and buffers, "
                   "nothing has been packed yet. Longer prompts reach the 2-bit pages.")
st.download_button("Download (CSV)", texts.drop(columns="tokens").to_csv(index=False), "generations.csv", "text/csv")
