"""The lab, headless (Streamlit's AppTest) on the demo model on CPU: every page renders real data."""

import base64
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pages").glob("*.py"))


def run(page: str) -> AppTest:
    at = AppTest.from_file(str(ROOT / page), default_timeout=1800)
    at.run()
    assert not at.exception, at.exception
    return at


def chart(at: AppTest, i: int = 0) -> dict:
    return json.loads(at.get("plotly_chart")[i].proto.spec)


def numbers(field) -> list:
    """A trace's numeric array as a list: plotly writes numbers as {"dtype", "bdata": base64}."""
    if isinstance(field, dict) and "bdata" in field:
        return np.frombuffer(base64.b64decode(field["bdata"]), dtype=field["dtype"]).tolist()
    return list(field)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_with_the_shared_sidebar(page):
    at = run(page)
    assert at.sidebar.text_input[0].value == "demo"
    assert any("30 layers" in c.value for c in at.sidebar.caption)
    spec = chart(at)
    assert any(len(trace.get("x", []) or trace.get("z", [])) for trace in spec["data"])


def test_overview_memory_table_and_layout():
    at = run("app.py")
    table = at.dataframe[0].value.set_index("method")
    assert len(table) == 8 and table.loc["kitty", "vs_fp16"] > table.loc["kitty-pro", "vs_fp16"] > 4
    # 80 GiB hold millions of tokens; the longest sequence is the model's context of 8,192
    assert (table["max_context"] == 8192).all() and (table["max_context_budget"] > 8192).all()
    # D=64, 16 boosted: planes 16 + 4 + 16, scales 2 + 4, boost index 16/128 -> 42.125 bytes against 4D
    assert table.loc["kitty-pro", "vs_fp16"] == pytest.approx(256 / 42.125)
    layout = chart(at)
    assert {t["name"] for t in layout["data"]} >= {"sink (FP16)", "pages"}


def test_boost_dial_changes_the_method():
    at = run("pages/1_Key_statistics.py")
    at.sidebar.slider[0].set_value(0.5).run()
    assert not at.exception
    assert "kitty-pro+boost_rate=0.5" in json.dumps(chart(at, 1)["layout"]["title"])


def test_the_tail_choice_changes_the_method():
    """The 8-bit tail reaches every page through the method: the Overview's table gets a row for it,
    whose pages cost what kitty-pro's do and whose smaller tail fits more sequences, and its layout
    draws an int8 sink."""
    at = run("app.py")
    at.sidebar.radio(key="sb_tail").set_value("8-bit").run()
    assert not at.exception
    table = at.dataframe[0].value.set_index("method")
    assert table.loc["kitty-pro+tail_bits=8", "bytes_per_token"] == table.loc["kitty-pro", "bytes_per_token"]
    assert table.loc["kitty-pro+tail_bits=8", "max_batch"] > table.loc["kitty-pro", "max_batch"]
    assert {t["name"] for t in chart(at)["data"]} >= {"sink (INT8)", "pages"}
    at.sidebar.selectbox(key="sb_method").set_value("fp16").run()
    assert at.sidebar.radio(key="sb_tail").disabled and "fp16" in set(at.dataframe[0].value["method"])


def test_bad_inputs_show_errors_not_exceptions():
    at = run("app.py")
    at.sidebar.text_input[0].set_value("/nowhere/model").run()
    assert not at.exception and "looks like a path" in at.error[0].value
    at = run("pages/1_Key_statistics.py")
    at.sidebar.radio(key="sb_source").set_value("My text").run()
    assert not at.exception and "empty" in at.warning[0].value


def test_generations_page_opens_on_a_saved_long_context_run():
    from kitty_core.generate import read_generations

    at = run("pages/4_Generations.py")
    settings, texts, kl = read_generations(ROOT / "data/results/generations_demo_cpu.json")
    assert settings["tokens"] >= 2000 and any("saved run" in c.value for c in at.caption)
    # each method's text with its departure, and pages packed meanwhile: most of the context is in them
    for r in texts[texts.method != "fp16"].itertuples():
        assert any(f"departs from FP16 after {int(r.first_divergence)} tokens" in c.value for c in at.caption)
        assert r.keys_in_2bit_pages > 0.9 and r.values_in_2bit_pages > 0.9
    summary = at.dataframe[0].value.set_index("method")
    assert list(summary.index) == settings["methods"]
    assert summary["mean_kl"].to_dict() == pytest.approx(kl.groupby("method")["kl"].mean().to_dict())
    lines = chart(at)
    assert {t["name"] for t in lines["data"]} == set(settings["methods"])
    assert all(len(numbers(t["y"])) == len(kl) // len(settings["methods"]) for t in lines["data"])
    assert "generated token" in json.dumps(lines["layout"]["xaxis"]["title"])


def test_generations_page_runs_a_short_prompt_and_rejects_bad_ones():
    at = run("pages/4_Generations.py")
    at.radio(key="prompt_kind").set_value("Short prompt").run()
    at.number_input[0].set_value(6).run()
    at.button[0].click().run()
    assert not at.exception, at.exception
    assert any("run here" in c.value for c in at.caption)
    assert {t["name"] for t in chart(at)["data"]} == {"kivi-k2v2", "kitty-pro"}
    at.text_area[0].set_value("   ").run()
    assert not at.exception and "empty" in at.error[0].value
    at = run("pages/4_Generations.py")
    at.sidebar.radio(key="sb_source").set_value("My text").run()
    at.sidebar.text_area[0].set_value("In the beginning.").run()
    assert not at.exception and "were asked for" in at.error[0].value


def test_boost_rate_page_draws_a_curve_per_rule_from_0_to_1():
    at = run("pages/3_Boost_rate.py")
    assert at.selectbox[0].value == "rules_demo_cpu.json"
    spec = chart(at)
    curves = {t["name"]: t for t in spec["data"] if t.get("mode") == "lines+markers"}
    assert set(curves) == {"magnitude", "qk", "range", "random"}
    for trace in curves.values():
        x = numbers(trace["x"])
        assert len(x) >= 6 and min(x) == 0 and max(x) == 1 and x == sorted(x)
    kl = numbers(curves["magnitude"]["y"])
    assert kl[0] > 3 * kl[-1]  # boosting key channels brings the cache toward FP16
    assert spec["layout"]["xaxis"]["range"] == [-0.04, 1.04] and spec["layout"]["xaxis"]["tickformat"] == ".0%"
    assert "presets" in {t.get("name") for t in spec["data"]}


def test_boost_rate_page_draws_accuracy_against_memory():
    at = run("pages/3_Boost_rate.py")
    cost = chart(at, 1)
    assert "against memory" in json.dumps(cost["layout"]["title"])
    front = next(t for t in cost["data"] if t["name"] == "best at each budget")
    bits, kl = numbers(front["x"]), numbers(front["y"])
    assert bits == sorted(bits) and kl == sorted(kl, reverse=True)  # more memory buys less error
    points = [t for t in cost["data"] if t["name"] != "best at each budget"]
    best = {}
    for t in points:
        for b, k in zip(numbers(t["x"]), numbers(t["y"])):
            best[b] = min(best.get(b, k), k)
    # every point on or above the line: the line is the least KL at or below each budget
    for b, k in best.items():
        assert k >= min(kk for bb, kk in zip(bits, kl) if bb <= b + 1e-9) - 1e-12
    assert {"qk", "magnitude", "presets"} <= {t["name"] for t in points}
    # a calibrated allocation's points are their own series, not a zigzag on the uniform rule's curve
    at.selectbox[0].set_value("accuracy_demo_h200_allocation.json").run()
    assert not at.exception
    names = {t["name"] for t in chart(at, 1)["data"]}
    assert {"qk + allocation", "magnitude + allocation"} <= names
    assert "kitty-pro+selection=qk+allocation=" in " ".join(c.value for c in at.caption)


def test_boost_rate_live_sweep_needs_a_rule():
    at = run("pages/3_Boost_rate.py")
    at.radio(key="results_source").set_value("run on the loaded model").run()
    at.multiselect[0].set_value([]).run()  # no rule
    at.button[0].click().run()
    assert not at.exception and "at least one rule" in at.error[0].value


def test_memory_page_charts_saved_runs_and_sweeps_live():
    at = run("pages/5_Memory_and_throughput.py")
    saved = chart(at)
    assert saved["data"][0]["x"]  # max batch per cache of a saved run
    assert not at.json  # nothing written by Streamlit's magic (a bare expression in the page's script)
    # shown first: the fullest graph-decoded GPU comparison; every other saved file renders its own caches
    assert at.selectbox[0].value.name == "e2e_qwen3-8b_h200_graph.json"
    for path in at.selectbox[0].options:
        other = run("pages/5_Memory_and_throughput.py")
        other.selectbox[0].set_value(ROOT / "data/results" / path).run()
        assert not other.exception, other.exception
        saved_run = json.loads((ROOT / "data/results" / path).read_text())
        measured = {r["cache"] for r in saved_run["points"] if r.get("tokens_per_s")}
        if measured:
            assert set(other.dataframe[0].value["cache"]) == measured
        else:  # a run of real generations only (--caches ''): no points, the generations' table
            assert any("No completed points" in i.value for i in other.info)
            assert set(other.dataframe[0].value["cache"]) == {c["cache"] for c in saved_run["validation"]}
    assert any("expandable_segments" in c.value for c in at.caption)  # the saved run's allocator setting
    # each real generation against its estimate, and a command that only ran those says so
    run_file = json.loads((ROOT / "data/results/e2e_qwen3-8b_h200_graph.json").read_text())
    for check in run_file["validation"]:
        assert any(f"{check['cache']}, batch {check['batch']}" in c.value and f"a real generation of "
                   f"{check['generate']} tokens took {check['measured_s']:.1f} s" in c.value for c in at.caption)
    real = next(d.value for d in at.dataframe if "estimate_error" in d.value)  # the real generations' table
    bars = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    bars = next(c for c in bars if "Real generations" in json.dumps(c["layout"]))
    measured = next(t for t in bars["data"] if t["name"] == "measured")
    assert numbers(measured["y"]) == pytest.approx([c["batch"] * c["generate"] / c["measured_s"]
                                                    for c in run_file["validation"]])
    assert list(real["measured_s"]) == pytest.approx([c["measured_s"] for c in run_file["validation"]])
    # a preset's real generation at its max batch against fp16-prealloc's of the same length at its own
    for check in run_file["validation"]:
        base = [c for c in run_file["validation"] if c["cache"] == "fp16-prealloc" and c["generate"] == check["generate"]
                and c["batch"] == next(p["max_batch"] for p in run_file["points"] if p["cache"] == "fp16-prealloc")]
        mine = next(p["max_batch"] for p in run_file["points"] if p["cache"] == check["cache"])
        if base and check["batch"] == mine and check["cache"] != "fp16-prealloc":
            ratio = (check["batch"] / check["measured_s"]) / (base[-1]["batch"] / base[-1]["measured_s"])
            assert any(f"{ratio:.2f}x fp16-prealloc's at its max batch" in c.value for c in at.caption)
    if any(not r["caches"] for r in run_file["settings"]["runs"]):
        assert any("real generations only (--validate)" in c.value for c in at.caption)
    kernels = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    kernels = [c for c in kernels if "Decode attention" in json.dumps(c["layout"])]
    assert kernels and {t["name"] for t in kernels[0]["data"]} == {"fused (packed pages)", "unfused qk/sv", "SDPA on FP16"}
    assert list(kernels[0]["data"][0]["x"]) == ["64 x 8192", "8 x 32768", "1 x 131072"]
    saved_kernels = pd.DataFrame(json.loads((ROOT / "data/results/kernels_h200.json").read_text())["results"])
    if saved_kernels["key_dots"].nunique() > 1:  # a run that timed both key dots: one shown at a time
        def fused(dots):
            rows = saved_kernels[(saved_kernels.key_dots == dots) & (saved_kernels.boost_rate == 0.25)]
            return pytest.approx(list(rows.fused_ms))

        assert at.radio(key="kernel_dots").value == "int8"
        assert numbers(kernels[0]["data"][0]["y"]) == fused("int8")
        at.radio(key="kernel_dots").set_value("fp16").run()
        fused_bars = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
        fused_bars = [c for c in fused_bars if "Decode attention" in json.dumps(c["layout"])][0]["data"][0]
        assert numbers(fused_bars["y"]) == fused("fp16")
    # the default page kernel's table: CUDA, Triton and cuDNN, one boost rate at a time (the highest first)
    saved_cuda = pd.read_csv(ROOT / "data/results/kernels_cuda_h200_in_stream.csv")
    assert at.radio(key="cuda_boost").value == saved_cuda.boost_rate.max()
    for boost in (0.25, 0.0):
        if at.radio(key="cuda_boost").value != boost:
            at.radio(key="cuda_boost").set_value(boost).run()
        steps = next(c for c in map(json.loads, (c.proto.spec for c in at.get("plotly_chart")))
                     if "by page kernel" in json.dumps(c["layout"]))
        rows = saved_cuda[saved_cuda.boost_rate == boost]
        assert {t["name"]: numbers(t["y"]) for t in steps["data"]} == {
            "CUDA page kernel (the default)": pytest.approx(list(rows.cuda_ms)),
            "Triton page kernel": pytest.approx(list(rows.triton_ms)),
            "cuDNN on FP16": pytest.approx(list(rows.cudnn_ms))}
    at.multiselect[0].set_value(["fp16-prealloc", "kitty-pro"])
    at.number_input[1].set_value(64)  # generated tokens: a short sweep
    at.number_input[2].set_value(0.03)  # GiB: a few sequences
    at.button[0].click().run()
    assert not at.exception, at.exception
    live = at.session_state["sweep_run"]
    assert live["done"] and {p["cache"] for p in live["points"]} == {"fp16-prealloc", "kitty-pro"}
    assert any(not p["fits"] for p in live["probes"])  # the budget ended every doubling
    # each throughput bar names the batch it was timed at
    tput = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    tput = [c for c in tput if "Generation throughput" in json.dumps(c["layout"])][-1]
    assert "not the method's claim" in json.dumps(tput["layout"]["title"])
    timed = {(p["cache"], p["at"]): p["batch"] for p in live["points"]}
    for trace in tput["data"]:
        at_what = "max batch" if "largest" in trace["name"] else "equal batch"
        for cache, text in zip(trace["x"], trace["text"]):
            assert text.startswith(f"batch {timed.get((cache, at_what), timed[(cache, 'max batch')])}")
    at.number_input[0].set_value(100_000)  # a prompt beyond the context
    at.button[0].click().run()
    assert not at.exception and "context" in at.error[0].value


def test_saved_cpu_sweep_gives_kitty_pro_the_larger_batch():
    """The saved CPU run the live sweep's defaults reproduce: on 1,024-token sequences the pages pay for
    the fixed FP16 parts, within the same budget."""
    run_file = json.loads((ROOT / "data/results/e2e_demo_cpu.json").read_text())
    s = run_file["settings"]
    assert s["device"] == "cpu" and s["prompt"] + s["generate"] >= 1024
    at = run("pages/5_Memory_and_throughput.py")
    at.selectbox[0].set_value(ROOT / "data/results/e2e_demo_cpu.json").run()
    table = at.dataframe[0].value.set_index("cache")
    assert table.loc["kitty-pro", "max_batch"] > table.loc["fp16-prealloc", "max_batch"]
    assert table.loc["kitty-pro", "kv_bytes_per_token"] < table.loc["fp16-prealloc", "kv_bytes_per_token"] / 2
    assert any("not the method" in c.value for c in at.caption)


def test_progress_reports_counts_and_time_left():
    def script():
        from kitty_app import Progress

        bar = Progress("Steps")
        bar(1, 4, "first")

    at = AppTest.from_function(script).run()
    text = at.get("progress")[0].proto.text
    assert "1 of 4 (first)" in text and "left" in text


def test_duration_reads_as_minutes_and_hours():
    from kitty_app import duration

    assert (duration(12.4), duration(185), duration(3725)) == ("12 s", "3 min 05 s", "1 h 02 min")


def test_memory_page_skips_unreadable_files_and_shows_a_validations_clock(tmp_path, monkeypatch):
    import kitty_app

    (tmp_path / "results").mkdir()
    saved = json.loads((ROOT / "data/results/e2e_qwen3-8b_h200_graph.json").read_text())
    saved["validation"][-1].update(sm_clock_mhz=1869.2, power_w=682.4)  # as `telemetry` records them on a GPU
    (tmp_path / "results/e2e_qwen3-8b_h200_graph.json").write_text(json.dumps(saved))
    (tmp_path / "results/e2e_cut_short.json").write_text('{"settings": {"caches": ')
    (tmp_path / "results/e2e_other.json").write_text('{"points": []}')
    monkeypatch.setattr(kitty_app, "DATA", tmp_path)
    at = run("pages/5_Memory_and_throughput.py")
    warned = " ".join(w.value for w in at.warning)
    assert "e2e_cut_short.json" in warned and "e2e_other.json" in warned
    assert at.selectbox[0].options == ["e2e_qwen3-8b_h200_graph.json"] and at.get("plotly_chart")
    assert sum("SM clock 1,869 MHz at 682 W" in c.value for c in at.caption) == 1


def test_generations_page_passkey_heatmap_saved_and_live():
    at = run("pages/4_Generations.py")
    heat = [c for c in at.get("plotly_chart") if "Passkey" in json.dumps(json.loads(c.proto.spec)["layout"])]
    assert heat, "the saved passkey heatmap is shown on first visit"
    at.text_input(key="pk_depths").set_value("0.5")
    at.text_input(key="pk_lengths").set_value("300")
    at.button[-1].click().run()
    assert not at.exception, at.exception
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    spec = next(s for s in specs if "Passkey" in json.dumps(s["layout"]))
    assert "run here" in json.dumps(spec["layout"]) and spec["data"][0]["z"]
    at.text_input(key="pk_lengths").set_value("30000")  # beyond the context
    at.button[-1].click().run()
    assert not at.exception and any("context" in e.value for e in at.error)


def test_generations_page_shows_the_saved_lm_eval_suite():
    from kitty_core.lm_eval import read_table

    at = run("pages/4_Generations.py")
    settings, table = read_table(ROOT / "data/results/lm_eval_demo_h200.json")
    spec = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                if "Score per task" in json.dumps(json.loads(c.proto.spec)["layout"]))
    # one line per method in each of the six kinds' panels, a point per tested length, named in words
    assert {t["name"] for t in spec["data"]} == set(settings["methods"])
    assert len(spec["data"]) == 6 * len(settings["methods"])
    assert all(t["x"] == ["1,024", "2,048", "4,096", "7,680"] for t in spec["data"])
    panels = {a["text"] for a in spec["layout"]["annotations"]}
    assert {"needle: one key", "variable tracking", "passkey"} <= panels
    qk = next(t for t in spec["data"]
              if t["name"] == "kitty-pro+selection=qk" and "needle: one key" in t["hovertemplate"])
    assert numbers(qk["y"]) == table[(table.method == "kitty-pro+selection=qk") & (table.kind == "niah_single")
                                     ].sort_values("length").score.tolist()
    scores = next(d.value for d in at.dataframe if "kitty-pro - fp16" in d.value.columns)
    assert scores.loc["kitty_niah_single_4096", "fp16"] == 1.0


def test_pages_skip_malformed_result_files(tmp_path, monkeypatch):
    """A result file without what its page reads is named in a warning and skipped; the page runs on."""
    import kitty_app

    res = tmp_path / "results"
    res.mkdir()
    no_model = json.loads((ROOT / "data/results/e2e_qwen3-8b_h200_graph.json").read_text())
    del no_model["settings"]["model"]
    (res / "e2e_no_model.json").write_text(json.dumps(no_model))
    (res / "kernels_h200.json").write_text('{"settings": {"device": "H200"}, "results": [{"batch": 1')
    (res / "kernels_cuda_h200_in_stream.csv").write_text("batch,length\n64,8192\n")
    (res / "accuracy_broken.json").write_text('{"results": [{"method": "kitty-pro"}]}')
    (res / "passkey_demo_cpu.csv").write_text('method,length\n"unterminated')
    (res / "generations_demo_cpu.json").write_text('{"settings": {}, "texts": [{"method": "fp16"}], "kl": []}')
    (res / "lm_eval_cut_short.json").write_text('{"settings": {"model": "demo"}, "results": [')
    monkeypatch.setattr(kitty_app, "DATA", tmp_path)
    warned = lambda at: " ".join(w.value for w in at.warning)  # noqa: E731
    memory = run("pages/5_Memory_and_throughput.py")
    assert "e2e_no_model.json has no model in settings" in warned(memory)
    assert "kernels_h200.json cannot be read as JSON" in warned(memory)
    assert "kernels_cuda_h200_in_stream.csv lacks the columns boost_rate, cuda_ms, triton_ms, cudnn_ms" in warned(memory)
    boost = run("pages/3_Boost_rate.py")
    assert "accuracy_broken.json: its results lack the columns kl, perplexity, top1, bits_per_element" in warned(boost)
    generations = run("pages/4_Generations.py")
    assert "passkey_demo_cpu.csv" in warned(generations)
    assert "generations_demo_cpu.json: its texts lack text, tokens, first_divergence" in warned(generations)
    assert "lm_eval_cut_short.json cannot be read as JSON" in warned(generations)
