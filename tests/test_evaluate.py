import json

import pytest
import torch

from kitty_core.evaluate import compare, main, text_windows


def test_compare_on_known_distributions():
    ref = torch.log_softmax(torch.tensor([[[2.0, 0.0, 0.0]]]), -1)
    same = compare(ref, ref, torch.tensor([[0]]))
    assert same["kl"] == pytest.approx(0.0) and same["top1"] == 1.0
    flat = torch.log(torch.full((1, 1, 3), 1 / 3))
    other = compare(ref, flat, torch.tensor([[0]]))
    p = ref.exp()[0, 0]
    assert other["kl"] == pytest.approx(float((p * (p.log() - torch.log(torch.tensor(1 / 3)))).sum()), rel=1e-5)
    assert other["perplexity"] == pytest.approx(3.0)


def test_windows_are_spread_over_the_text(demo):
    ids = text_windows(demo.tokenizer, "word " * 1000, 100, 20, 3)
    assert ids.shape == (3, 120)
    with pytest.raises(ValueError, match="tokens"):
        text_windows(demo.tokenizer, "too short", 100, 20, 3)


def test_cli_scores_methods_through_the_cache(demo, tmp_path, capsys):
    out = tmp_path / "acc.json"
    code = main(["--context", "400", "--continuation", "24", "--windows", "2", "--device", "cpu",
                 "--methods", "fp16,kivi-k2v2,kitty-pro", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "kitty-pro" in printed and "perplexity" in printed
    res = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(res) == {"fp16", "kivi-k2v2", "kitty-pro"}
    assert res["fp16"]["kl"] == 0 and res["fp16"]["top1"] == 1
    assert res["kivi-k2v2"]["kl"] > res["kitty-pro"]["kl"] > 0
    assert all({"method", "perplexity", "kl", "top1"} <= set(r) for r in res.values())


def test_cli_rejects_a_bad_method(capsys):
    assert main(["--methods", "fp16,kitty+boost_rate=2"]) == 2
    assert "boost_rate" in capsys.readouterr().err


def test_generations_against_fp16(demo):
    from kitty_core.generate import compare_generations

    texts, kl = compare_generations(demo.model, demo.tokenizer, "The capital of France is", ["kivi-k2v2", "kitty-pro"], 12)
    assert list(texts.method) == ["fp16", "kivi-k2v2", "kitty-pro"]
    assert texts.first_divergence.isna()[0] and "Paris" in texts.text[0]
    assert str(texts.first_divergence.dtype) == "Int64"  # positions stay integers beside "never departs"
    assert len(kl) == 2 * 12 and (kl.kl >= -1e-6).all()
    with pytest.raises(ValueError, match="empty"):
        compare_generations(demo.model, demo.tokenizer, "  ", ["kitty"])
    with pytest.raises(ValueError, match="context"):
        compare_generations(demo.model, demo.tokenizer, "hi", ["kitty"], 9000)


def test_pareto_front_keeps_the_best_at_each_budget():
    import pandas as pd

    from kitty_core.evaluate import pareto_front

    df = pd.DataFrame({"method": list("abcdef"), "bits_per_element": [2.5, 2.5, 2.63, 2.63, 3.4, 2.9],
                       "kl": [0.10, 0.08, 0.05, 0.09, 0.001, 0.06], "top1": [0.80, 0.82, 0.88, 0.81, 0.99, 0.87]})
    # b beats a at 2.5 bits; d costs what c costs and does worse; f costs more than c and does worse
    assert pareto_front(df).method.tolist() == ["b", "c", "e"]
    assert pareto_front(df, error="top1", lower_is_better=False).method.tolist() == ["b", "c", "e"]
    assert pareto_front(df.iloc[:0]).empty


def test_a_method_that_changes_more_than_the_boost_is_a_curve_of_its_own():
    from kitty_core.evaluate import curve_rule

    assert curve_rule("kitty-pro+selection=qk") == "qk"
    assert curve_rule("kitty-pro+selection=qk+allocation=data/allocations/demo_kitty-pro.json") == "qk + allocation"
    assert curve_rule("kitty+allocation=data/allocations/demo_kitty.json") == "magnitude + allocation"
    assert curve_rule("kitty+selection=qk+boost_rate=0.3125+group_size=256") == "qk + group_size=256"
    assert curve_rule("kitty-pro+sink=8+local_window=32") == "magnitude + sink=8 + local_window=32"
    assert curve_rule("k4v2-sink") == curve_rule("kivi-k2v2") == "preset"
