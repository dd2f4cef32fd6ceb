"""Triton cache attention of HOLA: forward and backward of the read over [P_b | causal block | sink].

Shape legend: B batch, T tokens, H heads, D head dim, NB blocks, W window, C block, E = NB * H * W cache slots.
Token tensors are ``[B, T, H, D]`` contiguous and addressed as rows ``[B * T * H, D]`` (row = token * H + head);
blocks and selections follow :mod:`hola_titan.kernels.hola_triton_select`.

Math per query t of block b, head h (``s = D^-1/2``; ``r_x = rsqrt(mean(x^2) + eps)``):
    qc = q r_q gamma_q,  kc = k r_k gamma_k,  logit_tj = s qc_t . kc_j,  j in P_b u {b*C <= j <= t}
    o_cache_t = sum_j softmax_j(logits, sink_h) v_j,   o_t = o_state_t + sigmoid(gate_h) o_cache_t
The RMSNorms are fused: r_q and r_k are computed once per token (a [B*T, H] float32 pass), and
``logit_tj = (q_t r_q_t gamma_q gamma_k s) . k_j  r_k_j``, so key tiles are read raw and never normalised inside
the loops (the query side carries both gammas). The softmax runs in float32 base 2 from the sink
(``m = sink, l = 1``), and saves the log-sum-exp per query.

Backward (FlashAttention-2 style, without the cache output): ``delta_t = lambda <do_t, o_cache_t>``, which the
softmax backward needs per query, is not read from a saved ``o_cache`` (one more [B, T, H, D] tensor kept per layer
for backward) but formed by the dq program of the query tile in the same pass as dq: with ``dp_tj = lambda <do_t,
v_j>`` and ``delta_t = sum_j p_tj dp_tj``, ``dq_t = sum_j p_tj (dp_tj - delta_t) kc_j = sum_j p_tj dp_tj kc_j -
delta_t sum_j p_tj kc_j``, so the program accumulates both sums and ``delta`` and combines them at the end (one
more product per key tile). It writes ``delta`` for the dk/dv programs, which run after it, and the per-program
partial sums of the sink and gate gradients. One program per key tile (a cache tile of block b, or an in-block
tile) accumulates dk and dv over the queries that read it. In-block keys belong to one block, so their rows are
written directly; cache rows are read by many blocks, so each block writes its partial [W, D] rows and a
deterministic segmented reduction (stable sort by destination row, fixed order) adds them. The RMSNorm backward is
linear in the incoming gradient, so every program applies it to its own partial. gamma, sink and gate gradients
are per-program partial sums reduced by torch in a fixed order: the whole backward is deterministic.
"""

from __future__ import annotations


import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

NORM_EPS = 1e-6
LOG2E = 1.4426950408889634

# Launch configurations (block sizes, warps, stages) per head dim for the GPU; the interpreter uses 16 x 16 tiles.
# One fixed configuration per kernel instead of autotune: autotuned launches fail in the interpreter, and a fresh
# machine would re-tune every run. scripts/bench_hola_attention.py sweeps alternatives.
# BM: query tile, BN: key tile. D = 128 picked by the fewest register spills in ptxas (Triton 3.6); D = 256 by
# timing on an H200 (scripts/bench_hola_attention.py --sweep, 65,536 tokens, 4 heads; the numbers are in
# docs/LOG.md), against the ptxas pick (64 x 32, 8 warps).
CONFIGS = {
    "fwd": {64: dict(BM=64, BN=64, num_warps=4, num_stages=3), 128: dict(BM=64, BN=32, num_warps=8, num_stages=2),
            256: dict(BM=64, BN=32, num_warps=4, num_stages=2)},
    "dq": {64: dict(BM=64, BN=64, num_warps=4, num_stages=3), 128: dict(BM=64, BN=32, num_warps=8, num_stages=2),
           256: dict(BM=32, BN=32, num_warps=4, num_stages=2)},
    "dkdv": {64: dict(BM=64, BN=64, num_warps=4, num_stages=3), 128: dict(BM=64, BN=32, num_warps=8, num_stages=2),
             256: dict(BM=32, BN=32, num_warps=4, num_stages=2)},
}
_INTERPRET_CONFIG = dict(BM=16, BN=16, num_warps=1, num_stages=1)

# Tests set this to fill every output buffer with NaN before the kernels run, so unwritten elements fail.
POISON_OUTPUTS = False


def _empty(*shape, dtype, device):
    if POISON_OUTPUTS:  # NaN, or for indices the most negative value: no valid row
        poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, poison, dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


def _config(kind: str, d: int, device: torch.device) -> dict:
    if device.type != "cuda":  # Triton's interpreter
        return dict(_INTERPRET_CONFIG)
    table = CONFIGS[kind]
    return dict(table[min(table, key=lambda x: abs(x - d))]) if d not in table else dict(table[d])


if triton is not None:

    @triton.jit(do_not_specialize=["R"])
    def _rstd_kernel(x_ptr, r_ptr, R, EPS, D: tl.constexpr, BR: tl.constexpr):
        o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        mask = o_r < R
        b_x = tl.load(x_ptr + o_r[:, None] * D + tl.arange(0, D)[None, :], mask=mask[:, None], other=0.0)
        b_x = b_x.to(tl.float32)
        tl.store(r_ptr + o_r, tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + EPS), mask=mask)

    @triton.jit
    def _load_keys(k_ptr, v_ptr, rk_ptr, sel_ptr, i_b, i_h, start, length, c0, H, W,
                   IS_CACHE: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
        """A key tile: cache slots c0 ... c0 + BN of block i_b, or in-block keys c0 ... c0 + BN."""
        o_n = c0 + tl.arange(0, BN)
        o_d = tl.arange(0, D)
        if IS_CACHE:
            b_idx = tl.load(sel_ptr + (i_b * H + i_h) * W + o_n, mask=o_n < W, other=-1).to(tl.int64)
            n_ok = b_idx >= 0
            row = tl.where(n_ok, b_idx, 0) * H + i_h
        else:
            n_ok = o_n < length
            row = (start + o_n) * H + i_h
        b_k = tl.load(k_ptr + row[:, None] * D + o_d[None, :], mask=n_ok[:, None], other=0.0)
        b_v = tl.load(v_ptr + row[:, None] * D + o_d[None, :], mask=n_ok[:, None], other=0.0)
        b_rk = tl.load(rk_ptr + row, mask=n_ok, other=0.0)
        return o_n, n_ok, row, b_k, b_v, b_rk

    @triton.jit
    def _query_block(blk_start_ptr, blk_len_ptr, NQT, BM: tl.constexpr):
        """This program's query tile: (pid, head, block, first query in the block, block start row, length)."""
        pid = tl.program_id(0)
        i_h = tl.program_id(1).to(tl.int64)
        i_b = (pid // NQT).to(tl.int64)
        q0 = (pid % NQT) * BM
        return pid, i_h, i_b, q0, tl.load(blk_start_ptr + i_b).to(tl.int64), tl.load(blk_len_ptr + i_b)

    @triton.jit
    def _query_tile(q_ptr, rq_ptr, gq_ptr, gk_ptr, i_h, start, length, q0, H, scale,
                    D: tl.constexpr, BM: tl.constexpr):
        """Queries q0 ... q0 + BM of a block: positions, mask, flat rows and offsets, q, its rstd, both gammas, and
        the scaled normalised query ``q r gamma_q gamma_k scale log2(e)`` (in q's dtype) that the tiles dot with
        the raw keys (their rstd applied after the dot)."""
        o_m = q0 + tl.arange(0, BM)
        m_ok = o_m < length
        o_d = tl.arange(0, D)
        row_q = (start + o_m) * H + i_h
        p_q = row_q[:, None] * D + o_d[None, :]
        b_q = tl.load(q_ptr + p_q, mask=m_ok[:, None], other=0.0)
        b_rq = tl.load(rq_ptr + row_q, mask=m_ok, other=0.0)
        b_gq = tl.load(gq_ptr + o_d).to(tl.float32)
        b_gk = tl.load(gk_ptr + o_d).to(tl.float32)
        b_qs = (b_q.to(tl.float32) * b_rq[:, None] * (b_gq * b_gk)[None, :] * (scale * 1.4426950408889634))
        return o_m, m_ok, o_d, row_q, p_q, b_q, b_rq, b_gq, b_gk, b_qs.to(b_q.dtype)

    @triton.jit
    def _fwd_tile(b_qs, b_m, b_l, b_acc, b_k, b_v, b_rk, b_ok, DOT_PREC: tl.constexpr):
        b_s = tl.dot(b_qs, tl.trans(b_k), input_precision=DOT_PREC) * b_rk[None, :]
        b_s = tl.where(b_ok, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        return b_m_new, b_l, b_acc

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_fwd_kernel(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                          sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, H, NQT, scale, W,
                          D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          DOT_PREC: tl.constexpr):
        pid, i_h, i_b, q0, start, length = _query_block(blk_start_ptr, blk_len_ptr, NQT, BM)
        if q0 >= length:
            return
        o_m, m_ok, o_d, row_q, p_q, b_q, b_rq, b_gq, b_gk, b_qs = _query_tile(q_ptr, rq_ptr, gq_ptr, gk_ptr, i_h, start,
                                                                             length, q0, H, scale, D, BM)
        b_sink = tl.load(sink_ptr + i_h).to(tl.float32) * 1.4426950408889634
        b_m = tl.zeros([BM], dtype=tl.float32) + b_sink
        b_l = tl.full([BM], 1.0, dtype=tl.float32)
        b_acc = tl.zeros([BM, D], dtype=tl.float32)
        if W > 0:
            for c0 in range(0, W, BN):
                o_n, n_ok, row, b_k, b_v, b_rk = _load_keys(k_ptr, v_ptr, rk_ptr, sel_ptr, i_b, i_h, start, length,
                                                            c0, H, W, True, D, BN)
                b_m, b_l, b_acc = _fwd_tile(b_qs, b_m, b_l, b_acc, b_k, b_v, b_rk, n_ok[None, :], DOT_PREC)
        hi = tl.minimum(q0 + BM, length)
        for c0 in range(0, hi, BN):
            o_n, n_ok, row, b_k, b_v, b_rk = _load_keys(k_ptr, v_ptr, rk_ptr, sel_ptr, i_b, i_h, start, length,
                                                        c0, H, W, False, D, BN)
            b_ok = n_ok[None, :] & (o_n[None, :] <= o_m[:, None])
            b_m, b_l, b_acc = _fwd_tile(b_qs, b_m, b_l, b_acc, b_k, b_v, b_rk, b_ok, DOT_PREC)
        b_oc = b_acc / b_l[:, None]
        tl.store(lse_ptr + row_q, b_m + tl.log2(b_l), mask=m_ok)
        b_lam = tl.sigmoid(tl.load(gate_ptr + i_h).to(tl.float32))
        b_os = tl.load(os_ptr + p_q, mask=m_ok[:, None], other=0.0).to(tl.float32)
        tl.store(o_ptr + p_q, (b_os + b_lam * b_oc).to(o_ptr.dtype.element_ty), mask=m_ok[:, None])

    @triton.jit
    def _norm_bwd(b_dy, b_x, b_r, b_g, D: tl.constexpr):
        """RMSNorm backward: y = x r g. Returns (dx, per-row contributions summed into dgamma)."""
        b_gdy = b_g[None, :] * b_dy
        b_dx = b_r[:, None] * b_gdy - b_x * (b_r * b_r * b_r / D)[:, None] * tl.sum(b_x * b_gdy, axis=1)[:, None]
        return b_dx, tl.sum(b_dy * b_x * b_r[:, None], axis=0)

    @triton.jit
    def _dq_tile(b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_k, b_v, b_rk, b_ok, b_lam, DOT_PREC: tl.constexpr):
        """One key tile of the dq pass: ``b_r += sum_j p <do, v_j>``, ``b_dq += sum_j p dp kc_j``, ``b_pk += sum_j
        p kc_j`` (kc_j = k_j r_k; the gammas and the scale are applied at the end)."""
        b_s = tl.dot(b_qs, tl.trans(b_k), input_precision=DOT_PREC) * b_rk[None, :]
        b_p = tl.where(b_ok, tl.exp2(b_s - b_lse[:, None]), 0.0)
        b_dov = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_r += tl.sum(b_p * b_dov, axis=1)
        b_prk = b_p * b_rk[None, :]
        b_dq += tl.dot((b_prk * (b_dov * b_lam)).to(b_k.dtype), b_k, input_precision=DOT_PREC)
        b_pk += tl.dot(b_prk.to(b_k.dtype), b_k, input_precision=DOT_PREC)
        return b_r, b_dq, b_pk

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                             sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr, dsink_ptr,
                             dgate_ptr, H, NQT, scale, W,
                             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             DOT_PREC: tl.constexpr):
        """dq of a query tile, its ``delta`` (written for the dk/dv programs) and its partial sink and gate
        gradients (see the module docstring)."""
        pid, i_h, i_b, q0, start, length = _query_block(blk_start_ptr, blk_len_ptr, NQT, BM)
        if q0 >= length:  # past the block's end: zero partials (the buffers are not zero-filled first)
            tl.store(dgq_ptr + (pid * H + i_h) * D + tl.arange(0, D), tl.zeros([D], dtype=tl.float32))
            tl.store(dsink_ptr + pid * H + i_h, 0.0)
            tl.store(dgate_ptr + pid * H + i_h, 0.0)
            return
        o_m, m_ok, o_d, row_q, p_q, b_q, b_rq, b_gq, b_gk, b_qs = _query_tile(q_ptr, rq_ptr, gq_ptr, gk_ptr, i_h, start,
                                                                             length, q0, H, scale, D, BM)
        b_do = tl.load(do_ptr + p_q, mask=m_ok[:, None], other=0.0)
        b_lse = tl.load(lse_ptr + row_q, mask=m_ok, other=0.0)
        b_lam = tl.sigmoid(tl.load(gate_ptr + i_h).to(tl.float32))
        b_r = tl.zeros([BM], dtype=tl.float32)
        b_dq = tl.zeros([BM, D], dtype=tl.float32)
        b_pk = tl.zeros([BM, D], dtype=tl.float32)
        if W > 0:
            for c0 in range(0, W, BN):
                o_n, n_ok, row, b_k, b_v, b_rk = _load_keys(k_ptr, v_ptr, rk_ptr, sel_ptr, i_b, i_h, start, length,
                                                            c0, H, W, True, D, BN)
                b_ok = n_ok[None, :] & m_ok[:, None]
                b_r, b_dq, b_pk = _dq_tile(b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_k, b_v, b_rk, b_ok, b_lam, DOT_PREC)
        hi = tl.minimum(q0 + BM, length)
        for c0 in range(0, hi, BN):
            o_n, n_ok, row, b_k, b_v, b_rk = _load_keys(k_ptr, v_ptr, rk_ptr, sel_ptr, i_b, i_h, start, length,
                                                        c0, H, W, False, D, BN)
            b_ok = n_ok[None, :] & m_ok[:, None] & (o_n[None, :] <= o_m[:, None])
            b_r, b_dq, b_pk = _dq_tile(b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_k, b_v, b_rk, b_ok, b_lam, DOT_PREC)
        b_delta = b_lam * b_r
        tl.store(delta_ptr + row_q, b_delta, mask=m_ok)
        b_psink = tl.exp2(tl.load(sink_ptr + i_h).to(tl.float32) * 1.4426950408889634 - b_lse)
        tl.store(dsink_ptr + pid * H + i_h, -tl.sum(tl.where(m_ok, b_psink * b_delta, 0.0), axis=0))
        tl.store(dgate_ptr + pid * H + i_h, tl.sum(b_r, axis=0) * b_lam * (1.0 - b_lam))
        b_dqc = (b_dq - b_delta[:, None] * b_pk) * (scale * b_gk)[None, :]
        b_dx, b_dg = _norm_bwd(b_dqc, b_q.to(tl.float32), b_rq, b_gq, D)
        tl.store(dq_ptr + p_q, b_dx.to(dq_ptr.dtype.element_ty), mask=m_ok[:, None])
        tl.store(dgq_ptr + (pid * H + i_h) * D + o_d, b_dg)

    @triton.jit(do_not_specialize=["H", "NKT", "NCT", "W"])
    def _cache_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                               gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                               dgk_ptr, dest_ptr, SENTINEL, H, NKT, NCT, scale, W,
                               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                               DOT_PREC: tl.constexpr):
        """One key tile: cache tiles (j < NCT) read by all queries of the block, then in-block tiles. A cache tile
        also writes the destination row (token * H + head, ``SENTINEL`` for an empty slot) of each of its slots, the
        keys the reduction of the cache partials sorts by."""
        pid = tl.program_id(0)
        i_h = tl.program_id(1).to(tl.int64)
        i_b = (pid // NKT).to(tl.int64)
        j = pid % NKT
        start = tl.load(blk_start_ptr + i_b).to(tl.int64)
        length = tl.load(blk_len_ptr + i_b)
        is_cache = j < NCT
        c0 = tl.where(is_cache, j, j - NCT) * BN
        lo = tl.where(is_cache, 0, (c0 // BM) * BM)
        if (c0 >= length) & (j >= NCT):  # past the block's end: a zero partial (the buffer is not zero-filled)
            tl.store(dgk_ptr + (pid * H + i_h) * D + tl.arange(0, D), tl.zeros([D], dtype=tl.float32))
            return
        o_n = c0 + tl.arange(0, BN)
        o_d = tl.arange(0, D)
        if is_cache:
            b_idx = tl.load(sel_ptr + (i_b * H + i_h) * W + o_n, mask=o_n < W, other=-1).to(tl.int64)
            n_ok = b_idx >= 0
            row_k = tl.where(n_ok, b_idx, 0) * H + i_h
        else:
            n_ok = o_n < length
            row_k = (start + o_n) * H + i_h
        p_k = row_k[:, None] * D + o_d[None, :]
        b_k = tl.load(k_ptr + p_k, mask=n_ok[:, None], other=0.0)
        b_v = tl.load(v_ptr + p_k, mask=n_ok[:, None], other=0.0)
        b_rk = tl.load(rk_ptr + row_k, mask=n_ok, other=0.0)
        b_gq = tl.load(gq_ptr + o_d).to(tl.float32)
        b_gk = tl.load(gk_ptr + o_d).to(tl.float32)
        b_ks = (b_k.to(tl.float32) * b_rk[:, None] * (b_gq * b_gk)[None, :] * (scale * 1.4426950408889634))
        b_ks = b_ks.to(b_k.dtype)
        b_lam = tl.sigmoid(tl.load(gate_ptr + i_h).to(tl.float32))
        b_dk = tl.zeros([BN, D], dtype=tl.float32)
        b_dv = tl.zeros([BN, D], dtype=tl.float32)
        for m0 in range(lo, length, BM):
            o_m = m0 + tl.arange(0, BM)
            m_ok = o_m < length
            row_q = (start + o_m) * H + i_h
            p_q = row_q[:, None] * D + o_d[None, :]
            b_q = tl.load(q_ptr + p_q, mask=m_ok[:, None], other=0.0)
            b_do = tl.load(do_ptr + p_q, mask=m_ok[:, None], other=0.0)
            b_rq = tl.load(rq_ptr + row_q, mask=m_ok, other=0.0)
            b_lse = tl.load(lse_ptr + row_q, mask=m_ok, other=0.0)
            b_delta = tl.load(delta_ptr + row_q, mask=m_ok, other=0.0)
            b_st = tl.dot(b_ks, tl.trans(b_q), input_precision=DOT_PREC) * b_rq[None, :]
            b_ok = n_ok[:, None] & m_ok[None, :] & (is_cache | (o_m[None, :] >= o_n[:, None]))
            b_pt = tl.where(b_ok, tl.exp2(b_st - b_lse[None, :]), 0.0)
            b_dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=DOT_PREC)
            b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC) * b_lam
            b_dst = b_pt * (b_dpt - b_delta[None, :])
            b_dk += tl.dot((b_dst * b_rq[None, :]).to(b_q.dtype), b_q, input_precision=DOT_PREC)
        b_dkc = b_dk * (scale * b_gq)[None, :]
        b_dx, b_dg = _norm_bwd(b_dkc, b_k.to(tl.float32), b_rk, b_gk, D)
        b_dv = b_dv * b_lam
        tl.store(dgk_ptr + (pid * H + i_h) * D + o_d, b_dg)
        if is_cache:
            p_e = ((i_b * H + i_h) * W + o_n)[:, None] * D + o_d[None, :]
            e_ok = (o_n < W)[:, None]
            tl.store(pdk_ptr + p_e, b_dx, mask=e_ok)
            tl.store(pdv_ptr + p_e, b_dv, mask=e_ok)
            tl.store(dest_ptr + (i_b * H + i_h) * W + o_n, tl.where(n_ok, row_k, SENTINEL), mask=o_n < W)
        else:
            tl.store(dk_ptr + p_k, b_dx.to(dk_ptr.dtype.element_ty), mask=n_ok[:, None])
            tl.store(dv_ptr + p_k, b_dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None])

    @triton.jit(do_not_specialize=["E"])
    def _scatter_cache_grads_kernel(key_ptr, order_ptr, pdk_ptr, pdv_ptr, dk_ptr, dv_ptr, E, SENTINEL,
                                    D: tl.constexpr):
        """Add the cache partials of one destination row in a fixed order (the heads of sorted runs do the work)."""
        p = tl.program_id(0).to(tl.int64)
        key = tl.load(key_ptr + p)
        prev = tl.load(key_ptr + p - 1, mask=p > 0, other=-1)
        if (key == SENTINEL) | (prev == key):
            return
        o_d = tl.arange(0, D)
        b_dk = tl.zeros([D], dtype=tl.float32)
        b_dv = tl.zeros([D], dtype=tl.float32)
        i = p
        cur = key
        while cur == key:
            e = tl.load(order_ptr + i)
            b_dk += tl.load(pdk_ptr + e * D + o_d)
            b_dv += tl.load(pdv_ptr + e * D + o_d)
            i += 1
            cur = tl.load(key_ptr + i, mask=i < E, other=-1)
        p_r = key * D + o_d
        tl.store(dk_ptr + p_r, (tl.load(dk_ptr + p_r).to(tl.float32) + b_dk).to(dk_ptr.dtype.element_ty))
        tl.store(dv_ptr + p_r, (tl.load(dv_ptr + p_r).to(tl.float32) + b_dv).to(dv_ptr.dtype.element_ty))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else None


def rms_rstd(x: torch.Tensor) -> torch.Tensor:
    """``rsqrt(mean(x^2) + eps)`` over the last dim of a contiguous ``[..., D]`` tensor, float32 ``[...]``."""
    d = x.shape[-1]
    rows = x.numel() // d
    r = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    br = 16 if x.device.type != "cuda" else max(1, 4096 // d)
    if rows:
        _rstd_kernel[(triton.cdiv(rows, br),)](x, r, rows, NORM_EPS, D=d, BR=br, num_warps=4)
    return r


def cache_attention_fwd(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, *, block: int,
                        window: int):
    """Forward launches. Returns ``(o, lse [B*T, H] base 2, r_q, r_k)``: what the backward needs besides the
    inputs (no cache output: the backward forms ``delta`` itself)."""
    h, d = q.shape[-2], q.shape[-1]
    num_blocks = blk_start.shape[0]
    rq, rk = rms_rstd(q), rms_rstd(k)
    o = _empty(*q.shape, dtype=q.dtype, device=q.device)
    lse = _empty(*q.shape[:-1], dtype=torch.float32, device=q.device)
    sel = sel if sel.numel() else blk_start  # window 0: never read, but Triton needs a valid pointer
    cfg = _config("fwd", d, q.device)
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    nqt = triton.cdiv(block, bm)
    if num_blocks:
        _cache_fwd_kernel[(num_blocks * nqt, h)](
            q, k, v, o_state, o, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len,
            h, nqt, d ** -0.5, W=window, D=d, BM=bm, BN=bn, DOT_PREC=_dot_precision(q.dtype), **cfg)
    return o, lse, rq, rk


def cache_attention_bwd(do, q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, *,
                        block: int, window: int):
    """Backward launches. Returns ``(dq, dk, dv, dgamma_q, dgamma_k, dsink, dgate)`` (parameter grads float32)."""
    h, d = q.shape[-2], q.shape[-1]
    num_blocks = blk_start.shape[0]
    num_tokens = q.numel() // (h * d)
    device = q.device
    scale = d ** -0.5
    prec = _dot_precision(q.dtype)
    # Written by the dq programs for every query row of a block; the dk/dv programs read only those rows.
    delta = _empty(num_tokens, h, dtype=torch.float32, device=device)
    sel = sel if sel.numel() else blk_start  # window 0: never read, but Triton needs a valid pointer
    dq = _empty(*q.shape, dtype=q.dtype, device=device)
    cfg = _config("dq", d, device)
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    nqt = triton.cdiv(block, bm)
    # Per-program partials, every one written (zeros past a block's end): no fill launches.
    dgq_part = _empty(num_blocks * nqt, h, d, dtype=torch.float32, device=device)
    dsink_part = _empty(num_blocks * nqt, h, dtype=torch.float32, device=device)
    dgate_part = _empty(num_blocks * nqt, h, dtype=torch.float32, device=device)
    if num_blocks:
        _cache_bwd_dq_kernel[(num_blocks * nqt, h)](
            q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, dq,
            dgq_part, dsink_part, dgate_part, h, nqt, scale, W=window, D=d, BM=bm, BN=bn, DOT_PREC=prec, **cfg)
    dk = _empty(*k.shape, dtype=k.dtype, device=device)
    dv = _empty(*v.shape, dtype=v.dtype, device=device)
    cfg = _config("dkdv", d, device)
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    nct = triton.cdiv(window, bn)
    nkt = nct + triton.cdiv(block, bn)
    num_slots = num_blocks * h * window
    pdk = _empty(max(num_slots, 1), d, dtype=torch.float32, device=device)
    pdv = _empty(max(num_slots, 1), d, dtype=torch.float32, device=device)
    dgk_part = _empty(num_blocks * nkt, h, d, dtype=torch.float32, device=device)
    # Destination row of every cache slot (token * H + head), written by the cache tiles; empty slots sort last.
    sentinel = torch.iinfo(torch.int64).max
    dest = _empty(max(num_slots, 1), dtype=torch.int64, device=device)
    if num_blocks:
        _cache_bwd_dkdv_kernel[(num_blocks * nkt, h)](
            q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, gate, sel, blk_start, blk_len, dk, dv,
            pdk, pdv, dgk_part, dest, sentinel, h, nkt, nct, scale, W=window, D=d, BM=bm, BN=bn, DOT_PREC=prec, **cfg)
    if num_slots:
        dest_sorted, order = torch.sort(dest, stable=True)
        _scatter_cache_grads_kernel[(num_slots,)](dest_sorted, order, pdk, pdv, dk, dv, num_slots, sentinel, D=d,
                                                  num_warps=1 if d <= 64 else 2)
    # The gate's partials carry sigmoid'(gate) already.
    return dq, dk, dv, dgq_part.sum((0, 1)), dgk_part.sum((0, 1)), dsink_part.sum(0), dgate_part.sum(0)
