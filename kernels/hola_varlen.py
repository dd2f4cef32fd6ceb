"""HOLA's cache read on FlashAttention's variable-length kernels: a candidate measured against the Triton kernels,
not a backend.

Shape legend: B batch, T tokens, n = B * T, H heads, D head dim, NB blocks (rows of the block table), W window,
C block.

The read of :mod:`hola_titan.kernels.hola_triton_attn` (``o = o_state + sigmoid(gate) o_cache``, ``o_cache`` the
softmax over [P_b | causal block | sink] with RMS-normalised queries and keys) as two multi-head variable-length
FlashAttention calls whose sequences are the blocks, on the tokens' own ``[n, H, D]`` layout:

1. own rows: queries and keys the block's tokens, causal (``cu_blk``, the blocks' boundaries: the blocks tile the
   tokens in order). The normalised q and k, and v itself: no gather, no transpose.
2. the cache: queries the block's tokens, keys the block's filled entries, not causal (``cu_cache``). The entries
   are gathered once into ``[NB W, H, D]`` (a quarter of a token tensor at W = 64, C = 256); the entry in slot j
   of block b may be a different token for every head (row ``cu_cache[b] + j`` holds head h's j-th filled entry).
   One sequence per block for all heads needs the same number of filled entries in every head, which the top-W
   and recency selections give (all candidates, or W of them); :func:`build_layout` checks it on the device.

The two log-sum-exps and the sink (one more logit, with no value) are joined: ``lse_all = logsumexp(lse_1, lse_2,
sink)``, ``o_cache = sum_i exp(lse_i - lse_all) o_i``. Backward: each call's FlashAttention backward given
``o_cache`` and ``lse_all`` (instead of its own output and log-sum-exp) is exactly that part's gradient of the
whole read: it recomputes its probabilities ``exp(s - lse_all)`` (the denominator with every key and the sink) and
``delta = rowsum(do o_cache)``; dq is the sum of the two, the entries' dk and dv are summed into their tokens (an
entry is read by many blocks), and the sink's gradient is ``-sum_i p_sink,i delta_i``.

Kept for backward: q, k, v (the layer keeps them anyway), ``o_cache`` (one token-sized tensor, which the Triton
kernels do not keep), ``lse_all``, the norms' reciprocal roots and the layout; the normalised copies and the
gathered entries are made again.

``glue`` runs the work around the attention as plain PyTorch or compiled (:class:`Glue`). ``core`` is the
attention to call: :class:`FlashCore` (``aten::_flash_attention_forward`` / ``_backward``, CUDA only) or
:class:`DenseCore` (the same contract in PyTorch, padded and masked: the reference the candidate is tested against
on a CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hola_titan.kernels.hola_reference import rms_norm_backward
from hola_titan.kernels.hola_triton_select import BlockTable

NORM_EPS = 1e-6


@dataclass(frozen=True)
class VarlenLayout:
    """The blocks as FlashAttention sequences (see the module docstring); depends on the block table and on which
    cache slots are filled, i.e. once per selection."""

    cu_blk: torch.Tensor  # [NB + 1] int32: the blocks' token boundaries
    cu_cache: torch.Tensor  # [NB + 1] int32: the blocks' rows of the gathered entries
    cache_src: torch.Tensor  # [NB W, H] int64: flat row (token * H + head) of every entry; n H (a zero row) unused
    block: int
    window: int
    num_tokens: int
    num_heads: int


def build_layout(table: BlockTable, sel: torch.Tensor, num_tokens: int, *, window: int) -> VarlenLayout:
    """The layout for the blocks of ``table`` (which tile the ``num_tokens`` tokens in order) and the selection
    ``sel`` ``[NB, H, W]`` (flat token indices, negative empty; the same number filled in every head)."""
    device = sel.device
    nb, h = sel.shape[0], sel.shape[1]
    n = num_tokens
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    blk_len = table.blk_len.long()
    cu_blk = torch.cat([zero, torch.cumsum(blk_len, 0)])
    # Device-side checks (no synchronisation; on CUDA a failure ends the process with this message).
    torch._assert_async(((blk_len == 0) | (cu_blk[:-1] == table.blk_start.long())).all() & (cu_blk[-1] == n),
                        "hola_varlen: the blocks must tile the tokens in order")
    valid = sel >= 0  # [NB, H, W]
    filled = valid.sum(-1)  # [NB, H]
    if h > 1:
        torch._assert_async((filled == filled[:, :1]).all(),
                            "hola_varlen: a block's heads have different numbers of filled cache slots")
    cu_cache = torch.cat([zero, torch.cumsum(filled[:, 0], 0)])
    cache_src = torch.full((nb * window, h), n * h, dtype=torch.int64, device=device)
    if window:
        # Head h's filled slot w of block b goes to row cu_cache[b] + (its rank among the head's filled slots).
        rank = torch.cumsum(valid.long(), -1) - 1
        row = cu_cache[:-1, None, None] + rank
        heads = torch.arange(h, device=device)[None, :, None].expand_as(rank)
        src = sel.long() * h + heads
        cache_src.index_put_((row[valid], heads[valid]), src[valid])
    return VarlenLayout(cu_blk=cu_blk.to(torch.int32), cu_cache=cu_cache.to(torch.int32), cache_src=cache_src,
                        block=table.block, window=window, num_tokens=n, num_heads=h)


def _cdt(x: torch.Tensor) -> torch.dtype:
    """Float32, or float64 for float64 inputs (the tests' references)."""
    return torch.promote_types(x.dtype, torch.float32)


class FlashCore:
    """Multi-head variable-length FlashAttention through PyTorch's aten ops (CUDA). ``forward`` returns
    ``(o, lse [H, total_q] float32, state)``, a query with no keys giving o = 0 and lse = +inf (FlashAttention's
    convention); ``backward`` takes the output and log-sum-exp it is given (not necessarily its own)."""

    name = "aten::_flash_attention_forward"

    def forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"FlashAttention's variable-length log-sum-exp has shape {tuple(lse.shape)}; this "
                               f"candidate reads [heads={q.shape[1]}, total_q={q.shape[0]}]")
        return out, lse, (rng, unused)

    def backward(self, do, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                 state):
        rng, unused = state
        return torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse.contiguous(), cu_q, cu_k, max_q, max_k,
                                                        0.0, causal, rng, unused, scale=scale)


class DenseCore:
    """:class:`FlashCore`'s contract in PyTorch: every sequence padded to ``max_q x max_k`` and masked (causal
    aligned to the bottom right: query i of Lq sees keys up to i + Lk - Lq), in float32 (float64 for float64
    inputs). The reference the candidate is tested against where FlashAttention does not run."""

    name = "dense reference"

    @staticmethod
    def _pad(cu_q, cu_k, max_q, max_k, q_rows, k_rows, causal):
        device = cu_q.device
        cu_q, cu_k = cu_q.long(), cu_k.long()
        len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        iq, ik = torch.arange(max_q, device=device), torch.arange(max_k, device=device)
        q_ok, k_ok = iq[None, :] < len_q[:, None], ik[None, :] < len_k[:, None]
        q_idx = torch.where(q_ok, cu_q[:-1, None] + iq[None, :], q_rows)  # q_rows: a zero row appended
        k_idx = torch.where(k_ok, cu_k[:-1, None] + ik[None, :], k_rows)
        allowed = k_ok[:, None, :] & q_ok[:, :, None]
        if causal:
            allowed &= ik[None, None, :] <= iq[None, :, None] + (len_k - len_q)[:, None, None]
        return q_idx, k_idx, allowed[:, None]  # [S, 1, Lq, Lk]: the same for every head

    @staticmethod
    def _rows(x, idx):  # x [rows, H, D] -> [S, H, L, D]
        cdt = _cdt(x)
        xz = torch.cat([x.to(cdt), x.new_zeros(1, *x.shape[1:]).to(cdt)])
        return xz[idx].transpose(1, 2)

    def _probs(self, q, k, cu_q, cu_k, max_q, max_k, causal, scale, lse=None):
        q_idx, k_idx, allowed = self._pad(cu_q, cu_k, max_q, max_k, q.shape[0], k.shape[0], causal)
        qs, ks = self._rows(q, q_idx), self._rows(k, k_idx)
        logits = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        if lse is None:
            lse_p = torch.logsumexp(logits, -1)
            lse_p = torch.where(allowed.any(-1), lse_p, float("inf"))  # no keys: +inf, as FlashAttention
        else:
            lse_p = torch.cat([lse.t(), lse.new_zeros(1, lse.shape[0])])[q_idx].transpose(1, 2)
        p = torch.exp(logits - lse_p[..., None]).masked_fill(~allowed, 0.0)
        return p, lse_p, qs, ks, q_idx, k_idx

    @staticmethod
    def _scatter(x, idx, rows):  # x [S, H, L, D] -> [rows, H, D]
        """Rows no sequence owns are NaN: FlashAttention leaves them unwritten, so a caller must never read them."""
        acc = x.new_zeros(rows + 1, x.shape[1], x.shape[-1])
        acc.index_add_(0, idx.reshape(-1), x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]))
        owned = torch.zeros(rows + 1, dtype=torch.bool, device=x.device).index_fill_(0, idx.reshape(-1), True)
        return acc[:-1].masked_fill(~owned[:-1, None, None], float("nan"))

    def forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        p, lse_p, _, _, q_idx, k_idx = self._probs(q, k, cu_q, cu_k, max_q, max_k, causal, scale)
        o = p @ self._rows(v, k_idx)
        lse = lse_p.new_full((q.shape[0] + 1, q.shape[1]), float("nan"))  # rows no sequence owns: NaN
        lse.index_copy_(0, q_idx.reshape(-1), lse_p.transpose(1, 2).reshape(-1, q.shape[1]))
        return self._scatter(o, q_idx, q.shape[0]).to(q.dtype), lse[:-1].t().contiguous(), None

    def backward(self, do, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                 state):
        p, _, qs, ks, q_idx, k_idx = self._probs(q, k, cu_q, cu_k, max_q, max_k, causal, scale, lse)
        dos, outs, vs = self._rows(do, q_idx), self._rows(out, q_idx), self._rows(v, k_idx)
        ds = p * (dos @ vs.transpose(-1, -2) - (dos * outs).sum(-1, keepdim=True))
        dq, dk, dv = ds @ ks * scale, ds.transpose(-1, -2) @ qs * scale, p.transpose(-1, -2) @ dos
        return (self._scatter(dq, q_idx, q.shape[0]).to(q.dtype), self._scatter(dk, k_idx, k.shape[0]).to(k.dtype),
                self._scatter(dv, k_idx, v.shape[0]).to(v.dtype))


class _VarlenRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, o_state, gamma_q, gamma_k, sink, gate, layout, core, glue):
        lay = layout
        scale = 1.0 / math.sqrt(q.shape[-1])
        qn, kn, kc, vc, rq, rk = glue.prologue(q, k, v, gamma_q, gamma_k, lay.cache_src)
        b_t = (lay.cu_blk, lay.cu_blk, lay.block, lay.block, True, scale)
        parts = [core.forward(qn, kn, v.reshape(qn.shape), *b_t)]
        if lay.window:
            parts.append(core.forward(qn, kc, vc, lay.cu_blk, lay.cu_cache, lay.block, lay.window, False, scale))
        o, o_cache, lse_all = glue.epilogue([p[0] for p in parts], [p[1] for p in parts], o_state, sink, gate)
        ctx.save_for_backward(q, k, v, gamma_q, gamma_k, sink, gate, o_cache, lse_all, rq, rk)
        ctx.layout, ctx.core, ctx.glue, ctx.scale = layout, core, glue, scale
        ctx.states = [p[2] for p in parts]
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, gamma_q, gamma_k, sink, gate, o_cache, lse_all, rq, rk = ctx.saved_tensors
        lay, core, glue, scale = ctx.layout, ctx.core, ctx.glue, ctx.scale
        do_c, dgate, dsink = glue.grad_in(do, o_cache, lse_all, sink, gate)
        qn, kn, kc, vc = glue.gather(q, k, v, gamma_q, gamma_k, rq, rk, lay.cache_src)
        vt = v.reshape(qn.shape)
        dq, dk, dv = core.backward(do_c, qn, kn, vt, o_cache, lse_all, lay.cu_blk, lay.cu_blk, lay.block, lay.block,
                                   True, scale, ctx.states[0])
        dq2 = dkc = dvc = None
        if lay.window:
            dq2, dkc, dvc = core.backward(do_c, qn, kc, vc, o_cache, lse_all, lay.cu_blk, lay.cu_cache, lay.block,
                                          lay.window, False, scale, ctx.states[1])
        dq, dk, dv, dgq, dgk = glue.grad_out(dq, dq2, dk, dv, dkc, dvc, q, k, gamma_q, gamma_k, rq, rk,
                                             lay.cache_src)
        return dq, dk, dv, do, dgq, dgk, dsink.to(sink.dtype), dgate.to(gate.dtype), None, None, None


def _rstd(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H]`` reciprocal RMS of x's rows, in the compute dtype."""
    xf = x.to(_cdt(x))
    return torch.rsqrt(xf.pow(2).mean(-1) + NORM_EPS)


def _gather(q, k, v, gamma_q, gamma_k, rq, rk, cache_src):
    """``(qn, kn [n, H, D], kc, vc [NB W, H, D])``: the normalised queries (both gammas on the query side: the score
    is the same) and keys, the gathered entries' normalised keys and values."""
    bsz, seq_len, h, d = q.shape
    n = bsz * seq_len
    cdt = _cdt(q)
    qn = (q.to(cdt) * rq[..., None] * (gamma_q.to(cdt) * gamma_k.to(cdt))).to(q.dtype).reshape(n, h, d)
    kn = (k.to(cdt) * rk[..., None]).to(k.dtype).reshape(n, h, d)

    def entries(x):
        flat = torch.cat([x.reshape(n * h, d), x.new_zeros(1, d)])
        return flat[cache_src]
    return qn, kn, entries(kn), entries(v)


def _prologue(q, k, v, gamma_q, gamma_k, cache_src):
    rq, rk = _rstd(q), _rstd(k)
    return (*_gather(q, k, v, gamma_q, gamma_k, rq, rk, cache_src), rq, rk)


def _epilogue(outs, lses, o_state, sink, gate):
    """``(o [B, T, H, D], o_cache [n, H, D], lse_all [H, n])``: the parts and the sink joined by their log-sum-exps,
    the gate, the state path's output added."""
    bsz, seq_len, h, d = o_state.shape
    n = bsz * seq_len
    cdt = _cdt(outs[0])
    # A part with no keys for a query reports lse = +inf (and o = 0): it takes no weight.
    lses = [torch.where(torch.isposinf(lse), float("-inf"), lse).to(cdt) for lse in lses]
    lse_all = torch.logsumexp(torch.stack([*lses, sink.to(cdt)[:, None].expand(h, n)]), 0)
    o_cache = sum(o.to(cdt) * torch.exp(lse - lse_all).t()[..., None] for o, lse in zip(outs, lses))
    o_cache = o_cache.to(outs[0].dtype)
    o_tok = o_cache.reshape(bsz, seq_len, h, d)
    o = (o_state.to(cdt) + torch.sigmoid(gate.to(cdt))[:, None] * o_tok.to(cdt)).to(o_state.dtype)
    return o, o_cache, lse_all


def _grad_in(do, o_cache, lse_all, sink, gate):
    """``(d o_cache [n, H, D], dgate, dsink)`` from the output's gradient."""
    cdt = _cdt(do)
    h, d = do.shape[2], do.shape[3]
    sig = torch.sigmoid(gate.to(cdt))
    do_f = do.to(cdt).reshape(-1, h, d)
    oc = o_cache.to(cdt)
    dgate = (do_f * oc).sum((0, 2)) * sig * (1 - sig)
    do_c = (do_f * sig[:, None]).to(o_cache.dtype)
    # The sink's probability times delta = rowsum(d o_cache * o_cache), summed over each head's rows.
    delta = (do_c.to(cdt) * oc).sum(-1)  # [n, H]
    p_sink = torch.exp(sink.to(cdt)[:, None] - lse_all).t()
    dsink = -(p_sink * delta).sum(0)
    return do_c, dgate, dsink


def _grad_out(dqn, dqn2, dkn, dv, dkc, dvc, q, k, gamma_q, gamma_k, rq, rk, cache_src):
    """``(dq, dk, dv, dgamma_q, dgamma_k)``: the two calls' dq summed, the entries' gradients summed into their
    tokens (an entry is read by many blocks), in the compute dtype, then the norms' backward."""
    shape, (n, h, d) = q.shape, dkn.shape
    cdt = _cdt(q)
    dqn = dqn.to(cdt) if dqn2 is None else dqn.to(cdt) + dqn2.to(cdt)
    dv_dtype = dv.dtype
    dkn, dv = dkn.to(cdt).reshape(n * h, d), dv.to(cdt).reshape(n * h, d)
    if dkc is not None:
        # Rows past the last block's entries (whatever the core left there) go to the dropped zero row.
        src = cache_src.reshape(-1)
        dkn = torch.cat([dkn, dkn.new_zeros(1, d)]).index_add(0, src, dkc.reshape(-1, d).to(cdt))[:-1]
        dv = torch.cat([dv, dv.new_zeros(1, d)]).index_add(0, src, dvc.reshape(-1, d).to(cdt))[:-1]
    gq, gk = gamma_q.to(cdt), gamma_k.to(cdt)
    dq, dgamma = rms_norm_backward(q, rq[..., None], gq * gk, dqn.reshape(shape))
    dk, _ = rms_norm_backward(k, rk[..., None], torch.ones_like(gk), dkn.reshape(shape))
    return (dq.to(q.dtype), dk.to(k.dtype), dv.reshape(shape).to(dv_dtype), (dgamma * gk).to(gamma_q.dtype),
            (dgamma * gq).to(gamma_k.dtype))


class Glue:
    """The candidate's work around the attention core (norms, gathers, the sink and gate, the scatters and the
    norms' backward), as plain PyTorch (``compiled=False``), or each piece compiled whole (``fullgraph``, static
    shapes) by ``backend`` on first use: Inductor fuses each into a few kernels."""

    PIECES = ("prologue", "epilogue", "grad_in", "gather", "grad_out")

    def __init__(self, compiled: bool, backend: str = "inductor"):
        self.compiled, self.backend = compiled, backend
        for name in self.PIECES:
            fn = globals()["_" + name]
            setattr(self, name, torch.compile(fn, fullgraph=True, dynamic=False, backend=backend) if compiled else fn)

    def __repr__(self) -> str:
        return f"Glue(compiled={self.compiled}, backend={self.backend!r})"


def cache_read_varlen(q, k, v, o_state, gamma_q, gamma_k, sink, gate, layout: VarlenLayout, *, core=None,
                      glue: Glue | None = None):
    """``o`` ``[B, T, H, D]``: the cache read of the selection ``layout`` was built from, on ``core``
    (:class:`FlashCore` when None), the work around it by ``glue`` (plain PyTorch when None)."""
    if q.shape[0] * q.shape[1] != layout.num_tokens or q.shape[2] != layout.num_heads:
        raise ValueError(f"layout built for {layout.num_tokens} tokens x {layout.num_heads} heads, inputs "
                         f"{tuple(q.shape)}")
    return _VarlenRead.apply(q, k, v, o_state, gamma_q, gamma_k, sink, gate, layout, core or FlashCore(),
                             glue or Glue(compiled=False))
