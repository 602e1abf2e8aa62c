import pytest

from kitty_core.passkey import passkey_prompt, retrieved, run_passkey, summary


def test_prompt_length_and_depth(demo):
    tok = demo.tokenizer
    for depth in (0.0, 0.5, 1.0):
        p = passkey_prompt(tok, 1000, depth, "12345")
        n = len(tok(p).input_ids)
        assert 950 <= n <= 1000
        at = p.index("12345") / len(p)
        assert abs(at - depth) < 0.1
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tok, 20, 0.5, "12345")


def test_retrieved_needs_the_exact_number():
    assert retrieved(" 12345. Remember", "12345")
    assert not retrieved("1234566", "12345") and not retrieved("1234", "12345") and not retrieved("none", "12345")


def test_fp16_retrieves_the_key_at_1k(demo):
    df = run_passkey(demo.model, demo.tokenizer, "fp16,kitty-pro", [1024], depths=(0.5,), seed=0)
    assert len(df) == 2 and df.prompt_tokens.max() <= 1024
    assert summary(df).loc["fp16", 1024] == 1.0
    with pytest.raises(ValueError, match="context"):
        run_passkey(demo.model, demo.tokenizer, "fp16", [9000])
