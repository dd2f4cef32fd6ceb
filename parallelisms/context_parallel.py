"""Context parallelism: every row is split into ``R`` contiguous shards, one per rank of the ``cp`` mesh.

Recurrent flavours (HOLA, HOLA+recency, GDN) run the sequence-parallel chunked scan of HOLA_SPEC section 3;
Transformer++ runs exact causal attention over keys and values all-gathered from the cp group.

Shape legend: R cp ranks, r this rank, T row length, L = T / R shard length, H heads, D head dim, C block,
W window, K conv kernel. "Chain" c: one row of the sharded stream, followed across ranks. A local
"sequence" is what ``hola_attention`` sees as one sequence: a row (unpacked) or a segment of a document
inside this rank's shard (packed). Positions are positions inside a document (the cache's convention).

Layout (:class:`CPLayout`, built per batch from the global batch, identical on every rank of a cp group).
Packed batches (``cu_seqlens``) of recurrent flavours are first flattened into one stream of B*T tokens,
as the model itself flattens them, so rank r holds one contiguous piece of the global stream: the short
convolution then needs one tail per rank (``ShortConvolution`` takes one tail per row of its input).
Unpacked rows keep their rows: rank r holds columns ``[rL, (r+1)L)`` of each. Per chain, the first local
sequence *continues* when its document began on an earlier rank, and the last one *crosses* when its
document goes on past the shard end.

The scan (one HOLA layer, every rank at once; the numbers are the order of the collectives):
1. Summaries. The last sequence of each chain maps its incoming state affinely, ``S_out = M S_in + X``:
   ``X`` is its final state from zero, ``M`` the final state of the run with ``v = 0`` from the identity
   (``M = 0`` unless that sequence is also the continuing first one). (1) All-gather ``[M | X]``; chaining
   the earlier ranks' maps gives each continuing sequence its incoming state. The same two runs give the
   prediction errors from zero and from the identity, so the scores of the crossing sequence under the
   true incoming state follow without another pass: ``e(S) = e_X + S^T e_M`` (the error is affine in S).
2. Block heads. (2) All-gather the head of the block that contains each shard end: the crossing
   sequence's tokens from the last block start of its document (< C tokens, with m, pre-norm k, v).
3. Candidates. Each rank ranks, for each crossing document, the tokens before that last block start
   that it holds, counting the head it received itself (top-W by score, or by position for recency),
   and (3) all-gathers them. ``top_W(A u B) = top_W(top_W(A) u top_W(B))``, so rank r merges the lists
   of the ranks its first document spans into the persistent cache of its first block; the received
   head is that block's unfinished part, and ``seen`` the document tokens before the shard.
4. ``hola_attention`` on the shard with those initial states and caches: every block reads exactly what
   it would read in one process. Scores are detached, so selection needs no gradient.
Each message has a constant size (H*D*2D, C or W entries per head and chain), independent of T.

Gradients. The exchanged ``M, X, k, v`` travel through autograd-aware all-gathers, whose backward returns
the gradients of borrowed rows to their owners and the gradient of ``S_in`` along the chain, so every
gradient equals the one-process run. Backward collectives must run in the same order on every rank and
on every rank at all, even one whose shard borrows nothing (rank 0, or a shard that starts a document):
each collective's input is tied (:func:`_tie`: identity forward, zero gradient to the tied tensors) to the
previous collective's output, the convolution tails' all-gather being the first, and the layer output to
the last one. Backward then meets the collectives of a layer in exactly the reverse order on every rank.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hola_titan.kernels.hola_cache import HolaCache
from hola_titan.kernels.hola_reference import compute_dtype, gated_delta_chunked, l2norm
from hola_titan.ops import hola_attention


@dataclass(frozen=True)
class CPLayout:
    """Where the documents of one batch lie on the cp ranks (see the module docstring).

    Per rank ``j`` and chain ``c`` (``[R][num_rows]`` tuples): ``first_offset`` document tokens before the
    shard start (0: a document starts there), ``end_offset`` the document position at the shard end when the
    document crosses it (0: a document starts right after the shard, or j is the last rank), ``single``
    no document starts strictly inside the shard. Local sequences of this rank: ``seq_start``/``seq_len``
    over the flattened ``num_rows * shard_len`` local tokens and ``seq_offset`` (document tokens before).
    """

    cp_rank: int
    cp_size: int
    num_rows: int
    row_len: int
    packed: bool
    first_offset: tuple[tuple[int, ...], ...]
    end_offset: tuple[tuple[int, ...], ...]
    single: tuple[tuple[bool, ...], ...]
    seq_start: tuple[int, ...]
    seq_len: tuple[int, ...]
    seq_offset: tuple[int, ...]

    @property
    def shard_len(self) -> int:
        return self.row_len // self.cp_size

    @property
    def shard_start(self) -> int:
        """Column of the row where this rank's shard starts."""
        return self.cp_rank * self.shard_len

    @property
    def local_cu_seqlens(self) -> list[int]:
        return [*self.seq_start, self.num_rows * self.shard_len]

    def _chain_seqs(self, c: int) -> tuple[int, int]:
        """Index of the first and last local sequence of chain c."""
        if not self.packed:
            return c, c
        start, end = c * self.shard_len, (c + 1) * self.shard_len
        first = bisect.bisect_left(self.seq_start, start)
        return first, bisect.bisect_left(self.seq_start, end) - 1

    @property
    def in_seq(self) -> tuple[int, ...]:
        """Per chain: the local sequence that continues a document of an earlier rank, or -1."""
        r = self.cp_rank
        return tuple(self._chain_seqs(c)[0] if self.first_offset[r][c] > 0 else -1 for c in range(self.num_rows))

    @property
    def out_seq(self) -> tuple[int, ...]:
        """Per chain: the local sequence whose document crosses into the next rank, or -1."""
        r = self.cp_rank
        return tuple(self._chain_seqs(c)[1] if self.end_offset[r][c] > 0 else -1 for c in range(self.num_rows))

    def passthrough(self, j: int, c: int) -> bool:
        """Rank j's shard of chain c lies inside one document that began earlier and goes on after it."""
        return self.first_offset[j][c] > 0 and self.end_offset[j][c] > 0 and self.single[j][c]

    def merge_ranks(self, c: int) -> tuple[int, ...]:
        """Ranks that hold earlier tokens of the document this rank's chain c continues (empty if none)."""
        j = self.cp_rank - 1
        if self.first_offset[self.cp_rank][c] == 0:
            return ()
        ranks = [j]
        while self.passthrough(j, c):
            j -= 1
            ranks.append(j)
        return tuple(ranks)


def build_layout(*, cp_rank: int, cp_size: int, num_rows: int, row_len: int,
                 cu_seqlens: list[int] | None) -> CPLayout:
    """The :class:`CPLayout` of ``num_rows`` rows of ``row_len`` tokens; ``cu_seqlens`` (over the flattened
    rows, every row starting a document) or None for one document per row."""
    if row_len % cp_size:
        raise ValueError(f"training.seq_len: a row of {row_len} tokens does not split into {cp_size} shards")
    shard = row_len // cp_size
    starts = [[0] for _ in range(num_rows)]
    if cu_seqlens is not None:
        cu = list(cu_seqlens)
        if cu[0] != 0 or cu[-1] != num_rows * row_len or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError("cu_seqlens: must increase strictly from 0 to the number of tokens")
        starts = [[s - c * row_len for s in cu[:-1] if c * row_len <= s < (c + 1) * row_len]
                  for c in range(num_rows)]
        if any(not row or row[0] != 0 for row in starts):
            raise ValueError("cu_seqlens: every row must start a document")

    def offset(c: int, p: int) -> int:
        return p - starts[c][bisect.bisect_right(starts[c], p) - 1]

    first, end, single = [], [], []
    for j in range(cp_size):
        lo, hi = j * shard, (j + 1) * shard
        first.append(tuple(offset(c, lo) for c in range(num_rows)))
        end.append(tuple(offset(c, hi) if j < cp_size - 1 else 0 for c in range(num_rows)))
        single.append(tuple(not any(lo < s < hi for s in starts[c]) for c in range(num_rows)))
    lo, hi = cp_rank * shard, (cp_rank + 1) * shard
    seq_start, seq_len, seq_offset = [], [], []
    for c in range(num_rows):
        bounds = [lo] + ([s for s in starts[c] if lo < s < hi] if cu_seqlens is not None else []) + [hi]
        for a, b in zip(bounds, bounds[1:]):
            seq_start.append(c * shard + a - lo)
            seq_len.append(b - a)
            seq_offset.append(offset(c, a))
    return CPLayout(cp_rank=cp_rank, cp_size=cp_size, num_rows=num_rows, row_len=row_len,
                    packed=cu_seqlens is not None, first_offset=tuple(first), end_offset=tuple(end),
                    single=tuple(single), seq_start=tuple(seq_start), seq_len=tuple(seq_len),
                    seq_offset=tuple(seq_offset))


# torch 2.13 renamed the single-tensor collectives; 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """``[R, *x.shape]``, x of every rank; backward reduce-scatters, so each rank gets the sum of the gradients
    that all ranks computed for its x (how borrowed rows send their gradients home)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_flat(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Flat buffers: gloo takes only the concatenated form.
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(out.view(-1), grad.contiguous().view(-1), group=ctx.group)
        return out, None


def _gather_flat(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty(dist.get_world_size(group), *x.shape)
    _all_gather_single(out.view(-1), x.detach().contiguous().view(-1), group=group)
    return out


class _Tie(torch.autograd.Function):
    """``x`` unchanged; backward also sends zero gradients to ``deps`` (orders the backward collectives)."""

    @staticmethod
    def forward(ctx, x, *deps):
        ctx.metas = [(d.shape, d.dtype, d.device) for d in deps]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.metas))


def _tie(x: torch.Tensor, *deps: torch.Tensor | None) -> torch.Tensor:
    deps = tuple(d for d in deps if d is not None and d.requires_grad)
    return _Tie.apply(x, *deps) if deps and torch.is_grad_enabled() else x


class ContextParallel:
    """The ``context_parallel`` hook of the model's mixers, shared by every layer of one model.

    Holds the cp process group and the layout of the batch being run (:meth:`shard_batch` builds it,
    :meth:`set_layout` makes it current; it must stay current until that batch's backward is done, because
    activation checkpointing re-runs forwards during backward). ``bytes_received`` counts the bytes this
    rank received in forward collectives since it was last reset.
    """

    def __init__(self, group: dist.ProcessGroup, *, recurrent: bool, conv_size: int, block: int):
        self.group = group
        self.cp_rank = dist.get_rank(group)
        self.cp_size = dist.get_world_size(group)
        self.recurrent = recurrent
        self.conv_size = conv_size
        self.block = block
        self.layout: CPLayout | None = None
        self.bytes_received = 0
        self._tails: torch.Tensor | None = None

    # ------------------------------------------------------------------ batches

    def shard_batch(self, batch: dict) -> dict:
        """This rank's shard of a batch that every rank of the cp group read whole, with its ``cp_layout``.

        Packed recurrent batches become one row of B*T tokens (then ``cu_seqlens`` holds this shard's
        sequences); unpacked rows keep their rows. Labels and position ids are sharded like the tokens.
        """
        tokens = batch["input_ids"]
        bsz, seq_len = tokens.shape
        cu = batch.get("cu_seqlens")
        if cu is not None and not self.recurrent:
            raise ValueError("data.varlen: must be false for transformer with context_parallel_degree > 1")
        rows, row_len = (1, bsz * seq_len) if cu is not None else (bsz, seq_len)
        layout = build_layout(cp_rank=self.cp_rank, cp_size=self.cp_size, num_rows=rows, row_len=row_len,
                              cu_seqlens=None if cu is None else cu.tolist())
        shard = layout.shard_len
        if self.recurrent and (shard % self.block or shard < self.conv_size - 1):
            raise ValueError(f"training.seq_len: the shard of {shard} tokens per cp rank must be a multiple of "
                             f"block {self.block} and at least conv_size - 1 = {self.conv_size - 1}")
        cols = slice(layout.shard_start, layout.shard_start + shard)
        local = {key: batch[key].reshape(rows, row_len)[:, cols] for key in ("input_ids", "labels", "position_ids")
                 if key in batch}
        if cu is not None:
            local["cu_seqlens"] = torch.tensor(layout.local_cu_seqlens, dtype=cu.dtype, device=cu.device)
        local["cp_layout"] = layout
        return local

    def set_layout(self, layout: CPLayout) -> None:
        if (layout.cp_rank, layout.cp_size) != (self.cp_rank, self.cp_size):
            raise ValueError(f"cp_layout: built for rank {layout.cp_rank} of {layout.cp_size}, this is rank "
                             f"{self.cp_rank} of {self.cp_size}")
        self.layout = layout

    def _current(self) -> CPLayout:
        if self.layout is None:
            raise RuntimeError("context parallel: no batch layout; pass batches through shard_batch and set_layout")
        return self.layout

    # ------------------------------------------------------------------ collectives

    def _gather(self, x: torch.Tensor, *, differentiable: bool) -> torch.Tensor:
        """``[R, *x.shape]``: x of every cp rank. ``differentiable``: backward sums the gradients into x."""
        self.bytes_received += (self.cp_size - 1) * x.numel() * x.element_size()
        if differentiable and torch.is_grad_enabled() and x.requires_grad:
            return _AllGather.apply(x, self.group)
        return _gather_flat(x, self.group)

    # ------------------------------------------------------------------ the mixer hooks

    def conv_tails(self, xs: list[torch.Tensor], positions: torch.Tensor | None):
        """The previous shard's last ``K-1`` inputs of each short convolution and, per token, whether its
        document began on an earlier rank. Inputs of another document are zero in the tails."""
        layout = self._current()
        r, k1 = self.cp_rank, self.conv_size - 1
        bsz, seq_len = xs[0].shape[:2]
        gathered = self._gather(torch.stack([x[:, seq_len - k1:] for x in xs]), differentiable=True)
        self._tails = gathered
        valid = torch.zeros(bsz, k1, dtype=torch.bool)
        continues = torch.zeros(bsz, seq_len, dtype=torch.bool)
        if r > 0:
            shard = layout.shard_len
            for c in range(layout.num_rows):
                # The crossing document's tokens on rank r-1: all of them if it began earlier.
                held = min(layout.end_offset[r - 1][c], shard)
                valid[0 if layout.packed else c, max(0, k1 - held):] = held > 0
            for n in layout.in_seq:
                if n >= 0:
                    start = layout.seq_start[n]
                    row, col = (0, start) if layout.packed else (n, 0)
                    continues[row, col:col + layout.seq_len[n]] = True
        device = xs[0].device
        tails = torch.where(valid.to(device)[None, :, :, None], gathered[(r - 1) % self.cp_size], 0)
        return list(tails.unbind(0)), continues.to(device)

    def attention(self, q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int = 64, block: int = 256,
                  evict: str = "score", cu_seqlens=None, initial_state=None, output_final_state: bool = False,
                  initial_cache=None, output_final_cache: bool = False, backend: str = "auto"):
        """``hola_attention`` over this rank's shard, continuing the states and caches of the earlier ranks
        (the module docstring); same signature and result as ``hola_attention``, without decoding options."""
        if initial_state is not None or initial_cache is not None or output_final_state or output_final_cache:
            raise ValueError("initial_state: context parallelism runs whole training rows; states and caches "
                             "of a call are not available under it")
        layout = self._current()
        self._check_local(layout, q, cu_seqlens, block)
        tails, self._tails = self._tails, None
        o = _scan(self, layout, q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block,
                  evict=evict, cu_seqlens=cu_seqlens, backend=backend, tails=tails)
        return o, None

    def _check_local(self, layout: CPLayout, q: torch.Tensor, cu_seqlens, block: int) -> None:
        rows, shard = layout.num_rows, layout.shard_len
        expected = (1, rows * shard) if layout.packed else (rows, shard)
        if tuple(q.shape[:2]) != expected:
            raise ValueError(f"q: shape {list(q.shape)} does not match the cp layout {list(expected)} + [H, D]")
        if layout.packed != (cu_seqlens is not None) or (
                cu_seqlens is not None and cu_seqlens.tolist() != layout.local_cu_seqlens):
            raise ValueError("cu_seqlens: differs from the cp layout's local sequences")
        if shard % block:
            raise ValueError(f"block: the shard of {shard} tokens is not a multiple of block {block}")


def _scan(cp: ContextParallel, layout: CPLayout, q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int,
          block: int, evict: str, cu_seqlens, backend: str, tails) -> torch.Tensor:
    """The sequence-parallel scan of one layer (module docstring): the output ``[B, T_local, H, D]``."""
    bx, tx, h, d = q.shape
    in_dtype, cdt, device = q.dtype, compute_dtype(q.dtype), q.device
    r, rows, shard = layout.cp_rank, layout.num_rows, layout.shard_len
    num_seqs = len(layout.seq_start)
    in_seq, out_seq = layout.in_seq, layout.out_seq
    ntok = bx * tx

    def flat(x):  # [B, T, ...] -> [B*T + 1, ...] in the compute dtype, with a zero padding slot at the end
        x = x.reshape(ntok, *x.shape[2:]).to(cdt)
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)

    # Crossing sequences as rows [rows, L + 1]: flat token indices, padding (index ntok) after each end and in
    # one extra column, so that a gather at column L is an empty slot.
    out_len = [layout.seq_len[n] if n >= 0 else 0 for n in out_seq]
    out_off = [layout.seq_offset[n] if n >= 0 else 0 for n in out_seq]
    index = torch.full((rows, shard + 1), ntok, dtype=torch.int64)
    for c, n in enumerate(out_seq):
        if n >= 0:
            index[c, :out_len[c]] = torch.arange(layout.seq_start[n], layout.seq_start[n] + out_len[c])
    index = index.to(device)
    passthrough = torch.tensor([layout.passthrough(r, c) for c in range(rows)], device=device)
    k_f, v_f, g_f, beta_f = map(flat, (k, v, g, beta))

    # 1. Summaries [M | X] of the crossing sequences, and their errors from zero and from the identity.
    zero_state = torch.zeros(rows, h, d, d, dtype=cdt, device=device)
    if any(n >= 0 for n in out_seq):
        kh_rows = l2norm(k_f)[index[:, :shard]]
        v_rows, g_rows, beta_rows = (x[index[:, :shard]] for x in (v_f, g_f, beta_f))
        eye = torch.eye(d, dtype=cdt, device=device).expand(rows, h, d, d)
        _, err, final = gated_delta_chunked(
            torch.cat([kh_rows, kh_rows]), torch.cat([kh_rows, kh_rows]), torch.cat([v_rows, torch.zeros_like(v_rows)]),
            torch.cat([g_rows, g_rows]), torch.cat([beta_rows, beta_rows]), torch.cat([zero_state, eye]), d ** -0.5)
        x_state = final[:rows]
        m_map = torch.where(passthrough[:, None, None, None], final[rows:], 0)
        err_x, err_m = err[:rows].detach(), err[rows:].detach()
    else:
        x_state, m_map = zero_state, zero_state
    # The tie to the layer's inputs makes the message require grad on every rank (its all-gather then has a
    # backward everywhere) even when this rank has nothing to summarise.
    summary = _tie(torch.cat([m_map, x_state], dim=-1), tails if tails is not None else k)
    summaries = cp._gather(summary, differentiable=True)  # [R, rows, H, D, 2D]
    last = summaries
    s_in = zero_state
    for j in range(r):  # in fp32 (fp64 for fp64 inputs): the chain of maps amplifies rounding
        s_in = summaries[j, ..., :d] @ s_in + summaries[j, ..., d:]
    cont = [c for c in range(rows) if in_seq[c] >= 0]
    cont_seqs = torch.tensor([in_seq[c] for c in cont], dtype=torch.int64, device=device)
    initial_state = torch.zeros(num_seqs, h, d, d, dtype=cdt, device=device)
    if cont:
        initial_state = initial_state.index_put((cont_seqs,), s_in[cont])

    initial_cache = None
    if evict != "none":
        c_blk, w = block, window
        # Scores of the crossing sequences under the true incoming state: e(S) = e_X + S^T e_M.
        m_rows = torch.full((rows, shard + 1, h), float("-inf"), dtype=cdt, device=device)
        if any(n >= 0 for n in out_seq):
            with torch.no_grad():
                err_true = err_x + torch.where(passthrough[:, None, None, None],
                                               torch.einsum("chkv,clhk->clhv", s_in.detach(), err_m), 0)
                m_rows[:, :shard] = (err_true.norm(dim=-1) * beta_rows).masked_fill(
                    index[:, :shard, None] == ntok, float("-inf"))
        kv_rows = torch.cat([k_f[index], v_f[index]], dim=-1).transpose(1, 2)  # [rows, H, L + 1, 2D]
        pos_rows = torch.full((rows, shard + 1), -1, dtype=torch.int64)
        for c in range(rows):
            pos_rows[c, :out_len[c]] = torch.arange(out_off[c], out_off[c] + out_len[c])
        pos_rows = pos_rows.to(device)

        # 2. Head of the block that contains the shard end: row columns [len - E % C, len).
        end = [layout.end_offset[r][c] for c in range(rows)]
        head_col = torch.full((rows, c_blk), shard, dtype=torch.int64)
        for c in range(rows):
            nb = end[c] % c_blk if out_seq[c] >= 0 else 0
            head_col[c, :nb] = torch.arange(out_len[c] - nb, out_len[c])
        head_col = head_col.to(device)
        head_m = m_rows.gather(1, head_col[..., None].expand(rows, c_blk, h)).transpose(1, 2)  # [rows, H, C]
        head_kv = kv_rows.gather(2, head_col[:, None, :, None].expand(rows, h, c_blk, 2 * d))
        heads_m = cp._gather(head_m.double(), differentiable=False)  # [R, rows, H, C]
        heads_kv = cp._gather(_tie(head_kv, last), differentiable=True)  # [R, rows, H, C, 2D]
        last = heads_kv
        prev = (r - 1) % cp.cp_size
        recv = [layout.first_offset[r][c] % c_blk if layout.passthrough(r, c) else 0 for c in range(rows)]

        if w > 0:
            # 3. Top-W candidates before the last block start, counting the head received from rank r-1.
            cand_pos = torch.full((rows, c_blk), -1, dtype=torch.int64)
            for c in range(rows):
                base = layout.first_offset[r][c] - recv[c]
                cand_pos[c, :recv[c]] = torch.arange(base, base + recv[c])
            cand_pos = torch.cat([cand_pos.to(device), pos_rows[:, :shard]], dim=1)  # [rows, C + L], ascending
            limit = torch.tensor([e - e % c_blk for e in end], device=device)
            cand_pos = torch.where((cand_pos >= 0) & (cand_pos < limit[:, None]), cand_pos, -1)
            cand_m = torch.cat([heads_m[prev].to(cdt), m_rows[:, :shard].transpose(1, 2)], dim=-1)
            cand_kv = torch.cat([heads_kv[prev], kv_rows[:, :, :shard]], dim=2)
            top_m, top_pos, top_kv = _top_w(cand_m, cand_pos[:, None, :].expand_as(cand_m), cand_kv, w, evict)
            cands_meta = cp._gather(torch.stack([top_m.double(), top_pos.double()], dim=-1), differentiable=False)
            cands_kv = cp._gather(_tie(top_kv, last), differentiable=True)  # [R, rows, H, W, 2D]
            last = cands_kv

        # 4. Initial caches of the continuing sequences: merged candidates, the received head, tokens seen.
        top = {}
        if cont and w > 0:
            use = torch.tensor([[j in layout.merge_ranks(c) for j in range(cp.cp_size)] for c in cont], device=device)
            meta = cands_meta[:, cont].permute(1, 2, 0, 3, 4)  # [n, H, R, W, 2]
            m_all = meta[..., 0].flatten(2).to(cdt)
            pos_all = torch.where(use[:, None, :, None], meta[..., 1], -1).flatten(2).long()
            kv_all = cands_kv[:, cont].permute(1, 2, 0, 3, 4).flatten(2, 3)
            order = torch.sort(pos_all.masked_fill(pos_all < 0, torch.iinfo(torch.int64).max), dim=-1,
                               stable=True).indices
            top = dict(zip(("m", "pos", "kv"), _top_w(m_all.gather(-1, order), pos_all.gather(-1, order),
                                                      _gather_entries(kv_all, order), w, evict)))
        initial_cache = _initial_cache(num_seqs, h, d, w, c_blk, evict, cont, cont_seqs, top, heads_m[prev],
                                       heads_kv[prev], [layout.first_offset[r][c] for c in cont], in_dtype, cdt,
                                       device)

    o, _ = hola_attention(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block, evict=evict,
                          cu_seqlens=cu_seqlens, initial_state=initial_state, initial_cache=initial_cache,
                          backend=backend)
    return _tie(o, last)


def _gather_entries(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [..., E, F], idx [..., K] -> [..., K, F]."""
    return x.gather(-2, idx[..., None].expand(*idx.shape, x.shape[-1]))


def _top_w(m: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, w: int, evict: str):
    """The ``w`` best valid entries (``pos >= 0``) of candidates laid out in ascending position, in selection
    order: larger key first (score, or position for recency), ties by lower position. Empty slots: score
    -inf, position -1, zero k and v. m, pos [..., E]; kv [..., E, F]."""
    valid = pos >= 0
    if m.shape[-1] < w:  # fewer candidates than slots: pad with empty ones
        extra = w - m.shape[-1]
        m = F.pad(m, (0, extra), value=float("-inf"))
        pos = F.pad(pos, (0, extra), value=-1)
        valid = F.pad(valid, (0, extra), value=False)
        kv = F.pad(kv, (0, 0, 0, extra))
    key = pos.to(m.dtype) if evict == "recency" else m
    key = key.masked_fill(~valid, float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :w]
    ok = valid.gather(-1, order)
    top_m = m.gather(-1, order).masked_fill(~ok, float("-inf"))
    top_pos = pos.gather(-1, order).masked_fill(~ok, -1)
    top_kv = torch.where(ok[..., None], _gather_entries(kv, order), 0)
    return top_m, top_pos, top_kv


def _initial_cache(num_seqs, h, d, w, c_blk, evict, cont, cont_seqs, top, head_m, head_kv, seen, in_dtype, cdt,
                   device) -> HolaCache:
    """A :class:`HolaCache` for the local sequences: empty, except for the continuing ones (rows ``cont_seqs``)."""
    cache = HolaCache.empty(num_seqs, h, d, window=w, block=c_blk, evict=evict, dtype=in_dtype, device=device,
                            score_dtype=cdt)
    if not cont:
        return cache
    put = lambda base, value: base.index_put((cont_seqs,), value.to(base.dtype))  # noqa: E731
    if w > 0:
        cache.scores = put(cache.scores, top["m"])
        cache.positions = put(cache.positions, top["pos"])
        cache.k = put(cache.k, top["kv"][..., :d])
        cache.v = put(cache.v, top["kv"][..., d:])
    cache.buf_scores = put(cache.buf_scores, head_m[cont])
    cache.buf_k = put(cache.buf_k, head_kv[cont][..., :d])
    cache.buf_v = put(cache.buf_v, head_kv[cont][..., d:])
    cache.seen = put(cache.seen, torch.tensor(seen, dtype=torch.int64, device=device))
    return cache


# ---------------------------------------------------------------------------------------------------------------
# Transformer++: exact causal attention over the cp group's keys and values
# ---------------------------------------------------------------------------------------------------------------

class _AllGatherCausalSDPA(TorchFunctionMode):
    """Inside one attention module: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on a shard
    becomes attention of the local queries over the keys and values of every rank, causal in global
    positions. Keys and values are all-gathered with autograd (O(T) bytes per layer; the simple exact
    alternative to ring attention, which PyTorch implements only for the CUDA SDPA kernels)."""

    def __init__(self, cp: ContextParallel, layout: CPLayout):
        super().__init__()
        self.cp, self.layout = cp, layout

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if len(args) > 3 or kwargs.get("attn_mask") is not None or not kwargs.get("is_causal", False):
            raise ValueError("data.varlen: transformer under context parallelism takes unpacked causal rows")
        extra = {name: kwargs[name] for name in ("scale", "enable_gqa") if name in kwargs}
        kv = self.cp._gather(torch.stack([k, v]), differentiable=True)  # [R, 2, B, H, L, D]
        keys, values = (torch.cat(kv[:, i].unbind(0), dim=2) for i in (0, 1))
        shard = q.shape[2]
        qi = torch.arange(shard, device=q.device)[:, None] + self.layout.shard_start
        kj = torch.arange(keys.shape[2], device=q.device)[None, :]
        return func(q, keys, values, attn_mask=kj <= qi, dropout_p=kwargs.get("dropout_p", 0.0), **extra)


def _wrap_attention(module: nn.Module, cp: ContextParallel) -> None:
    """Run ``module``'s forward at global RoPE positions under :class:`_AllGatherCausalSDPA`."""
    inner = module.forward

    def forward(x, *, doc_ids, positions, cache):
        if cache is not None:
            raise ValueError("cache: decoding does not run under context parallelism")
        if doc_ids is not None:
            raise ValueError("data.varlen: must be false for transformer with context_parallel_degree > 1")
        layout = cp._current()
        with _AllGatherCausalSDPA(cp, layout):
            return inner(x, doc_ids=doc_ids, positions=positions + layout.shard_start, cache=cache)

    module.forward = forward
    module.context_parallel = cp


def apply_context_parallel(model: nn.Module, *, cp_mesh) -> ContextParallel:
    """Install context parallelism over ``cp_mesh`` on every token mixer of ``model``; returns the hook object
    whose ``shard_batch`` / ``set_layout`` the trainer calls per batch."""
    from hola_titan.models.model import Attention, GatedDeltaMixer

    args = model.args
    cp = ContextParallel(cp_mesh.get_group(), recurrent=args.is_recurrent, conv_size=args.conv_size,
                         block=args.block)
    for module in model.modules():
        if isinstance(module, GatedDeltaMixer):
            module.context_parallel = cp
        elif isinstance(module, Attention):
            _wrap_attention(module, cp)
    return cp


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """The :class:`ContextParallel` installed on ``model`` (through any wrappers), or None."""
    for module in model.modules():
        cp = getattr(module, "context_parallel", None)
        if isinstance(cp, ContextParallel):
            return cp
    return None
