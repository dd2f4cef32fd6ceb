"""The GDN state path in pure PyTorch: the reference that fla-core's chunk kernels (:mod:`fla_bridge`) and the
HOLA reference (:mod:`hola_titan.kernels.hola.reference`) build on (DESIGN §1-2).

Shape legend: B batch, T tokens, H heads, D head dim, N sequences (B, or documents with ``cu_seqlens``),
L longest sequence.

Layout. Every sequence (a batch row, or a document of a packed row) becomes one row of a padded
[N, L] layout (:func:`sequence_layout`, :func:`to_rows`), so that the state restarts at every document start
without masks; padded steps have ``g = 0`` and ``beta = 0`` and leave the state unchanged.

State path (GDN), chunked WY form. Within a chunk with cumulative log-decay ``G_t`` and entry state ``S``:
    e_t = v_t - exp(G_t) k_t S - sum_{s<t} exp(G_t - G_s) beta_s (k_t . k_s) e_s
i.e. ``(I + A) E = V - exp(G) K S`` with ``A`` strictly lower triangular, solved once per chunk for ``U``
(the ``V`` part) and ``W`` (the ``K S`` part), so that ``E = U - W S`` needs only the entry state;
    o_t = scale * (exp(G_t) q_t S + sum_{s<=t} exp(G_t - G_s) beta_s (q_t . k_s) e_s)
    S'  = exp(G_last) S + sum_s exp(G_last - G_s) beta_s k_s^T e_s
HOLA's surprise score is ``m_t = beta_t * ||e_t||`` (detached), made from ``e``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NORM_EPS = 1e-6
STATE_CHUNK = 64


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension (DESIGN §2)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + NORM_EPS)


def sequence_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device):
    """Map tokens to the padded [N, L] layout.

    Returns ``(index [N, L], lengths [N])``: ``index[n, i]`` is the flat (B*T) token index of token i of
    sequence n, or ``B*T`` (a padding slot) past its end.
    """
    if cu_seqlens is None:
        index = torch.arange(batch * seq_len, device=device).view(batch, seq_len)
        return index, torch.full((batch,), seq_len, dtype=torch.int64, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    longest = int(lengths.max().item()) if lengths.numel() else 0
    offs = torch.arange(longest, device=device)
    index = cu[:-1, None] + offs[None, :]
    index = torch.where(offs[None, :] < lengths[:, None], index, torch.full_like(index, batch * seq_len))
    return index, lengths


def to_rows(x_flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather [E, ...] entries (the last one a zero padding slot) into rows [N, L, ...]."""
    return x_flat[index.reshape(-1)].view(*index.shape, *x_flat.shape[1:])


def gated_delta_chunked(qh: torch.Tensor, kh: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, scale: float, chunk: int = STATE_CHUNK, with_output: bool = True):
    """The GDN state path on rows: qh, kh, v [N, L, H, D]; g, beta [N, L, H]; state [N, H, D, D].

    Returns ``(o [N, L, H, D] without the cache, e [N, L, H, D], final state [N, H, D, D])``; with
    ``with_output=False`` (context parallelism's summaries need only e and the state) ``o`` is None and its
    per-chunk work is skipped.
    """
    n, length, h, d = qh.shape
    c = max(1, min(chunk, length))
    nc = -(-length // c)
    pad = nc * c - length
    if pad:
        qh, kh, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qh, kh, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))

    def chunks(x):  # [N, L, H, ...] -> [N, H, nc, c, ...]
        return x.view(n, nc, c, h, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    qh, kh, v, g, beta = map(chunks, (qh, kh, v, g, beta))
    cum = g.cumsum(-1)
    idx = torch.arange(c, device=qh.device)
    causal = idx[:, None] >= idx[None, :]
    # Mask before exp: above the diagonal G_t - G_s > 0 and could overflow.
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))
    decay_beta = decay * beta[..., None, :]
    a = ((kh @ kh.transpose(-1, -2)) * decay_beta).tril(-1)
    tmat = a + torch.eye(c, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(tmat, v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(tmat, kh * cum.exp()[..., None], upper=False, unitriangular=True)
    if with_output:
        qk = (qh @ kh.transpose(-1, -2)) * decay_beta
        q_decayed = qh * cum.exp()[..., None]
    k_to_end = kh * (torch.exp(cum[..., -1:] - cum) * beta)[..., None]
    end_decay = cum[..., -1].exp()[..., None, None]
    outs, errs = [], []
    for i in range(nc):
        e = u[:, :, i] - w[:, :, i] @ state
        if with_output:
            outs.append(q_decayed[:, :, i] @ state + qk[:, :, i] @ e)
        errs.append(e)
        state = end_decay[:, :, i] * state + k_to_end[:, :, i].transpose(-1, -2) @ e
    e = torch.stack(errs, 2)

    def unchunk(x):  # [N, H, nc, c, D] -> [N, L, H, D]
        return x.transpose(2, 3).transpose(1, 3).reshape(n, nc * c, h, d)[:, :length]

    o = unchunk(torch.stack(outs, 2) * scale) if with_output else None
    return o, unchunk(e), state
