"""``gather_head_rows`` on a GPU (marker ``gpu``): its backward's ``index_add_`` there is atomic adds (or, under
``torch.use_deterministic_algorithms``, the sorted kernel), where a sum in bfloat16 would drift. Both must give the
float64 sum of every used slot, rounded once, and nothing from empty slots."""

from __future__ import annotations

import pytest
import torch

from hola_titan.kernels.hola.stages import gather_head_rows

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = torch.device("cuda")


@pytest.mark.parametrize("deterministic", [False, True])
def test_duplicates_are_summed_in_float32_and_empty_slots_add_nothing(deterministic):
    # The duplicate pattern of a batch of short documents: many slots per head reading one row (a token every block
    # of its document selected), and many empty slots (each document's first block) whose gradients are NaN.
    n, h, d, slots = 4096, 4, 256, 20480
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    index = torch.randint(0, n, (slots, h), device=DEVICE, generator=gen)
    index[: slots // 4] = 7
    index[slots // 4: slots // 2] = n
    index[slots // 4: slots // 4 + 512] = -1  # the selection's spelling of an empty slot
    rows = torch.randn(n, h, d, device=DEVICE).to(torch.bfloat16).requires_grad_()
    grad = (1 + 0.01 * torch.randn(slots, h, d, device=DEVICE, generator=gen)).to(torch.bfloat16)
    grad[slots // 4: slots // 2] = float("nan")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out = gather_head_rows(rows, index)
        (g,) = torch.autograd.grad(out, rows, grad)
    finally:
        torch.use_deterministic_algorithms(previous)
    used = (index >= 0) & (index < n)
    heads = torch.arange(h, device=DEVICE).expand(slots, h)
    assert torch.equal(out[used], rows.detach()[index[used], heads[used]])
    assert torch.count_nonzero(out[~used]) == 0
    exact = torch.zeros(n, h, d, dtype=torch.float64, device=DEVICE)
    exact.index_put_((index[used], heads[used]), grad[used].double(), accumulate=True)
    assert torch.isfinite(g).all(), "an empty slot's NaN gradient reached a token row"
    # The float32 sum of a row's terms (at most `slots` of them, atomics in any order) is within slots * 2^-24 *
    # sum|terms| of the exact one; rounding it to bfloat16 adds at most half an ulp (2^-8 of the value).
    terms = torch.zeros_like(exact).index_put_((index[used], heads[used]), grad[used].double().abs(), accumulate=True)
    fp32_sum = slots * 2 ** -24 * terms
    bound = (exact.abs() + fp32_sum) * 2 ** -8 + fp32_sum
    assert ((g.double() - exact).abs() <= bound).all(), "not the sum rounded once"
