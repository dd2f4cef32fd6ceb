"""Stages shared by the Triton, SDPA and FA4 backends: the state path with the score, the selection, the gather of
token rows into key slots per head, and the :class:`HolaCache` after a call that started from an empty cache.

Shape legend: B batch, T tokens, H heads, D head dim, N sequences, NB blocks, W window.
"""

from __future__ import annotations

import torch

from hola_titan.kernels.hola import selection as _select
from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.kernels.hola.triton_ops import select_topw_op
from hola_titan.kernels.hola.selection import keys_to_index
from hola_titan.kernels.runtime.documents import BlockTable, build_block_table


def state_path(q, k, v, g, beta, *, initial_state, cu_seqlens, output_final_state, impl: str = "auto",
               chunk_indices=None, recompute_norms: bool = False, scale: float | None = None):
    """fla on CUDA, the fp32 reference elsewhere: ``(o_state in q.dtype, m [B, T, H] float32, final_state)``.

    ``impl="reference"`` forces the reference (tests of the cache path alone on a GPU). ``chunk_indices``: fla's,
    made once per batch (``Documents.chunk_indices``), or None. ``recompute_norms``: the caller keeps these very
    ``q`` and ``k`` for its own backward, so fla's op keeps them too instead of normalised copies
    (:func:`~hola_titan.kernels.gdn.fla_bridge.gdn_with_scores`). ``scale``: the state read's factor (None: ``D^-1/2``).
    """
    if impl == "fla" or (impl == "auto" and q.device.type == "cuda"):
        from hola_titan.kernels.gdn.fla_bridge import gdn_with_scores
        o_state, m, final_state = gdn_with_scores(q, k, v, g, beta, initial_state=initial_state,
                                                  cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                                  output_final_state=output_final_state,
                                                  recompute_norms=recompute_norms, scale=scale)
    else:
        from hola_titan.kernels.gdn.fla_bridge import reference_gdn_with_scores
        o_state, m, final_state = reference_gdn_with_scores(q, k, v, g, beta, initial_state=initial_state,
                                                            cu_seqlens=cu_seqlens,
                                                            output_final_state=output_final_state, scale=scale)
    return o_state.to(q.dtype), m, final_state


class _HeadRowGather(torch.autograd.Function):
    """``rows[index[..., h], h]`` with empty slots read as zero rows; see :func:`gather_head_rows`."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        n, h, d = rows.shape
        ok = (index >= 0) & (index < n)
        flat = _flat_head_rows(index, ok, n, h)
        out = rows.reshape(n * h, d).index_select(0, flat.reshape(-1)).view(*index.shape, d)
        ctx.save_for_backward(flat, ok)
        ctx.rows_shape = rows.shape
        return out.masked_fill(~ok[..., None], 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, ok = ctx.saved_tensors
        n, h, d = ctx.rows_shape
        # Empty slots carry no gradient (FlashAttention-4 leaves theirs unwritten: masked_fill clears NaN too); their
        # zeros go to spread-out rows. Summed in float32 at least (float64 stays float64), as the Triton kernels sum
        # a row read by several blocks.
        acc = torch.promote_types(grad.dtype, torch.float32)
        g = grad.masked_fill(~ok[..., None], 0).reshape(-1, d).to(acc)
        total = torch.zeros(n * h, d, dtype=acc, device=grad.device).index_add_(0, flat.reshape(-1), g)
        return total.to(grad.dtype).view(n, h, d), None


def _flat_head_rows(index: torch.Tensor, ok: torch.Tensor, n: int, h: int) -> torch.Tensor:
    """Row ``index * H + head`` of the ``[N * H, D]`` view for every used slot; an empty slot gets the slot's own
    number modulo ``N * H``, so that no row collects every empty slot (see :func:`gather_head_rows`)."""
    heads = torch.arange(h, device=index.device)
    spread = torch.arange(index.numel(), device=index.device).view(index.shape) % (n * h)
    return torch.where(ok, index.long() * h + heads, spread)


def gather_head_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[..., H, D]``: ``rows[index[..., h], h]`` from token rows ``[N, H, D]``, a zero row where ``index`` is outside
    ``[0, N)`` (an empty cache slot, a slot past a sequence's keys); ``index`` ``[..., H]`` integer, any layout
    (expanded or transposed views too). The backends mark empty slots with ``N`` or ``-1``; any other value outside
    the range is read as empty as well, not refused (refusing would need a read-back to the host).

    Why not ``rows[index, heads]``: the backward of advanced indexing on CUDA is ``index_put_(accumulate=True)``,
    which sorts the indices and adds the duplicates of one index one after another, and every empty slot of the batch
    (64 per head in each document's first block) pointed at the same padding row: a serial sum that grows with the
    number of documents (pytorch issue #41162). Here the backward is ``index_add_`` (atomic adds; the sorted,
    deterministic kernel under ``torch.use_deterministic_algorithms``) into float32 or wider, and the empty slots' zero
    gradients go to distinct rows. Tensor operations only: no host synchronisation.
    """
    if rows.dim() != 3 or index.dim() < 1 or index.shape[-1] != rows.shape[1]:
        raise ValueError(f"gather_head_rows: rows [N, H, D] and index [..., H]; got {tuple(rows.shape)} and "
                         f"{tuple(index.shape)}")
    if rows.shape[0] == 0:  # no token rows: every slot is empty, and nothing takes a gradient
        return rows.new_zeros(*index.shape, rows.shape[2])
    return _HeadRowGather.apply(rows, index)


def state_and_table(q, k, v, g, beta, *, initial_state, cu_seqlens, output_final_state, impl: str, chunk_indices,
                    scale: float | None, evict: str, block: int, block_table: BlockTable | None):
    """The first stages of the SDPA and FA4 backends: :func:`state_path`, and the batch's block table (the one given,
    or built here; None for ``evict="none"``, which reads no cache). ``(o_state, m, final_state, table)``."""
    o_state, m, final_state = state_path(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                         output_final_state=output_final_state, impl=impl,
                                         chunk_indices=chunk_indices, scale=scale)
    if evict == "none":
        return o_state, m, final_state, None
    bsz, seq_len = q.shape[:2]
    table = block_table if block_table is not None else build_block_table(bsz, seq_len, cu_seqlens, block, q.device)
    return o_state, m, final_state, table


def select(m: torch.Tensor, table: BlockTable, *, window: int, evict: str, num_heads: int):
    """``(sel [NB, H, W] int32, final top-W keys [N, H, W] or None)`` for ``m`` ``[B * T, H]``."""
    if window == 0:
        return torch.empty(table.num_blocks, num_heads, 0, dtype=torch.int32, device=m.device), None
    if evict == "recency":
        return _select.select_recency(table, num_heads, window), None
    return select_topw_op(m, table.blk_start, table.blk_len, table.doc_first_blk, table.doc_num_blk, table.block,
                          window)


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


class TwoSourceRows:
    """Rows ``[R, H, ...]`` of an index space held in two tensors, never put together: ``tokens`` ``[B * T, H,
    ...]`` and ``prefix`` ``[A, H, ...]``; ``src`` ``[R]`` maps a row to its token row, or to ``-2 - a`` for
    prefix row ``a`` (what a call that continues from a cache reads: the cache's rows, then the new tokens)."""

    def __init__(self, tokens: torch.Tensor, prefix: torch.Tensor, src: torch.Tensor):
        self.tokens, self.prefix, self.src = tokens, prefix, src

    def take(self, rows: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
        """``[M, ...]`` values of (row, head) pairs, or ``[M, H, ...]`` whole rows when ``heads`` is None."""
        s = self.src[rows]
        from_tokens = s >= 0
        t_row, a_row = s.clamp_min(0), (-2 - s).clamp_min(0)
        t, a = _take(self.tokens, t_row, heads), _take(self.prefix, a_row, heads)
        shape = (-1,) + (1,) * (t.dim() - 1)
        return torch.where(from_tokens.view(shape), t, a)


def _take(x, rows: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
    """Values of flat rows ``x`` ``[R, H, ...]`` (a tensor or :class:`TwoSourceRows`) at (row, head) pairs, or
    whole rows. Through index_select over flattened pairs: its backward is an index_add, where advanced indexing's
    backward sorts the indices over the whole ``[R, H, D]`` gradient."""
    if isinstance(x, TwoSourceRows):
        return x.take(rows, heads)
    if heads is None:
        return x.index_select(0, rows)
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows * x.shape[1] + heads)


def _cache_from_rows(k_rows, v_rows, m_rows, pos_rows, top, buf_start, rem, seen, *, window: int, block: int,
                     evict: str) -> HolaCache:
    """A :class:`HolaCache` gathered from flat rows ``[R, H, ...]`` (tensors or :class:`TwoSourceRows`): the
    persistent entries at rows ``top`` ``[N, H, W]`` (-1 empty; scores ``m_rows``, positions ``pos_rows``), the
    unfinished block the ``rem`` [N] rows from ``buf_start`` [N], ``seen`` [N] tokens."""
    device = top.device
    n, h = top.shape[:2]
    ok = top >= 0
    rows = top.long().clamp_min(0).reshape(-1)
    heads = torch.arange(h, device=device)[None, :, None].expand(top.shape).reshape(-1)

    def entries(x):
        out = _take(x, rows, heads)
        return out.view(*top.shape, *out.shape[1:])

    offs = torch.arange(block, device=device)
    buf_ok = offs[None, :] < rem[:, None]
    buf_row = torch.where(buf_ok, buf_start[:, None] + offs[None, :], torch.zeros((), dtype=torch.long,
                                                                                  device=device)).reshape(-1)

    def buffered(x):
        out = _take(x, buf_row, None)
        return out.view(n, block, *out.shape[1:]).transpose(1, 2)

    k_e, v_e, k_b, v_b = entries(k_rows), entries(v_rows), buffered(k_rows), buffered(v_rows)
    zero = torch.zeros((), dtype=k_e.dtype, device=device)
    return HolaCache(
        scores=torch.where(ok, entries(m_rows).float(), float("-inf")),
        positions=torch.where(ok, entries(pos_rows), -1),
        k=torch.where(ok[..., None], k_e, zero), v=torch.where(ok[..., None], v_e, zero),
        buf_scores=torch.where(buf_ok[:, None, :], buffered(m_rows).float(), float("-inf")),
        buf_k=torch.where(buf_ok[:, None, :, None], k_b, zero),
        buf_v=torch.where(buf_ok[:, None, :, None], v_b, zero),
        seen=seen, window=window, block=block, evict=evict)
