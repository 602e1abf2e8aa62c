"""Generation against FP16: each method's greedy continuation of one prompt, where it first departs
from FP16, and the per-step KL(FP16 || method) along FP16's own continuation."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch
from transformers.generation.streamers import BaseStreamer

from .cache import KittyCache
from .evaluate import continuation_logprobs


class _TextCallback(BaseStreamer):
    """Calls fn(text so far) after each generated token (the prompt, put first, is skipped)."""

    def __init__(self, tokenizer, fn: Callable[[str], None]):
        self.tokenizer, self.fn, self.tokens, self.prompt_seen = tokenizer, fn, [], False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.tokens += value.reshape(-1).tolist()
        self.fn(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def end(self):
        pass


@torch.inference_mode()
def compare_generations(model, tokenizer, prompt: str, methods, max_new_tokens: int = 64,
                        engine: str | None = None, chat: bool = False,
                        on_text: Callable[[str, str], None] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(texts, kl): one row per method with its text, token ids and first differing position
    (None if it matches FP16 throughout); and per-step KL of each method against FP16.
    With chat=True the prompt is a user turn in the tokenizer's chat template, if it has one.
    `on_text(method, text so far)` streams each generation as it is produced."""
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
    rows, ref = [], None
    for m in methods:
        streamer = _TextCallback(tokenizer, lambda text, m=m: on_text(m, text)) if on_text else None
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                             past_key_values=KittyCache(model, m, engine), pad_token_id=tokenizer.pad_token_id)
        new = out[0, n:].tolist()
        if ref is None:
            ref = new
        diverge = next((i for i, (a, b) in enumerate(zip(new, ref)) if a != b), None)
        if diverge is None and len(new) != len(ref):
            diverge = min(len(new), len(ref))
        rows.append({"method": m, "text": tokenizer.decode(new, skip_special_tokens=True), "tokens": new,
                     "first_divergence": diverge})
    # teacher-force FP16's continuation through every cache: the same tokens, so steps compare
    ids = torch.tensor([enc.input_ids[0].tolist() + ref], device=device)
    fp16 = continuation_logprobs(model, ids, n, "fp16", engine)[0]
    kl_rows = []
    for m in methods[1:]:
        logp = continuation_logprobs(model, ids, n, m, engine)[0]
        kl = (fp16.exp() * (fp16 - logp)).sum(-1)
        kl_rows += [{"method": m, "step": i, "kl": float(v)} for i, v in enumerate(kl)]
    # nullable integers: None (never departs) beside positions must not turn them into floats
    texts = pd.DataFrame(rows).astype({"first_divergence": "Int64"})
    return texts, pd.DataFrame(kl_rows, columns=["method", "step", "kl"])
