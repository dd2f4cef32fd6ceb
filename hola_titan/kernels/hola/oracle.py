"""Token-by-token HOLA oracle: DESIGN §1 followed literally, with the buffers of decoding.

For tests only. Each sequence (batch row, or document with ``cu_seqlens``) is run one token at a time:
the state recurrence, the surprise score, a block buffer that every token joins, a read over
[top-W buffer | block buffer | sink], and a merge of the block buffer into the top-W buffer when the block
is full. Selection uses Python sorting on the scores' values with the spec's tie order. Slow by design.
"""

from __future__ import annotations

import math

import torch

from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.kernels.hola.reference import compute_dtype, merge_read, rms_norm
from hola_titan.kernels.gdn.reference import l2norm


def naive_hola_attention(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int = 64, block: int = 256,
                         evict: str = "score", cu_seqlens=None, initial_state=None, output_final_state=False,
                         initial_cache: HolaCache | None = None, output_final_cache=False,
                         scale: float | None = None, mix: str = "sum"):
    """Same contract as ``hola_attention``; see the module docstring."""
    in_dtype = q.dtype
    cdt = compute_dtype(in_dtype)
    bsz, seq_len, h, d = q.shape
    if cu_seqlens is None:
        spans = [(b, 0, seq_len) for b in range(bsz)]
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    scale = d ** -0.5 if scale is None else scale
    out = {}
    finals, caches = [], []
    for n, (b, start, end) in enumerate(spans):
        state = (torch.zeros(h, d, d, dtype=cdt, device=q.device) if initial_state is None
                 else initial_state[n].to(cdt))
        # Per head: lists of (score, position, k, v) entries.
        top = [[] for _ in range(h)]
        buf = [[] for _ in range(h)]
        seen = 0
        if initial_cache is not None:
            seen = int(initial_cache.seen[n])
            for hh in range(h):
                for j in range(initial_cache.window):
                    pos = int(initial_cache.positions[n, hh, j])
                    if pos >= 0:
                        top[hh].append((float(initial_cache.scores[n, hh, j]), pos,
                                        initial_cache.k[n, hh, j].to(cdt), initial_cache.v[n, hh, j].to(cdt)))
                for j in range(seen % block):
                    buf[hh].append((float(initial_cache.buf_scores[n, hh, j]), seen - seen % block + j,
                                    initial_cache.buf_k[n, hh, j].to(cdt), initial_cache.buf_v[n, hh, j].to(cdt)))
        for t in range(start, end):
            q_t, k_t, v_t = (x[b, t].to(cdt) for x in (q, k, v))
            alpha = torch.exp(g[b, t].to(cdt))  # [H]
            beta_t = beta[b, t].to(cdt)
            kh, qh = l2norm(k_t), l2norm(q_t)
            e = v_t - alpha[:, None] * torch.einsum("hk,hkv->hv", kh, state)  # decay first, then predict
            state = alpha[:, None, None] * state + beta_t[:, None, None] * kh[:, :, None] * e[:, None, :]
            o_t = scale * torch.einsum("hk,hkv->hv", qh, state)
            if evict != "none":
                m = (beta_t * e.detach().norm(dim=-1)).tolist()
                qc = rms_norm(q_t, gamma_q.to(cdt))
                reads = []
                for hh in range(h):
                    buf[hh].append((m[hh], seen, k_t[hh], v_t[hh]))
                    visible = top[hh] + buf[hh]
                    keys = torch.stack([rms_norm(entry[2], gamma_k.to(cdt)) for entry in visible])
                    vals = torch.stack([entry[3] for entry in visible])
                    logits = keys @ qc[hh] / math.sqrt(d)
                    probs = torch.softmax(torch.cat([logits, sink[hh].to(cdt).view(1)]), dim=0)[:-1]
                    reads.append(probs @ vals)
                o_t = merge_read(o_t, torch.sigmoid(gate.to(cdt))[:, None] * torch.stack(reads), mix)
            seen += 1
            if evict != "none" and seen % block == 0:
                for hh in range(h):
                    merged = top[hh] + buf[hh]
                    if evict == "recency":
                        merged.sort(key=lambda entry: -entry[1])
                    else:
                        merged.sort(key=lambda entry: (-entry[0], entry[1]))
                    top[hh] = merged[:window]
                    buf[hh] = []
            out[(b, t)] = o_t
        finals.append(state)
        if output_final_cache and evict != "none":
            caches.append(_to_cache(top, buf, seen, h, d, window, block, evict, in_dtype, cdt, q.device))
    o = torch.stack([torch.stack([out[(b, t)] for t in range(seq_len)]) for b in range(bsz)]).to(in_dtype)
    final_state = torch.stack(finals) if output_final_state else None
    final_cache = HolaCache.cat(caches) if caches else None
    return o, final_state, final_cache


def _to_cache(top, buf, seen, h, d, window, block, evict, dtype, cdt, device) -> HolaCache:
    cache = HolaCache.empty(1, h, d, window=window, block=block, evict=evict, dtype=dtype, device=device,
                            score_dtype=cdt)
    fields = {name: [] for name in ("scores", "positions", "k", "v", "buf_scores", "buf_k", "buf_v")}
    for hh in range(h):
        for prefix, entries, size in (("", top[hh], window), ("buf_", buf[hh], block)):
            scores = [e[0] for e in entries] + [float("-inf")] * (size - len(entries))
            ks = [e[2] for e in entries] + [torch.zeros(d, dtype=cdt, device=device)] * (size - len(entries))
            vs = [e[3] for e in entries] + [torch.zeros(d, dtype=cdt, device=device)] * (size - len(entries))
            fields[prefix + "scores"].append(torch.tensor(scores, dtype=cdt, device=device))
            fields[prefix + "k"].append(torch.stack(ks) if ks else torch.zeros(0, d, dtype=cdt, device=device))
            fields[prefix + "v"].append(torch.stack(vs) if vs else torch.zeros(0, d, dtype=cdt, device=device))
            if not prefix:
                positions = [e[1] for e in entries] + [-1] * (size - len(entries))
                fields["positions"].append(torch.tensor(positions, dtype=torch.int64, device=device))
    for name, values in fields.items():
        tensor = torch.stack(values)[None]
        setattr(cache, name, tensor.to(dtype) if name in ("k", "v", "buf_k", "buf_v") else tensor)
    cache.seen = torch.tensor([seen], dtype=torch.int64, device=device)
    return cache
