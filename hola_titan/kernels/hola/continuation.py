"""Continuing from a cache (context-parallel shards, chunked prefill) on the Triton backend.

Shape legend: B batch, T tokens, H heads, D head dim, N sequences, NB blocks, W window, C block.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from hola_titan.kernels.hola import selection as _select
from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.kernels.hola.stages import TwoSourceRows, _cache_from_rows
from hola_titan.kernels.hola.triton_ops import cache_attn_pre_op, select_topw_op
from hola_titan.kernels.hola.selection import KEY_EMPTY
from hola_titan.kernels.runtime.documents import BlockTable, block_table_of_docs

# Continuing from a cache (context-parallel shards, chunked prefill).
#
# The cache attention reads two sources and copies neither: the new tokens where they are, and a small prefix
# ``[N (W + C), H, D]`` that holds per sequence its persistent entries (W rows, per head sorted by position, empty
# slots last) and a C-row area whose last ``r = seen % C`` rows are the unfinished block's buffered tokens. Blocks
# start at each sequence's first buffered row, so its first block is the unfinished one: r prefix rows, then new
# tokens that complete it; a block's queries are its new tokens only. A selection entry names a token row, or
# ``-2 - a`` for prefix row ``a`` (:class:`~hola_titan.kernels.hola.triton_kernels.Prefix`).
#
# The selection itself runs on an index space of ``R = N W + N C + B T`` rows that orders each sequence's rows by
# position (persistent < buffered < new), so that the row doubles as the position in the tie order, as in a fresh
# call: only the [R, H] scores are laid out in it (unpacked rows: row b is [entries | area | tokens]; packed
# sequences: all entries first, then per sequence its area and its tokens). ``src`` maps this space onto the two
# sources. The prefix is built differentiably from the cache, so gradients reach its k and v (a context-parallel
# rank passes them back to the rank before).


@dataclass(frozen=True)
class ContinuationLayout:
    """The index tensors of a call continuing from a cache that depend only on the tokens each sequence has seen,
    the call's shape and (W, C): the same for every layer of a batch (a context-parallel shard's layers all
    continue the same documents), so a batch makes it once (:meth:`from_host`, one copy to the device) and passes
    it to every layer (``hola_attention(..., continuation=...)``); a call without one makes it on the device.

    Index space of the selection: ``R = num_rows`` rows, see the module comment. Per sequence ``[N]``: ``seen``,
    ``r = seen % C``, ``doc_len``, ``pers_start`` (its entries' first row), ``ext_start`` / ``ext_len`` (its rows
    from the first buffered one); per token ``[B T]``: ``tok_doc``, ``tok_pos``; ``src`` ``[R]``: a row's token
    row, or ``-2 - a`` for prefix row a; ``order`` ``[R]``: where a row sits in ``cat([prefix, tokens])``; ``slot``
    ``[N, C]``: the buffer slot of each area row (negative: unused). The selection's block ``table`` and, per
    block, the attention's view of it (int32 ``[NB]``): ``tok_start``, ``q_len`` (its new tokens, the queries),
    ``pre_start``, ``pre_len`` (its prefix rows)."""

    window: int
    block: int
    num_tokens: int
    num_rows: int
    seen: torch.Tensor
    r: torch.Tensor
    doc_len: torch.Tensor
    pers_start: torch.Tensor
    ext_start: torch.Tensor
    ext_len: torch.Tensor
    tok_doc: torch.Tensor
    tok_pos: torch.Tensor
    src: torch.Tensor
    order: torch.Tensor
    slot: torch.Tensor
    table: BlockTable
    tok_start: torch.Tensor
    q_len: torch.Tensor
    pre_start: torch.Tensor
    pre_len: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.seen.shape[0]

    def matches(self, *, num_tokens: int, num_seqs: int, window: int, block: int) -> bool:
        return (self.num_tokens, self.num_seqs, self.window, self.block) == (num_tokens, num_seqs, window, block)

    @classmethod
    def build(cls, seen: torch.Tensor, cu_seqlens: torch.Tensor | None, *, batch: int, seq_len: int, window: int,
              block: int) -> ContinuationLayout:
        """The layout on ``seen``'s device (``[N]`` tokens each sequence has seen; ``cu_seqlens`` on the same
        device, or None for ``batch`` rows)."""
        device = seen.device
        n, total, c, w = seen.shape[0], batch * seq_len, block, window
        seen = seen.to(torch.int64)
        r = seen % c
        tok = torch.arange(total, device=device)
        if cu_seqlens is None:
            stride = w + c + seq_len
            num_rows = batch * stride
            pers_start = torch.arange(batch, device=device) * stride
            area_start = pers_start + w
            doc_len = torch.full((batch,), seq_len, device=device, dtype=torch.int64)
            tok_doc = tok // seq_len
            tok_pos = tok - tok_doc * seq_len
            tok_row = tok_doc * stride + w + c + tok_pos
        else:
            cu = cu_seqlens.to(device=device, dtype=torch.int64)
            num_rows = n * (w + c) + total
            doc_len = cu[1:] - cu[:-1]
            tok_doc = torch.searchsorted(cu[1:], tok, right=True)
            tok_pos = tok - cu[:-1][tok_doc]
            pers_start = torch.arange(n, device=device) * w
            area_start = n * w + torch.arange(n, device=device) * c + cu[:-1]
            tok_row = n * w + (tok_doc + 1) * c + tok
        pre_row = torch.cat([pers_start[:, None] + torch.arange(w, device=device)[None, :],
                             area_start[:, None] + torch.arange(c, device=device)[None, :]], dim=1).reshape(-1)
        src = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
        src[pre_row] = -2 - torch.arange(n * (w + c), device=device)
        src[tok_row] = tok
        order = torch.empty(num_rows, dtype=torch.int64, device=device)
        order[torch.cat([pre_row, tok_row])] = torch.arange(num_rows, device=device)
        ext_start, ext_len = area_start + c - r, r + doc_len
        table = block_table_of_docs(ext_start, ext_len, -(-total // c) + 2 * n, c)
        # The attention's blocks: a sequence's first block starts with its r buffered rows (prefix rows), the rest
        # are new tokens only; a block's length counts its new tokens, its queries.
        blk_doc = _blk_doc(table)
        blk_len = table.blk_len.long()
        first = torch.arange(table.num_blocks, device=device) == table.doc_first_blk.long()[blk_doc]
        pre_len = torch.where(first, torch.minimum(r[blk_doc], blk_len), torch.zeros_like(blk_len))
        q_len = blk_len - pre_len
        tok_start = torch.where(q_len > 0, src[(table.blk_start.long() + pre_len).clamp(max=num_rows - 1)],
                                torch.zeros_like(q_len))
        pre_start = blk_doc * (w + c) + w + c - r[blk_doc]
        i32 = torch.int32
        return cls(window=w, block=c, num_tokens=total, num_rows=num_rows, seen=seen, r=r, doc_len=doc_len,
                   pers_start=pers_start, ext_start=ext_start, ext_len=ext_len, tok_doc=tok_doc, tok_pos=tok_pos,
                   src=src, order=order, slot=torch.arange(c, device=device)[None, :] - (c - r)[:, None],
                   table=table, tok_start=tok_start.to(i32), q_len=q_len.to(i32), pre_start=pre_start.to(i32),
                   pre_len=pre_len.to(i32))

    @classmethod
    def from_host(cls, seen: list[int], cu_seqlens: list[int] | None, *, batch: int, seq_len: int, window: int,
                  block: int, device: torch.device | str) -> ContinuationLayout:
        """The layout made on the host from host values and sent to ``device`` in one copy
        (:func:`~hola_titan.kernels.runtime.documents.to_device_aligned`)."""
        from hola_titan.kernels.runtime.documents import to_device_aligned

        on_host = cls.build(torch.tensor(seen, dtype=torch.int64),
                            None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int64),
                            batch=batch, seq_len=seq_len, window=window, block=block)
        names = [f.name for f in fields(cls) if isinstance(getattr(on_host, f.name), torch.Tensor)]
        sent = to_device_aligned([getattr(on_host, name) for name in names]
                                 + [getattr(on_host.table, name) for name in BlockTable.FIELDS], device)
        table = BlockTable(**dict(zip(BlockTable.FIELDS, sent[len(names):])), block=on_host.table.block)
        return replace(on_host, table=table, **dict(zip(names, sent)))


def continue_from_cache(q, k, v, o_state, m, gamma_q, gamma_k, sink, gate, cu_seqlens, cache: HolaCache, *,
                         window: int, block: int, evict: str, output_final_cache: bool,
                         layout: ContinuationLayout | None = None):
    """The Triton backend's call from ``cache``; ``layout``: the batch's :class:`ContinuationLayout` for these
    shapes and the cache's ``seen`` (None: made here, on the device)."""
    bsz, seq_len, h, d = q.shape
    device = q.device
    n, total, c, w = cache.seen.shape[0], bsz * seq_len, block, window
    if layout is None:
        layout = ContinuationLayout.build(cache.seen.to(device), cu_seqlens, batch=bsz, seq_len=seq_len, window=w,
                                          block=c)
    elif not layout.matches(num_tokens=total, num_seqs=n, window=w, block=c):
        raise ValueError(f"continuation: a layout for {layout.num_tokens} tokens, {layout.num_seqs} sequences, "
                         f"window {layout.window}, block {layout.block}; the call has {total}, {n}, {w}, {c}")
    lay = layout
    # Persistent entries per head by position, empty slots last (the one per-layer part: the cache's positions).
    pos = cache.positions.to(device)
    by_pos = torch.argsort(torch.where(pos >= 0, pos, torch.iinfo(torch.int64).max), dim=-1, stable=True)
    slot_ok = lay.slot >= 0

    def prefix(persistent, buffered, fill, dtype):
        """``[N (W + C), H, ...]`` from ``[N, H, W, ...]`` entries and ``[N, H, C, ...]`` buffer."""
        extra = persistent.shape[3:]
        idx_p = by_pos.view(n, h, w, *([1] * len(extra))).expand(n, h, w, *extra)
        p = persistent.gather(2, idx_p).transpose(1, 2).to(dtype)  # [N, W, H, ...]
        idx_b = lay.slot.clamp_min(0)[:, None, :].view(n, 1, c, *([1] * len(extra))).expand(n, h, c, *extra)
        b = buffered.gather(2, idx_b)
        b = torch.where(slot_ok.view(n, 1, c, *([1] * len(extra))), b, torch.full((), fill, dtype=b.dtype,
                                                                                   device=device))
        return torch.cat([p, b.transpose(1, 2).to(dtype)], dim=1).reshape(n * (w + c), h, *extra)

    def in_index_space(tokens, pre):
        """``[R, H, ...]`` from ``[B * T, H, ...]`` tokens and the prefix rows (the scores and positions only).
        index_select, not advanced indexing: the backward is an index_add, not a sort of R indices."""
        return torch.cat([pre, tokens]).index_select(0, lay.order)

    dt, f32 = q.dtype, torch.float32
    pre_k = prefix(cache.k.to(device=device, dtype=dt), cache.buf_k.to(device=device, dtype=dt), 0.0, dt)
    pre_v = prefix(cache.v.to(device=device, dtype=dt), cache.buf_v.to(device=device, dtype=dt), 0.0, dt)
    pre_m = prefix(cache.scores.to(device=device, dtype=f32), cache.buf_scores.to(device=device, dtype=f32),
                   float("-inf"), f32)
    m_ext = in_index_space(m.reshape(total, h).float(), pre_m)
    table = lay.table
    sel, final_keys = _select_with_cache(m_ext, table, pos, by_pos, lay.pers_start, window=w, evict=evict,
                                         num_heads=h)
    sel_src = torch.where(sel >= 0, lay.src[sel.long().clamp_min(0)], torch.full((), -1, device=device))
    o, *_ = cache_attn_pre_op(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel_src.to(torch.int32),
                              lay.tok_start, lay.q_len, pre_k, pre_v, lay.pre_start, lay.pre_len, block, window)
    final_cache = None
    if output_final_cache:
        abs_tok = (lay.seen[lay.tok_doc] + lay.tok_pos)[:, None].expand(total, h)
        abs_buf = (lay.seen - lay.r)[:, None, None] + torch.arange(c, device=device)[None, None, :]  # by slot
        pos_ext = in_index_space(abs_tok, prefix(pos, abs_buf.expand(n, h, c), -1, torch.int64))
        rows_k = TwoSourceRows(k.reshape(total, h, d), pre_k, lay.src)
        rows_v = TwoSourceRows(v.reshape(total, h, d), pre_v, lay.src)
        final_cache = _final_cache_ext(rows_k, rows_v, m_ext, pos_ext, sel, final_keys, table, lay.ext_start,
                                       lay.ext_len, pos, lay.pers_start, lay.seen + lay.doc_len, window=w, block=c,
                                       evict=evict)
    return o, final_cache, sel, table


def _recent_rows(s, doc_start, pos, doc_of, pers_start, window):
    """``[M, H, W]``: the ``window`` latest rows before row ``s`` [M] (of the index space) of a sequence starting
    at row ``doc_start`` [M] (sequence ``doc_of`` [M]), latest first, continuing into that sequence's persistent entries
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
    """Selection in the index space of :func:`continue_from_cache`: ``(sel [NB, H, W], final keys [N, H, W] or
    None)``."""
    n = pos.shape[0]
    if window == 0:
        return torch.empty(table.num_blocks, num_heads, 0, dtype=torch.int32, device=m_ext.device), None
    if evict == "recency":
        doc = _blk_doc(table)
        sel = _recent_rows(table.blk_start.long(), table.blk_doc_start.long(), pos, doc.clamp(max=n - 1), pers_start,
                           window)
        real = table.blk_len > 0  # padding rows of the table read nothing
        return torch.where(real[:, None, None], sel, torch.full_like(sel, -1)).contiguous(), None
    rows = pers_start[:, None, None] + torch.arange(window, device=m_ext.device)
    valid = pos.gather(-1, by_pos) >= 0
    heads = torch.arange(num_heads, device=m_ext.device)[None, :, None]
    keys = _select.score_keys(m_ext[rows.expand(n, num_heads, window), heads], rows)
    keys = torch.where(valid, keys, torch.full_like(keys, KEY_EMPTY)).sort(dim=-1, descending=True).values
    return select_topw_op(m_ext, table.blk_start, table.blk_len, table.doc_first_blk, table.doc_num_blk,
                          table.block, window, keys)


def _final_cache_ext(k_rows, v_rows, m_ext, pos_ext, sel, final_keys, table: BlockTable, doc_start, doc_len, pos,
                     pers_start, seen, *, window: int, block: int, evict: str) -> HolaCache:
    """The :class:`HolaCache` after a call that continued from a cache (see :func:`final_cache_from_selection`),
    from rows of its index space (``k_rows``, ``v_rows``: :class:`TwoSourceRows`); ``doc_start``, ``doc_len``:
    each sequence's rows from its first buffered one."""
    n, h = pos.shape[:2]
    device = m_ext.device
    rem = seen % block
    if window == 0:
        top = torch.empty(n, h, 0, dtype=torch.int32, device=device)
    elif evict == "score":
        last = (table.doc_first_blk[:n] + table.doc_num_blk[:n] - 1).long().clamp_min(0)
        top = torch.where((rem == 0)[:, None, None], _select.keys_to_index(final_keys), sel[last])
    else:
        top = _recent_rows(doc_start + doc_len - rem, doc_start, pos, torch.arange(n, device=device), pers_start,
                           window)
    return _cache_from_rows(k_rows, v_rows, m_ext, pos_ext, top, doc_start + doc_len - rem, rem, seen, window=window,
                            block=block, evict=evict)

