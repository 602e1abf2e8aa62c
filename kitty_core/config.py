"""Method configuration: one frozen dataclass, named presets, and the `preset+field=value` spelling.

A method is a `KittyConfig`. The paper's family (Kitty, arXiv 2511.18643, sections 3-4) is spanned by
a few fields: the bit widths of keys and values, the fraction of key channels boosted from 2 to 4
bits, the FP16 sink of the first tokens, the page (quantization group) size and the FP16 local
window of the newest values. `quantize=False` is the FP16 reference. One field goes beyond the
paper: `tail_bits=8` keeps that tail (sink, window, and the keys and values waiting for a page) in
int8, one scale a vector, half its bytes (`kitty_core/regions.py`).

Spelling used by the CLI and the app: a preset name, optionally followed by overrides joined with
`+`, e.g. `kitty-pro+selection=random` or `kitty+boost_rate=0.5`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SELECTION_RULES = ("magnitude", "random", "range", "qk")  # see quant.channel_scores


@dataclass(frozen=True)
class KittyConfig:
    quantize: bool = True  # False: the FP16 reference (no pages at all)
    key_bits: int = 2  # 2: INT2 keys, some channels boosted to INT4; 4: every key channel INT4
    value_bits: int = 2  # per-token value quantization, 2 or 4 bits
    boost_rate: float = 0.125  # fraction of key channels per page stored at 4 bits (Kitty 12.5%, Pro 25%)
    sink: int = 32  # S: the first S tokens of every sequence stay FP16 (keys and values)
    group_size: int = 128  # G: tokens per page; keys get one scale/zero per channel per page
    local_window: int = 128  # R: the newest R values stay FP16
    tail_bits: int = 16  # the tail (sink, q-buffers, window) as computed (16), or int8 a vector with an fp32 scale (8)
    selection: str = "magnitude"  # how boosted channels are chosen per page: magnitude | random | range | qk
    seed: int = 0  # for selection="random"
    allocation: str = ""  # a calibration file (`kitty_core.calibrate`): boosted channels per layer, same average

    def __post_init__(self):
        _check(isinstance(self.quantize, bool), "quantize", self.quantize, "True or False")
        for name in ("key_bits", "value_bits"):
            v = getattr(self, name)
            _check(v in (2, 4), name, v, "one of {2, 4}")
        _check(
            isinstance(self.boost_rate, (int, float)) and 0.0 <= self.boost_rate <= 1.0,
            "boost_rate", self.boost_rate, "a number in [0, 1]",
        )
        for name in ("sink", "local_window"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 0, name, v, "an integer >= 0")
        _check(
            isinstance(self.group_size, int) and self.group_size >= 4 and self.group_size % 4 == 0,
            "group_size", self.group_size, "a positive multiple of 4 (four 2-bit codes per byte)",
        )
        _check(self.tail_bits in (8, 16) and (self.quantize or self.tail_bits == 16), "tail_bits", self.tail_bits,
               "16, or 8 for a quantized method (the FP16 reference keeps every token as computed)")
        _check(self.selection in SELECTION_RULES, "selection", self.selection, f"one of {SELECTION_RULES}")
        _check(not self.allocation or (self.quantize and self.key_bits == 2), "allocation", self.allocation,
               "empty for a method without INT2 keys to boost")

    def boosted_channels(self, head_dim: int) -> int:
        """Number of key channels stored at 4 bits in every page (all of them when key_bits=4); with an
        `allocation`, the average over layers (each layer's count is in the file, `allocation.check`)."""
        if self.key_bits == 4:
            return head_dim
        return int(round(self.boost_rate * head_dim))

    def token_bytes(self, head_dim: int) -> dict[str, float]:
        """Bytes per paged token and KV head (keys and values): the planes, and their metadata.

        Keys: D/4 + b/4 bytes of planes, b/G boost index (a byte per boosted channel) + 4D/G FP16
        scale and zero per channel per page; values: D * value_bits / 8 bytes of planes + 4 (FP16 scale and zero per token)."""
        d = head_dim
        if not self.quantize:
            return {"payload": 4.0 * d, "metadata": 0.0}
        g = self.group_size
        payload = d / 4 + self.boosted_channels(d) / 4 + d * self.value_bits / 8
        return {"payload": payload, "metadata": self.boosted_channels(d) / g + 4 * d / g + 4}

    def bits_per_element(self, head_dim: int) -> float:
        """Average stored bits per cached key/value element of a page, metadata included."""
        tb = self.token_bytes(head_dim)
        return (tb["payload"] + tb["metadata"]) * 8 / (2 * head_dim)

    def replace(self, **changes) -> "KittyConfig":
        return dataclasses.replace(self, **changes)


def _check(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


PRESETS: dict[str, KittyConfig] = {
    "fp16": KittyConfig(quantize=False),
    "kivi-k4v4": KittyConfig(key_bits=4, value_bits=4, boost_rate=0.0, sink=0),
    "kivi-k2v2": KittyConfig(key_bits=2, value_bits=2, boost_rate=0.0, sink=0),
    "kivi-k2v2-sink": KittyConfig(key_bits=2, value_bits=2, boost_rate=0.0),
    "k4v2-sink": KittyConfig(key_bits=4, value_bits=2, boost_rate=0.0),
    "k2v4-sink": KittyConfig(key_bits=2, value_bits=4, boost_rate=0.0),
    "kitty": KittyConfig(boost_rate=0.125),
    "kitty-pro": KittyConfig(boost_rate=0.25),
}

_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(KittyConfig)}


def parse_method(spec: str | KittyConfig) -> KittyConfig:
    """`kitty-pro+selection=random` -> KittyConfig. Raises ValueError naming what is wrong."""
    if isinstance(spec, KittyConfig):
        return spec
    name, *overrides = [p.strip() for p in str(spec).split("+")]
    if name not in PRESETS:
        raise ValueError(f"unknown method preset {name!r}; choose one of {', '.join(PRESETS)}")
    changes = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in _FIELD_TYPES:
            raise ValueError(
                f"bad override {item!r} in {spec!r}: write field=value with a field among {', '.join(_FIELD_TYPES)}"
            )
        changes[key] = _coerce(key, raw.strip())
    config = PRESETS[name].replace(**changes) if changes else PRESETS[name]
    ignored = sorted(set(changes) - {"quantize"}) if not config.quantize else []
    if ignored:  # an FP16 cache has no pages: a page setting would be accepted and do nothing
        raise ValueError(f"{', '.join(ignored)} in {spec!r} would be ignored: {name} keeps every token in FP16 "
                         "(no pages, nothing quantized); drop the override or pick a quantized preset")
    return config


def _coerce(key: str, raw: str):
    kind = _FIELD_TYPES[key]
    try:
        if kind == "bool":
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return raw
    except ValueError:
        raise ValueError(f"{key} must be a {kind}, got {raw!r}") from None

