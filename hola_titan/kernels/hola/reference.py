"""Vectorised pure-PyTorch HOLA attention: the ``"reference"`` backend (DESIGN §1-2).

Runs on any device, computes in float32 (float64 inputs stay float64), and is differentiated by autograd.
Python loops run over chunks of the state path and over cache blocks, never over tokens.

Shape legend: B batch, T tokens, H heads, D head dim, N sequences (B, or documents with ``cu_seqlens``),
L longest sequence, W window, C block, R longest cache row (unfinished block of the initial cache + tokens).

Layout. Every sequence (a batch row, or a document of a packed row) becomes one row of a padded
[N, L] layout, so that the state and the cache restart at every document start without masks. Padding sits
after each sequence's last token, so causality alone keeps it out of every real output; padded steps have
``g = 0`` and ``beta = 0`` and leave the state unchanged, so the state after the padding is the final state.

State path (GDN): :func:`~hola_titan.kernels.gdn.reference.gated_delta_chunked`, with the surprise score
``m_t = beta_t * ||e_t||`` (detached) from its per-token errors ``e_t``.

Cache path. A cache row is [unfinished block of the initial cache | new tokens | padding], so row position
0 is a block start. The persistent cache of block b is kept by merging: ``P_{b+1} = top_W(P_b u block b)``
(``top_W(A u B) = top_W(top_W(A) u B)``), a stable sort by key over candidates laid out in position order,
which gives the spec's tie order (larger key first, then lower position). Then all blocks read at once:
queries of block b attend to [P_b | causal tokens of block b | sink].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hola_titan.kernels.gdn.reference import NORM_EPS, gated_delta_chunked, l2norm, sequence_layout, to_rows
from hola_titan.kernels.hola.cache import HolaCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rms_norm_backward(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of ``y = x rstd weight`` with ``rstd = rsqrt(mean(x^2) + eps)`` ``[..., 1]``, in rstd's
    dtype (the compute dtype); ``dweight`` summed over every dimension but the last."""
    cdt = rstd.dtype
    xhat = x.to(cdt) * rstd
    dyf = dy.to(cdt)
    dweight = (dyf * xhat).sum(dim=tuple(range(dyf.dim() - 1)))
    gy = dyf * weight.to(cdt)
    return rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True)), dweight


def merge_read(o_state: torch.Tensor, gated_cache: torch.Tensor, mix: str) -> torch.Tensor:
    """``o`` of ``hola_attention`` from the state read and ``sigmoid(gate) o_cache`` (same shapes): their sum
    (``mix="sum"``) or both side by side in the last dimension (``"parts"``)."""
    return o_state + gated_cache if mix == "sum" else torch.cat([o_state, gated_cache], dim=-1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _top_w_merge(cand_key: torch.Tensor, window: int, block: int, num_blocks: int) -> list[torch.Tensor]:
    """Persistent cache of every block as candidate indices.

    ``cand_key`` [N, H, W + num_blocks*C]: the selection key of the W initial-cache slots (already in
    selection order) followed by the row positions. Returns ``num_blocks + 1`` index tensors [N, H, W]:
    entry b is P_b, the cache read by block b (P_0 = the initial cache).
    """
    n, h, _ = cand_key.shape
    device = cand_key.device
    chosen = torch.arange(window, device=device).expand(n, h, window)
    history = [chosen]
    for b in range(num_blocks):
        blk = (window + b * block + torch.arange(block, device=device)).expand(n, h, block)
        cand = torch.cat([chosen, blk], dim=-1)
        # Candidates are in position order (P_b precedes block b and is in selection order itself), so a
        # stable descending sort breaks ties by lower position.
        order = torch.sort(cand_key.gather(-1, cand), dim=-1, descending=True, stable=True).indices[..., :window]
        chosen = cand.gather(-1, order)
        history.append(chosen)
    return history


def selection_order(cache: HolaCache, cdt: torch.dtype):
    """A cache's persistent entries in selection order: by position (empty slots last), then stably by the key
    (score, or position for recency), descending. Returns ``(scores in cdt, positions, k, v)``, ``[N, H, W]`` and
    ``[N, H, W, D]`` (k, v in the cache's dtype)."""
    pos = cache.positions
    score = cache.scores.to(cdt)
    key = pos if cache.evict == "recency" else score
    order = torch.sort(pos.masked_fill(pos < 0, torch.iinfo(torch.int64).max), dim=-1, stable=True).indices
    order = order.gather(-1, torch.sort(key.gather(-1, order), dim=-1, descending=True, stable=True).indices)
    return score.gather(-1, order), pos.gather(-1, order), _gather_rows(cache.k, order), _gather_rows(cache.v, order)


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [N, H, E, ...], idx [N, H, K] -> [N, H, K, ...]."""
    if x.dim() == 3:
        return x.gather(2, idx)
    return x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1]))


def cache_read_probs(q_rows, kc_rows, v_rows, row_valid, cache_kc, cache_v, cache_valid, sink, *, block: int,
                     window: int, history: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax of every block's read over [P_b | causal block | sink] on rows [N, H, R, D]: ``(probs [N, H, NB,
    C, W + C + 1], the sink's column last; values [N, H, NB, W + C, D])`` (no P_b columns with window 0). What
    :func:`cache_read` sums, kept apart for ``hola_titan.eval``'s split of the read by where its mass goes."""
    n, h, r, d = q_rows.shape
    nb = r // block
    if window > 0:
        sel = torch.stack(history[:nb], dim=2).view(n, h, nb * window)
        cand_kc = torch.cat([cache_kc, kc_rows], dim=2)
        cand_v = torch.cat([cache_v, v_rows], dim=2)
        cand_valid = torch.cat([cache_valid, row_valid[:, None, :].expand(n, h, r)], dim=2)
        kc_sel = _gather_rows(cand_kc, sel).view(n, h, nb, window, d)
        v_sel = _gather_rows(cand_v, sel).view(n, h, nb, window, d)
        valid_sel = _gather_rows(cand_valid, sel).view(n, h, nb, window)
    q_b = q_rows.view(n, h, nb, block, d)
    kc_b = kc_rows.view(n, h, nb, block, d)
    v_b = v_rows.view(n, h, nb, block, d)
    causal = torch.ones(block, block, dtype=torch.bool, device=q_rows.device).tril()
    if window > 0:
        keys = torch.cat([kc_sel, kc_b], dim=3)
        values = torch.cat([v_sel, v_b], dim=3)
        mask = torch.cat([valid_sel[..., None, :].expand(n, h, nb, block, window),
                          causal.expand(n, h, nb, block, block)], dim=-1)
    else:
        keys, values, mask = kc_b, v_b, causal.expand(n, h, nb, block, block)
    logits = (q_b @ keys.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    logits = logits.masked_fill(~mask, float("-inf"))
    sink_logit = sink.to(logits.dtype).view(1, h, 1, 1, 1).expand(n, h, nb, block, 1)
    return torch.softmax(torch.cat([logits, sink_logit], dim=-1), dim=-1), values


def cache_read(q_rows, kc_rows, v_rows, row_valid, cache_kc, cache_v, cache_valid, sink, *, block: int, window: int,
               history: list[torch.Tensor]) -> torch.Tensor:
    """Read [P_b | causal block | sink] for every block: the cache-path output on rows [N, H, R, D]."""
    probs, values = cache_read_probs(q_rows, kc_rows, v_rows, row_valid, cache_kc, cache_v, cache_valid, sink,
                                     block=block, window=window, history=history)
    return (probs[..., :-1] @ values).view(q_rows.shape)


# Inductor (torch 2.13, CPU) compiles this function to wrong gradients for k, g and beta (relative error ~1,
# forward correct; aot_eager is exact; each piece compiled alone is exact): see docs/LOG.md. The reference
# therefore always runs eagerly, and a compiled block graph-breaks around it; fullgraph compilation needs the
# custom-op backends.
@torch.compiler.disable
def hola_attention_reference(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int,
                             evict: str, cu_seqlens, initial_state, output_final_state: bool,
                             initial_cache: HolaCache | None, output_final_cache: bool,
                             selected: torch.Tensor | None = None, scale: float | None = None, mix: str = "sum"):
    """The reference backend. Arguments are validated by ``hola_titan.ops.hola_attention``.

    ``selected`` (tests only, no ``initial_cache``): the persistent cache every block reads, as ``[NB, H, W]``
    flat token indices (``-1`` empty) in the block table of ``hola_titan.kernels.hola.selection``, replacing
    the reference's own selection for the read (not for the final cache). ``scale``: the state read's factor
    (None: ``D^-1/2``); ``mix`` as in ``hola_attention``.
    """
    # The reference computes in float32 (float64 for float64 inputs) whatever autocast region it is called
    # from (a bf16 training step with backend="reference"): autocast would run its matmuls in bf16.
    with torch.autocast(q.device.type, enabled=False):
        return _reference(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block, evict=evict,
                          cu_seqlens=cu_seqlens, initial_state=initial_state,
                          output_final_state=output_final_state, initial_cache=initial_cache,
                          output_final_cache=output_final_cache, selected=selected, scale=scale, mix=mix)


def _reference(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window, block, evict, cu_seqlens, initial_state,
               output_final_state, initial_cache, output_final_cache, selected, scale, mix):
    in_dtype = q.dtype
    cdt = compute_dtype(in_dtype)
    bsz, seq_len, h, d = q.shape
    device = q.device
    index, lengths = sequence_layout(bsz, seq_len, cu_seqlens, device)
    n = index.shape[0]

    def flat(x):  # [B, T, ...] -> [B*T + 1, ...] with a zero padding slot at the end
        x = x.reshape(bsz * seq_len, *x.shape[2:]).to(cdt)
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)

    q_f, k_f, v_f, g_f, beta_f = map(flat, (q, k, v, g, beta))
    state0 = (torch.zeros(n, h, d, d, dtype=cdt, device=device) if initial_state is None
              else initial_state.to(cdt))
    o_rows, e_rows, final_state = gated_delta_chunked(
        to_rows(l2norm(q_f), index), to_rows(l2norm(k_f), index), to_rows(v_f, index),
        to_rows(g_f, index), to_rows(beta_f, index), state0, d ** -0.5 if scale is None else scale)
    # Rows back to tokens: token t sits at row n_t, offset i_t.
    valid = index < bsz * seq_len
    row_pos = torch.nonzero(valid.reshape(-1)).squeeze(1)  # ordered by (n, i)
    token_of = index.reshape(-1)[row_pos]
    inverse = row_pos[torch.argsort(token_of)]
    o_tok = o_rows.reshape(-1, h, d)[inverse]
    final_cache = None
    if evict != "none":
        m_rows = (e_rows.norm(dim=-1) * to_rows(beta_f, index)).detach().masked_fill(~valid[..., None], float("-inf"))
        o_cache_tok, final_cache = _cache_path(
            q_f, k_f, v_f, m_rows, index, lengths, gamma_q.to(cdt), gamma_k.to(cdt), sink.to(cdt),
            window=window, block=block, evict=evict, initial_cache=initial_cache, in_dtype=in_dtype,
            want_final=output_final_cache, num_tokens=bsz * seq_len, selected=selected)
        o_tok = merge_read(o_tok, torch.sigmoid(gate.to(cdt))[None, :, None] * o_cache_tok, mix)
    o = o_tok.view(bsz, seq_len, h, -1).to(in_dtype)
    return o, (final_state if output_final_state else None), final_cache


def _cache_path(q_f, k_f, v_f, m_rows, index, lengths, gamma_q, gamma_k, sink, *, window, block, evict,
                initial_cache, in_dtype, want_final, num_tokens, selected=None):
    """Cache-path output per token [B*T, H, D] and, if wanted, the final cache."""
    device = q_f.device
    n, length = index.shape
    h, d = q_f.shape[1], q_f.shape[2]
    cdt = q_f.dtype
    cache = initial_cache
    if cache is None:
        cache = HolaCache.empty(n, h, d, window=window, block=block, evict=evict, dtype=in_dtype, device=device,
                                score_dtype=cdt)
    seen0 = cache.seen
    nb0 = seen0 % block  # tokens of the unfinished block carried in from the previous call
    row_len = nb0 + lengths
    num_blocks = -(-int(row_len.max().item()) // block) if n else 0
    r_pad = num_blocks * block

    # Entries: [B*T tokens | N*C buffer slots of the initial cache | one zero padding slot].
    pad_slot = num_tokens + n * block
    r = torch.arange(r_pad, device=device)[None, :]
    tok_i = (r - nb0[:, None]).clamp(0, max(length - 1, 0))
    src_tok = index.gather(1, tok_i) if length else torch.full_like(r.expand(n, r_pad), pad_slot)
    is_buf = r < nb0[:, None]
    is_tok = (r >= nb0[:, None]) & (r < row_len[:, None])
    src_buf = num_tokens + torch.arange(n, device=device)[:, None] * block + r
    src = torch.where(is_buf, src_buf, torch.where(is_tok & (src_tok < num_tokens), src_tok,
                                                   torch.full_like(src_tok, pad_slot)))

    def entries(tok, buf):  # tok [B*T + 1, H, ...] (last slot zero), buf [N, H, C, ...] -> [E, H, ...]
        buf = buf.to(cdt).transpose(1, 2).reshape(n * block, h, *buf.shape[3:])
        return torch.cat([tok[:-1], buf, tok[-1:]], dim=0)

    def rows(x):  # [E, H, ...] -> [N, H, R, ...]
        y = x[src.reshape(-1)].view(n, r_pad, *x.shape[1:])
        return y.transpose(1, 2)

    # Scores of new tokens live in the state-path row layout; move them to the token layout first.
    m_tok = torch.full((num_tokens + 1, h), float("-inf"), dtype=cdt, device=device)
    valid = index < num_tokens
    m_tok[index[valid]] = m_rows[valid]
    kpre_rows = rows(entries(k_f, cache.buf_k))
    v_rows = rows(entries(v_f, cache.buf_v))
    q_rows = rows(entries(q_f, torch.zeros_like(cache.buf_k)))
    m_rows_c = rows(entries(m_tok, cache.buf_scores)).masked_fill(~(is_buf | is_tok)[:, None, :], float("-inf"))
    base = seen0 - nb0
    pos_rows = torch.where(is_buf | is_tok, base[:, None] + r, torch.full_like(r.expand(n, r_pad), -1))

    c_score, c_pos, c_k, c_v = selection_order(cache, cdt)
    c_k, c_v = c_k.to(cdt), c_v.to(cdt)
    c_valid = c_pos >= 0

    if evict == "recency":
        cand_key = torch.cat([c_pos, pos_rows[:, None, :].expand(n, h, r_pad)], dim=-1)
    else:
        cand_key = torch.cat([c_score.masked_fill(~c_valid, float("-inf")), m_rows_c], dim=-1)
    history = _top_w_merge(cand_key, window, block, num_blocks)
    if selected is not None:
        if initial_cache is not None:
            raise ValueError("selected: only without initial_cache")
        history = _history_from_selected(selected, index, lengths, window, block, num_blocks) + history[num_blocks:]

    qc_rows = rms_norm(q_rows, gamma_q)
    kc_rows = rms_norm(kpre_rows, gamma_k)
    o_rows = cache_read(qc_rows, kc_rows, v_rows, is_buf | is_tok, rms_norm(c_k, gamma_k), c_v, c_valid, sink,
                        block=block, window=window, history=history)
    # Row outputs back to tokens.
    flat_rows = o_rows.transpose(1, 2).reshape(n * r_pad, h, d)
    row_index = torch.arange(n, device=device)[:, None] * r_pad + r
    take = is_tok & (src < num_tokens)
    o_tok = torch.empty(num_tokens, h, d, dtype=cdt, device=device)
    o_tok = o_tok.index_put((src[take],), flat_rows[row_index[take]])

    final = None
    if want_final:
        final = _final_cache(history, window, block, row_len, r_pad, c_score, c_pos, c_k, c_v, m_rows_c,
                             pos_rows, kpre_rows, v_rows, seen0 + lengths, evict, in_dtype)
    return o_tok, final


def _history_from_selected(selected, index, lengths, window, block, num_blocks):
    """Flat-token selections [NB, H, W] (sequence-major blocks) as candidate indices per block of the rows."""
    nblk = (lengths + block - 1) // block
    first = torch.cumsum(nblk, 0) - nblk
    doc_start = index[:, 0]
    out = []
    for b in range(num_blocks):
        inside = b < nblk
        sel = selected[(first + b).clamp(0, max(selected.shape[0] - 1, 0))].long()
        cand = window + sel - doc_start[:, None, None]
        out.append(torch.where(inside[:, None, None] & (sel >= 0), cand, torch.zeros_like(cand)))
    return out


def _final_cache(history, window, block, row_len, r_pad, c_score, c_pos, c_k, c_v, m_rows, pos_rows, kpre_rows,
                 v_rows, seen, evict, in_dtype) -> HolaCache:
    n, h = c_score.shape[:2]
    device = c_k.device
    full_blocks = row_len // block
    top = torch.stack(history, dim=2)  # [N, H, nb + 1, W]
    top = top.gather(2, full_blocks.view(n, 1, 1, 1).expand(n, h, 1, window)).squeeze(2)
    cand_score = torch.cat([c_score, m_rows], dim=-1)
    cand_pos = torch.cat([c_pos, pos_rows[:, None, :].expand(n, h, r_pad)], dim=-1)
    cand_k = torch.cat([c_k, kpre_rows], dim=2)
    cand_v = torch.cat([c_v, v_rows], dim=2)
    positions = cand_pos.gather(-1, top)
    ok = positions >= 0
    # Unfinished block: rows [full*C, row_len); the rows are padded by one block so the gather stays inside.
    extra = block
    buf_idx = (full_blocks * block)[:, None] + torch.arange(block, device=device)[None, :]
    buf_ok = buf_idx < row_len[:, None]
    buf_idx = buf_idx.clamp(max=r_pad + extra - 1)

    def buf(x):  # [N, H, R, ...] -> [N, H, C, ...]
        x = F.pad(x, (0, 0, 0, extra)) if x.dim() == 4 else F.pad(x, (0, extra), value=float("-inf"))
        return _gather_rows(x, buf_idx[:, None, :].expand(n, h, block))

    zero = torch.zeros((), dtype=kpre_rows.dtype, device=device)
    return HolaCache(
        scores=cand_score.gather(-1, top).masked_fill(~ok, float("-inf")),
        positions=positions,
        k=torch.where(ok[..., None], _gather_rows(cand_k, top), zero).to(in_dtype),
        v=torch.where(ok[..., None], _gather_rows(cand_v, top), zero).to(in_dtype),
        buf_scores=buf(m_rows).masked_fill(~buf_ok[:, None, :], float("-inf")),
        buf_k=torch.where(buf_ok[:, None, :, None], buf(kpre_rows), zero).to(in_dtype),
        buf_v=torch.where(buf_ok[:, None, :, None], buf(v_rows), zero).to(in_dtype),
        seen=seen,
        window=window, block=block, evict=evict,
    )
