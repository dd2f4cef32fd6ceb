"""The fused short convolution and cross-entropy kernels compiled on a GPU, at the 340M shapes (marker ``gpu``).

Reference: the PyTorch forms in float64 on the same inputs. Bound (DESIGN §7): the kernel's relative L2 error may be
at most twice that of the PyTorch form run in the kernel's input precision (bf16), plus 1e-6. Outputs are poisoned
with NaN before the kernels write them. The interpreter versions of these checks, on tiny shapes, are in
``tests/interpreter/fused_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hola_titan.kernels.fused import short_conv  # noqa: E402
from hola_titan.kernels.fused.short_conv import short_conv_qkv  # noqa: E402
from hola_titan.loss import chunked_linear_cross_entropy  # noqa: E402
from hola_titan.models.layers import ShortConvolution, document_positions  # noqa: E402

DEVICE = torch.device("cuda")


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(short_conv, "POISON_OUTPUTS", True)


def _reference_conv(x, weights, positions, dys, dtype):
    """The PyTorch form in ``dtype``: outputs and the gradients of x and the three weights."""
    x = x.detach().to(dtype).requires_grad_()
    c = x.shape[-1] // 3
    convs = []
    for w in weights:
        conv = ShortConvolution(c, w.shape[-1]).to(DEVICE, dtype)
        conv.weight.data.copy_(w.detach().view(c, 1, -1))
        convs.append(conv)
    outs = [conv(xi, positions=positions)[0] for conv, xi in zip(convs, x.split(c, dim=-1))]
    torch.autograd.backward(outs, [dy.to(dtype) for dy in dys])
    return outs, x.grad, [conv.weight.grad.view(c, -1) for conv in convs]


@pytest.mark.parametrize("packed", [True, False])
def test_short_conv_matches_the_reference_at_340M_shapes(packed, poisoned):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    c, k = 1024, 4
    if packed:
        bsz, seq_len = 1, 32768
        cuts = torch.randint(1, seq_len, (60,), generator=torch.Generator().manual_seed(1)).tolist()
        cu = torch.tensor(sorted(set([0, seq_len, 7, 8, 9] + cuts)), device=DEVICE)  # length-1 documents too
        positions = document_positions(1, seq_len, cu, DEVICE)
    else:
        bsz, seq_len, positions = 4, 2000, None
    x = torch.randn(bsz, seq_len, 3 * c, device=DEVICE, generator=gen).to(torch.bfloat16).requires_grad_()
    weights = [(torch.rand(c, 1, k, device=DEVICE, generator=gen) - 0.5).requires_grad_() for _ in range(3)]
    dys = [torch.randn(bsz, seq_len, c, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(3)]
    outs = short_conv_qkv(x, weights, positions=positions)
    torch.autograd.backward(list(outs), dys)
    assert all(torch.isfinite(o).all() for o in outs) and torch.isfinite(x.grad).all()
    ref_o, ref_dx, ref_dw = _reference_conv(x, weights, positions, dys, torch.float64)
    low_o, low_dx, low_dw = _reference_conv(x, weights, positions, dys, torch.bfloat16)
    for got, ref, low in [*zip(outs, ref_o, low_o), (x.grad, ref_dx, low_dx)]:
        assert _rel(got, ref) <= 2 * _rel(low, ref) + 1e-6
    for w, ref, low in zip(weights, ref_dw, low_dw):
        # The kernel accumulates dweight in float32 (the bf16 form sums in bf16): well inside the bound.
        assert _rel(w.grad.view(c, -1), ref) <= 2 * _rel(low, ref) + 1e-6


def test_cross_entropy_kernel_matches_the_pytorch_form():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    n, d, vocab = 4096, 1024, 32000
    h = torch.randn(n, d, device=DEVICE, generator=gen).requires_grad_()
    w = (0.05 * torch.randn(vocab, d, device=DEVICE, generator=gen)).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device=DEVICE, generator=gen)
    labels[::7] = -100
    results = []
    for kernel in (False, True):
        h.grad = w.grad = None
        loss = chunked_linear_cross_entropy(h, w, labels, chunk_size=1000, matmul_dtype=torch.bfloat16,
                                            kernel=kernel)
        loss.backward()
        results.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    (loss_r, dh_r, dw_r), (loss_k, dh_k, dw_k) = results
    # Same bf16 logits, float32 statistics: the sums differ in order only; the bf16 gradients by ulp flips.
    assert abs(loss_k.item() - loss_r.item()) <= 1e-5 * abs(loss_r.item())
    assert _rel(dh_k, dh_r) < 5e-3 and _rel(dw_k, dw_r) < 5e-3
