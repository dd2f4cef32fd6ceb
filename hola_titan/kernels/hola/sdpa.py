"""The ``"sdpa"`` backend of ``hola_attention``: the paper's ``cache_kernel = sdpa`` path, in the input dtype.

Shape legend: B batch, T tokens, H heads, D head dim, NB blocks, C block, W window, K = W + C + sink + padding.

State path and score as in the Triton backend (fla's chunk op through :mod:`hola_titan.kernels.gdn.fla_bridge`; the fp32
reference stands in on a CPU). Selection by a masked ``topk`` over composite (score, position) keys, so the tie
order is the spec's. The cache read gathers, for every block, the W selected rows and the block's own rows of
``kc = RMSNorm_{gamma_k}(k)`` and ``v`` into ``[NB, H, K, D]``, and runs one batched
``torch.nn.functional.scaled_dot_product_attention`` over all blocks with an additive mask: 0 for valid cache
slots and causal in-block keys, ``-inf`` elsewhere, and ``sink_h`` on one zero key and value (the null sink; its
gradient flows through the mask). The RMSNorms are computed in float32 and rounded to the input dtype, the
attention and the mix run in the input dtype. This is the baseline for speed and bf16 error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hola_titan.kernels.hola.reference import merge_read, rms_norm
from hola_titan.kernels.hola.stages import final_cache_from_selection, gather_head_rows, state_and_table
from hola_titan.kernels.hola.selection import select_recency, select_topw_torch
from hola_titan.kernels.runtime.documents import BlockTable

KEY_ALIGN = 16  # pad the key dimension (W + C + 1) so SDPA's fused kernels take the mask without copies


@torch.library.custom_op("hola::select_topw_torch", mutates_args=())
def select_topw_torch_op(m: torch.Tensor, blk_start: torch.Tensor, blk_len: torch.Tensor,
                         blk_doc_start: torch.Tensor, doc_start: torch.Tensor, doc_len: torch.Tensor,
                         doc_first_blk: torch.Tensor, doc_num_blk: torch.Tensor, block: int,
                         window: int) -> torch.Tensor:
    """:func:`select_topw_torch` as one opaque op: ``sel [NB, H, W]`` int32 for ``m`` ``[B * T, H]``.

    The masked ``topk`` sizes its keys by the longest sequence of the batch and drops the table's padding rows, both
    read from the data; traced by ``torch.compile``, that is a graph break (an error with ``compile.fullgraph``). The
    result's shape depends on the shapes alone, so behind a custom op the compiled block stays one graph.
    """
    table = BlockTable(blk_start=blk_start, blk_len=blk_len, blk_doc_start=blk_doc_start, doc_start=doc_start,
                       doc_len=doc_len, doc_first_blk=doc_first_blk, doc_num_blk=doc_num_blk, block=block)
    return select_topw_torch(m, table, window)


@select_topw_torch_op.register_fake
def _(m, blk_start, blk_len, blk_doc_start, doc_start, doc_len, doc_first_blk, doc_num_blk, block, window):
    return m.new_empty(blk_start.shape[0], m.shape[1], window, dtype=torch.int32)


def _select(m_flat, table, *, window, evict, num_heads):
    if window == 0:
        return torch.empty(table.num_blocks, num_heads, 0, dtype=torch.int32, device=m_flat.device)
    if evict == "recency":
        return select_recency(table, num_heads, window)
    # The selection takes no gradient (indices); detached, the op needs no autograd registration.
    return select_topw_torch_op(m_flat.detach(), *(getattr(table, f) for f in BlockTable.FIELDS), table.block,
                                window)


def hola_attention_sdpa(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int, evict: str,
                        cu_seqlens=None, initial_state=None, output_final_state: bool = False,
                        output_final_cache: bool = False, selected: torch.Tensor | None = None,
                        return_aux: bool = False, state_impl: str = "auto",
                        chunk_indices: torch.Tensor | None = None, block_table=None, scale: float | None = None,
                        mix: str = "sum"):
    """The SDPA backend; same arguments and results as ``hola_attention_triton``."""
    bsz, seq_len, h, d = q.shape
    dtype, device = q.dtype, q.device
    o_state, m, final_state, table = state_and_table(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=output_final_state,
        impl=state_impl, chunk_indices=chunk_indices, scale=scale, evict=evict, block=block, block_table=block_table)
    aux = {"m": m}
    if table is None:  # evict "none": GDN, no cache read
        return (o_state, final_state, None, aux) if return_aux else (o_state, final_state, None)
    m_flat = m.reshape(bsz * seq_len, h)
    if selected is None:
        sel = _select(m_flat, table, window=window, evict=evict, num_heads=h)
    else:
        sel = selected.to(device=device, dtype=torch.int32)
    num_tokens = bsz * seq_len
    nb = table.num_blocks

    # Token rows [B*T, H, D]; a slot with index B*T (past a block's tokens, an empty cache slot) reads zeros and
    # takes no gradient (gather_head_rows: its backward does not sum every such slot into one padding row).
    def rows(x):
        return x.reshape(num_tokens, h, d)

    qc = rows(rms_norm(q.float(), gamma_q.float()).to(dtype))
    kc = rows(rms_norm(k.float(), gamma_k.float()).to(dtype))
    vr = rows(v)
    offs = torch.arange(block, device=device)
    blk_tok = table.blk_start.long()[:, None] + offs[None, :]  # [NB, C]
    blk_ok = offs[None, :] < table.blk_len.long()[:, None]
    blk_tok = torch.where(blk_ok, blk_tok, torch.full_like(blk_tok, num_tokens))
    blk_tok_h = blk_tok[:, :, None].expand(nb, block, h)

    def gather_block(x):  # [B*T, H, D] -> [NB, H, C, D]
        return gather_head_rows(x, blk_tok_h).transpose(1, 2)

    cache_ok = sel >= 0  # [NB, H, W]
    cache_tok = torch.where(cache_ok, sel.long(), torch.full_like(sel, num_tokens, dtype=torch.int64))
    cache_tok_h = cache_tok.transpose(1, 2)  # [NB, W, H]

    def gather_cache(x):  # [B*T, H, D] -> [NB, H, W, D]
        return gather_head_rows(x, cache_tok_h).transpose(1, 2)

    n_keys = window + block + 1
    pad = -n_keys % KEY_ALIGN
    zeros = q.new_zeros(nb, h, 1 + pad, d)
    keys = torch.cat([gather_cache(kc), gather_block(kc), zeros], dim=2)
    values = torch.cat([gather_cache(vr), gather_block(vr), zeros], dim=2)
    neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    causal = (offs[None, :] <= offs[:, None]) & blk_ok[:, None, :]  # [NB, C(query), C(key)]
    mask = torch.cat([
        torch.where(cache_ok[:, :, None, :], zero, neg_inf).expand(nb, h, block, window),
        torch.where(causal[:, None], zero, neg_inf).expand(nb, h, block, block),
        sink.to(dtype).view(1, h, 1, 1).expand(nb, h, block, 1),
        neg_inf.expand(nb, h, block, pad),
    ], dim=-1)
    o_blk = F.scaled_dot_product_attention(gather_block(qc), keys, values, attn_mask=mask)  # [NB, H, C, D]
    # Back to token order with static shapes (a boolean mask would size the result by the data: a graph break under
    # torch.compile): every token is one slot of one block, and the padding slots, all pointing at row B*T, land in
    # one extra row that is dropped (its gradient is zero).
    o_cache = o_blk.new_zeros(num_tokens + 1, h, d).index_put((blk_tok.reshape(-1),),
                                                              o_blk.transpose(1, 2).reshape(-1, h, d))[:num_tokens]
    lam = torch.sigmoid(gate.float()).to(dtype)
    o = merge_read(o_state, lam.view(1, 1, h, 1) * o_cache.view(bsz, seq_len, h, d), mix)
    final_cache = None
    if output_final_cache:
        final_keys = None
        if evict == "score" and selected is None and window > 0:
            from hola_titan.kernels.hola.selection import score_keys
            final_keys = _final_keys(m_flat, table, window, score_keys)
        final_cache = final_cache_from_selection(q, k, v, m_flat, sel, final_keys, table, window=window, block=block,
                                                 evict=evict)
    aux.update(sel=sel, table=table)
    return (o, final_state, final_cache, aux) if return_aux else (o, final_state, final_cache)


def _final_keys(m_flat, table, window, score_keys):
    """Top-W keys over the completed blocks of every sequence: ``[N, H, W]`` int64."""
    from hola_titan.kernels.hola.selection import KEY_EMPTY
    n, h = table.num_seqs, m_flat.shape[1]
    out = torch.full((n, h, window), KEY_EMPTY, dtype=torch.int64, device=m_flat.device)
    starts, lens = table.doc_start.tolist(), table.doc_len.tolist()
    for i in range(n):
        end = starts[i] + (lens[i] // table.block) * table.block
        if end > starts[i]:
            tok = torch.arange(starts[i], end, device=m_flat.device)
            keys = score_keys(m_flat[starts[i]:end], tok[:, None].expand(-1, h)).transpose(0, 1)
            top = keys.topk(min(window, keys.shape[1]), dim=-1).values
            out[i, :, :top.shape[1]] = top
    return out
