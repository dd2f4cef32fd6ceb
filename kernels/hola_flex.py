"""HOLA's cache read on PyTorch's FlexAttention: a candidate measured against the Triton kernels, not a backend.

Shape legend: B batch, T tokens, H heads, D head dim, NB blocks, W window, C block, n = B * T.

The read of :mod:`hola_titan.kernels.hola_triton_attn` (``o = o_state + sigmoid(gate) o_cache``, ``o_cache`` the
softmax over [P_b | causal block | sink] with RMS-normalised queries and keys) as two FlexAttention calls over two
sources of keys, each with its log-sum-exp, joined with the sink:

1. the cache: every block's selected entries gathered once into their own ``[1, H, NB * W, D]`` tensor; query
   token t reads the W entries of its block (a block mask of the block table);
2. the block's own rows: the token tensor itself, block-diagonal and causal.

``o_cache = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2 + e^sink)``: the sink is one more logit with no value. The
RMSNorms and both gammas are applied to copies of q and k first (FlexAttention reads whole tensors; folding the
per-token rstd into a ``score_mod`` would make them captured buffers that need gradients), so this path keeps
normalised copies of q and k and the gathered entries for backward, which the Triton kernels do not: the
comparison is of time, at that memory cost. Gradients come from FlexAttention's own backward (the log-sum-exp's
included) through autograd.

``flex`` is the FlexAttention function to call: ``torch.compile(flex_attention)`` on a GPU (eager FlexAttention
is a dense reference), the plain function in CPU tests.
"""

from __future__ import annotations

import torch

from hola_titan.kernels.hola_triton_select import BlockTable

NORM_EPS = 1e-6


def _rms(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * gamma.float()).to(x.dtype)


def block_masks(table: BlockTable, sel: torch.Tensor, num_tokens: int, *, window: int):
    """``(cache mask, own-block mask)`` of FlexAttention for the table's blocks and the selection ``sel``
    ``[NB, H, W]`` (-1 empty): what a batch would build once for all its layers (it depends on the selection only
    through which slots are filled)."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = sel.device
    nb, h = sel.shape[0], sel.shape[1]
    blk_len = table.blk_len.long()
    # Block of every token: real blocks are in token order, padding rows (length 0) take no token.
    tok_blk = torch.repeat_interleave(torch.arange(nb, device=device), blk_len, output_size=num_tokens)
    valid = (sel >= 0).permute(1, 0, 2).reshape(h, nb * window)

    def cache_mask(b, hh, q_idx, kv_idx):
        return (tok_blk[q_idx] == kv_idx // window) & valid[hh, kv_idx]

    def own_mask(b, hh, q_idx, kv_idx):
        return (tok_blk[q_idx] == tok_blk[kv_idx]) & (kv_idx <= q_idx)

    cache = create_block_mask(cache_mask, 1, h, num_tokens, nb * window, device=device) if window else None
    own = create_block_mask(own_mask, 1, None, num_tokens, num_tokens, device=device)
    return cache, own


def cache_read_flex(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, masks, *, window: int, flex=None):
    """``o`` ``[B, T, H, D]`` for the selection ``sel`` ``[NB, H, W]`` (flat token indices, -1 empty) and the
    ``masks`` of :func:`block_masks`."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    flex = flex or flex_attention
    bsz, seq_len, h, d = q.shape
    n = bsz * seq_len
    cache_mask, own_mask = masks
    # [1, H, n, D]; both gammas go to the query side (one normalised copy each of q and k; FlexAttention scales).
    qn = _rms(q, gamma_q * gamma_k).reshape(n, h, d).transpose(0, 1)[None]
    kn = _rms(k, torch.ones_like(gamma_k)).reshape(n, h, d).transpose(0, 1)[None]
    vt = v.reshape(n, h, d).transpose(0, 1)[None]
    scale = d ** -0.5
    aux = AuxRequest(lse=True)
    o2, a2 = flex(qn, kn, vt, block_mask=own_mask, scale=scale, return_aux=aux)
    parts = [(o2, a2.lse)]
    if window:
        nb = sel.shape[0]
        idx = sel.long().clamp_min(0).permute(1, 0, 2).reshape(h, nb * window)[..., None].expand(h, nb * window, d)
        k_sel, v_sel = kn[0].gather(1, idx)[None], vt[0].gather(1, idx)[None]
        o1, a1 = flex(qn, k_sel, v_sel, block_mask=cache_mask, scale=scale, return_aux=aux)
        parts.append((o1, a1.lse))
    # A query with no cache entries has lse -inf and a zero output there: its weight is 0.
    sink_l = sink.float()[None, :, None].expand_as(parts[0][1])
    top = torch.stack([lse for _, lse in parts] + [sink_l]).amax(0)
    weights = [torch.exp(lse - top) for _, lse in parts]
    total = sum(weights) + torch.exp(sink_l - top)
    o_cache = sum(w[..., None] * o.float() for w, (o, _) in zip(weights, parts)) / total[..., None]
    o_cache = o_cache[0].transpose(0, 1).reshape(bsz, seq_len, h, d)
    return (o_state.float() + torch.sigmoid(gate.float())[:, None] * o_cache).to(q.dtype)
