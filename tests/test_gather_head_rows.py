"""``gather_head_rows``: the per-head gather of token rows into key slots that the SDPA and FA4 backends share.

Its forward is ``rows[index[..., h], h]`` with zero rows for empty slots; its backward sums every used slot's
gradient into its token row in float32 and drops the empty slots' gradients, whatever they hold (FlashAttention-4
leaves them unwritten). The backends' tests check it inside the read; these check it alone, with the duplicates a
batch of many documents makes.
"""

from __future__ import annotations

import pytest
import torch

from hola_titan.kernels.hola.stages import gather_head_rows


def _index(n, slots, h, seed, empty_share=0.3):
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n, (slots, h), generator=gen)
    empty = torch.rand(slots, h, generator=gen) < empty_share
    # Both spellings of an empty slot: the backends' ``N`` and the selection's ``-1``.
    return torch.where(empty, torch.where(torch.rand(slots, h, generator=gen) < 0.5, n, -1), index)


def _expected(rows64, index, grad64):
    """Forward and the rows' gradient in float64, slot by slot."""
    n, h, d = rows64.shape
    out = torch.zeros(*index.shape, d, dtype=torch.float64)
    total = torch.zeros_like(rows64)
    for s in range(index.shape[0]):
        for hh in range(h):
            i = int(index[s, hh])
            if 0 <= i < n:
                out[s, hh] = rows64[i, hh]
                total[i, hh] += grad64[s, hh]
    return out, total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradient_are_the_slotwise_gather_and_sum(dtype):
    n, h, d, slots = 11, 3, 8, 40
    rows = torch.randn(n, h, d).to(dtype).requires_grad_()
    index = _index(n, slots, h, seed=1)
    grad = torch.randn(slots, h, d).to(dtype)
    empty = (index < 0) | (index >= n)
    grad = torch.where(empty[..., None], torch.full_like(grad, float("nan")), grad)  # what FA4 leaves there
    out = gather_head_rows(rows, index)
    (g,) = torch.autograd.grad(out, rows, grad)
    want_out, want_g = _expected(rows.detach().double(), index, torch.nan_to_num(grad.double(), nan=0.0))
    assert out.dtype == dtype and out.shape == (slots, h, d)
    assert torch.equal(out.double(), want_out), "the forward is a copy: exact"
    assert torch.isfinite(g).all(), "an empty slot's gradient (NaN here) reached a token row"
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(g.double(), want_g, rtol=tol, atol=tol)


def test_many_slots_of_one_row_are_summed_in_float32_and_rounded_once():
    """Every slot reads token row 0 (a token chosen by many blocks) in bfloat16: the sum is the float64 sum rounded
    once. A CPU's ``index_add_`` already sums bfloat16 in a wider type, so on a CPU this checks the result, not the
    float32 buffer; a GPU's bfloat16 atomic adds would drift by tens of ulps, which ``test_gather_head_rows_gpu.py``
    catches. The loop below shows the size of that drift."""
    n, h, d, slots = 4, 2, 16, 512
    rows = torch.randn(n, h, d).to(torch.bfloat16).requires_grad_()
    index = torch.zeros(slots, h, dtype=torch.long)
    grad = (1 + 0.01 * torch.randn(slots, h, d, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    (g,) = torch.autograd.grad(gather_head_rows(rows, index), rows, grad)
    exact = grad.double().sum(0)  # [H, D]
    # Rounded once: the float32 sum of `slots` terms is within slots * 2^-24 * sum|terms| of the exact one (any
    # order of addition), and rounding that to bfloat16 adds at most half an ulp (2^-8 of the value), element by
    # element.
    fp32_sum = slots * 2 ** -24 * grad.double().abs().sum(0)
    bound = (exact.abs() + fp32_sum) * 2 ** -8 + fp32_sum
    assert ((g[0].double() - exact).abs() <= bound).all(), "not rounded once"
    naive = torch.zeros(h, d, dtype=torch.bfloat16)
    for s in range(slots):
        naive += grad[s]
    assert (naive.double() - exact).abs().max() > 4 * (g[0].double() - exact).abs().max(), \
        "the test cannot tell a float32 sum from a bfloat16 one"
    assert torch.count_nonzero(g[1:]) == 0


def test_empty_slots_read_zero_rows_and_leave_every_row_untouched():
    n, h, d = 5, 2, 4
    rows = torch.randn(n, h, d, requires_grad=True)
    index = torch.full((7, h), n)
    index[0, 0] = -1
    out = gather_head_rows(rows, index)
    assert torch.count_nonzero(out) == 0
    (g,) = torch.autograd.grad(out, rows, torch.full_like(out, float("nan")))
    assert torch.count_nonzero(g) == 0


def test_a_larger_index_than_rows_wraps_its_empty_slots_without_error():
    """More empty slots than ``N * H`` rows: their (zero) gradients wrap around the rows, still adding nothing."""
    n, h, d = 2, 1, 3
    rows = torch.randn(n, h, d, requires_grad=True)
    index = torch.tensor([[0]] + [[n]] * 9)
    out = gather_head_rows(rows, index)
    (g,) = torch.autograd.grad(out, rows, torch.ones_like(out))
    assert torch.equal(g[0], torch.ones(h, d)) and torch.count_nonzero(g[1]) == 0


def test_the_sdpa_backend_s_index_views_and_a_transposed_gradient_match_advanced_indexing():
    """The SDPA backend passes an expanded ``[NB, C, H]`` view and a transposed ``[NB, W, H]`` one, the selection's
    int32; a gradient that arrives transposed. Against the advanced indexing over an appended zero row that the
    backends used before."""
    n, h, d, nb, c, w = 13, 2, 4, 3, 5, 6
    rows = torch.randn(n, h, d, dtype=torch.float64, requires_grad=True)
    gen = torch.Generator().manual_seed(5)
    blk = torch.randint(0, n + 1, (nb, c), generator=gen)  # n: past the block's tokens
    sel = torch.randint(-1, n, (nb, h, w), generator=gen).to(torch.int32)  # -1: an empty cache slot
    for index in (blk[:, :, None].expand(nb, c, h), torch.where(sel >= 0, sel.long(), n).transpose(1, 2)):
        out = gather_head_rows(rows, index.to(torch.int32) if index.dtype == torch.int64 else index)
        padded = torch.cat([rows, rows.new_zeros(1, h, d)])
        want = padded[index.long(), torch.arange(h)]
        assert torch.equal(out, want)
        grad = torch.randn(*reversed(out.shape), dtype=torch.float64).permute(*reversed(range(out.dim())))
        (g,) = torch.autograd.grad(out, rows, grad)
        (g_want,) = torch.autograd.grad(want, rows, grad)
        torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-12)


def test_it_compiles_into_one_graph_with_the_same_gradients():
    n, h, d = 9, 2, 4
    rows = torch.randn(n, h, d, dtype=torch.float64, requires_grad=True)
    index = torch.randint(-1, n + 1, (12, h), generator=torch.Generator().manual_seed(2))

    def loss(r):
        return (gather_head_rows(r, index) ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    (g,) = torch.autograd.grad(compiled(rows), rows)
    (g_want,) = torch.autograd.grad(loss(rows), rows)
    torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows_shape, index_shape", [((4, 2, 3), (5, 3)), ((4, 2), (5, 2)), ((4, 2, 3), ())])
def test_shapes_that_do_not_fit_are_refused_naming_both(rows_shape, index_shape):
    with pytest.raises(ValueError, match="rows \\[N, H, D\\] and index \\[..., H\\]"):
        gather_head_rows(torch.zeros(rows_shape), torch.zeros(index_shape, dtype=torch.long))
