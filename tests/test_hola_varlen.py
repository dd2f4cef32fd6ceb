"""The variable-length FlashAttention candidate of the cache read (kernels/hola_varlen.py) on a CPU: its layout, and
its forward and every gradient against the reference with :class:`DenseCore` standing in for FlashAttention (the
GPU suite runs FlashAttention itself)."""

from __future__ import annotations

import pytest
import torch

from hola_titan.kernels import hola_triton_select
from hola_titan.kernels.hola_reference import hola_attention_reference
from hola_titan.kernels.hola_stages import state_path
from hola_titan.kernels.hola_varlen import DenseCore, build_layout, cache_read_varlen

NAMES = ("q", "k", "v", "g", "beta", "gamma_q", "gamma_k", "sink", "gate")


def _selection(table, heads, window, seed):
    """A valid selection with holes: per block the same number of filled slots in every head (as the top-W and
    recency selections give), each head its own earlier tokens of the block's document, at random slots of the
    window (the layout must compact them)."""
    gen = torch.Generator().manual_seed(seed)
    nb = table.num_blocks
    sel = torch.full((nb, heads, window), -1, dtype=torch.int32)
    for b in range(nb):
        start, doc_start = int(table.blk_start[b]), int(table.blk_doc_start[b])
        if int(table.blk_len[b]) == 0 or start == doc_start or window == 0:
            continue
        m = min(window, start - doc_start) - int(torch.randint(0, 2, (1,), generator=gen))
        for h in range(heads):
            cand = doc_start + torch.randperm(start - doc_start, generator=gen)[:m]
            slots = torch.randperm(window, generator=gen)[:m]
            sel[b, h, slots] = cand.to(torch.int32)
    return sel


CASES = [  # (batch, seq_len, cu_seqlens, heads, dim, block, window)
    (1, 61, [0, 1, 20, 21, 61], 3, 8, 8, 5),  # packed documents, length-1 documents, partial blocks
    (2, 19, None, 2, 4, 4, 3),  # rows
    (1, 40, [0, 13, 40], 2, 4, 8, 0),  # no window: own blocks only
]


def _table(b, t, cu, block):
    return hola_triton_select.build_block_table(b, t, torch.tensor(cu) if cu else None, block, torch.device("cpu"))


@pytest.mark.parametrize("case", CASES[:2])
def test_layout_holds_each_block_s_filled_entries_per_head(case):
    b, t, cu, h, _, block, window = case
    table = _table(b, t, cu, block)
    sel = _selection(table, h, window, seed=t)
    n = b * t
    lay = build_layout(table, sel, n, window=window)
    nb = table.num_blocks
    assert lay.cu_blk.shape == lay.cu_cache.shape == (nb + 1,)
    assert lay.cache_src.shape == (nb * window, h)
    assert int(lay.cu_blk[-1]) == n
    for blk in range(nb):
        start, length = int(table.blk_start[blk]), int(table.blk_len[blk])
        if length:
            assert int(lay.cu_blk[blk]) == start and int(lay.cu_blk[blk + 1]) == start + length
        rows = slice(int(lay.cu_cache[blk]), int(lay.cu_cache[blk + 1]))
        for head in range(h):
            want = [int(x) * h + head for x in sel[blk, head] if x >= 0]
            assert lay.cache_src[rows, head].tolist() == want, (blk, head)
    assert (lay.cache_src[int(lay.cu_cache[-1]):] == n * h).all(), "rows past the entries must point at the zero row"


def test_layout_refuses_heads_with_different_numbers_of_entries_and_blocks_that_do_not_tile():
    table = _table(1, 40, [0, 40], 8)
    sel = _selection(table, 2, 4, seed=0)
    bad = sel.clone()
    bad[3, 1, bad[3, 1] >= 0] = -1  # head 1 of block 3 loses its entries
    with pytest.raises(RuntimeError, match="different numbers of filled cache slots"):
        build_layout(table, bad, 40, window=4)
    short = _table(1, 40, [0, 33], 8)  # documents that end before the tokens do
    with pytest.raises(RuntimeError, match="must tile the tokens in order"):
        build_layout(short, _selection(short, 2, 4, seed=0), 40, window=4)


def _inputs(b, t, h, d, seed, dtype):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=randn(b, t, h, d), k=randn(b, t, h, d), v=randn(b, t, h, d),
             g=-torch.nn.functional.softplus(randn(b, t, h)) * 0.5, beta=torch.sigmoid(randn(b, t, h)),
             gamma_q=1 + 0.3 * randn(d), gamma_k=1 + 0.3 * randn(d), sink=randn(h), gate=randn(h))
    return {n: x_.to(dtype).requires_grad_() for n, x_ in x.items()}


def _candidate(x, table, sel, cu, window):
    b, t = x["q"].shape[:2]
    o_state, _, _ = state_path(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=None, cu_seqlens=cu,
                               output_final_state=False, impl="reference")
    lay = build_layout(table, sel, b * t, window=window)
    return cache_read_varlen(x["q"], x["k"], x["v"], o_state, x["gamma_q"], x["gamma_k"], x["sink"], x["gate"], lay,
                             core=DenseCore())


@pytest.mark.parametrize("case", CASES)
def test_candidate_matches_the_reference_forward_and_every_gradient(case):
    """float64 end to end: the output and the gradient of every input equal the reference's reading the same
    selection to rounding (1e-9 of each tensor's scale)."""
    b, t, cu, h, d, block, window = case
    table = _table(b, t, cu, block)
    sel = _selection(table, h, window, seed=t + 1)
    cu_t = torch.tensor(cu) if cu else None
    x = _inputs(b, t, h, d, seed=t, dtype=torch.float64)
    w = torch.randn(b, t, h, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    o = _candidate(x, table, sel, cu_t, window)
    grads = torch.autograd.grad((o * w).sum(), [x[n] for n in NAMES])
    xr = {n: x_.detach().clone().requires_grad_() for n, x_ in x.items()}
    o_r, _, _ = hola_attention_reference(*[xr[n] for n in NAMES], window=window, block=block, evict="score",
                                         cu_seqlens=cu_t, initial_state=None, output_final_state=False,
                                         initial_cache=None, output_final_cache=False, selected=sel)
    grads_r = torch.autograd.grad((o_r * w).sum(), [xr[n] for n in NAMES])
    for name, a, e in [("o", o, o_r), *zip(("d" + n for n in NAMES), grads, grads_r)]:
        err = (a - e).abs().max().item()
        assert err <= 1e-9 * max(e.abs().max().item(), 1e-30), f"{name}: max abs error {err:.3e}"


def test_candidate_gradcheck_and_a_layout_for_other_shapes_is_refused():
    b, t, cu, h, d, block, window = 1, 21, [0, 9, 21], 2, 4, 4, 3
    table = _table(b, t, cu, block)
    sel = _selection(table, h, window, seed=1)
    lay = build_layout(table, sel, b * t, window=window)
    x = _inputs(b, t, h, d, seed=2, dtype=torch.float64)
    o_state = torch.randn(b, t, h, d, dtype=torch.float64, requires_grad=True)
    args = (x["q"], x["k"], x["v"], o_state, x["gamma_q"], x["gamma_k"], x["sink"], x["gate"])
    assert torch.autograd.gradcheck(lambda *a: cache_read_varlen(*a, lay, core=DenseCore()), args)
    with pytest.raises(ValueError, match="layout built for 21 tokens x 2 heads"):
        cache_read_varlen(*(a[:, :20] if a.dim() == 4 else a for a in args), lay, core=DenseCore())


def test_compiled_glue_traces_whole_and_gives_the_eager_results():
    """Every glue piece compiles as one graph (fullgraph; aot_eager here, Inductor on the GPU) and the read gives
    the eager glue's output and gradients."""
    from hola_titan.kernels.hola_varlen import Glue
    b, t, cu, h, d, block, window = CASES[0]
    table = _table(b, t, cu, block)
    sel = _selection(table, h, window, seed=3)
    lay = build_layout(table, sel, b * t, window=window)
    results = []
    for glue in (Glue(compiled=False), Glue(compiled=True, backend="aot_eager")):
        x = _inputs(b, t, h, d, seed=4, dtype=torch.float32)
        o_state = torch.randn(b, t, h, d, generator=torch.Generator().manual_seed(5), requires_grad=True)
        args = (x["q"], x["k"], x["v"], o_state, x["gamma_q"], x["gamma_k"], x["sink"], x["gate"])
        o = cache_read_varlen(*args, lay, core=DenseCore(), glue=glue)
        results.append((o, *torch.autograd.grad((o * o.detach().sin()).sum(), args)))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
