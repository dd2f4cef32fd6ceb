"""The whole Triton HOLA layer as one custom op pair, so its backward can overlap the two paths (CUDA, fla).

Shape legend: B batch, T tokens, H heads, D head dim, N sequences, NB blocks, W window.

Why. In the layered form (``triton_backend.hola_attention_triton``) autograd runs the cache-attention backward and
then fla's GDN backward, one after the other on one stream. fla's recurrent stages (the recomputed forward state
and the state-gradient pass, about a third of the GDN forward + backward at the 340M layer shape) have only
N * H * (D / 64) programs, one or two per multiprocessor, and leave most of the chip waiting on latency, while the
cache-attention backward is fully parallel. Here one backward op launches
the cache-attention backward on a side stream and fla's backward on the current one, joins them, and adds the two
paths' gradients of q, k and v. It is bit-equal to the layered form; what it saves per layer call is measured by
``scripts/bench_hola_attention.py`` (``hola_triton_overlap``; numbers in docs/LOG.md).

Scope: evict "score" or "recency" from an empty cache, on CUDA through fla, head dims fla runs unpadded
(D >= 128 on Hopper with Triton < 3.7.1, see ``gdn/fla_bridge.py``). Ask for it with
``hola_attention(..., overlap_backward=True)``; the trainer does by default (``model.overlap_backward`` unset or
true), since in 340M training on an H200 it was about 1% faster with every loss equal (docs/LOG.md, 2026-12-04).
"""

from __future__ import annotations

import torch

from hola_titan.kernels.gdn.fla_bridge import _gdn_bwd_impl, _gdn_fwd_impl, ensure_backward_checked, padded_head_dim
from hola_titan.kernels.runtime.documents import build_block_table, num_block_rows


def layered_because(head_dim: int, device: torch.device) -> str | None:
    """Why no call at ``head_dim`` on ``device`` can take this op (the trainer's paths line says it), or None."""
    if torch.device(device).type != "cuda":
        return "the overlapped op runs on CUDA only"
    if padded_head_dim(head_dim, device) != head_dim:
        return f"head dim {head_dim} is padded for fla on this GPU"
    return None


def applies(q: torch.Tensor, *, overlap_backward: bool, evict: str, initial_cache, selected, state_impl: str,
            output_final_cache: bool, return_aux: bool) -> bool:
    """Whether :func:`hola_layer` serves this call (see the module docstring); the layered form does the rest."""
    return (overlap_backward and evict in ("score", "recency") and initial_cache is None and selected is None
            and state_impl in ("auto", "fla") and not output_final_cache and not return_aux
            and layered_because(q.shape[-1], q.device) is None)


@torch.library.custom_op("hola::layer_fwd", mutates_args=())
def layer_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 gamma_q: torch.Tensor, gamma_k: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor,
                 initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                 chunk_indices: torch.Tensor | None, scale: float, output_final_state: bool, block: int, window: int,
                 evict: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor]:
    """``(o, final_state or empty, m, sel, blk_start, blk_len, then saved for backward: g_cum, a, lse, rq, rk)``.
    The backward has q and k: it remakes their l2norms rather than keeping a normalised copy of each."""
    from hola_titan.kernels.hola.stages import select
    from hola_titan.kernels.hola.triton_ops import _device_ctx
    from hola_titan.kernels.hola.triton_kernels import cache_attention_fwd

    bsz, seq_len, h, _ = q.shape
    with _device_ctx(q):
        o_state, m, final_state, _, _, _, _, g_cum, a = _gdn_fwd_impl(
            q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, scale, output_final_state)
        table = build_block_table(bsz, seq_len, cu_seqlens, block, q.device)
        sel, _ = select(m.reshape(bsz * seq_len, h), table, window=window, evict=evict, num_heads=h)
        o, lse, rq, rk = cache_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), o_state,
                                             gamma_q.contiguous(), gamma_k.contiguous(), sink.contiguous(),
                                             gate.contiguous(), sel, table.blk_start, table.blk_len,
                                             block=block, window=window)
    return o, final_state, m, sel, table.blk_start, table.blk_len, g_cum, a, lse, rq, rk


@layer_fwd_op.register_fake
def _(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, initial_state, cu_seqlens, chunk_indices, scale,
      output_final_state, block, window, evict):
    from hola_titan.kernels.gdn.fla_bridge import CHUNK
    bsz, seq_len, h, d = q.shape
    n = bsz if cu_seqlens is None else cu_seqlens.shape[0] - 1
    nb = num_block_rows(bsz, seq_len, cu_seqlens, block)
    f32 = torch.float32
    final = q.new_empty(n, h, d, d, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32)
    stats = q.new_empty(bsz, seq_len, h, dtype=f32)
    i32 = torch.int32
    return (torch.empty_like(q), final, torch.empty_like(stats), q.new_empty(nb, h, window, dtype=i32),
            q.new_empty(nb, dtype=i32), q.new_empty(nb, dtype=i32), g.new_empty(bsz, seq_len, h, dtype=f32),
            k.new_empty(bsz, seq_len, h, CHUNK), torch.empty_like(stats), torch.empty_like(stats),
            torch.empty_like(stats))


@torch.library.custom_op("hola::layer_bwd", mutates_args=())
def layer_bwd_op(do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 beta: torch.Tensor, gamma_q: torch.Tensor, gamma_k: torch.Tensor, sink: torch.Tensor,
                 gate: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                 chunk_indices: torch.Tensor | None, g_cum: torch.Tensor, a: torch.Tensor, lse: torch.Tensor,
                 rq: torch.Tensor, rk: torch.Tensor,
                 sel: torch.Tensor, blk_start: torch.Tensor, blk_len: torch.Tensor, scale: float, block: int,
                 window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dg, dbeta, dh0 or empty, dgamma_q, dgamma_k, dsink, dgate)``: the cache backward on a side
    stream, fla's backward on the current stream, joined before the gradients of q, k, v are summed."""
    from hola_titan.kernels.hola.triton_ops import _device_ctx
    from hola_titan.kernels.hola.triton_kernels import cache_attention_bwd

    do = do.contiguous()

    def cache_backward():
        return cache_attention_bwd(do, q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start,
                                   blk_len, block=block, window=window)

    no_rstd = lse.new_empty(0)  # the l2norms are remade from q and k (recompute_norms)
    with _device_ctx(q):
        if q.device.type != "cuda":  # the interpreter tests: one stream, one path after the other
            cache = cache_backward()
            dq, dk, dv, dg, db, dh0 = _gdn_bwd_impl(do, dht, q, no_rstd, k, no_rstd, v, g_cum, beta, a,
                                                    initial_state, cu_seqlens, chunk_indices, scale,
                                                    recompute_norms=True)
        else:
            main = torch.cuda.current_stream()
            side = _side_stream(q.device)
            side.wait_stream(main)  # do and everything saved are ready
            with torch.cuda.stream(side):
                cache = cache_backward()
            dq, dk, dv, dg, db, dh0 = _gdn_bwd_impl(do, dht, q, no_rstd, k, no_rstd, v, g_cum, beta, a,
                                                    initial_state, cu_seqlens, chunk_indices, scale,
                                                    recompute_norms=True)
            main.wait_stream(side)
            for t in cache:
                t.record_stream(main)  # made on the side stream, used and freed on this one
        dq_c, dk_c, dv_c, dgq, dgk, dsink, dgate = cache
        if dh0 is None:
            dh0 = do.new_empty(0, dtype=torch.float32)
        # The same sums, in the same dtype, as autograd's accumulation in the layered form.
        return dq + dq_c, dk + dk_c, dv + dv_c, dg, db, dh0, dgq, dgk, dsink, dgate


@layer_bwd_op.register_fake
def _(do, dht, q, k, v, beta, gamma_q, gamma_k, sink, gate, initial_state, cu_seqlens, chunk_indices, g_cum, a, lse,
      rq, rk, sel, blk_start, blk_len, scale, block, window):
    f32 = torch.float32
    dh0 = (torch.empty_like(initial_state, dtype=f32) if initial_state is not None else do.new_empty(0, dtype=f32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g_cum),
            torch.empty_like(beta), dh0, gamma_q.new_empty(gamma_q.shape, dtype=f32),
            gamma_k.new_empty(gamma_k.shape, dtype=f32), sink.new_empty(sink.shape, dtype=f32),
            gate.new_empty(gate.shape, dtype=f32))


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _setup(ctx, inputs, output):
    (q, k, v, g, beta, gamma_q, gamma_k, sink, gate, initial_state, cu_seqlens, chunk_indices, scale, ofs, block,
     window, evict) = inputs
    _, _, _, sel, blk_start, blk_len, g_cum, a, lse, rq, rk = output
    ctx.save_for_backward(q, k, v, beta, gamma_q, gamma_k, sink, gate, initial_state, cu_seqlens, chunk_indices,
                          g_cum, a, lse, rq, rk, sel, blk_start, blk_len)
    ctx.scale, ctx.output_final_state, ctx.block, ctx.window = scale, ofs, block, window
    ctx.g_dtype = g.dtype
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the outputs saved for backward


def _backward(ctx, do, dht, *unused):
    (q, k, v, beta, gamma_q, gamma_k, sink, gate, initial_state, cu_seqlens, chunk_indices, g_cum, a, lse, rq, rk,
     sel, blk_start, blk_len) = ctx.saved_tensors
    if do is None:  # only the final state was used
        do = torch.zeros_like(q)
    if not ctx.output_final_state or dht is None or dht.numel() == 0:
        dht = None
    # The kernels address rows as row * D: the forward ran on contiguous copies, so must the backward.
    q, k, v, beta, gamma_q, gamma_k, sink, gate = (
        t.contiguous() for t in (q, k, v, beta, gamma_q, gamma_k, sink, gate))
    dq, dk, dv, dg, db, dh0, dgq, dgk, dsink, dgate = layer_bwd_op(
        do, dht, q, k, v, beta, gamma_q, gamma_k, sink, gate, initial_state, cu_seqlens, chunk_indices, g_cum, a,
        lse, rq, rk, sel, blk_start, blk_len, ctx.scale, ctx.block, ctx.window)
    return (dq, dk, dv, dg.to(ctx.g_dtype), db.to(beta.dtype), dgq.to(gamma_q.dtype), dgk.to(gamma_k.dtype),
            dsink.to(sink.dtype), dgate.to(gate.dtype), dh0 if initial_state is not None else None,
            None, None, None, None, None, None, None)


torch.library.register_autograd("hola::layer_fwd", _backward, setup_context=_setup)


def hola_layer(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int, evict: str,
               cu_seqlens=None, chunk_indices=None, initial_state=None, output_final_state: bool = False,
               scale: float | None = None):
    """``(o, final_state or None, m, sel)``: the layer through :func:`layer_fwd_op` (see the module docstring);
    ``chunk_indices`` and ``scale`` as in :func:`~hola_titan.kernels.gdn.fla_bridge.gdn_with_scores`."""
    d = q.shape[-1]
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int64)
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32)
    if (not torch.compiler.is_compiling() and torch.is_grad_enabled()
            and any(x.requires_grad for x in (q, k, v, g, beta))):
        ensure_backward_checked(d, q.device, num_heads=q.shape[2], dtype=q.dtype, packed=cu_seqlens is not None)
    o, final_state, m, sel, *_ = layer_fwd_op(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, initial_state,
                                              cu_seqlens, chunk_indices, d ** -0.5 if scale is None else scale,
                                              output_final_state, block, window, evict)
    return o, (final_state if output_final_state else None), m, sel
