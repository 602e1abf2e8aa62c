"""The end-to-end estimate's arithmetic: where decode steps are timed, and how they are integrated."""

import pytest

from kitty_core.config import parse_method
from kitty_core.throughput import integrate, timed_lengths


@pytest.mark.parametrize("kind", ["kivi-k2v2", "kitty", "kitty-pro", "kitty+sink=5"])
def test_presets_are_timed_mid_page(kind):
    c = parse_method(kind)
    for room in (0, 5):
        lengths = timed_lengths(kind, 512, 8192, 3, room)
        assert [(n - c.sink) % c.group_size for n in lengths] == [c.group_size // 2] * 3
        spread = [512, 512 + (8192 - room) // 2, 512 + 8192 - room]
        assert all(abs(n - m) < c.group_size for n, m in zip(lengths, spread))
        assert 512 <= min(lengths) and max(lengths) <= 512 + 8192 - room  # never past what the probe held


def test_baselines_are_timed_where_asked():
    assert timed_lengths("fp16-prealloc", 512, 8192, 3) == [512, 4608, 8704]
    # the steps after the last point must fit: the window before
    assert timed_lengths("fp16-prealloc", 512, 8192, 3, room=5) == [512, 4608, 8448]
    assert timed_lengths("dynamic", 100, 10, 2) == [100, 110]
    assert timed_lengths("dynamic", 100, 10, 2, room=5) == [100, 105]
    assert timed_lengths("kitty-pro", 100, 10, 2, room=5) == [100, 105]  # no page middle in range: as spread


def test_integral_holds_the_ends_and_stays_in_range():
    # a constant step time integrates to time x tokens, wherever the points lie
    assert integrate([100, 600, 1200], [2.0, 2.0, 2.0], 0, 1000) == pytest.approx(2000.0)
    # linear from 1 ms at 0 tokens to 3 ms at 1000: the mean is 2 ms
    assert integrate([0, 1000], [1.0, 3.0], 0, 1000) == pytest.approx(2000.0)
    # a point past the end is interpolated at the end, not integrated beyond it
    assert integrate([0, 2000], [1.0, 3.0], 0, 1000) == pytest.approx(1000 * (1.0 + 2.0) / 2)


def test_fp16_baseline_decodes_as_transformers_does():
    """fp16-prealloc (its own SDPA backends) gives the logits of a DynamicCache, step after step."""
    import torch
    from transformers import DynamicCache

    from conftest import tiny_model
    from kitty_core.baselines import forward, make_cache

    model = tiny_model("qwen3")
    ids = torch.randint(3, 256, (2, 12))
    ours, theirs = make_cache("fp16-prealloc", model, 16), DynamicCache(config=model.config)
    with torch.inference_mode():
        for s in (slice(0, 9), slice(9, 10), slice(10, 11), slice(11, 12)):
            a = forward(model, ours, ids[:, s]).logits
            b = model(input_ids=ids[:, s], past_key_values=theirs, use_cache=True, logits_to_keep=1).logits
            torch.testing.assert_close(a, b)
    assert ours.get_seq_length() == 12


def test_sweep_prefills_in_smaller_chunks_before_it_backs_the_batch_off(monkeypatch):
    """Out of memory in a prefill at the max batch: smaller prefill chunks first, then 10% less batch,
    from the largest chunk again."""
    import torch

    from kitty_core import throughput

    def search(*args, **kwargs):
        yield {"cache": "kitty", "batch": 100, "fits": True}
        return 100, 200

    calls = []

    def measure(model, kind, batch, prompt, generate, points, steps, prefill_chunk, decode="eager"):
        calls.append((batch, prefill_chunk))
        if batch > 90 or batch * prefill_chunk > 90 * 128:  # 100 fits no chunk, 90 takes 128
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"cache": kind, "batch": batch, "prefill_chunk": prefill_chunk}

    monkeypatch.setattr(throughput, "search", search)
    monkeypatch.setattr(throughput, "measure", measure)
    points = [row for what, row in throughput.sweep(None, ["kitty"], 512, 64) if what == "point"]
    assert calls == [(100, 512), (100, 128), (100, 32), (90, 512), (90, 128)]
    assert points == [{"cache": "kitty", "batch": 90, "prefill_chunk": 128, "at": "max batch", "max_batch": 100}]


def test_measure_runs_the_model_without_autograd(monkeypatch):
    """A prefill that records activations for backward would need ~36x the memory at max batch."""
    import torch

    from conftest import tiny_model
    from kitty_core.throughput import measure

    model, grad = tiny_model("llama"), []
    call = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, *a, **k: grad.append(torch.is_grad_enabled()) or call(self, *a, **k))
    row = measure(model, "fp16-prealloc", 2, 16, 16, points=2)
    assert row["prefill_chunk"] == 512 and len(grad) >= 5 and not any(grad)


@pytest.mark.parametrize("decode", ["compiled", "graph"])
def test_measure_says_how_each_cache_decoded(decode):
    """Compiled or graphed: the FP16 baseline steps from device counters (eagerly on a CPU: no CUDA graph to
    replay), a Kitty cache on the reference engine cannot and says why, transformers' caches are eager."""
    from conftest import tiny_model
    from kitty_core.throughput import measure

    model = tiny_model("llama")
    how = {kind: measure(model, kind, 2, 40, 16, points=2, decode=decode)["decode"]
           for kind in ("fp16-prealloc", "kitty-pro", "dynamic")}
    assert how["fp16-prealloc"] == "device counters, eager"
    assert how["kitty-pro"].startswith("eager (") and "'reference' engine" in how["kitty-pro"]
    assert how["dynamic"] == "eager"
    row = measure(model, "fp16-prealloc", 2, 40, 16, points=2)
    assert row["decode"] == "eager"
    # KV bytes per token as the whole generation holds them: the preallocation's K and V, per layer
    text = model.config
    per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4
    assert row["kv_bytes_per_token"] == per_token  # float32 CPU model


def test_compiled_static_cache_decodes_through_the_compiled_call():
    """static-compiled: prefill eager, each decode step through transformers' compiled forward
    (dynamo with a backend that runs the captured graphs as they are, to test the plumbing without a
    C++ compile), the same logits as a DynamicCache, and no recompilation from one step to the next:
    the cache's position lives on the device."""
    import torch
    import torch._dynamo
    from transformers import CompileConfig, DynamicCache

    from conftest import tiny_model
    from kitty_core.baselines import CompiledStaticCache, forward, release_compiled

    graphs = []

    def backend(gm, example_inputs):  # counts what dynamo captures
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = tiny_model("llama")
    ours = CompiledStaticCache(model, 16, CompileConfig(backend=backend, mode=None))
    theirs = DynamicCache(config=model.config)
    ids = torch.randint(3, 256, (2, 12))
    captured = []
    with torch.inference_mode():
        for s in (slice(0, 9), slice(9, 10), slice(10, 11), slice(11, 12)):
            a = forward(model, ours, ids[:, s]).logits
            b = model(input_ids=ids[:, s], past_key_values=theirs, use_cache=True, logits_to_keep=1).logits
            torch.testing.assert_close(a, b)
            captured.append(len(graphs))
    assert captured[0] == 0 and captured[1] > 0  # the prefill ran eagerly, the first step compiled
    assert captured[1] == captured[2] == captured[3]  # later steps reuse it
    assert int(ours.get_seq_length()) == 12
    release_compiled(model)  # what the sweep does after this cache
    assert not hasattr(model, "_compiled_call")


def test_out_of_memory_in_the_compiled_decode_drops_the_compiled_call():
    """An out of memory inside the compiled decode (a batch too large for its CUDA graphs) leaves
    torch.compile's graph trees unusable, so `forward` drops the compiled call before re-raising:
    the next cache, at a batch that fits, compiles afresh and decodes."""
    import torch
    import torch._dynamo
    from transformers import CompileConfig, DynamicCache

    from conftest import tiny_model
    from kitty_core.baselines import CompiledStaticCache, forward

    calls = {"n": 0}

    def backend(gm, example_inputs):  # the first compiled call runs out of memory, later ones run
        def run(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return gm.forward(*args)
        return run

    torch._dynamo.reset()
    model = tiny_model("llama")
    config = CompileConfig(backend=backend, mode=None)
    ids = torch.randint(3, 256, (2, 9))
    with torch.inference_mode():
        big = CompiledStaticCache(model, 16, config)
        forward(model, big, ids[:, :8])
        with pytest.raises(torch.OutOfMemoryError):
            forward(model, big, ids[:, 8:])
        assert not hasattr(model, "_compiled_call")
        ours, theirs = CompiledStaticCache(model, 16, config), DynamicCache(config=model.config)
        forward(model, ours, ids[:, :8])
        model(input_ids=ids[:, :8], past_key_values=theirs, use_cache=True)
        a = forward(model, ours, ids[:, 8:]).logits
        b = model(input_ids=ids[:, 8:], past_key_values=theirs, use_cache=True, logits_to_keep=1).logits
    torch.testing.assert_close(a, b)
    assert calls["n"] >= 2
    torch._dynamo.reset()


def _run_file(caches, points, command=None):
    settings = {"model": "random:qwen3-8b", "prompt": 512, "generate": 8192, "points": 3, "caches": caches}
    if command:
        settings["runs"] = [{"command": command, "caches": caches}]
    rows = [{"cache": c, "batch": b} for c, b in points]
    return {"settings": settings, "points": rows, "probes": list(rows), "skipped": [], "validation": []}


def test_merged_runs_replace_the_caches_measured_again_and_name_both_commands():
    from kitty_core.results import PAGE_KERNEL_RULE, merge_runs, setup_differences

    first = _run_file(["dynamic", "kitty", "kitty-pro"], [("dynamic", 96), ("kitty", 576), ("kitty-pro", 64)], "cmd 1")
    second = _run_file(["kitty-pro"], [("kitty-pro", 544)])
    assert not setup_differences(first["settings"], second["settings"])
    merged = merge_runs(first, second, "cmd 2")
    assert [(r["cache"], r["batch"]) for r in merged["points"]] == [("dynamic", 96), ("kitty", 576), ("kitty-pro", 544)]
    assert merged["settings"]["runs"] == [{"command": "cmd 1", "caches": ["dynamic", "kitty"]},
                                          {"command": "cmd 2", "caches": ["kitty-pro"]}]
    assert merged["settings"]["caches"] == ["dynamic", "kitty", "kitty-pro"]
    assert setup_differences(first["settings"], dict(second["settings"], generate=4096)) == ["generate"]
    # against a file written before e2e runs recorded their page kernel, as `first` was
    newer = dict(second["settings"], generate=4096, page_kernel=PAGE_KERNEL_RULE)
    assert setup_differences(first["settings"], newer) == ["generate", "page_kernel"]


def test_real_generations_compare_max_batches_of_the_same_length():
    import pandas as pd

    from kitty_core.results import real_table

    def check(cache, batch, generate, seconds):
        return {"cache": cache, "batch": batch, "prompt": 512, "generate": generate, "measured_s": seconds,
                "estimated_s": seconds * 0.98, "estimate_error": -0.02}

    points = pd.DataFrame([{"cache": "fp16-prealloc", "max_batch": 96}, {"cache": "kitty-pro", "max_batch": 544}])
    real = real_table([check("kitty-pro", 64, 8192, 80.0), check("kitty-pro", 544, 8192, 400.0),
                       check("fp16-prealloc", 96, 8192, 200.0), check("kitty-pro", 544, 4096, 150.0)], points)
    assert list(real["tokens_per_s"]) == pytest.approx([64 * 8192 / 80, 544 * 8192 / 400, 96 * 8192 / 200,
                                                        544 * 4096 / 150])
    assert list(real["at_max_batch"]) == [False, True, True, True]
    ratio = list(real["tput_vs_fp16-prealloc"])
    # only a max batch against the baseline's max batch at the same length: not batch 64, not 4,096 tokens
    assert pd.isna(ratio[0]) and pd.isna(ratio[3])
    assert ratio[1] == pytest.approx((544 / 400) / (96 / 200)) and ratio[2] == pytest.approx(1.0)
    assert real_table([], points).empty


def test_gpu_telemetry_reads_nvidia_smi_lines_and_is_empty_without_a_gpu(monkeypatch):
    import torch

    from kitty_core import telemetry

    got = telemetry.summarize("1680, 690.5\n[N/A], [N/A]\n1320, 701.5\nclocks.sm [MHz], power.draw [W]\n")
    assert got == {"sm_clock_mhz": 1500.0, "sm_clock_min_mhz": 1320.0, "power_w": 696.0, "gpu_samples": 2}
    assert telemetry.summarize("") == {}
    with telemetry.sampled(device="cpu") as gpu:  # a model on the CPU, GPU or not
        pass
    assert gpu == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with telemetry.sampled() as gpu:
        pass
    assert gpu == {}


def test_e2e_refuses_to_merge_into_a_run_of_other_settings(tmp_path, capsys):
    import json

    from kitty_core.bench import main

    out = tmp_path / "run.json"
    out.write_text(json.dumps(_run_file(["dynamic"], [("dynamic", 96)], "cmd 1")))
    assert main(["e2e", "--model", "demo", "--device", "cpu", "--caches", "fp16-prealloc", "--prompt", "64",
                 "--generate", "64", "--out", str(out), "--merge"]) == 2
    assert "--merge needs the same" in capsys.readouterr().err
    assert json.loads(out.read_text())["points"] == [{"cache": "dynamic", "batch": 96}]  # left as it was
    assert main(["e2e", "--model", "demo", "--caches", "fp16-prealloc", "--merge"]) == 2
    assert "--merge adds to the file named by --out" in capsys.readouterr().err


def test_e2e_merges_a_second_command_into_the_same_file(tmp_path):
    """Two real (tiny, CPU) e2e commands into one file: both caches' rows, both commands named."""
    import json

    from kitty_core.bench import main

    out = tmp_path / "run.json"
    common = ["--model", "demo", "--device", "cpu", "--prompt", "8", "--generate", "8", "--budget-gib", "0.001",
              "--equal-batch", "1", "--points", "2", "--start", "1", "--out", str(out)]
    assert main(["e2e", "--caches", "fp16-prealloc", *common]) == 0
    assert main(["e2e", "--caches", "kivi-k2v2", *common, "--merge"]) == 0
    run = json.loads(out.read_text())
    assert [r["caches"] for r in run["settings"]["runs"]] == [["fp16-prealloc"], ["kivi-k2v2"]]
    assert "--merge" in run["settings"]["runs"][1]["command"]
    assert {r["cache"] for r in run["summary"]} == {"fp16-prealloc", "kivi-k2v2"}
    # a command that only validates (no caches to sweep) adds its real generation to the same file
    assert main(["e2e", "--caches", "", "--validate", "fp16-prealloc:1:8", *common, "--merge"]) == 0
    assert main(["e2e", "--caches", "kivi-k2v2", *common, "--merge"]) == 0
    run = json.loads(out.read_text())
    assert [r["caches"] for r in run["settings"]["runs"]] == [["fp16-prealloc"], [], ["kivi-k2v2"]]
    assert "--validate fp16-prealloc:1:8" in run["settings"]["runs"][1]["command"]
    assert [(v["cache"], v["batch"], v["generate"]) for v in run["validation"]] == [("fp16-prealloc", 1, 8)]
    assert {r["cache"] for r in run["summary"]} == {"fp16-prealloc", "kivi-k2v2"}


def test_a_compiled_decode_that_cannot_be_built_is_skipped_not_fatal(monkeypatch):
    """torch.compile failing on this machine (no compiler, an unsupported op) skips static-compiled
    with the reason, and the sweep goes on to the next cache."""
    from transformers import CompileConfig

    from conftest import tiny_model
    from kitty_core import baselines, throughput

    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler for the backend")

    init = baselines.CompiledStaticCache.__init__
    monkeypatch.setattr(baselines.CompiledStaticCache, "__init__",
                        lambda self, model, n: init(self, model, n, CompileConfig(backend=broken, mode=None)))
    model = tiny_model("qwen3")
    rows = list(throughput.sweep(model, ["static-compiled", "dynamic"], 8, 8, budget_bytes=1 << 16, points=2, limit=2))
    skipped = [row for what, row in rows if what == "skip"]
    assert len(skipped) == 1 and skipped[0]["cache"] == "static-compiled"
    assert "compiled decode failed" in skipped[0]["reason"]
    assert any(what == "point" and row["cache"] == "dynamic" for what, row in rows)


def test_a_preset_kind_may_name_its_engine():
    """"kitty-pro@triton+key_dots=fp16" times one engine setting beside another in one sweep: the
    cache gets that engine, the timed lengths are the preset's, a wrong engine is refused up front."""
    from conftest import tiny_model
    from kitty_core.baselines import make_cache
    from kitty_core.bench import _caches

    model = tiny_model("llama")
    cache = make_cache("kitty-pro@triton+key_dots=fp16", model, 64)
    assert cache.engine.name == "triton" and cache.engine.key_dots == "fp16"
    assert make_cache("kitty-pro@reference", model, 64).engine.name == "reference"
    assert timed_lengths("kitty-pro@reference", 512, 8192, 3) == timed_lengths("kitty-pro", 512, 8192, 3)
    assert _caches("fp16-prealloc, kitty-pro@triton+key_dots=int8") == ["fp16-prealloc", "kitty-pro@triton+key_dots=int8"]
    with pytest.raises(ValueError, match="key_dots"):
        _caches("kitty-pro@triton+key_dots=int4")
    with pytest.raises(ValueError, match="engine must be one of"):
        _caches("kitty-pro@cuda")


@pytest.mark.parametrize("kind", ["kitty-pro+group_size=16+local_window=16", "kitty+group_size=16+local_window=8+sink=4"])
def test_packing_steps_are_where_the_cache_packs(kind):
    """The estimate adds a packing step's extra time once per page boundary the generation crosses:
    `pack_steps` counts them from the preset alone, `steps_to_pack` says which step comes next, and
    both agree with the steps at which a real cache's page pools grow."""
    import torch

    from conftest import tiny_model
    from kitty_core.baselines import forward, make_cache
    from kitty_core.throughput import pack_steps

    model = tiny_model("llama")
    cache = make_cache(kind, model, 128)
    forward(model, cache, torch.randint(3, 256, (2, 21)))
    packed, predicted = [], []
    pages = lambda: (cache.layers[0].k_pages.count, cache.layers[0].v_pages.count)  # noqa: E731
    for _ in range(60):
        k, before = cache.steps_to_pack(), pages()
        forward(model, cache, torch.randint(3, 256, (2, 1)))
        packed.append(pages() != before)
        predicted.append(k == 1)
    assert packed == predicted and sum(packed) == pack_steps(kind, 21, 81) >= 3
    assert pack_steps("kitty-pro", 512, 512 + 8192) == 8192 // 128  # keys and values pack at the same steps
    assert pack_steps("kitty+local_window=64", 512, 512 + 8192) == 2 * 8192 // 128
    assert pack_steps("fp16-prealloc", 512, 8704) == 0


def test_measure_times_the_prefill_warm(monkeypatch):
    """The first prefill at a shape compiles kernels: `measure` runs it once untimed, then times a
    second one into a fresh cache, which is the cache it goes on to decode. A clock that reads 9 s
    for a prefill that holds the process's first forward and 1 s otherwise tells which was timed."""
    from conftest import tiny_model
    from kitty_core import baselines, throughput

    calls = []
    forward = baselines.forward

    def recording_forward(model, cache, ids):
        calls.append((cache, ids.shape[1]))
        return forward(model, cache, ids)

    def clock(fn):
        before = len(calls)
        fn()
        return 9.0 if before == 0 else 1.0

    for module in (throughput, baselines):  # the prefill's forwards, and the decode steps' (`decode_step`)
        monkeypatch.setattr(module, "forward", recording_forward)
    monkeypatch.setattr(throughput, "_timed", clock)
    row = throughput.measure(tiny_model("llama"), "kitty-pro+group_size=16+local_window=16", 2, 40, 60, points=2,
                             prefill_chunk=16)
    assert row["prefill_s"] == 1.0
    prefills = [(c, t) for c, t in calls if t > 1]
    caches = list(dict.fromkeys(id(c) for c, _ in prefills))
    assert len(caches) == 2  # warm-up and timed, each into its own cache
    for cache in caches:
        assert [t for c, t in prefills if id(c) == cache] == [16, 16, 8]  # the whole prompt, in chunks
    assert {id(c) for c, t in calls if t == 1} == {caches[1]}  # the decode steps run on the timed one


def test_measure_adds_what_packing_costs(monkeypatch):
    """A preset's estimate includes its packing steps: their count from the preset, and what a step
    that packs costs beyond a plain one, timed once. A clock that reads 10 ms for a plain step and
    50 ms for a step that packed makes every figure exact."""
    from conftest import tiny_model
    from kitty_core import layer as layer_module
    from kitty_core import throughput

    packs = []
    insert_all = layer_module.KittyLayer._insert_all

    def counting_insert_all(self, k, v, pack=True):
        before = self.k_pages.count + self.v_pages.count
        insert_all(self, k, v, pack)
        if self.layer_idx == 0 and self.k_pages.count + self.v_pages.count > before:
            packs.append(self.seen)

    def clock(fn):
        before = len(packs)
        fn()
        return 0.05 if len(packs) > before else 0.01

    monkeypatch.setattr(layer_module.KittyLayer, "_insert_all", counting_insert_all)
    monkeypatch.setattr(throughput, "_timed", clock)
    kind = "kitty-pro+group_size=16+local_window=16"
    row = throughput.measure(tiny_model("llama"), kind, 2, 40, 100, points=2)
    assert row["packing_steps"] == throughput.pack_steps(kind, 40, 140) == 6
    assert row["packing_ms"] == pytest.approx(40.0)
    steps = [row[k] for k in row if k.startswith("step_ms@")]
    lengths = [int(k.split("@")[1]) for k in row if k.startswith("step_ms@")]
    assert row["decode_s"] == pytest.approx(throughput.integrate(lengths, steps, 40, 140) / 1e3 + 6 * 0.040)
    plain = throughput.measure(tiny_model("llama"), "fp16-prealloc", 2, 40, 100, points=2)
    assert plain["packing_steps"] == 0 and plain["packing_ms"] is None


def test_validate_prefills_in_the_chunks_the_estimate_could_fit(monkeypatch):
    """A max batch leaves room only for small prefill chunks: `validate` backs off as the sweep
    does (here the 512-token estimate runs out of memory) and prefills the real generation in the
    chunk that fitted, then decodes every token."""
    import torch

    from conftest import tiny_model
    from kitty_core import baselines, throughput

    model = tiny_model("llama")
    real_measure, real_forward = throughput.measure, baselines.forward
    tried, widths = [], []

    def measure(*args, prefill_chunk, **kwargs):
        tried.append(prefill_chunk)
        if prefill_chunk > 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_measure(*args, prefill_chunk=prefill_chunk, **kwargs)

    def forward(model, cache, ids):
        widths.append(ids.shape[1])
        return real_forward(model, cache, ids)

    monkeypatch.setattr(throughput, "measure", measure)
    for module in (throughput, baselines):  # the prefill's forwards, and the decode steps' (`decode_step`)
        monkeypatch.setattr(module, "forward", forward)
    row = throughput.validate(model, "fp16-prealloc", 2, 256, 8, points=2)
    assert tried == [512, 128]
    assert row["prefill_chunk"] == 128 and row["decode"] == "eager"
    # the estimate's two prefills and its steps, then the real run: two chunks, eight steps
    assert widths[-10:] == [128, 128] + [1] * 8
    assert row["measured_s"] > 0 and row["estimated_s"] > 0
    assert row["estimate_error"] == row["estimated_s"] / row["measured_s"] - 1


def test_e2e_refuses_counts_that_cannot_be_measured(capsys):
    """No steps, no points or nothing to generate: a usage error naming the argument, before any
    model loads (these used to end in a division by zero or an empty interpolation)."""
    import pytest

    from kitty_core.bench import main

    for flag, value in (("--steps", "0"), ("--points", "0"), ("--generate", "0"), ("--prompt", "-1"),
                        ("--steps", "ten")):
        with pytest.raises(SystemExit) as stop:
            main(["e2e", "--model", "no-such-model", "--caches", "fp16-prealloc", flag, value])
        assert stop.value.code == 2
        assert f"argument {flag}: needs an integer of at least" in capsys.readouterr().err


def test_an_equal_batch_that_did_not_fit_has_no_figure_in_the_summary():
    """The baseline's equal batch out of memory (an FP16 cache on a smaller GPU): its equal-batch
    throughput and every ratio against it are missing, not its max batch's figure in their place;
    a cache whose equal batch is its max batch (measured once) keeps that figure."""
    import pandas as pd

    from kitty_core.results import e2e_table

    def point(cache, batch, at, max_batch, tps=None):
        row = {"cache": cache, "batch": batch, "at": at, "max_batch": max_batch, "tokens_per_s": tps,
               "peak_bytes": 1.0, "kv_bytes_per_token": 2.0}
        return row if tps else dict(row, reason="out of memory")

    points = pd.DataFrame([point("fp16-prealloc", 40, "max batch", 40, 2000.0),
                           point("fp16-prealloc", 64, "equal batch", 40),
                           point("kitty-pro", 288, "max batch", 288, 11000.0),
                           point("kitty-pro", 64, "equal batch", 288, 5800.0),
                           point("kivi-k2v2", 64, "max batch", 64, 3000.0)])
    t = e2e_table(points).set_index("cache")
    assert t.loc["fp16-prealloc", "equal_batch"] == 64 and pd.isna(t.loc["fp16-prealloc", "tokens_per_s_equal_batch"])
    assert pd.isna(t.loc["kitty-pro", "equal_batch_vs_fp16-prealloc"])
    assert t.loc["kitty-pro", "tput_vs_fp16-prealloc"] == pytest.approx(11000 / 2000)
    assert t.loc["kitty-pro", "tokens_per_s_equal_batch"] == pytest.approx(5800)
    assert t.loc["kivi-k2v2", "equal_batch"] == 64 and t.loc["kivi-k2v2", "tokens_per_s_equal_batch"] == 3000
