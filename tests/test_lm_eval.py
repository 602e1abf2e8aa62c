"""lm-eval integration: the `kitty` model, the long-context suite and the methods-against-FP16 command.

Model calls use a 2-layer random decoder with the demo model's tokenizer (fast); the command line runs
the demo model itself on one short sample."""

import json
import re
import sys

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.models.huggingface import HFLM

from kitty_core import lm_eval_harness
from kitty_core.lm_eval import main, read_table, summary
from kitty_core.lm_eval_metrics import exact_match, recall
from kitty_core.lm_eval_model import KittyLM, KittyLMError
from kitty_core.lm_eval_tasks import KINDS, MAX_GEN, generate, task_name, write_suite
from kitty_core.passkey import INTRO, NEEDLE, QUESTION


@pytest.fixture(scope="module")
def tiny(demo):
    """A 2-layer random Llama (4 query / 2 KV heads, head size 16) over the demo tokenizer's vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = demo.tokenizer
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), tok


def kitty(tiny, method, **kw):
    model, tok = tiny
    return KittyLM(pretrained=model, tokenizer=tok, method=method, batch_size=2, **kw)


def text(n_words: int, start: int = 0) -> str:
    from kitty_core.lm_eval_tasks import haystack_sentences

    words = " ".join(haystack_sentences()).split()
    return " ".join(words[start:start + n_words])


def test_registry_finds_kitty():
    assert get_model("kitty") is KittyLM
    assert get_model("hf") is HFLM  # lm-eval's own models are still there


def test_loglikelihood_reads_the_context_as_the_cache_stores_it(tiny):
    model, tok = tiny
    # contexts of ~400 tokens: past the 32-token sink, a 128-token page and the 128-value window
    reqs = [Instance("loglikelihood", {}, (text(330, 50 * i), " And the evening and the morning were the first day."), i)
            for i in range(3)]
    reqs.append(Instance("loglikelihood", {}, ("In the beginning", " God"), 3))  # shorter than the sink
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=2).loglikelihood(reqs)
    lm = kitty(tiny, "fp16")
    fp16 = lm.loglikelihood(reqs)
    report = lm.last_cache_report
    assert report["call"] == "loglikelihood" and report["method"] == "fp16" and report["bytes"] > 0
    assert max(report["held_tokens"]) > 300  # the last batch's cache held its context and continuation
    rounding = max(abs(a - b) for (a, _), (b, _) in zip(ref, fp16))
    assert rounding < 1e-4 and [g for _, g in ref] == [g for _, g in fp16]
    one_by_one = kitty(tiny, "fp16", score_chunk=1).loglikelihood(reqs)  # continuation fed a token a step
    assert [a for a, _ in one_by_one] == pytest.approx([a for a, _ in fp16], abs=1e-3)
    k2 = kitty(tiny, "kivi-k2v2").loglikelihood(reqs)
    moved = [abs(a - b) for (a, _), (b, _) in zip(fp16, k2)]
    assert min(moved[:3]) > max(1e-3, 100 * rounding)  # 2-bit pages of the long contexts move every score
    pro = kitty(tiny, "kitty-pro").loglikelihood(reqs)
    assert pro[3][0] == pytest.approx(fp16[3][0], abs=1e-4)  # a context inside the sink stays FP16


def test_generate_until_runs_through_a_fresh_cache(tiny):
    model, tok = tiny
    reqs = [Instance("generate_until", {}, (text(200), {"until": ["\n\n"], "max_gen_toks": 6}), 0),
            Instance("generate_until", {}, (text(150, 400), {"until": ["\n\n"], "max_gen_toks": 6}), 1)]
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=2).generate_until(reqs)
    lm = kitty(tiny, "fp16")
    assert lm.generate_until(reqs) == ref  # greedy tokens of lm-eval's hf model
    pro = kitty(tiny, "kitty-pro")
    out = pro.generate_until(reqs)
    assert len(out) == 2 and all(isinstance(s, str) for s in out)
    report = pro.last_cache_report
    prompt = len(tok(text(200)).input_ids)
    assert report["call"] == "generate_until" and report["method"] == "kitty-pro"
    assert prompt < max(report["held_tokens"]) <= prompt + 6
    with pytest.raises(KittyLMError, match="beam"):
        pro.generate_until([Instance("generate_until", {}, ("Hi", {"max_gen_toks": 2, "num_beams": 2}), 0)])


def test_bad_model_args_say_what_to_pass(tiny):
    with pytest.raises(KittyLMError, match="method='kitty-ultra'.*choose one of"):
        kitty(tiny, "kitty-ultra")
    with pytest.raises(KittyLMError, match="boost_rate"):
        kitty(tiny, "kitty+boost_rate=2")
    with pytest.raises(KittyLMError, match="methd"):
        kitty(tiny, "kitty", methd="kitty-pro")
    with pytest.raises(KittyLMError, match="engine="):
        kitty(tiny, "kitty", engine="warp")
    with pytest.raises(KittyLMError, match="pretrained='/no/such/model'.*no such directory"):
        get_model("kitty").create_from_arg_string("pretrained=/no/such/model,method=kitty-pro")
    with pytest.raises(KittyLMError, match="method='bogus'"):  # checked before any model is loaded
        get_model("kitty").create_from_arg_string("pretrained=/no/such/model,method=bogus")
    with pytest.raises(KittyLMError, match="tokenizer=demo"):  # before 8B random weights are made
        get_model("kitty").create_from_arg_string("pretrained=random:qwen3-8b,method=kitty")


@pytest.mark.parametrize("kind", KINDS)
def test_suite_samples_are_deterministic_and_hold_their_answers(demo, kind):
    tok = demo.tokenizer
    docs = generate(tok, kind, 1024, 3, seed=1)
    assert docs == generate(tok, kind, 1024, 3, seed=1)
    assert docs != generate(tok, kind, 1024, 3, seed=2)
    target = 1024 - MAX_GEN[kind]
    for d in docs:
        prompt = f"{d['input']} {d['gen_prefix']}"
        n = len(tok(prompt).input_ids)
        assert n == d["tokens"] and 0.9 * target <= n <= target
        for answer in d["outputs"]:
            assert answer in d["input"]
    if kind == "niah_multikey":  # three other keys as distractors, each with its own value
        assert len(re.findall(r"special magic numbers for [a-z]+-[a-z]+ is: \d{7}", docs[0]["input"])) == 4
    if kind == "niah_multivalue":
        assert all(d["input"].count(f"is: {v}.") == 1 for d in docs for v in d["outputs"])
    if kind == "cwe":  # the ten expected words are the ten most frequent entries of the list
        entries = re.findall(r"\d+\. ([a-z]+)", docs[0]["input"])
        counts = {w: entries.count(w) for w in set(entries)}
        top = sorted(counts, key=counts.get, reverse=True)[:10]
        assert set(top) == set(docs[0]["outputs"])
        assert min(counts[w] for w in top) > max(c for w, c in counts.items() if w not in top)
    if kind == "passkey":  # kitty_core.passkey's prompt, split before its answer prefix
        for d in docs:
            prompt = f"{d['input']} {d['gen_prefix']}"
            assert prompt.startswith(INTRO) and prompt.endswith(QUESTION)
            assert NEEDLE.format(key=d["outputs"][0]) in prompt
        assert [d["depth"] for d in docs] == [0.0, 0.5, 1.0]


def test_metrics():
    assert recall({"outputs": ["AB", "cd"]}, [" ab and nothing else"]) == {"recall": 0.5}
    assert recall({"outputs": ["1234567"]}, [": 1234567."]) == {"recall": 1.0}
    assert exact_match({"outputs": ["12345"]}, [" 12345. Remember"]) == {"exact_match": 1.0}
    assert exact_match({"outputs": ["12345"]}, [" 123456"]) == {"exact_match": 0.0}


def test_suite_tasks_score_like_lm_evals_hf_model(tiny, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tok = tiny
    folder, names = write_suite(tok, tmp_path / "tasks", ["passkey", "niah_single"], [512], samples=2, seed=0)
    assert names == [task_name("passkey", 512), task_name("niah_single", 512)]
    assert sorted(p.name for p in folder.glob("*.yaml")) == sorted(f"{n}.yaml" for n in names)
    again = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.jsonl")}
    write_suite(tok, folder, ["passkey", "niah_single"], [512], samples=2, seed=0)  # the same settings: kept
    assert again == {p.name: p.stat().st_mtime_ns for p in folder.glob("*.jsonl")}
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    assert {"kitty_long", "kitty_long_512", "kitty_passkey"} <= set(manager.all_tasks)
    run = lambda lm: lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, gen_kwargs="max_gen_toks=4")  # noqa: E731
    hf, fp16 = run(HFLM(pretrained=model, tokenizer=tok, batch_size=2)), run(kitty(tiny, "fp16"))
    for name in names:
        assert [s["resps"] for s in hf["samples"][name]] == [s["resps"] for s in fp16["samples"][name]]
        assert hf["results"][name] == fp16["results"][name]
        # lm-eval's prompt is the sample's input, a space and its answer prefix
        doc = json.loads((folder / f"{name}.jsonl").read_text().splitlines()[0])
        assert fp16["samples"][name][0]["arguments"][0][0] == f"{doc['input']} {doc['gen_prefix']}"
    pro = run(kitty(tiny, "kitty-pro"))
    assert set(pro["results"]) == set(names) and pro["n-samples"][names[0]]["effective"] == 2


def test_cli_writes_the_table(demo, tmp_path, capsys):
    out = tmp_path / "table.json"
    code = main(["--methods", "kivi-k2v2", "--tasks", "passkey", "--lengths", "300", "--samples", "1",
                 "--gen-kwargs", "max_gen_toks=6", "--device", "cpu", "--tasks-dir", str(tmp_path / "tasks"),
                 "--out", str(out)])
    assert code == 0
    settings, df = read_table(out)
    assert settings["methods"] == ["fp16", "kivi-k2v2"] and settings["lengths"] == [300]
    assert set(df.method) == {"fp16", "kivi-k2v2"} and set(df.metric) == {"exact_match"}
    row = df[df.method == "kivi-k2v2"].iloc[0]
    assert row.task == "kitty_passkey_300" and row.kind == "passkey" and row.length == 300 and row.samples == 1
    assert row["diff"] == pytest.approx(row.score - row.fp16) and row.seconds > 0
    assert "kivi-k2v2 - fp16" in summary(df).columns and "kitty_passkey_300" in capsys.readouterr().out


def test_cli_resumes_a_run_with_more_methods(demo, tmp_path, capsys):
    out = tmp_path / "table.json"
    args = ["--tasks", "passkey", "--lengths", "300", "--samples", "1", "--gen-kwargs", "max_gen_toks=6",
            "--device", "cpu", "--tasks-dir", str(tmp_path / "tasks"), "--out", str(out)]
    assert main(["--methods", "fp16", *args]) == 0
    _, first = read_table(out)
    assert main(["--methods", "kivi-k2v2", "--resume", *args]) == 0
    settings, df = read_table(out)
    assert settings["methods"] == ["fp16", "kivi-k2v2"] and list(df.method) == ["fp16", "kivi-k2v2"]
    assert df.seconds[0] == first.seconds[0]  # fp16 was kept, not run again
    assert df["diff"][1] == pytest.approx(df.score[1] - df.score[0])
    capsys.readouterr()
    assert main(["--methods", "kitty", "--resume", *args[:-4], "--samples", "2", *args[-4:]]) == 2
    assert "other settings (samples 1, now 2)" in capsys.readouterr().err
    assert read_table(out)[1].equals(df)  # the refused run wrote nothing


def test_cli_rejects_bad_input(tmp_path, capsys):
    assert main(["--methods", "fp16,kitty+boost_rate=2", "--out", str(tmp_path / "t.json")]) == 2
    assert "boost_rate" in capsys.readouterr().err
    assert main(["--model", "/no/such/model", "--out", str(tmp_path / "t.json")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["--lengths", "100", "--out", str(tmp_path / "t.json")]) == 2
    assert "at least 256" in capsys.readouterr().err


@pytest.mark.parametrize("command, args", [(main, ["--model", "demo"]), (lm_eval_harness.main, ["--help"])],
                         ids=["lm_eval", "lm_eval_harness"])
def test_without_lm_eval_the_commands_say_how_to_install_it(command, args, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    with pytest.raises(SystemExit) as stopped:
        command(args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs lm-eval: pip install -c requirements.txt '.[eval]'" in err
