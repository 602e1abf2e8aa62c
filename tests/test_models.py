import pytest
import torch

from conftest import tiny_model
from kitty_core.hf import num_attention_layers
from kitty_core.models import ModelLoadError, cache_dir, load_model


def test_demo_model_shape_and_defaults(demo):
    assert demo.shape == {"model_type": "llama", "layers": 30, "q_heads": 9, "kv_heads": 3, "head_dim": 64,
                          "context": 8192}
    assert demo.device.type == "cpu" and demo.dtype == torch.float32
    assert demo.tokenizer.padding_side == "left" and demo.tokenizer.pad_token is not None
    # the GGUF was converted once and kept
    assert any((p / "config.json").is_file() for p in (cache_dir() / "gguf").iterdir())
    ids = demo.tokenizer("The capital of France is", return_tensors="pt")
    out = demo.model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in demo.tokenizer.decode(out[0])


def test_a_gguf_is_parsed_once_in_its_conversion(monkeypatch, tmp_path):
    """transformers reads a GGUF's metadata for the tokenizer, the config and the weights: the
    conversion has gguf parse it once (four parses took the demo model's conversion to 18.4 s on a
    2-core CPU, against 7.1 s), gives the loaded model the demo's shape, and leaves gguf as it found it."""
    import gguf

    from kitty_core.models import demo_gguf_path

    parsed = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    monkeypatch.setenv("KITTY_CACHE_DIR", str(tmp_path))
    name_map = gguf.get_tensor_name_map
    lm = load_model(str(demo_gguf_path()), device="cpu")
    assert parsed == [str(demo_gguf_path())]
    assert lm.shape["layers"] == 30 and lm.tokenizer("Paris").input_ids
    assert gguf.GGUFReader is Counted and gguf.get_tensor_name_map is name_map


def test_local_directory(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 3, "[UNK]": 0}, unk_token="[UNK]")),
                                  eos_token="[UNK]")
    tok.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device="cpu", dtype="bfloat16")
    assert lm.dtype == torch.bfloat16 and lm.shape["model_type"] == "qwen3" and lm.shape["kv_heads"] == 2


@pytest.mark.parametrize("name, words", [
    ("", ["no model given"]),
    ("/nowhere/model", ["looks like a path"]),
    ("/nowhere/model.gguf", ["does not exist"]),
    ("no-such-org/no-such-model", ["could not load", "no-such-org/no-such-model", "hub"]),
])
def test_bad_names_give_one_clear_error(name, words):
    with pytest.raises(ModelLoadError) as err:
        load_model(name, device="cpu")
    for w in words:
        assert w in str(err.value)


def test_bad_dtype_and_missing_demo_copy(monkeypatch):
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model("demo", device="cpu", dtype="int3")
    monkeypatch.setenv("KITTY_DEMO_GGUF", "/nowhere/smol.gguf")
    with pytest.raises(ModelLoadError, match="KITTY_DEMO_GGUF"):
        load_model("demo", device="cpu")


def test_architectures_without_a_kv_cache_are_refused():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match="without a key/value cache"):
        num_attention_layers(cfg)
