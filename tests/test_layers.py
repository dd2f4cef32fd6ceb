"""The hand-written backwards of the shared layers (RMSNorm, SwiGLU, the short convolution): gradients against
autograd of the plain expressions (float64), what each saves for the backward, and RMSNorm under autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hola_titan.models.layers import FeedForward, RMSNorm, ShortConvolution, _SwiGLUFunction

torch.manual_seed(0)


def _saved(fn):
    """Run ``fn`` and return the shapes of the tensors autograd saved (by storage, once each)."""
    seen, shapes = set(), []

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def _grads(out, inputs, weight):
    return torch.autograd.grad((out * weight).sum(), inputs)


def test_rms_norm_gradients_and_saved_tensors():
    norm = RMSNorm(8).double()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    out, saved = _saved(lambda: norm(x))
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    assert torch.equal(out, plain)
    w = torch.randn_like(out)
    for a, b in zip(_grads(out, [x, norm.weight], w), _grads(plain, [x, norm.weight], w)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert sorted(saved) == sorted([(3, 5, 8), (8,), (3, 5, 1)])  # x, weight, rstd


def test_rms_norm_returns_autocast_dtype_inside_autocast_and_input_dtype_outside():
    norm = RMSNorm(8)
    norm.init_weights()
    x = torch.randn(2, 8)
    assert norm(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, norm(x).to(torch.bfloat16), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm.double()(x.double()).dtype == torch.float64  # autocast never lowers float64


def test_swiglu_gradients_and_saved_tensors():
    ff = FeedForward(6, 16).double()
    ff.init_weights(0.3, 0.3)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    out, saved = _saved(lambda: ff(x))
    plain = ff.w2(F.silu(ff.w1(x)) * ff.w3(x))
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    w = torch.randn_like(out)
    params = [x, ff.w1.weight, ff.w2.weight, ff.w3.weight]
    for a, b in zip(_grads(out, params, w), _grads(plain, params, w)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    hidden = [s for s in saved if s == (4, 16)]
    assert len(hidden) == 2  # w1 x and w3 x; neither silu(w1 x) nor the product fed to w2 (recomputed)


@pytest.mark.parametrize("autocast", [False, True])
def test_folded_down_projection_is_bit_identical_to_the_modules(autocast, monkeypatch):
    """The MLP with the product recomputed in the backward against the same MLP through w2's module call: output
    and every gradient bit for bit, in float32 and under bf16 autocast with float32 weights (the training setup)."""
    from hola_titan.models import layers

    torch.manual_seed(0)
    ff = FeedForward(32, 96)
    ff.init_weights(0.1, 0.1)
    x = torch.randn(2, 50, 32)
    up = torch.randn(2, 50, 32)

    def run():
        inp = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ff(inp)
        out.backward(up.to(out.dtype))
        grads = [inp.grad] + [p.grad.clone() for p in (ff.w1.weight, ff.w2.weight, ff.w3.weight)]
        ff.zero_grad(set_to_none=True)
        return [out.detach()] + grads

    folded = run()
    monkeypatch.setattr(layers, "_is_plain_linear", lambda module: False)
    modules = run()
    assert folded[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    for name, got, want in zip(["out", "x", "w1", "w2", "w3"], folded, modules):
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_down_projection_with_a_hook_runs_through_its_module():
    """A hooked (or converted) w2 keeps its module call, so parallelisms and conversions still apply."""
    ff = FeedForward(8, 16)
    ff.init_weights(0.1, 0.1)
    calls = []
    ff.w2.register_forward_hook(lambda module, args, out: calls.append(out.shape) or out * 2)
    x = torch.randn(3, 8)
    out = ff(x)
    assert calls == [torch.Size([3, 8])]
    torch.testing.assert_close(out, 2 * F.linear(F.silu(ff.w1(x)) * ff.w3(x), ff.w2.weight))


def _plain_conv(x, weight, positions, tail, continues, k):
    prev = tail if tail is not None else x.new_zeros(x.shape[0], k - 1, x.shape[2])
    xp = torch.cat([prev, x], dim=1)
    w = weight.view(x.shape[2], k)
    y = x * w[:, k - 1]
    for shift in range(1, k):
        term = xp[:, k - 1 - shift: k - 1 - shift + x.shape[1]] * w[:, k - 1 - shift]
        if positions is not None:
            keep = positions >= shift
            if continues is not None and tail is not None:
                keep = keep | continues
            term = torch.where(keep[..., None], term, torch.zeros((), dtype=x.dtype))
        y = y + term
    return F.silu(y), xp[:, -(k - 1):]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_tail", [False, True])
def test_short_convolution_gradients_and_saved_tensors(packed, with_tail):
    b, t, c, k = 2, 9, 5, 4
    conv = ShortConvolution(c, k).double()
    conv.init_weights()
    x = torch.randn(b, t, c, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(b, k - 1, c, dtype=torch.float64, requires_grad=True) if with_tail else None
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0], [3, 4, 5, 6, 0, 1, 0, 0, 1]]) if packed else None
    continues = (torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
                 if packed and with_tail else None)
    (y, new_tail), saved = _saved(lambda: conv(x, positions=positions, tail=tail, continues=continues))
    y_ref, tail_ref = _plain_conv(x, conv.weight, positions, tail, continues, k)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(new_tail, tail_ref, rtol=0, atol=0)
    inputs = [x, conv.weight] + ([tail] if with_tail else [])
    wy, wt = torch.randn_like(y), torch.randn_like(new_tail)
    got = torch.autograd.grad((y * wy).sum() + (new_tail * wt).sum(), inputs)
    want = torch.autograd.grad((y_ref * wy).sum() + (tail_ref * wt).sum(), inputs)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)
    activations = [s for s in saved if len(s) == 3 and s[-1] == c]
    assert activations == [(b, k - 1 + t, c)]  # only the padded input


def test_short_convolution_keeps_a_nan_in_its_document_both_ways():
    """Forward: a NaN input in document 0 does not reach document 1's outputs. Backward: a NaN gradient on
    document 1's outputs does not reach document 0's inputs through the masked taps (a product with a zero mask
    would carry it: 0 * NaN)."""
    conv = ShortConvolution(3, 4).double()
    conv.init_weights()
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # document 0 is tokens 0-3, document 1 tokens 4-7
    x = torch.randn(1, 8, 3, dtype=torch.float64)
    x[0, 2, 1] = float("nan")
    y, _ = conv(x, positions=positions)
    assert torch.isfinite(y[0, 4:]).all()
    x = torch.randn(1, 8, 3, dtype=torch.float64, requires_grad=True)
    y, _ = conv(x, positions=positions)
    upstream = torch.ones_like(y)
    upstream[0, 4:] = float("nan")
    grad_x, = torch.autograd.grad(y, [x], upstream)
    assert torch.isfinite(grad_x[0, :4]).all()


def test_bf16_backwards_match_autograd_of_the_expressions():
    """In bf16 the hand-written backwards compute as autograd of the plain expressions does: SwiGLU's gradients
    bit for bit, the convolution's weight gradient bit for bit and its input gradient within bf16 rounding (the
    taps' contributions are summed in another order)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(8, 96, generator=gen).to(torch.bfloat16).requires_grad_()
    b = torch.randn(8, 96, generator=gen).to(torch.bfloat16).requires_grad_()
    got = _SwiGLUFunction.apply(a, b)
    want = F.silu(a) * b
    assert torch.equal(got, want)
    up = torch.randn(8, 96, generator=gen).to(torch.bfloat16)
    for g, w in zip(torch.autograd.grad(got, [a, b], up), torch.autograd.grad(want, [a, b], up)):
        assert torch.equal(g, w)

    conv = ShortConvolution(64, 4)
    conv.init_weights()
    x = torch.randn(2, 300, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    positions = torch.cat([torch.arange(150), torch.arange(150)]).expand(2, 300)
    weight = conv.weight.to(torch.bfloat16)
    y, _ = conv(x, positions=positions)
    y_ref, _ = _plain_conv(x, weight, positions, None, None, 4)
    assert torch.equal(y, y_ref)
    up = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    got = torch.autograd.grad(y, [x, conv.weight], up)
    want = torch.autograd.grad(y_ref, [x, conv.weight], up)
    assert torch.equal(got[1], want[1])
    assert (got[0].float() - want[0].float()).abs().max() <= 2 ** -6 * want[0].float().abs().max()
