"""The fused short convolution and cross-entropy kernels in Triton's interpreter, against their PyTorch forms.

Tiny shapes (the interpreter runs every tile op in NumPy); the compiled kernels at the 340M shapes are checked by
``test_fused_kernels_gpu.py``. float32 kernels against the float64 PyTorch form: at most twice the error of the
float32 PyTorch form plus 16 roundoff units of the absolute terms (``helpers.assert_fp32_close``; the weight
gradients of the convolution are sums over every token, bounded by the sum of the tokens' |contributions|). The
cross-entropy kernel is checked against the PyTorch form from the same bf16 logits. Outputs are poisoned with NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("this suite runs in Triton's interpreter: tests/test_interpreter.py starts it in a process with "
                       "TRITON_INTERPRET=1 (Triton picks the interpreter when a kernel is defined)")
pytest.importorskip("triton")

from hola_titan.kernels.fused import cross_entropy, short_conv  # noqa: E402
from hola_titan.loss import chunked_linear_cross_entropy  # noqa: E402
from hola_titan.models.args import model_args  # noqa: E402
from hola_titan.models.layers import ShortConvolution, document_positions  # noqa: E402
from hola_titan.models.model import HolaTitanLM  # noqa: E402
from hola_titan.ops import resolve_kernels  # noqa: E402
from helpers import (FP32_FLOOR_UNITS, NUDGED_RUNS, U32, assert_fp32_close, model_grads,  # noqa: E402
                     token_abs_terms)


pytestmark = pytest.mark.usefixtures("single_thread")


def _close(got, ref, bound=1e-5):
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= bound * ref.double().abs().max().clamp_min(1e-30).item(), err


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(short_conv, "POISON_OUTPUTS", True)


def _reference(x, weights, positions, dys, dtype=torch.float64):
    """The PyTorch form (``ShortConvolution``, one per q, k, v) in ``dtype``: outputs, dx, the weight grads and,
    in float64, the weight grads' absolute terms (each a sum over the tokens: helpers.token_abs_terms)."""
    x = x.detach().to(dtype).requires_grad_()
    c = x.shape[-1] // 3
    convs = []
    for w in weights:
        conv = ShortConvolution(c, w.shape[-1]).to(dtype)
        conv.weight.data.copy_(w.detach().to(dtype).view(c, 1, -1))
        convs.append(conv)
    outs = [conv(xi, positions=positions)[0] for conv, xi in zip(convs, x.split(c, dim=-1))]
    terms = None
    if dtype == torch.float64:
        # One backward per token: the convolution's autograd function has no batching rule.
        terms = [token_abs_terms(out, dy, [conv.weight], batched=False)[0].view(c, -1)
                 for out, dy, conv in zip(outs, dys, convs)]
    torch.autograd.backward(outs, [dy.to(dtype) for dy in dys])
    return outs, x.grad, [conv.weight.grad.view(c, -1) for conv in convs], terms


def _check_conv(outs, dx, dws, x, weights, positions, dys):
    """Outputs, dx and the weight grads of the kernel against the float64 PyTorch form, within twice the float32
    PyTorch form's error plus roundoff units of the absolute terms (helpers.assert_fp32_close)."""
    o64, dx64, dw64, terms = _reference(x, weights, positions, dys)
    o32, dx32, dw32, _ = _reference(x, weights, positions, dys, torch.float32)
    for i, (got, ref, exact) in enumerate(zip(outs, o32, o64)):
        assert_fp32_close(got, ref, exact, f"out {i}")
    assert_fp32_close(dx, dx32, dx64, "dx")
    for i, (got, ref, exact, abs_terms) in enumerate(zip(dws, dw32, dw64, terms)):
        assert_fp32_close(got, ref, exact, f"dw {i}", abs_terms=abs_terms)


@pytest.mark.parametrize("lengths", [[75], [10, 1, 29, 35], [1, 1, 1, 16, 3], [40, 23]])
def test_packed_documents_match_the_reference(lengths, poisoned):
    c, k = 16, 4
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = document_positions(1, t, cu, "cpu")
    x = torch.randn(1, t, 3 * c, requires_grad=True)
    weights = [(torch.rand(c, 1, k) - 0.5).requires_grad_() for _ in range(3)]
    dys = [torch.randn(1, t, c) for _ in range(3)]
    outs = short_conv.short_conv_qkv(x, weights, positions=positions)
    torch.autograd.backward(list(outs), dys)
    for got in outs:
        assert got.is_contiguous() and got.shape == (1, t, c)
    _check_conv(outs, x.grad, [w.grad.view(c, -1) for w in weights], x, weights, positions, dys)


def test_rows_without_positions_are_documents(poisoned):
    c = 32
    x = torch.randn(3, 21, 3 * c, requires_grad=True)
    weights = [(torch.rand(c, 4) - 0.5).requires_grad_() for _ in range(3)]
    dys = [torch.randn(3, 21, c) for _ in range(3)]
    outs = short_conv.short_conv_qkv(x, weights, positions=None)
    torch.autograd.backward(list(outs), dys)
    _check_conv(outs, x.grad, [w.grad for w in weights], x, weights, None, dys)


def test_a_nan_in_one_document_does_not_reach_the_next():
    c = 16
    cu = torch.tensor([0, 20, 40])
    positions = document_positions(1, 40, cu, "cpu")
    x = torch.randn(1, 40, 3 * c)
    x[0, 19] = float("nan")  # the last token of the first document
    weights = [torch.rand(c, 4) for _ in range(3)]
    outs = short_conv.short_conv_qkv(x, weights, positions=positions)
    for out in outs:
        assert torch.isnan(out[0, 19]).all() and torch.isfinite(out[0, 20:]).all()


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="x: the channels"):
        short_conv.short_conv_qkv(torch.randn(1, 4, 3 * 20), [torch.randn(20, 4)] * 3, positions=None)
    with pytest.raises(ValueError, match="positions"):
        short_conv.short_conv_qkv(torch.randn(1, 4, 48), [torch.randn(16, 4)] * 3, positions=torch.zeros(1, 5))
    assert not short_conv.supports(20, torch.device("cpu")) and short_conv.supports(32, torch.device("cpu"))


@pytest.mark.parametrize("flavour", ["hola", "gdn"])
def test_model_with_the_kernels_equals_the_reference_model(flavour):
    """The whole debug model with ``kernels="triton"`` (fused q|k|v projection and convolution) against the same
    weights on the PyTorch path: logits and every parameter gradient, packed documents."""
    args = model_args(flavour, "debug", vocab_size=97, n_layers=2)
    tokens = torch.randint(0, 97, (1, 80))
    cu = torch.tensor([0, 30, 31, 80])
    exact_logits, exact_grads = model_grads(args, tokens, cu, "reference", torch.float64)
    logits, grads = model_grads(args, tokens, cu, "triton", torch.float32)
    ref_logits, ref_grads = model_grads(args, tokens, cu, "reference", torch.float32)
    assert_fp32_close(logits, ref_logits, exact_logits, "logits")
    assert ref_grads.keys() == grads.keys() == exact_grads.keys()
    nudged = [model_grads(args, tokens, cu, "reference", torch.float32, nudge=k)[1] for k in range(NUDGED_RUNS)]

    def rel_err(got, name):
        exact = exact_grads[name]
        return ((got[name].double() - exact).norm() / exact.norm().clamp_min(1e-300)).item()

    # Against the float64 model, in relative L2 norm per parameter: at most twice the float32 PyTorch model's
    # largest error over the plain and nudged runs (helpers.NUDGED_RUNS, DESIGN §7) plus 16 roundoff units.
    for name in exact_grads:
        err = rel_err(grads, name)
        err_ref = max(rel_err(g, name) for g in (ref_grads, *nudged))
        assert err <= 2 * err_ref + FP32_FLOOR_UNITS * U32, (name, err, err_ref)


@pytest.mark.parametrize("vocab", [203, 64, 1])
def test_cross_entropy_kernel_matches_the_pytorch_form(vocab):
    n, d = 37, 16
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(vocab, d, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    labels[3] = -100
    labels[10:14] = -100
    out = []
    for kernel in (False, True):
        h.grad = w.grad = None
        loss = chunked_linear_cross_entropy(h, w, labels, chunk_size=8, matmul_dtype=torch.bfloat16, kernel=kernel)
        loss.backward()
        out.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    (loss_r, dh_r, dw_r), (loss_k, dh_k, dw_k) = out
    # Both from the same bf16 logits with float32 statistics: the loss to float32 summation order; the bf16
    # logit gradients may differ by a rounding flip (1 bf16 ulp, 2^-8 relative).
    assert abs(loss_k.item() - loss_r.item()) <= 1e-5 * max(1.0, abs(loss_r.item()))
    for got, ref in ((dh_k, dh_r), (dw_k, dw_r)):
        assert ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item() < 1e-2


def test_cross_entropy_rows_in_place_and_ignored_rows():
    logits = torch.randn(5, 70).to(torch.bfloat16)
    labels = torch.tensor([0, 69, -100, 5, 5])
    expected = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")
    probs = torch.softmax(logits.float(), -1)
    work = logits.clone()
    loss = cross_entropy.cross_entropy_rows_(work, labels, ignore_index=-100, write_grad=True)
    _close(loss, expected)
    assert loss[2] == 0 and (work[2] == 0).all()
    grad = probs.clone()
    grad[torch.arange(5), labels.clamp_min(0)] -= 1
    grad[2] = 0
    assert (work.float() - grad).abs().max() <= 2 ** -8
    untouched = logits.clone()
    cross_entropy.cross_entropy_rows_(untouched, labels, ignore_index=-100, write_grad=False)
    assert torch.equal(untouched, logits)
    with pytest.raises(ValueError, match="logits: expected bfloat16"):
        cross_entropy.cross_entropy_rows_(logits.float(), labels, ignore_index=-100, write_grad=True)
    with pytest.raises(ValueError, match="kernel: the cross-entropy kernel"):
        chunked_linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1]), kernel=True)


def test_kernels_resolve_once_and_name_the_choice():
    cpu = torch.device("cpu")
    assert resolve_kernels("auto", cpu) == "reference"  # auto: Triton kernels on CUDA only
    assert resolve_kernels("triton", cpu) == "triton"  # the interpreter (this module set TRITON_INTERPRET)
    assert resolve_kernels("reference", cpu) == "reference"
    with pytest.raises(ValueError, match="kernels: unknown"):
        resolve_kernels("fast", cpu)
    with pytest.raises(ValueError, match="kernels: expected"):
        HolaTitanLM(model_args("gdn", "debug", vocab_size=97, n_layers=1), kernels="auto")


def test_the_fused_convolution_steps_aside_where_it_does_not_apply():
    """Decoding caches, context parallelism, tensor parallelism (local parameter views) and converted projections
    take the PyTorch form; a plain forward takes the kernels."""
    from hola_titan.models.model import GatedDeltaMixer, RecurrentLayerCache

    mixer = GatedDeltaMixer(model_args("hola", "debug", vocab_size=97), kernels="triton")
    assert mixer._fused_conv_applies(None, None)
    assert not mixer._fused_conv_applies(object(), None)
    assert not mixer._fused_conv_applies(None, RecurrentLayerCache())
    mixer.q_conv.local_grad_placements = {"weight": ()}  # what a tensor-parallel plan records
    assert not mixer._fused_conv_applies(None, None)
    mixer = GatedDeltaMixer(model_args("hola", "debug", vocab_size=97), kernels="triton")
    mixer.k_proj.register_forward_hook(lambda *args: None)
    assert not mixer._fused_conv_applies(None, None)
    assert not GatedDeltaMixer(model_args("hola", "debug", vocab_size=97),
                               kernels="reference")._fused_conv_applies(None, None)
