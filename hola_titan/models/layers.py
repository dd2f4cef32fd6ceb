"""Building blocks shared by the flavours: RMSNorm, the short convolution, SwiGLU, RoPE, document helpers.

Shape legend: B batch, T tokens, C channels, H heads, D head dim. ``cu_seqlens`` always describes the
flattened ``B*T`` stream (each row starts a document), so helpers take the ``[B, T]`` shape beside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hola_titan.kernels.hola.reference import rms_norm_backward


class LocalParams:
    """Modules whose forward may compute with the local shards of distributed parameters.

    A tensor-parallel plan (``hola_titan.parallelisms.tensor_parallel.HeadParallel``) distributes some
    parameters by head and records, per parameter name, the gradient placements of the local tensor the
    forward computes with in ``local_grad_placements``; :meth:`param` then returns that local tensor (the
    shard of a head-sharded parameter; the local copy of a replicated per-head-dim weight, whose gradient is
    partial: each rank's heads give part of it). The model states where it reads a parameter through
    :meth:`param`; the plan is data, so no method of the model is replaced and this code imports nothing of
    ``torch.distributed``.
    """

    # None until a plan records placements. Not an empty mapping: torch 2.11's Dynamo cannot take ``bool()`` of a
    # ``mappingproxy`` (the read-only class default this once was), and a shared mutable ``{}`` could be written
    # through by mistake.
    local_grad_placements: dict[str, tuple] | None = None

    def param(self, name: str) -> torch.Tensor:
        value = getattr(self, name)
        placements = None if self.local_grad_placements is None else self.local_grad_placements.get(name)
        if placements is None:
            return value
        if not hasattr(value, "to_local"):  # the plan distributed it; anything else is a wiring error
            raise TypeError(f"{type(self).__name__}.{name}: recorded as distributed but is a plain tensor")
        return value.to_local(grad_placements=placements)

    @property
    def computes_locally(self) -> bool:
        """Whether a plan made any of this module's parameters local (tensor parallelism)."""
        return bool(self.local_grad_placements)


class _RMSNormFunction(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` in at least float32, saving only ``x`` and ``rstd`` [..., 1].

    Autograd of the plain expression saves the float32 input, the normalised input and the product (about
    three float32 copies of the activation per norm); the backward here recomputes the normalised input.
    """

    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype: torch.dtype):
        cdt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(cdt)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.to(cdt)).to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_backward(x, rstd, weight, dy)
        return dx.to(x.dtype), dweight.to(weight.dtype), None, None


class RMSNorm(LocalParams, nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in at least float32.

    Returned in the input dtype, or in autocast's dtype inside an autocast region: every consumer is a linear
    layer that would cast it there anyway, and one cast here lets the q, k, v, a, b (or w1, w3) projections
    save one shared copy instead of one each.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype
        if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):  # autocast never lowers float64
            out_dtype = torch.get_autocast_dtype(x.device.type)
        # The local weight inside a head-sharded region (a per-head output norm under tensor parallelism).
        return _RMSNormFunction.apply(x, self.param("weight"), self.eps, out_dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def document_positions(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Position of every token inside its document, ``[B, T]`` (restarting at 0 at each document start)."""
    pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
    if cu_seqlens is None:
        return pos
    flat = torch.arange(batch * seq_len, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    doc = torch.bucketize(flat, cu[1:], right=True)
    return (flat - cu[doc]).view(batch, seq_len)


def document_ids(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Index of every token's document, ``[B, T]`` (rows are documents when ``cu_seqlens`` is None)."""
    if cu_seqlens is None:
        return torch.arange(batch, device=device)[:, None].expand(batch, seq_len)
    flat = torch.arange(batch * seq_len, device=device)
    return torch.bucketize(flat, cu_seqlens.to(device=device, dtype=torch.int64)[1:], right=True).view(batch, seq_len)


class _ShortConvFunction(torch.autograd.Function):
    """``silu(causal depthwise conv)`` over ``xp`` ``[B, K-1+T, C]`` (the K-1 earlier inputs, then the tokens) with
    ``weight`` ``[C, K]``; ``keep`` ``[K-1, B, T]`` bool (or None: all kept) says whether the input ``shift``
    tokens back belongs to the token's document. Saves ``xp`` alone (autograd of the expression also keeps the
    pre-activation and a product per tap) and recomputes the rest in the backward."""

    @staticmethod
    def _pre_activation(xp, weight, keep):
        k = weight.shape[1]
        seq_len = xp.shape[1] - (k - 1)
        y = xp[:, k - 1:] * weight[:, k - 1]
        for shift in range(1, k):
            term = xp[:, k - 1 - shift: k - 1 - shift + seq_len] * weight[:, k - 1 - shift]
            if keep is not None:
                # where, not a product: a NaN in another document must not leak through 0 * NaN.
                term = torch.where(keep[shift - 1, ..., None], term, torch.zeros((), dtype=term.dtype,
                                                                                  device=term.device))
            y = y + term
        return y

    @staticmethod
    def forward(ctx, xp, weight, keep):
        ctx.save_for_backward(xp, weight, keep)
        return F.silu(_ShortConvFunction._pre_activation(xp, weight, keep))

    @staticmethod
    def backward(ctx, dout):
        # In the input dtype, as autograd of the expression computes it (the recomputed pre-activation is the
        # forward's, bit for bit; reductions accumulate in float32 inside ATen).
        xp, weight, keep = ctx.saved_tensors
        k = weight.shape[1]
        seq_len = xp.shape[1] - (k - 1)
        dy = torch.ops.aten.silu_backward(dout, _ShortConvFunction._pre_activation(xp, weight, keep))
        dxp = torch.zeros_like(xp)
        dweight = torch.empty_like(weight)
        zero = torch.zeros((), dtype=dy.dtype, device=dy.device)
        for shift in range(k):
            lo = k - 1 - shift
            window = xp[:, lo: lo + seq_len]
            if shift and keep is not None:
                kept = keep[shift - 1, ..., None]
                dxp[:, lo: lo + seq_len] += torch.where(kept, dy, zero) * weight[:, lo]
                dweight[:, lo] = torch.where(kept, dy * window, zero).sum(dim=(0, 1))
            else:
                dxp[:, lo: lo + seq_len] += dy * weight[:, lo]
                dweight[:, lo] = (dy * window).sum(dim=(0, 1))
        return dxp, dweight, None


class ShortConvolution(LocalParams, nn.Module):
    """Causal depthwise convolution (kernel K) followed by SiLU, restarting at every document start.

    ``weight`` is ``[C, 1, K]`` as in ``nn.Conv1d(C, C, K, groups=C, bias=False)``. ``tail`` ``[B, K-1, C]``
    holds the K-1 inputs before the first token (decoding, chunked prefill, a context-parallel neighbour);
    it is used only by tokens whose document began before this call.
    """

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def init_weights(self) -> None:
        # nn.Conv1d's default (kaiming uniform, a = sqrt(5)): U(-1/sqrt(K), 1/sqrt(K)) for a depthwise kernel.
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor | None = None, tail: torch.Tensor | None = None,
                continues: torch.Tensor | None = None):
        """x ``[B, T, C]``; ``positions`` ``[B, T]`` position in document (None: rows are documents that start
        here, or continue from ``tail``); ``continues`` ``[B, T]`` bool: the token's document began before
        this call. Returns ``(y [B, T, C], new tail [B, K-1, C])``."""
        bsz, seq_len, ch = x.shape
        k = self.kernel_size
        prev = tail if tail is not None else x.new_zeros(bsz, k - 1, ch)
        xp = torch.cat([prev.to(x.dtype), x], dim=1)
        weight = self.param("weight").view(ch, k).to(x.dtype)
        keep = None
        if positions is not None:
            shifts = torch.arange(1, k, device=positions.device).view(k - 1, 1, 1)
            keep = positions[None] >= shifts
            if continues is not None and tail is not None:
                keep = keep | continues[None]
        return _ShortConvFunction.apply(xp, weight, keep), xp[:, -(k - 1):]


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(a) * b`` saving only ``a`` and ``b``: autograd of the expression also keeps ``silu(a)``, a third
    activation of the MLP's hidden width per block."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dp):
        # In the activations' dtype with ATen's fused silu backward (float32 inside each element), as autograd of
        # the expression computes it: no full-size float32 temporaries.
        a, b = ctx.saved_tensors
        return torch.ops.aten.silu_backward(dp * b, a), dp * F.silu(a)


class _SwiGLUDownFunction(torch.autograd.Function):
    """``linear(silu(a) * b, weight)`` saving ``a``, ``b`` and the weight: the product, the down projection's
    input, is recomputed in the backward instead of kept (a third activation of the hidden width per block:
    4.1 GiB at 340M, 16 x 2048 tokens). Forward and gradients are those of the two ops, bit for bit: the same
    kernels on the same operands, the weight cast to the activations' dtype as autocast casts it."""

    @staticmethod
    def forward(ctx, a, b, weight):
        ctx.save_for_backward(a, b, weight)
        return F.linear(F.silu(a) * b, weight.to(a.dtype))

    @staticmethod
    def backward(ctx, dout):
        a, b, weight = ctx.saved_tensors
        w = weight.to(a.dtype)
        silu_a = F.silu(a)
        hidden = silu_a * b
        # As autograd's linear backward: grad_weight = dout^T h over the flattened rows, grad_input = dout w.
        dweight = dout.reshape(-1, dout.shape[-1]).t().mm(hidden.reshape(-1, hidden.shape[-1]))
        dhidden = dout.matmul(w)
        return torch.ops.aten.silu_backward(dhidden * b, a), dhidden * silu_a, dweight.to(weight.dtype)


def _is_plain_linear(module: nn.Module) -> bool:
    """A bias-free ``nn.Linear`` with a plain weight and no hooks, whose forward can be folded into another op.
    Not when a parallelism or a conversion changed it: tensor parallelism (DTensor weight, module hooks),
    float8 (another class), or any forward hook."""
    return (type(module) is nn.Linear and module.bias is None and type(module.weight) in (nn.Parameter, torch.Tensor)
            and not module._forward_hooks and not module._forward_pre_hooks)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w1(x), self.w3(x)
        if _is_plain_linear(self.w2):
            return _SwiGLUDownFunction.apply(a, b, self.w2.weight)
        return self.w2(_SwiGLUFunction.apply(a, b))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=out_std)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on ``[B, T, H, D]`` at integer ``positions`` ``[B, T]``, rotating pairs (i, i + D/2).

    Angles are computed from the positions on the fly (float32), so no table bounds the length.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
