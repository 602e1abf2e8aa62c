"""Where a method's error comes from: which layers, which heads, which tokens and which channels.

All four views start from one FP16 forward pass over `context + continuation + 1` tokens
(`probe.capture`: per layer the queries, the keys after RoPE and the values). A prefill attends its
own tokens in FP16 and quantizes them afterwards (paper, section 4.3), so the state a method's
cache holds after prefilling the context is the captured FP16 keys and values put through that
cache: `cache_from_capture` builds it with the cache's own insert-and-pack code, no second forward.

* `layer_kl`: KL(FP16 || method) of the continuation's next-token predictions (scored in one
  chunk over the cached context, `evaluate.compare`) when only layer l is quantized, and when every
  layer but l is (`KittyCache(fp16_layers=...)`): one bar per layer.
* `head_error`: per layer and query head, how far the continuation's attention probabilities move
  when the keys are the method's cache state instead of FP16 (queries, and the continuation's own
  keys, FP16 in both): the share of attention mass moved (total variation, 0-1), KL between the two
  rows, and the relative error of the attention output (values included).
* `attention_map`: the two probability maps of one layer and query head, continuation queries x
  key positions, and `parts`: where the sink, pages, buffers and window lie.
* `page_error`: one page's dequantized keys and values minus FP16, keys with the page's boosted
  channels.

    python -m kitty_core.attribution --methods kitty-pro,kivi-k2v2 --out data/results/attribution_demo_cpu

writes settings.json, layer_kl.csv, head_error.csv, attention_map.csv, parts.csv, page_error.csv and
(with the probe) layer_sensitivity.csv into the folder; `read_saved` reads them back for the lab.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
DEFAULT_OUT = DATA / "results" / "attribution_demo_cpu"
MODES = {"only": "only this layer quantized", "all_but": "every layer but this one quantized"}
FILES = ("layer_kl", "head_error", "attention_map", "parts", "page_error")
COLUMNS = {
    "layer_kl": ("method", "layer", "quantized", "kl", "top1"),
    "head_error": ("method", "layer", "kv_head", "q_head", "moved", "kl", "output_error"),
    "attention_map": ("method", "layer", "q_head", "query", "key", "fp16", "quantized"),
    "parts": ("method", "side", "part", "start", "end"),
    "page_error": ("method", "layer", "kv_head", "page", "side", "token", "channel", "error", "boosted"),
}


# -- the method's cache state, built from an FP16 capture ------------------------------------------
def token_ids(tokenizer, text: str, context: int, continuation: int):
    """[1, context + continuation + 1]: the first tokens of the text (the context, the scored
    continuation and the token its last prediction is scored against)."""
    from .evaluate import text_windows

    if context < 1 or continuation < 1:
        raise ValueError(f"context and continuation must be at least 1 token, got {context} and {continuation}")
    return text_windows(tokenizer, text, context, continuation + 1, 1)


def _fill(layer, cap, index: int, tokens: int, dtype) -> None:
    """Put the first `tokens` captured keys and values of layer `index` into an empty KittyLayer, as a
    prefill would (queries tracked first for selection="qk", as the cache does before storing)."""
    k = cap.keys[index][None, :, :tokens].to(dtype)  # [1, Hkv, T, D]
    v = cap.values[index][None, :, :tokens].to(dtype)
    layer.lazy_initialization(k, v)
    if layer.config.quantize and layer.config.selection == "qk":
        layer.track_step_queries(cap.queries[index][None, :, :tokens].to(dtype))
    layer.insert(k, v)


def cache_from_capture(model, cap, method: str, tokens: int, fp16_layers=(), engine: str | None = None):
    """A KittyCache holding the first `tokens` captured tokens, as prefilling them would leave it."""
    from .cache import KittyCache

    cache = KittyCache(model, method, engine=engine, device_steps=False, fp16_layers=fp16_layers)
    dtype = next(model.parameters()).dtype
    for i, layer in enumerate(cache.layers):
        _fill(layer, cap, i, tokens, dtype)
    return cache


def layer_state(cap, method: str, layer: int, tokens: int):
    """One layer's KittyLayer (reference engine) holding the first `tokens` captured tokens."""
    import torch

    from .layer import KittyLayer
    from .reference_engine import ReferenceEngine
    from .config import parse_method

    state = KittyLayer(parse_method(method), ReferenceEngine(), layer)
    _fill(state, cap, layer, tokens, torch.float32)
    return state


# -- KL per layer -----------------------------------------------------------------------------------
def _chunk_logprobs(model, ids, context: int, cache):
    """Log-probabilities [1, C, V] of the continuation's predictions, one forward over the cache."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=ids[:, context:-1].to(next(model.parameters()).device), past_key_values=cache,
                    use_cache=True)
    return out.logits.float().log_softmax(-1).cpu()


def layer_kl(model, cap, ids, method: str, context: int, modes=tuple(MODES), engine: str | None = None,
             progress=None):
    """One row per (layer, mode): KL(FP16 || method) and top-1 agreement of the continuation when
    only that layer is quantized ("only") or every layer but it ("all_but"); `attrs["kl_all"]`: the
    method on every layer. `progress(done, total, label)` after each scored cache."""
    import pandas as pd

    from .evaluate import compare

    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be among {', '.join(MODES)}, got {list(modes)}")
    n = len(cap.keys)
    targets = ids[:, context + 1 :]
    every = set(range(n))
    runs = [("fp16", "all", ()), (method, "all", ())]
    runs += [(method, (mode, i), every - {i} if mode == "only" else {i}) for mode in modes for i in range(n)]
    rows, ref, kl_all = [], None, None
    for done, (m, what, fp16_layers) in enumerate(runs):
        logp = _chunk_logprobs(model, ids, context, cache_from_capture(model, cap, m, context, fp16_layers, engine))
        if ref is None:
            ref = logp
        elif what == "all":
            kl_all = compare(ref, logp, targets)["kl"]
        else:
            scores = compare(ref, logp, targets)
            rows.append({"method": method, "layer": what[1], "quantized": what[0], "kl": scores["kl"],
                         "top1": scores["top1"]})
        if progress:
            progress(done + 1, len(runs), f"{method}: {_label(what)}")
    df = pd.DataFrame(rows, columns=list(COLUMNS["layer_kl"]))
    df.attrs["kl_all"] = kl_all
    return df


def _label(what) -> str:
    if what == "all":
        return "every layer"
    return f"layer {what[1]}, {MODES[what[0]]}"


def analyse(model, tokenizer, text: str, methods, context: int, continuation: int, modes=tuple(MODES),
            engine: str | None = None, progress=None) -> dict:
    """The per-layer and per-head tables of every method over the text's first tokens: {cap, ids,
    layer_kl, head_error, kl_all: {method: KL with every layer quantized}}. `progress(done, total,
    label)` counts the capture, every scored cache and every layer's attention."""
    import pandas as pd

    from .config import parse_method
    from .probe import capture

    methods = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    if not methods or any(not parse_method(m).quantize for m in methods):
        raise ValueError(f"pick quantized methods (fp16 is the reference everything is measured against), "
                         f"got {methods}")
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be among {', '.join(MODES)}, got {list(modes)}")
    ids = token_ids(tokenizer, text, context, continuation)
    cap = capture(model, ids)
    n = len(cap.keys)
    total, done = 1 + len(methods) * (2 + len(modes) * n + n), [0]

    def step(label: str) -> None:
        done[0] += 1
        if progress:
            progress(done[0], total, label)

    step("FP16 capture")
    layers, heads, kl_all = [], [], {}
    for m in methods:
        df = layer_kl(model, cap, ids, m, context, modes, engine, progress=lambda d, t, label: step(label))
        kl_all[m] = df.attrs["kl_all"]
        layers.append(df)
        heads.append(head_error(cap, m, context, progress=lambda d, t, label: step(label)))
    return {"cap": cap, "ids": ids, "layer_kl": pd.concat(layers, ignore_index=True),
            "head_error": pd.concat(heads, ignore_index=True), "kl_all": kl_all}


# -- attention probabilities per head ---------------------------------------------------------------
def _probabilities(cap, method: str, layer: int, context: int):
    """(FP16, method) attention probabilities [Hq, C, context + C] of the continuation's queries, and
    (FP16, method) attention outputs [Hq, C, D]; the layer's state. The continuation's own keys and
    values are new tokens: FP16, and for the method as its tail holds them (`as_tail_holds`: the
    continuation is decoded one token at a time, and a later query reads a token as stored); the
    context's are the method's stored state."""
    import torch

    state = layer_state(cap, method, layer, context)
    q, k, v = cap.queries[layer], cap.keys[layer], cap.values[layer]  # [Hq, T, D], [Hkv, T, D]
    span = k.shape[1] - 1  # the capture's last token is only a target
    past_k, past_v = state.dense_history(torch.float32)  # [1, Hkv, context, D]
    k_new, v_new = state.as_tail_holds(k[:, context:span], v[:, context:span])
    k_m = torch.cat([past_k[0], k_new], dim=1)
    v_m = torch.cat([past_v[0], v_new], dim=1)
    rep = q.shape[0] // k.shape[0]
    query = q[:, context:span]  # [Hq, C, D]
    causal = torch.arange(context, span, device=q.device)[:, None] >= torch.arange(span, device=q.device)[None]
    out = []
    for keys, values in ((k[:, :span], v[:, :span]), (k_m, v_m)):
        logits = query @ keys.repeat_interleave(rep, 0).transpose(1, 2) * cap.scaling  # [Hq, C, span]
        p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append((p, p @ values.repeat_interleave(rep, 0)))
    (p_ref, o_ref), (p_m, o_m) = out
    return p_ref, p_m, o_ref, o_m, state


def head_error(cap, method: str, context: int, progress=None):
    """Rows (layer, kv_head, q_head): moved (total variation of the probabilities, mean over the
    continuation's queries), kl (KL(FP16 || method) of them) and output_error (|o_m - o| / |o|)."""
    import pandas as pd

    rows = []
    n = len(cap.keys)
    for layer in range(n):
        p_ref, p_m, o_ref, o_m, _ = _probabilities(cap, method, layer, context)
        moved = 0.5 * (p_ref - p_m).abs().sum(-1).mean(-1)  # [Hq]
        kl = (p_ref * (p_ref.clamp_min(1e-30).log() - p_m.clamp_min(1e-30).log())).sum(-1).mean(-1)
        err = ((o_m - o_ref).norm(dim=-1) / o_ref.norm(dim=-1).clamp_min(1e-12)).mean(-1)
        rep = p_ref.shape[0] // cap.keys[layer].shape[0]
        for h in range(p_ref.shape[0]):
            rows.append({"method": method, "layer": layer, "kv_head": h // rep, "q_head": h,
                         "moved": float(moved[h]), "kl": float(kl[h]), "output_error": float(err[h])})
        if progress:
            progress(layer + 1, n, f"{method}: attention of layer {layer}")
    return pd.DataFrame(rows, columns=list(COLUMNS["head_error"]))


def attention_map(cap, method: str, layer: int, q_head: int, context: int):
    """Long table (query, key, fp16, quantized) of one query head's attention probabilities, the
    continuation's queries (absolute positions) over every key before them; and `parts(state)`."""
    import pandas as pd

    heads = cap.queries[layer].shape[0]
    if not 0 <= q_head < heads:
        raise ValueError(f"query head must be in [0, {heads - 1}], got {q_head}")
    p_ref, p_m, _, _, state = _probabilities(cap, method, layer, context)
    c, span = p_ref.shape[1], p_ref.shape[2]
    query = [context + i for i in range(c) for _ in range(span)]
    key = list(range(span)) * c
    df = pd.DataFrame({"method": method, "layer": layer, "q_head": q_head, "query": query, "key": key,
                       "fp16": p_ref[q_head].flatten().cpu().numpy(), "quantized": p_m[q_head].flatten().cpu().numpy()})
    causal = df["key"] <= df["query"]
    return df[causal].reset_index(drop=True), parts(state, span)


def parts(state, span: int | None = None):
    """Where a layer's stored tokens lie (sequence 0): rows side (keys | values), part, start, end
    (token positions, end exclusive); `span` adds the continuation's new tokens after them."""
    import pandas as pd

    c, n = state.config, state.tokens(0)
    rows = []
    s = min(c.sink, n) if c.quantize else n
    tail = "FP16" if c.tail_bits == 16 else "INT8"
    for side in ("keys", "values"):
        rows.append((side, f"sink ({tail})" if c.quantize else "FP16", 0, s))
        if c.quantize:
            pool = state.k_pages if side == "keys" else state.v_pages
            paged = s + pool.pages_of(0) * c.group_size
            for p in range(pool.pages_of(0)):
                rows.append((side, f"page {p} (2-bit)", s + p * c.group_size, s + (p + 1) * c.group_size))
            rows.append((side, f"q-buffer ({tail})" if side == "keys" else f"q-buffer and window ({tail})", paged, n))
        if span and span > n:
            rows.append((side, "new tokens (FP16)", n, span))
    df = pd.DataFrame(rows, columns=["side", "part", "start", "end"])
    return df[df.end > df.start].reset_index(drop=True)


# -- one page's quantization error ------------------------------------------------------------------
def page_error(cap, method: str, layer: int, kv_head: int, page: int, context: int):
    """Dequantized minus FP16 for page `page` of one layer and KV head: rows side (keys | values),
    token (absolute position), channel, error, boosted (the key channel is stored at 4 bits)."""
    import pandas as pd
    import torch

    from .quant import dequantize_keys, dequantize_values

    state = layer_state(cap, method, layer, context)
    c = state.config
    heads = cap.keys[layer].shape[0]
    if not 0 <= kv_head < heads:
        raise ValueError(f"KV head must be in [0, {heads - 1}], got {kv_head}")
    have = min(state.k_pages.pages_of(0), state.v_pages.pages_of(0)) if c.quantize else 0
    if not 0 <= page < have:
        raise ValueError(f"{method} holds {have} full pages of keys and values after {context} tokens; "
                         f"pick a page in [0, {have - 1}]" if have else
                         f"{method} holds no page of keys and values after {context} tokens: "
                         "quantize a method, or give a longer context")
    s, g = min(c.sink, context), c.group_size
    tokens = torch.arange(s + page * g, s + (page + 1) * g)
    keys = dequantize_keys(state.k_pages.pages(0, page))[0, kv_head]  # [G, D]
    values = dequantize_values(state.v_pages.pages(0, page))[0, kv_head]  # [G, D]
    boosted = torch.zeros(keys.shape[1], dtype=torch.bool)
    boosted[state.k_pages.pages(0, page).boost_ch[0, kv_head].long().cpu()] = True
    frames = []
    for side, deq, ref in (("keys", keys, cap.keys[layer]), ("values", values, cap.values[layer])):
        err = (deq.float() - ref[kv_head, tokens[0] : tokens[-1] + 1].float()).cpu()  # [G, D]
        d = err.shape[1]
        frames.append(pd.DataFrame({
            "method": method, "layer": layer, "kv_head": kv_head, "page": page, "side": side,
            "token": tokens.repeat_interleave(d).numpy(), "channel": torch.arange(d).repeat(g).numpy(),
            "error": err.flatten().numpy(),
            "boosted": boosted.repeat(g).numpy() if side == "keys" else False}))
    return pd.concat(frames, ignore_index=True)


# -- against the probe ------------------------------------------------------------------------------
def layer_sensitivity(cap, progress=None):
    """Per layer, the probe's sensitivity summed over heads and channels (`probe.sensitivity_all`):
    attention MSE when each key channel alone is INT2."""
    from .probe import sensitivity_all

    sens = sensitivity_all(cap, progress=progress)
    return sens.groupby("layer", as_index=False)["mse"].sum().rename(columns={"mse": "probe_mse"})


def ranking_agreement(layers, sensitivity, mode: str = "only") -> float:
    """Spearman correlation of the layers' ranking by KL (one method, one mode) against the probe's
    per-layer sensitivity. With every layer but l quantized, the layers that matter most leave the
    least KL: that ranking is the reverse one."""
    import torch

    from .probe import spearman

    kl = layers[layers.quantized == mode].set_index("layer")["kl"].sort_index()
    probe = sensitivity.set_index("layer")["probe_mse"].reindex(kl.index)
    sign = -1.0 if mode == "all_but" else 1.0
    return spearman(torch.tensor(sign * kl.to_numpy()), torch.tensor(probe.to_numpy()))


# -- saved runs -------------------------------------------------------------------------------------
def read_saved(folder: Path) -> dict:
    """The tables of a saved run (as `main` writes them) and its settings; ResultFileError naming the
    file and what is wrong if one is missing or unreadable."""
    import pandas as pd

    from .results import ResultFileError, check_version

    folder = Path(folder)
    try:
        settings = json.loads((folder / "settings.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ResultFileError(f"{folder.name}/settings.json cannot be read ({err})") from None
    if isinstance(settings, dict):
        check_version(settings, f"{folder.name}/settings.json")
    need = ("model", "context", "continuation", "methods", "layer", "q_head", "kv_head", "page", "kl_all")
    if not isinstance(settings, dict) or any(k not in settings for k in need):
        raise ResultFileError(f"{folder.name}/settings.json lacks some of {', '.join(need)}")
    found = {"settings": settings}
    for name in FILES + ("layer_sensitivity",):
        path = folder / f"{name}.csv"
        if name == "layer_sensitivity" and not path.exists():
            found[name] = None  # a run without the probe
            continue
        try:
            df = pd.read_csv(path)
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ResultFileError(f"{folder.name}/{path.name} cannot be read as CSV ({err})") from None
        missing = [c for c in COLUMNS.get(name, ("layer", "probe_mse")) if c not in df]
        if missing or df.empty:
            raise ResultFileError(f"{folder.name}/{path.name} " + (f"lacks the columns {', '.join(missing)}"
                                                                     if missing else "holds no rows"))
        found[name] = df
    return found


def main(argv=None) -> int:
    from .cli import count, parser
    from .texts import shipped_path

    p = parser("kitty_core.attribution", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo | hub id | local directory | file.gguf")
    p.add_argument("--text", type=Path, default=shipped_path(), help="a plain-text file; its first tokens")
    p.add_argument("--context", type=count(1), default=1024, help="tokens in the cache")
    p.add_argument("--continuation", type=count(1), default=32, help="tokens scored after them")
    p.add_argument("--methods", default="kitty-pro,kivi-k2v2", help="comma-separated methods")
    p.add_argument("--modes", default="only,all_but", help="per-layer runs: only (this layer quantized), "
                                                           "all_but (every layer but this one)")
    p.add_argument("--layer", type=int, default=None, help="layer of the attention map and page; None: the "
                                                          "first method's worst layer by attention moved")
    p.add_argument("--q-head", type=int, default=None, help="query head of the attention map; None: that "
                                                           "layer's worst")
    p.add_argument("--page", type=count(0), default=0, help="page whose quantization error is kept")
    p.add_argument("--no-probe", action="store_true", help="skip the probe's per-layer sensitivity")
    p.add_argument("--device", default=None, help="cpu | cuda; None: a GPU if there is one")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16; None: the device's default")
    p.add_argument("--engine", default=None, help="reference | triton; None: triton on a GPU")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the tables")
    a = p.parse_args(argv)
    return _run(a)


def _run(a) -> int:
    import pandas as pd
    from tqdm import tqdm

    from .cli import writable, write_csv, write_text
    from .config import parse_method
    from .models import ModelLoadError, load_model
    from .results import stamp

    try:
        methods = [m.strip() for m in a.methods.split(",") if m.strip()]
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        for m in methods:
            parse_method(m)  # a wrong name fails here, before the model loads
        writable(a.out, folder=True)
        text = a.text.read_text()
        lm = load_model(a.model, device=a.device, dtype=a.dtype)
        if lm.tokenizer is None:
            raise ValueError(f"{a.model} has no tokenizer: attribution scores a text")
        n_layers = lm.shape["layers"]
        if a.layer is not None and not 0 <= a.layer < n_layers:
            raise ValueError(f"--layer must be in [0, {n_layers - 1}], got {a.layer}")
        bar = tqdm(file=sys.stderr, unit="step")

        def step(done, total, label):
            bar.total = total + (0 if a.no_probe else n_layers)
            bar.set_description(label)
            bar.update(done - bar.n)

        found = analyse(lm.model, lm.tokenizer, text, methods, a.context, a.continuation, modes, a.engine, step)
        cap = found["cap"]
        tables = {"layer_kl": [found["layer_kl"]], "head_error": [found["head_error"]], "attention_map": [],
                  "parts": [], "page_error": []}
        settings = {"model": a.model, "text": a.text.name, "context": a.context, "continuation": a.continuation,
                    "methods": methods, "modes": modes, "device": str(lm.device), "dtype": str(lm.dtype),
                    "kl_all": found["kl_all"], "spearman": {}}
        heads = found["head_error"][found["head_error"].method == methods[0]]
        layer = a.layer if a.layer is not None else int(heads.groupby("layer")["moved"].mean().idxmax())
        in_layer = heads[heads.layer == layer]
        q_head = a.q_head if a.q_head is not None else int(in_layer.loc[in_layer.moved.idxmax(), "q_head"])
        kv_head = q_head // (cap.queries[layer].shape[0] // cap.keys[layer].shape[0])
        for m in methods:
            amap, spans = attention_map(cap, m, layer, q_head, a.context)
            tables["attention_map"].append(amap)
            tables["parts"].append(spans.assign(method=m)[list(COLUMNS["parts"])])
            tables["page_error"].append(page_error(cap, m, layer, kv_head, a.page, a.context))
        settings.update(layer=layer, q_head=q_head, kv_head=kv_head, page=a.page)
        sens = None
        if not a.no_probe:
            first = bar.n
            sens = layer_sensitivity(cap, progress=lambda done, total: (bar.set_description(f"probe: layer {done}"),
                                                                        bar.update(first + done + 1 - bar.n)))
            for m in methods:
                layers = found["layer_kl"][found["layer_kl"].method == m]
                settings["spearman"][m] = {mode: ranking_agreement(layers, sens, mode) for mode in modes}
        bar.close()
    except (ValueError, ModelLoadError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, frames in tables.items():  # 6 decimals: the saved tables stay small, far below any difference shown
        write_csv(a.out / f"{name}.csv", pd.concat(frames, ignore_index=True).round(6))
    if sens is not None:
        write_csv(a.out / "layer_sensitivity.csv", sens)
    write_text(a.out / "settings.json", json.dumps(stamp(settings), indent=2))
    _print(tables, settings, sens)
    return 0


def _print(tables, settings, sens) -> None:
    import pandas as pd

    layers = pd.concat(tables["layer_kl"], ignore_index=True)
    wide = layers.pivot_table(index="layer", columns=["method", "quantized"], values="kl")
    print(wide.to_string(float_format=lambda x: f"{x:.4f}"))
    for m in settings["methods"]:
        only = layers[(layers.method == m) & (layers.quantized == "only")].sort_values("kl", ascending=False)
        top = ", ".join(f"{int(r.layer)} ({r.kl:.4f})" for r in only.head(3).itertuples())
        print(f"{m}: KL with every layer quantized {settings['kl_all'][m]:.4f}; sum of single layers "
              f"{only.kl.sum():.4f}; worst layers alone: {top}"
              + (f"; Spearman against the probe {settings['spearman'][m]}" if sens is not None else ""))
    heads = pd.concat(tables["head_error"], ignore_index=True)
    for m, g in heads.groupby("method"):
        hi, lo = g.loc[g.moved.idxmax()], g.loc[g.moved.idxmin()]
        print(f"{m}: attention moved {100 * g.moved.mean():.2f}% on average; most {100 * hi.moved:.2f}% "
              f"(layer {int(hi.layer)}, query head {int(hi.q_head)}), least {100 * lo.moved:.3f}% "
              f"(layer {int(lo.layer)}, query head {int(lo.q_head)})")


if __name__ == "__main__":
    sys.exit(main())
