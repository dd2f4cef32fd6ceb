"""Block layout and top-W cache selection for the Triton and SDPA backends (DESIGN §1, items 6-7).

Shape legend: B batch, T tokens, H heads, N sequences (batch rows, or documents with ``cu_seqlens``),
NB blocks over all sequences, W window, C block.

Tokens are addressed by their flat index ``b * T + t`` into ``[B * T, H, ...]``. Blocks of ``C`` tokens start at
every sequence start; block ``i`` covers the flat tokens ``blk_start[i] ... blk_start[i] + blk_len[i] - 1``, and
the blocks of sequence ``n`` are ``doc_first_blk[n] ... doc_first_blk[n] + doc_num_blk[n] - 1`` (all blocks in
one table, sequence-major).

A selection is an int32 tensor ``sel [NB, H, W]``: the flat token indices of the persistent cache ``P_b`` that
block ``i`` reads, in selection order (key descending, then position ascending), ``-1`` for empty slots.

Score selection as a key sort. A (score, position) pair becomes one int64 key whose descending order is the
spec's order (larger score first, then lower position): the float32 score's bits mapped to an order-preserving
signed integer in the high 32 bits, ``2^32 - 1 - position`` in the low 32 bits. Every block first keeps its own
top W keys (one program per block and head, in parallel); one program per sequence and head then walks the
blocks in order, emits the running top W as the block's cache and merges the block's own top W into it
(``top_W(A u B) = top_W(top_W(A) u top_W(B))``), which resets at every sequence start by construction.
"""

from __future__ import annotations

import torch

from hola_titan.kernels.runtime.documents import BlockTable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton: the reference backend needs none of this module
    triton = None
    tl = None

KEY_EMPTY = -(2 ** 63)


def score_keys(m: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (score descending, position ascending); torch version."""
    bits = m.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    mapped = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (mapped << 32) | (0xFFFFFFFF - position.to(torch.int64))


def keys_to_index(keys: torch.Tensor) -> torch.Tensor:
    """Flat token indices of int64 keys (``-1`` for empty keys)."""
    idx = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
    return torch.where(keys == KEY_EMPTY, torch.full_like(idx, -1), idx).to(torch.int32)


def select_recency(table: BlockTable, num_heads: int, window: int) -> torch.Tensor:
    """``evict="recency"``: the ``window`` tokens just before each block, within its sequence. It depends on the
    table alone, so a table shared by a batch's layers (``Documents.block_table``) computes it once (not inside a
    compiled region, where the operations are fused instead)."""
    key = ("recency", num_heads, window)
    if key in table.derived:
        return table.derived[key]
    pos = table.blk_start[:, None].long() - window + torch.arange(window, device=table.blk_start.device)[None, :]
    pos = pos.flip(-1)  # selection order for recency: latest position first
    ok = (pos >= table.blk_doc_start[:, None].long()) & (table.blk_len[:, None] > 0)
    pos = torch.where(ok, pos, torch.full_like(pos, -1))
    sel = pos.to(torch.int32)[:, None, :].expand(table.num_blocks, num_heads, window).contiguous()
    if not torch.compiler.is_compiling():
        table.derived[key] = sel
    return sel


if triton is not None:

    @triton.jit
    def _make_keys(score, tok):
        bits = score.to(tl.int32, bitcast=True)
        mapped = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (mapped.to(tl.int64) << 32) | (0xFFFFFFFF - tok.to(tl.int64))

    @triton.jit
    def _head(keys, N: tl.constexpr, M: tl.constexpr):
        """The first M entries of a length-N int64 vector (M divides N)."""
        rows2d = tl.reshape(keys, (N // M, M))
        rows = tl.arange(0, N // M)
        return tl.max(tl.where(rows[:, None] == 0, rows2d, -9223372036854775808), axis=0)

    @triton.jit
    def _block_topw_kernel(m_ptr, blk_start_ptr, blk_len_ptr, local_ptr, H,
                           W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
        """Each block's own top W keys, sorted descending: local [NB, H, BW] int64."""
        i_b, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        start = tl.load(blk_start_ptr + i_b).to(tl.int64)
        length = tl.load(blk_len_ptr + i_b)
        o_c = tl.arange(0, BC)
        mask = o_c < length
        tok = start + o_c
        b_m = tl.load(m_ptr + tok * H + i_h, mask=mask, other=0.0)
        b_key = tl.where(mask, _make_keys(b_m, tok), -9223372036854775808)
        b_key = tl.sort(b_key, descending=True)
        b_key = _head(b_key, BC, BW)
        o_w = tl.arange(0, BW)
        b_key = tl.where(o_w < W, b_key, -9223372036854775808)
        tl.store(local_ptr + (i_b * H + i_h) * BW + o_w, b_key)

    @triton.jit
    def _merge_topw_kernel(local_ptr, doc_first_blk_ptr, doc_num_blk_ptr, init_ptr, sel_ptr, final_ptr, H,
                           W: tl.constexpr, BW: tl.constexpr, HAS_INIT: tl.constexpr):
        """Walk the blocks of one sequence and head: emit the running top W, then merge the block into it.
        The running top W starts empty, or from the sequence's initial keys (a cache carried from before)."""
        i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        first = tl.load(doc_first_blk_ptr + i_n).to(tl.int64)
        nblk = tl.load(doc_num_blk_ptr + i_n)
        o_w = tl.arange(0, BW)
        if HAS_INIT:
            b_carry = tl.load(init_ptr + (i_n * H + i_h) * BW + o_w)
        else:
            b_carry = tl.full([BW], -9223372036854775808, dtype=tl.int64)
        for i in range(0, nblk):
            blk = first + i
            b_idx = 0xFFFFFFFF - (b_carry & 0xFFFFFFFF)
            b_idx = tl.where(b_carry == -9223372036854775808, -1, b_idx)
            tl.store(sel_ptr + (blk * H + i_h) * W + o_w, b_idx.to(tl.int32), mask=o_w < W)
            b_local = tl.load(local_ptr + (blk * H + i_h) * BW + o_w)
            b_cand = tl.reshape(tl.join(b_carry, b_local), (2 * BW,))
            b_cand = tl.sort(b_cand, descending=True)
            b_carry = _head(b_cand, 2 * BW, BW)
            b_carry = tl.where(o_w < W, b_carry, -9223372036854775808)
        tl.store(final_ptr + (i_n * H + i_h) * BW + o_w, b_carry)


def topw_launches(window: int, block: int) -> tuple[dict, dict]:
    """The compile-time arguments and warps of the two selection kernels for ``window`` and ``block``:
    ``(_block_topw_kernel's, _merge_topw_kernel's)`` (``HAS_INIT`` aside). One place for the launches and for the
    test that the shipped compile plans hold every recipe's (a plan without them compiles both kernels on the run's
    main thread at its first step)."""
    bw = max(1 << max(window - 1, 0).bit_length(), 2)  # triton.next_power_of_2, without needing triton
    bc = max(1 << max(block - 1, 0).bit_length(), bw)
    return (dict(W=window, BW=bw, BC=bc, num_warps=4 if bc >= 256 else 1),
            dict(W=window, BW=bw, num_warps=1 if bw <= 64 else 2))


def select_topw(m: torch.Tensor, table: BlockTable, window: int,
                init_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Score selection with the Triton kernels.

    Args:
        m: ``[B * T, H]`` float32 scores (contiguous). table: the block table. window: W >= 1.
        init_keys: ``[N, H, W]`` int64 keys every sequence's running top W starts from, in selection order
            (``KEY_EMPTY`` for empty slots), or None for empty caches.
    Returns:
        ``(sel [NB, H, W] int32, final_keys [N, H, W] int64)``: the cache of every block, and the top W keys of
        every sequence after merging all its blocks (empty keys are ``KEY_EMPTY``).
    """
    h = m.shape[1]
    block_launch, merge_launch = topw_launches(window, table.block)
    bw = block_launch["BW"]
    local = torch.empty(table.num_blocks, h, bw, dtype=torch.int64, device=m.device)
    sel = torch.full((table.num_blocks, h, window), -1, dtype=torch.int32, device=m.device)  # padding rows stay -1
    final = torch.empty(table.num_seqs, h, bw, dtype=torch.int64, device=m.device)
    if init_keys is not None:
        init = torch.full((table.num_seqs, h, bw), KEY_EMPTY, dtype=torch.int64, device=m.device)
        init[..., :window] = init_keys
    if table.num_blocks:
        _block_topw_kernel[(table.num_blocks, h)](m, table.blk_start, table.blk_len, local, h, **block_launch)
        _merge_topw_kernel[(table.num_seqs, h)](local, table.doc_first_blk, table.doc_num_blk,
                                                local if init_keys is None else init, sel, final, h,
                                                HAS_INIT=init_keys is not None, **merge_launch)
    elif init_keys is not None:
        final.copy_(init)
    else:
        final.fill_(KEY_EMPTY)
    return sel, final[..., :window]


def select_topw_torch(m: torch.Tensor, table: BlockTable, window: int) -> torch.Tensor:
    """The same selection as :func:`select_topw` by a masked ``topk`` over composite keys (the SDPA backend's).

    Builds ``[N, H, blocks per sequence, longest sequence]`` keys: fine for training shapes, quadratic in the
    number of blocks of a sequence.
    """
    device = m.device
    h = m.shape[1]
    doc_start = table.doc_start.long()
    doc_len = table.doc_len.long()
    n = doc_start.shape[0]
    if table.num_blocks == 0:
        return torch.empty(0, h, window, dtype=torch.int32, device=device)
    longest = int(doc_len.max())
    max_blk = -(-longest // table.block)
    offs = torch.arange(longest, device=device)
    tok = doc_start[:, None] + offs[None, :]  # [N, L]
    valid = offs[None, :] < doc_len[:, None]
    tok_safe = torch.where(valid, tok, torch.zeros_like(tok))
    keys = score_keys(m[tok_safe.view(-1)].view(n, longest, h), tok_safe[..., None].expand(n, longest, h))
    keys = torch.where(valid[..., None], keys, torch.full_like(keys, KEY_EMPTY)).transpose(1, 2)  # [N, H, L]
    blk_first = (torch.arange(max_blk, device=device) * table.block)[:, None]  # [nb, 1]
    earlier = offs[None, :] < blk_first  # [nb, L]
    masked = torch.where(earlier[None, None], keys[:, :, None, :], torch.full((), KEY_EMPTY, device=device))
    k = min(window, longest)
    top = masked.topk(k, dim=-1, sorted=True).values  # [N, H, nb, k]
    if k < window:
        top = torch.cat([top, top.new_full((*top.shape[:-1], window - k), KEY_EMPTY)], dim=-1)
    sel = keys_to_index(top).permute(0, 2, 1, 3)  # [N, nb, H, W]
    blk_ok = torch.arange(max_blk, device=device)[None, :] < table.doc_num_blk.long()[:, None]
    sel = sel[blk_ok]
    pad = sel.new_full((table.num_blocks - sel.shape[0], h, window), -1)
    return torch.cat([sel, pad], dim=0).contiguous()


def check_selection(m: torch.Tensor, sel: torch.Tensor, table: BlockTable, window: int) -> None:
    """Raise ``AssertionError`` unless ``sel`` is a valid top-W of the scores ``m`` ``[B * T, H]`` (tests).

    Every block's chosen set must be exactly the top ``min(W, #earlier tokens)`` earlier tokens of its sequence by
    (score descending, position ascending), unused slots ``-1``; padding rows of the table must be empty.
    """
    h = m.shape[1]
    blk_start, blk_len = table.blk_start.tolist(), table.blk_len.tolist()
    blk_doc_start = table.blk_doc_start.tolist()
    for i in range(table.num_blocks):
        got = sel[i].long()
        if blk_len[i] == 0:
            assert (got == -1).all(), f"padding block row {i} is not empty"
            continue
        lo, hi = blk_doc_start[i], blk_start[i]
        tok = torch.arange(lo, hi, device=m.device)
        keys = score_keys(m[lo:hi], tok[:, None].expand(-1, h)).transpose(0, 1)  # [H, candidates]
        k = min(window, hi - lo)
        want = keys_to_index(keys.topk(k, dim=-1).values).long() if k else tok.new_empty(h, 0)
        for hh in range(h):
            chosen = got[hh][got[hh] >= 0]
            assert int((got[hh] >= 0).sum()) == k, f"block {i} head {hh}: {int((got[hh] >= 0).sum())} chosen, want {k}"
            assert set(chosen.tolist()) == set(want[hh].tolist()), (
                f"block {i} head {hh}: chose {sorted(chosen.tolist())}, top-{window} is {sorted(want[hh].tolist())}")
