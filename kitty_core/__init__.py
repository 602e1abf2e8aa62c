"""Kitty: 2-bit KV cache quantization with channel-wise precision boost, for transformers models."""

from .cache import KittyCache
from .config import PRESETS, KittyConfig, parse_method
from .hf import UnsupportedModelError
from .models import LoadedModel, ModelLoadError, load_model

__all__ = ["KittyCache", "KittyConfig", "PRESETS", "parse_method", "load_model", "LoadedModel", "ModelLoadError",
           "UnsupportedModelError"]
