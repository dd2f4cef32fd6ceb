"""The decoding step (hola_titan/kernels/hola/decode.py) against the reference backend, one token at a time.

Rows at different points of their blocks (caches of prompts of different lengths, concatenated), steps across
several block boundaries, score ties, float32 and bfloat16, every eviction mode; and the calls it must not take.
"""

from __future__ import annotations

import pytest
import torch

from hola_titan.kernels.hola import decode
from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.ops import hola_attention

H, D = 2, 16
FIELDS = ("scores", "positions", "k", "v", "buf_scores", "buf_k", "buf_v", "seen")


def _tokens(gen, b, t, dtype, *, tie_scores=False, h=H, d=D):
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    g = -0.5 * torch.rand(b, t, h, generator=gen)
    beta = torch.zeros(b, t, h) if tie_scores else torch.rand(b, t, h, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def _params(gen, evict):
    if evict == "none":
        return [None] * 4
    return [1 + 0.3 * torch.randn(D, generator=gen), 1 + 0.3 * torch.randn(D, generator=gen),
            torch.randn(H, generator=gen), torch.randn(H, generator=gen)]


def _prefill(x, params, prompt_lens, *, kw, want_cache):
    """Each row's prompt alone through the reference (rows then sit at different block offsets)."""
    states, caches = [], []
    for row, length in enumerate(prompt_lens):
        res = hola_attention(*[t[row:row + 1, :length] for t in x], *params, **kw, output_final_state=True,
                             output_final_cache=want_cache, backend="reference")
        states.append(res[1])
        caches.append(res[2] if want_cache else None)
    return torch.cat(states), (HolaCache.cat(caches) if want_cache else None)


def _assert_close(got, want, what, atol):
    assert got.dtype == want.dtype, what
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), f"{what}: different empty entries"
    err = (got[finite].double() - want[finite].double()).abs().max().item() if finite.any() else 0.0
    assert err <= atol, f"{what}: {err:.2e} > {atol}"


# (evict, window, block, ties): ties (every score 0, beta = 0) only matter where scores choose.
CASES = [("score", 4, 8, False), ("score", 16, 4, False), ("score", 0, 4, False), ("score", 4, 8, True),
         ("score", 16, 4, True), ("recency", 4, 8, False), ("recency", 16, 4, False), ("none", 4, 8, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("evict,window,block,ties", CASES)
def test_decoding_steps_equal_the_reference(evict, window, block, ties, dtype):
    gen = torch.Generator().manual_seed(window * 31 + block)
    prompt_lens = [5, block, 2 * block + 3]  # mid-block, at a boundary, past two boundaries
    x = _tokens(gen, 3, max(prompt_lens), dtype, tie_scores=ties)
    params = _params(gen, evict)
    kw = dict(window=window, block=block, evict=evict)
    want_cache = evict != "none"
    state, cache = _prefill(x, params, prompt_lens, kw=kw, want_cache=want_cache)
    ref_state, ref_cache = state, cache
    atol = 1e-6 if dtype == torch.float32 else 2e-2
    for step in range(2 * block + 2):
        y = _tokens(gen, 3, 1, dtype, tie_scores=ties)
        call = dict(kw, output_final_state=True, output_final_cache=want_cache)
        ref = hola_attention(*y, *params, initial_state=ref_state, initial_cache=ref_cache, backend="reference",
                             **call)
        got = hola_attention(*y, *params, initial_state=state, initial_cache=cache, **call)
        _assert_close(got[0], ref[0], f"step {step} o", atol)
        _assert_close(got[1], ref[1], f"step {step} state", 1e-5)
        if want_cache:
            for name in FIELDS:
                a, b = getattr(got[2], name), getattr(ref[2], name)
                if name in ("positions", "seen"):
                    assert torch.equal(a, b), f"step {step} {name}: {a} vs {b}"
                else:
                    _assert_close(a, b, f"step {step} cache.{name}", 1e-6 if "scores" in name else atol)
        # Each side continues from its own result, so differences would accumulate.
        state, cache = got[1], (got[2] if want_cache else None)
        ref_state, ref_cache = ref[1], (ref[2] if want_cache else None)


def test_calls_that_are_not_decoding_steps_take_the_general_paths(monkeypatch):
    """Prefill (T > 1), packed documents, a first token without a state, an explicit reference backend and a
    call that wants gradients never reach the decoding step."""
    def refuse(*args, **kwargs):
        raise AssertionError("decode_step called")

    gen = torch.Generator().manual_seed(0)
    x = _tokens(gen, 1, 6, torch.float32)
    params = _params(gen, "score")
    kw = dict(window=4, block=4, evict="score")
    _, state, cache = hola_attention(*x, *params, **kw, output_final_state=True, output_final_cache=True)
    monkeypatch.setattr(decode, "decode_step", refuse)
    y = _tokens(gen, 1, 1, torch.float32)
    hola_attention(*x, *params, **kw, initial_state=state, initial_cache=cache, output_final_cache=True)
    hola_attention(*y, *params, **kw, cu_seqlens=torch.tensor([0, 1]), initial_state=state, initial_cache=cache,
                   output_final_cache=True)
    hola_attention(*y, *params, **kw)
    hola_attention(*y, *params, **kw, initial_state=state, initial_cache=cache, backend="reference")
    leaf = y[0].clone().requires_grad_()
    o, _ = hola_attention(leaf, *y[1:], *params, **kw, initial_state=state, initial_cache=cache)
    o.sum().backward()
    assert leaf.grad is not None
    with torch.no_grad():
        with pytest.raises(AssertionError, match="decode_step called"):
            hola_attention(*y, *params, **kw, initial_state=state, initial_cache=cache)


@pytest.mark.parametrize("decoding", [False, True])
def test_reference_arithmetic_ignores_an_enclosing_autocast(decoding):
    """A bf16 training or decoding step under autocast with the reference backend (or the decoding step) still
    computes in float32: the same result as outside autocast (autocast used to turn its matmuls to bf16 and a
    mixed-dtype index_put then failed)."""
    gen = torch.Generator().manual_seed(3)
    x = _tokens(gen, 2, 11, torch.float32)
    params = _params(gen, "score")
    kw = dict(window=4, block=4, evict="score", output_final_state=True, output_final_cache=True)
    args = x
    if decoding:
        _, state, cache = hola_attention(*x, *params, **kw)
        args, kw = _tokens(gen, 2, 1, torch.float32), dict(kw, initial_state=state, initial_cache=cache)
    backend = "auto" if decoding else "reference"
    plain = hola_attention(*args, *params, **kw, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = hola_attention(*args, *params, **kw, backend=backend)
    assert torch.equal(plain[0], under[0]) and torch.equal(plain[1], under[1])
    assert torch.equal(plain[2].k, under[2].k) and torch.equal(plain[2].scores, under[2].scores)


def test_decoding_writes_scores_in_the_compute_dtype_like_the_reference():
    """float64 inputs continuing from a cache whose scores are float32 (``HolaCache.empty``'s default): the new
    token's score is kept in float64, as the reference keeps it, so a near-tie is not decided by rounding."""
    gen = torch.Generator().manual_seed(5)
    params = [p.double() for p in _params(gen, "score")]
    kw = dict(window=4, block=4, evict="score", output_final_state=True, output_final_cache=True)
    cache = HolaCache.empty(2, H, D, window=4, block=4, evict="score", dtype=torch.float64, device="cpu")
    state = torch.zeros(2, H, D, D, dtype=torch.float64)
    for _ in range(6):
        y = _tokens(gen, 2, 1, torch.float64)
        ref = hola_attention(*y, *params, **kw, initial_state=state, initial_cache=cache, backend="reference")
        got = hola_attention(*y, *params, **kw, initial_state=state, initial_cache=cache)
        for name in ("scores", "buf_scores"):
            assert getattr(got[2], name).dtype == getattr(ref[2], name).dtype == torch.float64
            assert torch.equal(getattr(got[2], name), getattr(ref[2], name))
        state, cache = ref[1], ref[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("evict", ["score", "recency"])
def test_decoding_on_cuda_continues_a_triton_prefill_like_the_reference(evict):
    """On the GPU: a bf16 prefill through the default (Triton) backend, then decoding steps; each step equals the
    reference's step from the same state and cache (positions exactly; bf16 values to rounding)."""
    gen = torch.Generator().manual_seed(9)
    h, d, window, block = 4, 256, 64, 256
    x = [t.cuda() for t in _tokens(gen, 2, 700, torch.bfloat16, h=h, d=d)]
    params = [p.cuda() for p in (1 + 0.3 * torch.randn(d, generator=gen), 1 + 0.3 * torch.randn(d, generator=gen),
                                 torch.randn(h, generator=gen), torch.randn(h, generator=gen))]
    kw = dict(window=window, block=block, evict=evict, output_final_state=True, output_final_cache=True)
    _, state, cache = hola_attention(*x, *params, **kw)
    for step in range(block + 3):  # across a block boundary: rows sit at offset 700 % 256 = 188
        y = [t.cuda() for t in _tokens(gen, 2, 1, torch.bfloat16, h=h, d=d)]
        ref = hola_attention(*y, *params, **kw, initial_state=state, initial_cache=cache, backend="reference")
        got = hola_attention(*y, *params, **kw, initial_state=state, initial_cache=cache)
        _assert_close(got[0], ref[0], f"step {step} o", 2e-2)
        _assert_close(got[1], ref[1], f"step {step} state", 1e-4)
        assert torch.equal(got[2].positions, ref[2].positions) and torch.equal(got[2].seen, ref[2].seen)
        state, cache = got[1], got[2]

