"""Bad input to the library and the command lines: a message that says what was wrong and what to
do, given before any expensive work, and no earlier result lost."""

import json

import pytest

from kitty_core import bench, evaluate, passkey, probe
from kitty_core.cli import write_atomic, write_text
from kitty_core.config import parse_method


def _usage_error(main, argv, capsys) -> str:
    """argparse's own exit (status 2) for an argument that does not parse; its message."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("main, argv", [
    (evaluate.main, ["--context", "-5"]),
    (evaluate.main, ["--context", "0"]),
    (evaluate.main, ["--continuation", "0"]),
    (evaluate.main, ["--windows", "-3"]),
    (probe.main, ["--tokens", "-5"]),
    (probe.main, ["--tokens", "0"]),
    (passkey.main, ["--trials", "0"]),
    (bench.main, ["generate", "--new", "1"]),
])
def test_counts_are_checked_as_they_are_parsed(main, argv, capsys):
    err = _usage_error(main, argv, capsys)
    assert "needs an integer of at least" in err and repr(argv[-1]) in err


def test_a_memory_budget_must_be_positive(capsys):
    assert "needs a number above 0, got '-1'" in _usage_error(bench.main, ["e2e", "--budget-gib", "-1"], capsys)


def test_a_kernel_grid_narrower_than_the_shapes_is_refused_before_any_kernel(capsys):
    assert bench.main(["kernels", "--cuda", "--shapes", "64x4704,8x9000", "--grid-tokens", "8704"]) == 2
    assert "--grid-tokens 8704 is shorter than the longest shape's 9000 tokens: give at least 9000" \
        in capsys.readouterr().err
    assert bench.main(["kernels", "--grid-tokens", "8704"]) == 2
    assert "give it with --cuda" in capsys.readouterr().err
    assert bench.main(["kernels", "--launch-once"]) == 2
    assert "--launch-once launches the CUDA page kernel: give it with --cuda" in capsys.readouterr().err
    assert bench.main(["kernels", "--cuda", "--launch-once", "--out", "x.csv"]) == 2
    assert "--launch-once times nothing and writes no table: drop --out" in capsys.readouterr().err
    assert bench.main(["kernels", "--cuda", "--launch-once", "--rounds", "9"]) == 2
    assert "--launch-once times nothing and writes no table: drop --rounds" in capsys.readouterr().err
    assert bench.main(["kernels", "--rounds", "9"]) == 2
    assert "--rounds sets the timing rounds of the CUDA comparison: give it with --cuda" in capsys.readouterr().err
    assert bench.main(["kernels", "--cuda", "--launch-once", "--steps-a-graph", "1"]) == 2
    assert "--launch-once times nothing and writes no table: drop --steps-a-graph" in capsys.readouterr().err
    assert bench.main(["kernels", "--tail-bits", "8"]) == 2
    assert "--tail-bits applies to the CUDA comparison: give it with --cuda" in capsys.readouterr().err
    assert bench.main(["kernels", "--cuda", "--tail-bits", "16,4"]) == 2
    assert "--tail-bits takes 16, 8 or 16,8 (the tail's width), not '16,4'" in capsys.readouterr().err
    assert bench.main(["kernels", "--cuda", "--tail-bits", "8,8"]) == 2
    assert "--tail-bits takes 16, 8 or 16,8 (the tail's width), not '8,8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["kernels", "--cuda", "--rounds", "0"])
    assert "--rounds: needs an integer of at least 1, got '0'" in capsys.readouterr().err


def test_kernel_variants_must_be_files_and_go_with_cuda(tmp_path, capsys):
    variant = tmp_path / "decode_variant.cu"
    variant.write_text("// a variant\n")
    assert bench.main(["kernels", "--variants", str(variant)]) == 2
    assert "--variants are variants of the CUDA page kernel: give them with --cuda" in capsys.readouterr().err
    assert bench.main(["kernels", "--cuda", "--variants", f"{variant},{tmp_path / 'nope.cu'}"]) == 2
    assert f"no file {tmp_path / 'nope.cu'} (--variants takes .cu files" in capsys.readouterr().err
    assert bench.main(["kernels", "--cuda", "--variants", ","]) == 2
    assert "no file ',' (--variants takes .cu files" in capsys.readouterr().err
    for twice in (f"{variant},{variant}", f"{variant},kernels/cuda/decode.cu"):
        assert bench.main(["kernels", "--cuda", "--variants", twice]) == 2
        assert "names a file twice, or the shipped kernel" in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for main, argv in ((evaluate.main, ["--json", str(blocker / "out.json")]),
                       (passkey.main, ["--csv", str(blocker / "out.csv")]),
                       (probe.main, ["--out", str(blocker / "probe")]),
                       (bench.main, ["generate", "--out", str(blocker / "gen.csv")])):
        assert main(argv) == 2
        assert "cannot write to" in capsys.readouterr().err
    assert evaluate.main(["--json", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "results.json"
    write_text(path, json.dumps({"run": 1}))

    def failing(tmp):  # a write that fails halfway, as on a full disk
        tmp.write_text('{"run": 2, "resu')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, failing)
    assert json.loads(path.read_text()) == {"run": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary file left behind


def test_empty_methods_and_ignored_overrides(capsys):
    assert passkey.main(["--methods", " ,"]) == 2
    assert "--methods is empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"boost_rate in 'fp16\+boost_rate=0.5' would be ignored"):
        parse_method("fp16+boost_rate=0.5")
    assert parse_method("kitty+boost_rate=0.5").boost_rate == 0.5


@pytest.mark.parametrize("layers", ["99", "-1", "0,30"])
def test_probe_layers_outside_the_model(layers, tmp_path, capsys):
    assert probe.main(["--layers", layers, "--out", str(tmp_path / "probe")]) == 2
    assert "--layers must be 'all' or indices in [0, 29]" in capsys.readouterr().err
    assert not any((tmp_path / "probe").iterdir())  # nothing written


@pytest.mark.parametrize("name, text, says", [
    ("e2e_a.json", '{"settings": {"caches": ', "cannot be read as JSON"),
    ("e2e_b.json", "[1, 2]", "holds a list, not a result object"),
    ("e2e_c.json", '{"points": []}', "has no settings in the file"),
    ("e2e_d.json", '{"settings": {"model": "m", "prompt": 512, "generate": 8192, "caches": "kitty"}, "points": []}',
     "settings.caches is not a list"),
    ("e2e_e.json", '{"settings": {"model": "m", "prompt": 512, "generate": 8192, "caches": ["kitty"]}, '
                   '"points": [{"cache": "kitty", "batch": 8, "tokens_per_s": 1.0}]}', "timed points lack the columns at"),
    ("kernels_a.json", '{"settings": {}, "results": []}', "settings lack the device"),
    ("kernels_b.json", '{"settings": {"device": "H200"}, "results": [{"batch": 1}]}', "lack the columns length"),
    ("accuracy_a.json", '{"results": [{"method": "kitty-pro++", "kl": 0, "perplexity": 1, "top1": 1, '
                        '"bits_per_element": 2}]}', "names a method this version cannot read"),
    ("passkey_a.csv", "", "cannot be read as CSV"),
    ("kernels_cuda_a.csv", "batch,length,boost_rate,cuda_ms,triton_ms,cudnn_ms\n64,8192,0.25,0.1,x,0.4\n",
     "non-positive, non-numeric or missing values in cuda_ms, triton_ms, cudnn_ms"),
    ("kernels_cuda_c.csv", "batch,length,boost_rate,cuda_ms,triton_ms,cudnn_ms\n64,8192,25%,0.1,0.2,0.4\n",
     "non-numeric or missing values in batch, length, boost_rate"),
    ("kernels_cuda_b.csv", "batch,length,boost_rate\n64,8192,0.25\n", "lacks the columns cuda_ms, triton_ms"),
    ("passkey_b.csv", "method,length,depth\nfp16,1024,0.5\n", "lacks the columns correct"),
])
def test_malformed_result_files_are_named_with_the_cause(tmp_path, name, text, says):
    from kitty_core import results

    path = tmp_path / name
    path.write_text(text)
    readers = [("e2e", results.read_e2e), ("kernels_cuda", results.read_kernels_cuda), ("kernels", results.read_kernels),
               ("accuracy", results.read_accuracy), ("passkey", results.read_passkey)]
    read = next(reader for prefix, reader in readers if name.startswith(prefix))
    with pytest.raises(results.ResultFileError, match=says) as err:
        read(path)
    assert name in str(err.value)


def test_the_saved_result_files_all_read():
    from pathlib import Path

    from kitty_core import results

    saved = Path(__file__).resolve().parent.parent / "data" / "results"
    for path in saved.glob("e2e_*.json"):  # timed points, or real generations only (--caches '')
        run = results.read_e2e(path)
        assert len(run["points"]) or run["validation"]
    assert len(results.read_kernels(saved / "kernels_h200.json")[1])
    for path in saved.glob("kernels_cuda_*.csv"):
        assert len(results.read_kernels_cuda(path))
    for path in [*saved.glob("accuracy_*.json"), *saved.glob("rules_*.json")]:
        assert len(results.read_accuracy(path))
    assert len(results.read_passkey(saved / "passkey_demo_cpu.csv"))


def test_model_loading_failures_say_what_and_why(tmp_path, demo):
    """Every way a model fails to load is a ModelLoadError naming the file or input and the cause."""
    from transformers import AutoConfig

    from kitty_core.models import ModelLoadError, load_model

    def fails(name, says, **kw):
        with pytest.raises(ModelLoadError, match=says):
            load_model(name, **kw)

    fails("demo", r"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got 'tpu'", device="tpu")
    fails("demo", r"device must be .* got 'xla'", device="xla")
    (tmp_path / "x.gguf").mkdir()
    fails(str(tmp_path / "x.gguf"), "is a directory, not a GGUF file")
    fails("~/no-such-model-dir", "looks like a path, but no such directory exists")
    (tmp_path / "empty").mkdir()
    fails(str(tmp_path / "empty"), "has no config.json: not a transformers model directory")
    # a directory with a tokenizer and a config, and weights that cannot be read
    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2)
    for case, weights, says in (("truncated", "model.safetensors", "SafetensorError|HeaderTooSmall|safetensors"),
                                ("pickled", "pytorch_model.bin", "UnpicklingError|weights_only|pickle")):
        d = tmp_path / case
        cfg.save_pretrained(d)
        demo.tokenizer.save_pretrained(d)
        if case == "truncated":
            (d / weights).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
        else:
            import pickle

            (d / weights).write_bytes(pickle.dumps({"weights": print}))
        fails(str(d), f"could not load .*{case}.* from the local directory: .*({says})")
    d = tmp_path / "no-heads"
    cfg.save_pretrained(d)
    demo.tokenizer.save_pretrained(d)
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "num_attention_heads": 0}))
    fails(str(d), "could not load .* from the local directory: ZeroDivisionError")


def test_library_counts_and_lengths_are_checked_before_any_work(demo):
    """evaluate and run_passkey called directly (not through their command lines): each bad count or
    length is refused by name before the first forward pass."""
    from kitty_core.evaluate import evaluate
    from kitty_core.passkey import run_passkey

    m, tok = demo.model, demo.tokenizer
    for kw, says in ((dict(context=-5), "context must be a whole number of at least 1, got -5"),
                     (dict(continuation=0), "continuation must be a whole number of at least 1, got 0"),
                     (dict(windows=-3), "windows must be a whole number of at least 1, got -3"),
                     (dict(methods=" , "), "no methods given"),
                     (dict(context=8190, continuation=4), r"\(8190 \+ 4 tokens\) is beyond the model's context of 8192")):
        with pytest.raises(ValueError, match=says):
            evaluate(m, tok, **{"methods": "fp16", "text": "x", **kw})
    for args, says in (((["kitty-pro"], [512, 100_000]), "length 100000 exceeds the model's context of 8192"),
                       (([], [512]), "no methods given"),
                       ((["fp16"], [512], [2.0]), r"depth must be in \[0, 1\], got 2.0"),
                       ((["fp16"], [10]), "is too short for a passkey prompt")):
        with pytest.raises(ValueError, match=says):
            run_passkey(m, tok, *args)
    with pytest.raises(ValueError, match="trials must be at least 1, got 0"):
        run_passkey(m, tok, ["fp16"], [512], trials=0)


@pytest.mark.parametrize("argv, says", [
    (["--lengths", "512,abc"], "--lengths: 'abc' is not a whole number; give numbers separated by commas, e.g. 1024,2048"),
    (["--lengths", " , "], "--lengths is empty"),
    (["--depths", "0.5,2"], r"--depths must lie in [0, 1]"),
])
def test_passkey_lists_are_checked_before_the_model_loads(argv, says, capsys):
    assert passkey.main(argv) == 2
    assert says in capsys.readouterr().err


def test_probe_and_generate_arguments_before_the_model_loads(tmp_path, capsys):
    from kitty_core import generate

    assert probe.main(["--tokens", "100", "--out", str(tmp_path / "p")]) == 2
    assert "100 tokens are too short to measure" in capsys.readouterr().err and not (tmp_path / "p").exists()
    assert probe.main(["--rules", "magnitude,loudest", "--out", str(tmp_path / "p")]) == 2
    assert "--rules: unknown 'loudest'; choose from magnitude, random, range, qk" in capsys.readouterr().err
    assert generate.main(["--methods", " ,"]) == 2
    assert "--methods is empty" in capsys.readouterr().err
    assert evaluate.main(["--methods", ""]) == 2
    assert "--methods is empty" in capsys.readouterr().err
    assert probe.main(["--tokens", "9000", "--out", str(tmp_path / "p")]) == 2  # loads the demo model, no capture
    assert "--tokens 9000 is beyond the model's context of 8192 tokens" in capsys.readouterr().err


def test_sensitivity_refuses_a_capture_too_short_to_measure(demo):
    """Fewer tokens than the sink and one page never leave FP16: every channel's error is zero, so a
    ranking of channels would be noise."""
    from kitty_core.probe import capture, sensitivity

    cap = capture(demo.model, demo.tokenizer("In the beginning God created", return_tensors="pt").input_ids)
    with pytest.raises(ValueError, match="tokens are too short to measure: .* at least 160 tokens; give a longer text"):
        sensitivity(cap, 0)


def test_result_files_carry_a_format_version(tmp_path):
    import pandas as pd

    from kitty_core import results
    from kitty_core.generate import read_generations, save_generations

    texts = pd.DataFrame([{"method": "fp16", "text": "a", "tokens": [1], "first_divergence": None}])
    path = tmp_path / "generations.json"
    save_generations(path, texts, pd.DataFrame(columns=["method", "step", "kl"]), {"model": "demo"})
    assert json.loads(path.read_text())["format_version"] == results.FORMAT_VERSION
    assert len(read_generations(path)[1]) == 1
    newer = tmp_path / "e2e_newer.json"
    newer.write_text(json.dumps({"format_version": results.FORMAT_VERSION + 1, "settings": {}, "points": []}))
    with pytest.raises(results.ResultFileError, match=f"e2e_newer.json is of result format {results.FORMAT_VERSION + 1}, "
                                                      "newer than this version reads .*update kitty-lab"):
        results.read_e2e(newer)
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": "1.0"}))
    with pytest.raises(results.ResultFileError, match=r"generations.json has format_version '1.0', not a version number"):
        read_generations(path)
    assert results.stamp({"format_version": 0, "settings": {}}) == {"format_version": results.FORMAT_VERSION, "settings": {}}


def test_the_pack_kernel_writes_channel_numbers_past_255():
    """Head size 512 through the Triton pack kernel (its interpreter on a CPU): the same two-byte boost
    index as the reference quantizer, channel 511 included."""
    import os

    if not (torch_cuda() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("the pack kernel needs a GPU or Triton's interpreter")
    import torch

    from kernels.pack import quantize_keys
    from kitty_core import quant

    torch.manual_seed(0)
    x = torch.randn(1, 1, 4, 512, device="cuda" if torch_cuda() else "cpu")
    x[..., -64:] *= 10
    got, want = quantize_keys(x, 128, "magnitude"), quant.quantize_keys(x, 128, "magnitude")
    assert got.boost_ch.dtype == torch.int16 and int(got.boost_ch.max()) == 511
    for field in ("dense", "high", "boost_ch", "scale", "zero"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_truncated_gguf_is_named_as_incomplete(tmp_path, monkeypatch):
    from kitty_core.models import ModelLoadError, demo_gguf_path, load_model

    cut = tmp_path / "cut.gguf"
    with open(demo_gguf_path(), "rb") as whole:
        cut.write_bytes(whole.read(30_000_000))  # the header and some tensors: a download stopped part way
    monkeypatch.setenv("KITTY_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"could not convert GGUF .*cut.gguf' \(30,000,000 bytes\): its tensors run "
                                             r"past the end of the file, so it is incomplete .*fetch it again"):
        load_model(str(cut), device="cpu")
    assert not any((tmp_path / "cache" / "gguf").iterdir())  # no half-converted model left to be picked up


def test_an_interrupted_evaluation_keeps_what_it_scored_beside_the_earlier_file(tmp_path, monkeypatch, capsys):
    from kitty_core import evaluate as ev

    target = tmp_path / "accuracy_demo.json"
    target.write_text('{"run": 1}')
    scored = ev.continuation_logprobs

    def interrupted(model, ids, context, method, engine=None, progress=None):
        if method != "fp16":
            raise KeyboardInterrupt  # Ctrl-C while the second method is scored
        return scored(model, ids, context, method, engine, progress)

    monkeypatch.setattr(ev, "continuation_logprobs", interrupted)
    argv = ["--methods", "fp16,kitty-pro", "--context", "8", "--continuation", "2", "--windows", "1", "--json", str(target)]
    assert ev.main(argv) == 130
    assert target.read_text() == '{"run": 1}'  # the earlier file as it was
    partial = json.loads((tmp_path / "accuracy_demo.partial.json").read_text())
    assert partial["settings"]["interrupted"] and [r["method"] for r in partial["results"]] == ["fp16"]
    assert "the 1 methods scored are in" in capsys.readouterr().err


def test_an_empty_prompt_through_a_kitty_cache_says_so():
    """model.generate on no tokens with a KittyCache: refused by name, not the model's reshape error."""
    import torch

    from conftest import tiny_model
    from kitty_core import KittyCache

    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match=r"the input has no tokens \(an empty prompt\?\): give at least one token"):
        model.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=2, do_sample=False,
                       past_key_values=KittyCache(model, "kitty-pro"))


def test_a_cache_reserved_beyond_the_models_context_is_refused(demo):
    from kitty_core import KittyCache

    with pytest.raises(ValueError, match=r"max_length=8300 is beyond the model's context of 8192 tokens: keep the "
                                         r"prompt and the new tokens within 8192"):
        KittyCache(demo.model, "kitty-pro", max_length=8300)
    assert KittyCache(demo.model, "kitty-pro", max_length=8192).config.boost_rate == 0.25


def test_e2e_beyond_the_models_context_is_refused_before_the_sweep(capsys):
    from kitty_core.bench import main

    assert main(["e2e", "--model", "demo", "--device", "cpu", "--caches", "kitty-pro"]) == 2  # 512 + 8192
    assert "--prompt 512 + --generate 8192 is beyond demo's context of 8192 tokens: give --generate 7680 or less" \
        in capsys.readouterr().err
