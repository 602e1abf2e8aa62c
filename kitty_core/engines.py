"""The engines by name: which attention implementation a cache's layers call, and which this machine has."""

from __future__ import annotations

import torch

from .reference_engine import ReferenceEngine


ENGINES = {"reference": ReferenceEngine}


def make_engine(name: str):
    """An engine by name: "reference", or "triton" with options as "+name=value", e.g.
    "triton+key_dots=int8", "triton+pages=triton" or "triton+tail=triton" (`TritonEngine`)."""
    base, *opts = name.split("+")
    if base == "triton":
        from .triton_engine import TritonEngine  # optional: needs a GPU build of Triton

        kwargs = {}
        for opt in opts:
            key, eq, value = opt.partition("=")
            if key not in ("key_dots", "pages", "tail") or not eq:
                raise ValueError(f"the triton engine takes the options key_dots=..., pages=... and tail=..., got "
                                 f"{opt!r} in {name!r}")
            kwargs[key] = value
        return TritonEngine(**kwargs)
    if base not in ENGINES or opts:
        raise ValueError(f"engine must be one of {sorted([*ENGINES, 'triton'])} (triton with +key_dots=...), "
                         f"got {name!r}")
    return ENGINES[name]()


def available_engines() -> list[str]:
    engines = ["reference"]
    if torch.cuda.is_available():
        try:
            from . import triton_engine  # noqa: F401

            engines.append("triton")
        except ImportError:
            pass
    return engines
