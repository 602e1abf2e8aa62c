"""Generations: one prompt, the chosen methods beside FP16 (streamed), where each first departs, KL per
step; passkey retrieval as a depth x length heatmap."""

import html

import pandas as pd
import plotly.express as px
import streamlit as st

from kitty_app import DATA, gpu_lock, sidebar
from kitty_core import PRESETS
from kitty_core.generate import compare_generations
from kitty_core.passkey import run_passkey
from kitty_core.results import ResultFileError, read_passkey

frame = sidebar()
st.title("Generations against FP16")

prompt = st.text_area("Prompt", "Explain in three sentences why the sky is blue.", height=80)
cols = st.columns([3, 1])
methods = cols[0].multiselect("Methods", sorted(set(PRESETS) - {"fp16"} | {frame.method}),
                              default=["kivi-k2v2", frame.method])
new_tokens = int(cols[1].number_input("New tokens", 1, 1024, 32, 16))


@st.cache_resource
def finished() -> dict:
    """Generations already run, shared by every tab: (model, prompt, methods, tokens) -> (texts, kl)."""
    return {}


key = (frame.model_key, prompt, tuple(methods), new_tokens)
shown = ["fp16"] + [m for m in methods if m != "fp16"]
slots = {}
for col, m in zip(st.columns(len(shown)), shown):
    col.markdown(f"**{m}**")
    slots[m] = col.empty()

if key not in finished():
    try:
        with gpu_lock():
            result = compare_generations(frame.lm.model, frame.lm.tokenizer, prompt, methods, new_tokens, chat=True,
                                         on_text=lambda m, text: slots[m].markdown(html.escape(text) + " ▌"))
    except ValueError as err:
        st.error(str(err))
        st.stop()
    done = finished()
    done[key] = result
    while len(done) > 16:
        done.pop(next(iter(done)))
texts, kl = finished()[key]

tok = frame.lm.tokenizer
for row in texts.itertuples():
    d = None if pd.isna(row.first_divergence) else int(row.first_divergence)
    with slots[row.method].container():
        if d is None:
            st.caption("same tokens as FP16")
            st.markdown(html.escape(row.text))
        else:
            same = tok.decode(row.tokens[:d], skip_special_tokens=True)
            rest = tok.decode(row.tokens[d:], skip_special_tokens=True)
            st.caption(f"departs from FP16 at token {d}")
            st.markdown(f"{html.escape(same)}<mark>{html.escape(rest)}</mark>", unsafe_allow_html=True)
if len(kl):
    fig = px.line(kl, x="step", y="kl", color="method", markers=True,
                  title="KL(FP16 || method) per step, along FP16's own continuation")
    st.plotly_chart(fig, width="stretch")
    if not kl.kl.abs().gt(1e-9).any():
        st.caption("KL is zero throughout: this short a prompt still sits in the FP16 sink and buffers, "
                   "nothing has been packed yet. Longer prompts reach the 2-bit pages.")
st.download_button("Download (CSV)", texts.drop(columns="tokens").to_csv(index=False), "generations.csv", "text/csv")

st.subheader("Passkey retrieval")
st.markdown("A 5-digit key hidden at a depth of filler text; a cell is the share of trials whose answer "
            "starts with the key. `python -m kitty_core.passkey` runs the same test.")
saved = DATA / "results" / "passkey_demo_cpu.csv"
with st.form("passkey"):
    c = st.columns(4)
    pk_methods = c[0].multiselect("Methods", sorted(PRESETS), default=list(dict.fromkeys(["fp16", frame.method.split("+")[0]])))
    lengths = c[1].text_input("Lengths (tokens)", "512,1024", key="pk_lengths")
    depths = c[2].text_input("Depths (0 = start)", "0.1,0.5,0.9", key="pk_depths")
    trials = int(c[3].number_input("Trials per cell", 1, 20, 1))
    run_it = st.form_submit_button("Run on the loaded model")


@st.cache_data(max_entries=8, show_spinner="Hiding keys and asking for them with every method ...")
def passkey(model_key: tuple, methods: tuple, lengths: tuple, depths: tuple, trials: int) -> pd.DataFrame:
    from kitty_app import get_model

    lm = get_model(*model_key)
    with gpu_lock():
        return run_passkey(lm.model, lm.tokenizer, list(methods), list(lengths), list(depths), trials)


if run_it:
    try:
        parsed_l = tuple(int(x) for x in lengths.split(",") if x.strip())
        parsed_d = tuple(float(x) for x in depths.split(",") if x.strip())
        if not pk_methods or not parsed_l or not parsed_d:
            raise ValueError("pick at least one method, length and depth")
        st.session_state.passkey_args = (tuple(pk_methods), parsed_l, parsed_d, trials)
    except ValueError as err:
        st.error(f"Passkey settings: {err}")
args = st.session_state.get("passkey_args")
if args:
    try:
        df, source = passkey(frame.model_key, *args), f"{frame.lm.name}, run here"
    except ValueError as err:
        st.error(str(err))
        df, source = None, None
elif saved.exists():
    try:
        df, source = read_passkey(saved), "saved run: the demo model on a CPU, 2 trials per cell"
    except ResultFileError as err:
        st.warning(f"{err}; skipped. `python -m kitty_core.passkey --csv` writes such files.")
        df, source = None, None
else:
    df, source = None, None
if df is not None:
    cells = df.groupby(["method", "length", "depth"], sort=False)["correct"].mean().reset_index()
    cells["length"] = cells["length"].astype(str)
    fig = px.density_heatmap(cells, x="length", y="depth", z="correct", histfunc="avg", facet_col="method",
                             color_continuous_scale="RdYlGn", range_color=(0, 1), text_auto=".2f",
                             title=f"Passkey retrieved ({source})")
    fig.update_yaxes(type="category")
    st.plotly_chart(fig, width="stretch")
    st.download_button("Download (CSV)", df.to_csv(index=False), "passkey.csv", "text/csv", key="passkey-csv")
