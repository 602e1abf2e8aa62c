"""Memory & throughput: the largest batch each cache fits and how fast it generates (the paper's
Figure 5), from saved GPU runs or live on the loaded model."""

import pandas as pd
import plotly.express as px
import streamlit as st

from kitty_app import DATA, Progress, gpu_turn, sidebar
from kitty_core import PRESETS
from kitty_core.baselines import BASELINES
from kitty_core.results import ResultFileError, e2e_table, read_e2e, read_kernels, read_kernels_cuda, real_table
from kitty_core.throughput import sweep

frame = sidebar()
st.title("Memory & throughput")
st.markdown(
    "Per cache: batch sizes double until memory runs out, then a bisection finds the largest batch to "
    "within 10%; at that batch (and at one equal batch for all) decode steps are timed at several cache "
    "lengths and integrated over the generation, and a preset's steps that pack pages (one every G) add "
    "what one costs beyond a plain step. `python -m kitty_core.bench e2e` runs the same sweep."
)


def ratio_columns(columns) -> dict:
    """Column titles for e2e_table's ratio columns (`batch_vs_fp16-prealloc`, ...)."""
    config = {}
    for c in columns:
        for prefix, words in (("batch_vs_", "largest batch vs "), ("tput_vs_", "tokens/s vs "),
                              ("equal_batch_vs_", "tokens/s at the equal batch vs ")):
            if c.startswith(prefix):
                config[c] = st.column_config.NumberColumn(words + c.removeprefix(prefix), format="%.2fx")
                break
    return config


E2E_COLUMNS = {
    "cache": st.column_config.TextColumn("cache"),
    "max_batch": st.column_config.NumberColumn("largest batch", format="%d"),
    "peak_GiB": st.column_config.NumberColumn("peak memory (GiB)", format="%.2f"),
    "kv_bytes_per_token": st.column_config.NumberColumn("KV bytes / token (all layers)", format="%.0f"),
    "tokens_per_s_max_batch": st.column_config.NumberColumn("tokens/s at its largest batch", format="%.1f"),
    "packing_ms_max_batch": st.column_config.NumberColumn("a packing step's extra (ms)", format="%.2f"),
    "measured_at_batch": st.column_config.NumberColumn("timed at batch", format="%d"),
    "equal_batch": st.column_config.NumberColumn("equal batch", format="%d"),
    "tokens_per_s_equal_batch": st.column_config.NumberColumn("tokens/s at the equal batch", format="%.1f"),
}


def charts(points: pd.DataFrame, key: str, on_cpu: bool = False) -> None:
    table = e2e_table(points)
    if table.empty:
        st.info("No completed points yet.")
        return
    cols = st.columns(2)
    fig = px.bar(table, x="cache", y="max_batch", text="max_batch", title="Largest batch that fits",
                 labels={"max_batch": "sequences in the batch", "cache": ""})
    cols[0].plotly_chart(fig, width="stretch", key=f"{key}-batch")
    # each bar says the batch it was timed at: the equal batch falls back to the max where it was not timed
    long = pd.concat([
        table.assign(at="at its largest batch", batch=table["measured_at_batch"], rate=table["tokens_per_s_max_batch"]),
        table.assign(at="at one batch for all", batch=table["equal_batch"], rate=table["tokens_per_s_equal_batch"]),
    ])
    long["label"] = [f"batch {int(b)}" + (" (over its budget)" if b > m else "") if pd.notna(b) else ""
                     for b, m in zip(long["batch"], long["max_batch"])]
    fig = px.bar(long, x="cache", y="rate", color="at", barmode="group", text="label",
                 labels={"rate": "tokens/s (generated, all sequences)", "cache": "", "at": ""},
                 title="Generation throughput" + (" on this CPU (not the method's claim)" if on_cpu else ""))
    cols[1].plotly_chart(fig, width="stretch", key=f"{key}-tput")
    if on_cpu:
        st.caption("Throughput on a CPU measures the reference engine (PyTorch operators, a dense working view), "
                   "not the method: the claim is the GPU's, where the fused kernel reads the packed pages. See the "
                   "saved GPU runs in the file list above.")
    st.dataframe(table, hide_index=True, column_config={**E2E_COLUMNS, **ratio_columns(table.columns)})
    st.download_button("Download (CSV)", table.to_csv(index=False), f"{key}.csv", "text/csv", key=f"{key}-csv")


def read_saved(path, reader, kind: str):
    """A saved result file through its reader; None where there is none, or where it cannot be read
    (then a warning names it and says why)."""
    if not path.exists():
        return None
    try:
        return reader(path)
    except ResultFileError as err:
        st.warning(f"{err}: not {kind}; skipped.")
        return None


def one_boost_rate(rows: pd.DataFrame, key: str, where=st) -> pd.DataFrame:
    """The rows of the boost rate picked on a radio (the highest at first), with a "batch x length" shape."""
    rows = rows.assign(shape=rows["batch"].astype(str) + " x " + rows["length"].astype(str))
    boosts = sorted(rows["boost_rate"].unique())
    boost = where.radio("Boost rate", boosts, index=len(boosts) - 1, format_func=lambda b: f"{b:.1%}",
                        horizontal=True, key=key)
    return rows[rows["boost_rate"] == boost]


st.subheader("Saved runs")
runs = {}
for path in sorted((DATA / "results").glob("e2e_*.json")):
    try:
        runs[path] = read_e2e(path)
    except ResultFileError as err:  # a file this page cannot read is named, not fatal
        st.warning(f"{err}: not an e2e result file as `bench e2e --out` writes them; skipped.")
saved = list(runs)
if saved:
    # first shown: the fullest comparison on a GPU (graph-decoded, the most caches)
    fullest = max(saved, key=lambda p: (runs[p]["settings"].get("decode") == "graph",
                                        str(runs[p]["settings"].get("device", "")).startswith("cuda"),
                                        len(runs[p]["settings"]["caches"])))
    pick = st.selectbox("Result file", saved, format_func=lambda p: p.name, index=saved.index(fullest))
    run = runs[pick]
    s = run["settings"]
    st.caption(f"{s['model']} on {s.get('gpu') or s.get('device', '?')} ({s.get('dtype', '?')}, torch "
               f"{s.get('torch', '?')}, transformers {s.get('transformers', '?')}), prompt {s['prompt']} + "
               f"{s['generate']} generated tokens"
               + (f", cache budget {s['budget_gib']} GiB" if s.get("budget_gib") else ", until out of memory")
               + (f", allocator `{s['alloc_conf']}`" if s.get("alloc_conf") else "")
               + (f", decode steps timed {s['steps']} at a time at {s['points']} lengths" if s.get("steps") else "")
               + (". Decode steps of this library's caches replayed from CUDA graphs (transformers' caches eager)"
                  if s.get("decode") == "graph" else ". Eager decode steps"))
    for part in s.get("runs", []):  # a file merged from several commands says which measured what
        measured = ", ".join(part["caches"]) or "real generations only (--validate)"
        st.caption(f"`{part['command']}`: {measured}" + (f" ({part['note']})" if part.get("note") else ""))
    charts(pd.DataFrame(run["points"]), "saved", on_cpu=str(s.get("device", "")).startswith("cpu"))
    for skip in run.get("skipped", []):
        st.caption(f"{skip['cache']}: not measured ({skip['reason']})")
    real = real_table(run.get("validation", []), pd.DataFrame(run["points"]))
    if not real.empty:
        st.markdown("**Real generations** (`--validate`): the whole prompt and every generated token, timed, "
                    "against the estimate integrated from timed steps")
        bars = real.assign(run=[f"{c}, batch {b}, {g} tokens" for c, b, g in zip(real["cache"], real["batch"],
                                                                               real["generate"])])
        bars = pd.concat([bars.assign(timing="measured", rate=bars["tokens_per_s"]),
                          bars.assign(timing="estimated", rate=bars["batch"] * bars["generate"] / bars["estimated_s"])])
        fig = px.bar(bars, x="run", y="rate", color="timing", barmode="group", labels={"rate": "tokens/s", "run": ""},
                     title="Real generations against their estimates")
        st.plotly_chart(fig, width="stretch", key="saved-real")
        st.dataframe(real, hide_index=True, column_config={
            "batch": st.column_config.NumberColumn("batch", format="%d"),
            "at_max_batch": st.column_config.CheckboxColumn("at its largest batch"),
            "prompt": st.column_config.NumberColumn("prompt tokens", format="%d"),
            "generate": st.column_config.NumberColumn("generated tokens", format="%d"),
            "prefill_chunk": st.column_config.NumberColumn("prefill chunk (tokens)", format="%d"),
            "measured_s": st.column_config.NumberColumn("measured (s)", format="%.1f"),
            "tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.0f"),
            "estimated_s": st.column_config.NumberColumn("estimated (s)", format="%.1f"),
            "estimate_error": st.column_config.NumberColumn("estimate's error", format="percent"),
            "sm_clock_mhz": st.column_config.NumberColumn("SM clock (MHz)", format="%.0f"),
            "power_w": st.column_config.NumberColumn("power (W)", format="%.0f"),
            **{c: st.column_config.NumberColumn(f"tokens/s vs {c.removeprefix('tput_vs_')} at its largest batch",
                                                format="%.2fx") for c in real if c.startswith("tput_vs_")},
        })
        for r in real.to_dict("records"):
            ratios = [f"{x:.2f}x {c.removeprefix('tput_vs_')}'s at its max batch" for c, x in r.items()
                      if c.startswith("tput_vs_") and pd.notna(x) and c != f"tput_vs_{r['cache']}"]
            st.caption(f"{r['cache']}, batch {r['batch']}{' (its max)' if r['at_max_batch'] else ''}: a real "
                       f"generation of {r['generate']} tokens took {r['measured_s']:.1f} s, "
                       f"{r['tokens_per_s']:,.0f} tokens/s" + (f", {', '.join(ratios)}" if ratios else "")
                       + f"; the estimate {r['estimated_s']:.1f} s ({r['estimate_error']:+.1%})"
                       + (f"; SM clock {r['sm_clock_mhz']:,.0f} MHz at {r['power_w']:.0f} W on average"
                          if pd.notna(r.get("sm_clock_mhz")) else "") + ".")
else:
    st.info("No saved runs in data/results (e2e_*.json).")

kernels = read_saved(DATA / "results" / "kernels_h200.json", read_kernels,
                     "a kernel result file as `bench kernels --out x.json` writes them")
if kernels is not None:
    st.subheader("Decode attention on packed pages")
    k_settings, rows = kernels
    cols = st.columns(2)
    pick = one_boost_rate(rows, "kernel_boost", cols[0])
    if "key_dots" in rows and rows["key_dots"].nunique() > 1:  # a run that timed both (`--key-dots fp16,int8`)
        dots = sorted(rows["key_dots"].unique())
        chosen = cols[1].radio("Page kernel's key dots", dots, index=dots.index("int8") if "int8" in dots else 0,
                               horizontal=True, key="kernel_dots",
                               help="int8: the query rounded to 8 bits per page and head, the default from "
                                    "head size 128; fp16: the codes as fp16 operands")
        pick = pick[pick["key_dots"] == chosen]
    long = pick.melt(id_vars="shape", value_vars=["fused_ms", "unfused_ms", "sdpa_fp16_ms"], var_name="attention",
                     value_name="ms")
    long["attention"] = long["attention"].map({"fused_ms": "fused (packed pages)", "unfused_ms": "unfused qk/sv",
                                               "sdpa_fp16_ms": "SDPA on FP16"})
    fig = px.bar(long, x="shape", y="ms", color="attention", barmode="group",
                 labels={"shape": "batch x cache length (tokens)", "ms": "GPU time per call (ms)", "attention": ""},
                 title=f"Decode attention on {k_settings['device']}: GPU time per call (Qwen3-8B heads)")
    st.plotly_chart(fig, width="stretch", key="kernels")
    shown = ["shape", "key_dots", "fused_ms", "unfused_ms", "sdpa_fp16_ms", "fused_vs_sdpa", "fused_vs_unfused",
             "fused_TBps", "sdpa_TBps", "copy_TBps", "fused_max_abs_err"]
    st.dataframe(pick[[c for c in shown if c in pick]], hide_index=True, column_config={
        "shape": st.column_config.TextColumn("batch x tokens"),
        "key_dots": st.column_config.TextColumn("key dots"),
        "fused_ms": st.column_config.NumberColumn("fused (ms)", format="%.3f"),
        "unfused_ms": st.column_config.NumberColumn("unfused (ms)", format="%.3f"),
        "sdpa_fp16_ms": st.column_config.NumberColumn("SDPA on FP16 (ms)", format="%.3f"),
        "fused_vs_sdpa": st.column_config.NumberColumn("fused speed-up over SDPA", format="%.2fx"),
        "fused_vs_unfused": st.column_config.NumberColumn("fused speed-up over unfused", format="%.2fx"),
        "fused_TBps": st.column_config.NumberColumn("fused (TB/s)", format="%.2f"),
        "sdpa_TBps": st.column_config.NumberColumn("SDPA (TB/s)", format="%.2f"),
        "copy_TBps": st.column_config.NumberColumn("copy (TB/s)", format="%.2f"),
        "fused_max_abs_err": st.column_config.NumberColumn("fused's largest error", format="%.1e"),
    })
    steps = int(pick["steps_a_graph"].iloc[0]) if "steps_a_graph" in pick and len(pick) else 1
    timing = "one replay of its own a call" if steps == 1 else f"{steps} calls in a row a graph, divided among them"
    st.caption(f"`python -m kitty_core.bench kernels` on one GPU: CUDA-graph replays ({timing}), the same process "
               "for all three. TB/s: the bytes each one reads per second; copy: a device-to-device copy in the same "
               "run.")

cuda = read_saved(DATA / "results" / "kernels_cuda_h200_in_stream.csv", read_kernels_cuda,
                  "a table as `bench kernels --cuda --out x.csv` writes them")
if cuda is not None:
    st.subheader("The page kernel a default cache decodes with")
    st.markdown(
        "Where it applies (head and page size 128, nvcc on the machine) a cache's decode steps read the packed "
        "pages with a CUDA C++ kernel, elsewhere with the Triton one; both run beside the same FP16 tail kernel "
        "(sink, key q-buffer, value window). One layer's whole step with each, against cuDNN's attention over "
        "an FP16 cache of the same shape."
    )
    pick = one_boost_rate(cuda, "cuda_boost")
    names = {"cuda_ms": "CUDA page kernel (the default)", "triton_ms": "Triton page kernel",
             "cudnn_ms": "cuDNN on FP16"}
    long = pick.melt(id_vars="shape", value_vars=list(names), var_name="attention", value_name="ms")
    long["attention"] = long["attention"].map(names)
    device = pick["device"].iloc[0] if "device" in pick else "one GPU"
    fig = px.bar(long, x="shape", y="ms", color="attention", barmode="group",
                 labels={"shape": "batch x cache length (tokens)", "ms": "GPU time per step (ms)", "attention": ""},
                 title=f"One layer's decode step on {device}, by page kernel (Qwen3-8B heads)")
    st.plotly_chart(fig, width="stretch", key="cuda_kernels")
    shown = ["shape", "cuda_vs_cudnn", "triton_vs_cudnn", "cuda_vs_triton", "tail_time_share", "fp16_byte_share",
             "cuda_max_abs_err"]
    st.dataframe(pick[[c for c in shown if c in pick]], hide_index=True, column_config={
        "shape": st.column_config.TextColumn("batch x tokens"),
        "cuda_vs_cudnn": st.column_config.NumberColumn("CUDA speed-up over cuDNN", format="%.2fx"),
        "triton_vs_cudnn": st.column_config.NumberColumn("Triton speed-up over cuDNN", format="%.2fx"),
        "cuda_vs_triton": st.column_config.NumberColumn("CUDA over Triton", format="%.2fx"),
        "tail_time_share": st.column_config.NumberColumn("FP16 tail kernel alone / step", format="percent"),
        "fp16_byte_share": st.column_config.NumberColumn("FP16 parts' share of the bytes", format="percent"),
        "cuda_max_abs_err": st.column_config.NumberColumn("CUDA's largest error", format="%.1e"),
    })
    st.caption("`python -m kitty_core.bench kernels --cuda --out x.csv` on one GPU: each step ten times in a row in "
               "one CUDA graph (the GPU's wait for a replay's launch spread over ten calls), interleaved rounds, "
               "all three in one process. The tail kernel timed alone, as a share of the step, beside the FP16 "
               "parts' share of the bytes the step reads: where the two are close, the tail costs what its bytes "
               "do; where it takes far more, it is latency (few programs), partly hidden beside the pages.")

st.subheader("Live sweep on the loaded model")
on_gpu = frame.lm.device.type == "cuda"
if not on_gpu:
    st.caption("No GPU: the sweep runs on the CPU with the reference engine, against a cache memory budget "
               "instead of the GPU's memory. The budget counts what a GPU run holds, the tensors of the cache "
               "itself (FP16 sink, buffers and window, packed pages, page tables); the reference engine also keeps "
               "a dense FP16 working view of the history for its attention, which the Triton engine on a GPU does "
               "not have: it is left out of the budget and reported apart (`working_view_bytes`). The FP16 parts "
               "of a Kitty cache are a fixed few hundred tokens per sequence, so its pages pay off on long "
               "sequences: the CPU default is 1,024 tokens.")
options = list(BASELINES) + list(PRESETS)
with st.form("sweep"):
    cols = st.columns(5)
    default = list(dict.fromkeys(["fp16-prealloc", "kivi-k2v2", frame.method.split("+")[0]]))
    caches = cols[0].multiselect("Caches", options, default=default)
    first = 512 if on_gpu else 64
    prompt = int(cols[1].number_input("Prompt tokens", 1, 1 << 20, first, 64))
    # on a GPU, 8,192 new tokens where the model's context holds them (the demo model's 8,192 hold 7,680)
    room = max(64, (frame.lm.shape["context"] or 1 << 20) - first)
    generate = int(cols[2].number_input("Generated tokens", 1, 1 << 20, min(8192, room) if on_gpu else 960, 64))
    budget = cols[3].number_input("Cache budget (GiB, 0 = until out of memory)", 0.0, 4096.0,
                                  0.0 if on_gpu else 0.1, 0.01, format="%.2f")
    equal = int(cols[4].number_input("Equal batch for all", 1, 1 << 14, 64 if on_gpu else 2))
    go = st.form_submit_button("Run sweep", type="primary")

if go:
    limit = frame.lm.shape["context"]
    if limit and prompt + generate > limit:
        st.error(f"Prompt + generated tokens ({prompt + generate}) exceed this model's context of {limit}.")
        st.stop()
    if not caches:
        st.error("Pick at least one cache.")
        st.stop()
    st.session_state.sweep_run = {"probes": [], "points": [], "skipped": [], "done": False, "on_cpu": not on_gpu}
    state = st.session_state.sweep_run
    st.button("Stop", help="Stops the sweep after the current step; the points so far stay.")
    # three stages a cache: the max-batch search, its timing at the max batch, at the equal batch
    stages, done = 3 * len(caches), 0
    bar = Progress("Sweep stages done")
    status = st.status("Sweeping ...", expanded=True)
    live = st.empty()
    with gpu_turn("The sweep") as gpu:
        try:
            # on a GPU, this library's caches decode from CUDA graphs, as `bench e2e` does by default
            for what, row in gpu.iterate(sweep, frame.lm.model, caches, prompt, generate, equal,
                                         int(budget * 2**30) if budget else None, points=3, start=1,
                                         decode="compiled"):
                state[{"probe": "probes", "point": "points", "skip": "skipped"}[what]].append(row)
                if what == "probe":
                    status.write(f"{row['cache']} at batch {row['batch']}: "
                                 + ("fits" if row["fits"] else row.get("reason", "does not fit")))
                    bar(done, stages, f"{row['cache']}: batch {row['batch']} probed")
                elif what == "skip":
                    status.write(f"{row['cache']}: skipped ({row['reason']})")
                    done += 3
                    bar(done, stages, f"{row['cache']} skipped")
                else:
                    status.write(f"{row['cache']}: {row.get('tokens_per_s', 0):.1f} tokens/s at batch {row['batch']}")
                    if row["at"] == "max batch":
                        done += 1  # its search ended
                    # a cache whose max batch is the equal batch is timed once
                    done += 1 if row["at"] == "equal batch" or row["max_batch"] != equal else 2
                    bar(done, stages, f"{row['cache']} timed at batch {row['batch']}")
                    with live.container():
                        charts(pd.DataFrame(state["points"]), f"live{len(state['points'])}", on_cpu=not on_gpu)
        except ValueError as err:
            st.error(str(err))
    bar.clear()
    state["done"] = True
    status.update(label="Sweep done", state="complete", expanded=False)
elif "sweep_run" in st.session_state:
    state = st.session_state.sweep_run
    if not state["done"]:
        st.warning("The last sweep was stopped; these are the points it finished.")
    charts(pd.DataFrame(state["points"]), "live", on_cpu=state.get("on_cpu", False))
    for skip in state["skipped"]:
        st.caption(f"{skip['cache']}: not measured ({skip['reason']})")
