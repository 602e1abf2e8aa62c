"""Decode steps from device counters (kitty_core.graphs): the step a CUDA graph captures gives the
logits of an eager step and leaves the cache in the same state. On CPU the device-driven step runs
eagerly (and the Kitty kernels in Triton's interpreter); the captured graphs run on a GPU."""

import os

import pytest
import torch

from conftest import tiny_model
from kitty_core import KittyCache
from kitty_core.baselines import make_cache
from kitty_core.graphs import CompiledDecoder, GraphedDecoder

PROMPT = 40
SMALL_KITTY = "kitty-pro+sink=4+group_size=16+local_window=16"  # interpreter-sized pages


def _pair(make, model, ids, steps, graph=False, make_ref=None):
    """(logits of `steps` device-driven steps, logits of eager steps fed the same tokens, both caches).
    `make_ref`: the eager steps' cache, if not `make`'s (a KittyCache's steps from the host's record)."""
    with torch.inference_mode():
        ours, ref = make(), (make_ref or make)()
        model(input_ids=ids, past_key_values=ours, use_cache=True)
        model(input_ids=ids, past_key_values=ref, use_cache=True)
        decoder = GraphedDecoder(model, ours, ids.shape[0], graph=graph)
        fed, got = [], []
        for _ in range(steps):
            fed.append(decoder.ids.clone())
            got.append(decoder.step().clone())
        want = [model(input_ids=tok, past_key_values=ref, use_cache=True).logits[:, -1] for tok in fed]
    return got, want, ours, decoder, ref


def test_fp16_baseline_steps_from_device_counters_match_eager_steps():
    """Steps from 250 to 260 tokens: the window the device-driven steps read grows from 256 to 512."""
    model = tiny_model("qwen3")
    prompt, steps = 250, 10
    ids = torch.randint(3, 256, (2, prompt))
    got, want, ours, decoder, ref = _pair(lambda: make_cache("fp16-prealloc", model, prompt + steps + 1),
                                          model, ids, steps)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert ours.get_seq_length() == ref.get_seq_length() == prompt + steps
    assert ours.layers[0].window == prompt + steps + 1  # the last window stops at the capacity
    torch.testing.assert_close(ours.layers[1].keys, ref.layers[1].keys)  # every token in its slot
    decoder.close()  # an eager step after the decoder's: it takes up the host's record
    with torch.inference_mode():
        tok = decoder.ids.clone()
        eager = model(input_ids=tok, past_key_values=ours, use_cache=True).logits[:, -1]
        torch.testing.assert_close(eager, model(input_ids=tok, past_key_values=ref, use_cache=True).logits[:, -1])
    with pytest.raises(ValueError, match="cache is full"):
        GraphedDecoder(model, ours, 2, graph=False).step()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="tiny shapes for the interpreter; on a GPU, "
                    "test_graph_replays_match_eager_steps_on_the_demo_model covers it")
@pytest.mark.parametrize("tail", ["", "+tail_bits=8"])
def test_kitty_steps_from_device_counters_match_eager_steps_across_page_packs(tail):
    """Triton engine (interpreter on CPU): 14 steps from 40 prompt tokens fill and pack a key page
    and a value page (G=16) between steps; the counters follow the host's packing. An 8-bit tail:
    the kernel quantizes each step's token as the host does (the same codes and scales)."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 256, (2, PROMPT))
    steps = 14
    make = lambda host=False: KittyCache(model, SMALL_KITTY + tail, engine="triton", max_length=PROMPT + steps + 1,  # noqa: E731
                                         device_steps=not host)
    got, want, ours, decoder, ref = _pair(make, model, ids, steps, make_ref=lambda: make(host=True))
    for g, w in zip(got, want):  # the kernels write the token and take it into their tiles: same numbers
        assert torch.equal(g, w)
    a, b = ours.layers[0], ref.layers[0]
    assert (a.seen, a.k_buffer.lens, a.v_window.lens) == (b.seen, b.k_buffer.lens, b.v_window.lens)
    assert a.k_pages.table == b.k_pages.table and len(a.k_pages.table[0]) == 3  # two packed in the prompt, one here
    n = a.k_buffer.lens[0]
    assert len(a.k_buffer.tensors()) == (2 if tail else 1)
    for mine, host in ((a.k_buffer, b.k_buffer), (a.v_window, b.v_window)):  # codes and scales, as stored
        for x, y in zip(mine.tensors(), host.tensors()):
            assert torch.equal(x[:, :, : host.lens[0]], y[:, :, : host.lens[0]])
    assert int(ours.counters.lens[0]) == a.tokens(0) + 1 and int(ours.counters.write[0, 0]) == n
    with decoder, torch.inference_mode():  # then back to eager steps, from the host's record
        tok = decoder.ids.clone()
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=tok, past_key_values=ours).logits,
                                   model(input_ids=tok, past_key_values=ref).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="tiny shapes for the interpreter")
def test_compiled_decoder_takes_the_steps_of_the_graphed_one():
    """The benchmarks' compiled decoder (generate's compiled forward; aot_eager on a CPU, so the
    interpreter's kernels run inside the traced graph) packs between its steps by itself and gives
    the greedy tokens and logits of the graphed loop's steps; a cache it cannot compile is refused."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True
    runs = []
    for decoder in (CompiledDecoder, GraphedDecoder):
        cache = KittyCache(model, SMALL_KITTY, engine="triton", max_length=PROMPT + 16)
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        extra = {"compile_config": config} if decoder is CompiledDecoder else {"graph": False}
        with decoder(model, cache, 2, **extra) as d:
            runs.append(([d.step().clone() for _ in range(14)], d.ids.clone(), cache.layers[0].k_pages.table))
    (got, got_ids, got_pages), (want, want_ids, want_pages) = runs
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert torch.equal(got_ids, want_ids) and got_pages == want_pages and len(got_pages[0]) == 3
    with pytest.raises(ValueError, match="not compileable"):
        CompiledDecoder(model, KittyCache(model, SMALL_KITTY, engine="reference"), 2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="tiny shapes for the interpreter")
def test_caches_that_cannot_step_from_device_counters_say_why():
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 256, (2, PROMPT))
    cases = [
        (KittyCache(model, SMALL_KITTY, engine="triton", max_length=64), {"input_ids": ids[:, :2]}, "sink is not full"),
        (KittyCache(model, SMALL_KITTY, engine="reference", max_length=64), {"input_ids": ids}, "reference"),
        (KittyCache(model, SMALL_KITTY, engine="triton"), {"input_ids": ids}, "max_length"),
        (KittyCache(model, SMALL_KITTY + "+group_size=12", engine="triton", max_length=64), {"input_ids": ids},
         "page size 12"),
    ]
    with torch.inference_mode():
        for cache, inputs, why in cases:
            model(**inputs, past_key_values=cache, use_cache=True)
            with pytest.raises(ValueError, match=why):
                GraphedDecoder(model, cache, 2, graph=False)
        with pytest.raises(ValueError, match="empty"):
            GraphedDecoder(model, make_cache("fp16-prealloc", model, 8), 2, graph=False)
        cache = make_cache("fp16-prealloc", model, PROMPT + 4)
        model(input_ids=ids, past_key_values=cache)
        with pytest.raises(ValueError, match="a cache of 2 sequences"):
            GraphedDecoder(model, cache, 3, graph=False)
        with pytest.raises(ValueError, match="first_ids of 1 tokens"):
            GraphedDecoder(model, cache, 2, graph=False, first_ids=ids[:1, -1:])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp16-prealloc", "kitty-pro", "kitty-pro+tail_bits=8", "kivi-k2v2"])
def test_graph_replays_match_eager_steps_on_the_demo_model(kind):
    """On the GPU: 300 steps, replayed from captured graphs (2 key pages packed between them; the FP16
    baseline's window grows twice), against eager steps fed the same tokens. The 8-bit tail: the
    kernel writes each step's token as codes, and its dots widen the codes in registers."""
    from kitty_core import load_model

    lm = load_model("demo", device="cuda", dtype=torch.float16)
    model = lm.model
    ids = lm.tokenizer(["The history of the printing press " * 30] * 4, return_tensors="pt").input_ids.cuda()
    steps, prompt = 300, ids.shape[1]
    got, want, ours, decoder, ref = _pair(lambda: make_cache(kind, model, prompt + steps + 4), model, ids, steps,
                                          graph=True)
    worst = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
    print(f"{kind}: {steps} steps, {decoder.captures} graphs captured, largest logit difference to eager steps "
          f"{worst:.4f}")
    # the same tokens through the same weights; the attention kernels differ (cuDNN over a masked
    # window against flash on the prefix; the fused kernel's grid over the capacity against the
    # pages held): fp16 rounding, not a different history
    assert worst < 0.25
    assert ours.get_seq_length() == ref.get_seq_length()
    shapes = {min(-(-n // 256) * 256, prompt + steps + 4) for n in range(prompt + 1, prompt + steps + 1)}
    assert decoder.captures == (1 if kind != "fp16-prealloc" else len(shapes))


def test_graphed_greedy_decoding_gives_the_tokens_of_generate():
    """The loop of the README: prefill, then `first_ids` from its logits and one token per step,
    the same tokens as transformers' greedy `generate` (FP16 baseline, device-driven steps)."""
    model = tiny_model("qwen3")
    ids = torch.randint(3, 256, (3, 20))
    with torch.inference_mode():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              do_sample=False, pad_token_id=0)[:, 20:]
        cache = make_cache("fp16-prealloc", model, 20 + 12)
        logits = model(input_ids=ids, past_key_values=cache).logits
        decoder = GraphedDecoder(model, cache, batch=3, graph=False, first_ids=logits[:, -1:].argmax(-1))
        tokens = [decoder.ids.clone()]
        for _ in range(11):
            decoder.step()
            tokens.append(decoder.ids.clone())
    assert torch.equal(torch.cat(tokens, 1), want)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="tiny shapes for the interpreter")
def test_kitty_steps_of_a_left_padded_batch_match_eager_steps():
    """Prompts of 40 and 33 real tokens: each sequence writes at its own positions, and its pages
    fill at its own steps (the shorter one packs after 3 steps, the longer after 12)."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 256, (2, PROMPT))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    steps = 14
    make = lambda host=False: KittyCache(model, SMALL_KITTY, engine="triton", max_length=PROMPT + steps + 1,  # noqa: E731
                                         device_steps=not host)
    with torch.inference_mode():
        ours, ref = make(), make(host=True)
        model(input_ids=ids, attention_mask=mask, past_key_values=ours)
        model(input_ids=ids, attention_mask=mask, past_key_values=ref)
        decoder = GraphedDecoder(model, ours, 2, graph=False)
        for _ in range(steps):
            tok = decoder.ids.clone()
            got = decoder.step()
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            want = model(input_ids=tok, attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
                         past_key_values=ref).logits[:, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    a, b = ours.layers[0], ref.layers[0]
    assert a.k_pages.table == b.k_pages.table and [len(t) for t in a.k_pages.table] == [3, 2]
    assert (a.k_buffer.lens, a.v_window.lens) == (b.k_buffer.lens, b.v_window.lens)


@pytest.mark.gpu
def test_graph_replays_of_a_left_padded_batch_match_eager_steps_on_the_demo_model():
    from kitty_core import load_model

    lm = load_model("demo", device="cuda", dtype=torch.float16)
    model = lm.model
    enc = lm.tokenizer(["The history of the printing press " * 30, "Tell me about cats, " * 12],
                       return_tensors="pt", padding=True).to("cuda")
    steps = 200
    make = lambda: make_cache("kitty-pro", model, enc.input_ids.shape[1] + steps + 4)  # noqa: E731
    worst, mask = 0.0, enc.attention_mask
    with torch.inference_mode():
        ours, ref = make(), make()
        model(**enc, past_key_values=ours)
        model(**enc, past_key_values=ref)
        decoder = GraphedDecoder(model, ours, 2)
        for _ in range(steps):
            tok = decoder.ids.clone()
            got = decoder.step().float()
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            want = model(input_ids=tok, attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
                         past_key_values=ref).logits[:, -1].float()
            worst = max(worst, float((got - want).abs().max()))
    print(f"left-padded kitty-pro: {steps} steps, {decoder.captures} graph, largest logit difference {worst:.4f}")
    assert worst < 0.25 and decoder.captures == 1


def test_a_thread_that_did_not_import_torch_can_run_compiled_steps():
    """Streamlit runs each script run in a new thread: the compiled forward's CUDA-graph trees must
    find their per-thread state there (torch before 2.13 asserted in `cudagraph_trees.get_obj`)."""
    import threading

    from torch._inductor import cudagraph_trees

    from kitty_core.graphs import cudagraph_trees_for_this_thread

    found = {}

    def worker():
        cudagraph_trees_for_this_thread()
        found["state"] = torch._C._is_key_in_tls("tree_manager_containers")
        found["container"] = cudagraph_trees.get_container(0).device_index
        cudagraph_trees_for_this_thread()  # a second call keeps the thread's trees
        found["same"] = cudagraph_trees.get_container(0) is cudagraph_trees.get_container(0)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert found == {"state": True, "container": 0, "same": True}
