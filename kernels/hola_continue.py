"""Continuing from a cache (context-parallel shards, chunked prefill) on the Triton backend.

Shape legend: B batch, T tokens, H heads, D head dim, N sequences, NB blocks, W window, C block.
"""

from __future__ import annotations

import torch

from hola_titan.kernels import hola_triton_select as _select
from hola_titan.kernels.hola_cache import HolaCache
from hola_titan.kernels.hola_stages import _cache_from_rows
from hola_titan.kernels.hola_triton_ops import cache_attn_op, select_topw_op
from hola_titan.kernels.hola_triton_select import KEY_EMPTY, BlockTable

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


def continue_from_cache(q, k, v, o_state, m, gamma_q, gamma_k, sink, gate, cu_seqlens, cache: HolaCache, *,
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

