"""The Triton cache-path kernels on CPU, in Triton's interpreter (``TRITON_INTERPRET=1``), and the dispatch.

fla's chunk kernels do not run in the interpreter, so here the Triton and SDPA backends take the state path and
the scores from the fp32 reference (``state_path``'s CPU branch); what is tested is the selection kernels, the
cache attention forward and backward, the custom-op registrations and the backend dispatch. GPU tests with fla
are in ``test_kernels_triton_gpu.py``.

Bounds (``helpers.assert_fp32_close``): every float32 output and gradient of a kernel is compared with the
reference run in float64 on the same inputs (and the same selection); its error may be at most twice that of the
reference run in float32 (plain PyTorch at the same precision; DESIGN §7) plus 16 float32 roundoff units of the
absolute terms. For the gradients of the per-head and per-channel parameters (gamma_q, gamma_k, sink, gate),
which sum every token's contribution with cancellation, the absolute terms are the sum over tokens of each
token's |contribution| (computed in float64); for the other tensors, the tensor's largest magnitude. A fixed
fraction of the largest value would not do: dsink sums terms up to 100x its size, and its float32 error
moves with the summation order of the CPU's reductions. Forward tensors that the kernels copy or that take
no sum (cache slots, scores) keep 1e-5 of their largest value; two plumbings of the same float32 kernels
must agree bit for bit. Shapes are tiny because the interpreter runs every tile op in NumPy.
Skipped where Triton is not importable; skipped where a GPU is visible and the interpreter was not asked for
(the GPU tests cover the kernels there, compiled).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("this suite runs in Triton's interpreter: tests/test_interpreter.py starts it in a process with "
                       "TRITON_INTERPRET=1 (Triton picks the interpreter when a kernel is defined)")
pytest.importorskip("triton")

from hola_titan import hola_attention  # noqa: E402
from hola_titan.kernels.hola import triton_kernels, selection  # noqa: E402
from hola_titan.kernels.hola.reference import hola_attention_reference  # noqa: E402
from hola_titan.kernels.hola.sdpa import hola_attention_sdpa  # noqa: E402
from hola_titan.kernels.hola.triton_backend import hola_attention_triton  # noqa: E402
from hola_titan.ops import resolve_backend  # noqa: E402
from hola_titan.kernels.runtime.documents import build_block_table  # noqa: E402
from helpers import Launches as _Launches, assert_fp32_close, fresh_leaves, hola_inputs, token_abs_terms  # noqa: E402


NAMES = ("q", "k", "v", "g", "beta", "gamma_q", "gamma_k", "sink", "gate")
# Shared by every token: their gradients are sums over the tokens (bounded by their absolute terms).
SHARED = ("gamma_q", "gamma_k", "sink", "gate")
# Forward values that are copies or a few roundings (cache slots and scores, the outputs in test_dispatch):
# 1e-5 of the largest value (unit roundoff 6e-8).
TOL_FP32 = 1e-5


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_kernels, "POISON_OUTPUTS", True)


make_inputs = hola_inputs
fresh = fresh_leaves


def output_weight(o, seed=7):
    return torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(o.dtype)


def loss_and_grads(o, state, x, seed=7):
    loss = (o * output_weight(o, seed)).sum() + (state.sum() if state is not None else 0)
    return torch.autograd.grad(loss, [x[n] for n in NAMES], allow_unused=True, retain_graph=True)


def shared_abs_terms(o64, x64, w):
    """{name: sum over tokens of |the token's contribution to d name|} for the shared parameters (float64)."""
    return dict(zip(SHARED, token_abs_terms(o64, w, [x64[n] for n in SHARED])))


def assert_close_scaled(actual, expected, tol, what):
    a, e = actual.detach().double(), expected.detach().double()
    assert not torch.isnan(a).any(), f"{what}: NaN (unwritten output?)"
    scale = e.abs().max().item() if e.numel() else 0.0
    err = (a - e).abs().max().item() if e.numel() else 0.0
    assert err <= tol * max(scale, 1e-30), f"{what}: max abs error {err:.3e} > {tol:g} x scale {scale:.3e}"


def reference_given(x, sel, **kw):
    return hola_attention_reference(*[x[n] for n in NAMES], initial_state=None, output_final_state=True,
                                    initial_cache=None, output_final_cache=False, selected=sel, **kw)


# (batch, seq_len, cu_seqlens, heads, dim, block, window, evict): partial blocks, length-1 documents, a window
# larger than one key tile (20 > 16), no window, recency.
CASES = [
    (2, 37, None, 2, 16, 16, 4, "score"),
    (1, 60, [0, 1, 23, 24, 60], 2, 16, 24, 20, "score"),
    (1, 40, [0, 3, 40], 2, 32, 16, 8, "recency"),
    (1, 33, None, 2, 16, 16, 0, "score"),
]


def _case_id(c):
    return f"B{c[0]}-T{c[1]}-{'varlen' if c[2] else 'rows'}-H{c[3]}-D{c[4]}-C{c[5]}-W{c[6]}-{c[7]}"


def check_backend_against_reference_given_its_selection(backend, case, seed):
    """``backend``'s output, final state and every gradient against the reference reading the backend's own
    selection (which must be a valid top-W of the backend's scores); returns the inputs, the keyword arguments
    and the reference's output."""
    b, t, cu, h, d, block, window, evict = case
    x = make_inputs(b, t, h, d, seed=seed)
    kw = dict(window=window, block=block, evict=evict, cu_seqlens=torch.tensor(cu) if cu else None)
    o, state, _, aux = backend(*[x[n] for n in NAMES], output_final_state=True, return_aux=True, **kw)
    if evict == "score" and window:
        selection.check_selection(aux["m"].reshape(b * t, h), aux["sel"], aux["table"], window)
    grads = loss_and_grads(o, state, x)
    xr, x64 = fresh(x), fresh(x, torch.float64)
    o_r, state_r, _ = reference_given(xr, aux["sel"], **kw)
    grads_r = loss_and_grads(o_r, state_r, xr)
    o_64, state_64, _ = reference_given(x64, aux["sel"], **kw)
    grads_64 = loss_and_grads(o_64, state_64, x64)
    terms = shared_abs_terms(o_64, x64, output_weight(o_64))
    assert_fp32_close(o, o_r, o_64, "o")
    assert_fp32_close(state, state_r, state_64, "final_state")
    for name, gr, gr_r, gr_64 in zip(NAMES, grads, grads_r, grads_64):
        assert_fp32_close(gr, gr_r, gr_64, f"d{name}", abs_terms=terms.get(name))
    return x, kw, o_r


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_triton_cache_path_matches_reference_given_its_selection(case):
    x, kw, o_r = check_backend_against_reference_given_its_selection(hola_attention_triton, case, seed=case[1])
    # The reference's own selection is the same one: same scores, same tie order.
    o_own, _, _ = hola_attention_reference(*[x[n] for n in NAMES], initial_state=None, output_final_state=False,
                                           initial_cache=None, output_final_cache=False, **kw)
    assert torch.equal(o_own, o_r)


SELECT_CASES = [(2, 37, None, 8, 4), (1, 61, [0, 1, 20, 21, 61], 8, 5), (1, 50, [0, 50], 16, 8),
                (1, 40, [0, 3, 3, 40], 4, 16), (1, 9, [0, 9], 4, 1)]


@pytest.mark.parametrize("b,t,cu,block,window", SELECT_CASES)
def test_selection_kernel_is_the_top_w_with_the_spec_tie_order(b, t, cu, block, window):
    h = 3
    gen = torch.Generator().manual_seed(t + window)
    m = (torch.rand(b * t, h, generator=gen) * 4).round() / 4  # many exact ties
    m[::7] = 0.0
    table = build_block_table(b, t, torch.tensor(cu) if cu else None, block, m.device)
    sel, final_keys = selection.select_topw(m, table, window)
    selection.check_selection(m, sel, table, window)
    # The torch selection of the SDPA backend is the same, slot for slot (both in selection order).
    assert torch.equal(selection.select_topw_torch(m, table, window), sel)
    # Brute force, in selection order: larger score first, then lower position.
    starts, lens = table.doc_start.tolist(), table.doc_len.tolist()
    row = 0
    for n, (s0, ln) in enumerate(zip(starts, lens)):
        for blk in range(-(-ln // block)):
            for hh in range(h):
                cand = sorted(range(s0, s0 + blk * block), key=lambda j: (-float(m[j, hh]), j))[:window]
                assert sel[row, hh].tolist() == cand + [-1] * (window - len(cand))
            row += 1
        cand = sorted(range(s0, s0 + ln), key=lambda j: (-float(m[j, 0]), j))[:window]  # merged: every block
        assert selection.keys_to_index(final_keys[n, 0]).tolist() == cand + [-1] * (window - len(cand))


@pytest.mark.parametrize("evict", ["score", "recency"])
def test_final_cache_matches_reference(evict):
    b, t, h, d, block, window = 1, 45, 2, 16, 16, 4
    x = make_inputs(b, t, h, d, seed=3)
    cu = torch.tensor([0, 1, 32, 45])
    kw = dict(window=window, block=block, evict=evict, cu_seqlens=cu, initial_state=None, output_final_state=False,
              output_final_cache=True)
    _, _, cache_r = hola_attention_reference(*[x[n] for n in NAMES], initial_cache=None, **kw)
    for fn in (hola_attention_triton, hola_attention_sdpa):
        _, _, cache = fn(*[x[n] for n in NAMES], **kw)
        assert torch.equal(cache.seen, cache_r.seen)
        assert torch.equal(cache.positions, cache_r.positions), fn.__name__
        for name in ("scores", "buf_scores", "k", "v", "buf_k", "buf_v"):
            a, e = getattr(cache, name), getattr(cache_r, name)
            assert torch.equal(torch.isinf(a), torch.isinf(e)), f"{fn.__name__} {name}"
            fin = torch.isfinite(e)
            assert_close_scaled(a[fin], e[fin], TOL_FP32, f"{fn.__name__} cache.{name}")


CACHE_TENSORS = ("k", "v", "buf_k", "buf_v")
# (batch, prefix length or cu_seqlens, rest length or cu_seqlens, block, window, evict): unfinished and complete
# blocks carried over, an empty document, a length-1 document, a window larger than the block, recency.
CONTINUE_CASES = [
    (2, 13, 21, 8, 3, "score"),
    (1, [0, 5, 21, 22], [0, 7, 7, 19], 8, 3, "score"),
    (1, 6, 15, 4, 10, "score"),
    (1, [0, 5, 21, 22], [0, 7, 7, 19], 8, 3, "recency"),
    (1, [0, 9, 12], [0, 1, 30], 4, 6, "recency"),
    (2, 16, 9, 8, 0, "score"),  # no window; every block carried over complete
    (2, 24, 5, 8, 4, "recency"),  # complete blocks, continuation shorter than a block
    (2, 13, 1, 8, 3, "score"),  # one decoding step
    (1, [0, 7, 16], [0, 1, 2], 8, 3, "score"),  # one step of each of two documents, one completing a block
    (2, 13, 21, 8, 5, "recency"),  # rows with an unfinished block, recency
    (3, 10, 7, 4, 6, "recency"),  # rows, window larger than the block
    # Unfinished blocks of more buffered rows than a key tile of the interpreter (16): the prefix spans two tiles.
    (1, 54, 30, 32, 5, "score"),
    (2, 45, 20, 24, 4, "recency"),
    # Unfinished blocks whose new rows reach past the prefix's last key tile: the forward and dq read those tiles
    # as token rows alone (prefix 5, 8 and 16 rows of a 32-row block).
    (1, 37, 30, 32, 5, "score"),
    (2, 40, 20, 32, 4, "recency"),
    (1, 48, 40, 32, 5, "score"),
]


def _continue_case(case, *, seed_of_prefix):
    """A continuation case's second call (tokens, boundaries, sequences, keywords) and the reference's state and
    cache after its first call (2 heads of 16)."""
    b, first, rest, block, window, evict = case
    t1 = first if isinstance(first, int) else first[-1]
    t2 = rest if isinstance(rest, int) else rest[-1]
    cu1 = None if isinstance(first, int) else torch.tensor(first)
    cu2 = None if isinstance(rest, int) else torch.tensor(rest)
    n = b if cu1 is None else len(first) - 1
    kw = dict(window=window, block=block, evict=evict)
    x1 = make_inputs(b, t1, 2, 16, seed=seed_of_prefix(t1))
    _, state, cache = hola_attention_reference(*[x1[name].detach() for name in NAMES], cu_seqlens=cu1,
                                               initial_state=None, output_final_state=True, initial_cache=None,
                                               output_final_cache=True, **kw)
    return t2, cu2, n, kw, state, cache


@pytest.mark.parametrize("case", CONTINUE_CASES, ids=[f"{c[-1]}-C{c[3]}-W{c[4]}-{i}"
                                                       for i, c in enumerate(CONTINUE_CASES)])
def test_triton_continues_from_a_cache_like_the_reference(case):
    """A call that continues from a HolaCache (a context-parallel shard, chunked prefill): output, final state,
    final cache and every gradient, including those of the incoming state and of the cache's k and v."""
    b, _, _, block, window, evict = case
    h, d = 2, 16
    t2, cu2, n, kw, state, cache = _continue_case(case, seed_of_prefix=lambda t1: t1 + window)
    x2 = make_inputs(b, t2, h, d, seed=t2 + 1)
    gen = torch.Generator().manual_seed(3)
    w_o = torch.randn(b, t2, h, d, generator=gen)
    w_k = torch.randn(n, h, window, d, generator=gen)
    w_s = torch.randn(state.shape, generator=gen)

    def run(fn, dtype=torch.float32):
        # float64: the same inputs (the float32 prefix's state and cache), computed in float64.
        x = fresh(x2, dtype)
        s0 = state.to(dtype).clone().requires_grad_()
        c0 = dataclasses.replace(cache, scores=cache.scores.to(dtype), buf_scores=cache.buf_scores.to(dtype),
                                 **{name: getattr(cache, name).to(dtype).clone().requires_grad_()
                                    for name in CACHE_TENSORS})
        o, s1, c1 = fn(*[x[name] for name in NAMES], cu_seqlens=cu2, initial_state=s0, output_final_state=True,
                       initial_cache=c0, output_final_cache=True, **kw)
        w = [t.to(dtype) for t in (w_o, w_s, w_k)]
        loss = (o * w[0]).sum() + (s1 * w[1]).sum() + (c1.k * w[2]).sum() + (c1.v * w[2]).sum()
        leaves = [x[name] for name in NAMES] + [s0] + [getattr(c0, name) for name in CACHE_TENSORS]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=dtype == torch.float64)
        grads = dict(zip([*NAMES, "initial_state", *(f"cache.{n}" for n in CACHE_TENSORS)], grads))
        if dtype == torch.float64:  # the final state and cache do not depend on the shared parameters
            grads["terms"] = shared_abs_terms(o, x, w[0])
        return o, s1, c1, grads

    o, s1, c1, grads = run(hola_attention_triton)
    o_r, s1_r, c1_r, grads_r = run(hola_attention_reference)
    o_64, s1_64, c1_64, grads_64 = run(hola_attention_reference, torch.float64)
    # The float64 run reads the same cache entries (no near-tie of scores flips in float64).
    assert torch.equal(c1_r.positions, c1_64.positions)
    assert_fp32_close(o, o_r, o_64, "o")
    assert_fp32_close(s1, s1_r, s1_64, "final_state")
    assert torch.equal(c1.seen, c1_r.seen)
    assert torch.equal(c1.positions, c1_r.positions)
    for name in ("scores", "buf_scores", "k", "v", "buf_k", "buf_v"):
        a, e = getattr(c1, name), getattr(c1_r, name)
        assert torch.equal(torch.isinf(a), torch.isinf(e)), f"final cache {name}: empty slots differ"
        fin = torch.isfinite(e)
        assert_close_scaled(a[fin], e[fin], TOL_FP32, f"final cache {name}")
    terms = grads_64.pop("terms")
    for name, g_r in grads_r.items():
        g = grads[name]
        if g_r is None:
            assert g is None or not g.any(), f"d{name}: the reference has none"
            continue
        assert g is not None, f"d{name}: missing"
        assert_fp32_close(g, g_r, grads_64[name], f"d{name}", abs_terms=terms.get(name))


@pytest.mark.parametrize("case", CASES[:2], ids=[_case_id(c) for c in CASES[:2]])
def test_sdpa_backend_matches_reference_given_its_selection(case):
    check_backend_against_reference_given_its_selection(hola_attention_sdpa, case, seed=case[1] + 1)


def test_overlapped_layer_op_matches_the_layered_form(monkeypatch):
    """The plumbing of triton_layer (overlap_backward=True: one custom-op pair for the whole layer) in the
    interpreter, with fla's stages replaced by the fp32 reference (forward, and its autograd for the backward):
    output, final state and every gradient equal the layered backend's. Streams are GPU-only (tested there)."""
    from hola_titan.kernels.gdn import fla_bridge
    from hola_titan.kernels.hola import triton_layer

    def fwd(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, scale, output_final_state):
        o, m, final = fla_bridge.reference_gdn_with_scores(q, k, v, g, beta, initial_state=initial_state,
                                                        cu_seqlens=cu_seqlens, output_final_state=True)
        final = final if output_final_state else q.new_empty(0, dtype=torch.float32)
        # Stand-ins for fla's saved tensors, fresh tensors (custom-op outputs may not alias inputs); the layer
        # keeps only g_cum and a of them (it passes the raw q and k to the backward).
        return (o.to(q.dtype), m, final, q.clone(), q.new_empty(0), k.clone(), q.new_empty(0), g.float().clone(),
                q.new_empty(*q.shape[:3], 64))

    def bwd(do, dht, qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, initial_state, cu_seqlens, chunk_indices, scale,
            recompute_norms=False):
        # The layer saves no normalised copies: "qn" and "kn" are the raw q and k, which the stand-in backward
        # recomputes the reference from.
        assert recompute_norms and q_rstd.numel() == 0 and k_rstd.numel() == 0
        # A custom op's body runs below autograd; a fresh thread starts with autograd on (its state is per thread).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(reference_bwd, do, dht, qn, kn, v, g_cum, beta, initial_state, cu_seqlens).result()

    def reference_bwd(do, dht, qn, kn, v, g_cum, beta, initial_state, cu_seqlens):
        with torch.enable_grad():
            leaves = [t.detach().clone().requires_grad_() for t in (qn, kn, v, g_cum, beta)]
            h0 = None if initial_state is None else initial_state.detach().clone().requires_grad_()
            o, _, final = fla_bridge.reference_gdn_with_scores(*leaves, initial_state=h0, cu_seqlens=cu_seqlens,
                                                            output_final_state=True)
            outs, grads_out = [o], [do.to(o.dtype)]
            if dht is not None:
                outs.append(final)
                grads_out.append(dht.to(final.dtype))
            grads = torch.autograd.grad(outs, leaves + ([h0] if h0 is not None else []), grads_out,
                                        allow_unused=True)
        dq, dk, dv, dg, db = (gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads[:5], leaves))
        return dq, dk, dv, dg, db, (grads[5] if h0 is not None else None)

    monkeypatch.setattr(triton_layer, "_gdn_fwd_impl", fwd)
    monkeypatch.setattr(triton_layer, "_gdn_bwd_impl", bwd)
    monkeypatch.setattr(triton_layer, "ensure_backward_checked", lambda *a, **k: None)
    b, t, h, d = 1, 40, 2, 16
    cu = torch.tensor([0, 3, 21, 40])
    x = make_inputs(b, t, h, d, seed=17)
    state = torch.randn(3, h, d, d, generator=torch.Generator().manual_seed(2)) * 0.1
    for evict in ("score", "recency"):
        kw = dict(window=5, block=8, evict=evict, cu_seqlens=cu)
        xa, xb = fresh(x), fresh(x)
        sa, sb = state.clone().requires_grad_(), state.clone().requires_grad_()
        o_a, f_a, _, _ = triton_layer.hola_layer(*[xa[n] for n in NAMES], initial_state=sa,
                                                      output_final_state=True, **kw)
        o_b, f_b, _ = hola_attention_triton(*[xb[n] for n in NAMES], initial_state=sb, output_final_state=True,
                                            state_impl="reference", **kw)
        assert torch.equal(o_a, o_b) and torch.equal(f_a, f_b), f"{evict}: output or final state differs"
        w = torch.randn(o_a.shape, generator=torch.Generator().manual_seed(5))
        w_s = torch.randn(f_a.shape, generator=torch.Generator().manual_seed(6))
        grads_a = torch.autograd.grad((o_a * w).sum() + (f_a * w_s).sum(), [*(xa[n] for n in NAMES), sa])
        grads_b = torch.autograd.grad((o_b * w).sum() + (f_b * w_s).sum(), [*(xb[n] for n in NAMES), sb])
        # The same float32 operations in the same order on both sides (only the custom-op plumbing differs), so
        # bit for bit: a difference is a plumbing error or a reordering of the sums.
        for name, ga, gb in zip([*NAMES, "initial_state"], grads_a, grads_b):
            assert torch.equal(ga, gb), f"{evict} d{name}: max abs difference {(ga - gb).abs().max().item():.3e}"


def test_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "reference"
    assert resolve_backend("reference", cpu) == "reference"
    assert resolve_backend("triton", cpu) == "triton"  # under the interpreter
    assert resolve_backend("sdpa", cpu) == "sdpa"
    from hola_titan.kernels import dispatch
    assert dispatch.interpreting(), "the kernels of this process were defined for the interpreter"
    with monkeypatch.context() as mp:  # a process whose kernels were compiled for a GPU
        mp.setattr(dispatch, "interpreting", lambda: False)
        with pytest.raises(ValueError, match=r"^backend\b"):
            resolve_backend("triton", cpu)
    x = make_inputs(1, 20, 2, 16, seed=5)
    args = [x[n] for n in NAMES]
    kw = dict(window=3, block=8, output_final_state=True)
    o_t, s_t = hola_attention(*args, backend="triton", **kw)
    o_r, s_r = hola_attention(*args, backend="reference", **kw)
    o_a, _ = hola_attention(*args, **kw)  # auto: the reference on CPU
    assert torch.equal(o_a, o_r)
    assert_close_scaled(o_t, o_r, TOL_FP32, "o")
    assert_close_scaled(s_t, s_r, TOL_FP32, "final_state")
    # Calls that continue from a cache object: Triton runs them itself, SDPA hands them to the reference.
    _, _, cache = hola_attention(*[a[:, :12] if a.dim() > 1 else a for a in args], window=3, block=8,
                                 output_final_cache=True, backend="reference")
    rest = [a[:, 12:] if a.dim() > 1 else a for a in args]
    o_c, _ = hola_attention(*rest, window=3, block=8, initial_cache=cache, backend="triton")
    o_c_r, _ = hola_attention(*rest, window=3, block=8, initial_cache=cache, backend="reference")
    o_c_s, _ = hola_attention(*rest, window=3, block=8, initial_cache=cache, backend="sdpa")
    assert_close_scaled(o_c, o_c_r, TOL_FP32, "o continued (triton)")
    assert torch.equal(o_c_s, o_c_r)
    # Head dims the kernels do not take raise a ValueError naming q.
    y = make_inputs(1, 8, 2, 24, seed=6)
    with pytest.raises(ValueError, match=r"^q\b"):
        hola_attention(*[y[n] for n in NAMES], window=2, block=4, backend="triton")
    with pytest.raises(ValueError, match=r"^q\b"):
        hola_attention(*[x[n].double() for n in NAMES], window=2, block=4, backend="triton")


def test_custom_ops_trace_without_graph_breaks():
    """The whole backend compiles as one graph: selection and cache attention are opaque custom ops, with and
    without the cache read's output kept for the backward (both calls in one traced function: one compilation)."""
    x = make_inputs(2, 24, 2, 16, seed=9)

    def fn(*args):
        o, state = hola_attention(*args, window=4, block=8, backend="triton", output_final_state=True)
        o_kept, _ = hola_attention(*args, window=4, block=8, backend="triton", save_cache_output=True)
        return o.square().sum() + state.sum() + (o_kept * o_kept.flip(1)).sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = [x[n] for n in NAMES]
    loss = compiled(*args)
    grads = torch.autograd.grad(loss, args)
    xr = fresh(x)
    args_r = [xr[n] for n in NAMES]
    loss_r = fn(*args_r)
    grads_r = torch.autograd.grad(loss_r, args_r)
    # aot_eager runs the same float32 operations (the custom ops and the aten ops between them) in the same order
    # as eager: bit for bit.
    assert torch.equal(loss, loss_r)
    for name, a, e in zip(NAMES, grads, grads_r):
        assert torch.equal(a, e), f"d{name}: max abs difference {(a - e).abs().max().item():.3e}"


def test_cache_attn_op_registrations():
    """torch.library.opcheck: schema, fake tensor and autograd registrations of the cache-attention op."""
    from hola_titan.kernels.hola.triton_ops import cache_attn_op
    b, t, h, d, block, window = 1, 20, 2, 16, 8, 3
    x = make_inputs(b, t, h, d, seed=11)
    table = build_block_table(b, t, None, block, torch.device("cpu"))
    m = torch.rand(b * t, h, generator=torch.Generator().manual_seed(1))
    sel, _ = selection.select_topw(m, table, window)
    o_state = torch.randn(b, t, h, d, requires_grad=True)
    args = (x["q"], x["k"], x["v"], o_state, x["gamma_q"], x["gamma_k"], x["sink"], x["gate"], sel, table.blk_start,
            table.blk_len, block, window)
    for keep in (False, True):  # without and with the cache read's output kept for the backward
        torch.library.opcheck(cache_attn_op, (*args, keep), test_utils=("test_schema", "test_autograd_registration",
                                                                        "test_faketensor"))


def test_fresh_kernels_read_every_negative_slot_as_empty():
    """Without a prefix, a selection entry below -1 is an empty slot like -1 (it names a prefix row only in the
    continuing kernels): output and every gradient equal, bit for bit."""
    from hola_titan.kernels.hola.triton_ops import cache_attn_op
    b, t, h, d, block, window = 1, 20, 2, 16, 8, 3
    table = build_block_table(b, t, None, block, torch.device("cpu"))
    m = torch.rand(b * t, h, generator=torch.Generator().manual_seed(3))
    sel, _ = selection.select_topw(m, table, window)
    assert (sel == -1).any()
    results = []
    for empty in (-1, -2):
        x = make_inputs(b, t, h, d, seed=13)
        o_state = torch.randn(b, t, h, d, generator=torch.Generator().manual_seed(4), requires_grad=True)
        given = torch.where(sel == -1, torch.full_like(sel, empty), sel)
        o = cache_attn_op(x["q"], x["k"], x["v"], o_state, x["gamma_q"], x["gamma_k"], x["sink"], x["gate"], given,
                          table.blk_start, table.blk_len, block, window)[0]
        leaves = [x["q"], x["k"], x["v"], o_state, x["gamma_q"], x["gamma_k"], x["sink"], x["gate"]]
        results.append((o, torch.autograd.grad((o * output_weight(o)).sum(), leaves)))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, e) for a, e in zip(results[0][1], results[1][1]))


def test_cache_attn_pre_op_registrations():
    """The same for the op that also reads prefix rows (a call continuing from a cache): a first block of 3 prefix
    rows and 5 tokens, cache slots naming token rows, prefix rows (``-2 - a``) and nothing (``-1``)."""
    from hola_titan.kernels.hola.triton_ops import cache_attn_pre_op
    b, t, h, d, block, window = 1, 20, 2, 16, 8, 3
    x = make_inputs(b, t, h, d, seed=12)
    gen = torch.Generator().manual_seed(2)
    pre_k, pre_v = (torch.randn(6, h, d, generator=gen).requires_grad_() for _ in range(2))
    i32 = dict(dtype=torch.int32)
    blk_start, blk_len = torch.tensor([0, 5, 13], **i32), torch.tensor([5, 8, 7], **i32)
    pre_start, pre_len = torch.tensor([3, 0, 0], **i32), torch.tensor([3, 0, 0], **i32)
    sel = torch.tensor([[-2, -3, -1], [-4, 2, -1], [7, -5, 10]], **i32)[:, None, :].expand(3, h, 3).contiguous()
    o_state = torch.randn(b, t, h, d, requires_grad=True)
    args = (x["q"], x["k"], x["v"], o_state, x["gamma_q"], x["gamma_k"], x["sink"], x["gate"], sel, blk_start,
            blk_len, pre_k, pre_v, pre_start, pre_len, block, window)
    torch.library.opcheck(cache_attn_pre_op, args, test_utils=("test_schema", "test_autograd_registration",
                                                              "test_faketensor"))


@pytest.mark.parametrize("evict", ["score", "recency"])
def test_layers_sharing_a_batch_s_block_table_equal_calls_that_build_their_own(evict):
    """Two layer calls given one Documents (its block table, and the recency selection derived from it, made by
    the first call and shared by the second) equal calls given bare cu_seqlens (each building its own), output and
    every gradient bit for bit."""
    from hola_titan.kernels.runtime.documents import Documents
    cu = [0, 1, 23, 24, 60]
    docs = Documents.from_host(torch.tensor(cu), device="cpu", seq_len=cu[-1])
    kw = dict(window=20, block=24, evict=evict, backend="triton")
    for seed in (0, 1):  # the second call finds the table (and its recency selection) made
        x = make_inputs(1, cu[-1], 2, 16, seed=seed)
        o, _ = hola_attention(*[x[n] for n in NAMES], documents=docs, **kw)
        grads = loss_and_grads(o, None, x)
        xb = fresh(x)
        o_b, _ = hola_attention(*[xb[n] for n in NAMES], cu_seqlens=torch.tensor(cu), **kw)
        grads_b = loss_and_grads(o_b, None, xb)
        assert torch.equal(o, o_b), f"seed {seed}: o"
        for name, gr, gr_b in zip(NAMES, grads, grads_b):
            assert torch.equal(gr, gr_b), f"seed {seed}: d{name}"
    if evict == "recency":  # the selection was derived once, from the shared table
        assert ("recency", 2, 20) in docs.block_table(24).derived


def test_continuing_call_copies_no_token_sized_tensor():
    """A call that continues from a cache reads the new tokens where they are: outside the cache-attention op, no
    operation of its forward makes a tensor as large as q (the extended row layout made four: q, k, v and the state
    output laid out again, and sliced the output back)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    b, t1, t2, h, d, block, window = 2, 13, 40, 2, 16, 8, 3
    kw = dict(window=window, block=block, evict="score", cu_seqlens=None)
    x1 = make_inputs(b, t1, h, d, seed=5)
    _, state, cache = hola_attention_reference(*[x1[n].detach() for n in NAMES], initial_state=None,
                                               output_final_state=True, initial_cache=None, output_final_cache=True,
                                               **kw)
    x2 = make_inputs(b, t2, h, d, seed=6)
    token_sized = b * t2 * h * d

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.large = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor)}
            for o in (out if isinstance(out, (tuple, list)) else [out]):
                # New memory only: a view of an input is no copy.
                if (isinstance(o, torch.Tensor) and o.numel() >= token_sized
                        and o.untyped_storage().data_ptr() not in inputs):
                    self.large.append(str(func))
            return out

    from hola_titan.kernels.hola.continuation import continue_from_cache
    from hola_titan.kernels.hola.stages import state_path
    q, k, v, g, beta, gamma_q, gamma_k, sink, gate = (x2[n] for n in NAMES)
    o_state, m, _ = state_path(q, k, v, g, beta, initial_state=state, cu_seqlens=None, output_final_state=False)
    with Sizes() as mode:
        continue_from_cache(q, k, v, o_state, m, gamma_q, gamma_k, sink, gate, None, cache, window=window,
                            block=block, evict="score", output_final_cache=True)
    attn = [f for f in mode.large if "cache_attn" in f]
    assert attn, "the cache-attention op did not run"
    assert not [f for f in mode.large if f not in attn], mode.large


@pytest.mark.parametrize("case", CASES[:2] + CASES[3:], ids=[_case_id(c) for c in CASES[:2] + CASES[3:]])
def test_kernel_variants_match_reference_given_their_selection(case, monkeypatch):
    """The launch candidates that the GPU sweep times: the forward with its output columns split over two programs,
    the two-pass dq and dk/dv summed by separate programs compute the same read, output and every gradient."""
    monkeypatch.setattr(triton_kernels, "_INTERPRET_CONFIG",
                        dict(triton_kernels._INTERPRET_CONFIG, SPLIT=2, TWO_PASS=True, SEPARATE=True))
    check_backend_against_reference_given_its_selection(hola_attention_triton, case, seed=case[1] + 3)


# The selection is given, so the eviction mode does not matter to the backward: the recency case is left out.
DQ_ATOMIC_CASES = [CASES[0], CASES[1], CASES[3]]


@pytest.mark.parametrize("case", DQ_ATOMIC_CASES, ids=[_case_id(c) for c in DQ_ATOMIC_CASES])
def test_dq_summed_by_the_dkdv_programs_matches_reference_given_its_selection(case, monkeypatch):
    """The DQ_ATOMIC launch candidate (dq added into float32 rows by the dk/dv programs, after a pass that forms
    only delta, then a per-row epilogue): output and every gradient, and its kernel did run."""
    monkeypatch.setattr(triton_kernels, "_INTERPRET_CONFIG", dict(triton_kernels._INTERPRET_CONFIG, DQ_ATOMIC=True))
    launches = _Launches(triton_kernels._cache_bwd_dkdv_dq_kernel)
    monkeypatch.setattr(triton_kernels, "_cache_bwd_dkdv_dq_kernel", launches)
    check_backend_against_reference_given_its_selection(hola_attention_triton, case, seed=case[1] + 5)
    assert launches.count == 1


def test_dq_atomic_is_not_used_under_deterministic_algorithms(monkeypatch):
    """Atomic adds sum dq in no fixed order, so a run that asks torch for deterministic algorithms gets the dq
    programs instead, with the same results; and the two launch choices that exclude each other are refused."""
    monkeypatch.setattr(triton_kernels, "_INTERPRET_CONFIG", dict(triton_kernels._INTERPRET_CONFIG, DQ_ATOMIC=True))
    launches = _Launches(triton_kernels._cache_bwd_dkdv_dq_kernel)
    monkeypatch.setattr(triton_kernels, "_cache_bwd_dkdv_dq_kernel", launches)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        check_backend_against_reference_given_its_selection(hola_attention_triton, CASES[0], seed=7)
    finally:
        torch.use_deterministic_algorithms(was)
    assert launches.count == 0
    monkeypatch.setattr(triton_kernels, "_INTERPRET_CONFIG",
                        dict(triton_kernels._INTERPRET_CONFIG, DQ_ATOMIC=True, SEPARATE=True))
    with pytest.raises(ValueError, match="SEPARATE and DQ_ATOMIC"):
        check_backend_against_reference_given_its_selection(hola_attention_triton, CASES[0], seed=7)


KEPT_OUTPUT_CASES = [(CASES[1], False), (CASES[3], False), (CASES[0], True), (CASES[1], True)]


@pytest.mark.parametrize("case,dq_atomic", KEPT_OUTPUT_CASES,
                         ids=[_case_id(c) + ("-DQ_ATOMIC" if a else "") for c, a in KEPT_OUTPUT_CASES])
def test_kept_cache_output_matches_reference_given_its_selection(case, dq_atomic, monkeypatch):
    """``save_cache_output``: the forward also writes the cache read's output and the backward forms delta from
    it (dq in one pass with delta known; with DQ_ATOMIC, no pass at all before the dk/dv programs, and then the
    forward's output columns split over two programs, each storing its half): output and every gradient against
    the reference, and the kernels that keep and read it did run; the backward took its dk/dv launch from the kept
    output's own table."""
    import functools
    if dq_atomic:
        monkeypatch.setattr(triton_kernels, "_INTERPRET_CONFIG",
                            dict(triton_kernels._INTERPRET_CONFIG, DQ_ATOMIC=True, SPLIT=2))
    kinds = []
    config = triton_kernels._config
    monkeypatch.setattr(triton_kernels, "_config", lambda kind, d, dtype, device: kinds.append((kind, dtype)) or
                        config(kind, d, dtype, device))
    keep = _Launches(triton_kernels._cache_fwd_oc_kernel)
    read = _Launches(triton_kernels._cache_bwd_dq_oc_kernel)
    monkeypatch.setattr(triton_kernels, "_cache_fwd_oc_kernel", keep)
    monkeypatch.setattr(triton_kernels, "_cache_bwd_dq_oc_kernel", read)
    backend = functools.partial(hola_attention_triton, save_cache_output=True)
    check_backend_against_reference_given_its_selection(backend, case, seed=case[1] + 7)
    assert (keep.count, read.count) == (1, 1)
    launched = {kind for kind, _ in kinds}
    assert "dkdv_kept" in launched and "dkdv" not in launched, kinds
    assert {dtype for _, dtype in kinds} == {torch.float32}, kinds  # each launch asks for its inputs' dtype


def test_kept_cache_output_is_refused_where_it_cannot_apply():
    """Paths that cannot keep the output refuse the setting instead of ignoring it."""
    x = make_inputs(1, 20, 2, 16, seed=3)
    args = [x[n] for n in NAMES]
    with pytest.raises(ValueError, match="save_cache_output: only the Triton backend"):
        hola_attention(*args, window=4, block=8, backend="reference", save_cache_output=True)
    with pytest.raises(ValueError, match="save_cache_output: not available with overlap_backward"):
        hola_attention_triton(*args, window=4, block=8, evict="score", overlap_backward=True,
                              save_cache_output=True)
    from hola_titan.ops import HolaSettings
    with pytest.raises(ValueError, match="overlap_backward"):
        HolaSettings(window=4, block=8, evict="score", overlap_backward=True, save_cache_output=True)
    with pytest.raises(ValueError, match="evict 'none'"):
        HolaSettings(window=0, block=8, evict="none", save_cache_output=True)


@pytest.mark.parametrize("form", ["plain", "dq_atomic", "kept_cache_output"])
def test_nan_in_one_document_stays_in_it(form, monkeypatch):
    """NaN in one packed document's q, k and v reaches none of the other documents' outputs or gradients of q, k,
    v: not through a tile of rows that straddles a document boundary, in which masked rows must be read as zeros
    (or not read), never as zero-weighted values (0 x NaN). The documents sit so that the blocks before and after
    the poisoned one are shorter than a tile. Also with dq summed by the dk/dv programs and with the cache read's
    output kept (delta from it)."""
    if form == "dq_atomic":
        monkeypatch.setattr(triton_kernels, "_INTERPRET_CONFIG",
                            dict(triton_kernels._INTERPRET_CONFIG, DQ_ATOMIC=True))
    cu = [0, 1, 23, 24, 60]
    bad = slice(1, 23)
    x = make_inputs(1, cu[-1], 2, 16, seed=21)
    with torch.no_grad():
        for name in ("q", "k", "v"):
            x[name][0, bad] = float("nan")
    o, _, _ = hola_attention_triton(*[x[n] for n in NAMES], window=20, block=24, evict="score",
                                    cu_seqlens=torch.tensor(cu), state_impl="reference",
                                    save_cache_output=form == "kept_cache_output")
    keep = torch.ones(cu[-1], dtype=torch.bool)
    keep[bad] = False
    assert torch.isnan(o[0, bad]).any(), "the poison did not reach its own document (test is vacuous)"
    assert torch.isfinite(o[0, keep]).all(), "NaN leaked into another document's outputs"
    grads = torch.autograd.grad((o[0, keep] * output_weight(o[0, keep])).sum(), [x[n] for n in ("q", "k", "v")])
    for name, grad in zip(("q", "k", "v"), grads):
        assert torch.isfinite(grad[0, keep]).all(), f"NaN leaked into another document's d{name}"


@pytest.mark.parametrize("case", [CONTINUE_CASES[0], CONTINUE_CASES[1], CONTINUE_CASES[3]],
                         ids=["rows-score", "packed-score", "packed-recency"])
def test_a_batch_s_continuation_layout_gives_the_call_s_own_results(case):
    """A ContinuationLayout made once on the host (what a context-parallel batch hands every layer) gives what the
    call computes when it makes its own on the device: output, final cache and gradients, bit for bit; a layout for
    other shapes is refused."""
    from hola_titan.kernels.hola.continuation import ContinuationLayout, continue_from_cache
    from hola_titan.kernels.hola.stages import state_path
    b, _, _, block, window, evict = case
    h, d = 2, 16
    t2, cu2, _, kw, state, cache = _continue_case(case, seed_of_prefix=lambda t1: 4)
    layout = ContinuationLayout.from_host(cache.seen.tolist(), None if cu2 is None else cu2.tolist(), batch=b,
                                          seq_len=t2, window=window, block=block, device="cpu")
    results = []
    for given in (None, layout):
        x = make_inputs(b, t2, h, d, seed=8)
        ck, cv = cache.k.clone().requires_grad_(), cache.v.clone().requires_grad_()
        c0 = dataclasses.replace(cache, k=ck, v=cv)
        q, k, v, g, beta, gamma_q, gamma_k, sink, gate = (x[n] for n in NAMES)
        o_state, m, _ = state_path(q, k, v, g, beta, initial_state=state, cu_seqlens=cu2, output_final_state=False)
        o, c1, _, _ = continue_from_cache(q, k, v, o_state, m, gamma_q, gamma_k, sink, gate, cu2, c0,
                                          output_final_cache=True, layout=given, **kw)
        loss = (o * output_weight(o)).sum() + c1.k.sum() + (c1.v * 2).sum()
        grads = torch.autograd.grad(loss, [x[n] for n in NAMES] + [ck, cv], allow_unused=True)
        results.append((o, c1, grads))
    (o_a, c_a, g_a), (o_b, c_b, g_b) = results
    assert torch.equal(o_a, o_b)
    for name in ("scores", "positions", "k", "v", "buf_scores", "buf_k", "buf_v", "seen"):
        assert torch.equal(getattr(c_a, name), getattr(c_b, name)), name
    for ga, gb in zip(g_a, g_b):
        assert (ga is None and gb is None) or torch.equal(ga, gb)
    other = ContinuationLayout.from_host(cache.seen.tolist(), None if cu2 is None else cu2.tolist(), batch=b,
                                         seq_len=t2, window=window, block=2 * block, device="cpu")
    with pytest.raises(ValueError, match="continuation: a layout for"):
        continue_from_cache(q, k, v, o_state, m, gamma_q, gamma_k, sink, gate, cu2, cache, output_final_cache=False,
                            layout=other, **kw)


def test_the_model_setting_reaches_the_cache_op(monkeypatch):
    """``HolaTitanLM(..., save_cache_output=True)`` on the Triton backend: the layer's call keeps its output (the
    kernels that write and read it run once each) and the model's logits and gradients equal the model's without
    it; a forward without gradients keeps nothing."""
    from hola_titan.models.args import model_args
    from hola_titan.models.model import HolaTitanLM
    keep = _Launches(triton_kernels._cache_fwd_oc_kernel)
    read = _Launches(triton_kernels._cache_bwd_dq_oc_kernel)
    monkeypatch.setattr(triton_kernels, "_cache_fwd_oc_kernel", keep)
    monkeypatch.setattr(triton_kernels, "_cache_bwd_dq_oc_kernel", read)
    args = dataclasses.replace(model_args("hola", "debug", vocab_size=61), n_layers=1, dim=32, head_dim=16,
                               mlp_hidden=32, block=8, window=4)
    tokens = torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 9, 10, 24])
    results = []
    for save in (False, True):
        torch.manual_seed(0)
        model = HolaTitanLM(args, backend="triton", save_cache_output=save)
        model.init_weights()
        logits = model(tokens, cu_seqlens=cu)
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert (keep.count, read.count) == (1, 1)
    with torch.no_grad():
        model(tokens, cu_seqlens=cu)
    assert keep.count == 1
    (ref_logits, ref_grads), (logits, grads) = results
    assert torch.equal(logits, ref_logits)  # the forward computes the same; it only also writes o_cache
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp_min(1e-30)
        assert (grad - ref_grads[name]).abs().max() <= 1e-5 * scale, name


def test_dq_atomic_and_the_kept_output_leave_a_continuing_call_as_it_was(monkeypatch):
    """A call continuing from a cache (prefix keys) runs the plain kernels whatever the dk/dv configuration and
    the setting: it keeps no output and launches neither the atomic dk/dv kernel nor the kept-output ones, and
    matches the reference as in test_triton_continues_from_a_cache_like_the_reference."""
    import functools
    import sys
    monkeypatch.setattr(triton_kernels, "_INTERPRET_CONFIG", dict(triton_kernels._INTERPRET_CONFIG, DQ_ATOMIC=True))
    spies = {name: _Launches(getattr(triton_kernels, name))
             for name in ("_cache_bwd_dkdv_dq_kernel", "_cache_fwd_oc_kernel", "_cache_bwd_dq_oc_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(triton_kernels, name, spy)
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "hola_attention_triton",
                        functools.partial(module.hola_attention_triton, save_cache_output=True))
    test_triton_continues_from_a_cache_like_the_reference(CONTINUE_CASES[1])
    assert {name: spy.count for name, spy in spies.items()} == dict.fromkeys(spies, 0)


def test_the_trainer_sets_model_cache_kernels_and_reports_it(tmp_path):
    """A trainer on the Triton backend applies ``model.cache_kernels`` to the launch tables before its paths lines;
    the next trainer, with ``auto``, restores them. (The debug model's head dim takes the Triton kernels either way,
    so its paths lines give the table as the reason; the reason at head dim 256 is in tests/test_gluon_kernels.py.)"""
    from hola_titan.config import parse_config
    from hola_titan.train import Trainer

    def trainer(choice: str) -> Trainer:
        return Trainer(parse_config([
            "--model.size", "debug", "--model.attention_backend", "triton", "--model.cache_kernels", choice,
            "--training.seq_len", "128", "--training.local_batch_size", "1", "--checkpoint.enable", "false",
            "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(tmp_path / choice)]))

    try:
        first = trainer("triton")
        assert triton_kernels.FORWARD == {} and triton_kernels.BACKWARD == {}
        why = f"Triton kernels (the launch table names Triton at head dim {first.model_args.head_dim})"
        assert first.paths["cache_forward"] == why, first.paths["cache_forward"]
        assert first.paths["cache_backward"].startswith(why), first.paths["cache_backward"]
        trainer("auto")
        assert triton_kernels.FORWARD == triton_kernels.DEFAULT_FORWARD
        assert triton_kernels.BACKWARD == triton_kernels.DEFAULT_BACKWARD
    finally:
        triton_kernels.set_cache_kernels("auto")
