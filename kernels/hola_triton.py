"""The ``"triton"`` backend of ``hola_attention``: fla's GDN with the score, Triton selection and cache attention.

Shape legend: B batch, T tokens, H heads, D head dim, N sequences, NB blocks, W window.

Pipeline (DESIGN §1):
1. state path and score: :func:`hola_titan.kernels.fla_gdn.gdn_with_scores` (fla-core, the score from fla's own
   per-token update); on a CPU under ``TRITON_INTERPRET=1`` the fp32 reference state path stands in for fla,
   whose chunk kernels do not run in the interpreter;
2. selection: :func:`hola_titan.kernels.hola_triton_select.select_topw` (``evict="score"``) or the recency window;
3. cache attention with the fused RMSNorms, sink and ``o_state + sigmoid(gate) o_cache`` epilogue:
   :mod:`hola_titan.kernels.hola_triton_attn`, as the custom op ``hola::cache_attn`` (fake and autograd
   registrations; its backward is the custom op ``hola::cache_attn_bwd``).
Calls with an ``initial_cache`` run on an extended row layout that puts the cache's entries and buffered tokens in
front of each sequence (:func:`_continue_from_cache`).
"""

from __future__ import annotations

import functools

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
    """Whether this process's Triton kernels run in Triton's interpreter (CPU tensors). Triton decides when a
    kernel is defined (``TRITON_INTERPRET=1`` in the environment when these modules are imported), so the answer
    is read from a kernel itself, once, and is fixed for the process; nothing reads the environment later."""
    return _interpreting()


@functools.lru_cache(maxsize=None)
def _interpreting() -> bool:
    if not triton_importable():
        return False
    from hola_titan.kernels import hola_triton_attn
    return type(hola_triton_attn._rstd_kernel).__name__ == "InterpretedFunction"


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
                  window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, lse, r_q, r_k)`` for ``[B, T, H, D]`` inputs; see :mod:`hola_triton_attn`."""
    from hola_titan.kernels.hola_triton_attn import cache_attention_fwd
    q, k, v, o_state = (x.contiguous() for x in (q, k, v, o_state))
    with _device_ctx(q):
        return cache_attention_fwd(q, k, v, o_state, gamma_q.contiguous(), gamma_k.contiguous(), sink.contiguous(),
                                   gate.contiguous(), sel.contiguous(), blk_start, blk_len, block=block,
                                   window=window)


@cache_attn_op.register_fake
def _(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window):
    stats = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return torch.empty_like(q), stats, torch.empty_like(stats), torch.empty_like(stats)


@torch.library.custom_op("hola::cache_attn_bwd", mutates_args=())
def cache_attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                      rq: torch.Tensor, rk: torch.Tensor, gamma_q: torch.Tensor,
                      gamma_k: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor, sel: torch.Tensor,
                      blk_start: torch.Tensor, blk_len: torch.Tensor, block: int,
                      window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dgamma_q, dgamma_k, dsink, dgate)``, parameter gradients in float32."""
    from hola_titan.kernels.hola_triton_attn import cache_attention_bwd
    with _device_ctx(q):
        return cache_attention_bwd(do.contiguous(), q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel,
                                   blk_start, blk_len, block=block, window=window)


@cache_attn_bwd_op.register_fake
def _(do, q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            gamma_q.new_empty(gamma_q.shape, dtype=torch.float32),
            gamma_k.new_empty(gamma_k.shape, dtype=torch.float32),
            sink.new_empty(sink.shape, dtype=torch.float32), gate.new_empty(gate.shape, dtype=torch.float32))


def _cache_attn_setup(ctx, inputs, output):
    q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, block, window = inputs
    _, lse, rq, rk = output
    # The saved outputs take no gradient: no zero-filled gradients for them.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len)
    ctx.block, ctx.window = block, window


def _cache_attn_backward(ctx, do, dlse, drq, drk):
    q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len = ctx.saved_tensors
    if do is None:  # the output was not used
        do = torch.zeros_like(q)
    dq, dk, dv, dgq, dgk, dsink, dgate = cache_attn_bwd_op(
        do, q.contiguous(), k.contiguous(), v.contiguous(), lse, rq, rk, gamma_q.contiguous(),
        gamma_k.contiguous(), sink.contiguous(), gate.contiguous(), sel, blk_start, blk_len, ctx.block, ctx.window)
    return (dq, dk, dv, do, dgq.to(gamma_q.dtype), dgk.to(gamma_k.dtype), dsink.to(sink.dtype), dgate.to(gate.dtype),
            None, None, None, None, None)


torch.library.register_autograd("hola::cache_attn", _cache_attn_backward, setup_context=_cache_attn_setup)


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


# ----------------------------------------------------------------------------------------------------------------
# The backend.


def state_path(q, k, v, g, beta, *, initial_state, cu_seqlens, output_final_state, impl: str = "auto",
               chunk_indices=None, recompute_norms: bool = False):
    """fla on CUDA, the fp32 reference elsewhere: ``(o_state in q.dtype, m [B, T, H] float32, final_state)``.

    ``impl="reference"`` forces the reference (tests of the cache path alone on a GPU). ``chunk_indices``: fla's,
    made once per batch (``Documents.chunk_indices``), or None. ``recompute_norms``: the caller keeps these very
    ``q`` and ``k`` for its own backward, so fla's op keeps them too instead of normalised copies
    (:func:`~hola_titan.kernels.fla_gdn.gdn_with_scores`).
    """
    if impl == "fla" or (impl == "auto" and q.device.type == "cuda"):
        from hola_titan.kernels.fla_gdn import gdn_with_scores
        o_state, m, final_state = gdn_with_scores(q, k, v, g, beta, initial_state=initial_state,
                                                  cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                                  output_final_state=output_final_state,
                                                  recompute_norms=recompute_norms)
    else:
        from hola_titan.kernels.fla_gdn import reference_gdn_with_scores
        o_state, m, final_state = reference_gdn_with_scores(q, k, v, g, beta, initial_state=initial_state,
                                                            cu_seqlens=cu_seqlens,
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
                          initial_cache: HolaCache | None = None, output_final_cache: bool = False,
                          selected: torch.Tensor | None = None, return_aux: bool = False, state_impl: str = "auto",
                          overlap_backward: bool = False, chunk_indices: torch.Tensor | None = None,
                          block_table: BlockTable | None = None):
    """The Triton backend (arguments validated by ``hola_titan.ops.hola_attention``); ``chunk_indices`` as in
    :func:`state_path`; ``block_table``: the batch's table for ``block`` (``Documents.block_table``, made once per
    batch), or None to build it here.

    ``selected`` (``[NB, H, W]`` int32 flat token indices, ``-1`` empty) replaces the selection, for tests that
    compare reading given the same indices. With ``return_aux`` the result gains a dict with the scores ``m``
    ``[B, T, H]``, the selection ``sel`` and the block table. ``state_impl``: see :func:`state_path`.
    ``overlap_backward``: the layer as one op whose backward overlaps the two paths (:mod:`hola_triton_layer`).
    A call with an ``initial_cache`` runs on an extended row layout (:func:`_continue_from_cache`).
    Returns ``(o, final_state, final_cache[, aux])``.
    """
    bsz, seq_len, h, d = q.shape
    from hola_titan.kernels import hola_triton_layer
    if hola_triton_layer.applies(q, overlap_backward=overlap_backward, evict=evict, initial_cache=initial_cache,
                                 selected=selected, state_impl=state_impl, output_final_cache=output_final_cache,
                                 return_aux=return_aux):
        o, final_state, _, _ = hola_triton_layer.hola_layer(
            q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block, evict=evict,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, initial_state=initial_state,
            output_final_state=output_final_state)
        return o, final_state, None
    # The cache op of a call without an initial cache saves these same q and k for its backward.
    o_state, m, final_state = state_path(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                         output_final_state=output_final_state, impl=state_impl,
                                         chunk_indices=chunk_indices,
                                         recompute_norms=evict != "none" and initial_cache is None)
    aux = {"m": m}
    if evict == "none":
        return (o_state, final_state, None, aux) if return_aux else (o_state, final_state, None)
    if initial_cache is not None:
        if selected is not None:
            raise ValueError("selected: not supported together with initial_cache")
        o, final_cache, sel, table = _continue_from_cache(q, k, v, o_state, m, gamma_q, gamma_k, sink, gate,
                                                          cu_seqlens, initial_cache, window=window, block=block,
                                                          evict=evict, output_final_cache=output_final_cache)
        aux.update(sel=sel, table=table)
        return (o, final_state, final_cache, aux) if return_aux else (o, final_state, final_cache)
    table = block_table if block_table is not None else build_block_table(bsz, seq_len, cu_seqlens, block, q.device)
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
    doc_start, doc_len = table.doc_start.long(), table.doc_len.long()
    rows = torch.arange(bsz * seq_len, device=device)
    row_pos = rows - doc_start[torch.searchsorted(doc_start + doc_len, rows, right=True).clamp(max=n - 1)]
    return _cache_from_rows(k.reshape(-1, h, d), v.reshape(-1, h, d), m_flat, row_pos[:, None].expand(-1, h), top,
                            doc_start + doc_len - doc_len % block, doc_len % block, doc_len, window=window,
                            block=block, evict=evict)


def _cache_from_rows(k_rows, v_rows, m_rows, pos_rows, top, buf_start, rem, seen, *, window: int, block: int,
                     evict: str) -> HolaCache:
    """A :class:`HolaCache` gathered from flat rows ``[R, H, ...]``: the persistent entries at rows ``top``
    ``[N, H, W]`` (-1 empty; scores ``m_rows``, positions ``pos_rows``), the unfinished block the ``rem`` [N] rows
    from ``buf_start`` [N], ``seen`` [N] tokens."""
    device = k_rows.device
    h = top.shape[1]
    ok = top >= 0
    # Gathers through index_select over flattened (row, head) pairs: its backward is an index_add, where advanced
    # indexing's backward sorts the indices over the whole [R, H, D] gradient.
    flat = (top.long().clamp_min(0) * h + torch.arange(h, device=device)[None, :, None]).reshape(-1)

    def entries(x):
        return x.reshape(-1, *x.shape[2:]).index_select(0, flat).view(*top.shape, *x.shape[2:])

    zero = torch.zeros((), dtype=k_rows.dtype, device=device)
    offs = torch.arange(block, device=device)
    buf_ok = offs[None, :] < rem[:, None]
    buf_row = torch.where(buf_ok, buf_start[:, None] + offs[None, :], torch.zeros((), dtype=torch.long,
                                                                                  device=device)).reshape(-1)

    def buffered(x):
        return x.index_select(0, buf_row).view(rem.shape[0], block, *x.shape[1:]).transpose(1, 2)

    return HolaCache(
        scores=torch.where(ok, entries(m_rows).float(), float("-inf")),
        positions=torch.where(ok, entries(pos_rows), -1),
        k=torch.where(ok[..., None], entries(k_rows), zero), v=torch.where(ok[..., None], entries(v_rows), zero),
        buf_scores=torch.where(buf_ok[:, None, :], buffered(m_rows).float(), float("-inf")),
        buf_k=torch.where(buf_ok[:, None, :, None], buffered(k_rows), zero),
        buf_v=torch.where(buf_ok[:, None, :, None], buffered(v_rows), zero),
        seen=seen, window=window, block=block, evict=evict)


# ----------------------------------------------------------------------------------------------------------------
# Continuing from a cache (context-parallel shards, chunked prefill).
#
# The call runs on an extended row layout ``[R, H, D]``, ``R = N W + N C + B T``, which puts in front of each
# sequence's new tokens its persistent entries (W rows, per head sorted by position, empty slots last; never
# queries, read only through the selection) and a C-row area whose last ``r = seen % C`` rows hold the unfinished
# block's buffered tokens. Unpacked rows: row b is [entries | area | tokens], a concatenation. Packed sequences: all
# entries first, then per sequence its area and its tokens, a permutation.
# Blocks start at each sequence's first buffered row, so the first block is the unfinished one, completed by the
# new tokens; the running top W of the selection starts from the persistent entries. Row order is position order
# within a sequence (persistent < buffered < new), so the flat row doubles as the position in the tie order, as in
# the plain layout. The persistent rows and the area rows before the buffered ones are covered by blocks of extra
# "sequences" after the N real ones, so that every row's output and statistics are written (the backward reduces
# over all rows); their outputs are dropped and, with zero output gradients, add nothing to any gradient. The
# assembly is differentiable, so gradients reach the cache's k and v (a context-parallel rank passes them back to
# the rank before).


def _continue_from_cache(q, k, v, o_state, m, gamma_q, gamma_k, sink, gate, cu_seqlens, cache: HolaCache, *,
                         window: int, block: int, evict: str, output_final_cache: bool):
    bsz, seq_len, h, d = q.shape
    device = q.device
    n, total, c, w = cache.seen.shape[0], bsz * seq_len, block, window
    seen = cache.seen.to(device=device, dtype=torch.int64)
    r = seen % c
    tok = torch.arange(total, device=device)
    if cu_seqlens is None:
        # Rows: each row is [its W entries | its C-row area | its T tokens], so the extension is a concatenation
        # along the row and the output a slice (no permutation of the B*T token rows, whose gather and scatter
        # cost a fresh call's cache kernels again at 64k tokens).
        stride = w + c + seq_len
        pers_start = torch.arange(bsz, device=device) * stride
        area_start = pers_start + w
        doc_len = torch.full((bsz,), seq_len, device=device, dtype=torch.int64)
        tok_doc = tok // seq_len
        tok_pos = tok - tok_doc * seq_len
        order = token_rows = None
    else:
        # Packed: the entries of every sequence first, then per sequence its area and its tokens (a permutation).
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        doc_len = cu[1:] - cu[:-1]
        tok_doc = torch.searchsorted(cu[1:], tok, right=True)
        tok_pos = tok - cu[:-1][tok_doc]
        pers_start = torch.arange(n, device=device) * w
        area_start = n * w + torch.arange(n, device=device) * c + cu[:-1]
        area_rows = (area_start[:, None] + torch.arange(c, device=device)[None, :]).reshape(-1)
        dest = torch.cat([torch.arange(n * w, device=device), area_rows, n * w + (tok_doc + 1) * c + tok])
        order = torch.empty_like(dest)
        order[dest] = torch.arange(dest.shape[0], device=device)
        token_rows = dest[n * (w + c):]
    ext_start, ext_len = area_start + c - r, r + doc_len
    # Persistent entries per head by position, empty slots last; buffer slot of each area row.
    pos = cache.positions.to(device)
    by_pos = torch.argsort(torch.where(pos >= 0, pos, torch.iinfo(torch.int64).max), dim=-1, stable=True)
    slot = torch.arange(c, device=device)[None, :] - (c - r)[:, None]  # [N, C]
    slot_ok = slot >= 0

    def extend(tokens, persistent, buffered, fill):
        """Extended rows ``[R, H, ...]`` from ``[B*T, H, ...]`` tokens, ``[N, H, W, ...]`` entries and
        ``[N, H, C, ...]`` buffer."""
        extra = persistent.shape[3:]
        idx_p = by_pos.view(n, h, w, *([1] * len(extra))).expand(n, h, w, *extra)
        p = persistent.gather(2, idx_p).transpose(1, 2).to(tokens.dtype)  # [N, W, H, ...]
        idx_b = slot.clamp_min(0)[:, None, :].view(n, 1, c, *([1] * len(extra))).expand(n, h, c, *extra)
        b = buffered.gather(2, idx_b)
        b = torch.where(slot_ok.view(n, 1, c, *([1] * len(extra))), b, torch.full((), fill, dtype=b.dtype,
                                                                                   device=device))
        b = b.transpose(1, 2).to(tokens.dtype)  # [N, C, H, ...]
        if order is None:
            return torch.cat([p, b, tokens.reshape(bsz, seq_len, h, *extra)], dim=1).reshape(-1, h, *extra)
        # index_select, not advanced indexing: the backward is an index_add, not a sort of R indices.
        return torch.cat([p.reshape(n * w, h, *extra), b.reshape(n * c, h, *extra),
                          tokens.reshape(total, h, *extra)]).index_select(0, order)

    dt = q.dtype
    q_ext = extend(q, q.new_zeros(n, h, w, d), q.new_zeros(n, h, c, d), 0.0)
    k_ext = extend(k, cache.k.to(device=device, dtype=dt), cache.buf_k.to(device=device, dtype=dt), 0.0)
    v_ext = extend(v, cache.v.to(device=device, dtype=dt), cache.buf_v.to(device=device, dtype=dt), 0.0)
    os_ext = extend(o_state, o_state.new_zeros(n, h, w, d), o_state.new_zeros(n, h, c, d), 0.0)
    m_ext = extend(m.float(), cache.scores.to(device=device, dtype=torch.float32),
                   cache.buf_scores.to(device=device, dtype=torch.float32), float("-inf"))
    # Real sequences first, then each sequence's persistent rows and its area's unused rows as extra sequences.
    seq_start = torch.cat([ext_start, pers_start, area_start])
    seq_len_all = torch.cat([ext_len, torch.full_like(pers_start, w), c - r])
    num_rows = -(-total // c) + 2 * n + n * (-(-w // c)) + n  # an upper bound on the blocks, without a sync
    table = _select.block_table_of_docs(seq_start, seq_len_all, num_rows, c)
    sel, final_keys = _select_with_cache(m_ext, table, pos, by_pos, pers_start, window=w, evict=evict, num_heads=h)
    o_ext, *_ = cache_attn_op(q_ext[None], k_ext[None], v_ext[None], os_ext[None], gamma_q, gamma_k, sink, gate, sel,
                              table.blk_start, table.blk_len, block, window)
    if order is None:
        o = o_ext[0].view(bsz, stride, h, d)[:, w + c:]
    else:
        o = o_ext[0].index_select(0, token_rows).view(bsz, seq_len, h, d)
    final_cache = None
    if output_final_cache:
        abs_tok = (seen[tok_doc] + tok_pos)[:, None].expand(total, h)
        abs_buf = (seen - r)[:, None, None] + torch.arange(c, device=device)[None, None, :]  # by buffer slot
        pos_ext = extend(abs_tok, pos, abs_buf.expand(n, h, c), -1)
        final_cache = _final_cache_ext(k_ext, v_ext, m_ext, pos_ext, sel, final_keys, table, ext_start, ext_len, pos,
                                       pers_start, seen + doc_len, window=w, block=c, evict=evict)
    return o, final_cache, sel, table


def _recent_rows(s, doc_start, pos, doc_of, pers_start, window):
    """``[M, H, W]``: the ``window`` latest rows before extended row ``s`` [M] of a sequence starting at row
    ``doc_start`` [M] (sequence ``doc_of`` [M]), latest first, continuing into that sequence's persistent entries
    (positions ``pos`` [N, H, W], stored per head by position at rows ``pers_start[n] + j``); ``-1`` for none."""
    h = pos.shape[1]
    j = torch.arange(window, device=s.device)[None, :]
    inside = s[:, None] - 1 - j  # [M, W]
    in_seq = inside >= doc_start[:, None]
    k = j - (s - doc_start)[:, None]  # how far into the persistent entries, latest first
    valid = (pos >= 0).sum(-1)[doc_of]  # [M, H]
    entry = valid[:, :, None] - 1 - k[:, None, :]  # [M, H, W]
    from_cache = torch.where(entry >= 0, pers_start[doc_of][:, None, None] + entry, torch.full_like(entry, -1))
    out = torch.where(in_seq[:, None, :], inside[:, None, :].expand(-1, h, -1), from_cache)
    return out.to(torch.int32)


def _blk_doc(table: BlockTable) -> torch.Tensor:
    rows = torch.arange(table.num_blocks, device=table.blk_start.device)
    end = (table.doc_first_blk + table.doc_num_blk).long()
    return torch.searchsorted(end, rows, right=True).clamp(max=table.num_seqs - 1)


def _select_with_cache(m_ext, table: BlockTable, pos, by_pos, pers_start, *, window: int, evict: str,
                       num_heads: int):
    """Selection on the extended layout: ``(sel [NB, H, W], final keys [N, H, W] or None)``."""
    n = pos.shape[0]
    if window == 0:
        return torch.empty(table.num_blocks, num_heads, 0, dtype=torch.int32, device=m_ext.device), None
    if evict == "recency":
        doc = _blk_doc(table)
        sel = _recent_rows(table.blk_start.long(), table.blk_doc_start.long(), pos, doc.clamp(max=n - 1), pers_start,
                           window)
        real = (table.blk_len > 0) & (doc < n)  # the extra sequences' blocks read nothing
        return torch.where(real[:, None, None], sel, torch.full_like(sel, -1)).contiguous(), None
    rows = pers_start[:, None, None] + torch.arange(window, device=m_ext.device)
    valid = pos.gather(-1, by_pos) >= 0
    heads = torch.arange(num_heads, device=m_ext.device)[None, :, None]
    keys = _select.score_keys(m_ext[rows.expand(n, num_heads, window), heads], rows)
    keys = torch.where(valid, keys, torch.full_like(keys, KEY_EMPTY)).sort(dim=-1, descending=True).values
    keys = torch.cat([keys, keys.new_full((table.num_seqs - n, num_heads, window), KEY_EMPTY)])
    sel, final_keys = select_topw_op(m_ext, table.blk_start, table.blk_len, table.doc_first_blk, table.doc_num_blk,
                                     table.block, window, keys)
    return sel, final_keys[:n]


def _final_cache_ext(k_ext, v_ext, m_ext, pos_ext, sel, final_keys, table: BlockTable, doc_start, doc_len, pos,
                     pers_start, seen, *, window: int, block: int, evict: str) -> HolaCache:
    """The :class:`HolaCache` after a call on the extended layout (see :func:`final_cache_from_selection`);
    ``doc_start``, ``doc_len``: each sequence's rows from its first buffered one."""
    n, h = pos.shape[:2]
    device = k_ext.device
    rem = seen % block
    if window == 0:
        top = torch.empty(n, h, 0, dtype=torch.int32, device=device)
    elif evict == "score":
        last = (table.doc_first_blk[:n] + table.doc_num_blk[:n] - 1).long().clamp_min(0)
        top = torch.where((rem == 0)[:, None, None], _select.keys_to_index(final_keys), sel[last])
    else:
        top = _recent_rows(doc_start + doc_len - rem, doc_start, pos, torch.arange(n, device=device), pers_start,
                           window)
    return _cache_from_rows(k_ext, v_ext, m_ext, pos_ext, top, doc_start + doc_len - rem, rem, seen, window=window,
                            block=block, evict=evict)


__all__ = ["hola_attention_triton", "check_supported", "triton_importable", "interpreting", "KEY_EMPTY"]
