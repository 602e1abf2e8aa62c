"""Kernel launches built once and replayed with new tensors, without Triton's per-call dispatch.

A Triton launch from Python (`kernel[grid](*args)`) binds every argument, computes a specialization
key from each (dtype, alignment, divisibility by 16) and looks up the compiled kernel: tens of
microseconds for the decode kernels' ~70 arguments, three times per layer and step. Steps from
device counters launch the same kernels with the same arguments at every step but for a few
tensors (the step's query, token and output: see `decode.decode_attention`), so `Launch` goes
through Triton once, keeps the compiled kernel and its full argument list, and afterwards calls the
kernel's launcher directly with those few arguments replaced (FlashInfer's plan once, run per
layer). A replacement must match what the kernel was specialized for (dtype, strides, 16-byte
alignment); `Launch.run` checks that and goes through Triton again when it does not.

Under Triton's interpreter (CPU) there is no compiled kernel: every run is an ordinary launch.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from triton import knobs


def _spec(t: torch.Tensor) -> tuple:
    return t.dtype, t.stride(), t.data_ptr() % 16 == 0


class Launch:
    """One kernel launch, `kernel[grid](*args, **options)`, whose positional arguments `slots`
    (indices into args) are replaced at each `run`. The tensors in the slots here say what the kernel
    is specialized for; no reference to them is kept (see `run`)."""

    def __init__(self, kernel, grid: tuple, args: tuple, options: dict, slots: tuple[int, ...]):
        self.kernel, self.args, self.options, self.slots = kernel, list(args), options, slots
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.spec = [_spec(self.args[i]) for i in slots]
        for i in slots:
            self.args[i] = None
        self.compiled, self.values = None, None

    def run(self, *tensors: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """Launch with `tensors` in the slots. No reference to them is kept: a tensor a CUDA graph
        allocated while recording must die with the step that made it."""
        if self.compiled is None or [_spec(t) for t in tensors] != self.spec:
            for i, t in zip(self.slots, tensors):
                self.args[i] = t
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                self._dispatch(tensors)
            for i in self.slots:
                self.args[i] = None
            return
        values = self.values
        for i, t in zip(self.slots, tensors):
            values[i] = t
        k, (g0, g1, g2) = self.compiled, self.grid
        handle = (stream or torch.cuda.current_stream()).cuda_stream
        k.run(g0, g1, g2, handle, k.function, k.packed_metadata, k.launch_metadata(self.grid, handle, *values),
              knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
        for i in self.slots:
            values[i] = None

    def _dispatch(self, tensors) -> None:
        """Through Triton (compiling if needed); keeps the compiled kernel and its arguments in the
        order of the kernel's parameters, constexprs at their defaults or as given."""
        compiled = self.kernel[self.grid](*self.args, **self.options)
        self.spec = [_spec(t) for t in tensors]
        if not hasattr(compiled, "packed_metadata"):  # the interpreter
            return
        values = list(self.args)
        for p in self.kernel.params[len(values):]:
            values.append(self.options[p.name] if p.name in self.options else p.default)
        for i in self.slots:
            values[i] = None
        self.compiled, self.values = compiled, values
