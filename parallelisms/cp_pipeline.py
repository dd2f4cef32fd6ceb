"""Context parallelism that passes state and cache along the ranks: one token mixer call of the pipelined protocol.

Shape legend: B rows, T local tokens, H heads, D head dim, W window, C block, N sequences of the shard.

Rank ``r`` of a context-parallel group holds the ``r``-th contiguous shard of every row. The sequences that cross
into its shard from the left (every row unpacked; the first document of a packed row unless the shard starts one)
continue from exactly what ``hola_attention`` over the earlier tokens returns: the final state and the
``HolaCache`` (top-W entries, the unfinished block, tokens seen). So rank ``r`` receives those from rank ``r - 1``,
runs its shard as a continuation, and sends its own final state and cache of the sequences that cross out to rank
``r + 1``. Nothing is computed twice, and every block reads exactly what it reads in one process (the scores are
computed under the true incoming state), so the output and every gradient equal the one-process call.

Backward runs the same chain in reverse: the gradients of what rank ``r`` sent come back from rank ``r + 1``
(``_Send``'s backward receives them), flow through rank ``r``'s continuation, and the gradients of what it
received go back to rank ``r - 1`` (``_Receive``'s backward sends them). Point to point only; messages are
constant in ``T`` (the state in the compute dtype; ``W + C`` rows of keys and values with their scores and
positions, per head). A rank whose shard starts a document receives nothing and waits for nothing.

Within one call the ranks run one after another; across the layers of a model they pipeline (rank ``r`` runs
layer ``l`` while rank ``r - 1`` runs layer ``l + 1``): ``parallelisms/critical_path.py`` predicts that step. The
model, the trainer and activation checkpointing do not use this module yet (``context_parallel.py``'s summary
scan serves them); this is the exact building block, tested against one process (tests/test_cp_pipeline.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hola_titan.kernels.hola_cache import HolaCache
from hola_titan.kernels.hola_reference import compute_dtype
from hola_titan.kernels.seqlens import Documents
from hola_titan.ops import hola_attention

# The cache's differentiable tensors (keys and values) and the rest (scores and positions are detached by the
# contract, seen is a count).
_DIFF = ("k", "v", "buf_k", "buf_v")
_PLAIN = ("scores", "positions", "buf_scores", "seen")


class _Receive(torch.autograd.Function):
    """Forward: the tensors rank ``src`` sent, into ``templates``' shapes and dtypes. Backward: their gradients
    sent back to ``src``. ``anchor`` (any input that requires grad) puts the call in the graph."""

    @staticmethod
    def forward(ctx, anchor, group, src, *templates):
        ctx.group, ctx.src = group, src
        out = []
        for t in templates:
            buf = torch.empty_like(t)
            dist.recv(buf, src=src, group=group)
            out.append(buf)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        for g in grads:
            dist.send(g.contiguous(), dst=ctx.src, group=ctx.group)
        return (None, None, None, *([None] * len(grads)))


class _Send(torch.autograd.Function):
    """Forward: ``tensors`` sent to rank ``dst``; returns a zero scalar that the caller adds to its output, so that
    the backward reaches here. Backward: the gradients of ``tensors`` received from ``dst``."""

    @staticmethod
    def forward(ctx, group, dst, *tensors):
        ctx.group, ctx.dst = group, dst
        ctx.metas = [(t.shape, t.dtype, t.device) for t in tensors]
        for t in tensors:
            dist.send(t.detach().contiguous(), dst=dst, group=group)
        return tensors[0].new_zeros(())

    @staticmethod
    def backward(ctx, grad_token):
        grads = []
        for shape, dtype, device in ctx.metas:
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src=ctx.dst, group=ctx.group)
            grads.append(buf)
        return (None, None, *grads)


def crossing(documents: Documents | None, *, shard_starts_document: bool, shard_ends_document: bool,
             num_rows: int) -> tuple[list[int], list[int]]:
    """``(sequences that continue in, sequences that continue out)``, as indices among the shard's N sequences:
    every row of an unpacked batch, else the first document unless the shard starts one and the last unless the
    shard ends one."""
    if documents is None:
        rows = list(range(num_rows))
        return ([] if shard_starts_document else rows), ([] if shard_ends_document else rows)
    n = documents.num_docs
    return ([] if shard_starts_document else [0]), ([] if shard_ends_document else [n - 1])


def pipelined_attention(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int, evict: str,
                        group, documents: Documents | None = None, continues_in: list[int], continues_out: list[int],
                        backend: str = "reference"):
    """``hola_attention`` of this rank's shard ``[B, T, H, D]`` under the pipelined protocol (module docstring).

    ``continues_in`` / ``continues_out``: the shard's sequences that continue from rank ``r - 1`` / into rank
    ``r + 1`` (:func:`crossing`); both empty on a group of one. ``group``: the context-parallel process group
    (None: the default group). ``documents``: the shard's local document
    boundaries (packed rows, B = 1). Returns ``o`` ``[B, T, H, D]``."""
    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if (continues_in and rank == 0) or (continues_out and rank == size - 1):
        raise ValueError(f"continues_in/continues_out: rank {rank} of {size} has no neighbour on that side")
    bsz, _, h, d = q.shape
    num_seqs = documents.num_docs if documents is not None else bsz
    cdt = compute_dtype(q.dtype)
    has_cache = evict != "none"
    initial_state = initial_cache = None
    if continues_in:
        n_in = len(continues_in)
        templates = [torch.empty(n_in, h, d, d, dtype=cdt, device=q.device)]
        empty = HolaCache.empty(n_in, h, d, window=window, block=block, evict=evict, dtype=q.dtype,
                                device=q.device, score_dtype=cdt) if has_cache else None
        if has_cache:
            templates += [getattr(empty, name) for name in _DIFF]
        received = _Receive.apply(q, group, dist.get_global_rank(group, rank - 1), *templates)
        plain = {}
        if has_cache:
            for name in _PLAIN:
                buf = torch.empty_like(getattr(empty, name))
                dist.recv(buf, src=dist.get_global_rank(group, rank - 1), group=group)
                plain[name] = buf
        # Sequences that start in this shard start from a zero state and an empty cache, which is what a fresh
        # start computes.
        state = q.new_zeros(num_seqs, h, d, d, dtype=cdt)
        initial_state = state.index_copy(0, torch.tensor(continues_in, device=q.device), received[0])
        if has_cache:
            rows = HolaCache(**dict(zip(_DIFF, received[1:])), **plain, window=window, block=block, evict=evict)
            fresh = HolaCache.empty(num_seqs, h, d, window=window, block=block, evict=evict, dtype=q.dtype,
                                    device=q.device, score_dtype=cdt)
            initial_cache = _place(fresh, rows, continues_in)
    want_out = bool(continues_out)
    result = hola_attention(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block, evict=evict,
                            documents=documents, initial_state=initial_state, initial_cache=initial_cache,
                            output_final_state=want_out, output_final_cache=want_out and has_cache, backend=backend)
    o = result[0]
    if want_out:
        dst = dist.get_global_rank(group, rank + 1)
        index = torch.tensor(continues_out, device=q.device)
        sent = [result[1].index_select(0, index)]
        if has_cache:
            final = result[2]
            sent += [getattr(final, name).index_select(0, index) for name in _DIFF]
        token = _Send.apply(group, dst, *sent)
        if has_cache:
            for name in _PLAIN:
                dist.send(getattr(final, name).index_select(0, index).contiguous(), dst=dst, group=group)
        o = o + token.to(o.dtype)  # a zero that carries the backward to _Send
    return o


def _place(fresh: HolaCache, rows: HolaCache, at: list[int]) -> HolaCache:
    """``fresh`` with ``rows``' sequences at indices ``at`` (differentiably for the keys and values)."""
    index = torch.tensor(at, device=fresh.seen.device)
    values = {name: getattr(fresh, name).index_copy(0, index, getattr(rows, name)) for name in HolaCache._TENSORS}
    return HolaCache(**values, window=fresh.window, block=fresh.block, evict=fresh.evict)
