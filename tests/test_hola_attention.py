"""``hola_attention`` (DESIGN §1, 2, 4) on CPU: the reference backend against the token-by-token
oracle and against independent formulations (fla-core's GDN recurrence, PyTorch SDPA), chunked and packed
layouts, the selection semantics, input validation and NaN isolation.

Tolerances. Every comparison uses the max-abs error divided by the max-abs of the expected tensor
(``assert_close_scaled``). The two sides sum the same products in a different order (chunked WY solve vs.
one token at a time, batched rows vs. one row), so the rounding error scales with the tensor's magnitude,
not with each element: an element-wise relative bound would fail on entries that happen to be near zero,
and a bare absolute bound would be meaningless for gradients whose scale is far from 1. Bounds: 1e-10 in
float64 (unit roundoff 1.1e-16, so this leaves ~6 orders of magnitude for error growth over tens of tokens
and a triangular solve), 1e-5 in float32 (unit roundoff 6e-8: ~100x headroom), 1e-6 for packed vs. separate
in float32 (same kernel, only the batching differs; DESIGN §7).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from hola_titan import HolaCache, hola_attention
from hola_titan.kernels.hola.oracle import naive_hola_attention

INPUTS = ("q", "k", "v", "g", "beta", "gamma_q", "gamma_k", "sink", "gate")
CACHE_PARAMS = ("gamma_q", "gamma_k", "sink", "gate")
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
CACHE_FIELDS = ("scores", "positions", "k", "v", "buf_scores", "buf_k", "buf_v", "seen")
EPS = 1e-6  # DESIGN §2: l2norm and RMSNorm epsilon
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
TOL_PACKED_FP32 = 1e-6


pytestmark = pytest.mark.usefixtures("single_thread")


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------

def make_inputs(batch: int, seq_len: int, heads: int, dim: int, *, dtype=torch.float64, seed: int = 0,
                num_states: int | None = None, requires_grad: bool = False,
                ties: bool = False) -> dict[str, torch.Tensor]:
    """Random inputs of ``hola_attention``; with ``num_states`` also an ``initial_state`` [N, H, D, D].

    ``ties``: beta is exactly 0 on two tokens of every three, so their scores m = beta * ||e|| are all exactly
    0 and selection must break the ties by position.

    Decays are moderate (alpha mostly in 0.5..1) so that the state carries information over many tokens,
    gate and sink are O(1) so that the cache path is a sizeable part of the output, gammas differ from 1 so
    that a missing or misplaced RMSNorm weight shows.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {
        "q": randn(batch, seq_len, heads, dim),
        "k": randn(batch, seq_len, heads, dim),
        "v": randn(batch, seq_len, heads, dim),
        "g": -F.softplus(randn(batch, seq_len, heads)) * 0.5,
        "beta": torch.sigmoid(randn(batch, seq_len, heads)),
        "gamma_q": 1.0 + 0.3 * randn(dim),
        "gamma_k": 1.0 + 0.3 * randn(dim),
        "sink": randn(heads),
        "gate": randn(heads),
    }
    if ties:
        keep = torch.arange(seq_len) % 3 == 0
        x["beta"] = torch.where(keep[None, :, None], x["beta"], 0.0)
    if num_states is not None:
        x["initial_state"] = 0.3 * randn(num_states, heads, dim, dim)
    x = {name: t.to(dtype) for name, t in x.items()}
    if requires_grad:
        x = {name: t.requires_grad_() for name, t in x.items()}
    return x


def call(fn, x: dict, *, evict: str, **kwargs):
    """``fn(q, ..., gate, **kwargs)`` with the cache parameters dropped for ``evict="none"``."""
    args = [None if (evict == "none" and name in CACHE_PARAMS) else x[name] for name in INPUTS]
    kwargs.setdefault("initial_state", x.get("initial_state"))
    out = fn(*args, evict=evict, **kwargs)
    return out if len(out) == 3 else (*out, None)


def run_ref(x, **kwargs):
    return call(hola_attention, x, backend="reference", output_final_state=True, output_final_cache=True, **kwargs)


def run_naive(x, **kwargs):
    return call(naive_hola_attention, x, output_final_state=True, output_final_cache=True, **kwargs)


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """``max|actual - expected| <= tol * max|expected|`` (see the module docstring for why)."""
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} vs {list(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    scale = e.abs().max().item() if e.numel() else 0.0
    err = (a - e).abs().max().item() if e.numel() else 0.0
    assert err <= tol * max(scale, 1e-300), f"{what}: max abs error {err:.3e} > {tol:g} x scale {scale:.3e}"


def assert_scores_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Scores hold -inf in empty slots: those must match exactly, the finite ones within ``tol``."""
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), f"{what}: empty slots differ"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    finite = torch.isfinite(expected)
    assert_close_scaled(actual[finite], expected[finite], tol, what)


def assert_cache_close(actual: HolaCache, expected: HolaCache, tol: float, what: str = "cache") -> None:
    assert actual is not None and expected is not None, f"{what}: missing"
    meta = lambda c: (c.window, c.block, c.evict)  # noqa: E731
    assert meta(actual) == meta(expected), f"{what}: metadata {meta(actual)} vs {meta(expected)}"
    assert torch.equal(actual.seen, expected.seen), f"{what}.seen: {actual.seen} vs {expected.seen}"
    assert torch.equal(actual.positions, expected.positions), (
        f"{what}.positions:\n{actual.positions}\nvs\n{expected.positions}")
    assert_scores_close(actual.scores, expected.scores, tol, f"{what}.scores")
    assert_scores_close(actual.buf_scores, expected.buf_scores, tol, f"{what}.buf_scores")
    for name in ("k", "v", "buf_k", "buf_v"):
        assert_close_scaled(getattr(actual, name), getattr(expected, name), tol, f"{what}.{name}")


def weighted_loss(o: torch.Tensor, state: torch.Tensor | None, seed: int = 123) -> torch.Tensor:
    """A random weighted sum of the output (and final state): gradients differ per element."""
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    if state is not None:
        loss = loss + (state * torch.randn(state.shape, generator=gen, dtype=torch.float64).to(state.dtype)).sum()
    return loss


def grad_names(x: dict, evict: str) -> list[str]:
    return [n for n in x if x[n] is not None and x[n].requires_grad and not (evict == "none" and n in CACHE_PARAMS)]


def grads(loss: torch.Tensor, x: dict, names: list[str], **kwargs) -> dict[str, torch.Tensor]:
    values = torch.autograd.grad(loss, [x[n] for n in names], allow_unused=True, **kwargs)
    return dict(zip(names, values))


def assert_grads_close(actual: dict, expected: dict, tol: float, what: str = "grad") -> None:
    for name in expected:
        assert (actual[name] is None) == (expected[name] is None), f"{what} {name}: reached on only one side"
        if expected[name] is not None:
            assert_close_scaled(actual[name], expected[name], tol, f"{what} {name}")


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def l2norm(x):
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + EPS)


# ----------------------------------------------------------------------------------------------------------------
# Reference == token-by-token oracle: forward, final state, final cache, every gradient
# ----------------------------------------------------------------------------------------------------------------

# (id, batch, seq_len, heads, dim, block, window, cu_seqlens, with initial_state[, tied scores])
ORACLE_CASES = [
    ("T13_not_block_multiple", 2, 13, 3, 16, 4, 3, None, True),
    ("T_lt_block", 2, 5, 3, 16, 8, 3, None, False),
    ("window_gt_prefix", 1, 11, 3, 16, 4, 20, None, False),
    ("window0", 2, 10, 3, 16, 4, 0, None, False),
    ("D48", 1, 9, 3, 48, 4, 2, None, True),
    ("block1", 1, 7, 3, 16, 1, 2, None, False),
    # documents of length 1, exactly one block (4), spanning several blocks
    ("packed_len1_oneblock_multiblock", 1, 23, 3, 16, 4, 3, [0, 1, 5, 6, 15, 23], True),
    ("packed_D48_window_gt_doc", 1, 14, 3, 48, 4, 6, [0, 9, 10, 14], False),
    # longer than the reference's 64-token state chunk, odd lengths
    ("T75_multichunk", 1, 75, 3, 16, 16, 5, None, True),
    ("packed_over_chunk", 1, 100, 3, 16, 8, 4, [0, 1, 70, 72, 100], False),
    ("tied_scores", 2, 19, 3, 16, 4, 5, None, False, True),
    ("packed_tied_scores", 1, 30, 3, 16, 4, 4, [0, 2, 14, 30], True, True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("evict", ["score", "recency", "none"])
@pytest.mark.parametrize("case", ORACLE_CASES, ids=[c[0] for c in ORACLE_CASES])
def test_reference_matches_naive_oracle(case, evict, dtype):
    _, batch, seq_len, heads, dim, block, window, cu, with_state, *ties = case
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    num_seqs = batch if cu is None else len(cu) - 1
    x = make_inputs(batch, seq_len, heads, dim, dtype=dtype, seed=seq_len * 7 + dim,
                    num_states=num_seqs if with_state else None, requires_grad=True, ties=bool(ties))
    kw = dict(evict=evict, window=window, block=block, cu_seqlens=cu_seqlens)
    o_ref, s_ref, c_ref = run_ref(x, **kw)
    o_nv, s_nv, c_nv = run_naive(x, **kw)
    tol = TOL[dtype]

    assert o_ref.dtype == dtype and o_ref.shape == x["q"].shape
    assert s_ref.dtype == dtype and s_ref.shape == (num_seqs, heads, dim, dim)
    assert torch.isfinite(o_ref).all() and torch.isfinite(s_ref).all()
    assert_close_scaled(o_ref, o_nv, tol, "o")
    assert_close_scaled(s_ref, s_nv, tol, "final_state")
    if evict == "none":
        assert c_ref is None and c_nv is None
    else:
        assert_cache_close(c_ref, c_nv, tol)

    names = grad_names(x, evict)
    g_ref = grads(weighted_loss(o_ref, s_ref), x, names)
    g_nv = grads(weighted_loss(o_nv, s_nv), x, names)
    for name in names:
        assert g_ref[name] is not None, f"no gradient reaches {name}"
        assert torch.isfinite(g_ref[name]).all(), f"grad {name} not finite"
    if evict != "none":
        for name in CACHE_PARAMS:
            assert g_ref[name].abs().max() > 0, f"grad {name} is zero: the cache path is not differentiated"
    assert_grads_close(g_ref, g_nv, tol)


@pytest.mark.parametrize("evict", ["score", "recency", "none"])
@pytest.mark.parametrize("case", [ORACLE_CASES[0], ORACLE_CASES[6]], ids=[ORACLE_CASES[0][0], ORACLE_CASES[6][0]])
def test_the_state_read_scale_matches_the_oracle_and_scales_only_the_state(case, evict):
    """``scale`` (the paper's ``q^T S`` is ``scale=1``) against the oracle, forward and every gradient; with the
    cache off the output is the D^-1/2 output times ``scale * D^1/2``, and the state and cache do not change."""
    _, batch, seq_len, heads, dim, block, window, cu, with_state, *_ = case
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    num_seqs = batch if cu is None else len(cu) - 1
    x = make_inputs(batch, seq_len, heads, dim, dtype=torch.float64, seed=5,
                    num_states=num_seqs if with_state else None, requires_grad=True)
    kw = dict(evict=evict, window=window, block=block, cu_seqlens=cu_seqlens)
    tol = TOL[torch.float64]
    o_ref, s_ref, c_ref = run_ref(x, scale=1.0, **kw)
    o_nv, s_nv, c_nv = run_naive(x, scale=1.0, **kw)
    assert_close_scaled(o_ref, o_nv, tol, "o")
    assert_close_scaled(s_ref, s_nv, tol, "final_state")
    names = grad_names(x, evict)
    assert_grads_close(grads(weighted_loss(o_ref, s_ref), x, names), grads(weighted_loss(o_nv, s_nv), x, names), tol)
    o_def, s_def, c_def = run_ref(x, **kw)
    assert_close_scaled(s_ref, s_def, tol, "the state does not depend on the read's scale")
    if evict == "none":
        assert_close_scaled(o_ref, o_def * dim ** 0.5, tol, "o at scale 1")
    else:
        assert_cache_close(c_ref, c_def, tol)
        assert (o_ref - o_def * dim ** 0.5).abs().max() > 1e-6, "the cache read must not be scaled with the state"


@pytest.mark.parametrize("evict", ["score", "recency"])
def test_the_parts_are_the_state_read_and_the_gated_cache_read(evict):
    """``mix="parts"``: ``[..., :D]`` is the state read and ``[..., D:]`` sigmoid(gate) o_cache, whose sum is the
    ``"sum"`` output; forward and every gradient against the oracle in the same mode; GDN refuses it."""
    _, batch, seq_len, heads, dim, block, window, cu, with_state, *_ = ORACLE_CASES[6]
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    x = make_inputs(batch, seq_len, heads, dim, dtype=torch.float64, seed=9, num_states=len(cu) - 1,
                    requires_grad=True)
    kw = dict(evict=evict, window=window, block=block, cu_seqlens=cu_seqlens)
    tol = TOL[torch.float64]
    o_parts, s_parts, c_parts = run_ref(x, mix="parts", **kw)
    o_nv, s_nv, c_nv = run_naive(x, mix="parts", **kw)
    assert o_parts.shape == (*x["q"].shape[:-1], 2 * dim)
    assert_close_scaled(o_parts, o_nv, tol, "parts")
    names = grad_names(x, evict)
    assert_grads_close(grads(weighted_loss(o_parts, s_parts), x, names), grads(weighted_loss(o_nv, s_nv), x, names),
                       tol)
    o_sum, _, _ = run_ref(x, **kw)
    o_state, _, _ = run_ref(x, **{**kw, "evict": "none"})
    assert_close_scaled(o_parts[..., :dim] + o_parts[..., dim:], o_sum, tol, "the parts add up to the sum")
    assert_close_scaled(o_parts[..., :dim], o_state, tol, "the first part is the state read")
    with pytest.raises(ValueError, match="^mix"):
        run_ref(x, mix="parts", **{**kw, "evict": "none"})
    with pytest.raises(ValueError, match="^mix"):
        run_ref(x, mix="product", **kw)


# (id, batch, prefix cu or prefix length, continuation cu or length, block, window)
CONTINUATION_CASES = [
    ("rows_inside_block", 2, 6, 9, 4, 3),
    ("rows_on_block_boundary", 2, 8, 7, 4, 3),
    ("rows_window_gt_prefix", 2, 5, 6, 4, 8),
    ("packed", 1, [0, 5, 7, 16], [0, 3, 9, 10], 4, 3),
    ("packed_len1", 1, [0, 1, 4, 12], [0, 1, 2, 9], 4, 2),
]


@pytest.mark.parametrize("evict", ["score", "recency"])
@pytest.mark.parametrize("case", CONTINUATION_CASES, ids=[c[0] for c in CONTINUATION_CASES])
def test_reference_matches_naive_with_initial_state_and_cache(case, evict):
    """The prefix is run by the reference (so the initial cache is the reference's own); reference and oracle then
    continue from the same state and cache. Gradients are compared for the continuation inputs and, through
    the state and the cached k/v, for the prefix inputs."""
    _, batch, prefix, cont, block, window = case
    dtype, tol = torch.float64, TOL[torch.float64]
    packed = isinstance(prefix, list)
    cu_p = torch.tensor(prefix) if packed else None
    cu_c = torch.tensor(cont) if packed else None
    len_p = prefix[-1] if packed else prefix
    len_c = cont[-1] if packed else cont
    xp = make_inputs(batch, len_p, 3, 16, dtype=dtype, seed=1, requires_grad=True)
    xc = make_inputs(batch, len_c, 3, 16, dtype=dtype, seed=2, requires_grad=True)
    for name in CACHE_PARAMS:  # one set of parameters for the whole sequence
        xc[name] = xp[name]
    kw = dict(evict=evict, window=window, block=block)
    _, state, cache = run_ref(xp, cu_seqlens=cu_p, **kw)
    assert cache.num_seqs == state.shape[0] == (len(prefix) - 1 if packed else batch)
    o_ref, s_ref, c_ref = run_ref(xc, cu_seqlens=cu_c, initial_state=state, initial_cache=cache, **kw)
    o_nv, s_nv, c_nv = run_naive(xc, cu_seqlens=cu_c, initial_state=state, initial_cache=cache, **kw)
    assert_close_scaled(o_ref, o_nv, tol, "o")
    assert_close_scaled(s_ref, s_nv, tol, "final_state")
    assert_cache_close(c_ref, c_nv, tol)

    leaves = {**{f"prefix.{n}": t for n, t in xp.items()}, **{f"cont.{n}": t for n, t in xc.items()
                                                                if n in TOKEN_INPUTS}}
    names = list(leaves)
    g_ref = grads(weighted_loss(o_ref, s_ref), leaves, names, retain_graph=True)
    g_nv = grads(weighted_loss(o_nv, s_nv), leaves, names)
    for name in ("prefix.k", "prefix.v", "prefix.gamma_k"):
        assert g_ref[name] is not None and g_ref[name].abs().max() > 0, f"no gradient reaches {name}"
    assert_grads_close(g_ref, g_nv, tol)


# ----------------------------------------------------------------------------------------------------------------
# evict="none" is Gated DeltaNet: fla-core's recurrent reference on l2-normalised q, k
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_evict_none_matches_fla_naive_recurrent_gdn(layout, with_state):
    try:
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    except Exception as exc:  # fla-core is a declared dependency; skip only if it cannot be imported at all
        pytest.skip(f"fla.ops.gated_delta_rule.naive cannot be imported: {exc!r}")
    dtype, tol = torch.float32, TOL[torch.float32]
    heads, dim = 3, 32
    if layout == "rows":
        batch, seq_len, cu = 2, 75, None
        spans = [(b, 0, seq_len) for b in range(batch)]
    else:
        batch, seq_len, cu = 1, 90, [0, 1, 70, 90]
        spans = [(0, a, b) for a, b in zip(cu, cu[1:])]
    x = make_inputs(batch, seq_len, heads, dim, dtype=dtype, seed=5, num_states=len(spans) if with_state else None)
    o, state, _ = call(hola_attention, x, evict="none", backend="reference", output_final_state=True,
                       cu_seqlens=None if cu is None else torch.tensor(cu))
    for n, (b, start, end) in enumerate(spans):
        part = {name: x[name][b:b + 1, start:end] for name in TOKEN_INPUTS}
        init = x["initial_state"][n:n + 1] if with_state else None
        # fla's signature is (q, k, v, beta, g, ...): beta before g. It neither l2-normalises nor scales by default.
        o_fla, s_fla = naive_recurrent_gated_delta_rule(
            l2norm(part["q"]), l2norm(part["k"]), part["v"], part["beta"], part["g"], scale=dim ** -0.5,
            initial_state=init, output_final_state=True)
        assert_close_scaled(o[b:b + 1, start:end], o_fla, tol, f"o of sequence {n}")
        assert_close_scaled(state[n:n + 1], s_fla, tol, f"final_state of sequence {n}")


# ----------------------------------------------------------------------------------------------------------------
# The cache path alone is causal softmax attention with a zero-valued sink key
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [0, 4], ids=["window0", "window4_empty_prefix"])
@pytest.mark.parametrize("block", [11, 16], ids=["block_eq_T", "block_gt_T"])
@pytest.mark.parametrize("evict", ["score", "recency"])
def test_cache_path_is_sdpa_with_sink(evict, block, window):
    """With one block covering the whole sequence the persistent cache is empty, so every query reads exactly
    [causal tokens | sink]: SDPA over RMSNorm'd q, k plus one zero key/value whose logit is the sink."""
    dtype, tol = torch.float64, TOL[torch.float64]
    batch, seq_len, heads, dim = 2, 11, 3, 16
    x = make_inputs(batch, seq_len, heads, dim, dtype=dtype, seed=11)
    kw = dict(window=window, block=block, backend="reference")
    o, _ = hola_attention(*(x[n] for n in INPUTS), evict=evict, **kw)
    o_none, _ = hola_attention(*(x[n] for n in TOKEN_INPUTS), None, None, None, None, evict="none", **kw)
    o_cache = (o - o_none) / torch.sigmoid(x["gate"])[:, None]

    qc = rms_norm(x["q"], x["gamma_q"]).transpose(1, 2)  # [B, H, T, D]
    kc = rms_norm(x["k"], x["gamma_k"]).transpose(1, 2)
    v = x["v"].transpose(1, 2)
    zero = torch.zeros(batch, heads, 1, dim, dtype=dtype)
    keys, values = torch.cat([zero, kc], dim=2), torch.cat([zero, v], dim=2)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    bias = torch.zeros(heads, seq_len, seq_len + 1, dtype=dtype)
    bias[:, :, 0] = x["sink"][:, None]  # q . 0 = 0, so the bias is the whole logit of the sink
    bias[:, :, 1:] = torch.zeros(seq_len, seq_len, dtype=dtype).masked_fill(~causal, float("-inf"))
    expected = F.scaled_dot_product_attention(qc, keys, values, attn_mask=bias[None]).transpose(1, 2)
    assert_close_scaled(o_cache, expected, tol, "o_cache")


# ----------------------------------------------------------------------------------------------------------------
# Chunked (chained through initial_state / initial_cache) equals one call
# ----------------------------------------------------------------------------------------------------------------

def _run_chained(x, bounds, *, evict, window, block, cu_per_call=None):
    outs, state, cache = [], None, None
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        piece = {n: (x[n][:, a:b] if n in TOKEN_INPUTS else x[n]) for n in INPUTS}
        cu = None if cu_per_call is None else torch.tensor(cu_per_call[i])
        o, state, cache = call(hola_attention, piece, evict=evict, window=window, block=block, cu_seqlens=cu,
                               backend="reference", initial_state=state, output_final_state=True,
                               initial_cache=cache, output_final_cache=True)
        outs.append(o)
    return torch.cat(outs, dim=1), state, cache


@pytest.mark.parametrize("evict", ["score", "recency", "none"])
@pytest.mark.parametrize("splits", [(6,), (8,), (3, 8), (1, 2, 13)],
                         ids=["inside_block", "on_block_boundary", "three_calls", "single_token_calls"])
def test_chunked_calls_equal_one_call(splits, evict):
    dtype, tol = torch.float64, TOL[torch.float64]
    batch, seq_len, block, window = 2, 14, 4, 3
    x = make_inputs(batch, seq_len, 3, 16, dtype=dtype, seed=3, requires_grad=True)
    kw = dict(evict=evict, window=window, block=block)
    o_whole, s_whole, c_whole = run_ref(x, **kw)
    o_chain, s_chain, c_chain = _run_chained(x, [0, *splits, seq_len], **kw)
    assert_close_scaled(o_chain, o_whole, tol, "o")
    assert_close_scaled(s_chain, s_whole, tol, "final_state")
    if evict != "none":
        assert_cache_close(c_chain, c_whole, tol)
    names = grad_names(x, evict)
    assert_grads_close(grads(weighted_loss(o_chain, s_chain), x, names),
                       grads(weighted_loss(o_whole, s_whole), x, names), tol)


@pytest.mark.parametrize("evict", ["score", "recency"])
def test_chunked_packed_calls_equal_one_packed_call(evict):
    """Two packed calls continue two documents (lengths 5 + 6 and 6 + 3) through a cache of 2 sequences."""
    dtype, tol = torch.float64, TOL[torch.float64]
    x1 = make_inputs(1, 11, 3, 16, dtype=dtype, seed=4)
    x2 = make_inputs(1, 9, 3, 16, dtype=dtype, seed=5)
    for name in CACHE_PARAMS:
        x2[name] = x1[name]
    kw = dict(evict=evict, window=3, block=4)
    _, state, cache = run_ref(x1, cu_seqlens=torch.tensor([0, 5, 11]), **kw)
    o2, s2, c2 = run_ref(x2, cu_seqlens=torch.tensor([0, 6, 9]), initial_state=state, initial_cache=cache, **kw)
    # The same two documents in one packed call: doc 0 = x1[0:5] + x2[0:6], doc 1 = x1[5:11] + x2[6:9].
    whole = {n: (torch.cat([x1[n][:, 0:5], x2[n][:, 0:6], x1[n][:, 5:11], x2[n][:, 6:9]], dim=1)
                 if n in TOKEN_INPUTS else x1[n]) for n in INPUTS}
    o_w, s_w, c_w = run_ref(whole, cu_seqlens=torch.tensor([0, 11, 20]), **kw)
    assert_close_scaled(o2, torch.cat([o_w[:, 5:11], o_w[:, 17:20]], dim=1), tol, "o of the second call")
    assert_close_scaled(s2, s_w, tol, "final_state")
    assert_cache_close(c2, c_w, tol)


# ----------------------------------------------------------------------------------------------------------------
# Packed equals separate
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("evict", ["score", "recency", "none"])
def test_packed_equals_documents_run_separately(evict):
    dtype, tol = torch.float32, TOL_PACKED_FP32
    cu = [0, 1, 5, 6, 15, 23, 40, 41]
    x = make_inputs(1, cu[-1], 3, 16, dtype=dtype, seed=6, num_states=len(cu) - 1, requires_grad=True)
    kw = dict(evict=evict, window=3, block=4)
    o_p, s_p, c_p = run_ref(x, cu_seqlens=torch.tensor(cu), **kw)
    names = grad_names(x, evict)
    g_p = grads(weighted_loss(o_p, s_p), x, names)

    o_parts, s_parts = [], []
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        doc = {name: (x[name][:, a:b] if name in TOKEN_INPUTS else x[name]) for name in INPUTS}
        doc["initial_state"] = x["initial_state"][n:n + 1]
        o_d, s_d, c_d = run_ref(doc, **kw)
        assert_close_scaled(o_d, o_p[:, a:b], tol, f"o of document {n}")
        assert_close_scaled(s_d, s_p[n:n + 1], tol, f"final_state of document {n}")
        if evict != "none":
            assert_cache_close(c_d, c_p.select(torch.tensor([n])), tol, f"cache of document {n}")
        o_parts.append(o_d)
        s_parts.append(s_d)
    # The packed loss evaluated on the separate runs' outputs and states gives the same gradients.
    g_s = grads(weighted_loss(torch.cat(o_parts, dim=1), torch.cat(s_parts)), x, names)
    assert_grads_close(g_s, g_p, tol)


@pytest.mark.parametrize("evict", ["score", "recency", "none"])
def test_batch_rows_equal_packed_rows(evict):
    """B rows without cu_seqlens are the same sequences as one packed row with cu_seqlens = [0, T, 2T, ...]."""
    batch, seq_len = 3, 10
    x = make_inputs(batch, seq_len, 3, 16, dtype=torch.float32, seed=7)
    kw = dict(evict=evict, window=3, block=4)
    o_b, s_b, c_b = run_ref(x, **kw)
    packed = {n: (x[n].reshape(1, batch * seq_len, *x[n].shape[2:]) if n in TOKEN_INPUTS else x[n]) for n in INPUTS}
    o_p, s_p, c_p = run_ref(packed, cu_seqlens=torch.arange(0, batch * seq_len + 1, seq_len), **kw)
    assert_close_scaled(o_p.view_as(o_b), o_b, TOL_PACKED_FP32, "o")
    assert_close_scaled(s_p, s_b, TOL_PACKED_FP32, "final_state")
    if evict != "none":
        assert_cache_close(c_p, c_b, TOL_PACKED_FP32)


# ----------------------------------------------------------------------------------------------------------------
# Selection semantics
# ----------------------------------------------------------------------------------------------------------------

def _surprise_sequence(seq_len, heads, dim, far_positions, dtype=torch.float64):
    """Tiny beta and small values everywhere except a few far-back tokens with beta ~ 1 and values of norm ~30."""
    gen = torch.Generator().manual_seed(8)
    x = make_inputs(1, seq_len, heads, dim, dtype=dtype, seed=8)
    x["beta"] = torch.full((1, seq_len, heads), 1e-3, dtype=dtype)
    x["v"] = 0.1 * x["v"]
    x["g"] = torch.full((1, seq_len, heads), math.log(0.9), dtype=dtype)
    for pos in far_positions:
        x["beta"][0, pos] = 0.99
        direction = torch.randn(heads, dim, generator=gen, dtype=torch.float64).to(dtype)
        x["v"][0, pos] = 30.0 * direction / direction.norm(dim=-1, keepdim=True)
    return x


def test_score_eviction_keeps_high_surprise_tokens_and_recency_keeps_the_last_window():
    heads, dim, block, window, seq_len = 2, 16, 8, 3, 37  # 4 full blocks; the current block starts at 32
    far = [2, 9, 17]  # all before the recency window 29..31
    x = _surprise_sequence(seq_len, heads, dim, far)
    for fn in (run_ref, run_naive):
        _, _, cache = fn(x, evict="score", window=window, block=block)
        for h in range(heads):
            assert sorted(cache.positions[0, h].tolist()) == far, (fn.__name__, cache.positions[0, h])
            # selection order: score descending
            scores = cache.scores[0, h]
            assert (scores[:-1] >= scores[1:]).all()
            assert scores.min() > 10 * cache.buf_scores[0, h, :seq_len % block].max()
        _, _, cache = fn(x, evict="recency", window=window, block=block)
        for h in range(heads):
            assert cache.positions[0, h].tolist() == [31, 30, 29], (fn.__name__, cache.positions[0, h])
        assert int(cache.seen[0]) == seq_len


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied_scores"])
@pytest.mark.parametrize("evict", ["score", "recency"])
@pytest.mark.parametrize("cu", [None, [0, 3, 20, 33]], ids=["row", "packed"])
def test_final_cache_is_a_valid_top_window_of_its_own_scores(cu, evict, ties):
    """After every prefix length (row layout; packed: the whole row), the persistent cache holds the top-w of the
    scores of all earlier blocks in selection order (larger score first, then lower position), or the w
    positions just before the current block, latest first.

    Scores come from a run with a window as long as the sequence, whose cache then holds every earlier token
    (the state path, hence every score, does not depend on the window)."""
    seq_len, block, window, heads = 33, 4, 3, 2
    x = make_inputs(1, seq_len, heads, 16, dtype=torch.float32, seed=9, ties=ties)
    cu_t = None if cu is None else torch.tensor(cu)
    docs = [(0, seq_len)] if cu is None else list(zip(cu, cu[1:]))
    _, _, all_cache = run_ref(x, evict="score", window=seq_len, block=block, cu_seqlens=cu_t)
    known = [[{int(p): float(s) for p, s in zip(all_cache.positions[n, h], all_cache.scores[n, h]) if p >= 0}
              for h in range(heads)] for n in range(len(docs))]
    if ties:
        zeros = [sum(s == 0.0 for s in known[n][0].values()) for n in range(len(docs))]
        assert max(zeros) >= 2 * window, f"the tie case has no ties: {zeros}"
    prefixes = range(1, seq_len + 1) if cu is None else [seq_len]
    for prefix in prefixes:
        part = {n: (x[n][:, :prefix] if n in TOKEN_INPUTS else x[n]) for n in INPUTS}
        _, _, cache = run_ref(part, evict=evict, window=window, block=block, cu_seqlens=cu_t)
        for n, (a, b) in enumerate(docs):
            full = (min(b, a + prefix) - a) // block * block  # positions before the current block
            for h in range(heads):
                scores = known[n][h]
                assert set(range(full)) <= set(scores), "the wide-window run must hold every earlier token"
                if evict == "score":
                    expected = sorted(range(full), key=lambda p: (-scores[p], p))[:window]
                else:
                    expected = list(range(full - 1, -1, -1))[:window]
                got = [int(p) for p in cache.positions[n, h] if p >= 0]
                assert got == expected, f"prefix {prefix} sequence {n} head {h}: {got} vs {expected}"
                for p, s in zip(cache.positions[n, h], cache.scores[n, h]):
                    if p >= 0:
                        assert float(s) == pytest.approx(scores[int(p)], rel=1e-6, abs=0)


@pytest.mark.parametrize("evict", ["score", "recency"])
def test_cached_scores_are_detached(evict):
    """DESIGN §1, item 4: m is detached (selection is discrete and parameter-free). The cache's k and v do carry
    gradients (section 2: so that gradients reach gamma_k however the cache was built); its scores must not."""
    x = make_inputs(1, 10, 2, 8, dtype=torch.float32, seed=15, requires_grad=True)
    _, _, cache = run_ref(x, evict=evict, window=2, block=4)
    assert cache.k.requires_grad and cache.v.requires_grad, "cached k/v must stay differentiable"
    for name in ("scores", "buf_scores"):
        tensor = getattr(cache, name)
        assert not tensor.requires_grad and tensor.grad_fn is None, (
            f"final_cache.{name} is attached to the autograd graph (grad_fn={tensor.grad_fn})")


# ----------------------------------------------------------------------------------------------------------------
# Contract: return values, dtypes
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_return_values_and_dtypes(dtype):
    x = make_inputs(2, 6, 2, 8, dtype=dtype, seed=10)
    args = [x[n] for n in INPUTS]
    out = hola_attention(*args, window=2, block=4, backend="reference")
    assert len(out) == 2 and out[1] is None and out[0].dtype == dtype and out[0].shape == x["q"].shape
    o, state, cache = hola_attention(*args, window=2, block=4, backend="reference", output_final_state=True,
                                     output_final_cache=True)
    assert state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert state.shape == (2, 2, 8, 8)
    assert isinstance(cache, HolaCache) and cache.num_seqs == 2 and cache.num_heads == 2 and cache.head_dim == 8
    assert cache.seen.tolist() == [6, 6]
    assert cache.scores.dtype in (torch.float32, torch.float64), "scores in at least fp32"
    # 'auto' is the reference on CPU
    o_auto, _ = hola_attention(*args, window=2, block=4)
    assert torch.equal(o_auto, o)


# ----------------------------------------------------------------------------------------------------------------
# Bad input raises ValueError naming the argument
# ----------------------------------------------------------------------------------------------------------------

B_, T_, H_, D_ = 2, 6, 2, 8


def _valid_call():
    x = make_inputs(B_, T_, H_, D_, dtype=torch.float32, seed=12)
    args = {n: x[n] for n in INPUTS}
    return args, dict(window=2, block=4, evict="score", backend="reference")


def _cache(num_seqs=B_, heads=H_, dim=D_, window=2, block=4, evict="score"):
    return HolaCache.empty(num_seqs, heads, dim, window=window, block=block, evict=evict, dtype=torch.float32,
                           device="cpu")


def _packed(args, kw, cu=(0, 5, 12)):
    for n in TOKEN_INPUTS:
        args[n] = args[n].reshape(1, B_ * T_, *args[n].shape[2:])
    kw["cu_seqlens"] = torch.tensor(cu)


def _set(**changes):
    def mutate(args, kw):
        for name, value in changes.items():
            (args if name in INPUTS else kw)[name] = value(args, kw) if callable(value) else value
    return mutate


BAD_INPUTS = [
    ("q", _set(q=lambda a, k: a["q"][0])),  # 3-D
    ("q", _set(q=lambda a, k: a["q"].to(torch.int64))),
    ("k", _set(k=lambda a, k: a["k"][:, :-1])),
    ("v", _set(v=lambda a, k: a["v"][..., :-1])),
    ("k", _set(k=lambda a, k: a["k"].double())),
    ("v", _set(v=lambda a, k: a["v"].double())),
    ("g", _set(g=lambda a, k: a["g"][..., None])),
    ("g", _set(g=lambda a, k: a["g"][:, :-1])),
    ("beta", _set(beta=lambda a, k: a["beta"][..., :-1])),
    ("g", _set(g=lambda a, k: a["g"].to(torch.int32))),
    ("gamma_q", _set(gamma_q=lambda a, k: a["gamma_q"][:-1])),
    ("gamma_k", _set(gamma_k=lambda a, k: a["gamma_k"][None])),
    ("sink", _set(sink=lambda a, k: torch.zeros(H_ + 1))),
    ("gate", _set(gate=lambda a, k: torch.zeros(1, H_))),
    ("gamma_q", _set(gamma_q=None)),
    ("gamma_k", _set(gamma_k=None)),
    ("sink", _set(sink=None)),
    ("gate", _set(gate=None)),
    ("gate", _set(gate=None, evict="recency")),
    ("sink", _set(sink=None, evict="recency")),
    ("cu_seqlens", _set(cu_seqlens=torch.tensor([0, 3, 6]))),  # B > 1
    ("cu_seqlens", lambda a, k: _packed(a, k, cu=(0, 7, 5, 12))),  # non-monotone
    ("cu_seqlens", lambda a, k: _packed(a, k, cu=(0, 5, 11))),  # does not end at T
    ("cu_seqlens", lambda a, k: _packed(a, k, cu=(1, 5, 12))),  # does not start at 0
    ("cu_seqlens", lambda a, k: (_packed(a, k), k.update(cu_seqlens=k["cu_seqlens"].float()))),
    ("cu_seqlens", lambda a, k: (_packed(a, k), k.update(cu_seqlens=k["cu_seqlens"][None]))),
    ("window", _set(window=-1)),
    ("window", _set(window=2.0)),
    ("block", _set(block=0)),
    ("block", _set(block=-4)),
    ("evict", _set(evict="lru")),
    ("evict", _set(evict="Score")),
    ("backend", _set(backend="cuda")),
    ("initial_state", _set(initial_state=torch.zeros(B_, H_, D_, D_ + 1))),
    ("initial_state", _set(initial_state=torch.zeros(B_ + 1, H_, D_, D_))),
    ("initial_state", lambda a, k: (_packed(a, k), k.update(initial_state=torch.zeros(B_ + 1, H_, D_, D_)))),
    ("initial_cache", _set(initial_cache=lambda a, k: _cache(window=3))),
    ("initial_cache", _set(initial_cache=lambda a, k: _cache(block=8))),
    ("initial_cache", _set(initial_cache=lambda a, k: _cache(evict="recency"))),
    ("initial_cache", _set(initial_cache=lambda a, k: _cache(heads=H_ + 1))),
    ("initial_cache", _set(initial_cache=lambda a, k: _cache(dim=D_ * 2))),
    ("initial_cache", _set(initial_cache=lambda a, k: _cache(num_seqs=B_ + 1))),
    ("initial_cache", lambda a, k: (_packed(a, k, cu=(0, 4, 7, 12)), k.update(initial_cache=_cache(num_seqs=2)))),
    ("initial_cache", _set(initial_cache={"scores": None})),
    ("initial_cache", _set(initial_cache=lambda a, k: _cache(evict="none"), evict="none")),
    ("scale", _set(scale=0.0)),
    ("scale", _set(scale=float("nan"))),
    ("scale", _set(scale=True)),
    ("scale", _set(scale="1")),
]


@pytest.mark.parametrize("name,mutate", BAD_INPUTS, ids=[f"{i:02d}_{n}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_value_error_naming_the_argument(name, mutate):
    args, kw = _valid_call()
    hola_attention(*args.values(), **kw)  # the unmodified call is valid
    mutate(args, kw)
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}\b"):
        hola_attention(*args.values(), **kw)


def test_bare_cu_seqlens_are_checked_on_every_call_so_an_in_place_change_is_caught():
    """A bare tensor is checked per call (nothing about it is remembered between calls), so one changed in place
    after a valid call raises naming cu_seqlens."""
    args, kw = _valid_call()
    _packed(args, kw, cu=(0, 5, 12))
    cu = kw["cu_seqlens"]
    hola_attention(*args.values(), **kw)
    cu[1] = 13  # in place: 0, 13, 12 is not monotone
    with pytest.raises(ValueError, match=r"^cu_seqlens\b"):
        hola_attention(*args.values(), **kw)


def test_documents_are_checked_once_from_their_host_copy_and_never_read_by_a_layer():
    """A batch's Documents (hola_titan.kernels.runtime.documents) check their host copy when made: bad values raise
    naming cu_seqlens; a call given them reads neither their device tensor nor their host copy again; refilling the
    caller's host tensor in place for the next batch does not change them."""
    from hola_titan.kernels.runtime.documents import Documents
    args, kw = _valid_call()
    _packed(args, kw, cu=(0, 5, 12))
    del kw["cu_seqlens"]
    for bad in ([0, 7, 5, 12], [0, 12, 13], [1, 12], [12]):
        with pytest.raises(ValueError, match=r"^cu_seqlens\b"):
            Documents.from_host(torch.tensor(bad), device="cpu", seq_len=12)
    with pytest.raises(ValueError, match=r"^cu_seqlens\b"):
        Documents.from_host(torch.tensor([0.0, 12.0]), device="cpu", seq_len=12)
    loader_host = torch.tensor([0, 5, 12], dtype=torch.int32)
    docs = Documents.from_host(loader_host, device="cpu", seq_len=12)
    assert docs.cu_seqlens.dtype == docs.host.dtype == torch.int64 and docs.num_docs == 2
    assert docs.chunk_indices is None  # only where fla runs the state path (CUDA)
    loader_host[1] = 9  # the loader's buffer, refilled for the next batch
    assert docs.host.tolist() == [0, 5, 12]
    real_tolist = torch.Tensor.tolist

    def spy(self):
        assert self is not docs.cu_seqlens and self is not docs.host, "the batch's boundaries were read again"
        return real_tolist(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "tolist", spy)
        o_docs, _ = hola_attention(*args.values(), documents=docs, **kw)
    o_bare, _ = hola_attention(*args.values(), cu_seqlens=torch.tensor([0, 5, 12]), **kw)
    assert torch.equal(o_docs, o_bare)
    with pytest.raises(ValueError, match=r"^cu_seqlens\b"):
        hola_attention(*args.values(), documents=docs, cu_seqlens=docs.cu_seqlens, **kw)
    with pytest.raises(ValueError, match=r"^documents\b"):
        hola_attention(*args.values(), documents=Documents.from_host(torch.tensor([0, 13]), device="cpu",
                                                                     seq_len=13), **kw)


def test_a_batch_s_block_table_is_made_once_from_its_host_copy():
    """``Documents.block_table`` (the Triton and SDPA backends' block table, made once per batch for all layers)
    equals the table each call used to build on the device, field by field, for awkward layouts; the second
    request returns the same object; another block size is another table."""
    pytest.importorskip("triton")
    from hola_titan.kernels.runtime.documents import Documents, build_block_table
    for cu, block in (([0, 1, 23, 24, 60], 24), ([0, 60], 16), ([0, 16, 32, 33], 16), ([0, 5, 12], 32)):
        docs = Documents.from_host(torch.tensor(cu, dtype=torch.int32), device="cpu", seq_len=cu[-1])
        table = docs.block_table(block)
        expected = build_block_table(1, cu[-1], torch.tensor(cu), block, torch.device("cpu"))
        for name in ("blk_start", "blk_len", "blk_doc_start", "doc_start", "doc_len", "doc_first_blk",
                     "doc_num_blk"):
            got, want = getattr(table, name), getattr(expected, name)
            assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want), (cu, block, name)
            # Every field 16-byte aligned, whatever the block count (Triton specialises pointers on it: a field
            # whose alignment followed the batch made the kernels compile again for some batches).
            assert got.data_ptr() % 16 == 0, (cu, block, name)
        assert docs.block_table(block) is table and docs.block_table(block + 1) is not table


def test_fla_chunk_indices_from_the_host_copy_equal_fla_s_own():
    """The chunk indices a batch's Documents carry on CUDA equal fla's ``prepare_chunk_indices`` (values, dtype,
    shape), made from the host copy without fla: documents of one token, of exact chunk multiples, empty ones, a
    single long one, none, int32 boundaries, and random packings."""
    pytest.importorskip("fla")
    from fla.ops.utils.index import prepare_chunk_indices

    from hola_titan.kernels.runtime.documents import CHUNK, chunk_indices_from_host
    g = torch.Generator().manual_seed(0)
    cases = [[0, 1, 70, 200, 333], [0, 64, 333], [0, 333], [0, 64, 64, 128, 128], [0, 0], [0], [0, 65536]]
    cases += [[0] + sorted(torch.randint(0, 4096, (n,), generator=g).tolist()) + [4096] for n in (1, 7, 60)]
    for cu in cases:
        for dtype in (torch.int64, torch.int32):
            host = torch.tensor(cu, dtype=dtype)
            made = chunk_indices_from_host(host, torch.device("cpu"))
            want = prepare_chunk_indices(host.clone(), CHUNK)
            assert made.dtype == want.dtype and made.shape == want.shape and torch.equal(made, want), (cu, dtype)
            assert host.tolist() == cu


def _dhu_loop(q, k, w, do, dv, g_cum, scale, lens, dht):
    """fla's state-gradient pass, one sequence at a time in float64 (rows ``[T_n, H, D]`` per sequence): the
    per-chunk ``dh`` (the gradient of the state after the chunk), the corrected ``dv`` and the initial state's
    gradient, as ``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64`` computes them."""
    dh, dv2, dh0 = [], [], []
    for n, (qs, ks, ws, dos, dvs, gs) in enumerate(zip(*(x.split(lens) for x in (q, k, w, do, dv, g_cum)))):
        ds = dht[n].clone() if dht is not None else torch.zeros(q.shape[1], q.shape[2], q.shape[2],
                                                                 dtype=torch.float64)
        chunks, dv_n = [], torch.empty_like(dvs)
        for c0 in reversed(range(0, lens[n], 64)):
            sl = slice(c0, min(c0 + 64, lens[n]))
            gl = gs[sl][-1]                                                    # [H]
            chunks.insert(0, ds.clone())
            dvc = torch.einsum("thk,hkv->thv", ks[sl], ds) * torch.exp2(gl[None] - gs[sl])[..., None] + dvs[sl]
            dv_n[sl] = dvc
            ds = (torch.exp2(gl)[:, None, None] * ds
                  + scale * torch.einsum("thk,thv->hkv", qs[sl] * torch.exp2(gs[sl])[..., None], dos[sl])
                  - torch.einsum("thk,thv->hkv", ws[sl], dvc))
        dh += chunks
        dv2.append(dv_n)
        dh0.append(ds)
    d = q.shape[2]
    dh = torch.stack(dh) if dh else torch.zeros(0, q.shape[1], d, d, dtype=torch.float64)
    return dh, torch.cat(dv2), torch.stack(dh0)


@pytest.mark.parametrize("lens", [[300], [70, 0, 1, 64, 130], [40], [0]])
@pytest.mark.parametrize("with_dht", [False, True])
def test_initial_state_gradient_from_the_first_chunk_s_stored_gradient(lens, with_dht):
    """``fla_bridge.initial_state_grad`` (the initial state's gradient, formed outside fla's state-gradient kernel
    from the first chunk's stored ``dh``) equals the pass's own last step: packed documents of every length
    class (shorter than a chunk, one row, a whole chunk, several chunks, none), plain rows, with and without a
    final-state gradient, no rows at all. Checks the first chunk's index, its rows and its last row per sequence:
    weak decays keep the stored ``dh`` term visible after a whole chunk, and small k and w keep the carried
    gradient from growing over the q-do term."""
    pytest.importorskip("fla")
    from hola_titan.kernels.gdn import fla_bridge
    gen = torch.Generator().manual_seed(len(lens) + 7 * with_dht)
    t, h, d = sum(lens), 2, 8

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k, w, do, dv = (randn(t, h, d) for _ in range(5))
    k, w = 0.2 * k, 0.2 * w
    g = -0.02 * torch.rand(t, h, generator=gen, dtype=torch.float64)
    g_cum = torch.cat([torch.cat([x.cumsum(0) for x in gs.split(64)]) for gs in g.split(lens)]) if t else g
    dht = randn(len(lens), h, d, d) if with_dht else None
    dh, dv2, dh0 = _dhu_loop(q, k, w, do, dv, g_cum, 0.3, lens, dht)
    if len(lens) == 1:  # plain rows: [B = 1, T, ...], dh [B, NT, ...]
        got = fla_bridge.initial_state_grad(dh[None], q[None], w[None], do[None], dv2[None], g_cum[None], 0.3,
                                         cu_seqlens=None, dht=dht)
    else:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        got = fla_bridge.initial_state_grad(dh[None], q[None], w[None], do[None], dv2[None], g_cum[None], 0.3,
                                         cu_seqlens=cu, dht=dht)
    assert got.dtype == torch.float32
    assert_close_scaled(got, dh0, 1e-5, "initial state gradient")


# ----------------------------------------------------------------------------------------------------------------
# Finite in, finite out; a NaN in one document stays in that document
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("evict", ["score", "recency", "none"])
def test_extreme_finite_inputs_give_finite_outputs_and_gradients(evict):
    dtype = torch.float32
    cu = [0, 1, 9, 30, 100]  # a 70-token document crosses the 64-token state chunk
    x = make_inputs(1, cu[-1], 2, 16, dtype=dtype, seed=13)
    with torch.no_grad():
        x["q"][0, 10:20] *= 1e4
        x["k"][0, 15:25] *= 1e4
        x["q"][0, 30:40] = 0.0  # zero vectors: l2norm and RMSNorm must not divide by zero
        x["k"][0, 35:45] = 0.0
        x["v"][0, 40:50] = 0.0
        x["g"][0, 50:60] = -40.0  # alpha ~ 4e-18
        x["g"][0, 60:70] = 0.0  # no decay
        x["g"][0, 90:] = -1e4
        x["beta"][0, 1:9] = 1.0 - 1e-7
        x["beta"][0, 70:80] = 0.0
        x["sink"] = torch.tensor([30.0, -30.0])
        x["gate"] = torch.tensor([20.0, -20.0])
        x["gamma_k"] = x["gamma_k"] * 10
    x = {n: t.requires_grad_() for n, t in x.items()}
    o, state, cache = run_ref(x, evict=evict, window=3, block=8, cu_seqlens=torch.tensor(cu))
    assert torch.isfinite(o).all(), "o has NaN/inf for finite inputs"
    assert torch.isfinite(state).all(), "final_state has NaN/inf for finite inputs"
    if evict != "none":
        for name in ("k", "v", "buf_k", "buf_v"):
            assert torch.isfinite(getattr(cache, name)).all(), f"cache.{name} not finite"
        for name in ("scores", "buf_scores"):
            assert not torch.isnan(getattr(cache, name)).any() and not torch.isposinf(getattr(cache, name)).any()
    names = grad_names(x, evict)
    for name, grad in grads(weighted_loss(o, state), x, names).items():
        assert torch.isfinite(grad).all(), f"grad {name} not finite for finite inputs"


@pytest.mark.parametrize("poisoned", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("evict", ["score", "recency", "none"])
def test_nan_in_one_document_does_not_leak_into_others(evict, poisoned):
    cu = [0, 5, 13, 14, 23]
    bad = (5, 13)  # document 1
    x = make_inputs(1, cu[-1], 2, 16, dtype=torch.float32, seed=14, num_states=len(cu) - 1)
    kw = dict(evict=evict, window=3, block=4, cu_seqlens=torch.tensor(cu))
    o_clean, s_clean, c_clean = run_ref(x, **kw)
    x[poisoned] = x[poisoned].clone()
    x[poisoned][0, bad[0]:bad[1]] = float("nan")
    o, state, cache = run_ref(x, **kw)
    assert torch.isnan(o[0, bad[0]:bad[1]]).any(), "the poison did not reach its own document (test is vacuous)"
    keep = torch.ones(cu[-1], dtype=torch.bool)
    keep[bad[0]:bad[1]] = False
    assert torch.isfinite(o[0, keep]).all(), "NaN leaked into another document's outputs"
    assert_close_scaled(o[0, keep], o_clean[0, keep], TOL_PACKED_FP32, "o of clean documents")
    others = torch.tensor([0, 2, 3])
    assert torch.isfinite(state[others]).all(), "NaN leaked into another document's final state"
    assert_close_scaled(state[others], s_clean[others], TOL_PACKED_FP32, "final_state of clean documents")
    if evict != "none":
        assert_cache_close(cache.select(others), c_clean.select(others), TOL_PACKED_FP32, "cache of clean documents")


def test_each_call_s_path_and_its_reason():
    """hola_titan.kernels.dispatch.call_path: the path one hola_attention call takes, and why, for every kind of
    call."""
    from hola_titan.kernels.dispatch import call_path

    q = torch.zeros(1, 4, 2, 16)
    plain = dict(decoding=False, initial_cache=None)
    assert call_path("auto", "reference", q, **plain) == ("reference", "auto: reference on cpu")
    assert call_path("triton", "triton", q, **plain) == ("triton", "as set")
    assert call_path("auto", "reference", q, **(plain | {"decoding": True}))[0] == "decode_step"
    assert call_path("reference", "reference", q, **(plain | {"decoding": True})) == ("reference", "as set")
    path, why = call_path("sdpa", "sdpa", q, **(plain | {"initial_cache": object()}))
    assert path == "reference" and "continuing from a cache" in why
    # What the kernels do not take: auto falls back and says so; an explicit backend is refused, naming q.
    odd = torch.zeros(1, 4, 2, 16, dtype=torch.float64)
    path, why = call_path("auto", "triton", odd, **plain)
    assert path == "reference" and why == "auto: head dim 16 / torch.float64 is not taken by the kernels"
    with pytest.raises(ValueError, match=r"^q: dtype torch.float64 is not supported by backend 'triton'"):
        call_path("triton", "triton", odd, **plain)


def test_a_compiled_region_does_not_recompile_for_another_document_count():
    """A batch's Documents mark the sizes that vary from batch to batch (cu_seqlens, the derived block table) as
    dynamic, so a compiled region traces them as symbols at the first batch: a batch with another number of
    documents reuses the graph. (Unmarked, Dynamo specialised on the first batch's count and compiled a second graph
    at the second: 8 s of the 340M run's start.)"""
    from torch._dynamo.testing import CompileCounter

    from hola_titan.kernels.runtime.documents import Documents

    def per_batch(cu_seqlens, blk_start, blk_len):  # integers only: compiled and eager agree exactly on any CPU
        return cu_seqlens.diff().max() + (blk_start + blk_len).sum()

    counter = CompileCounter()
    compiled = torch.compile(per_batch, backend=counter)
    torch._dynamo.reset()
    for bounds in ([0, 5, 9, 40, 64], [0, 30, 64], [0, 1, 2, 3, 50, 60, 64]):
        docs = Documents.from_host(torch.tensor(bounds), device="cpu", seq_len=64)
        table = docs.block_table(8)
        got = compiled(docs.cu_seqlens, table.blk_start, table.blk_len)
        assert torch.equal(got, per_batch(docs.cu_seqlens, table.blk_start, table.blk_len))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for three document counts"


@pytest.mark.parametrize("evict", ["score", "recency"])
def test_the_sdpa_backend_compiles_without_a_graph_break_of_its_own(evict):
    """``compile.enable`` with ``model.attention_backend sdpa`` compiles each block with ``fullgraph``: the cache
    read must trace as one graph. Its selection (a ``topk`` sized by the longest document) and its scatter back to
    token order once read sizes from the data, which broke the graph (a compiled step on an H100 failed on
    2026-12-07). On a CPU the state path is the fp32 reference, which stays out of compiled code: every break must
    come from it, and the compiled function (AOT autograd, no code generation) equals eager in every gradient."""
    from hola_titan.kernels.hola.sdpa import hola_attention_sdpa

    x = make_inputs(1, 45, 2, 16, dtype=torch.float64, seed=5, requires_grad=True)
    cu = torch.tensor([0, 1, 20, 45])  # a one-token document, a ragged last block, a document of several blocks

    def fn(*args):
        return hola_attention_sdpa(*args, window=4, block=8, evict=evict, cu_seqlens=cu)[0]

    args = [x[name] for name in INPUTS]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    ours = [str(frame) for reason in explained.break_reasons for frame in reason.user_stack
            if any(f"kernels/{name}.py" in str(frame)
                   for name in ("hola/sdpa", "hola/selection", "hola/stages", "runtime/documents"))]
    assert not ours, f"graph breaks in the SDPA cache read: {ours}"
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager")
    w = torch.randn(1, 45, 2, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    o_e, o_c = fn(*args), compiled(*args)
    assert torch.equal(o_c, o_e)
    g_e = torch.autograd.grad((o_e * w).sum(), args)
    g_c = torch.autograd.grad((o_c * w).sum(), args)
    for name, a, e in zip(INPUTS, g_c, g_e):
        assert_close_scaled(a, e, 1e-12, f"d{name}")


def test_tensors_sent_in_one_copy_start_on_16_byte_boundaries():
    """to_device_aligned: every tensor comes back with its values, dtype and shape, each at a 16-byte boundary of
    one buffer whatever the sizes before it (Triton specialises pointers on that alignment)."""
    from hola_titan.kernels.runtime.documents import to_device_aligned

    tensors = [torch.arange(3, dtype=torch.int32), torch.arange(6, dtype=torch.int64).view(2, 3),
               torch.tensor([True, False]), torch.arange(5, dtype=torch.int32) - 7]
    sent = to_device_aligned(tensors, torch.device("cpu"))
    base = sent[0].untyped_storage().data_ptr()
    for t, s in zip(tensors, sent):
        assert s.dtype == t.dtype and s.shape == t.shape and torch.equal(s, t)
        assert s.untyped_storage().data_ptr() == base and s.data_ptr() % 16 == 0


def test_cache_kernels_refuse_a_prefix_in_another_dtype():
    """A continuing call's kernels read a key tile from the tokens or the prefix through one pointer, so both must
    hold the same element type: a mismatch is an error naming both, not a miscompiled read."""
    pytest.importorskip("triton")
    from hola_titan.kernels.hola.triton_kernels import Prefix, _check_prefix
    k = v = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    ok = Prefix(k=torch.zeros(6, 2, 8, dtype=torch.bfloat16), v=torch.zeros(6, 2, 8, dtype=torch.bfloat16),
                start=torch.zeros(1, dtype=torch.int32), length=torch.zeros(1, dtype=torch.int32))
    _check_prefix(ok, k, v)
    with pytest.raises(ValueError, match=r"prefix: k and v in torch.float32 / torch.bfloat16, the tokens' in"):
        _check_prefix(ok._replace(k=ok.k.float()), k, v)


def test_the_kept_output_chooses_its_own_dk_dv_launch():
    """The cache backward takes its dk/dv launch from ``dkdv_kept`` when the forward kept its output: at D 256 the
    atomic dq sums (5 products per pair then; without the kept output their delta pass makes them slower), at the
    other head dims the plain table's launch; the plain table never sums dq atomically at D 256."""
    from hola_titan.kernels.hola import triton_kernels as attn
    cuda = torch.device("cuda")  # _config reads only the device type: no GPU needed
    bf16 = torch.bfloat16
    assert attn._config("dkdv_kept", 256, bf16, cuda).get("DQ_ATOMIC") is True
    assert "DQ_ATOMIC" not in attn._config("dkdv", 256, bf16, cuda)
    for d in (64, 128):
        assert attn._config("dkdv_kept", d, bf16, cuda) == attn._config("dkdv", d, bf16, cuda)
    kept = dict(attn._config("dkdv_kept", 256, bf16, cuda))
    kept.pop("DQ_ATOMIC")
    assert kept == attn._config("dkdv", 256, bf16, cuda)  # the same tiles: only the variant differs
    assert attn.kept_output_sums_dq_atomically(256, bf16, cuda)
    assert not attn.kept_output_sums_dq_atomically(128, bf16, cuda)
    assert all(attn.CONFIGS["dkdv_kept"][d] is not attn.CONFIGS["dkdv"][d] for d in attn.CONFIGS["dkdv"])


def test_float32_launches_take_their_own_tiles_where_listed():
    """float32 inputs (FMA products, no tensor cores) take ``CONFIGS_FLOAT32`` at the head dims it lists, whose tiles
    do not spill, and the bf16 table elsewhere; bf16 inputs never take the float32 table."""
    from hola_titan.kernels.hola import triton_kernels as attn
    cuda = torch.device("cuda")
    for kind in ("fwd", "dq", "dkdv", "dkdv_kept"):
        for d in (64, 128):
            assert attn._config(kind, d, torch.float32, cuda) == attn.CONFIGS_FLOAT32[kind][d]
            assert attn._config(kind, d, torch.bfloat16, cuda) == {
                k: v for k, v in attn.CONFIGS[kind][d].items() if k in ("BM", "BN", "num_warps", "num_stages")}
        assert attn._config(kind, 256, torch.float32, cuda) == attn._config(kind, 256, torch.bfloat16, cuda)
    assert attn.CONFIGS_FLOAT32["dq"][64] != attn.CONFIGS["dq"][64]  # the spilling 64 x 64 tiles are not taken
    assert attn._config("dq", 64, torch.float32, torch.device("cpu")) == attn._INTERPRET_CONFIG
