"""Looking inside the key cache: per-channel statistics and the sensitivity probe (Kitty, Figure 2).

* `capture(model, ids)` runs one forward pass and keeps, per layer, the queries and keys after RoPE
  (what the cache stores and attention reads), the keys before RoPE and the values.
* `channel_stats` / `outlier_ratios` / `heatmap`: mean |x|, max |x|, std per channel; the outlier
  ratio is the mean |x| of the top 12.5% channels over that of the rest.
* `sensitivity(cap, layer)`: for every KV head and channel d, quantize channel d alone to INT2 the
  way the cache does (per channel over pages of G tokens after the FP16 sink; the partial last page
  stays FP16 in the q-buffer), and measure the MSE of every query head's causal attention-probability
  matrix against FP16. All channels at once: the logits move by scaling * q_id * e_jd (e the key
  error of channel d), so each row block costs one batched softmax over [D, heads, rows, keys].
* `agreement`: Spearman correlation and overlap@k between a selection rule's channel scores and the
  measured sensitivity, per layer and KV head.

    python -m kitty_core.probe --model demo --tokens 1024 --out data/results/probe_demo
"""

from __future__ import annotations

import sys
from pathlib import Path

from .cli import count, parser, progress_bar, writable, write_csv
from .texts import shipped_path


def arguments():
    p = parser("kitty_core.probe", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo | hub id | local directory | file.gguf | random:qwen3-8b ...")
    p.add_argument("--text", type=Path, default=shipped_path(), help="a plain-text file: the prompt")
    p.add_argument("--tokens", type=count(1), default=1024, help="prompt length: the first N tokens of the text")
    p.add_argument("--layers", default="all", help="'all' or comma-separated layer indices")
    p.add_argument("--rules", default="magnitude,random,range,qk", help="selection rules to score against the probe")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU, bfloat16 "
                   "or float16 on a GPU)")
    p.add_argument("--out", type=Path, default=Path("data/results/probe"), help="folder for the CSV tables")
    return p


if __name__ == "__main__":
    arguments().parse_args()  # --help and usage errors answer here, before the imports below load torch

import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from .config import SELECTION_RULES, KittyConfig  # noqa: E402
from .gpu_memory import sync  # noqa: E402
from .quant import _minmax_params, channel_scores  # noqa: E402

TENSORS = ("key", "key_pre_rope", "value")


@dataclass
class Capture:
    """Per layer, batch of one: queries [Hq, T, D], keys / keys_pre_rope / values [Hkv, T, D] (float32)."""

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    keys_pre_rope: list[torch.Tensor]
    values: list[torch.Tensor]
    scaling: float

    @property
    def layers(self) -> int:
        return len(self.keys)

    def tensor(self, name: str, layer: int) -> torch.Tensor:
        return {"key": self.keys, "key_pre_rope": self.keys_pre_rope, "value": self.values}[name][layer]


def _capturing_attention(module, query, key, value, attention_mask, kitty_capture=None, **kwargs):
    if kitty_capture is not None:
        kitty_capture[module.layer_idx] = (query[0].float(), key[0].float(), value[0].float(), kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("kitty_capture", _capturing_attention)
AttentionMaskInterface.register("kitty_capture", sdpa_mask)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@torch.inference_mode()
def capture(model, input_ids: torch.Tensor) -> Capture:
    """One forward pass of a single sequence `input_ids` [1, T] (or [T]); returns what each layer saw."""
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    store: dict[int, tuple] = {}
    previous = model.config._attn_implementation
    model.set_attn_implementation("kitty_capture")
    try:
        model(input_ids=ids, use_cache=False, kitty_capture=store, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    layers = sorted(store)
    q, k, v, scaling = zip(*(store[i] for i in layers))
    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    if rotary is None:
        raise ValueError("this model has no rotary embedding module: keys before RoPE are not available")
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    cos, sin = rotary(k[0][None], positions)
    cos, sin = cos[0].float(), sin[0].float()  # [T, D]
    # RoPE rotates pairs of channels by a position's angle; rotating back by the same angle undoes it
    pre = [x * cos - _rotate_half(x) * sin for x in k]
    scaling = scaling[0] if scaling[0] is not None else q[0].shape[-1] ** -0.5
    return Capture(list(q), list(k), pre, list(v), float(scaling))


def channel_stats(cap: Capture, tensors=TENSORS) -> pd.DataFrame:
    """One row per (tensor, layer, head, channel): mean_abs, max_abs, std."""
    frames = []
    for name in tensors:
        for layer in range(cap.layers):
            x = cap.tensor(name, layer)  # [H, T, D]
            h, _, d = x.shape
            a = x.abs()
            frames.append(pd.DataFrame({
                "tensor": name, "layer": layer,
                "head": torch.arange(h).repeat_interleave(d).numpy(), "channel": torch.arange(d).repeat(h).numpy(),
                "mean_abs": a.mean(1).flatten().cpu().numpy(), "max_abs": a.amax(1).flatten().cpu().numpy(),
                "std": x.std(1).flatten().cpu().numpy(),
            }))
    return pd.concat(frames, ignore_index=True)


def outlier_ratios(stats: pd.DataFrame, top: float = 0.125) -> pd.DataFrame:
    """Per (tensor, layer, head): mean |x| of the top `top` share of channels over that of the rest."""
    def ratio(s: pd.Series) -> float:
        v = s.sort_values(ascending=False).to_numpy()
        k = max(1, int(round(top * len(v))))
        return float(v[:k].mean() / max(v[k:].mean(), 1e-12))

    return (stats.groupby(["tensor", "layer", "head"])["mean_abs"].apply(ratio)
            .rename("outlier_ratio").reset_index())


def heatmap(cap: Capture, layer: int, head: int, tensor: str = "key", max_rows: int = 256) -> pd.DataFrame:
    """|x| as tokens x channels, averaged over blocks of tokens so at most `max_rows` rows remain."""
    x = cap.tensor(tensor, layer)[head].abs()  # [T, D]
    block = -(-x.shape[0] // max_rows)
    t = x.shape[0] // block * block
    pooled = x[:t].reshape(-1, block, x.shape[1]).mean(1) if block > 1 else x
    df = pd.DataFrame(pooled.cpu().numpy())
    df.index = pd.RangeIndex(0, t, block, name="token")
    df.columns.name = "channel"
    return df


def int2_channel_error(keys: torch.Tensor, config: KittyConfig) -> torch.Tensor:
    """Error [H, T, D] of quantizing every channel to INT2 per page of G tokens after the sink."""
    h, t, d = keys.shape
    s, g = min(config.sink, t), config.group_size
    n = (t - s) // g
    err = torch.zeros_like(keys)
    if n:
        x = keys[:, s : s + n * g].reshape(h, n, g, d)
        codes, scale, zero = _minmax_params(x, torch.tensor(3.0, device=x.device), dim=2)
        deq = codes.float() * scale.float().unsqueeze(2) + zero.float().unsqueeze(2)
        err[:, s : s + n * g] = (deq - x).reshape(h, n * g, d)
    return err


def measurable_tokens(config: KittyConfig | None = None) -> int:
    """The fewest tokens whose sensitivity can be measured: the sink and one page after it. Fewer
    never leave FP16, so every channel's error is zero and any ranking of them is noise."""
    config = config or KittyConfig()
    return config.sink + config.group_size


def check_measurable(tokens: int, config: KittyConfig | None = None) -> None:
    config = config or KittyConfig()
    if tokens < measurable_tokens(config):
        raise ValueError(
            f"{tokens} tokens are too short to measure: a channel is quantized only in pages of {config.group_size} "
            f"tokens after the {config.sink}-token FP16 sink, so it takes at least {measurable_tokens(config)} tokens; "
            "give a longer text")


@torch.inference_mode()
def sensitivity(cap: Capture, layer: int, config: KittyConfig | None = None,
                rows_per_block: int | None = None) -> pd.DataFrame:
    """MSE of each query head's causal attention probabilities when one key channel alone is INT2.

    Rows: layer, kv_head, q_head, channel, mse (mean over the causal entries of the T x T matrix)."""
    config = config or KittyConfig()
    q, k = cap.queries[layer], cap.keys[layer]  # [Hq, T, D], [Hkv, T, D]
    check_measurable(k.shape[1], config)
    if rows_per_block is None:  # small blocks stay in a CPU's cache; a GPU wants work per launch
        rows_per_block = 64 if q.is_cuda else 4
    hq, t, d = q.shape
    rep = hq // k.shape[0]
    err = int2_channel_error(k, config).repeat_interleave(rep, 0)  # [Hq, T, D]
    k = k.repeat_interleave(rep, 0)
    total = torch.zeros(d, hq, device=q.device)
    quantized_rows = err.abs().sum((0, 2)).nonzero()
    if not len(quantized_rows):
        first_row = t  # too short to hold a page: nothing is ever quantized
    else:
        first_row = int(quantized_rows[0])  # earlier query rows see only FP16 keys: nothing moves
    qs = (q * cap.scaling).permute(2, 0, 1).contiguous()  # [D, Hq, T]
    e = err.permute(2, 0, 1).contiguous()  # [D, Hq, T]
    ones = torch.ones((t, 1), device=q.device)
    for r0 in range(first_row // rows_per_block * rows_per_block, t, rows_per_block):
        r1 = min(r0 + rows_per_block, t)
        logits = torch.einsum("hrd,hcd->hrc", q[:, r0:r1], k[:, :r1]) * cap.scaling  # [Hq, R, C]
        causal = torch.arange(r0, r1, device=q.device)[:, None] >= torch.arange(r1, device=q.device)[None]
        base = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        # channel d alone at INT2 moves logit (r, c) by scaling * q_rd * e_cd, so its probabilities are
        # base * exp(that) renormalized; all channels at once, in place: [D, Hq, R, C]
        moved = qs[:, :, r0:r1, None] * e[:, :, None, :r1]
        moved.exp_().mul_(base)
        moved.div_(moved @ ones[:r1]).sub_(base)  # row sums by a matmul: faster than sum() on CPU
        total += torch.linalg.vector_norm(moved.flatten(2), dim=-1).square_()
    entries = t * (t + 1) / 2
    mse = (total / entries).cpu()
    return pd.DataFrame({
        "layer": layer,
        "kv_head": (torch.arange(hq) // rep).repeat(d).numpy(),
        "q_head": torch.arange(hq).repeat(d).numpy(),
        "channel": torch.arange(d).repeat_interleave(hq).numpy(),
        "mse": mse.flatten().numpy(),
    })


def sensitivity_all(cap: Capture, config: KittyConfig | None = None, progress=None) -> pd.DataFrame:
    frames = []
    for layer in range(cap.layers):
        if progress:
            progress(layer, cap.layers)
        frames.append(sensitivity(cap, layer, config))
    return pd.concat(frames, ignore_index=True)


def rule_scores(cap: Capture, layer: int, rule: str, config: KittyConfig | None = None, seed: int = 0) -> torch.Tensor:
    """[Hkv, D] channel scores of a selection rule over the tokens the cache would page."""
    config = config or KittyConfig()
    k = cap.keys[layer]
    s = min(config.sink, k.shape[1])
    paged = k[:, s:] if k.shape[1] > s else k
    hkv = k.shape[0]
    q = cap.queries[layer].reshape(hkv, -1, *cap.queries[layer].shape[1:])  # [Hkv, rep, T, D]
    query_rms = q.pow(2).mean((1, 2)).sqrt()  # [Hkv, D]
    gen = torch.Generator().manual_seed(seed + layer)
    return channel_scores(paged.unsqueeze(0), rule, gen, query_rms.unsqueeze(0))[0]


def boosted(cap: Capture, layer: int, config: KittyConfig) -> torch.Tensor:
    """[Hkv, D] bool: the channels the method would boost over this prompt, by its selection rule."""
    scores = rule_scores(cap, layer, config.selection, config, config.seed)
    nb = config.boosted_channels(scores.shape[-1])
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if nb:
        mask.scatter_(-1, scores.topk(nb, dim=-1).indices, True)
    return mask


def agreement(cap: Capture, sens: pd.DataFrame, rules=("magnitude", "random"), config: KittyConfig | None = None,
              rates=(0.125, 0.25)) -> pd.DataFrame:
    """Per (layer, kv_head, rule): Spearman of rule scores vs sensitivity (summed over the group's
    query heads), and overlap@k: the share of the k most sensitive channels the rule would boost."""
    rows = []
    per_kv = sens.groupby(["layer", "kv_head", "channel"])["mse"].sum()
    for layer in sorted(int(x) for x in sens.layer.unique()):
        for rule in rules:
            scores = rule_scores(cap, layer, rule, config)
            for h in range(scores.shape[0]):
                truth = torch.tensor(per_kv.loc[(layer, h)].sort_index().to_numpy())
                row = {"layer": layer, "kv_head": h, "rule": rule, "spearman": spearman(scores[h].cpu(), truth)}
                for rate in rates:
                    k = max(1, int(round(rate * truth.numel())))
                    top_true = set(truth.topk(k).indices.tolist())
                    top_rule = set(scores[h].topk(k).indices.tolist())
                    row[f"overlap@{rate:g}"] = len(top_true & top_rule) / k
                rows.append(row)
    return pd.DataFrame(rows)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.double().argsort().argsort().double()
    rb = b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def main(argv=None) -> int:
    from .models import ModelLoadError, load_model

    a = arguments().parse_args(argv)
    try:
        check_measurable(a.tokens)
        unknown = sorted(set(a.rules.split(",")) - set(SELECTION_RULES))
        if unknown:
            raise ValueError(f"--rules: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(SELECTION_RULES)}")
        writable(a.out, folder=True)
        lm = load_model(a.model, device=a.device, dtype=a.dtype)
        context = lm.model.config.get_text_config().max_position_embeddings
        if context and a.tokens > context:
            raise ValueError(f"--tokens {a.tokens} is beyond the model's context of {context} tokens")
        n_layers = lm.model.config.get_text_config().num_hidden_layers
        layers = range(n_layers) if a.layers == "all" else [int(x) for x in a.layers.split(",")]
        if any(not 0 <= i < n_layers for i in layers):
            raise ValueError(f"--layers must be 'all' or indices in [0, {n_layers - 1}], got {a.layers!r}")
        if lm.tokenizer is None:  # a random-weight model: random tokens measure the same speed
            ids = torch.randint(0, lm.model.config.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0))
        else:
            ids = lm.tokenizer(a.text.read_text(), return_tensors="pt", add_special_tokens=False).input_ids[:, : a.tokens]
        if ids.shape[1] < a.tokens:
            raise ValueError(f"the text has only {ids.shape[1]} tokens, fewer than --tokens {a.tokens}")
        sync()
        t0 = time.perf_counter()
        cap = capture(lm.model, ids)
        sync()
        t1 = time.perf_counter()
        with progress_bar("sensitivity probe", "layer") as progress:
            frames = []
            for done, layer in enumerate(layers):
                progress(done, len(layers), f"layer {layer}")
                frames.append(sensitivity(cap, layer))
        sens = pd.concat(frames, ignore_index=True)
        sync()
        t2 = time.perf_counter()
        agree = agreement(cap, sens, rules=a.rules.split(","))
        stats = channel_stats(cap)
    except (ValueError, ModelLoadError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, df in (("channel_stats", stats), ("outlier_ratios", outlier_ratios(stats)), ("sensitivity", sens),
                     ("agreement", agree)):
        write_csv(a.out / f"{name}.csv", df)
    print(f"capture {t1 - t0:.2f} s, probe of {len(layers)} layers at {ids.shape[1]} tokens {t2 - t1:.2f} s on {lm.device}")
    ratios = outlier_ratios(stats).groupby(["tensor", "layer"])["outlier_ratio"].mean().unstack(0)
    print(ratios.to_string(float_format=lambda x: f"{x:.2f}"))
    print(agree.groupby("rule")[["spearman", "overlap@0.125", "overlap@0.25"]].mean().to_string(float_format=lambda x: f"{x:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
