"""Decode steps from device counters (kitty_core.graphs): the step a CUDA graph captures gives the
logits of an eager step and leaves the cache in the same state. On CPU the device-driven step runs
eagerly (and the Kitty kernels in Triton's interpreter); the captured graphs run on a GPU."""

import os

import pytest
import torch

from conftest import tiny_model
from kitty_core import KittyCache
from kitty_core.graphs import GraphedDecoder
from kitty_core.throughput import make_cache

PROMPT = 40
SMALL_KITTY = "kitty-pro+sink=4+group_size=16+local_window=16"  # interpreter-sized pages


def _pair(make, model, ids, steps, graph=False):
    """(logits of `steps` device-driven steps, logits of eager steps fed the same tokens, both caches)."""
    b = ids.shape[0]
    with torch.inference_mode():
        ours, ref = make(), make()
        model(input_ids=ids, past_key_values=ours, use_cache=True)
        model(input_ids=ids, past_key_values=ref, use_cache=True)
        decoder = GraphedDecoder(model, ours, b, graph=graph, warmup=1)
        if graph:  # the capture's warm-up step was a real one, on token id 1
            model(input_ids=torch.ones((b, 1), dtype=torch.long, device=ids.device), past_key_values=ref, use_cache=True)
        fed, got = [], []
        for _ in range(steps):
            fed.append(decoder.ids.clone())
            got.append(decoder.step().clone())
        want = [model(input_ids=tok, past_key_values=ref, use_cache=True).logits[:, -1] for tok in fed]
    return got, want, ours, ref


def test_fp16_baseline_steps_from_device_counters_match_eager_steps():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 256, (2, PROMPT))
    steps = 6
    got, want, ours, ref = _pair(lambda: make_cache("fp16-prealloc", model, PROMPT + steps + 1), model, ids, steps)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert ours.get_seq_length() == ref.get_seq_length() == PROMPT + steps
    torch.testing.assert_close(ours.layers[1].keys, ref.layers[1].keys)  # every token in its slot
    decoder = GraphedDecoder(model, ours, 2, graph=False)
    decoder.step()  # the last slot
    with pytest.raises(ValueError, match="cache is full"):
        decoder.step()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="tiny shapes for the interpreter; on a GPU, "
                    "test_graph_replays_match_eager_steps_on_the_demo_model covers it")
def test_kitty_steps_from_device_counters_match_eager_steps_across_page_packs():
    """Triton engine (interpreter on CPU): 14 steps from 40 prompt tokens fill and pack a key page
    and a value page (G=16) between steps; the counters follow the host's packing."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 256, (2, PROMPT))
    steps = 14
    got, want, ours, ref = _pair(lambda: KittyCache(model, SMALL_KITTY, engine="triton", max_length=PROMPT + steps + 1),
                                 model, ids, steps)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    a, b = ours.layers[0], ref.layers[0]
    assert (a.seen, a.k_buffer.lens, a.v_window.lens) == (b.seen, b.k_buffer.lens, b.v_window.lens)
    assert a.k_pages.table == b.k_pages.table and len(a.k_pages.table[0]) == 3  # two packed in the prompt, one here
    n = a.k_buffer.lens[0]
    torch.testing.assert_close(a.k_buffer.buf[:, :, :n], b.k_buffer.buf[:, :, :n])
    assert int(ours.counters.lens[0]) == a.tokens(0) + 1 and int(ours.counters.write[0]) == n


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="tiny shapes for the interpreter")
def test_caches_that_cannot_step_from_device_counters_say_why():
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 256, (2, PROMPT))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded batch
    cases = [
        (KittyCache(model, SMALL_KITTY, engine="triton", max_length=64), {"input_ids": ids[:, :2]}, "sink is not full"),
        (KittyCache(model, SMALL_KITTY, engine="reference", max_length=64), {"input_ids": ids}, "reference"),
        (KittyCache(model, SMALL_KITTY, engine="triton"), {"input_ids": ids}, "max_length"),
        (KittyCache(model, SMALL_KITTY, engine="triton", max_length=64), {"input_ids": ids, "attention_mask": mask},
         "left-padded"),
    ]
    with torch.inference_mode():
        for cache, inputs, why in cases:
            model(**inputs, past_key_values=cache, use_cache=True)
            with pytest.raises(ValueError, match=why):
                GraphedDecoder(model, cache, 2, graph=False)
        with pytest.raises(ValueError, match="empty"):
            GraphedDecoder(model, make_cache("fp16-prealloc", model, 8), 2, graph=False)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp16-prealloc", "kitty-pro", "kivi-k2v2"])
def test_graph_replays_match_eager_steps_on_the_demo_model(kind):
    """On the GPU: 300 replays of the captured step (2 key pages packed between them) against eager
    steps fed the same tokens; fp16-prealloc's graph runs FlashAttention on device lengths."""
    from kitty_core import load_model
    from kitty_core.throughput import FLASH_USED_LENGTHS

    assert FLASH_USED_LENGTHS
    lm = load_model("demo", device="cuda", dtype=torch.float16)
    model = lm.model
    ids = lm.tokenizer(["The history of the printing press " * 30] * 4, return_tensors="pt").input_ids.cuda()
    steps, prompt = 300, ids.shape[1]
    got, want, ours, ref = _pair(lambda: make_cache(kind, model, prompt + steps + 4), model, ids, steps, graph=True)
    worst = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
    print(f"{kind}: {steps} graph replays, largest logit difference to eager steps {worst:.4f}")
    # the same tokens through the same kernels, but FlashAttention's variable-length call (graph) and
    # its fixed-length one (eager) split the keys differently: fp16 rounding, not a different history
    assert worst < 0.25
    assert ours.get_seq_length() == ref.get_seq_length()


@pytest.mark.gpu
def test_flash_on_device_lengths_matches_sdpa_on_the_prefix():
    from kitty_core.throughput import fp16_decode_attention

    torch.manual_seed(0)
    b, cap, h, rep, d = 3, 1000, 8, 4, 128
    q = torch.randn(b, h * rep, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, h, cap, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor([1, 517, 1000], dtype=torch.int32, device="cuda")
    out = fp16_decode_attention(q, k, v, lens, d**-0.5)
    for i, n in enumerate(lens.tolist()):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[i, :, None], k[i, :, :n], v[i, :, :n], scale=d**-0.5, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i], want, atol=2e-2, rtol=2e-2)
