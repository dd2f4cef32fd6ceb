"""HOLA's cache read on FlashAttention's variable-length kernels: a candidate measured against the Triton kernels,
not a backend.

Shape legend: B batch, T tokens, n = B * T, H heads, D head dim, NB blocks (rows of the block table), W window,
C block, S = H * NB sequences.

The read of :mod:`hola_titan.kernels.hola_triton_attn` (``o = o_state + sigmoid(gate) o_cache``, ``o_cache`` the
softmax over [P_b | causal block | sink] with RMS-normalised queries and keys) is, for every (head, block), one
short attention: the block's queries against the block's filled cache entries followed by the block's own tokens,
causal with the mask aligned to the bottom right (query i of a block with f filled entries sees keys 0 ... f + i).
Every (head, block) becomes one sequence of a single-head variable-length FlashAttention call:

- queries: the normalised q transposed to ``[H, n, D]``; the blocks tile the tokens in order, so sequence
  ``s = h * NB + b`` is the contiguous run of head h's rows of block b (``cu_q``);
- keys and values: gathered once into a buffer of ``H (NB W + n)`` rows, sequence s holding its f_s filled entries
  (compacted) and then its block's rows (``cu_k``); the buffer's tail past ``cu_k[S]`` is never read. Built on
  the device with no host synchronisation (the sizes are bounds known from shapes).

FlashAttention returns the keys' log-sum-exp; the sink is one more logit with no value, so
``lse_all = logaddexp(lse, sink)``, ``o_cache = o_attn exp(lse - lse_all)``. Backward: FlashAttention's backward
given ``o_cache`` and ``lse_all`` (instead of its own output and lse) is exactly the gradient of the read with the
sink: it recomputes ``p = exp(s - lse_all)``, the probabilities with the sink in the denominator, and
``delta = rowsum(do o_cache)``; the sink's gradient is ``-sum_i p_sink,i delta_i``. The key and value gradients
come back per sequence and are summed into the tokens (an entry is read by many blocks).

What it keeps for backward: q, k, v (the layer keeps them anyway), ``o_cache`` in the sequence layout (one
token-sized tensor, which the Triton kernels do not keep), ``lse_all`` and the index tensors; the normalised and
gathered copies are made again in backward.

``core`` is the attention to call: :class:`FlashCore` (``aten::_flash_attention_forward`` / ``_backward``, CUDA
only) or :class:`DenseCore` (the same contract in PyTorch, padded and masked: the reference the candidate is tested
against on a CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hola_titan.kernels.hola_triton_select import BlockTable

NORM_EPS = 1e-6


@dataclass(frozen=True)
class VarlenLayout:
    """Where every (head, block) sequence's queries and keys are (see the module docstring); depends on the block
    table and on which cache slots are filled, i.e. once per selection."""

    cu_q: torch.Tensor  # [S + 1] int32: head-major query rows ([H, n] flattened)
    cu_k: torch.Tensor  # [S + 1] int32: rows of the key buffer
    k_src: torch.Tensor  # [H (NB W + n)] int64: flat (token * H + head) row of every key-buffer row; n H = zero row
    max_q: int  # C
    max_k: int  # W + C
    num_tokens: int
    num_heads: int


def build_layout(table: BlockTable, sel: torch.Tensor, num_tokens: int, *, window: int) -> VarlenLayout:
    """The layout for the blocks of ``table`` (which tile the ``num_tokens`` tokens in order) and the selection
    ``sel`` ``[NB, H, W]`` (flat token indices, negative empty)."""
    device = sel.device
    nb, h = sel.shape[0], sel.shape[1]
    n = num_tokens
    blk_start = table.blk_start.long()
    blk_len = table.blk_len.long()
    valid = sel >= 0  # [NB, H, W]
    filled = valid.sum(-1).t().reshape(-1)  # [S], s = head * NB + block
    len_q = blk_len.repeat(h)  # [S]
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    cu_q = torch.cat([zero, torch.cumsum(len_q, 0)])
    cu_k = torch.cat([zero, torch.cumsum(filled + len_q, 0)])
    capacity = h * (nb * window + n)
    k_src = torch.full((capacity,), n * h, dtype=torch.int64, device=device)
    heads = torch.arange(h, device=device)
    if window:
        # Filled slot w of (b, head) goes to the sequence's start + its rank among the filled slots.
        rank = torch.cumsum(valid.long(), -1) - 1  # [NB, H, W]
        seq = heads[None, :, None] * nb + torch.arange(nb, device=device)[:, None, None]  # [NB, H, 1]
        dest = cu_k[:-1][seq] + rank
        src = sel.long() * h + heads[None, :, None]
        k_src.scatter_(0, dest[valid], src[valid])
    # Token t of block b, head: after the sequence's filled entries.
    tok = torch.arange(n, device=device)
    tok_blk = torch.repeat_interleave(torch.arange(nb, device=device), blk_len, output_size=n)
    seq_t = heads[:, None] * nb + tok_blk[None, :]  # [H, n]
    dest_t = cu_k[:-1][seq_t] + filled[seq_t] + (tok - blk_start[tok_blk])[None, :]
    k_src.scatter_(0, dest_t.reshape(-1), (tok[None, :] * h + heads[:, None]).reshape(-1))
    return VarlenLayout(cu_q=cu_q.to(torch.int32), cu_k=cu_k.to(torch.int32), k_src=k_src, max_q=table.block,
                        max_k=window + table.block, num_tokens=n, num_heads=h)


def _rms(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    cdt = _cdt(x)
    xf = x.to(cdt)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * gamma.to(cdt)).to(x.dtype)


def _cdt(x: torch.Tensor) -> torch.dtype:
    """Float32, or float64 for float64 inputs (the tests' references)."""
    return torch.promote_types(x.dtype, torch.float32)


class FlashCore:
    """Single-head variable-length FlashAttention through PyTorch's aten ops (CUDA), causal aligned to the bottom
    right of every sequence. ``forward`` returns ``(o, lse [total_q] float32, state)``; ``backward`` takes the
    output and log-sum-exp it is given (not necessarily its own)."""

    name = "aten::_flash_attention_forward"

    def forward(self, q, k, v, layout: VarlenLayout, scale: float):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, 0.0, True, False, scale=scale)
        total = q.shape[0]
        if lse.shape == (1, total):
            lse = lse[0]
        else:
            raise RuntimeError(f"FlashAttention's variable-length log-sum-exp has shape {tuple(lse.shape)}; this "
                               f"candidate reads [heads=1, total_q={total}]")
        return out, lse, (rng, unused)

    def backward(self, do, q, k, v, out, lse, layout: VarlenLayout, scale: float, state):
        rng, unused = state
        return torch.ops.aten._flash_attention_backward(
            do, q, k, v, out, lse[None].contiguous(), layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, 0.0,
            True, rng, unused, scale=scale)


class DenseCore:
    """:class:`FlashCore`'s contract in PyTorch: every sequence padded to ``max_q x max_k`` and masked, in float32
    (float64 for float64 inputs).
    The reference the candidate is tested against where FlashAttention does not run."""

    name = "dense reference"

    @staticmethod
    def _pad(layout: VarlenLayout, q_rows: int, k_rows: int):
        device = layout.cu_q.device
        cu_q, cu_k = layout.cu_q.long(), layout.cu_k.long()
        len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        iq = torch.arange(layout.max_q, device=device)
        ik = torch.arange(layout.max_k, device=device)
        q_ok = iq[None, :] < len_q[:, None]
        k_ok = ik[None, :] < len_k[:, None]
        q_idx = torch.where(q_ok, cu_q[:-1, None] + iq[None, :], q_rows)  # q_rows: a zero row appended
        k_idx = torch.where(k_ok, cu_k[:-1, None] + ik[None, :], k_rows)
        # Bottom-right causal: query i sees key j when j <= i + len_k - len_q.
        allowed = (ik[None, None, :] <= iq[None, :, None] + (len_k - len_q)[:, None, None]) & k_ok[:, None, :]
        return q_idx, k_idx, allowed & q_ok[:, :, None]

    @staticmethod
    def _rows(x, idx):
        cdt = torch.promote_types(x.dtype, torch.float32)
        xz = torch.cat([x.to(cdt), x.new_zeros(1, *x.shape[1:]).to(cdt)])
        return xz[idx][:, :, 0]  # [S, L, D]

    def _probs(self, q, k, layout, scale, lse=None):
        q_idx, k_idx, allowed = self._pad(layout, q.shape[0], k.shape[0])
        qs, ks = self._rows(q, q_idx), self._rows(k, k_idx)
        logits = (qs @ ks.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
        if lse is None:
            lse_p = torch.logsumexp(logits, -1)
        else:
            lse_p = torch.cat([lse, lse.new_zeros(1)])[q_idx]
        p = torch.exp(logits - lse_p[..., None]).masked_fill(~allowed, 0.0)
        return p, lse_p, qs, ks, q_idx, k_idx

    def forward(self, q, k, v, layout: VarlenLayout, scale: float):
        p, lse_p, _, _, q_idx, k_idx = self._probs(q, k, layout, scale)
        o = p @ self._rows(v, k_idx)
        out = o.new_zeros(q.shape[0] + 1, q.shape[-1])
        lse = o.new_zeros(q.shape[0] + 1)
        out[q_idx.reshape(-1)] = o.reshape(-1, o.shape[-1])
        lse[q_idx.reshape(-1)] = lse_p.reshape(-1)
        return out[:-1, None].to(q.dtype), lse[:-1].to(torch.promote_types(q.dtype, torch.float32)), None

    def backward(self, do, q, k, v, out, lse, layout: VarlenLayout, scale: float, state):
        p, _, qs, ks, q_idx, k_idx = self._probs(q, k, layout, scale, lse)
        dos, outs, vs = self._rows(do, q_idx), self._rows(out, q_idx), self._rows(v, k_idx)
        ds = p * (dos @ vs.transpose(1, 2) - (dos * outs).sum(-1, keepdim=True))
        dq_s, dk_s, dv_s = ds @ ks * scale, ds.transpose(1, 2) @ qs * scale, p.transpose(1, 2) @ dos

        def scatter(x, idx, rows):
            acc = x.new_zeros(rows + 1, x.shape[-1])
            acc.index_add_(0, idx.reshape(-1), x.reshape(-1, x.shape[-1]))
            return acc[:-1, None]
        return (scatter(dq_s, q_idx, q.shape[0]).to(q.dtype), scatter(dk_s, k_idx, k.shape[0]).to(k.dtype),
                scatter(dv_s, k_idx, v.shape[0]).to(v.dtype))


class _VarlenRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, o_state, gamma_q, gamma_k, sink, gate, layout, core):
        bsz, seq_len, h, d = q.shape
        n = bsz * seq_len
        scale = 1.0 / math.sqrt(d)
        cdt = _cdt(q)
        qs, ks, vs = _sequences(q, k, v, gamma_q, gamma_k, layout)
        o_attn, lse, state = core.forward(qs, ks, vs, layout, scale)
        sink_rows = sink.to(cdt).repeat_interleave(n)  # [H n], head-major like the rows
        lse_all = torch.logaddexp(lse, sink_rows)
        o_cache = (o_attn[:, 0].to(cdt) * torch.exp(lse - lse_all)[:, None]).to(q.dtype)  # [H n, D]
        o_tok = o_cache.view(h, n, d).transpose(0, 1).reshape(bsz, seq_len, h, d)
        o = (o_state.to(cdt) + torch.sigmoid(gate.to(cdt))[:, None] * o_tok.to(cdt)).to(q.dtype)
        ctx.save_for_backward(q, k, v, gamma_q, gamma_k, sink, gate, o_cache, lse_all)
        ctx.layout, ctx.core, ctx.state, ctx.scale = layout, core, state, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, gamma_q, gamma_k, sink, gate, o_cache, lse_all = ctx.saved_tensors
        layout, core = ctx.layout, ctx.core
        bsz, seq_len, h, d = q.shape
        n = bsz * seq_len
        cdt = _cdt(q)
        sig = torch.sigmoid(gate.to(cdt))
        do_f = do.to(cdt)
        o_tok = o_cache.view(h, n, d).transpose(0, 1).reshape(bsz, seq_len, h, d).to(cdt)
        dgate = (do_f * o_tok).sum((0, 1, 3)) * sig * (1 - sig)
        # The cache output's gradient, in the sequence layout.
        do_c = (do_f * sig[:, None]).to(q.dtype).reshape(n, h, d).transpose(0, 1).reshape(h * n, 1, d)
        # The norms again, this time recording their graph: their backward is autograd's.
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, gamma_q, gamma_k)]
            qn, kn = _normalised(*leaves)
        qs, ks, vs = _gather(qn.detach(), kn.detach(), v, layout)
        dqs, dks, dvs = core.backward(do_c.contiguous(), qs, ks, vs, o_cache[:, None], lse_all, layout, ctx.scale,
                                      ctx.state)
        # p of the sink times delta, summed over each head's rows.
        delta = (do_c[:, 0].to(cdt) * o_cache.to(cdt)).sum(-1)
        p_sink = torch.exp(sink.to(cdt).repeat_interleave(n) - lse_all)
        dsink = -(p_sink * delta).view(h, n).sum(1)
        dqn = dqs[:, 0].view(h, n, d).transpose(0, 1).reshape(bsz, seq_len, h, d)
        dkn = _to_tokens(dks, layout, n, h, d).reshape(bsz, seq_len, h, d)
        dv = _to_tokens(dvs, layout, n, h, d).reshape(bsz, seq_len, h, d).to(v.dtype)
        dq, dk, dgq, dgk = torch.autograd.grad([qn, kn], leaves, [dqn.to(qn.dtype), dkn.to(kn.dtype)])
        return (dq, dk, dv, do, dgq, dgk, dsink.to(sink.dtype), dgate.to(gate.dtype), None, None)


def _normalised(q, k, gamma_q, gamma_k):
    """RMS-normalised q and k with both gammas on the query side (the score is the same)."""
    return _rms(q, gamma_q * gamma_k), _rms(k, torch.ones_like(gamma_k))


def _gather(qn, kn, v, layout: VarlenLayout):
    n, h = layout.num_tokens, layout.num_heads
    d = qn.shape[-1]
    qs = qn.reshape(n, h, d).transpose(0, 1).reshape(h * n, 1, d)

    def keys(x):
        flat = torch.cat([x.reshape(n * h, d), x.new_zeros(1, d)])
        return flat[layout.k_src][:, None]
    return qs, keys(kn), keys(v)


def _sequences(q, k, v, gamma_q, gamma_k, layout):
    qn, kn = _normalised(q, k, gamma_q, gamma_k)
    return _gather(qn, kn, v, layout)


def _to_tokens(x_seq, layout: VarlenLayout, n: int, h: int, d: int) -> torch.Tensor:
    """Sum the key buffer's rows into their tokens: ``[n, H, D]`` in float32 or float64 (rows past the last
    sequence, whatever the core left there, go to the dropped zero row)."""
    acc = torch.zeros(n * h + 1, d, dtype=_cdt(x_seq), device=x_seq.device)
    acc.index_add_(0, layout.k_src, x_seq[:, 0].to(acc.dtype))
    return acc[:-1].view(n, h, d)


def cache_read_varlen(q, k, v, o_state, gamma_q, gamma_k, sink, gate, layout: VarlenLayout, *, core=None):
    """``o`` ``[B, T, H, D]``: the cache read of the selection ``layout`` was built from, on ``core``
    (:class:`FlashCore` when None)."""
    if q.shape[0] * q.shape[1] != layout.num_tokens or q.shape[2] != layout.num_heads:
        raise ValueError(f"layout built for {layout.num_tokens} tokens x {layout.num_heads} heads, inputs "
                         f"{tuple(q.shape)}")
    return _VarlenRead.apply(q, k, v, o_state, gamma_q, gamma_k, sink, gate, layout, core or FlashCore())
