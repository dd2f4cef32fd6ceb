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
    """A valid selection with holes: up to ``window`` earlier tokens of the block's own document per (block, head),
    about one slot in five left empty anywhere in the window (the compaction must skip it)."""
    gen = torch.Generator().manual_seed(seed)
    nb = table.num_blocks
    sel = torch.full((nb, heads, window), -1, dtype=torch.int32)
    for b in range(nb):
        start, doc_start = int(table.blk_start[b]), int(table.blk_doc_start[b])
        if int(table.blk_len[b]) == 0 or start == doc_start:
            continue
        for h in range(heads):
            cand = doc_start + torch.randperm(start - doc_start, generator=gen)[:window]
            keep = torch.rand(cand.shape[0], generator=gen) > 0.2
            sel[b, h, :cand.shape[0]] = torch.where(keep, cand, -1).to(torch.int32)
    return sel


CASES = [  # (batch, seq_len, cu_seqlens, heads, dim, block, window)
    (1, 61, [0, 1, 20, 21, 61], 3, 8, 8, 5),  # packed documents, length-1 documents, partial blocks
    (2, 19, None, 2, 4, 4, 3),  # rows
    (1, 40, [0, 13, 40], 2, 4, 8, 0),  # no window: own blocks only
]


def _table(b, t, cu, block):
    return hola_triton_select.build_block_table(b, t, torch.tensor(cu) if cu else None, block, torch.device("cpu"))


@pytest.mark.parametrize("case", CASES[:2])
def test_layout_holds_each_sequence_s_filled_entries_then_its_block(case):
    b, t, cu, h, _, block, window = case
    table = _table(b, t, cu, block)
    sel = _selection(table, h, window, seed=t)
    n = b * t
    lay = build_layout(table, sel, n, window=window)
    nb = table.num_blocks
    assert lay.cu_q.shape == lay.cu_k.shape == (h * nb + 1,)
    assert lay.k_src.shape == (h * (nb * window + n),)
    for s in range(h * nb):
        head, blk = divmod(s, nb)
        start, length = int(table.blk_start[blk]), int(table.blk_len[blk])
        assert int(lay.cu_q[s]) == head * n + (start if length else int(lay.cu_q[s]) - head * n)
        assert int(lay.cu_q[s + 1]) - int(lay.cu_q[s]) == length
        filled = [int(x) for x in sel[blk, head] if x >= 0]
        want = [x * h + head for x in filled] + [(start + i) * h + head for i in range(length)]
        got = lay.k_src[int(lay.cu_k[s]):int(lay.cu_k[s + 1])].tolist()
        assert got == want, (s, got, want)
    assert (lay.k_src[int(lay.cu_k[-1]):] == n * h).all(), "the tail must point at the zero row"
    assert int(lay.cu_q[-1]) == h * n


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
