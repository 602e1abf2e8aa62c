"""The GPU's SM clock and power draw while a block of work runs, sampled by `nvidia-smi` in the
background. A decode that holds the GPU at its power limit runs at a lower clock than a short timing
sees, so a long measurement (`throughput.validate`) records what the clock was."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def summarize(text: str) -> dict:
    """`nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits` lines -> the mean
    and least SM clock (MHz), the mean power (W) and the number of samples; {} for none. Lines it
    cannot read ("[N/A]", a header) are skipped."""
    clocks, watts = [], []
    for line in text.splitlines():
        try:
            clock, power = (float(x) for x in line.split(","))
        except ValueError:
            continue
        clocks.append(clock)
        watts.append(power)
    if not clocks:
        return {}
    return {"sm_clock_mhz": sum(clocks) / len(clocks), "sm_clock_min_mhz": min(clocks),
            "power_w": sum(watts) / len(watts), "gpu_samples": len(clocks)}


def _smi_id(device: torch.device | str | None) -> str:
    """The GPU as nvidia-smi names it: by UUID, which CUDA_VISIBLE_DEVICES cannot renumber."""
    return f"GPU-{torch.cuda.get_device_properties(device or torch.cuda.current_device()).uuid}"


@contextmanager
def sampled(period_ms: int = 500, device: torch.device | str | None = None) -> Iterator[dict]:
    """Yields a dict that, once the block ends, holds `summarize` of the samples of `device` (by
    default the current CUDA device) taken meanwhile; it stays empty for a device that is not a CUDA
    GPU, and without nvidia-smi."""
    summary: dict = {}
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    smi = shutil.which("nvidia-smi") if on_gpu else None
    proc = None
    if smi:
        proc = subprocess.Popen([smi, f"--id={_smi_id(device)}", "--query-gpu=clocks.sm,power.draw",
                                 "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield summary
    finally:
        if proc is not None:
            proc.terminate()
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            summary.update(summarize(out))
