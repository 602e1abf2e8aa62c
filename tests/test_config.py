import pytest

from kitty_core.config import PRESETS, KittyConfig, parse_method


def test_presets_are_the_papers_methods():
    assert set(PRESETS) == {"fp16", "kivi-k4v4", "kivi-k2v2", "kivi-k2v2-sink", "k4v2-sink", "k2v4-sink",
                            "kitty", "kitty-pro"}
    assert PRESETS["kitty"].boost_rate == 0.125 and PRESETS["kitty-pro"].boost_rate == 0.25
    assert PRESETS["kivi-k2v2"].sink == 0 and PRESETS["kivi-k2v2-sink"].sink == 32
    assert PRESETS["k4v2-sink"].boosted_channels(128) == 128
    assert PRESETS["kitty-pro"].boosted_channels(128) == 32
    assert not PRESETS["fp16"].quantize
    d = KittyConfig()
    assert (d.sink, d.group_size, d.local_window) == (32, 128, 128)


def test_bits_per_element_matches_the_byte_budget():
    # D=128, G=128, 25% boost -> keys 32+8 (planes) + 4 (scale, zero) + 32/128 (boost index), values
    # 32+4 bytes per token and head = 80.25 bytes (DESIGN.md's 81 counts a D-byte boost index)
    assert PRESETS["kitty-pro"].bits_per_element(128) == pytest.approx(80.25 * 8 / 256)
    assert PRESETS["kivi-k2v2"].bits_per_element(128) == pytest.approx(72 * 8 / 256)
    assert PRESETS["fp16"].bits_per_element(128) == 16


def test_parse_method_overrides():
    c = parse_method("kitty-pro+selection=random")
    assert c.selection == "random" and c.boost_rate == 0.25
    assert parse_method("kitty+boost_rate=0.5").boost_rate == 0.5
    assert parse_method(" kitty + sink=0 + group_size=64").group_size == 64
    assert parse_method("kitty") is PRESETS["kitty"]


@pytest.mark.parametrize("spec, words", [
    ("kitty+boost_rate=1.5", ["boost_rate", "1.5", "[0, 1]"]),
    ("kitty+key_bits=3", ["key_bits", "3", "{2, 4}"]),
    ("kitty+value_bits=8", ["value_bits", "8"]),
    ("kitty+group_size=30", ["group_size", "30", "multiple of 4"]),
    ("kitty+sink=-1", ["sink", "-1", ">= 0"]),
    ("kitty+local_window=-5", ["local_window", "-5"]),
    ("kitty+selection=best", ["selection", "best"]),
    ("kitty+boost_rate=lots", ["boost_rate", "float", "lots"]),
    ("kitty+colour=red", ["colour", "field=value"]),
    ("kitty-ultra", ["kitty-ultra", "kitty-pro"]),
])
def test_invalid_values_name_field_value_and_range(spec, words):
    with pytest.raises(ValueError) as err:
        parse_method(spec)
    for w in words:
        assert w in str(err.value)
