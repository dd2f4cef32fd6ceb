"""The cache read on Hopper's warpgroup MMA, written in Gluon (Triton's explicit-layout language).

Same function, inputs and outputs as the fresh call's Triton dq and dk/dv kernels of
:mod:`hola_titan.kernels.hola.triton_kernels` (see its docstring for the math, the fused RMSNorms and the reductions);
what differs is how the products run. At head dim 256 Triton compiles those kernels' 32-row tiles to ``mma.sync``,
every warp reading its operands from shared memory itself, at 255 registers with spills: about 100 TFLOP/s. Here
every product is a ``warpgroup_mma`` over 64 x 64 tiles with both operands in shared memory:

- dq, one program per query tile of a block: the scaled normalised queries and dO are written to shared memory
  once; key tiles (the block's cache slots, gathered by their rows, then its own rows up to the diagonal) arrive by
  ``cp.async`` into two buffers, the next while the current is used. Per tile ``S = Q K^T``, ``dP = dO V^T``, then
  ``P (dP - delta)`` and, without a kept output, ``P`` go to shared memory for the two accumulating products (dq and
  the sum of ``p kc`` that gives ``delta`` at the end, as in the Triton kernel); with it, ``delta`` comes from the
  kept output and one accumulator is enough.
- dk/dv, one program per key tile: the scaled normalised keys and V in shared memory once; query tiles of Q and dO
  double-buffered by ``cp.async``; ``S^T = K Q^T``, ``dP^T = V dO^T``, then ``P^T`` and ``dS^T`` through shared
  memory into dV and dK.
- the forward, one program (one warpgroup) per query tile: scores from the scaled queries and a gathered key tile
  in shared memory, the online softmax from the sink, and the probabilities from registers into the output
  product; two programs share an SM. K and V arrive in separate ``cp.async`` groups into one buffer each: the
  next K is loaded as soon as the scores are done, the next V as soon as the output product is.

Each step's key validity comes from the staged rstd (zero only for an empty slot or one past the window), not
from a load of the selection; the epilogues' RMSNorm backward reads the raw rows from a buffer that the last step
(dq) or the last products (dk/dv) left free, staged by ``cp.async`` while the products run.

In the backward, 8 warps per program: the two warpgroups split each product's N dimension, so each holds half of the
two [64, D] float32 accumulators in registers (at D 256 the loops spill nothing, the epilogues a few registers).
Plain (not warp-specialised) warpgroups: a first form, timed against the Triton kernels in
``scripts/bench_hola_attention.py``. Gluon has no interpreter: these kernels run on an sm_90 GPU only (the CPU suite
compiles them for sm_90a and checks what they compile to; the GPU suite checks their results against the
reference). Fresh calls, no prefix: :func:`~hola_titan.kernels.hola.triton_kernels.forward_kernels` and
:func:`~hola_titan.kernels.hola.triton_kernels.backward_kernels` say when they run.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_init, warpgroup_mma_wait)
except ImportError as exc:  # a Triton without Gluon: the dispatch reports why
    gluon = None
    GLUON_MISSING = f"{type(exc).__name__}: {exc}"
else:
    GLUON_MISSING = ""

# Tiles and warps: 64-row tiles are the smallest warpgroup MMA; in the backward 8 warps split the two accumulators'
# columns; the forward keeps one warpgroup per program (one accumulator, 255 registers, 96 KiB of shared memory:
# two programs per SM).
CONFIG = dict(BM=64, BN=64, num_warps=8)
FWD_CONFIG = dict(BM=64, BN=64, num_warps=4)
# Head dims and element types the kernels are written for (their layouts assume D a multiple of 128; timed at 256).
HEAD_DIMS = (256,)
DTYPES = ("bfloat16", "float16")
# Triton versions whose Gluon the kernels are written against (Gluon is experimental; its names move between
# versions): run and timed on 3.6 (an H200), compiled for sm_90a on 3.9. Others take the Triton kernels.
TRITON_VERSIONS = ("3.6", "3.7", "3.8", "3.9")

if gluon is not None:
    # Triton 3.6 names the cp.async load async_copy_global_to_shared, later versions async_load; the CTA-wide barrier
    # is thread_barrier in 3.6 and barrier later.
    _async_load = getattr(async_copy, "async_load", None) or getattr(async_copy, "async_copy_global_to_shared")
    _cta_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")

    @gluon.constexpr_function
    def _mma_layout(cols, num_warps):
        """A 64-row accumulator's layout: a warpgroup along the rows, the others along the columns, each with the
        widest instruction N that divides its share."""
        wn = num_warps // 4
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wn],
                                         instr_shape=[16, min(256, cols // wn), 16])

    @gluon.constexpr_function
    def _row_layout(num_warps):
        """Loads of [rows, D] tiles: 8 contiguous elements (16 bytes) per thread."""
        return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

    @gluon.jit
    def _key_rows(sel_ptr, i_b, i_h, j, NCT, W, start, length, H, BN: gl.constexpr, layout: gl.constexpr):
        """Key tile ``j`` of a block in ``layout`` (a 1-D slice layout): tiles below NCT are cache slots (a slot's
        token from the selection, negative: empty), the rest the block's own rows. Returns (position: slot or
        position in the block, flat row, valid). The branch is on a scalar: one form of addressing per tile."""
        o = gl.arange(0, BN, layout=layout)
        if j < NCT:
            o_n = j * BN + o
            b_idx = gl.load(sel_ptr + (i_b * H + i_h) * W + o_n, mask=o_n < W, other=-1).to(gl.int64)
            ok = b_idx >= 0
            row = gl.where(ok, b_idx, 0) * H + i_h
        else:
            o_n = (j - NCT) * BN + o
            ok = o_n < length
            row = (start + o_n) * H + i_h
        return o_n, row, ok

    @gluon.jit
    def _key_thresholds(b_rk, j, NCT, BN: gl.constexpr, layout: gl.constexpr):
        """Per key of tile ``j`` (``layout``, a 1-D slice layout, as ``b_rk``, the tile's staged rstd), the position a
        query must reach to see it: for a cache slot -1 when it is filled, else above every position; for an own row
        its position in the block (causal). A filled slot is known by its staged rstd, nonzero for any real row
        (1 / sqrt(mean square + eps); NaN for a row with a NaN, which then reaches the output as in the Triton
        kernels), zero-filled for an empty slot or one past the window: no load of the selection in the step."""
        pos = (j - NCT) * BN + gl.arange(0, BN, layout=layout)
        return gl.where(j < NCT, gl.where(b_rk != 0.0, -1, 1 << 30), pos)

    @gluon.jit
    def _async_rows(smem, ptr, row, ok, D: gl.constexpr, layout: gl.constexpr):
        """cp.async of rows ``row`` (flat rows of D elements) into ``smem``; rows not ``ok`` are zero-filled."""
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        _async_load(smem, ptr + row[:, None] * D + cols[None, :], mask=ok[:, None])

    @gluon.jit
    def _async_query_tile(dst, ptr, q0, start, length, H, i_h, BM: gl.constexpr, D: gl.constexpr,
                          blk: gl.constexpr):
        """cp.async of the BM token rows of ``ptr`` from block position ``q0`` (zeros past the block's end)."""
        o_m = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
        _async_rows(dst, ptr, (start + o_m) * H + i_h, o_m < length, D, blk)

    @gluon.jit
    def _async_vec(smem, ptr, idx, ok):
        """cp.async of the float32 values ``ptr[idx]`` (zero where not ``ok``) into the 1-D ``smem``: a tile's
        per-row vectors staged with its rows, so that a step reads them from shared memory, not from a load it
        would wait for."""
        _async_load(smem, ptr + idx, mask=ok)

    @gluon.jit
    def _scaled_rows_to_smem(smem, x_ptr, r_ptr, gq_ptr, gk_ptr, row, ok, factor, D: gl.constexpr,
                             layout: gl.constexpr):
        """Rows of x scaled by their rstd, both gammas and ``factor``, written to ``smem`` in x's dtype (the side of
        the score product that carries the norms)."""
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        b_x = gl.load(x_ptr + row[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
        b_r = gl.load(r_ptr + row, mask=ok, other=0.0)
        b_g = gl.load(gq_ptr + cols).to(gl.float32) * gl.load(gk_ptr + cols).to(gl.float32) * factor
        smem.store((b_x.to(gl.float32) * b_r[:, None] * b_g[None, :]).to(b_x.dtype))

    @gluon.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + gl.exp(-x))

    @gluon.jit
    def _norm_bwd(b_dy, b_x, b_r, g_ptr, ok, D: gl.constexpr, layout: gl.constexpr):
        """RMSNorm backward (y = x r g) of rows ``b_x`` (float32, zeros where not ``ok``) with rstd ``b_r`` from
        ``b_dy`` (float32 in ``layout``, a 2-D layout): (dx, the rows' partial sum of dgamma)."""
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        b_g = gl.load(g_ptr + cols).to(gl.float32)
        b_dy = gl.where(ok[:, None], b_dy, 0.0)  # rows that are not valid hold unmasked sums: out of the dgamma sum
        b_gdy = b_g[None, :] * b_dy
        b_dx = b_r[:, None] * b_gdy - b_x * (b_r * b_r * b_r / D)[:, None] * gl.sum(b_x * b_gdy, axis=1)[:, None]
        return b_dx, gl.sum(b_dy * b_x * b_r[:, None], axis=0)

    @gluon.jit
    def _cache_bwd_dq_gluon_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                                   sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr,
                                   dsink_ptr, dgate_ptr, oc_ptr, H, NQT, scale, W,
                                   D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, HAS_OC: gl.constexpr,
                                   num_warps: gl.constexpr):
        """dq of a query tile, its ``delta`` and its partial gamma_q, sink and gate gradients (as
        ``_cache_bwd_dq_kernel``; with ``HAS_OC`` as ``_cache_bwd_dq_oc_kernel``)."""
        blk: gl.constexpr = _row_layout(num_warps)
        s_l: gl.constexpr = _mma_layout(BN, num_warps)
        acc_l: gl.constexpr = _mma_layout(D, num_warps)
        vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        pid = gl.program_id(0)
        i_h = gl.program_id(1).to(gl.int64)
        i_b = (pid // NQT).to(gl.int64)
        q0 = (pid % NQT) * BM
        start = gl.load(blk_start_ptr + i_b).to(gl.int64)
        length = gl.load(blk_len_ptr + i_b)
        if q0 >= length:  # past the block's end: zero partials (the buffers are not zero-filled first)
            gl.store(dgq_ptr + (pid * H + i_h) * D + gl.arange(0, D, layout=vec_l), gl.zeros([D], gl.float32, vec_l))
            gl.store(dsink_ptr + pid * H + i_h, 0.0)
            gl.store(dgate_ptr + pid * H + i_h, 0.0)
        else:
            sd_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16)
            p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
            q_s = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BM, D], sd_sl)
            do_s = gl.allocate_shared_memory(do_ptr.dtype.element_ty, [BM, D], sd_sl)
            k_s = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [2, BN, D], sd_sl)
            v_s = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [2, BN, D], sd_sl)
            # The two left operands of the accumulating products: P (dP - delta) kc-scaled, and P kc-scaled.
            pa_s = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BM, BN], p_sl)
            pb_s = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BM, BN], p_sl)
            v1_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            rk_s = gl.allocate_shared_memory(gl.float32, [2, BN], v1_sl)  # the key tiles' rstd

            NCT = gl.cdiv(W, BN)
            n_tiles = NCT + gl.cdiv(gl.minimum(q0 + BM, length), BN)  # own tiles up to the tile's last query
            # The first key tile in flight while the queries are scaled and written.
            o_n, row, ok = _key_rows(sel_ptr, i_b, i_h, 0, NCT, W, start, length, H, BN, gl.SliceLayout(1, blk))
            _async_rows(k_s.index(0), k_ptr, row, ok, D, blk)
            _async_rows(v_s.index(0), v_ptr, row, ok, D, blk)
            o_n, row, ok = _key_rows(sel_ptr, i_b, i_h, 0, NCT, W, start, length, H, BN, vec_l)
            _async_vec(rk_s.index(0), rk_ptr, row, ok)
            async_copy.commit_group()

            o_m = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
            m_ok = o_m < length
            row_q = (start + o_m) * H + i_h
            _async_rows(do_s, do_ptr, row_q, m_ok, D, blk)  # dO with the first key tile
            async_copy.commit_group()
            cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
            if HAS_OC:  # in flight while the queries are scaled
                b_oc = gl.load(oc_ptr + row_q[:, None] * D + cols[None, :], mask=m_ok[:, None], other=0.0)
            _scaled_rows_to_smem(q_s, q_ptr, rq_ptr, gq_ptr, gk_ptr, row_q, m_ok, scale * 1.4426950408889634, D,
                                 blk)
            b_lam = _sigmoid(gl.load(gate_ptr + i_h).to(gl.float32))

            s_m = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_l))
            s_mok = s_m < length
            s_row = (start + s_m) * H + i_h
            b_lse = gl.load(lse_ptr + s_row, mask=s_mok, other=0.0)
            if HAS_OC:  # the row sums from the kept output
                async_copy.wait_group(0)
                _cta_barrier()
                b_do = do_s.load(blk)
                b_r = gl.convert_layout(gl.sum(b_do.to(gl.float32) * b_oc.to(gl.float32), axis=1),
                                        gl.SliceLayout(1, s_l))
                b_delta = b_lam * b_r
            else:
                b_r = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_l))
                b_pk = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, acc_l))
            b_dq = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, acc_l))
            s_zero = gl.zeros([BM, BN], gl.float32, s_l)
            async_copy.wait_group(0)
            fence_async_shared()
            _cta_barrier()
            for j in range(0, n_tiles):
                # Step j: tile j is in buffer cur; the previous step's accumulating products may still run (they
                # read pa_s, pb_s and buffer 1 - cur).
                cur = j % 2
                k_t = k_s.index(cur)
                v_t = v_s.index(cur)
                s_tok = warpgroup_mma(q_s, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                b_rk = rk_s.index(cur).load(gl.SliceLayout(0, s_l))
                dp_tok = warpgroup_mma(do_s, v_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                b_s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # and all older products
                _cta_barrier()  # both warpgroups: the previous products are done with pa_s, pb_s, buffer 1 - cur
                # The next tile into the other buffer (past the last: all rows masked, nothing read), and its
                # score-layout vectors, while this step computes.
                # (Names local to each branch: nothing computed for a load stays live in registers after it.)
                if j + 1 < n_tiles:
                    k_n, k_row, k_ok = _key_rows(sel_ptr, i_b, i_h, j + 1, NCT, W, start, length, H, BN,
                                                 gl.SliceLayout(1, blk))
                    _async_rows(k_s.index(1 - cur), k_ptr, k_row, k_ok, D, blk)
                    _async_rows(v_s.index(1 - cur), v_ptr, k_row, k_ok, D, blk)
                    r_n, r_row, r_ok = _key_rows(sel_ptr, i_b, i_h, j + 1, NCT, W, start, length, H, BN, vec_l)
                    _async_vec(rk_s.index(1 - cur), rk_ptr, r_row, r_ok)
                else:  # after the last tile: the raw query rows, for the epilogue's RMSNorm backward
                    _async_query_tile(k_s.index(1 - cur), q_ptr, q0, start, length, H, i_h, BM, D, blk)
                async_copy.commit_group()

                # One comparison per score: the key's threshold against the query's position. Query rows past the
                # block's end are not masked: they were read as zeros (finite scores) and feed only their own dq
                # rows, which are not written, and zero row sums.
                thr = _key_thresholds(b_rk, j, NCT, BN, gl.SliceLayout(0, s_l))
                b_p = gl.where(thr[None, :] <= s_m[:, None], gl.exp2(b_s * b_rk[None, :] - b_lse[:, None]), 0.0)
                b_prk = b_p * b_rk[None, :]
                b_dov = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
                if HAS_OC:
                    pa_s.store((b_prk * (b_dov * b_lam - b_delta[:, None])).to(pa_s.dtype))
                else:
                    b_r += gl.sum(b_p * b_dov, axis=1)
                    pa_s.store((b_prk * (b_dov * b_lam)).to(pa_s.dtype))
                    pb_s.store(b_prk.to(pb_s.dtype))
                fence_async_shared()
                _cta_barrier()
                # The step waits for its accumulating products: left in flight into the next step, ptxas
                # serialises every product of the loop (registers; Triton 3.6, sm_90a).
                b_dq = warpgroup_mma(pa_s, k_t, b_dq, is_async=True)
                if HAS_OC:
                    b_dq = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(b_dq,)))
                else:
                    b_pk = warpgroup_mma(pb_s, k_t, b_pk, is_async=True)
                    b_dq, b_pk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq, b_pk))
                    b_dq = warpgroup_mma_init(b_dq)
                    b_pk = warpgroup_mma_init(b_pk)
                async_copy.wait_group(0)
                fence_async_shared()
                _cta_barrier()
            if HAS_OC:
                b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq,))
            else:
                b_dq, b_pk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq, b_pk))
            if not HAS_OC:
                b_delta = b_lam * b_r
            gl.store(delta_ptr + s_row, b_delta, mask=s_mok)
            b_psink = gl.exp2(gl.load(sink_ptr + i_h).to(gl.float32) * 1.4426950408889634 - b_lse)
            gl.store(dsink_ptr + pid * H + i_h, -gl.sum(gl.where(s_mok, b_psink * b_delta, 0.0), axis=0))
            gl.store(dgate_ptr + pid * H + i_h, gl.sum(b_r, axis=0) * b_lam * (1.0 - b_lam))
            if HAS_OC:
                b_dqr = b_dq
            else:
                b_dqr = b_dq - gl.convert_layout(b_delta, gl.SliceLayout(1, acc_l))[:, None] * b_pk
            a_m = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
            a_ok = a_m < length
            a_row = (start + a_m) * H + i_h
            a_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_l))
            b_gk = gl.load(gk_ptr + a_d).to(gl.float32)
            b_x = k_s.index(n_tiles % 2).load(acc_l).to(gl.float32)  # the raw queries, staged by the last step
            b_rq = gl.load(rq_ptr + a_row, mask=a_ok, other=0.0)
            b_dx, b_dg = _norm_bwd(b_dqr * (scale * b_gk)[None, :], b_x, b_rq, gq_ptr, a_ok, D, acc_l)
            gl.store(dq_ptr + a_row[:, None] * D + a_d[None, :], b_dx.to(dq_ptr.dtype.element_ty), mask=a_ok[:, None])
            gl.store(dgq_ptr + (pid * H + i_h) * D + a_d, b_dg)

    @gluon.jit
    def _query_vectors(rq_s, lse_s, dl_s, rq_ptr, lse_ptr, delta_ptr, m0, start, length, H, i_h, BM: gl.constexpr,
                       layout: gl.constexpr):
        """cp.async of query tile m0's rstd, log-sum-exp and delta (zeros past the block's end)."""
        o_m = m0 + gl.arange(0, BM, layout=layout)
        ok = o_m < length
        row = (start + o_m) * H + i_h
        _async_vec(rq_s, rq_ptr, row, ok)
        _async_vec(lse_s, lse_ptr, row, ok)
        _async_vec(dl_s, delta_ptr, row, ok)

    @gluon.jit
    def _cache_bwd_dkdv_gluon_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                                     gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                                     dgk_ptr, dest_ptr, SENTINEL, H, NKT, NCT, scale, W,
                                     D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
        """dk and dv of a key tile (as ``_cache_bwd_dkdv_kernel``): cache tiles (j < NCT) write their slots'
        float32 partials and destination rows for the reduction, in-block tiles their rows."""
        blk: gl.constexpr = _row_layout(num_warps)
        s_l: gl.constexpr = _mma_layout(BM, num_warps)
        acc_l: gl.constexpr = _mma_layout(D, num_warps)
        vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        pid = gl.program_id(0)
        i_h = gl.program_id(1).to(gl.int64)
        i_b = (pid // NKT).to(gl.int64)
        j = pid % NKT
        start = gl.load(blk_start_ptr + i_b).to(gl.int64)
        length = gl.load(blk_len_ptr + i_b)
        is_cache = j < NCT
        c0 = gl.where(is_cache, j, j - NCT) * BN
        if (c0 >= length) & (j >= NCT):  # past the block's end: a zero partial (the buffer is not zero-filled)
            gl.store(dgk_ptr + (pid * H + i_h) * D + gl.arange(0, D, layout=vec_l), gl.zeros([D], gl.float32, vec_l))
        else:
            sd_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16)
            p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], gl.bfloat16)
            k_s = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [BN, D], sd_sl)
            v_s = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [BN, D], sd_sl)
            q_s = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2, BM, D], sd_sl)
            do_s = gl.allocate_shared_memory(do_ptr.dtype.element_ty, [2, BM, D], sd_sl)
            pt_s = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BN, BM], p_sl)
            dst_s = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BN, BM], p_sl)
            # The query tiles' rstd, log-sum-exp and delta, staged with their rows.
            v1_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            rq_s = gl.allocate_shared_memory(gl.float32, [2, BM], v1_sl)
            lse_s = gl.allocate_shared_memory(gl.float32, [2, BM], v1_sl)
            dl_s = gl.allocate_shared_memory(gl.float32, [2, BM], v1_sl)

            # Queries from the first whose position reaches the tile's first key (all for a cache tile).
            lo = gl.where(is_cache, 0, (c0 // BM) * BM)
            o_m = lo + gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
            m_ok = o_m < length
            row_q = (start + o_m) * H + i_h
            _async_rows(q_s.index(0), q_ptr, row_q, m_ok, D, blk)
            _async_rows(do_s.index(0), do_ptr, row_q, m_ok, D, blk)
            _query_vectors(rq_s.index(0), lse_s.index(0), dl_s.index(0), rq_ptr, lse_ptr, delta_ptr, lo, start,
                           length, H, i_h, BM, vec_l)
            o_n, row_k, n_ok = _key_rows(sel_ptr, i_b, i_h, j, NCT, W, start, length, H, BN, gl.SliceLayout(1, blk))
            _async_rows(v_s, v_ptr, row_k, n_ok, D, blk)  # V as it is, with the first query tile
            async_copy.commit_group()
            _scaled_rows_to_smem(k_s, k_ptr, rk_ptr, gq_ptr, gk_ptr, row_k, n_ok, scale * 1.4426950408889634, D, blk)
            b_lam = _sigmoid(gl.load(gate_ptr + i_h).to(gl.float32))
            s_n, _, s_ok = _key_rows(sel_ptr, i_b, i_h, j, NCT, W, start, length, H, BN, gl.SliceLayout(1, s_l))
            # Causal for the block's own keys, none for filled cache slots; an empty slot's row is masked out.
            thr = gl.where(is_cache, gl.where(s_ok, -1, 1 << 30), s_n)

            b_dk = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, acc_l))
            b_dv = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, acc_l))
            s_zero = gl.zeros([BN, BM], gl.float32, s_l)
            async_copy.wait_group(0)
            fence_async_shared()
            _cta_barrier()
            for m0 in range(lo, length, BM):
                # Step: query tile m0 is in buffer cur; the previous step's dv and dk products may still run (they
                # read pt_s, dst_s and buffer 1 - cur).
                cur = ((m0 - lo) // BM) % 2
                q_t = q_s.index(cur)
                do_t = do_s.index(cur)
                st_tok = warpgroup_mma(k_s, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dpt_tok = warpgroup_mma(v_s, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                b_st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))  # and all older products
                _cta_barrier()  # both warpgroups: the previous products are done with pt_s, dst_s, buffer 1 - cur
                # The next query tile into the other buffer (past the block's end: masked, nothing read), and its
                # vectors, while this step computes.
                o_m = m0 + BM + gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
                m_ok = o_m < length
                row_q = (start + o_m) * H + i_h
                _async_rows(q_s.index(1 - cur), q_ptr, row_q, m_ok, D, blk)
                _async_rows(do_s.index(1 - cur), do_ptr, row_q, m_ok, D, blk)
                _query_vectors(rq_s.index(1 - cur), lse_s.index(1 - cur), dl_s.index(1 - cur), rq_ptr, lse_ptr,
                               delta_ptr, m0 + BM, start, length, H, i_h, BM, vec_l)
                async_copy.commit_group()
                s_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, s_l))
                b_rq = rq_s.index(cur).load(gl.SliceLayout(0, s_l))
                b_lse = lse_s.index(cur).load(gl.SliceLayout(0, s_l))
                b_delta = dl_s.index(cur).load(gl.SliceLayout(0, s_l))
                # (A key row past the block's end is not masked: it feeds only its own dk and dv rows, which are not
                # written and are zeroed before the gamma_k sum; query columns past the end were read as zeros.)
                b_pt = gl.where(thr[:, None] <= s_m[None, :], gl.exp2(b_st * b_rq[None, :] - b_lse[None, :]), 0.0)
                b_dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt_tok,))
                pt_s.store(b_pt.to(pt_s.dtype))
                dst_s.store((b_pt * (b_dpt * b_lam - b_delta[None, :]) * b_rq[None, :]).to(dst_s.dtype))
                fence_async_shared()
                _cta_barrier()
                b_dv = warpgroup_mma(pt_s, do_t, b_dv, is_async=True)
                b_dk = warpgroup_mma(dst_s, q_t, b_dk, is_async=True)
                async_copy.wait_group(0)
                fence_async_shared()
                _cta_barrier()
            # The tile's raw keys for the epilogue's RMSNorm backward, into the free query buffer while the last
            # products run (staged in the loop's last step instead, they cost the loop registers: spills).
            n_steps = gl.cdiv(length - lo, BM)
            x_n, x_row, x_ok = _key_rows(sel_ptr, i_b, i_h, j, NCT, W, start, length, H, BN, gl.SliceLayout(1, blk))
            _async_rows(q_s.index(n_steps % 2), k_ptr, x_row, x_ok, D, blk)
            async_copy.commit_group()
            b_dk, b_dv = warpgroup_mma_wait(num_outstanding=0, deps=(b_dk, b_dv))
            async_copy.wait_group(0)
            _cta_barrier()

            # dv scaled by the gate, then dk through its RMSNorm's backward; the tile's partial gamma_k sum.
            a_n, a_row, a_ok = _key_rows(sel_ptr, i_b, i_h, j, NCT, W, start, length, H, BN,
                                         gl.SliceLayout(1, acc_l))
            a_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_l))
            b_dv = gl.where(a_ok[:, None], b_dv * b_lam, 0.0)
            b_gq = gl.load(gq_ptr + a_d).to(gl.float32)
            b_x = q_s.index(n_steps % 2).load(acc_l).to(gl.float32)  # the raw keys, staged after the loop
            b_rk = gl.load(rk_ptr + a_row, mask=a_ok, other=0.0)
            b_dx, b_dg = _norm_bwd(b_dk * (scale * b_gq)[None, :], b_x, b_rk, gk_ptr, a_ok, D, acc_l)
            gl.store(dgk_ptr + (pid * H + i_h) * D + a_d, b_dg)
            if is_cache:
                p_e = ((i_b * H + i_h) * W + a_n)[:, None] * D + a_d[None, :]
                e_ok = (a_n < W)[:, None]
                gl.store(pdv_ptr + p_e, b_dv, mask=e_ok)
                gl.store(pdk_ptr + p_e, b_dx, mask=e_ok)
                # The reduction's key: the slot's token row, SENTINEL for an empty slot (sorted last).
                d_n, d_row, d_ok = _key_rows(sel_ptr, i_b, i_h, j, NCT, W, start, length, H, BN, vec_l)
                gl.store(dest_ptr + (i_b * H + i_h) * W + d_n, gl.where(d_ok, d_row, SENTINEL), mask=d_n < W)
            else:
                p_k = a_row[:, None] * D + a_d[None, :]
                gl.store(dv_ptr + p_k, b_dv.to(dv_ptr.dtype.element_ty), mask=a_ok[:, None])
                gl.store(dk_ptr + p_k, b_dx.to(dk_ptr.dtype.element_ty), mask=a_ok[:, None])

    @gluon.jit
    def _cache_fwd_gluon_kernel(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr, sink_ptr,
                                gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, oc_ptr, H, NQT, scale, W,
                                D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STORE_OC: gl.constexpr,
                                num_warps: gl.constexpr):
        """The forward of a query tile (as ``_cache_fwd_kernel``; with ``STORE_OC`` also ``o_cache``): one
        warpgroup, the scores from shared memory (scaled queries, gathered key tiles by ``cp.async``), the
        probabilities from registers into the output product. Small enough for two programs per SM, which take
        turns at the tensor cores while the other waits for its next key tile."""
        blk: gl.constexpr = _row_layout(num_warps)
        s_l: gl.constexpr = _mma_layout(BN, num_warps)
        acc_l: gl.constexpr = _mma_layout(D, num_warps)
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        pid = gl.program_id(0)
        i_h = gl.program_id(1).to(gl.int64)
        i_b = (pid // NQT).to(gl.int64)
        q0 = (pid % NQT) * BM
        start = gl.load(blk_start_ptr + i_b).to(gl.int64)
        length = gl.load(blk_len_ptr + i_b)
        if q0 < length:
            sd_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16)
            q_s = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BM, D], sd_sl)
            k_s = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [BN, D], sd_sl)
            v_s = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [BN, D], sd_sl)
            v1_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            rk_s = gl.allocate_shared_memory(gl.float32, [BN], v1_sl)

            NCT = gl.cdiv(W, BN)
            n_tiles = NCT + gl.cdiv(gl.minimum(q0 + BM, length), BN)  # own tiles up to the tile's last query
            # K (with its rstd) and V in separate cp.async groups: a step waits for K, and V arrives while the
            # scores and the softmax are computed; the next K is loaded as soon as the scores are (during the
            # softmax and the output product), the next V as soon as the output product is done.
            o_n, row, ok = _key_rows(sel_ptr, i_b, i_h, 0, NCT, W, start, length, H, BN, gl.SliceLayout(1, blk))
            _async_rows(k_s, k_ptr, row, ok, D, blk)
            o_n, row_v, ok_v = _key_rows(sel_ptr, i_b, i_h, 0, NCT, W, start, length, H, BN, vec_l)
            _async_vec(rk_s, rk_ptr, row_v, ok_v)
            async_copy.commit_group()
            _async_rows(v_s, v_ptr, row, ok, D, blk)
            async_copy.commit_group()
            o_m = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
            m_ok = o_m < length
            row_q = (start + o_m) * H + i_h
            _scaled_rows_to_smem(q_s, q_ptr, rq_ptr, gq_ptr, gk_ptr, row_q, m_ok, scale * 1.4426950408889634, D, blk)

            s_m = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_l))
            # The softmax starts from the sink: m = sink (log2 units), l = 1.
            b_m = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_l)) + \
                gl.load(sink_ptr + i_h).to(gl.float32) * 1.4426950408889634
            b_l = gl.full([BM], 1.0, gl.float32, gl.SliceLayout(1, s_l))
            b_acc = gl.zeros([BM, D], gl.float32, acc_l)
            s_zero = gl.zeros([BM, BN], gl.float32, s_l)
            for j in range(0, n_tiles):
                async_copy.wait_group(1)  # K j and its rstd (V j may still be in flight)
                fence_async_shared()
                _cta_barrier()
                b_rk = rk_s.load(gl.SliceLayout(0, s_l))
                thr = _key_thresholds(b_rk, j, NCT, BN, gl.SliceLayout(0, s_l))
                b_s = warpgroup_mma(q_s, k_s.permute((1, 0)), s_zero, use_acc=False) * b_rk[None, :]
                _cta_barrier()  # the warpgroup is done with K j and its rstd
                # (Names local to each branch: nothing computed for a load stays live in registers after it.)
                if j + 1 < n_tiles:
                    k_n, k_row, k_ok = _key_rows(sel_ptr, i_b, i_h, j + 1, NCT, W, start, length, H, BN,
                                                 gl.SliceLayout(1, blk))
                    _async_rows(k_s, k_ptr, k_row, k_ok, D, blk)
                    r_n, r_row, r_ok = _key_rows(sel_ptr, i_b, i_h, j + 1, NCT, W, start, length, H, BN, vec_l)
                    _async_vec(rk_s, rk_ptr, r_row, r_ok)
                async_copy.commit_group()
                b_s = gl.where(thr[None, :] <= s_m[:, None], b_s, float("-inf"))
                b_m_new = gl.maximum(b_m, gl.max(b_s, axis=1))
                b_alpha = gl.exp2(b_m - b_m_new)
                b_p = gl.exp2(b_s - b_m_new[:, None])
                b_l = b_l * b_alpha + gl.sum(b_p, axis=1)
                b_m = b_m_new
                b_acc = b_acc * gl.convert_layout(b_alpha, gl.SliceLayout(1, acc_l))[:, None]
                async_copy.wait_group(1)  # V j (the next K may still be in flight)
                fence_async_shared()
                _cta_barrier()
                b_acc = warpgroup_mma(gl.convert_layout(b_p.to(v_s.dtype), p_l), v_s, b_acc)
                _cta_barrier()  # the warpgroup is done with V j
                if j + 1 < n_tiles:
                    v_n, v_row, v_ok = _key_rows(sel_ptr, i_b, i_h, j + 1, NCT, W, start, length, H, BN,
                                                 gl.SliceLayout(1, blk))
                    _async_rows(v_s, v_ptr, v_row, v_ok, D, blk)
                async_copy.commit_group()
            async_copy.wait_group(0)
            _cta_barrier()
            s_row = (start + s_m) * H + i_h
            gl.store(lse_ptr + s_row, b_m + gl.log2(b_l), mask=s_m < length)
            a_m = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
            a_ok = a_m < length
            a_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_l))
            p_o = ((start + a_m) * H + i_h)[:, None] * D + a_d[None, :]
            b_oc = b_acc / gl.convert_layout(b_l, gl.SliceLayout(1, acc_l))[:, None]
            b_lam = _sigmoid(gl.load(gate_ptr + i_h).to(gl.float32))
            # o_state is loaded here, not staged in the free key buffer during the last tile: that staging made
            # Triton 3.6 spill 40 bytes in the loop, and the forward ran 2.6% slower with it on an H200.
            b_os = gl.load(os_ptr + p_o, mask=a_ok[:, None], other=0.0).to(gl.float32)
            gl.store(o_ptr + p_o, (b_os + b_lam * b_oc).to(o_ptr.dtype.element_ty), mask=a_ok[:, None])
            if STORE_OC:
                gl.store(oc_ptr + p_o, b_oc.to(oc_ptr.dtype.element_ty), mask=a_ok[:, None])
