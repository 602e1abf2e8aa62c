"""Kitty: 2-bit KV cache quantization with channel-wise precision boost, for transformers models.

The names below load on first use (PEP 562), so that `python -m kitty_core.evaluate --help` and the
other command lines answer before torch is imported.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {"KittyCache": "cache", "KittyConfig": "config", "PRESETS": "config", "parse_method": "config",
            "load_model": "models", "LoadedModel": "models", "ModelLoadError": "models",
            "shipped_text": "texts", "UnsupportedModelError": "hf"}

__all__ = ["KittyCache", "KittyConfig", "PRESETS", "parse_method", "load_model", "LoadedModel", "ModelLoadError",
           "shipped_text", "UnsupportedModelError"]

if TYPE_CHECKING:
    from .cache import KittyCache
    from .config import PRESETS, KittyConfig, parse_method
    from .models import LoadedModel, ModelLoadError, load_model
    from .hf import UnsupportedModelError
    from .texts import shipped_text


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
