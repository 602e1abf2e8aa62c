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
    ("passkey_b.csv", "method,length,depth\nfp16,1024,0.5\n", "lacks the columns correct"),
])
def test_malformed_result_files_are_named_with_the_cause(tmp_path, name, text, says):
    from kitty_core import results

    path = tmp_path / name
    path.write_text(text)
    read = {"e2e": results.read_e2e, "kernels": results.read_kernels, "accuracy": results.read_accuracy,
            "passkey": results.read_passkey}[name.split("_")[0]]
    with pytest.raises(results.ResultFileError, match=says) as err:
        read(path)
    assert name in str(err.value)


def test_the_saved_result_files_all_read():
    from pathlib import Path

    from kitty_core import results

    saved = Path(__file__).resolve().parent.parent / "data" / "results"
    for path in saved.glob("e2e_*.json"):
        assert len(results.read_e2e(path)["points"])
    assert len(results.read_kernels(saved / "kernels_h200.json")[1])
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
