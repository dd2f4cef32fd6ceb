"""Building blocks shared by the flavours: RMSNorm, the short convolution, SwiGLU, RoPE, document helpers.

Shape legend: B batch, T tokens, C channels, H heads, D head dim. ``cu_seqlens`` always describes the
flattened ``B*T`` stream (each row starts a document), so helpers take the ``[B, T]`` shape beside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hola_titan.kernels.hola_reference import rms_norm


def identity_view(param: torch.Tensor) -> torch.Tensor:
    return param


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in at least float32, returned in the input dtype."""

    # Tensor parallelism replaces this on norms inside a head-sharded region, so that the forward reads the
    # local tensor of a distributed weight (see hola_titan.parallelisms.tensor_parallel).
    param_view = staticmethod(identity_view)

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        return rms_norm(x.to(dtype), self.param_view(self.weight).to(dtype), self.eps).to(x.dtype)

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


class ShortConvolution(nn.Module):
    """Causal depthwise convolution (kernel K) followed by SiLU, restarting at every document start.

    ``weight`` is ``[C, 1, K]`` as in ``nn.Conv1d(C, C, K, groups=C, bias=False)``. ``tail`` ``[B, K-1, C]``
    holds the K-1 inputs before the first token (decoding, chunked prefill, a context-parallel neighbour);
    it is used only by tokens whose document began before this call.
    """

    param_view = staticmethod(identity_view)  # see RMSNorm.param_view

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
        weight = self.param_view(self.weight).view(ch, k).to(x.dtype)
        y = x * weight[:, k - 1]
        for shift in range(1, k):
            term = xp[:, k - 1 - shift: k - 1 - shift + seq_len] * weight[:, k - 1 - shift]
            if positions is not None:
                keep = positions >= shift
                if continues is not None and tail is not None:
                    keep = keep | continues
                # where, not a product: a NaN in another document must not leak through 0 * NaN.
                term = torch.where(keep[..., None], term, torch.zeros((), dtype=x.dtype, device=x.device))
            y = y + term
        return F.silu(y), xp[:, -(k - 1):]


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

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
