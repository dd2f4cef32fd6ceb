"""The ``"triton"`` backend of ``hola_attention``: fla's GDN with the score, Triton selection and cache attention.

Shape legend: B batch, T tokens, H heads, D head dim, N sequences, NB blocks, W window.

Pipeline (HOLA_SPEC section 1):
1. state path and score: :func:`hola_titan.kernels.fla_gdn.gdn_with_scores` (fla-core, the score from fla's own
   per-token update); on a CPU under ``TRITON_INTERPRET=1`` the fp32 reference state path stands in for fla,
   whose chunk kernels do not run in the interpreter;
2. selection: :func:`hola_titan.kernels.hola_triton_select.select_topw` (``evict="score"``) or the recency window;
3. cache attention with the fused RMSNorms, sink and ``o_state + sigmoid(gate) o_cache`` epilogue:
   :mod:`hola_titan.kernels.hola_triton_attn`, as the custom op ``hola::cache_attn`` (fake and autograd
   registrations; its backward is the custom op ``hola::cache_attn_bwd``).
Calls with an ``initial_cache`` are served by the reference backend (see ``hola_titan.ops``).
"""

from __future__ import annotations

import functools
import os

import torch

from hola_titan.kernels import hola_triton_select as _select
from hola_titan.kernels.hola_cache import HolaCache
from hola_titan.kernels.hola_triton_select import KEY_EMPTY, BlockTable, build_block_table, keys_to_index

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.compiler.assume_constant_result
def triton_importable() -> bool:
    return _select.triton is not None


@torch.compiler.assume_constant_result
def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _gpu_kernels_available() -> bool:
    from hola_titan.kernels.fla_gdn import fla_available
    return triton_importable() and fla_available()


@torch.compiler.assume_constant_result
def gpu_kernels_available() -> bool:
    """Triton and the pinned fla-core import (what the Triton and SDPA backends need on CUDA)."""
    return _gpu_kernels_available()


def is_supported(q: torch.Tensor) -> bool:
    """Whether the Triton and SDPA backends take inputs like ``q`` (head dim and dtype)."""
    return q.shape[-1] in SUPPORTED_HEAD_DIMS and q.dtype in SUPPORTED_DTYPES


def check_supported(q: torch.Tensor, backend: str) -> None:
    """``ValueError`` naming the argument when the Triton or SDPA backend cannot take these inputs."""
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim {d} is not supported by backend {backend!r}; use one of {SUPPORTED_HEAD_DIMS} "
                         "or backend='reference'")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} is not supported by backend {backend!r}; use float16, bfloat16 or "
                         "float32, or backend='reference'")


# ----------------------------------------------------------------------------------------------------------------
# Custom ops: cache attention forward and backward.


@torch.library.custom_op("hola::cache_attn", mutates_args=())
def cache_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_state: torch.Tensor, gamma_q: torch.Tensor,
                  gamma_k: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor, sel: torch.Tensor,
                  blk_start: torch.Tensor, blk_len: torch.Tensor, block: int,
                  window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, o_cache, lse, r_q, r_k)`` for ``[B, T, H, D]`` inputs; see :mod:`hola_triton_attn`."""
    from hola_titan.kernels.hola_triton_attn import cache_attention_fwd
    q, k, v, o_state = (x.contiguous() for x in (q, k, v, o_state))
    with _device_ctx(q):
        return cache_attention_fwd(q, k, v, o_state, gamma_q.contiguous(), gamma_k.contiguous(), sink.contiguous(),
                                   gate.contiguous(), sel.contiguous(), blk_start, blk_len, block=block,
                                   window=window)


@cache_attn_op.register_fake
def _(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window):
    stats = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(q), stats, torch.empty_like(stats), torch.empty_like(stats))


@torch.library.custom_op("hola::cache_attn_bwd", mutates_args=())
def cache_attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, oc: torch.Tensor,
                      lse: torch.Tensor, rq: torch.Tensor, rk: torch.Tensor, gamma_q: torch.Tensor,
                      gamma_k: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor, sel: torch.Tensor,
                      blk_start: torch.Tensor, blk_len: torch.Tensor, block: int,
                      window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dgamma_q, dgamma_k, dsink, dgate)``, parameter gradients in float32."""
    from hola_titan.kernels.hola_triton_attn import cache_attention_bwd
    with _device_ctx(q):
        return cache_attention_bwd(do.contiguous(), q, k, v, oc, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel,
                                   blk_start, blk_len, block=block, window=window)


@cache_attn_bwd_op.register_fake
def _(do, q, k, v, oc, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            gamma_q.new_empty(gamma_q.shape, dtype=torch.float32),
            gamma_k.new_empty(gamma_k.shape, dtype=torch.float32),
            sink.new_empty(sink.shape, dtype=torch.float32), gate.new_empty(gate.shape, dtype=torch.float32))


def _cache_attn_setup(ctx, inputs, output):
    q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window = inputs
    _, oc, lse, rq, rk = output
    ctx.save_for_backward(q, k, v, oc, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len)
    ctx.block, ctx.window = block, window


def _cache_attn_backward(ctx, do, doc, dlse, drq, drk):
    q, k, v, oc, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len = ctx.saved_tensors
    dq, dk, dv, dgq, dgk, dsink, dgate = cache_attn_bwd_op(
        do, q.contiguous(), k.contiguous(), v.contiguous(), oc, lse, rq, rk, gamma_q.contiguous(),
        gamma_k.contiguous(), sink.contiguous(), gate.contiguous(), sel, blk_start, blk_len, ctx.block, ctx.window)
    return (dq, dk, dv, do, dgq.to(gamma_q.dtype), dgk.to(gamma_k.dtype), dsink.to(sink.dtype), dgate.to(gate.dtype),
            None, None, None, None, None)


torch.library.register_autograd("hola::cache_attn", _cache_attn_backward, setup_context=_cache_attn_setup)


@torch.library.custom_op("hola::select_topw", mutates_args=())
def select_topw_op(m: torch.Tensor, blk_start: torch.Tensor, blk_len: torch.Tensor, doc_first_blk: torch.Tensor,
                   doc_num_blk: torch.Tensor, block: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Score selection: ``(sel [NB, H, W] int32, final keys [N, H, W] int64)`` for ``m`` ``[B * T, H]`` float32."""
    table = BlockTable(blk_start=blk_start, blk_len=blk_len, blk_doc_start=blk_start, doc_start=doc_first_blk,
                       doc_len=doc_num_blk, doc_first_blk=doc_first_blk, doc_num_blk=doc_num_blk, block=block)
    with _device_ctx(m):
        return _select.select_topw(m.contiguous(), table, window)


@select_topw_op.register_fake
def _(m, blk_start, blk_len, doc_first_blk, doc_num_blk, block, window):
    h = m.shape[1]
    return (m.new_empty(blk_start.shape[0], h, window, dtype=torch.int32),
            m.new_empty(doc_first_blk.shape[0], h, window, dtype=torch.int64))


def _device_ctx(x: torch.Tensor):
    import contextlib
    return torch.cuda.device(x.device.index) if x.device.type == "cuda" else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------
# The backend.


def state_path(q, k, v, g, beta, *, initial_state, cu_seqlens, output_final_state, impl: str = "auto"):
    """fla on CUDA, the fp32 reference elsewhere: ``(o_state in q.dtype, m [B, T, H] float32, final_state)``.

    ``impl="reference"`` forces the reference (tests of the cache path alone on a GPU).
    """
    if impl == "fla" or (impl == "auto" and q.device.type == "cuda"):
        from hola_titan.kernels.fla_gdn import gdn_with_scores
        fn = gdn_with_scores
    else:
        from hola_titan.kernels.fla_gdn import reference_gdn_with_scores
        fn = reference_gdn_with_scores
    o_state, m, final_state = fn(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 output_final_state=output_final_state)
    return o_state.to(q.dtype), m, final_state


def select(m: torch.Tensor, table: BlockTable, *, window: int, evict: str, num_heads: int):
    """``(sel [NB, H, W] int32, final top-W keys [N, H, W] or None)`` for ``m`` ``[B * T, H]``."""
    if window == 0:
        return torch.empty(table.num_blocks, num_heads, 0, dtype=torch.int32, device=m.device), None
    if evict == "recency":
        return _select.select_recency(table, num_heads, window), None
    return select_topw_op(m, table.blk_start, table.blk_len, table.doc_first_blk, table.doc_num_blk, table.block,
                          window)


def hola_attention_triton(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int, evict: str,
                          cu_seqlens=None, initial_state=None, output_final_state: bool = False,
                          output_final_cache: bool = False, selected: torch.Tensor | None = None,
                          return_aux: bool = False, state_impl: str = "auto"):
    """The Triton backend (arguments validated by ``hola_titan.ops.hola_attention``; no ``initial_cache``).

    ``selected`` (``[NB, H, W]`` int32 flat token indices, ``-1`` empty) replaces the selection, for tests that
    compare reading given the same indices. With ``return_aux`` the result gains a dict with the scores ``m``
    ``[B, T, H]``, the selection ``sel`` and the block table. ``state_impl``: see :func:`state_path`.
    Returns ``(o, final_state, final_cache[, aux])``.
    """
    bsz, seq_len, h, d = q.shape
    o_state, m, final_state = state_path(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                         output_final_state=output_final_state, impl=state_impl)
    aux = {"m": m}
    if evict == "none":
        return (o_state, final_state, None, aux) if return_aux else (o_state, final_state, None)
    table = build_block_table(bsz, seq_len, cu_seqlens, block, q.device)
    m_flat = m.reshape(bsz * seq_len, h)
    final_keys = None
    if selected is None:
        sel, final_keys = select(m_flat, table, window=window, evict=evict, num_heads=h)
    else:
        sel = selected.to(device=q.device, dtype=torch.int32).contiguous()
    o, *_ = cache_attn_op(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, table.blk_start, table.blk_len,
                          block, window)
    final_cache = None
    if output_final_cache:
        final_cache = final_cache_from_selection(q, k, v, m_flat, sel, final_keys, table, window=window, block=block,
                                                 evict=evict)
    aux.update(sel=sel, table=table)
    return (o, final_state, final_cache, aux) if return_aux else (o, final_state, final_cache)


def final_cache_from_selection(q, k, v, m_flat, sel, final_keys, table: BlockTable, *, window: int, block: int,
                               evict: str) -> HolaCache:
    """The :class:`HolaCache` after the call, from the backend's selection (no initial cache).

    The persistent cache after a sequence is the top W over its completed blocks: the merged keys of the
    selection kernel when the last block is complete, else the cache the last (unfinished) block read.
    """
    bsz, seq_len, h, d = q.shape
    device = q.device
    n = table.num_seqs
    last_blk = (table.doc_first_blk + table.doc_num_blk - 1).long()
    complete = (table.doc_len % block == 0)
    if window == 0:
        top = torch.empty(n, h, 0, dtype=torch.int32, device=device)
    elif evict == "score" and final_keys is not None:
        top = torch.where(complete[:, None, None], keys_to_index(final_keys), sel[last_blk.clamp_min(0)])
    elif evict == "recency":  # the W tokens before the end of the last completed block
        end = (table.doc_start + (table.doc_len // block) * block).long()
        pos = end[:, None] - 1 - torch.arange(window, device=device)[None, :]
        pos = torch.where(pos >= table.doc_start[:, None].long(), pos, torch.full_like(pos, -1))
        top = pos[:, None, :].expand(n, h, window).to(torch.int32)
    else:
        raise ValueError("output_final_cache: needs the backend's own selection, not a given one")
    ok = top >= 0
    idx = top.long().clamp_min(0)
    heads = torch.arange(h, device=device)[None, :, None]
    k_flat, v_flat = k.reshape(-1, h, d), v.reshape(-1, h, d)
    zero = torch.zeros((), dtype=q.dtype, device=device)
    scores = torch.where(ok, m_flat[idx, heads], torch.full((), float("-inf"), device=device))
    positions = torch.where(ok, idx - table.doc_start.long()[:, None, None], torch.full_like(idx, -1))
    # Unfinished block: positions len - len % C ... len - 1 of each sequence.
    rem = table.doc_len.long() % block
    offs = torch.arange(block, device=device)
    buf_tok = (table.doc_start + table.doc_len).long()[:, None] - rem[:, None] + offs[None, :]
    buf_ok = offs[None, :] < rem[:, None]
    buf_tok = torch.where(buf_ok, buf_tok, torch.zeros_like(buf_tok))
    buf_scores = torch.where(buf_ok[:, None, :], m_flat[buf_tok].transpose(1, 2), float("-inf"))
    return HolaCache(
        scores=scores.to(torch.float32), positions=positions,
        k=torch.where(ok[..., None], k_flat[idx, heads], zero), v=torch.where(ok[..., None], v_flat[idx, heads], zero),
        buf_scores=buf_scores.to(torch.float32),
        buf_k=torch.where(buf_ok[:, None, :, None], k_flat[buf_tok].transpose(1, 2), zero),
        buf_v=torch.where(buf_ok[:, None, :, None], v_flat[buf_tok].transpose(1, 2), zero),
        seen=table.doc_len.long(), window=window, block=block, evict=evict)


__all__ = ["hola_attention_triton", "check_supported", "triton_importable", "interpreting", "KEY_EMPTY"]
