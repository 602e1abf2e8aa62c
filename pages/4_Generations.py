"""Generations: one prompt, the chosen methods beside FP16 (streamed), where each first departs, KL per
step, the share of the context in 2-bit pages; passkey retrieval as a depth x length heatmap."""

import html

import pandas as pd
import plotly.express as px
import streamlit as st

from kitty_app import DATA, TEXT, Progress, gpu_turn, sidebar
from kitty_core import PRESETS
from kitty_core.cli import numbers
from kitty_core.generate import compare_generations, long_context, read_generations
from kitty_core.gpu_thread import on_caller
from kitty_core.lm_eval import read_table, summary
from kitty_core.lm_eval_tasks import TITLES
from kitty_core.passkey import passkey_prompt, run_passkey
from kitty_core.results import ResultFileError, read_passkey

SAVED = DATA / "results" / "generations_demo_cpu.json"
PROMPTS = ["Long context from the prompt source", "Passkey prompt", "Short prompt"]

frame = sidebar()
st.title("Generations against FP16")
st.caption("Greedy generations of each method beside FP16's. A method's text is FP16's until the first "
           "token where it picks another (marked); the KL chart scores every method on FP16's own "
           "continuation, step by step. A prompt shorter than the FP16 sink and buffers never reaches the "
           "2-bit pages, so the default is a long context whose pages fill while the methods generate.")

tok, limit = frame.lm.tokenizer, int(frame.lm.shape["context"] or 1 << 20)
kind = st.radio("Prompt", PROMPTS, horizontal=True, key="prompt_kind")
cols = st.columns([3, 1, 1, 1])
methods = cols[0].multiselect("Methods", sorted(set(PRESETS) - {"fp16"} | {frame.method}),
                              default=list(dict.fromkeys(["kivi-k2v2", frame.method])))
new_tokens = int(cols[1].number_input("New tokens", 1, 1024, 64, 16))
chat, settings = False, {}
try:
    if kind == PROMPTS[0]:
        tokens = int(cols[2].number_input("Context tokens", 64, limit, min(2048, limit), 256,
                                          help="the first tokens of the sidebar's prompt source, continued "
                                               "from where they stop"))
        if not frame.text.strip():
            raise ValueError("the prompt source is empty: type some text in the sidebar, or pick the shipped text")
        prompt = long_context(tok, frame.text, tokens)
        settings = {"prompt": "long context", "tokens": tokens, "text": TEXT.name if frame.text == TEXT.read_text()
                    else None}
    elif kind == PROMPTS[1]:
        length = int(cols[2].number_input("Prompt tokens", 64, limit, min(2048, limit), 256))
        depth = float(cols[3].number_input("Key depth", 0.0, 1.0, 0.5, 0.1, help="0 = start of the filler, 1 = end"))
        prompt = passkey_prompt(tok, length, depth, "52817")
    else:
        prompt = st.text_area("Your prompt", "Explain in three sentences why the sky is blue.", height=80)
        chat = True
        if not prompt.strip():
            raise ValueError("the prompt is empty: type a prompt")
except ValueError as err:
    st.error(f"Prompt: {err}")
    st.stop()
if not methods:
    st.error("Pick at least one method to compare with FP16.")
    st.stop()


@st.cache_resource
def finished() -> dict:
    """Generations already run, shared by every tab: (model, prompt, methods, tokens) -> (texts, kl, source)."""
    return {}


def show(texts: pd.DataFrame, kl: pd.DataFrame) -> None:
    """Each method's text with its first departure marked, a summary table, KL per step."""
    mean_kl = kl.groupby("method")["kl"].mean() if len(kl) else pd.Series(dtype=float)
    for row in texts.itertuples():
        d = None if pd.isna(row.first_divergence) else int(row.first_divergence)
        with slots[row.method].container():
            pages = (f"; context in 2-bit pages: keys {row.keys_in_2bit_pages:.0%}, "
                     f"values {row.values_in_2bit_pages:.0%}"
                     if "keys_in_2bit_pages" in texts and row.method != "fp16" else "")
            if row.method == "fp16":
                st.caption(f"the reference: {len(row.tokens)} tokens")
                st.markdown(html.escape(row.text))
            elif d is None:
                st.caption(f"same {len(row.tokens)} tokens as FP16; mean KL {mean_kl.get(row.method, 0):.4f}{pages}")
                st.markdown(html.escape(row.text))
            else:
                same = tok.decode(row.tokens[:d], skip_special_tokens=True)
                rest = tok.decode(row.tokens[d:], skip_special_tokens=True)
                st.caption(f"departs from FP16 after {d} tokens; mean KL {mean_kl.get(row.method, 0):.4f}{pages}")
                st.markdown(f"{html.escape(same)}<mark>{html.escape(rest)}</mark>", unsafe_allow_html=True)

    summary = texts[texts.method != "fp16"].assign(
        departs=lambda t: [len(tk) if pd.isna(d) else int(d) for tk, d in zip(t.tokens, t.first_divergence)],
        mean_kl=lambda t: t.method.map(mean_kl), max_kl=lambda t: t.method.map(kl.groupby("method")["kl"].max()))
    st.dataframe(summary[[c for c in ["method", "departs", "mean_kl", "max_kl", "keys_in_2bit_pages",
                                      "values_in_2bit_pages"] if c in summary]], hide_index=True, column_config={
        "departs": st.column_config.NumberColumn("tokens until it departs from FP16", format="%d"),
        "mean_kl": st.column_config.NumberColumn("mean KL (nats / token)", format="%.4f"),
        "max_kl": st.column_config.NumberColumn("largest KL", format="%.3f"),
        "keys_in_2bit_pages": st.column_config.NumberColumn("keys in 2-bit pages", format="percent"),
        "values_in_2bit_pages": st.column_config.NumberColumn("values in 2-bit pages", format="percent"),
    })
    if len(kl):
        fig = px.line(kl, x="step", y="kl", color="method", markers=True,
                      labels={"step": "generated token (FP16's continuation)", "kl": "KL(FP16 ‖ method), nats",
                              "method": ""},
                      title="KL(FP16 ‖ method) per step, along FP16's own continuation")
        for r in summary.itertuples():
            if r.departs < len(r.tokens):
                fig.add_vline(x=r.departs, line_dash="dot", annotation_text=f"{r.method} departs",
                              annotation_textangle=-90)
        st.plotly_chart(fig, width="stretch")
        if not kl.kl.abs().gt(1e-9).any():
            st.caption("KL is zero throughout: this short a prompt still sits in the FP16 sink and buffers, "
                       "nothing has been packed yet. Longer prompts reach the 2-bit pages.")
    st.download_button("Download (CSV)", texts.drop(columns="tokens").to_csv(index=False), "generations.csv",
                       "text/csv")


key = (frame.model_key, prompt, tuple(methods), new_tokens)
run_it = st.button("Run on the loaded model", type="primary")
shown = ["fp16"] + [m for m in methods if m != "fp16"]
slots = {}
for col, m in zip(st.columns(len(shown)), shown):
    col.markdown(f"**{m}**")
    slots[m] = col.empty()

result, saved_settings = finished().get(key), None
if result is None and not run_it and SAVED.exists():
    try:
        saved_settings, texts, kl = read_generations(SAVED)
    except ResultFileError as err:
        st.warning(f"{err}; skipped. `python -m kitty_core.generate --json` writes such files.")
    else:
        same = (frame.model_key[0] == saved_settings.get("model") and settings.get("prompt") == "long context"
                and settings.get("text") == saved_settings.get("text") and tokens == saved_settings.get("tokens")
                and new_tokens == saved_settings.get("new_tokens") and list(methods) == saved_settings.get("methods"))
        result = (texts, kl, f"saved run: {saved_settings['model']} on {saved_settings.get('device', '?')}, "
                             f"{saved_settings.get('dtype', '?')}") if same else None
stopped = st.session_state.get("generation_partial")
if result is None and not run_it and stopped and stopped["key"] == key:
    # the last run of these settings was stopped (Stop, or the tab closed): what it streamed is kept
    for m, text in stopped["texts"].items():
        with slots[m].container():
            st.caption(f"stopped after {stopped['tokens'].get(m, 0)} tokens")
            st.markdown(html.escape(text))
    st.warning("The last run was stopped before it finished: the text each method had generated is kept above "
               "(no KL yet, it is scored after every method has generated). **Run on the loaded model** runs it "
               "again from the start.")
elif result is None and not run_it:
    st.info("Press **Run on the loaded model** to generate with these settings (on a CPU, a 2,000-token context "
            "takes minutes per method).")
elif result is None or run_it:
    partial = st.session_state["generation_partial"] = {"key": key, "texts": {}, "tokens": {}}

    def stream(m: str, text: str) -> None:
        """Show the text so far, and keep it in the session, so that a Stop leaves it on the page."""
        partial["texts"][m] = text
        partial["tokens"][m] = partial["tokens"].get(m, 0) + 1
        slots[m].markdown(html.escape(text) + " ▌")

    try:
        bar = Progress("Tokens generated and scored")
        with gpu_turn("The generation") as gpu:
            texts, kl = gpu.call(compare_generations, frame.lm.model, tok, prompt, methods, new_tokens, chat=chat,
                                 on_text=on_caller(stream), progress=on_caller(bar))
        bar.clear()
        result = (texts, kl, f"run here: {frame.lm.name} on {frame.lm.device}")
        done = finished()
        done[key] = result
        while len(done) > 16:
            done.pop(next(iter(done)))
    except ValueError as err:
        st.error(str(err))
    st.session_state.pop("generation_partial", None)  # finished or refused: nothing partial to keep
if result is not None:
    texts, kl, source = result
    if saved_settings and source.startswith("saved"):
        st.caption(f"{source}, written by `python -m kitty_core.generate --tokens {saved_settings['tokens']} "
                   f"--new-tokens {saved_settings['new_tokens']} --methods {','.join(saved_settings['methods'])} "
                   "--json data/results/generations_demo_cpu.json`. **Run on the loaded model** recomputes it.")
    else:
        st.caption(source)
    show(texts, kl)

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
    run_pk = st.form_submit_button("Run on the loaded model")


@st.cache_resource
def passkey_runs() -> dict:
    """Passkey runs already done, shared by every tab: (model, methods, lengths, depths, trials) -> trials."""
    return {}


if run_pk:
    try:
        if not pk_methods:
            raise ValueError("pick at least one method")
        parsed_l = tuple(numbers(lengths, int, "lengths", "512,1024"))
        parsed_d = tuple(numbers(depths, float, "depths", "0.1,0.5,0.9"))
        st.session_state.passkey_args = (tuple(pk_methods), parsed_l, parsed_d, trials)
    except ValueError as err:
        st.session_state.pop("passkey_args", None)  # this submission replaces the last: its error, its result
        st.error(f"Passkey settings: {err}")
args = st.session_state.get("passkey_args")
df, source = None, None
if args:
    pk_key = (frame.model_key, *args)
    try:
        if pk_key not in passkey_runs():
            bar = Progress("Methods x lengths asked")
            with gpu_turn("The passkey run") as gpu:
                found = gpu.call(run_passkey, frame.lm.model, tok, list(args[0]), list(args[1]), list(args[2]),
                                 args[3], progress=on_caller(bar))
            bar.clear()
            runs = passkey_runs()
            runs[pk_key] = found
            while len(runs) > 8:
                runs.pop(next(iter(runs)))
        df, source = passkey_runs()[pk_key], f"{frame.lm.name}, run here"
    except ValueError as err:
        st.error(str(err))
elif saved.exists():
    try:
        df, source = read_passkey(saved), "saved run: the demo model on a CPU, 2 trials per cell"
    except ResultFileError as err:
        st.warning(f"{err}; skipped. `python -m kitty_core.passkey --csv` writes such files.")
if df is not None:
    cells = df.groupby(["method", "length", "depth"], sort=False)["correct"].mean().reset_index()
    cells = cells.sort_values(["length", "depth"], kind="stable")  # tested lengths in order, as categories
    cells["length"] = cells["length"].map(lambda n: f"{int(n):,}")
    cells["depth"] = cells["depth"].map(lambda d: f"{d:.0%}")
    fig = px.density_heatmap(cells, x="length", y="depth", z="correct", histfunc="avg", facet_col="method",
                             color_continuous_scale="RdYlGn", range_color=(0, 1), text_auto=".0%",
                             labels={"length": "prompt length (tokens)", "depth": "depth of the key",
                                     "correct": "retrieved"},
                             title=f"Passkey retrieved, share of trials ({source})")
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=list(dict.fromkeys(cells["length"])))
    fig.update_yaxes(type="category")
    fig.update_coloraxes(colorbar_title_text="retrieved", colorbar_tickformat=".0%")
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    st.plotly_chart(fig, width="stretch")
    st.download_button("Download (CSV)", df.to_csv(index=False), "passkey.csv", "text/csv", key="passkey-csv")

st.subheader("Long-context tasks with lm-eval")
st.markdown("RULER-style needles, variable tracking, common words and the passkey, run through lm-eval's "
            "harness with each method (saved runs; `python -m kitty_core.lm_eval` writes them, on any model "
            "and GPU). A point is the share of answers that recall the hidden values (exact match for the "
            "passkey).")
tables = sorted(p.name for p in (DATA / "results").glob("lm_eval_*.json"))
if tables:
    default = "lm_eval_demo_h200.json"
    name = st.selectbox("Saved run", tables, index=tables.index(default) if default in tables else 0)
    try:
        settings, table = read_table(DATA / "results" / name)
    except ValueError as err:  # named, not fatal: another file can still be picked
        st.warning(f"{err}; skipped. `python -m kitty_core.lm_eval --out FILE` writes such files.")
    else:
        st.caption(f"{settings.get('model')} on {settings.get('device')}, "
                   f"{str(settings.get('dtype')).removeprefix('torch.')}, {settings.get('samples')} samples a "
                   f"cell, lm-eval {settings.get('lm_eval')}, {settings.get('minutes')} minutes in all.")
        suite = table[table.kind.notna()].copy()
        if not suite.empty:
            suite = suite.sort_values("length", kind="stable")
            suite["length"] = suite["length"].map(lambda n: f"{int(n):,}")
            suite["kind"] = suite["kind"].map(lambda k: TITLES.get(k, k))
            fig = px.line(suite, x="length", y="score", color="method", facet_col="kind", facet_col_wrap=3,
                          markers=True, range_y=(-0.03, 1.03), hover_data={"diff": ":+.2f", "samples": True},
                          labels={"length": "prompt length (tokens)", "score": "score", "diff": "against FP16"},
                          category_orders={"kind": list(TITLES.values())},
                          title="Score per task and prompt length")
            fig.update_xaxes(type="category")
            fig.update_yaxes(tickformat=".0%")
            fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
            st.plotly_chart(fig, width="stretch")
        scores = summary(table)
        st.dataframe(scores, column_config={c: st.column_config.NumberColumn(c, format="%+.2f" if c.endswith(" - fp16")
                                                                             else "%.2f") for c in scores.columns})
        st.download_button("Download (CSV)", table.to_csv(index=False), name.replace(".json", ".csv"), "text/csv",
                           key="lm-eval-csv")
else:
    st.info("No saved lm-eval runs in data/results. `python -m kitty_core.lm_eval --out FILE` writes them.")
