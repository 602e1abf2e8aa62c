"""Generation against FP16: each method's greedy continuation of one prompt, where it first departs
from FP16, and the per-step KL(FP16 || method) along FP16's own continuation.

A short prompt never leaves the FP16 sink and buffers, so the default is a long context: the first
`tokens` tokens of a text, continued from where they stop (`long_context`), or a passkey prompt,
with enough new tokens that pages are packed while the methods generate. The lab's first visit
reads a saved run:

    python -m kitty_core.generate --tokens 2048 --new-tokens 64 --json data/results/generations_demo_cpu.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from .cli import count, parser, progress_bar, writable
from .texts import shipped_path


def arguments():
    p = parser("kitty_core.generate", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo | hub id | local directory | file.gguf")
    p.add_argument("--text", type=Path, default=shipped_path(), help="the text whose first tokens are the context")
    p.add_argument("--tokens", type=count(1), default=2048, help="context tokens taken from the text")
    p.add_argument("--new-tokens", type=count(1), default=64, help="tokens each method generates")
    p.add_argument("--methods", default="kivi-k2v2,kitty-pro", help="compared with fp16, comma-separated")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16")
    p.add_argument("--json", type=Path, default=None, help="write {settings, texts, kl} here")
    return p


if __name__ == "__main__":
    arguments().parse_args()  # --help and usage errors answer here, before the imports below load torch

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from .cache import KittyCache  # noqa: E402
from .config import parse_method  # noqa: E402
from .evaluate import continuation_logprobs  # noqa: E402
from .memory import layout_segments  # noqa: E402
from .results import ResultFileError, check_version, stamp  # noqa: E402


class _TextCallback(BaseStreamer):
    """Calls fn(text so far) (if given) and tick() after each generated token (the prompt, put first,
    is skipped)."""

    def __init__(self, tokenizer, fn: Callable[[str], None] | None, tick: Callable[[], None] | None = None):
        self.tokenizer, self.fn, self.tick, self.tokens, self.prompt_seen = tokenizer, fn, tick, [], False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.tokens += value.reshape(-1).tolist()
        if self.fn:
            self.fn(self.tokenizer.decode(self.tokens, skip_special_tokens=True))
        if self.tick:
            self.tick()

    def end(self):
        pass


@torch.inference_mode()
def compare_generations(model, tokenizer, prompt: str, methods, max_new_tokens: int = 64,
                        engine: str | None = None, chat: bool = False,
                        on_text: Callable[[str, str], None] | None = None,
                        progress=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(texts, kl): one row per method with its text, token ids, first differing position (None if
    it matches FP16 throughout) and the shares of the context's keys and values in 2-bit pages at
    the end; and per-step KL of each method against FP16.
    With chat=True the prompt is a user turn in the tokenizer's chat template, if it has one.
    `on_text(method, text so far)` streams each generation as it is produced; `progress(done,
    total, label)` counts generated and teacher-forced tokens."""
    if not prompt.strip():
        raise ValueError("the prompt is empty: type a prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    methods = ["fp16"] + [m for m in methods if m != "fp16"]
    device = next(model.parameters()).device
    enc = tokenizer([prompt], return_tensors="pt").to(device)
    n = enc.input_ids.shape[1]
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit and n + max_new_tokens > limit:
        raise ValueError(f"the prompt ({n} tokens) plus {max_new_tokens} new tokens exceeds the context of {limit}")
    configs = {m: parse_method(m) for m in methods}  # a bad name fails before any generation
    # tokens to generate, then to teacher-force, per method; the second half is known after FP16's
    todo = {"done": 0, "total": 2 * len(methods) * max_new_tokens}

    def tick(label: str, n: int = 1) -> None:
        todo["done"] += n
        if progress:
            progress(todo["done"], todo["total"], label)

    rows, ref = [], None
    for m in methods:
        streamer = (_TextCallback(tokenizer, (lambda text, m=m: on_text(m, text)) if on_text else None,
                                  (lambda m=m: tick(f"{m}: generating")) if progress else None)
                    if on_text or progress else None)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                             past_key_values=KittyCache(model, m, engine), pad_token_id=tokenizer.pad_token_id)
        new = out[0, n:].tolist()
        if ref is None:
            ref = new
            todo["total"] = len(methods) * (max_new_tokens + len(new))
        todo["done"] = (methods.index(m) + 1) * max_new_tokens  # a generation that stopped early counts whole
        diverge = next((i for i, (a, b) in enumerate(zip(new, ref)) if a != b), None)
        if diverge is None and len(new) != len(ref):
            diverge = min(len(new), len(ref))
        rows.append({"method": m, "text": tokenizer.decode(new, skip_special_tokens=True), "tokens": new,
                     "first_divergence": diverge, "context_tokens": n, **paged_share(configs[m], n + len(new))})
    # teacher-force FP16's continuation through every cache: the same tokens, so steps compare
    ids = torch.tensor([enc.input_ids[0].tolist() + ref], device=device)
    forced = lambda m: (lambda i, total, _: tick(f"{m}: scoring FP16's tokens")) if progress else None  # noqa: E731
    fp16 = continuation_logprobs(model, ids, n, "fp16", engine, progress=forced("fp16"))[0]
    kl_rows = []
    for m in methods[1:]:
        logp = continuation_logprobs(model, ids, n, m, engine, progress=forced(m))[0]
        kl = (fp16.exp() * (fp16 - logp)).sum(-1)
        kl_rows += [{"method": m, "step": i, "kl": float(v)} for i, v in enumerate(kl)]
    # nullable integers: None (never departs) beside positions must not turn them into floats
    texts = pd.DataFrame(rows).astype({"first_divergence": "Int64"})
    return texts, pd.DataFrame(kl_rows, columns=["method", "step", "kl"])


def paged_share(config, n_tokens: int) -> dict:
    """Shares of a sequence's n tokens whose keys and values sit in 2-bit pages (the rest: FP16 sink,
    buffers, window; a 4-bit or FP16 method has no 2-bit pages)."""
    seg = layout_segments(config, n_tokens)
    two_bit = seg[(seg["part"] == "pages") & (seg["bits"] < 4)]
    return {f"{side}_in_2bit_pages": float(two_bit.loc[two_bit["side"] == side, "tokens"].sum()) / max(n_tokens, 1)
            for side in ("keys", "values")}


def long_context(tokenizer, text: str, tokens: int) -> str:
    """The first `tokens` tokens of `text`, to be continued from where they stop (mid-sentence: the
    model's next tokens follow the text, so a method that departs from FP16 shows it early): long
    enough that the methods' pages hold most of it. ValueError if the text is shorter."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < tokens:
        raise ValueError(f"the text has {len(ids)} tokens; {tokens} were asked for: pick fewer or a longer text")
    return tokenizer.decode(ids[:tokens])


def save_generations(path: Path, texts: pd.DataFrame, kl: pd.DataFrame, settings: dict) -> None:
    """{settings, texts: [...], kl: [...]} as JSON, written whole (`cli.write_text`)."""
    from .cli import write_text

    rows = texts.astype({"first_divergence": object}).where(texts.notna(), None).to_dict(orient="records")
    write_text(Path(path), json.dumps(stamp({"settings": settings, "texts": rows, "kl": kl.to_dict(orient="records")})))


def read_generations(path: Path) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(settings, texts, kl) of a saved comparison; ResultFileError naming what is missing."""
    try:
        found = json.loads(Path(path).read_text())
        check_version(found, Path(path).name)
        texts, kl = pd.DataFrame(found["texts"]), pd.DataFrame(found["kl"], columns=["method", "step", "kl"])
        settings = dict(found["settings"])
        missing = [c for c in ("method", "text", "tokens", "first_divergence") if c not in texts]
    except ResultFileError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ResultFileError(f"{Path(path).name} is not a saved generation run "
                              f"({type(err).__name__}: {err})") from None
    if missing or texts.empty:
        raise ResultFileError(f"{Path(path).name}: its texts lack {', '.join(missing) or 'rows'}")
    return settings, texts.astype({"first_divergence": "Int64"}), kl


def main(argv=None) -> int:
    from .models import ModelLoadError, load_model

    a = arguments().parse_args(argv)
    try:
        methods = [m.strip() for m in a.methods.split(",") if m.strip()]
        if not methods:
            raise ValueError("--methods is empty: name at least one method to compare with fp16, e.g. kitty-pro")
        for m in methods:
            parse_method(m)
        if a.json:
            writable(a.json)
        lm = load_model(a.model, device=a.device, dtype=a.dtype)
        prompt = long_context(lm.tokenizer, a.text.read_text(), a.tokens)
        with progress_bar("generations", "method") as progress:
            texts, kl = compare_generations(lm.model, lm.tokenizer, prompt, methods, a.new_tokens, progress=progress)
    except (ValueError, ModelLoadError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mean = kl.groupby("method")["kl"].mean()
    for r in texts.itertuples():
        print(f"{r.method}: departs at {r.first_divergence}, mean KL {mean.get(r.method, 0.0):.4f}, "
              f"keys in 2-bit pages {r.keys_in_2bit_pages:.0%}")
    if a.json:
        save_generations(a.json, texts, kl, {
            "model": a.model, "device": str(lm.device), "dtype": str(lm.dtype).removeprefix("torch."),
            "text": a.text.name, "tokens": a.tokens, "new_tokens": a.new_tokens, "methods": methods,
            "prompt": "long context"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
