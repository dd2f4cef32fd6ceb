"""The custom ops of the Triton backend: cache attention (forward, backward) and the score selection.

``hola::cache_attn`` (fake and autograd registrations; its backward is ``hola::cache_attn_bwd``) wraps
:mod:`hola_titan.kernels.hola.triton_kernels`, ``hola::select_topw`` wraps
:func:`hola_titan.kernels.hola.selection.select_topw`. Custom ops, so that a compiled block neither traces
into Triton launches nor breaks its graph around them.
"""

from __future__ import annotations

import torch

from hola_titan.kernels.hola import selection as _select
from hola_titan.kernels.runtime.documents import BlockTable


@torch.library.custom_op("hola::cache_attn", mutates_args=())
def cache_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_state: torch.Tensor, gamma_q: torch.Tensor,
                  gamma_k: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor, sel: torch.Tensor,
                  blk_start: torch.Tensor, blk_len: torch.Tensor, block: int, window: int,
                  save_output: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """``(o, lse, r_q, r_k, o_cache)`` for ``[B, T, H, D]`` inputs; see :mod:`~hola_titan.kernels.hola.triton_kernels`.
    ``o_cache``, the cache read's own output that the backward then reads instead of forming ``delta`` over the keys,
    only with ``save_output`` (else an empty tensor)."""
    from hola_titan.kernels.hola.triton_kernels import cache_attention_fwd
    q, k, v, o_state = (x.contiguous() for x in (q, k, v, o_state))
    with _device_ctx(q):
        out = cache_attention_fwd(q, k, v, o_state, gamma_q.contiguous(), gamma_k.contiguous(), sink.contiguous(),
                                  gate.contiguous(), sel.contiguous(), blk_start, blk_len, block=block,
                                  window=window, save_output=save_output)
    return out if save_output else (*out, q.new_empty(0))


@cache_attn_op.register_fake
def _(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window, save_output=False):
    stats = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return (torch.empty_like(q), stats, torch.empty_like(stats), torch.empty_like(stats),
            torch.empty_like(q) if save_output else q.new_empty(0))


@torch.library.custom_op("hola::cache_attn_bwd", mutates_args=())
def cache_attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                      rq: torch.Tensor, rk: torch.Tensor, gamma_q: torch.Tensor,
                      gamma_k: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor, sel: torch.Tensor,
                      blk_start: torch.Tensor, blk_len: torch.Tensor, block: int, window: int,
                      o_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
    """``(dq, dk, dv, dgamma_q, dgamma_k, dsink, dgate)``, parameter gradients in float32; ``o_cache`` the
    forward's saved one, if it kept it."""
    from hola_titan.kernels.hola.triton_kernels import cache_attention_bwd
    with _device_ctx(q):
        return cache_attention_bwd(do.contiguous(), q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel,
                                   blk_start, blk_len, block=block, window=window,
                                   o_cache=None if o_cache is None else o_cache.contiguous())


@cache_attn_bwd_op.register_fake
def _(do, q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window, o_cache=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            gamma_q.new_empty(gamma_q.shape, dtype=torch.float32),
            gamma_k.new_empty(gamma_k.shape, dtype=torch.float32),
            sink.new_empty(sink.shape, dtype=torch.float32), gate.new_empty(gate.shape, dtype=torch.float32))


def _cache_attn_setup(ctx, inputs, output):
    q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window, _ = inputs
    _, lse, rq, rk, o_cache = output
    # The saved outputs take no gradient: no zero-filled gradients for them.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, o_cache)
    ctx.mark_non_differentiable(o_cache)  # kept for the backward only: no gradient flows into it
    ctx.block, ctx.window = block, window


def _cache_attn_backward(ctx, do, dlse, drq, drk, do_cache):
    q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, o_cache = ctx.saved_tensors
    if do is None:  # the output was not used
        do = torch.zeros_like(q)
    dq, dk, dv, dgq, dgk, dsink, dgate = cache_attn_bwd_op(
        do, q.contiguous(), k.contiguous(), v.contiguous(), lse, rq, rk, gamma_q.contiguous(),
        gamma_k.contiguous(), sink.contiguous(), gate.contiguous(), sel, blk_start, blk_len, ctx.block, ctx.window,
        o_cache if o_cache.numel() else None)  # empty: not kept (or nothing to keep)
    return (dq, dk, dv, do, dgq.to(gamma_q.dtype), dgk.to(gamma_k.dtype), dsink.to(sink.dtype), dgate.to(gate.dtype),
            None, None, None, None, None, None)


torch.library.register_autograd("hola::cache_attn", _cache_attn_backward, setup_context=_cache_attn_setup)


@torch.library.custom_op("hola::cache_attn_pre", mutates_args=())
def cache_attn_pre_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_state: torch.Tensor,
                      gamma_q: torch.Tensor, gamma_k: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor,
                      sel: torch.Tensor, blk_start: torch.Tensor, blk_len: torch.Tensor, pre_k: torch.Tensor,
                      pre_v: torch.Tensor, pre_start: torch.Tensor, pre_len: torch.Tensor, block: int,
                      window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hola::cache_attn`` with key rows ahead of the tokens (a call that continues from a cache):
    ``(o, lse, r_q, r_k, r_pre)``; see :class:`~hola_titan.kernels.hola.triton_kernels.Prefix` for the prefix
    arguments ``pre_k``, ``pre_v`` ``[A, H, D]``, ``pre_start``, ``pre_len`` ``[NB]``."""
    from hola_titan.kernels.hola.triton_kernels import Prefix, cache_attention_fwd
    q, k, v, o_state, pre_k, pre_v = (x.contiguous() for x in (q, k, v, o_state, pre_k, pre_v))
    with _device_ctx(q):
        return cache_attention_fwd(q, k, v, o_state, gamma_q.contiguous(), gamma_k.contiguous(), sink.contiguous(),
                                   gate.contiguous(), sel.contiguous(), blk_start, blk_len, block=block,
                                   window=window, prefix=Prefix(pre_k, pre_v, pre_start, pre_len))


@cache_attn_pre_op.register_fake
def _(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, pre_k, pre_v, pre_start, pre_len,
      block, window):
    stats = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return (torch.empty_like(q), stats, torch.empty_like(stats), torch.empty_like(stats),
            pre_k.new_empty(pre_k.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("hola::cache_attn_pre_bwd", mutates_args=())
def cache_attn_pre_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                          rq: torch.Tensor, rk: torch.Tensor, gamma_q: torch.Tensor, gamma_k: torch.Tensor,
                          sink: torch.Tensor, gate: torch.Tensor, sel: torch.Tensor, blk_start: torch.Tensor,
                          blk_len: torch.Tensor, pre_k: torch.Tensor, pre_v: torch.Tensor, r_pre: torch.Tensor,
                          pre_start: torch.Tensor, pre_len: torch.Tensor, block: int,
                          window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
    """``(dq, dk, dv, dgamma_q, dgamma_k, dsink, dgate, dpre_k, dpre_v)``, parameter gradients in float32."""
    from hola_titan.kernels.hola.triton_kernels import Prefix, cache_attention_bwd
    with _device_ctx(q):
        return cache_attention_bwd(do.contiguous(), q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel,
                                   blk_start, blk_len, block=block, window=window,
                                   prefix=Prefix(pre_k, pre_v, pre_start, pre_len), rka=r_pre)


@cache_attn_pre_bwd_op.register_fake
def _(do, q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, pre_k, pre_v, r_pre,
      pre_start, pre_len, block, window):
    f32 = torch.float32
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), gamma_q.new_empty(gamma_q.shape, dtype=f32),
            gamma_k.new_empty(gamma_k.shape, dtype=f32), sink.new_empty(sink.shape, dtype=f32),
            gate.new_empty(gate.shape, dtype=f32), torch.empty_like(pre_k), torch.empty_like(pre_v))


def _cache_attn_pre_setup(ctx, inputs, output):
    (q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, pre_k, pre_v, pre_start, pre_len,
     block, window) = inputs
    _, lse, rq, rk, r_pre = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, pre_k, pre_v,
                          r_pre, pre_start, pre_len)
    ctx.block, ctx.window = block, window


def _cache_attn_pre_backward(ctx, do, dlse, drq, drk, dr_pre):
    (q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, pre_k, pre_v, r_pre, pre_start,
     pre_len) = ctx.saved_tensors
    if do is None:  # the output was not used
        do = torch.zeros_like(q)
    dq, dk, dv, dgq, dgk, dsink, dgate, dpk, dpv = cache_attn_pre_bwd_op(
        do, q.contiguous(), k.contiguous(), v.contiguous(), lse, rq, rk, gamma_q.contiguous(), gamma_k.contiguous(),
        sink.contiguous(), gate.contiguous(), sel, blk_start, blk_len, pre_k.contiguous(), pre_v.contiguous(), r_pre,
        pre_start, pre_len, ctx.block, ctx.window)
    return (dq, dk, dv, do, dgq.to(gamma_q.dtype), dgk.to(gamma_k.dtype), dsink.to(sink.dtype), dgate.to(gate.dtype),
            None, None, None, dpk, dpv, None, None, None, None)


torch.library.register_autograd("hola::cache_attn_pre", _cache_attn_pre_backward,
                                setup_context=_cache_attn_pre_setup)


@torch.library.custom_op("hola::select_topw", mutates_args=())
def select_topw_op(m: torch.Tensor, blk_start: torch.Tensor, blk_len: torch.Tensor, doc_first_blk: torch.Tensor,
                   doc_num_blk: torch.Tensor, block: int, window: int,
                   init_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Score selection: ``(sel [NB, H, W] int32, final keys [N, H, W] int64)`` for ``m`` ``[B * T, H]`` float32,
    starting every sequence from ``init_keys`` ``[N, H, W]`` when given (see ``select_topw``)."""
    table = BlockTable(blk_start=blk_start, blk_len=blk_len, blk_doc_start=blk_start, doc_start=doc_first_blk,
                       doc_len=doc_num_blk, doc_first_blk=doc_first_blk, doc_num_blk=doc_num_blk, block=block)
    with _device_ctx(m):
        return _select.select_topw(m.contiguous(), table, window,
                                   None if init_keys is None else init_keys.contiguous())


@select_topw_op.register_fake
def _(m, blk_start, blk_len, doc_first_blk, doc_num_blk, block, window, init_keys=None):
    h = m.shape[1]
    return (m.new_empty(blk_start.shape[0], h, window, dtype=torch.int32),
            m.new_empty(doc_first_blk.shape[0], h, window, dtype=torch.int64))


def _device_ctx(x: torch.Tensor):
    import contextlib
    return torch.cuda.device(x.device.index) if x.device.type == "cuda" else contextlib.nullcontext()

