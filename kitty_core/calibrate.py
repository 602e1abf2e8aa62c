"""Budgeted boost allocation: how many key channels each layer boosts to 4 bits, at the method's
average, from an offline calibration of the user's model.

The paper boosts the same fraction of channels in every layer. The sensitivity probe
(`kitty_core.probe.sensitivity`) measures, per layer, KV head and channel, how much the attention
probabilities move when that channel alone is stored at INT2. Boosting a channel to INT4 cuts its
error by 4x in scale (15 levels for 3), so it removes about (1 - 1/25) of that cost; a layer's k-th
boosted channel per head removes the k-th largest of its heads' costs. Those gains fall with k in
every layer, so taking the `round(boost_rate x D) x layers` largest gains over all layers is the
best allocation under the budget for this additive model, and each layer's count is how many of
them it got. Every head of a layer boosts the same count (the page format stores one boosted count
per layer: `high` is [N, H, Db, G/4]); which channels, page by page, the method's rule still picks.

That model can be wrong about the whole network, so the calibration can also measure instead of
predict (`--source kl`): for every layer and a grid of counts, KL(FP16 || method) of the model's
next-token predictions over a scored stretch of the calibration text with only that layer quantized,
at that count (`layer_costs`). The layers' KLs add up to the whole model's to within about a tenth
on the demo model (the attribution page measures both), so the counts that minimize their sum under
the budget (`allocate_measured`, exact over the grid) are the allocation.

The counts are saved as a small JSON file for the model, which a method names:
`kitty-pro+allocation=<file>` (the same average bits per element as kitty-pro). A file calibrated on
another model shape, or for another boost rate, is refused when the cache is built.

    python -m kitty_core.calibrate --model demo --method kitty-pro --tokens 1024 --out allocation.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .allocation import FORMAT
from .cli import count, parser, progress_bar, writable, write_text
from .texts import shipped_path

if TYPE_CHECKING:
    import torch

INT4_KEEPS = 1 / 25  # an INT4 channel's error over its INT2 error, in squared scale (3 levels -> 15)


def arguments():
    p = parser("kitty_core.calibrate", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo | hub id | local directory | file.gguf")
    p.add_argument("--method", default="kitty-pro", help="the method whose boost rate is the budget")
    p.add_argument("--text", type=Path, default=shipped_path(), help="the calibration text (score on another)")
    p.add_argument("--skip", type=count(0), default=0, help="tokens of the text skipped before the calibration's")
    p.add_argument("--tokens", type=count(2), default=1024, help="calibration tokens")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16")
    p.add_argument("--source", choices=("probe", "kl"), default="probe",
                   help="probe: the sensitivity probe's per-channel costs; kl: each layer's measured KL at a grid "
                   "of counts (--tokens of context, then --scored tokens scored)")
    p.add_argument("--scored", type=count(1), default=64, help="with --source kl: scored tokens after the context")
    p.add_argument("--counts", default=None, help="with --source kl: the grid of boosted channels per layer, comma "
                   "separated (default: 0, half, the method's, twice and four times it, up to the head size)")
    p.add_argument("--out", type=Path, required=True, help="the allocation file (JSON) to write")
    return p


def allocate(costs, boost_rate: float) -> list[int]:
    """Channels to boost per layer: `costs` [layers, kv_heads, D] (INT2 cost of each channel alone),
    the budget `round(boost_rate x D)` per layer on average."""
    import torch

    costs = torch.as_tensor(costs, dtype=torch.float64)
    layers, _, d = costs.shape
    per_layer = int(round(boost_rate * d))
    gains = costs.sort(dim=-1, descending=True).values.sum(1) * (1 - INT4_KEEPS)  # [layers, D]: k-th channel's
    # ranked over [D, layers]: equal gains go to the layers' k-th channels before any (k+1)-th, so
    # equal costs give the uniform allocation
    order = torch.argsort(gains.T.flatten(), descending=True, stable=True)[: per_layer * layers]
    return torch.bincount(order % layers, minlength=layers).tolist()


def count_grid(per_layer: int, head_dim: int) -> list[int]:
    """0, half, the method's count, twice and four times it, capped at the head size."""
    return sorted({min(head_dim, c) for c in (0, per_layer // 2, per_layer, 2 * per_layer, 4 * per_layer)})


def layer_costs(model, cap, ids, method: str, context: int, counts, progress=None):
    """DataFrame (layer, boosted, kl): KL(FP16 || method) of the scored tokens' predictions with only
    that layer quantized, at that many boosted channels per KV head (every other layer FP16). `ids`
    and `cap` as `attribution.layer_kl` takes them."""
    import pandas as pd

    from .attribution import _chunk_logprobs, cache_from_capture
    from .evaluate import compare

    d = cap.keys[0].shape[-1]
    n = len(cap.keys)
    targets = ids[:, context + 1 :]
    ref = _chunk_logprobs(model, ids, context, cache_from_capture(model, cap, "fp16", context))
    rows, every = [], set(range(n))
    for layer in range(n):
        for c in counts:
            variant = f"{method}+boost_rate={c / d}"
            cache = cache_from_capture(model, cap, variant, context, fp16_layers=every - {layer})
            kl = compare(ref, _chunk_logprobs(model, ids, context, cache), targets)["kl"]
            rows.append({"layer": layer, "boosted": c, "kl": kl})
            if progress:
                progress(len(rows), n * len(counts), f"layer {layer}, {c} channels")
    return pd.DataFrame(rows)


def allocate_measured(costs, per_layer: int) -> list[int]:
    """Counts per layer, from the grid in `costs` (layer, boosted, kl), that minimize the layers' summed
    KL with exactly `per_layer` x layers channels in all (dynamic programming over the layers)."""
    import math

    layers = sorted(costs["layer"].unique())
    budget = per_layer * len(layers)
    best = {0: (0.0, [])}  # channels spent -> (summed KL, counts so far)
    for layer in layers:
        options = costs[costs["layer"] == layer].set_index("boosted")["kl"]
        step = {}
        for spent, (kl, chosen) in best.items():
            for c, cost in options.items():
                total = spent + int(c)
                if total <= budget and kl + cost < step.get(total, (math.inf,))[0]:
                    step[total] = (kl + cost, chosen + [int(c)])
        best = step
    if budget not in best:
        raise ValueError(f"no counts of the grid {sorted(costs['boosted'].unique())} sum to {budget} channels over "
                         f"{len(layers)} layers; give a grid that contains the method's count")
    return best[budget][1]


def channel_costs(sens) -> torch.Tensor:
    """[layers, kv_heads, D] from the probe's table (rows: layer, kv_head, q_head, channel, mse): a
    KV head's channel costs what it costs its query heads together."""
    import torch

    per = sens.groupby(["layer", "kv_head", "channel"])["mse"].sum()
    shape = [int(per.index.get_level_values(i).max()) + 1 for i in range(3)]
    return torch.tensor(per.to_numpy(), dtype=torch.float64).reshape(shape)


def main(argv=None) -> int:
    a = arguments().parse_args(argv)  # before torch loads
    import torch

    from .config import parse_method
    from .hf import model_shape
    from .models import ModelLoadError, load_model
    from .probe import capture, sensitivity

    try:
        config = parse_method(a.method)
        if not config.quantize or config.key_bits != 2:
            raise ValueError(f"{a.method} boosts no key channels to allocate (its keys are not INT2 with boosts)")
        writable(a.out)
        lm = load_model(a.model, device=a.device, dtype=a.dtype)
        if lm.tokenizer is None:
            raise ValueError(f"{a.model} has no tokenizer: calibration needs a real model and a text")
        ids = lm.tokenizer(a.text.read_text(), return_tensors="pt", add_special_tokens=False).input_ids
        need = a.tokens + (a.scored + 1 if a.source == "kl" else 0)
        ids = ids[:, a.skip : a.skip + need]
        if ids.shape[1] < need:
            raise ValueError(f"{a.text} has {ids.shape[1]} tokens after --skip {a.skip}, fewer than the {need} "
                             "the calibration reads (--tokens, and --scored + 1 with --source kl)")
        shape = model_shape(lm.model.config)
        per_layer = config.boosted_channels(shape["head_dim"])
        grid = (count_grid(per_layer, shape["head_dim"]) if a.counts is None
                else sorted({int(c) for c in a.counts.split(",")}))
        if a.source == "kl" and (per_layer not in grid or not all(0 <= c <= shape["head_dim"] for c in grid)):
            raise ValueError(f"--counts {a.counts} must hold the method's {per_layer} channels and stay within "
                             f"[0, {shape['head_dim']}]")
    except (ValueError, OSError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cap = capture(lm.model, ids.to(lm.device))
    calibration = {"text": a.text.name, "skip": a.skip, "tokens": a.tokens, "source": a.source,
                   "dtype": str(lm.dtype).removeprefix("torch."), "torch": torch.__version__}
    if a.source == "kl":
        with progress_bar("layers x counts", "cache") as progress:
            measured = layer_costs(lm.model, cap, ids, a.method, a.tokens, grid, progress)
        counts = allocate_measured(measured, per_layer)
        calibration |= {"scored": a.scored, "measured": measured.to_dict(orient="records")}
    else:
        with progress_bar("sensitivity probe", "layer") as progress:
            frames = []
            for layer in range(cap.layers):
                progress(layer, cap.layers, f"layer {layer}")
                frames.append(sensitivity(cap, layer, config))
        import pandas as pd

        counts = allocate(channel_costs(pd.concat(frames, ignore_index=True)), config.boost_rate)
    data = {"format": FORMAT, "model": lm.name, "method": a.method, "boost_rate": config.boost_rate,
            "shape": {k: shape[k] for k in ("layers", "kv_heads", "head_dim")},
            "calibration": calibration, "channels_per_layer": counts}
    write_text(a.out, json.dumps(data, indent=1))
    print(f"{a.out}: channels per layer {counts} (uniform: {int(round(config.boost_rate * shape['head_dim']))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
