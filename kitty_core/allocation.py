"""The allocation file: how many key channels each layer of a model boosts, as `calibrate` writes it
and a method names it (`kitty-pro+allocation=<file>`), read and checked against the model and method."""

from __future__ import annotations

import functools
import json
from pathlib import Path

FORMAT = "kitty-allocation/1"


@functools.lru_cache(maxsize=16)
def read(path: str) -> dict:
    """An allocation file, checked for its own consistency (ValueError naming what is wrong)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the allocation file {path}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an allocation file ({FORMAT}); write one with python -m kitty_core.calibrate")
    try:
        counts, shape, rate = data["channels_per_layer"], data["shape"], float(data["boost_rate"])
        d, layers = int(shape["head_dim"]), int(shape["layers"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path} lacks {err}: write it again with python -m kitty_core.calibrate") from None
    if (len(counts) != layers or any(not isinstance(c, int) or not 0 <= c <= d for c in counts)
            or sum(counts) != int(round(rate * d)) * layers):
        raise ValueError(f"{path}: channels_per_layer must be {layers} counts in [0, {d}] summing to the budget "
                         f"({int(round(rate * d))} x {layers}); write it again with python -m kitty_core.calibrate")
    return data


def check(path: str, config, shape: dict) -> list[int]:
    """The per-layer counts of allocation file `path` for a method `config` on a model of `shape`
    (`models.model_shape`); ValueError saying which does not match."""
    data = read(path)
    want = {k: data["shape"].get(k) for k in ("layers", "kv_heads", "head_dim")}
    have = {k: shape.get(k) for k in want}
    if want != have:
        raise ValueError(f"{path} was calibrated on {data.get('model')!r} ({want}); this model has {have}: "
                         "calibrate it with python -m kitty_core.calibrate")
    if abs(float(data["boost_rate"]) - config.boost_rate) > 1e-9 or config.key_bits != 2:
        raise ValueError(f"{path} spends boost_rate {data['boost_rate']} ({data.get('method')}); the method boosts "
                         f"{config.boost_rate if config.key_bits == 2 else 'every channel'}: name it on a method of "
                         "that boost rate, or calibrate for this one")
    return list(data["channels_per_layer"])
