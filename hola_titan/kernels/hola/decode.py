"""One decoding step of ``hola_attention``: one token per sequence, continuing from a state and a cache.

Shape legend: B sequences (batch rows), H heads, D head dim, W = window, C = block.

Why a separate path: the general continuation (``hola_attention_reference``'s ``_cache_path``, the Triton
backend's prefix of cache rows) lays a call out as blocks of rows, which for a single token costs about 1,500 small
ATen calls per layer, and decoding ran at the host's pace (docs/LOG.md). One token needs only the recurrent
update, a read of at most W + C + 1 rows plus the sink, a write into its block's buffer slot and, when the token
completes its block, the top-W merge: a fixed number of tensor operations with static shapes and no host
synchronisation.

The arithmetic is the reference's for a one-token call, term by term (the state, the scores and the cache come
out equal; the output's read sums its keys in another order, so it can differ in the last bit):
``gated_delta_chunked`` with a chunk of one token (``e = v - (alpha kh) S``,
``o = s ((alpha qh) S + beta (qh . kh) e)``, ``S' = alpha S + beta kh^T e``),
the cache read of ``cache_read`` (persistent entries, the block's earlier tokens and the token itself, the sink;
RMSNorm-gamma on q and k; logits over sqrt(D)), and the merge of ``_top_w_merge`` (persistent entries in
selection order, then the block's tokens by position; a stable descending sort by the key, so ties go to the
lower position).
"""

from __future__ import annotations

import math

import torch

from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.kernels.hola.reference import compute_dtype, merge_read, rms_norm, selection_order
from hola_titan.kernels.gdn.reference import l2norm


def applies(args: tuple, *, cu_seqlens, initial_state, initial_cache, evict: str) -> bool:
    """Whether a call on ``args`` (q, k, v, g, beta, gamma_q, gamma_k, sink, gate) is a decoding step this module
    computes: one token per row, no ``cu_seqlens``, continuing from a state (and, for HOLA, a cache), and no
    gradient wanted."""
    if args[0].shape[1] != 1 or cu_seqlens is not None or initial_state is None:
        return False
    if evict != "none" and initial_cache is None:
        return False
    if torch.is_grad_enabled():
        cache_tensors = () if initial_cache is None else (initial_cache.k, initial_cache.v)
        if any(t is not None and t.requires_grad for t in (*args, initial_state, *cache_tensors)):
            return False
    return True


def decode_step(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int, evict: str,
                initial_state: torch.Tensor, initial_cache: HolaCache | None, output_final_state: bool,
                output_final_cache: bool, scale: float, mix: str = "sum"):
    """``hola_attention`` for ``[B, 1, H, D]`` inputs continuing from ``initial_state`` (and ``initial_cache``);
    arguments validated (and ``scale``, the state read's factor, resolved) by ``hola_titan.ops.hola_attention``;
    ``mix`` as there.
    Returns ``(o, final_state, final_cache)``."""
    # Float32 arithmetic like the reference's, also inside an autocast region.
    with torch.autocast(q.device.type, enabled=False):
        return _step(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block, evict=evict,
                     initial_state=initial_state, initial_cache=initial_cache,
                     output_final_state=output_final_state, output_final_cache=output_final_cache, scale=scale,
                     mix=mix)


def _step(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window, block, evict, initial_state, initial_cache,
          output_final_state, output_final_cache, scale, mix):
    in_dtype = q.dtype
    cdt = compute_dtype(in_dtype)
    bsz, _, h, d = q.shape
    q1, k1, v1 = (x[:, 0].to(cdt) for x in (q, k, v))  # [B, H, D]
    g1, beta1 = g[:, 0].to(cdt), beta[:, 0].to(cdt)  # [B, H]
    state = initial_state.to(cdt)  # [B, H, D, D]

    # State path: one token of gated_delta_chunked.
    qh, kh = l2norm(q1), l2norm(k1)
    alpha = g1.exp()[..., None]  # [B, H, 1]
    e = v1 - ((kh * alpha)[..., None, :] @ state).squeeze(-2)
    o_state = ((qh * alpha)[..., None, :] @ state).squeeze(-2) + ((qh * kh).sum(-1) * beta1)[..., None] * e
    o_state = o_state * scale
    final_state = alpha[..., None] * state + (kh * beta1[..., None])[..., :, None] * e[..., None, :]
    final_state = final_state if output_final_state else None
    if evict == "none":
        return o_state.to(in_dtype)[:, None], final_state, None

    cache = initial_cache
    c, w = block, window
    m = e.norm(dim=-1) * beta1  # [B, H] the token's score
    r = cache.seen % c  # [B] the token's slot in its block
    slots = torch.arange(c, device=q.device)
    c_score, c_pos, c_k, c_v = selection_order(cache, cdt)
    c_valid = c_pos >= 0

    # Read: persistent entries, the block's earlier tokens, the token itself, and the sink.
    qc = rms_norm(q1, gamma_q.to(cdt))
    keys = rms_norm(torch.cat([c_k.to(cdt), cache.buf_k.to(cdt), k1[:, :, None]], dim=2), gamma_k.to(cdt))
    values = torch.cat([c_v.to(cdt), cache.buf_v.to(cdt), v1[:, :, None]], dim=2)
    earlier = (slots[None, :] < r[:, None])[:, None, :].expand(bsz, h, c)
    mask = torch.cat([c_valid, earlier, earlier.new_ones(bsz, h, 1)], dim=-1)
    logits = (qc[:, :, None, :] @ keys.transpose(-1, -2)).squeeze(-2) * (1.0 / math.sqrt(d))
    logits = logits.masked_fill(~mask, float("-inf"))
    sink_logit = sink.to(cdt).view(1, h, 1).expand(bsz, h, 1)
    probs = torch.softmax(torch.cat([logits, sink_logit], dim=-1), dim=-1)[..., :-1]
    o_cache = (probs[:, :, None, :] @ values).squeeze(-2)
    o = merge_read(o_state, torch.sigmoid(gate.to(cdt))[None, :, None] * o_cache, mix)
    o = o.to(in_dtype)[:, None]
    if not output_final_cache:
        return o, final_state, None

    # Write the token into its buffer slot.
    here = (slots[None, :] == r[:, None])[:, None, :]  # [B, 1, C]
    # Scores in the compute dtype, as the reference writes them, whatever dtype the incoming cache holds.
    buf_scores = torch.where(here, m[..., None], cache.buf_scores.to(cdt))
    buf_k = torch.where(here[..., None], k[:, 0, :, None].to(cache.buf_k.dtype), cache.buf_k)
    buf_v = torch.where(here[..., None], v[:, 0, :, None].to(cache.buf_v.dtype), cache.buf_v)
    seen = cache.seen + 1

    # Rows whose block the token completes: merge the persistent entries with the block's tokens.
    done = r == c - 1  # [B]
    block_pos = (cache.seen - r)[:, None] + slots[None, :]  # [B, C], all valid when done
    cand_pos = torch.cat([c_pos, block_pos[:, None, :].expand(bsz, h, c)], dim=-1)
    cand_score = torch.cat([c_score, buf_scores], dim=-1)
    if evict == "recency":
        cand_key = cand_pos
    else:
        cand_key = torch.cat([c_score.masked_fill(~c_valid, float("-inf")), buf_scores], dim=-1)
    top = torch.sort(cand_key, dim=-1, descending=True, stable=True).indices[..., :w]
    rows = top[..., None].expand(*top.shape, d)
    merged_pos = cand_pos.gather(-1, top)
    merged_score = cand_score.gather(-1, top)
    merged_k = torch.cat([c_k, buf_k], dim=2).gather(2, rows)
    merged_v = torch.cat([c_v, buf_v], dim=2).gather(2, rows)

    def pick(merged, kept):
        return torch.where(done.view(bsz, *([1] * (merged.dim() - 1))), merged, kept)

    positions = pick(merged_pos, c_pos)
    ok = positions >= 0
    zero = torch.zeros((), dtype=in_dtype, device=q.device)
    empty_block = done.view(bsz, 1, 1)
    final_cache = HolaCache(
        scores=pick(merged_score, c_score).masked_fill(~ok, float("-inf")),
        positions=positions,
        k=torch.where(ok[..., None], pick(merged_k, c_k), zero).to(in_dtype),
        v=torch.where(ok[..., None], pick(merged_v, c_v), zero).to(in_dtype),
        buf_scores=buf_scores.masked_fill(empty_block, float("-inf")),
        buf_k=torch.where(empty_block[..., None], zero, buf_k).to(in_dtype),
        buf_v=torch.where(empty_block[..., None], zero, buf_v).to(in_dtype),
        seen=seen, window=w, block=c, evict=evict,
    )
    return o, final_state, final_cache
