"""The Triton engine: decode steps attend directly on packed pages through `kernels.decode.decode_attention`.

The engine is the library's side of the kernels: it takes a `KittyLayer` and a model's attention
module and hands the kernels the layer's tensors and sizes (`kernels/` imports nothing of the cache).

A prefill's first chunk (several new tokens, no history) attends in FP16 over itself as the
reference engine does. A later chunk of a prompt prefilled in pieces attends either as the reference
engine does, over a dense FP16 copy of the whole history rebuilt from the pages, or to the history
on the packed pages through the decode kernels and to itself in FP16 (`kernels.prefill.prefill_attention`),
which needs no copy: short chunks take the pages (`SHORT_CHUNK_LAUNCHES`), and a longer one does
when the copy does not fit. A decode step from the host's record stores the new token in FP16, runs
the fused kernel over the layer's state, then packs any buffer that became full (at most once every
G steps). A decode step from device counters (`device_step`, through `kitty::decode_step`) lets the
kernels store the token as they attend, from launches planned once (`kernels.decode.DecodeStep`), and
leaves the packing to the host after the step (`KittyCache.end_step`). Pages are
packed by `kernels.pack` on CUDA (the torch quantizers where a kernel does not apply: the random
rule, other page or head sizes). A model's attention logit softcap (Gemma 2) is applied by the
kernels in every one of these paths, as the reference engine's eager attention applies it.
"""

from __future__ import annotations

import logging
import os

import torch

from kernels import pack
from kernels.decode import DecodeStep, decode_attention, key_dots_of, step_workspace
from kernels.prefill import prefill_attention, prefill_launches

from kernels import cuda_decode

from .reference_engine import ReferenceEngine

# A later prefill chunk attends on the pages when its history takes at most this many decode-kernel
# launches (16 query rows each: 32 tokens of a GQA group of 4), else over the dense FP16 history if
# that fits. On one H200 (Qwen3-8B shapes, kitty-pro, batch 256, a 512-token prompt) the pages took
# a prefill in 32-token chunks from 6.5-8.2 s to 4.9 s and 2.2 GiB less memory, and one in
# 128-token chunks (32 launches a layer and chunk) from 3.8-4.2 s to 5.2-6.6 s.
SHORT_CHUNK_LAUNCHES = 8
PAGE_KERNELS = ("auto", "cuda", "triton")  # which kernel reads the packed pages in decode steps
log = logging.getLogger(__name__)


class TritonEngine(ReferenceEngine):
    name = "triton"
    device_steps = True  # decode steps can run from device counters (kitty_core.graphs)

    def __init__(self, key_dots: str | None = None, pages: str = "auto", tail: str | None = None):
        """`key_dots`: the Triton page kernel's key dots, "fp16" or "int8"; None: by head size
        (`kernels.decode.key_dots_of`). `pages`: which kernel reads the packed pages of decode steps.
        "auto": the CUDA one (`kernels.cuda_decode`, built with nvcc at first use) where it applies,
        else Triton, with one log line at INFO that says why; "cuda": the same, the line a warning;
        "triton": always Triton. Key dots are the Triton kernel's option: given, "auto" means Triton.
        `tail`: which kernel reads the tail (sink, q-buffer, value window) beside the CUDA page kernel,
        "cuda" (None: the default) or "triton". Where Triton reads the pages, its fused step reads the
        tail too: the tail is "triton" under pages="triton", and "cuda" there is a ValueError."""
        if pages not in PAGE_KERNELS:
            raise ValueError(f"pages must be one of {', '.join(PAGE_KERNELS)}, got {pages!r}")
        if tail is not None and tail not in cuda_decode.TAILS:
            raise ValueError(f"tail must be one of {', '.join(cuda_decode.TAILS)}, got {tail!r}")
        if key_dots is not None:
            key_dots_of(key_dots, 0)  # a clear error now, not at the first decode step
            if pages == "cuda":
                raise ValueError(f"key_dots={key_dots} sets the Triton page kernel's dots, and pages=cuda reads the "
                                 "pages with the CUDA kernel (int8 dots): give one or the other")
            pages = "triton"
        if tail == "cuda" and pages == "triton":
            raise ValueError("tail=cuda puts the CUDA tail kernel beside the CUDA page kernel, and Triton reads the "
                             "pages here (pages=triton, or key_dots given), its fused step the tail with them: "
                             "give one or the other")
        self.key_dots, self.pages = key_dots, pages
        self.tail = tail or ("triton" if pages == "triton" else "cuda")
        self._cuda_ok: dict[tuple | str, bool] = {}  # per layer shape: does the CUDA page kernel take it
        self.workspaces: dict[tuple, dict] = {}  # the partials' buffers, by layer shape (`_workspace`)
        self.steps: dict[int, DecodeStep] = {}  # per layer: the launches of steps from device counters

    @staticmethod
    def supports(layer, query) -> bool:
        """The kernels take power-of-two page and head sizes of at least 64 on a GPU (code planes 16 wide
        for the tensor cores) and up to 64 query heads per KV head; anything else attends through the
        reference path."""
        return TritonEngine.takes(layer, query.shape[1], query.is_cuda)

    @staticmethod
    def takes(layer, q_heads: int, cuda: bool) -> bool:
        """`supports` for a layer and a number of query heads, before any query exists."""
        c, d = layer.config, layer.head_dim
        if not (cuda or os.environ.get("TRITON_INTERPRET") == "1"):  # the interpreter takes CPU tensors
            return False
        least = 64 if cuda else 4  # the interpreter has no tensor cores, and takes tiny test shapes
        pow2 = lambda x: x >= least and x & (x - 1) == 0  # noqa: E731
        return c.quantize and pow2(c.group_size) and pow2(d) and q_heads // layer.heads <= 64

    def quantize_keys(self, keys, n_boost, rule, generator, query_rms=None):
        if keys.is_cuda and pack.supported(keys, rule):
            return pack.quantize_keys(keys, n_boost, rule, query_rms)
        return super().quantize_keys(keys, n_boost, rule, generator, query_rms)

    def quantize_values(self, values, bits):
        if values.is_cuda and pack.supported(values):
            return pack.quantize_values(values, bits)
        return super().quantize_values(values, bits)

    @staticmethod
    def chunk_on_pages(layer, module, query) -> bool:
        """Can a chunk of several new tokens attend to the layer's history on its pages? A history
        (a prompt's later chunk), no padding (the chunk's mask is causal, nothing else), no sliding
        window, not during device-driven steps, and a layer and query the kernels take."""
        return (query.shape[2] > 1 and layer.seen > 0 and not any(layer.pad) and layer.steps is None
                and getattr(module, "sliding_window", None) is None and TritonEngine.supports(layer, query))

    def attend(self, layer, module, query, key_new, value_new, attention_mask, scaling, **kwargs):
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        on_pages = self.chunk_on_pages(layer, module, query)
        if on_pages and prefill_launches(query.shape[1] // layer.heads, query.shape[2]) <= SHORT_CHUNK_LAUNCHES:
            return self._chunk_on_pages(layer, query, key_new, value_new, scaling)
        if key_new.shape[2] != 1 or not self.supports(layer, query):
            try:
                out = self.attend_dense(layer, module, query, key_new, value_new, attention_mask, scaling, **kwargs)
            except torch.OutOfMemoryError:
                if not on_pages:
                    raise
                layer.drop_dense_view()  # the history's dense copy does not fit: read it on the pages
                return self._chunk_on_pages(layer, query, key_new, value_new, scaling)
            layer.insert(key_new, value_new)
            if self.supports(layer, query):
                # prefill (or a chunk of it) attended over a dense FP16 view of this layer's history;
                # decode steps read the packed state, so the view is freed, not kept beside it
                layer.drop_dense_view()
            return out
        layer.insert(key_new, value_new, pack=False)
        if self._cuda_pages(layer, query.shape[1], query.dtype, query.device):
            out = cuda_decode.decode_attention(layer, query, scaling, self._workspace(layer), tail=self.tail)
        else:
            out = decode_attention(layer, query, scaling, self._workspace(layer), key_dots=self.key_dots,
                                   softcap=layer.softcap)
        layer.pack_full()
        return out.transpose(1, 2), None  # transformers expects [B, t, Hq, D]

    def _cuda_pages(self, layer, q_heads: int, dtype, device) -> bool:
        """Does the CUDA page kernel read this layer's pages? Decided once per shape (a first call
        builds the kernel), with one log line where it falls back to Triton."""
        if self.pages == "triton":
            return False
        c = layer.config
        key = "softcap" if layer.softcap else (layer.head_dim, c.group_size, layer.n_boost, c.value_bits,
                                                q_heads // layer.heads, dtype, device)
        if key not in self._cuda_ok:
            why = ("it applies no logit softcap" if layer.softcap
                   else cuda_decode.unsupported(*key) or cuda_decode.build(layer.n_boost))
            if why:
                log.log(logging.WARNING if self.pages == "cuda" else logging.INFO,
                        "decode pages on Triton, not the CUDA kernel: %s", why)
            self._cuda_ok[key] = why is None
        return self._cuda_ok[key]

    def prepare_steps(self, layer, q_heads: int) -> list[torch.Tensor]:
        """Before decode steps from device counters: their workspace, allocated now (returned), and a
        fresh launch plan (the state it was built on may have moved)."""
        ws = self._workspace(layer)
        if self._cuda_pages(layer, q_heads, layer.dtype, layer.device):
            self.steps[layer.layer_idx] = cuda_decode.DecodeStep(layer, ws, tail=self.tail)
            return cuda_decode.step_workspace(layer, q_heads, ws)
        self.steps[layer.layer_idx] = DecodeStep(layer, ws, self.key_dots, layer.softcap)
        return step_workspace(layer, q_heads, ws)

    def _workspace(self, layer) -> dict:
        """The partials' buffers of a layer's decode attention, one set for all layers of its shape: a
        layer's combine reads them before the next layer's kernels write them (stream order; the tail's
        second stream joins before the combine). One set per layer would hold (layers - 1) x the
        partials more, memory that a batch near the GPU's limit needs for pages. One set per device, for
        the layers of a model split over several by a device_map."""
        return self.workspaces.setdefault((layer.batch, layer.heads, layer.head_dim, layer.dtype, layer.device), {})

    def device_step(self, layer, query, key_new, value_new, scaling: float) -> torch.Tensor:
        """A decode step from device counters (`kitty::decode_step`): query [B, Hq, 1, D] ->
        [B, 1, Hq, D]. The kernels write the token at the counters' positions as they attend; the
        host's record and any packing follow after the step (`KittyCache.end_step`)."""
        if layer.config.selection == "qk":
            layer.track_step_queries(query)
        return self.steps[layer.layer_idx](query, key_new, value_new, scaling).transpose(1, 2)

    def _chunk_on_pages(self, layer, query, key_new, value_new, scaling):
        out = prefill_attention(layer, query, *layer.as_stored(key_new, value_new), scaling, self.key_dots,
                                layer.softcap)
        layer.insert(key_new, value_new)
        layer.drop_dense_view()
        return out.transpose(1, 2), None
