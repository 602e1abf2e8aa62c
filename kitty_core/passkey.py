"""Synthetic passkey retrieval: a random 5-digit key hidden at a chosen depth of filler text.

Prompts are generated locally (no data set). One batch per length holds every depth (and trial),
left-padded, so a method's cache serves sequences of different lengths at once.

    python -m kitty_core.passkey --methods fp16,kivi-k2v2,kitty-pro --lengths 1024,2048,4096
"""

from __future__ import annotations

import sys
from pathlib import Path

from .cli import count, numbers, parser, progress_bar, writable, write_csv


def arguments():
    p = parser("kitty_core.passkey", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo | hub id | local directory | file.gguf")
    p.add_argument("--methods", default="fp16,kivi-k2v2,kitty-pro", help="comma-separated methods")
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="where the key sits in the filler (0: start, 1: end)")
    p.add_argument("--trials", type=count(1), default=1, help="prompts (random keys) per length and depth")
    p.add_argument("--seed", type=int, default=0, help="seed of the random keys")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU, bfloat16 "
                   "or float16 on a GPU)")
    p.add_argument("--csv", type=Path, default=None, help="write one row per prompt and method here")
    return p


if __name__ == "__main__":
    arguments().parse_args()  # --help and usage errors answer here, before the imports below load torch

import random  # noqa: E402
import re  # noqa: E402

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from .cache import KittyCache  # noqa: E402
from .config import parse_method  # noqa: E402
from .models import ModelLoadError, load_model  # noqa: E402

INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and remember it.\n\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> str:
    """A prompt of about `length` tokens with the key at `depth` (0 = start, 1 = end) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    count = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    fixed = count(INTRO + NEEDLE.format(key=key) + QUESTION)
    per_filler = count(FILLER * 20) / 20
    n = max(int((length - fixed) / per_filler), 1)
    if length - fixed < per_filler:
        raise ValueError(f"length {length} is too short for a passkey prompt (needs > {fixed + per_filler:.0f})")
    at = round(depth * n)
    return INTRO + FILLER * at + NEEDLE.format(key=key) + FILLER * (n - at) + QUESTION


@torch.inference_mode()
def run_passkey(model, tokenizer, methods, lengths, depths=(0.1, 0.5, 0.9), trials: int = 1, seed: int = 0,
                engine: str | None = None, progress=None, rows: list | None = None) -> pd.DataFrame:
    """One row per (method, length, depth, trial): the key, the answer, and whether it was retrieved.
    `rows`: a list the rows are appended to as each batch finishes, so that a caller keeps them when
    the run is interrupted."""
    methods = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    if not methods:
        raise ValueError("no methods given: name at least one, e.g. fp16,kitty-pro")
    for m in methods:
        parse_method(m)
    if not lengths or not depths:
        raise ValueError("give at least one length and one depth")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    rng = random.Random(seed)
    device = next(model.parameters()).device
    # every prompt first: a length beyond the context, too short or a depth outside [0, 1] fails
    # before the first generation, not after the lengths before it ran
    batches = []
    for length in lengths:
        if limit and length + 8 > limit:
            raise ValueError(f"length {length} exceeds the model's context of {limit} tokens")
        cases = [(d, t, f"{rng.randrange(10000, 100000)}") for d in depths for t in range(trials)]
        batches.append((length, cases, [passkey_prompt(tokenizer, length, d, key) for d, _, key in cases]))
    rows, jobs = [] if rows is None else rows, len(methods) * len(lengths)
    for li, (length, cases, prompts) in enumerate(batches):
        enc = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
        for mi, m in enumerate(methods):
            if progress:
                progress(li * len(methods) + mi, jobs, f"{m} @ {length}")
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, past_key_values=KittyCache(model, m, engine),
                                 pad_token_id=tokenizer.pad_token_id)
            answers = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
            for (d, t, key), ans in zip(cases, answers):
                rows.append({"method": m, "length": length, "depth": d, "trial": t, "key": key,
                             "answer": ans.strip(), "correct": retrieved(ans, key),
                             "prompt_tokens": int(enc.attention_mask[cases.index((d, t, key))].sum())})
    return pd.DataFrame(rows)


def retrieved(answer: str, key: str) -> bool:
    """The first number in the answer is the key itself (not a longer or shorter number)."""
    found = re.search(r"\d+", answer)
    return bool(found) and found.group() == key


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Accuracy per method (rows) and length (columns)."""
    return df.pivot_table(index="method", columns="length", values="correct", aggfunc="mean", sort=False)


def main(argv=None) -> int:
    a = arguments().parse_args(argv)
    rows = []  # the trials done, kept if the run is interrupted
    try:
        lengths = numbers(a.lengths, int, "--lengths", "1024,2048")
        depths = numbers(a.depths, float, "--depths", "0.1,0.5,0.9")
        if any(not 0 <= d <= 1 for d in depths):
            raise ValueError(f"--depths must lie in [0, 1] (0: the start of the filler, 1: its end), got {a.depths!r}")
        if not [m for m in a.methods.split(",") if m.strip()]:
            raise ValueError("--methods is empty: name at least one method, e.g. fp16,kitty-pro")
        if a.csv:
            writable(a.csv)
        lm = load_model(a.model, device=a.device, dtype=a.dtype)
        with progress_bar("passkey batches", "batch") as progress:
            df = run_passkey(lm.model, lm.tokenizer, a.methods, lengths, depths, a.trials, a.seed, progress=progress,
                             rows=rows)
    except (ValueError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # the trials done, beside the target: an earlier complete file there stays as it was
        if a.csv and rows:
            partial = a.csv.with_name(f"{a.csv.stem}.partial{a.csv.suffix}")
            write_csv(partial, pd.DataFrame(rows))
            print(f"interrupted: the {len(rows)} trials done are in {partial}", file=sys.stderr)
        return 130
    print(summary(df).to_string(float_format=lambda x: f"{x:.2f}"))
    if a.csv:
        write_csv(a.csv, df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
