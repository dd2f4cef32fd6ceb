"""The static decoder (hola_titan/decoding.py) on a CPU: its steps over fixed buffers equal the model's own steps
through the cache object, for every recurrent flavour, left-padded batches, sampling and stop tokens; and the
inputs it must refuse. The CUDA graph and compiled modes are checked on a GPU (tests/test_decoding_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from hola_titan.decoding import StaticDecoder, resolve_mode
from hola_titan.eval.generation import SamplingOptions, generate
from hola_titan.eval.runtime import EvalError
from hola_titan.models.args import model_args
from hola_titan.models.model import ModelCache, build_model

from helpers import flat_cache

pytestmark = pytest.mark.usefixtures("single_thread")
FLAVOURS = ("hola", "hola_recency", "gdn")


def _model(flavour: str, dtype=torch.float32):
    torch.manual_seed(0)
    # Window 4 and block 8: a 30-token decode crosses several blocks and top-W merges.
    return build_model(model_args(flavour, "debug", vocab_size=97, window=4, block=8), device="cpu").to(dtype).eval()



@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buffers_equal_the_cache_object(flavour, dtype):
    model = _model(flavour, dtype)
    prompt = torch.randint(0, 97, (3, 11))
    eager = generate(model, prompt, max_new_tokens=30, decode="eager")
    static = generate(model, prompt, max_new_tokens=30, decode="buffers")
    assert static.tokens == eager.tokens and static.steps == eager.steps == 30
    assert static.decode_path["decode"] == "buffers" and static.decode_path["mixer_step"] == "hola_step"
    assert eager.decode_path == {"decode": "eager"}
    # The whole cache after 29 steps, bit for bit (the same operations on the same values).
    for a, b in zip(flat_cache(eager.cache), flat_cache(static.cache), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert static.cache.nbytes() == eager.cache.nbytes()


def test_teacher_forced_logits_and_the_caller_cache_untouched():
    model = _model("hola")
    tokens = torch.randint(0, 97, (2, 40))
    cache = ModelCache()
    with torch.inference_mode():
        model(tokens[:, :9], cache=cache)
        before = [t.clone() for t in flat_cache(cache)]
        decoder = StaticDecoder(model, cache, mode="buffers")
        # Building it ran a step on copies: the caller's cache and the decoder's buffers are the prefilled cache.
        assert all(torch.equal(a, b) for a, b in zip(before, flat_cache(cache)))
        assert all(torch.equal(a, b) for a, b in zip(before, flat_cache(decoder.cache())))
        decoder.logits.fill_(float("nan"))  # the step must write every logit
        for t in range(9, 40):
            want = model(tokens[:, t:t + 1], cache=cache)[:, -1].float()
            got = decoder.step(tokens[:, t])
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert torch.equal(decoder.greedy_tokens, want.argmax(-1))
    assert decoder.seen == cache.seen == 40 and decoder.steps == 31


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_left_padded_batch_continues_each_prompt(flavour):
    model = _model(flavour)
    lengths = [5, 12, 1]
    prompts = [torch.randint(0, 97, (n,)) for n in lengths]
    slots = max(lengths)
    padded = torch.zeros(len(prompts), slots, dtype=torch.int64)
    for row, p in enumerate(prompts):
        padded[row, slots - len(p):] = p
    cache = ModelCache()
    with torch.inference_mode():
        logits = model.prefill(padded, lengths=lengths, cache=cache)[:, -1].float()
        decoder = StaticDecoder(model, cache, mode="buffers")
        token = logits.argmax(-1)
        batch = [token.tolist()]
        for _ in range(20):
            token = decoder.step(token).argmax(-1)
            batch.append(token.tolist())
    for row, p in enumerate(prompts):
        alone = generate(model, p[None], max_new_tokens=21, decode="eager").tokens[0]
        assert [step[row] for step in batch] == alone


def test_sampling_and_stop_tokens():
    model = _model("hola")
    prompt = torch.randint(0, 97, (3, 7))
    hot = SamplingOptions(temperature=0.8, top_k=20, seed=3)
    assert (generate(model, prompt, max_new_tokens=12, sampling=hot, decode="buffers").tokens
            == generate(model, prompt, max_new_tokens=12, sampling=hot, decode="eager").tokens)
    full = generate(model, prompt, max_new_tokens=25, decode="eager").tokens
    stop = full[1][6]
    for every in (1, 4, 50):  # stops looked for every step, every 4 steps, only at the end
        eager = generate(model, prompt, max_new_tokens=25, decode="eager", stop_ids=(stop,))
        static = generate(model, prompt, max_new_tokens=25, decode="buffers", stop_ids=(stop,),
                          stop_check_every=every)
        assert static.tokens == eager.tokens and static.finished == eager.finished
        assert static.finished[1] and len(static.tokens[1]) == full[1].index(stop)
    # Every row stops at its first token: decoding ends at the next look (step 4), and reports the one step the
    # output needed, as the eager loop does; the cache has run the 3 steps before that look.
    firsts = tuple({row[0] for row in full})
    ended = generate(model, prompt, max_new_tokens=25, decode="buffers", stop_ids=firsts, stop_check_every=4)
    assert ended.tokens == [[], [], []] and all(ended.finished) and ended.steps == 1
    assert generate(model, prompt, max_new_tokens=25, decode="eager", stop_ids=firsts).steps == 1
    assert ended.cache.seen == prompt.shape[1] + 3


def test_refuses_what_it_cannot_serve():
    model = _model("hola")
    transformer = build_model(model_args("transformer", "debug", vocab_size=97), device="cpu").eval()
    assert resolve_mode("auto", model, torch.device("cpu")) == "eager"
    assert resolve_mode("auto", transformer, torch.device("cpu")) == "eager"
    with pytest.raises(ValueError, match="decode: 'graph' captures a CUDA graph"):
        resolve_mode("graph", model, torch.device("cpu"))
    with pytest.raises(ValueError, match="decode: unknown mode 'fast'"):
        resolve_mode("fast", model, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a fixed-size cache"):
        resolve_mode("buffers", transformer, torch.device("cpu"))
    with pytest.raises(EvalError, match="decode: 'compile' captures a CUDA graph"):
        generate(model, torch.zeros(1, 3, dtype=torch.int64), max_new_tokens=2, decode="compile")
    with pytest.raises(ValueError, match="prefill the cache first"):
        StaticDecoder(model, ModelCache(), mode="buffers")
    cache = ModelCache()
    with torch.inference_mode():
        model(torch.zeros(2, 3, dtype=torch.int64), cache=cache)
    decoder = StaticDecoder(model, cache, mode="buffers")
    with pytest.raises(ValueError, match="tokens: the decoder serves 2 rows, got 3"):
        decoder.step(torch.zeros(3, dtype=torch.int64))
    # A prefilled tensor the step would round on the way into its buffer.
    cache.layers["0"].state = cache.layers["0"].state.double()
    with pytest.raises(ValueError, match="layer 0's tensor 3 is torch.float64, the decoding step writes"):
        StaticDecoder(model, cache, mode="buffers")


def test_reference_backend_is_not_captured_and_short_generations_skip_the_decoder():
    torch.manual_seed(0)
    model = build_model(model_args("hola", "debug", vocab_size=97, window=4, block=8), device="cpu",
                        backend="reference").eval()
    # auto never picks a graph for the reference backend (its blocked continuation reads the device back).
    assert resolve_mode("auto", model, torch.device("cpu")) == "eager"
    prompt = torch.randint(0, 97, (2, 6))
    for n in (0, 1):  # nothing to step: the eager loop, whatever the mode
        got = generate(model, prompt, max_new_tokens=n, decode="buffers")
        assert got.decode_path == {"decode": "eager"} and got.steps == n
    # Stop tokens found at the end: steps counts what the output needed, as the eager loop does.
    full = generate(model, prompt, max_new_tokens=12, decode="eager").tokens
    stops = (full[0][1], full[1][2])
    eager = generate(model, prompt, max_new_tokens=12, decode="eager", stop_ids=stops)
    static = generate(model, prompt, max_new_tokens=12, decode="buffers", stop_ids=stops, stop_check_every=8)
    assert all(eager.finished) and static.tokens == eager.tokens and static.steps == eager.steps


def test_load_serves_another_prefilled_cache():
    """A decoder reloaded with another prompt's cache (what hola_titan.hf_model does between generate calls)
    steps exactly as a decoder built on that cache; a cache of another batch size is refused."""
    model = _model("hola_recency")
    first, second = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 13))
    caches = [ModelCache(), ModelCache()]
    with torch.inference_mode():
        for prompt, cache in zip((first, second), caches):
            model(prompt, cache=cache)
        reused = StaticDecoder(model, caches[0], mode="buffers")
        for token in first[:, :5].T:  # advance it, so that the reload must overwrite every buffer
            reused.step(token)
        reused.load(caches[1])
        fresh = StaticDecoder(model, caches[1], mode="buffers")
        assert reused.seen == fresh.seen == 13 and reused.steps == 0
        token = torch.tensor([3, 50])
        for _ in range(12):
            got, want = reused.step(token).clone(), fresh.step(token)
            assert torch.equal(got, want)
            token = want.argmax(-1)
        for a, b in zip(flat_cache(reused.cache()), flat_cache(fresh.cache()), strict=True):
            assert torch.equal(a, b)
        other = ModelCache()
        model(torch.randint(0, 97, (3, 4)), cache=other)
        with pytest.raises(ValueError, match=r"layer 0's tensor 0 has shape \[3, "):
            reused.load(other)
