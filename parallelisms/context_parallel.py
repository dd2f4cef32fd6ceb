"""Context parallelism: every row is split into ``R`` contiguous shards, one per rank of the ``cp`` mesh.

Recurrent flavours (HOLA, HOLA+recency, GDN) run the sequence-parallel chunked scan of DESIGN §3;
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

Cost. Besides the shard itself, the state path runs over the crossing sequence once from zero and, when it
spans the shard, once more from the identity (both runs as one batch of rows). On CUDA both the shard (the
Triton backend, which takes initial states and caches: ``hola_titan.kernels.hola_triton``) and the summaries
(:func:`hola_titan.kernels.fla_gdn.gdn_summary`) run through fla's kernels; elsewhere the summaries run the
fp32 reference chunked form (a Python loop over 64-token chunks: on a GPU that loop, not the exchange, was
the step's cost). On CUDA the crossing sequences' scores are composed from bf16 updates, ``e_X + S^T e_M``,
while one process reads them from the shard's own pass, so a score tie that bf16 rounding decides can be
decided differently than in one process; in fp32 on the reference backend the run is the one-process function.

Objects. :class:`ContextParallel` is the group (mesh, flavour constants), made once per model; the model is not
changed. Per batch, ``shard_batch`` cuts the shard and its layout and ``batch`` makes a :class:`CPBatch`, which
the trainer passes through ``forward`` in the model's ``BatchContext``; each recurrent layer call takes a
:class:`CPLayer` from it (its convolution tails, then its scan). No batch's layout or per-layer handover is kept
anywhere else, so a forward recomputed during backward reads exactly what its first run read.

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
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from hola_titan.kernels import seqlens
from hola_titan.kernels.hola_cache import HolaCache
from hola_titan.kernels.hola_reference import compute_dtype, gated_delta_chunked, l2norm
from hola_titan.kernels.seqlens import Documents
from hola_titan.ops import hola_attention, resolve_backend


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


def shard_batch(batch: dict, *, cp_rank: int, cp_size: int, recurrent: bool, block: int, conv_size: int) -> dict:
    """Rank ``cp_rank``'s shard of a batch that every rank of the cp group read whole, with its ``cp_layout``.

    Packed recurrent batches become one row of B*T tokens (then ``cu_seqlens`` holds this shard's sequences);
    unpacked rows keep their rows. Labels and position ids are sharded like the tokens. Raises ``ValueError``
    for a packed Transformer++ batch and for shards that are not whole blocks.
    """
    tokens = batch["input_ids"]
    bsz, seq_len = tokens.shape
    cu = batch.get("cu_seqlens")
    if cu is not None and not recurrent:
        raise ValueError("data.varlen: must be false for transformer with context_parallel_degree > 1")
    rows, row_len = (1, bsz * seq_len) if cu is not None else (bsz, seq_len)
    layout = build_layout(cp_rank=cp_rank, cp_size=cp_size, num_rows=rows, row_len=row_len,
                          cu_seqlens=None if cu is None else cu.tolist())
    shard = layout.shard_len
    if recurrent and (shard % block or shard < conv_size - 1):
        raise ValueError(f"training.seq_len: the shard of {shard} tokens per cp rank must be a multiple of "
                         f"block {block} and at least conv_size - 1 = {conv_size - 1}")
    cols = slice(layout.shard_start, layout.shard_start + shard)
    local = {key: batch[key].reshape(rows, row_len)[:, cols] for key in ("input_ids", "labels", "position_ids")
             if key in batch}
    if cu is not None:
        local["cu_seqlens"] = torch.tensor(layout.local_cu_seqlens, dtype=cu.dtype, device=cu.device)
    local["cp_layout"] = layout
    return local


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
    """The context-parallel group of one model: the cp mesh and the flavour's constants, made once.

    Per batch, :meth:`shard_batch` cuts this rank's shard (with its :class:`CPLayout`) and :meth:`batch` makes
    the immutable per-batch view (:class:`CPBatch`) that the trainer passes through ``forward`` in the
    model's ``BatchContext``: nothing about a batch is stored here, so a forward re-run during backward
    (activation checkpointing) reads the context it is given. ``bytes_received`` counts the bytes this rank
    received in forward collectives since it was last reset.
    """

    def __init__(self, cp_mesh: DeviceMesh, *, recurrent: bool, conv_size: int, block: int):
        # The mesh, not its ProcessGroup: a group object that outlives destroy_process_group into interpreter
        # shutdown makes gloo abort the process.
        self.mesh = cp_mesh
        self.cp_rank = cp_mesh.get_local_rank()
        self.cp_size = cp_mesh.size()
        self.recurrent = recurrent
        self.conv_size = conv_size
        self.block = block
        self.bytes_received = 0
        # Benchmarks set time_collectives to add each forward all-gather's wall time (device synchronised before
        # and after, so it serialises the layer: time with it off) to comm_seconds.
        self.time_collectives = False
        self.comm_seconds = 0.0

    # ------------------------------------------------------------------ batches

    def shard_batch(self, batch: dict) -> dict:
        """This rank's shard of ``batch`` (:func:`shard_batch`)."""
        return shard_batch(batch, cp_rank=self.cp_rank, cp_size=self.cp_size, recurrent=self.recurrent,
                           block=self.block, conv_size=self.conv_size)

    def batch(self, layout: CPLayout) -> CPBatch:
        """The per-batch view of ``layout`` (this rank's), for the model's ``BatchContext.cp``."""
        if (layout.cp_rank, layout.cp_size) != (self.cp_rank, self.cp_size):
            raise ValueError(f"cp_layout: built for rank {layout.cp_rank} of {layout.cp_size}, this is rank "
                             f"{self.cp_rank} of {self.cp_size}")
        return CPBatch(self, layout)

    # ------------------------------------------------------------------ collectives

    def _gather(self, x: torch.Tensor, *, differentiable: bool) -> torch.Tensor:
        """``[R, *x.shape]``: x of every cp rank. ``differentiable``: backward sums the gradients into x."""
        self.bytes_received += (self.cp_size - 1) * x.numel() * x.element_size()
        if not self.time_collectives:
            return self._gather_now(x, differentiable=differentiable)
        sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = self._gather_now(x, differentiable=differentiable)
        sync()
        self.comm_seconds += time.perf_counter() - start
        return out

    def _gather_now(self, x: torch.Tensor, *, differentiable: bool) -> torch.Tensor:
        if differentiable and torch.is_grad_enabled() and x.requires_grad:
            return _AllGather.apply(x, self.mesh.get_group())
        return _gather_flat(x, self.mesh.get_group())


class CPBatch:
    """One batch's context-parallel view on this rank: its (immutable) layout, and the index tensors every layer
    builds from it, made once (:meth:`memo`). The model calls :meth:`layer` (a recurrent mixer's scan) or
    :meth:`causal_attention` and :attr:`shard_start` (Transformer++)."""

    def __init__(self, group: ContextParallel, layout: CPLayout):
        self.group = group
        self.layout = layout
        self.cp_rank, self.cp_size = group.cp_rank, group.cp_size
        self._memo: dict = {}

    @property
    def shard_start(self) -> int:
        return self.layout.shard_start

    def memo(self, key, make):
        """``make()``, made once for this batch and kept under ``key``: the index tensors that every layer builds
        from the layout on the host. Made per layer, each one's copy to the GPU synchronised the host with the
        device (a copy from pageable memory waits for the stream), several times per layer."""
        if key not in self._memo:
            # Plain tensors even when first made under inference_mode (validation), so that a later forward of the
            # same batch that records gradients can save them.
            with torch.inference_mode(False):
                self._memo[key] = make()
        return self._memo[key]

    def _gather(self, x: torch.Tensor, *, differentiable: bool) -> torch.Tensor:
        return self.group._gather(x, differentiable=differentiable)

    def layer(self) -> CPLayer:
        """The scan of one recurrent layer call (its convolution tails, then its attention)."""
        return CPLayer(self)

    @torch.compiler.disable
    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Transformer++ under context parallelism: the local queries ``[B, H, L, D]`` attend to the keys and
        values of every rank, causal in global positions. Keys and values are all-gathered with autograd (O(T)
        bytes per layer; the simple exact alternative to ring attention, which PyTorch implements only for the
        CUDA SDPA kernels)."""
        kv = self._gather(torch.stack([k, v]), differentiable=True)  # [R, 2, B, H, L, D]
        keys, values = (torch.cat(kv[:, i].unbind(0), dim=2) for i in (0, 1))
        shard = q.shape[2]
        qi = torch.arange(shard, device=q.device)[:, None] + self.shard_start
        kj = torch.arange(keys.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=kj <= qi)


class CPLayer:
    """One recurrent layer call under context parallelism: :meth:`conv_tails`, then :meth:`attention`, which
    ties its collectives to the tails' all-gather (so backward meets them in order on every rank). Made per
    call (``CPBatch.layer``); a recomputed forward makes a fresh one."""

    def __init__(self, cp: CPBatch):
        self.cp = cp
        self._tails: torch.Tensor | None = None

    # Under a compiled block, the two calls run eagerly (a graph break each): they read the batch's layout in Python
    # and run collectives; the block's other work (norms, convolutions, MLP) is still compiled.
    @torch.compiler.disable
    def conv_tails(self, xs: list[torch.Tensor], positions: torch.Tensor | None):
        """The previous shard's last ``K-1`` inputs of each short convolution and, per token, whether its
        document began on an earlier rank. Inputs of another document are zero in the tails."""
        cp, layout = self.cp, self.cp.layout
        if layout.packed and layout.num_rows > 1:
            raise ValueError("cu_seqlens: a packed cp shard must be one stream (shard_batch flattens packed rows)")
        r, k1 = cp.cp_rank, cp.group.conv_size - 1
        bsz, seq_len = xs[0].shape[:2]
        gathered = cp._gather(torch.stack([x[:, seq_len - k1:] for x in xs]), differentiable=True)
        self._tails = gathered
        device = xs[0].device

        def masks():
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
            return seqlens.to_device(valid, device), seqlens.to_device(continues, device)

        valid, continues = cp.memo(("conv", bsz, seq_len, k1, device), masks)
        tails = torch.where(valid[None, :, :, None], gathered[(r - 1) % cp.cp_size], 0)
        return list(tails.unbind(0)), continues

    @torch.compiler.disable
    def attention(self, q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int = 64, block: int = 256,
                  evict: str = "score", cu_seqlens=None, documents: Documents | None = None, initial_state=None,
                  output_final_state: bool = False, initial_cache=None, output_final_cache: bool = False,
                  backend: str = "auto", overlap_backward: bool = False):
        """``hola_attention`` over this rank's shard, continuing the states and caches of the earlier ranks
        (the module docstring); same signature and result as ``hola_attention``, without decoding options.
        ``overlap_backward`` is accepted and not used: the shards run the layered form."""
        if initial_state is not None or initial_cache is not None or output_final_state or output_final_cache:
            raise ValueError("initial_state: context parallelism runs whole training rows; states and caches "
                             "of a call are not available under it")
        if cu_seqlens is not None:
            if documents is not None:
                raise ValueError("cu_seqlens: give cu_seqlens or documents, not both")
            documents = Documents.of(cu_seqlens, seq_len=q.shape[0] * q.shape[1], device=q.device)
        layout = self.cp.layout
        _check_local(layout, q, documents, block)
        tails, self._tails = self._tails, None
        o = _scan(self.cp, layout, q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block,
                  evict=evict, documents=documents, backend=backend, tails=tails)
        return o, None


def _check_local(layout: CPLayout, q: torch.Tensor, documents: Documents | None, block: int) -> None:
    rows, shard = layout.num_rows, layout.shard_len
    expected = (1, rows * shard) if layout.packed else (rows, shard)
    if tuple(q.shape[:2]) != expected:
        raise ValueError(f"q: shape {list(q.shape)} does not match the cp layout {list(expected)} + [H, D]")
    if layout.packed != (documents is not None) or (
            documents is not None and documents.host.tolist() != layout.local_cu_seqlens):
        raise ValueError("cu_seqlens: differs from the cp layout's local sequences")
    if shard % block:
        raise ValueError(f"block: the shard of {shard} tokens is not a multiple of block {block}")


def _scan(cp: CPBatch, layout: CPLayout, q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int,
          block: int, evict: str, documents: Documents | None, backend: str, tails) -> torch.Tensor:
    """The sequence-parallel scan of one layer (module docstring): the output ``[B, T_local, H, D]``."""
    bx, tx, h, d = q.shape
    cdt, device = compute_dtype(q.dtype), q.device
    r, cp_size = layout.cp_rank, cp.cp_size
    ntok = bx * tx

    def flat(x, dtype):  # [B, T, ...] -> [B*T + 1, ...] with a zero padding slot at the end
        x = x.reshape(ntok, *x.shape[2:]).to(dtype)
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)

    rows = cp.memo(("crossing", ntok, device), lambda: _Crossing.of(layout, ntok, device))
    # fla's kernels where the shard itself runs on them; they take the inputs in their own dtypes.
    fla = q.is_cuda and q.dtype != torch.float64 and resolve_backend(backend, device) != "reference"
    k_f, v_f, g_f, beta_f = (flat(x, x.dtype if fla else cdt) for x in (k, v, g, beta))

    # 1. State: summaries of the crossing sequences, all-gathered and chained into the incoming states. The
    # tie to the tails (to k without them) makes the message require grad on every rank, so that its
    # all-gather has a backward everywhere, even where there is nothing to summarise.
    summary, err_x, err_m, beta_rows = _summaries(rows, k_f, v_f, g_f, beta_f, h, d, fla=fla, cdt=cdt)
    summaries = cp._gather(_tie(summary, tails if tails is not None else k), differentiable=True)
    last = summaries  # [R, chains, H, D, 2D]
    s_in = torch.zeros(layout.num_rows, h, d, d, dtype=cdt, device=device)
    for j in range(r):  # in fp32 (fp64 for fp64 inputs): the chain of maps amplifies rounding
        s_in = summaries[j, ..., :d] @ s_in + summaries[j, ..., d:]
    cont = [c for c, n in enumerate(layout.in_seq) if n >= 0]
    cont_chains, cont_seqs = cp.memo(("cont", device), lambda: (
        seqlens.to_device(torch.tensor(cont, dtype=torch.int64), device),
        seqlens.to_device(torch.tensor([layout.in_seq[c] for c in cont], dtype=torch.int64), device)))
    # Without a continuing sequence (rank 0, or a shard that starts a document) the shard makes the plain call:
    # no initial state, and no cache, with which the Triton backend would take its extended row layout (the same
    # function at ~200 more operations and copies of q, k, v per layer).
    initial_state = None
    if cont:
        initial_state = torch.zeros(len(layout.seq_start), h, d, d, dtype=cdt, device=device).index_put(
            (cont_seqs,), s_in.index_select(0, cont_chains))

    initial_cache = None
    if evict != "none":
        prev = (r - 1) % cp_size
        # Entries travel as [k | v] in the input dtype (what the cache stores), scores and positions in float64.
        kv_rows = _take(torch.cat([flat(k, k.dtype), flat(v, v.dtype)], dim=-1), rows.index).transpose(1, 2)
        m_rows = _crossing_scores(rows, err_x, err_m, beta_rows, s_in.detach(), h, cdt)

        # 2. The head of the block that contains the shard end, from the last block start of its document.
        head_m, head_kv = _block_head(cp, layout, rows, m_rows, kv_rows, block)
        heads_m = cp._gather(head_m.double(), differentiable=False)  # [R, chains, H, C]
        heads_kv = cp._gather(_tie(head_kv, last), differentiable=True)  # [R, chains, H, C, 2D]
        last = heads_kv

        # 3. Top-W candidates before that block start, counting the head received from rank r-1.
        top = None
        if window > 0:
            top_m, top_pos, top_kv = _candidates(cp, layout, rows, m_rows, kv_rows, heads_m[prev].to(cdt),
                                                 heads_kv[prev], block=block, window=window, evict=evict)
            cands_meta = cp._gather(torch.stack([top_m.double(), top_pos.double()], dim=-1), differentiable=False)
            cands_kv = cp._gather(_tie(top_kv, last), differentiable=True)  # [R, chains, H, W, 2D]
            last = cands_kv
            if cont:
                top = _merge_candidates(cp, layout, cont, cont_chains, cands_meta, cands_kv, window=window,
                                        evict=evict, cdt=cdt)

        # 4. Initial caches of the continuing sequences: merged candidates, the received head, tokens seen.
        if cont:
            seen = cp.memo(("seen", device), lambda: seqlens.to_device(
                torch.tensor([layout.first_offset[r][c] for c in cont], dtype=torch.int64), device))
            initial_cache = _initial_cache(len(layout.seq_start), h, d, window, block, evict, cont_seqs, top,
                                           heads_m[prev].index_select(0, cont_chains),
                                           heads_kv[prev].index_select(0, cont_chains), seen, q.dtype, cdt, device)

    o, _ = hola_attention(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block, evict=evict,
                          documents=documents, initial_state=initial_state, initial_cache=initial_cache,
                          backend=backend)
    return _tie(o, last)


@dataclass(frozen=True)
class _Crossing:
    """The crossing sequence of every chain as a row of ``L + 1`` slots: flat token ``index`` ([chains, L + 1],
    ``B*T`` for an empty slot: past its end, a chain without one, and the last column, so that a gather at
    column L is empty) and document ``positions`` (-1 empty)."""

    index: torch.Tensor
    positions: torch.Tensor
    length: tuple[int, ...]
    passthrough: torch.Tensor  # [chains] bool
    needs_map: bool  # some chain passes through, so M is not zero
    present: bool

    @classmethod
    def of(cls, layout: CPLayout, ntok: int, device) -> _Crossing:
        rows, shard, r = layout.num_rows, layout.shard_len, layout.cp_rank
        index = torch.full((rows, shard + 1), ntok, dtype=torch.int64)
        positions = torch.full((rows, shard + 1), -1, dtype=torch.int64)
        length = []
        for c, n in enumerate(layout.out_seq):
            size = layout.seq_len[n] if n >= 0 else 0
            if n >= 0:
                index[c, :size] = torch.arange(layout.seq_start[n], layout.seq_start[n] + size)
                positions[c, :size] = torch.arange(layout.seq_offset[n], layout.seq_offset[n] + size)
            length.append(size)
        passthrough = [layout.passthrough(r, c) for c in range(rows)]
        return cls(index=seqlens.to_device(index, device), positions=seqlens.to_device(positions, device),
                   length=tuple(length), passthrough=seqlens.to_device(torch.tensor(passthrough), device),
                   needs_map=any(passthrough), present=any(length))


def _summaries(rows: _Crossing, k_f, v_f, g_f, beta_f, h: int, d: int, *, fla: bool, cdt: torch.dtype):
    """``[M | X]`` per chain ([chains, H, D, 2D], ``cdt``), the errors from zero and from the identity (detached,
    [chains, L, H, D]) and the factor that turns their norms into scores: beta on the rows, or None where the
    errors already carry it (fla's per-token updates are ``beta_t e_t``). X: the final state from zero; M: the
    final state with ``v = 0`` from the identity, zero unless the chain passes through (then the crossing
    sequence is the continuing one)."""
    chains, shard = rows.index.shape[0], rows.index.shape[1] - 1
    zero = torch.zeros(chains, h, d, d, dtype=cdt, device=k_f.device)
    if not rows.present:
        return torch.cat([zero, zero], dim=-1), None, None, None
    index = rows.index[:, :shard]
    k, v, g, beta = (_take(x, index) for x in (k_f, v_f, g_f, beta_f))
    runs = 2 if rows.needs_map else 1  # both runs as one batch of rows
    eye = torch.eye(d, dtype=cdt, device=k_f.device).expand(chains, h, d, d)
    state0 = torch.cat([zero, eye][:runs])
    values = torch.cat([v, torch.zeros_like(v)][:runs])
    k, g, beta_runs = (torch.cat([x] * runs) for x in (k, g, beta))
    if fla:
        from hola_titan.kernels.fla_gdn import gdn_summary
        final, err = gdn_summary(k, values, g, beta_runs, state0)
        final, err, beta = final.to(cdt), err.to(cdt), None
    else:
        kh = l2norm(k)
        _, err, final = gated_delta_chunked(kh, kh, values, g, beta_runs, state0, d ** -0.5, with_output=False)
    x_state, err_x = final[:chains], err[:chains].detach()
    m_map, err_m = zero, None
    if rows.needs_map:
        m_map = torch.where(rows.passthrough[:, None, None, None], final[chains:], 0)
        err_m = err[chains:].detach()
    return torch.cat([m_map, x_state], dim=-1), err_x, err_m, beta


@torch.no_grad()
def _crossing_scores(rows: _Crossing, err_x, err_m, beta, s_in, h: int, cdt) -> torch.Tensor:
    """Scores m of the crossing rows under the true incoming state ([chains, L + 1, H], -inf empty): the error is
    affine in the incoming state, ``e(S) = e_X + S^T e_M`` (``beta`` None: the errors are already scaled by it)."""
    chains, slots = rows.index.shape
    m_rows = torch.full((chains, slots, h), float("-inf"), dtype=cdt, device=rows.index.device)
    if rows.present:
        err = err_x
        if err_m is not None:
            err = err + torch.where(rows.passthrough[:, None, None, None],
                                    torch.einsum("chkv,clhk->clhv", s_in, err_m), 0)
        empty = rows.positions[:, :slots - 1, None] < 0
        m = err.norm(dim=-1) if beta is None else err.norm(dim=-1) * beta
        m_rows[:, :slots - 1] = m.masked_fill(empty, float("-inf"))
    return m_rows


def _block_head(cp: ContextParallel, layout: CPLayout, rows: _Crossing, m_rows, kv_rows, block: int):
    """Scores [chains, H, C] and [k | v] [chains, H, C, 2D] of the crossing rows' last ``E % C`` tokens (E: the
    document position at the shard end), in the first slots; the rest empty."""
    chains, h = m_rows.shape[0], m_rows.shape[2]

    def columns():
        cols = torch.full((chains, block), rows.index.shape[1] - 1, dtype=torch.int64)
        for c in range(chains):
            size = layout.end_offset[layout.cp_rank][c] % block if rows.length[c] else 0
            cols[c, :size] = torch.arange(rows.length[c] - size, rows.length[c])
        return seqlens.to_device(cols, m_rows.device)

    cols = cp.memo(("head_cols", block, m_rows.device), columns)
    head_m = m_rows.gather(1, cols[..., None].expand(chains, block, h)).transpose(1, 2)
    head_kv = kv_rows.gather(2, cols[:, None, :, None].expand(chains, h, block, kv_rows.shape[-1]))
    return head_m, head_kv


def _candidates(cp: ContextParallel, layout: CPLayout, rows: _Crossing, m_rows, kv_rows, recv_m, recv_kv, *,
                block: int, window: int, evict: str):
    """This rank's top-W list per chain ([chains, H, W] scores and positions, [chains, H, W, 2D] entries): among
    the crossing document's tokens before the last block start, the received head (only when the chain passes
    through, so that the head belongs to the same document) and this rank's own tokens."""
    r, chains, shard = layout.cp_rank, layout.num_rows, layout.shard_len
    device = m_rows.device

    def positions():
        recv_pos = torch.full((chains, block), -1, dtype=torch.int64)
        limit = []
        for c in range(chains):
            if layout.passthrough(r, c):
                count = layout.first_offset[r][c] % block
                recv_pos[c, :count] = torch.arange(layout.first_offset[r][c] - count, layout.first_offset[r][c])
            end = layout.end_offset[r][c]
            limit.append(end - end % block)
        pos = torch.cat([seqlens.to_device(recv_pos, device), rows.positions[:, :shard]], dim=1)  # ascending
        limit = seqlens.to_device(torch.tensor(limit, dtype=torch.int64), device)
        return torch.where((pos >= 0) & (pos < limit[:, None]), pos, -1)

    pos = cp.memo(("candidate_positions", block, device), positions)
    m = torch.cat([recv_m, m_rows[:, :shard].transpose(1, 2)], dim=-1)
    kv = torch.cat([recv_kv, kv_rows[:, :, :shard]], dim=2)
    return _top_w(m, pos[:, None, :].expand_as(m), kv, window, evict)


def _merge_candidates(cp: ContextParallel, layout: CPLayout, cont: list[int], cont_chains, cands_meta, cands_kv, *,
                      window: int, evict: str, cdt):
    """Persistent caches of the continuing sequences of chains ``cont`` (``cont_chains`` on the device): top-W of
    the lists of the ranks their document spans (``merge_ranks``), as a dict of scores, positions and entries."""
    size, device = cands_meta.shape[0], cands_kv.device
    use = cp.memo(("merge_ranks", size, device), lambda: seqlens.to_device(
        torch.tensor([[j in layout.merge_ranks(c) for j in range(size)] for c in cont]), device))
    meta = cands_meta.index_select(1, cont_chains).permute(1, 2, 0, 3, 4)  # [n, H, R, W, 2]
    m = meta[..., 0].flatten(2).to(cdt)
    pos = torch.where(use[:, None, :, None], meta[..., 1], -1).flatten(2).long()
    kv = cands_kv.index_select(1, cont_chains).permute(1, 2, 0, 3, 4).flatten(2, 3)
    # Position order first (the lists of different ranks interleave nothing, but come rank by rank), so that
    # the stable sort by key in _top_w breaks ties by position.
    order = torch.sort(pos.masked_fill(pos < 0, torch.iinfo(torch.int64).max), dim=-1, stable=True).indices
    top = _top_w(m.gather(-1, order), pos.gather(-1, order), _gather_entries(kv, order), window, evict)
    return dict(zip(("m", "pos", "kv"), top))


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for rows of flat tokens, through ``index_select``: its backward is an ``index_add``, where
    advanced indexing's backward sorts the indices (on a GPU, 4 ms per call at 32k tokens, 8 calls per layer)."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


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


def _initial_cache(num_seqs, h, d, w, c_blk, evict, cont_seqs, top, head_m, head_kv, seen, in_dtype, cdt,
                   device) -> HolaCache:
    """A :class:`HolaCache` for the local sequences: empty, except for the continuing ones (rows ``cont_seqs``)."""
    cache = HolaCache.empty(num_seqs, h, d, window=w, block=c_blk, evict=evict, dtype=in_dtype, device=device,
                            score_dtype=cdt)
    put = lambda base, value: base.index_put((cont_seqs,), value.to(base.dtype))  # noqa: E731
    if top is not None:
        cache.scores = put(cache.scores, top["m"])
        cache.positions = put(cache.positions, top["pos"])
        cache.k = put(cache.k, top["kv"][..., :d])
        cache.v = put(cache.v, top["kv"][..., d:])
    cache.buf_scores = put(cache.buf_scores, head_m)
    cache.buf_k = put(cache.buf_k, head_kv[..., :d])
    cache.buf_v = put(cache.buf_v, head_kv[..., d:])
    cache.seen = put(cache.seen, seen)
    return cache


def context_parallel_for(args, cp_mesh: DeviceMesh) -> ContextParallel:
    """The :class:`ContextParallel` of a model with ``ModelArgs`` ``args`` over ``cp_mesh``. The model itself is
    not changed: every batch's :class:`CPBatch` reaches its layers through ``forward``."""
    return ContextParallel(cp_mesh, recurrent=args.is_recurrent, conv_size=args.conv_size, block=args.block)
