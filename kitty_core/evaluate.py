"""Accuracy against FP16: perplexity, KL(FP16 || method) and top-1 agreement, scored through the cache.

For each window of the text, the first `context` tokens are prefilled into the method's cache; the
next `continuation` tokens are then fed one at a time, exactly as decoding would feed them, so each
prediction sees the cache state (sink, buffers, packed pages) a generation would see. The first
continuation token is predicted by the prefill itself. All windows run as one batch.

    python -m kitty_core.evaluate --methods fp16,kivi-k2v2,kitty,kitty-pro --context 2048 --windows 3
"""

from __future__ import annotations

import sys
from pathlib import Path

from .cli import count, parser, progress_bar, writable, write_text
from .texts import shipped_path

DEFAULT_TEXT = shipped_path()  # Genesis (KJV): kitty_core.texts says where it is looked up
DEFAULT_METHODS = "fp16,kivi-k4v4,kivi-k2v2,kivi-k2v2-sink,k4v2-sink,k2v4-sink,kitty,kitty-pro,kitty-pro+selection=random"


def arguments():
    p = parser("kitty_core.evaluate", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo | hub id | local directory | file.gguf")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a plain-text file to score")
    p.add_argument("--context", type=count(1), default=2048, help="tokens prefilled into the cache per window")
    p.add_argument("--continuation", type=count(1), default=128, help="tokens then fed one at a time and scored")
    p.add_argument("--windows", type=count(1), default=3, help="windows of the text, spread evenly, as one batch")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated, e.g. fp16,kitty,kitty-pro+selection=random")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU, bfloat16 "
                   "or float16 on a GPU)")
    p.add_argument("--engine", default=None, help="reference | triton | triton+key_dots=int8 (default: triton on a GPU)")
    p.add_argument("--json", type=Path, default=None, help="write {settings, results: [...]} here")
    return p


if __name__ == "__main__":
    arguments().parse_args()  # --help and usage errors answer here, before the imports below load torch

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from .cache import KittyCache  # noqa: E402
from .engines import available_engines, make_engine  # noqa: E402
from .config import PRESETS, parse_method  # noqa: E402
from .models import ModelLoadError, load_model  # noqa: E402
from .results import boost_share, stamp  # noqa: E402


def text_windows(tokenizer, text: str, context: int, continuation: int, windows: int) -> torch.Tensor:
    """[W, context + continuation] token ids, windows spread evenly over the text."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    span = context + continuation
    if ids.numel() < span:
        raise ValueError(f"the text has {ids.numel()} tokens; context + continuation needs {span}")
    last = ids.numel() - span
    starts = [round(i * last / max(windows - 1, 1)) for i in range(windows)] if windows > 1 else [0]
    return torch.stack([ids[s : s + span] for s in starts])


@torch.inference_mode()
def continuation_logprobs(model, ids: torch.Tensor, context: int, method: str, engine: str | None = None,
                          progress=None):
    """Log-probabilities [W, C, V] (float32, CPU) of the continuation tokens' predictions;
    `progress(done, total, method)` after each of the C predictions."""
    cache = KittyCache(model, method, engine=engine)
    device = next(model.parameters()).device
    ids = ids.to(device)
    out = model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
    steps = [out.logits[:, -1].float().log_softmax(-1).cpu()]
    total = ids.shape[1] - context
    if progress:
        progress(1, total, method)
    for j in range(context, ids.shape[1] - 1):
        out = model(input_ids=ids[:, j : j + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits[:, -1].float().log_softmax(-1).cpu())
        if progress:
            progress(len(steps), total, method)
    return torch.stack(steps, dim=1)


def compare(ref: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> dict:
    """Metrics of one method's log-probs against the FP16 reference's, over [W, C] positions."""
    kl = (ref.exp() * (ref - logp)).sum(-1)  # KL(FP16 || method) per position
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return {
        "perplexity": math.exp(nll.mean().item()),
        "kl": kl.mean().item(),
        "top1": (logp.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "kl_per_window": kl.mean(-1).tolist(),
    }


def evaluate(
    model,
    tokenizer,
    methods=DEFAULT_METHODS,
    text: str | None = None,
    context: int = 2048,
    continuation: int = 128,
    windows: int = 3,
    engine: str | None = None,
    progress=None,
    rows: list | None = None,
) -> pd.DataFrame:
    """One row per method: perplexity, kl, top1 (against `fp16`), bits per element, seconds.
    `rows`: a list the rows are appended to as each method finishes, so that a caller keeps them
    when the run is interrupted."""
    methods = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    if not methods:
        raise ValueError("no methods given: name at least one, e.g. fp16,kitty-pro")
    configs = {m: parse_method(m) for m in methods}  # fail fast on a bad name
    for name, value in (("context", context), ("continuation", continuation), ("windows", windows)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit and context + continuation > limit:
        raise ValueError(f"context + continuation ({context} + {continuation} tokens) is beyond the model's context "
                         f"of {limit}; shorten them")
    if text is None:
        text = DEFAULT_TEXT.read_text()
    ids = text_windows(tokenizer, text, context, continuation, windows)
    targets = ids[:, context:]
    head_dim = _head_dim(model)
    ref = continuation_logprobs(model, ids, context, "fp16", engine)
    rows = [] if rows is None else rows
    for i, m in enumerate(methods):
        if progress:
            progress(i, len(methods), m)
        t0 = time.perf_counter()
        logp = ref if configs[m] == parse_method("fp16") else continuation_logprobs(model, ids, context, m, engine)
        row = {"method": m, **compare(ref, logp, targets)}
        row["bits_per_element"] = configs[m].bits_per_element(head_dim)
        row["boost_rate"] = boost_share(configs[m])
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs.update(context=context, continuation=continuation, windows=windows)
    return df


def boost_sweep(model, tokenizer, rates=(0.0, 0.125, 0.25, 0.5), rules=("magnitude", "qk"), base: str = "kitty",
                references=("kivi-k2v2", "k4v2-sink"), **kwargs) -> pd.DataFrame:
    """Accuracy against FP16 as a function of the boost rate, one series per selection rule, plus
    reference presets: `evaluate` over `base+boost_rate=r+selection=rule` (Kitty, Figure 4)."""
    grid = [f"{base}+boost_rate={r:g}+selection={rule}" for rule in rules for r in rates]
    df = evaluate(model, tokenizer, [*grid, *references], **kwargs)
    parsed = [parse_method(m) for m in df.method]
    df["rule"] = [c.selection if m in grid else curve_rule(m) for m, c in zip(df.method, parsed)]
    return df


def curve_rule(method: str) -> str:
    """The selection rule whose boost-rate curve a method lies on, or "preset": 2-bit keys with
    boosted channels, or a sweep's boost-0 point (its rule spelled out, `+selection=qk`), whose
    curves all start there. A method that changes anything else of Kitty's (a calibrated allocation,
    the page size, the FP16 sink ...) lies on a curve of its own, named by what it changes:
    "qk + allocation", "qk + group_size=256"."""
    c = parse_method(method)
    on_curve = c.quantize and c.key_bits == 2 and (c.boost_rate > 0 or "selection=" in method)
    if not on_curve:
        return "preset"
    kitty = PRESETS["kitty"]
    changed = [f.name if f.name == "allocation" else f"{f.name}={getattr(c, f.name)}" for f in dataclasses.fields(c)
               if f.name not in ("boost_rate", "selection", "seed") and getattr(c, f.name) != getattr(kitty, f.name)]
    return " + ".join([c.selection, *changed])


def pareto_front(df: pd.DataFrame, cost: str = "bits_per_element", error: str = "kl",
                 lower_is_better: bool = True) -> pd.DataFrame:
    """The rows no other row beats at the same or lower cost: the best `error` reachable at each
    memory budget, sorted by cost. `lower_is_better=False` for a score (top-1 agreement)."""
    sign = 1 if lower_is_better else -1
    ranked = df.assign(_e=sign * df[error]).sort_values([cost, "_e"], kind="stable")
    best, keep = float("inf"), []
    for i, e in zip(ranked.index, ranked["_e"]):
        if e < best:
            best = e
            keep.append(i)
    return df.loc[keep]


def rule_curves(df: pd.DataFrame) -> pd.DataFrame:
    """The points of every rule's boost-rate curve (rows of `df` with a `rule` from `curve_rule`):
    each rule's own points, plus the ends of the sweep it lacks, no channel or every channel boosted,
    taken from another rule: there the rule selects nothing, so every rule's cache is the same."""
    on = df[df["rule"] != "preset"]
    rows = [on]
    for rule in on["rule"].unique():
        for end in (0.0, 1.0):
            mine, any_rule = on[(on["rule"] == rule) & (on["boost_rate"] == end)], on[on["boost_rate"] == end]
            if mine.empty and len(any_rule):
                rows.append(any_rule.iloc[:1].assign(rule=rule))
    return pd.concat(rows, ignore_index=True).sort_values(["rule", "boost_rate"], kind="stable")


def _head_dim(model) -> int:
    from .hf import model_shape

    return model_shape(model.config)["head_dim"]


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv=None) -> int:
    a = arguments().parse_args(argv)
    rows, lm = [], None  # the methods scored, kept if the run is interrupted
    try:
        if not [m for m in a.methods.split(",") if m.strip()]:
            raise ValueError("--methods is empty: name at least one method, e.g. fp16,kitty-pro")
        for m in a.methods.split(","):
            if m.strip():
                parse_method(m.strip())
        if a.engine:
            make_engine(a.engine)  # a wrong engine name fails here, before the model loads
        if a.json:
            writable(a.json)
        text = a.text.read_text()
        lm = load_model(a.model, device=a.device, dtype=a.dtype)
        with progress_bar("methods scored", "method") as progress:
            df = evaluate(lm.model, lm.tokenizer, a.methods, text, a.context, a.continuation, a.windows, a.engine,
                          progress=progress, rows=rows)
    except (ValueError, ModelLoadError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # the methods scored so far, beside the target: an earlier complete file there stays as it was
        if a.json and rows and lm is not None:
            partial = a.json.with_name(f"{a.json.stem}.partial{a.json.suffix}")
            write_text(partial, json.dumps(stamp({"settings": {**_settings(a, lm), "interrupted": True},
                                                  "results": rows}), indent=2))
            print(f"interrupted: the {len(rows)} methods scored are in {partial}", file=sys.stderr)
        return 130
    cols = ["method", "perplexity", "kl", "top1", "bits_per_element"]
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    if a.json:
        write_text(a.json, json.dumps(stamp({"settings": _settings(a, lm), "results": df.to_dict(orient="records")}),
                                      indent=2))
    return 0


def _settings(a, lm) -> dict:
    return {"model": a.model, "text": _display_path(a.text), "context": a.context, "continuation": a.continuation,
            "windows": a.windows, "device": str(lm.device), "dtype": str(lm.dtype),
            "engine": a.engine or ("triton" if lm.device.type == "cuda" and "triton" in available_engines()
                                   else "reference")}


if __name__ == "__main__":
    sys.exit(main())
