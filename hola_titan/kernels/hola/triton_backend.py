"""The ``"triton"`` backend of ``hola_attention``: fla's GDN with the score, Triton selection and cache attention.

Shape legend: B batch, T tokens, H heads, D head dim, N sequences, NB blocks, W window.

Pipeline (DESIGN §1):
1. state path and score: :func:`hola_titan.kernels.gdn.fla_bridge.gdn_with_scores` (fla-core, the score from fla's own
   per-token update); on a CPU under ``TRITON_INTERPRET=1`` the fp32 reference state path stands in for fla,
   whose chunk kernels do not run in the interpreter;
2. selection: :func:`hola_titan.kernels.hola.selection.select_topw` (``evict="score"``) or the recency window;
3. cache attention with the fused RMSNorms, sink and ``o_state + sigmoid(gate) o_cache`` epilogue:
   :mod:`hola_titan.kernels.hola.triton_kernels`, as the custom op ``hola::cache_attn`` (fake and autograd
   registrations; its backward is the custom op ``hola::cache_attn_bwd``).
Calls with an ``initial_cache`` read the cache's entries and buffered tokens as a prefix of key rows beside the new
tokens, copying neither (:func:`hola_titan.kernels.hola.continuation.continue_from_cache`). The custom ops live in
:mod:`hola_titan.kernels.hola.triton_ops`, the stages the SDPA backend shares in :mod:`hola_titan.kernels.hola.stages`.
"""


from __future__ import annotations

import torch

from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.kernels.hola.continuation import ContinuationLayout, continue_from_cache
from hola_titan.kernels.hola.reference import merge_read
from hola_titan.kernels.hola.stages import final_cache_from_selection, select, state_path
from hola_titan.kernels.hola.triton_ops import cache_attn_op
from hola_titan.kernels.runtime.documents import BlockTable, build_block_table


def hola_attention_triton(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int, evict: str,
                          cu_seqlens=None, initial_state=None, output_final_state: bool = False,
                          initial_cache: HolaCache | None = None, output_final_cache: bool = False,
                          selected: torch.Tensor | None = None, return_aux: bool = False, state_impl: str = "auto",
                          overlap_backward: bool = False, save_cache_output: bool = False,
                          chunk_indices: torch.Tensor | None = None,
                          block_table: BlockTable | None = None, continuation: ContinuationLayout | None = None,
                          scale: float | None = None, mix: str = "sum"):
    """The Triton backend (arguments validated by ``hola_titan.ops.hola_attention``); ``chunk_indices`` as in
    :func:`state_path`; ``block_table``: the batch's table for ``block`` (``Documents.block_table``, made once per
    batch), or None to build it here.

    ``selected`` (``[NB, H, W]`` int32 flat token indices, ``-1`` empty) replaces the selection, for tests that
    compare reading given the same indices. With ``return_aux`` the result gains a dict with the scores ``m``
    ``[B, T, H]``, the selection ``sel`` and the block table. ``state_impl``: see :func:`state_path`.
    ``overlap_backward``: the layer as one op whose backward overlaps the two paths (:mod:`triton_layer`).
    ``save_cache_output``: a fresh call keeps the cache read's output for the backward (``hola::cache_attn``).
    A call with an ``initial_cache`` reads the cache as a prefix of key rows
    (:func:`~hola_titan.kernels.hola.continuation.continue_from_cache`), with the batch's ``continuation`` layout
    when given. ``scale``: the state read's factor (None: ``D^-1/2``). ``mix`` as in ``hola_attention``: with
    ``"parts"`` the cache kernels add the gated read to zeros, and the state read is put beside it (the overlapped
    layer op, which fuses the sum, then does not apply).
    Returns ``(o, final_state, final_cache[, aux])``.
    """
    bsz, seq_len, h, d = q.shape
    if save_cache_output and overlap_backward:
        raise ValueError("save_cache_output: not available with overlap_backward; choose one")
    from hola_titan.kernels.hola import triton_layer
    if mix == "sum" and triton_layer.applies(
            q, overlap_backward=overlap_backward, evict=evict, initial_cache=initial_cache, selected=selected,
            state_impl=state_impl, output_final_cache=output_final_cache, return_aux=return_aux):
        o, final_state, _, _ = triton_layer.hola_layer(
            q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block, evict=evict,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, initial_state=initial_state,
            output_final_state=output_final_state, scale=scale)
        return o, final_state, None
    # The cache op of a call without an initial cache saves these same q and k for its backward.
    o_state, m, final_state = state_path(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                         output_final_state=output_final_state, impl=state_impl,
                                         chunk_indices=chunk_indices, scale=scale,
                                         recompute_norms=evict != "none" and initial_cache is None)
    aux = {"m": m}
    if evict == "none":
        return (o_state, final_state, None, aux) if return_aux else (o_state, final_state, None)
    # What the cache kernels add their gated read to (their epilogue): the state read, or zeros to keep it apart.
    kernel_base = o_state if mix == "sum" else torch.zeros_like(o_state)
    if initial_cache is not None:
        if selected is not None:
            raise ValueError("selected: not supported together with initial_cache")
        o, final_cache, sel, table = continue_from_cache(q, k, v, kernel_base, m, gamma_q, gamma_k, sink, gate,
                                                          cu_seqlens, initial_cache, window=window, block=block,
                                                          evict=evict, output_final_cache=output_final_cache,
                                                          layout=continuation)
        o = o if mix == "sum" else merge_read(o_state, o, mix)
        aux.update(sel=sel, table=table)
        return (o, final_state, final_cache, aux) if return_aux else (o, final_state, final_cache)
    table = block_table if block_table is not None else build_block_table(bsz, seq_len, cu_seqlens, block, q.device)
    m_flat = m.reshape(bsz * seq_len, h)
    final_keys = None
    if selected is None:
        sel, final_keys = select(m_flat, table, window=window, evict=evict, num_heads=h)
    else:
        sel = selected.to(device=q.device, dtype=torch.int32).contiguous()
    # Kept only when a backward can come (validation, prefill and evaluation run without gradients).
    keep = save_cache_output and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, o_state, gamma_q, gamma_k, sink, gate))
    o, *_ = cache_attn_op(q, k, v, kernel_base, gamma_q, gamma_k, sink, gate, sel, table.blk_start, table.blk_len,
                          block, window, keep)
    o = o if mix == "sum" else merge_read(o_state, o, mix)
    final_cache = None
    if output_final_cache:
        final_cache = final_cache_from_selection(q, k, v, m_flat, sel, final_keys, table, window=window, block=block,
                                                 evict=evict)
    aux.update(sel=sel, table=table)
    return (o, final_state, final_cache, aux) if return_aux else (o, final_state, final_cache)



__all__ = ["hola_attention_triton"]
