"""The Kitty KV cache for transformers: a `Cache` of Kitty layers (`layer.py`), built for a model.

`KittyCache(model, "kitty-pro")` checks the model is one the cache serves (`hf.check_supported`),
switches its attention to the `kitty` implementation, makes one `KittyLayer` per attention layer
(a sliding-window layer keeps only its window), and, on an engine that can, runs decode steps from
device counters so that `generate` compiles them (`graphs.py`, `ops.py`). Its memory report counts
what the layers store.
"""

from __future__ import annotations

import pandas as pd
from transformers.cache_utils import Cache

from . import allocation, ops
from .config import KittyConfig, parse_method
from .engines import available_engines, make_engine
from .graphs import StepCounters, cudagraph_trees_for_this_thread
from .hf import check_supported, enable_kitty_attention, layer_windows, model_shape, softcapping
from .layer import SLIDING, TAIL_PARTS, KittyLayer


_STORED_AS = {  # what the packed parts are (kernels/pages.py); every other part holds the model's dtype
    "key dense plane": "2-bit codes", "key high plane": "2-bit codes", "value planes": "2-bit codes",
    "key boost index": "channel index", "key scales/zeros": "float16", "value scales/zeros": "float16",
}


class KittyCache(Cache):
    """A transformers `Cache` of Kitty layers. `KittyCache(model, "kitty-pro")`, then
    `model.generate(..., past_key_values=cache)`. Building one switches the model's attention to the
    `kitty` implementation (SDPA for everything that is not a KittyCache).

    On the Triton engine, decode steps run from device counters as soon as the prompt is stored
    (`begin_device_steps_if_possible`): they read nothing from the host's record, so the cache is
    compileable and `generate` decodes through transformers' compiled forward, replayed from CUDA
    graphs (`ops`). A prefill (a later turn of a conversation) goes back to host steps for itself."""

    def __init__(self, model, method: str | KittyConfig = "kitty", engine: str | None = None,
                 max_length: int | None = None, device_steps: bool = True, fp16_layers=()):
        """`max_length` (tokens per sequence, prompt included): reserve the page pools up front, so
        that memory use is known from the first step and pools never grow by doubling. Without it,
        device-driven steps reserve room for twice the tokens held when they begin, and begin anew
        (the compiled step records its CUDA graphs again) when that is used up. `device_steps=False`
        keeps every step on the host's record (eager only, as the reference engine runs).
        `fp16_layers`: indices of layers kept wholly in FP16 while the others use `method`, to see
        which layers a method's error comes from; such a cache steps from the host's record.

        A `max_length` beyond the model's context is refused. Without one, the cache cannot know how
        far a generation goes: past the context it goes on as transformers does (which warns)."""
        check_supported(model)
        context = model_shape(model.config)["context"]
        if max_length is not None and context and max_length > context:
            raise ValueError(f"max_length={max_length} is beyond the model's context of {context} tokens: keep the "
                             f"prompt and the new tokens within {context}")
        self.config = parse_method(method)
        fp16_layers = set(fp16_layers)
        self.device_steps = device_steps and not fp16_layers
        if engine is None:
            engine = "triton" if _on_cuda(model) and "triton" in available_engines() else "reference"
        self.engine = make_engine(engine)
        enable_kitty_attention(model)
        if _on_cuda(model):  # `generate` may compile its steps in this thread
            cudagraph_trees_for_this_thread()
        windows = layer_windows(model.config)
        n = len(windows)
        if not fp16_layers <= set(range(n)):
            raise ValueError(f"fp16_layers must be layer indices in [0, {n - 1}], got {sorted(fp16_layers)}")
        shape = model_shape(model.config)
        # query heads per KV head: under tensor parallel a rank's layers hold a slice of the KV heads
        # (`sharding`), and the kernels take that rank's query heads, this many per KV head it holds
        self.group = shape["q_heads"] // shape["kv_heads"]
        self.q_heads = shape["q_heads"]
        self.counters = None
        self._layout = None  # the state's addresses the counters' CUDA graphs were recorded against
        self.softcap = softcapping(model.config)
        fp16 = parse_method("fp16")
        layers = [KittyLayer(fp16 if i in fp16_layers else self.config, self.engine, i, max_length, owner=self,
                             window=w) for i, w in enumerate(windows)]
        layers[-1].last = True
        for layer in layers:
            layer.softcap = self.softcap
        if self.config.allocation:  # boosted channels per layer from a calibration of this model
            boosts = allocation.check(self.config.allocation, self.config, model_shape(model.config))
            if len(boosts) != n:
                raise ValueError(f"{self.config.allocation} has {len(boosts)} layers' counts; this model has {n} "
                                 "attention layers")
            for layer, boost in zip(layers, boosts):
                layer.boost = boost
        super().__init__(layers=layers)

    @property
    def is_compileable(self) -> bool:
        """Can `generate` compile the decode step? On an engine that steps from device counters."""
        return (self.device_steps and self.config.quantize and getattr(self.engine, "device_steps", False)
                and not any(layer.is_sliding for layer in self.layers))

    def memory_report(self) -> pd.DataFrame:
        """Stored bytes by part, summed over layers, with bytes per real token and what each part is
        stored as: the tail's parts (and every token of the "fp16" preset) hold the model's own dtype,
        float32 for a model loaded in fp32, twice an FP16 cache's bytes; an 8-bit tail (`tail_bits=8`)
        int8 codes and their scales. A part stored differently in different layers names each way."""
        totals: dict[str, int] = {}
        stored: dict[str, set[str]] = {}
        for layer in self.layers:
            if layer.is_initialized:
                dtype = str(layer.dtype).removeprefix("torch.")
                tail = dtype if layer.k_sink.scale is None else "int8, an fp32 scale a vector"
                for part, n in layer.nbytes().items():
                    totals[part] = totals.get(part, 0) + n
                    name = part.removeprefix(SLIDING)
                    stored.setdefault(part, set()).add(_STORED_AS.get(name, tail if name in TAIL_PARTS else dtype))
        tokens = sum(self.layers[0].tokens(b) for b in range(self.layers[0].batch)) if self.is_initialized else 0
        df = pd.DataFrame({"part": list(totals), "bytes": list(totals.values())})
        df["bytes_per_token"] = df["bytes"] / max(tokens, 1)
        # a part's storage in every layer that holds it: an 8-bit tail's full-precision layers (the
        # "fp16_layers", a short sliding window) keep the model's dtype beside the others' int8
        df["stored_as"] = [" or ".join(sorted(stored[part])) for part in df["part"]]
        return df

    def nbytes(self) -> int:
        return int(self.memory_report()["bytes"].sum())

    def steps_to_pack(self) -> int | None:
        """Decode steps (one token per sequence) until the one that packs pages: 1 if the next step
        does. None for a cache that never packs (FP16) or a padded batch, whose sequences pack at
        different steps."""
        first = next((layer for layer in self.layers if not layer.is_sliding), self.layers[0])
        c = first.config
        if not c.quantize or not first.is_initialized or any(first.pad) or min(first.k_sink.lens) < c.sink:
            return None
        return min(c.group_size - first.k_buffer.lens[0], c.local_window + c.group_size - first.v_window.lens[0])

    # -- decode steps from device counters (the protocol of kitty_core.graphs) --------------------
    def device_steps_refusal(self, reserve: bool = False) -> str | None:
        """Why the next decode steps cannot run from device counters (None if they can). `reserve`:
        the pools may be reserved further when the steps begin."""
        first = self.layers[0]
        if not first.is_initialized:
            return "it is empty: prefill it first"
        if not self.config.quantize or not getattr(self.engine, "device_steps", False):
            return f"the {self.engine.name!r} engine attends from host state; the Triton engine (CUDA) can"
        if any(layer.is_sliding for layer in self.layers):
            return ("this model has sliding-window layers, which the Triton kernels do not take (they attend to every "
                    "token a layer holds): its steps attend through the reference path")
        devices = {layer.device for layer in self.layers if layer.is_initialized}
        if len(devices) > 1:
            # the counters a step reads live on one device, and one CUDA graph captures one device's work
            return (f"its layers are on {len(devices)} devices (a device_map): its steps attend from host state, "
                    "each layer on its own device")
        if not self.engine.takes(first, self.group * first.heads, first.device.type == "cuda"):
            return (f"the Triton kernels do not take this shape (page size {self.config.group_size}, head size "
                    f"{first.head_dim}: powers of two >= 64 on a GPU), so its steps attend from host state")
        if first.max_length is None and not reserve:
            return "it was built without max_length, so its page pools may grow (and move)"
        if min(first.k_sink.lens) < self.config.sink:
            return f"an FP16 sink is not full yet: every prompt needs at least {self.config.sink} tokens"
        if self.device_room() <= 0 and (not reserve or first.max_length is not None):
            # with max_length the pools are not reserved further ahead of need: a cache built for
            # the GPU's whole memory holds its last tokens on host steps, which grow it only if a
            # token more comes
            return "it holds the max_length it was built for"
        return None

    def begin_device_steps(self, by_operator: bool = False) -> None:
        """Decode steps from device counters from now on (ValueError saying why not). `by_operator`:
        each step ends with `kitty::end_step` (the model's forward does the host's part, `ops`), and
        the pools are reserved further if the held tokens fill them; otherwise the caller advances
        the counters and calls `after_device_step` (`GraphedDecoder`)."""
        why = self.device_steps_refusal(reserve=by_operator)
        if why:
            raise ValueError(f"this KittyCache cannot decode from device counters: {why}")
        first = self.layers[0]
        held = max(self.held_tokens())
        if first.capacity is None or held >= first.capacity:
            for layer in self.layers:  # twice what is held: as many re-recordings as doublings
                layer.reserve(max(2 * held, held + 2 * self.config.group_size))
        layout = []
        for layer in self.layers:  # what the steps' graphs will hold, where it is
            layer.k_pages.reserve_slots(layer.capacity_slots())
            layer.v_pages.reserve_slots(layer.capacity_slots())
            tensors = layer.state_tensors() + self.engine.prepare_steps(layer, self.group * layer.heads)
            layout += [t.data_ptr() for t in tensors]
        if self.counters is None or layout != self._layout or by_operator != self.counters.by_operator:
            if self.counters is not None:
                ops.unregister(self)
            # new counters, at a new address: a compiled step records its CUDA graphs again for them
            self.counters = StepCounters(first.batch, 2, first.device, by_operator)
            self._layout = layout
        ops.register(self)
        for layer in self.layers:
            layer.start_steps(self.counters)
        self.sync_device_steps()

    def begin_device_steps_if_possible(self) -> None:
        """After a forward from the host's record: steps from device counters from the next one, on an
        engine that can take them."""
        if self.device_steps and self.layers[0].steps is None and self.device_steps_refusal(reserve=True) is None:
            self.begin_device_steps(by_operator=True)

    def sync_device_steps(self) -> None:
        first = self.layers[0]
        self.counters.set([first.k_buffer.lens, first.v_window.lens], [n + 1 for n in self.held_tokens()])

    def end_device_steps(self) -> None:
        for layer in self.layers:
            layer.start_steps(None)

    def end_step(self) -> None:
        """The host's part of a decode step the model's forward ran from device counters
        (`kitty::end_step`): counters advanced, the host's record, packing. When the reserved room is
        used up, more is reserved and the steps begin anew (new counters: the next compiled step
        records its CUDA graphs again, without recompiling); a cache built with `max_length` ends its
        device-driven steps instead (the next compiled step, if any, is traced for the host path)."""
        self.counters.advance()
        self.after_device_step()
        if self.device_room() <= 0:
            if self.layers[0].max_length is None:
                self.begin_device_steps(by_operator=True)
            else:  # full at the length it was built for: a step more (if any) from the host's record
                self.end_device_steps()

    def step_shape(self) -> None:
        """Every device-driven step launches the same kernels (grids span the capacity): one graph."""
        return None

    def held_tokens(self) -> list[int]:
        first = self.layers[0]
        return [first.tokens(b) for b in range(first.batch)]

    def device_room(self) -> int:
        """Decode steps left before the longest sequence fills the room reserved for it."""
        return (self.layers[0].capacity or 0) - max(self.held_tokens())

    def after_device_step(self) -> None:
        packed = [layer.advance_host() for layer in self.layers]
        if any(packed):
            self.sync_device_steps()


def _on_cuda(model) -> bool:
    try:
        return next(model.parameters()).is_cuda
    except (StopIteration, AttributeError):
        return False
