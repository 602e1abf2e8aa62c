"""lm-eval's HF model with a KittyCache under every call: `--model kitty --model_args pretrained=...,method=...`.

`KittyLM` is lm-eval's own `HFLM`, so tokenization, chat templates, batching, stop sequences and the
request ordering are lm-eval's; what changes is the cache each model call runs through, a fresh
`KittyCache(model, method, engine)`:

- `generate_until`: `model.generate(..., past_key_values=KittyCache(...))`, the pools reserved for
  the prompt plus `max_gen_toks`. On a GPU the Triton engine's cache is compileable, so `generate`
  decodes through transformers' compiled forward (`docs/generate.md`).
- `loglikelihood` (and `loglikelihood_rolling`): per batch, the contexts are prefilled into the cache
  in one forward (left-padded; the prefill attends over itself in FP16 and is then stored as the
  method stores it: FP16 sink, packed pages, buffers), and the continuation is fed after it in
  chunks of `score_chunk` tokens (default 128, one page), each chunk attending over everything
  before it as stored, as a later prefill chunk or a decode step does. Every continuation token is
  thus scored against the context as the method keeps it; `score_chunk=1` feeds the continuation one
  token a step, as greedy decoding would. A context shorter than the sink stays FP16 whatever the
  method. For `fp16` the scores are those of lm-eval's `hf` model up to float rounding.

Importing this module registers `kitty` in lm-eval's model registry (lm-eval 0.4.13's `lm_eval`
command reads its registry from its own package only; `python -m kitty_core.lm_eval_harness` is
that command with this module imported):

    import kitty_core.lm_eval_model  # noqa: F401  (registers "kitty")
    lm_eval.simple_evaluate(model="kitty", model_args="pretrained=demo,method=kitty-pro", tasks=[...])

`pretrained` takes every name `kitty_core.models.load_model` takes (demo, a hub id, a local
directory, a .gguf file, `random:<shape>` with a `tokenizer=`), a `LoadedModel`, or a transformers
model with its `tokenizer`.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from tqdm import tqdm

from .cache import KittyCache
from .engines import make_engine
from .config import parse_method
from .models import LoadedModel, ModelLoadError, load_model

OUR_ARGS = ("pretrained", "method", "engine", "score_chunk", "tokenizer", "device", "dtype", "trust_remote_code")
HFLM_ARGS = tuple(p for p in inspect.signature(HFLM.__init__).parameters if p not in ("self", "kwargs"))
# HFLM options that only apply when HFLM loads the model itself (from a hub id, with accelerate ...)
NOT_HERE = ("backend", "revision", "subfolder", "parallelize", "max_memory_per_gpu", "max_cpu_memory",
            "offload_folder", "tp_plan", "peft", "delta", "autogptq", "gptqmodel", "gguf_file")


class KittyLMError(ValueError):
    """Bad `model_args` for the kitty model; the message names the argument and what to pass."""


def _instance_notes(record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return not (text.startswith("`pretrained` model kwarg is not of type") or text.startswith("Passed an already-initialized"))


@register_model("kitty")
class KittyLM(HFLM):
    """lm-eval's HFLM whose every generate and loglikelihood call runs through a fresh KittyCache."""

    def __init__(self, pretrained="demo", method: str = "kitty-pro", engine: str | None = None,
                 score_chunk: int = 128, tokenizer=None, device: str | None = None, dtype: str | None = "auto",
                 trust_remote_code: bool = False, **kwargs):
        unknown = sorted(set(kwargs) - set(HFLM_ARGS))
        if unknown:
            raise KittyLMError(f"the kitty model takes no model_args {', '.join(unknown)}; it takes "
                               f"{', '.join(OUR_ARGS)} and lm-eval's hf options (batch_size, max_length, ...)")
        ignored = sorted(set(kwargs) & set(NOT_HERE))
        if ignored:
            raise KittyLMError(f"model_args {', '.join(ignored)} would be ignored: the kitty model loads "
                               "its model with kitty_core.models.load_model (pass pretrained= and dtype=)")
        try:
            self.config_kitty = parse_method(str(method))
        except ValueError as err:
            raise KittyLMError(f"model_args method={method!r}: {err}") from None
        self.method = str(method)
        self.engine_name = engine or None
        if self.engine_name:
            try:
                make_engine(self.engine_name)
            except (ValueError, ImportError) as err:
                raise KittyLMError(f"model_args engine={engine!r}: {err}") from None
        if not isinstance(score_chunk, int) or isinstance(score_chunk, bool) or score_chunk < 1:
            raise KittyLMError(f"model_args score_chunk must be an integer of at least 1, got {score_chunk!r}")
        self.score_chunk = score_chunk
        model, tok, name = self._load(pretrained, tokenizer, device, dtype, trust_remote_code)
        self.model_name = name
        self.last_cache_report = None  # what the last call's cache held: {call, method, held_tokens, bytes}
        hf_log = logging.getLogger("lm_eval.models.huggingface")
        hf_log.addFilter(_instance_notes)  # HFLM's notes on a model passed as an object: this class always does
        try:
            super().__init__(pretrained=model, tokenizer=tok, **kwargs)
        finally:
            hf_log.removeFilter(_instance_notes)

    @staticmethod
    def _load(pretrained, tokenizer, device, dtype, trust_remote_code):
        """(model, tokenizer, name) from a model name, a LoadedModel, or a model instance with its tokenizer."""
        from .lm_eval_tasks import load_tokenizer

        if isinstance(pretrained, torch.nn.Module) and tokenizer is None:
            raise KittyLMError("a model instance as pretrained needs its tokenizer as tokenizer=")
        if isinstance(pretrained, str) and pretrained.startswith("random:") and tokenizer is None:
            raise KittyLMError(f"model_args pretrained={pretrained!r} has random weights and no tokenizer: add "
                               "tokenizer=demo (or a hub id) to the model_args")
        if isinstance(tokenizer, str):
            try:
                tokenizer = load_tokenizer(tokenizer)
            except ModelLoadError as err:
                raise KittyLMError(f"model_args tokenizer={tokenizer!r}: {err}") from None
        try:
            if isinstance(pretrained, LoadedModel):
                model, tok, name = pretrained.model, tokenizer or pretrained.tokenizer, pretrained.name
            elif isinstance(pretrained, torch.nn.Module):
                model, tok, name = pretrained, tokenizer, getattr(pretrained, "name_or_path", type(pretrained).__name__)
            else:
                lm = load_model(str(pretrained), device=device, dtype=dtype, trust_remote_code=trust_remote_code)
                model, tok, name = lm.model, tokenizer or lm.tokenizer, str(pretrained)
        except ModelLoadError as err:
            raise KittyLMError(f"model_args pretrained={pretrained!r}: {err}") from None
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return model, tok, name

    # -- the cache -------------------------------------------------------------------------------
    def new_cache(self, max_length: int | None = None) -> KittyCache:
        return KittyCache(self.model, self.config_kitty, self.engine_name, max_length=max_length)

    def _report(self, call: str, cache: KittyCache) -> None:
        held = cache.held_tokens() if cache.is_initialized else []
        self.last_cache_report = {"call": call, "method": self.method, "held_tokens": held, "bytes": cache.nbytes()}

    # -- generate_until --------------------------------------------------------------------------
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        if int(generation_kwargs.get("num_beams", 1) or 1) > 1:
            raise KittyLMError("KittyCache decodes greedily or by sampling, not by beam search: drop num_beams "
                               "from the task's or --gen_kwargs' generation settings")
        cache = self.new_cache(max_length)
        out = super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
        self._report("generate_until", cache)
        return out

    # -- loglikelihood ---------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's request handling (longest first; one-token continuations of a shared context scored
        once), with each batch scored through a cache (`_continuation_logprobs`)."""
        def by_length(req):
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        re_ord = Collator(requests, sort_fn=by_length,
                          group_by="contexts" if self.backend == "causal" and self.logits_cache else None,
                          group_fn=lambda req: req[-2] + req[-1][:-1])
        auto = self.batch_size == "auto"
        size = self.batch_size if not auto else override_bs or 0
        batch_fn = self._batch_scheduler if auto and len(re_ord) > 0 and not override_bs else None
        if batch_fn is not None:
            self.batch_sizes = {}
        res = []
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        for chunk in re_ord.get_batched(n=size, batch_fn=batch_fn):
            pairs = [self._split(ctx, cont) for _, ctx, cont in chunk]
            for (req_str, ctx_toks, cont_toks), logp in zip(chunk, self._continuation_logprobs(pairs), strict=True):
                for req_str, toks, lp in re_ord.get_cache(req_str=req_str, cxt_toks=ctx_toks, cont_toks=cont_toks,
                                                           logits=logp[None]):
                    target = torch.tensor(toks, dtype=torch.long, device=lp.device)[None]  # [1, n]
                    lp = lp[:, -target.shape[1]:]
                    answer = (float(lp.gather(2, target[..., None]).sum()), bool((lp.argmax(-1) == target).all()))
                    res.append(answer)
                    if req_str is not None:
                        self.cache_hook.add_partial("loglikelihood", req_str, answer)
                    pbar.update(1)
        pbar.close()
        return re_ord.get_original(res)

    def _split(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """(tokens to prefill, tokens to score), left-truncated to the model's length as HFLM does."""
        if not context or not continuation:
            raise ValueError("a loglikelihood request needs a context and a continuation of at least one token")
        if len(continuation) > self.max_length:
            raise ValueError(f"a continuation of {len(continuation)} tokens exceeds the model's {self.max_length}")
        full = (context + continuation)[-(self.max_length + 1):]
        return full[: len(full) - len(continuation)], continuation

    @torch.inference_mode()
    def _continuation_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """Log-probabilities [len(continuation), V] of each pair's continuation tokens' predictions: the
        contexts prefilled into one cache, the continuations fed after them `score_chunk` tokens at a time.

        Rows are contexts left-padded to one length P, then continuations (without their last token)
        right-padded to C - 1. A right pad is stored like a token, but only after its row's last real
        token, which nothing real of the row attends to."""
        b, dev = len(pairs), self.device
        p = max(len(ctx) for ctx, _ in pairs)
        c = max(len(cont) for _, cont in pairs)
        ids = torch.full((b, p + c - 1), self.tokenizer.pad_token_id, dtype=torch.long)  # [B, P + C - 1]
        mask = torch.zeros_like(ids)
        for i, (ctx, cont) in enumerate(pairs):
            ids[i, p - len(ctx):p] = torch.tensor(ctx)
            ids[i, p:p + len(cont) - 1] = torch.tensor(cont[:-1], dtype=torch.long)
            mask[i, p - len(ctx):p] = 1
        mask[:, p:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = self.new_cache(max_length=p + c)
        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                            enabled=self.mixed_precision_dtype is not None):
            out = self.model(input_ids=ids[:, :p], attention_mask=mask[:, :p], position_ids=positions[:, :p],
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = [out.logits[:, -1:]]  # [B, 1, V]: the prediction of each continuation's first token
            for s in range(p, p + c - 1, self.score_chunk):
                e = min(s + self.score_chunk, p + c - 1)
                out = self.model(input_ids=ids[:, s:e], attention_mask=mask[:, :e], position_ids=positions[:, s:e],
                                 past_key_values=cache, use_cache=True)
                logits.append(out.logits)
        self._report("loglikelihood", cache)
        logp = F.log_softmax(torch.cat(logits, 1), dim=-1, dtype=self.softmax_dtype)  # [B, C, V]
        return [logp[i, : len(cont)] for i, (_, cont) in enumerate(pairs)]

    def get_model_info(self) -> dict:
        return {"model": self.model_name, "method": self.method, "engine": self.engine_name or "default",
                "score_chunk": self.score_chunk, "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype)}
