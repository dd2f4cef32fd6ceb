"""The pipelined context-parallel token mixer (parallelisms/cp_pipeline.py) against one process, on CPU with gloo.

Every rank draws the whole input, runs the one-process ``hola_attention`` (float64, reference backend), then its
shard through ``pipelined_attention``, and compares its shard of the output and of every input gradient, and the
parameter gradients summed over the ranks. Shards need not hold whole blocks; packed documents cross one and
several shards, have length 1 at shard edges, and a shard that starts a document receives nothing at all.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hola_titan import hola_attention
from hola_titan.kernels.seqlens import Documents
from hola_titan.parallelisms.cp_pipeline import crossing, pipelined_attention

H, D, W, C = 2, 8, 3, 4
# (name, evict, rows, total tokens, ranks, document boundaries over the row or None)
CASES = {
    2: [("score_unpacked", "score", 2, 30, 2, None), ("recency_unpacked", "recency", 2, 30, 2, None),
        ("gdn_unpacked", "none", 2, 30, 2, None), ("score_packed_edges", "score", 1, 30, 2, [0, 14, 15, 16, 30])],
    4: [("score_packed_spanning", "score", 1, 40, 4, [0, 7, 8, 9, 23, 40]),
        ("score_shard_starts_doc", "score", 1, 40, 4, [0, 5, 20, 33, 40]),
        ("gdn_packed", "none", 1, 40, 4, [0, 9, 10, 11, 27, 40]), ("score_unpacked", "score", 1, 40, 4, None)],
}


def _inputs(rows, total, seed):
    gen = torch.Generator().manual_seed(seed)
    x = {n: torch.randn(rows, total, H, D, generator=gen, dtype=torch.float64) for n in ("q", "k", "v")}
    x["g"] = -0.4 * torch.rand(rows, total, H, generator=gen, dtype=torch.float64)
    x["beta"] = torch.rand(rows, total, H, generator=gen, dtype=torch.float64)
    p = {"gamma_q": 1 + 0.3 * torch.randn(D, generator=gen, dtype=torch.float64),
         "gamma_k": 1 + 0.3 * torch.randn(D, generator=gen, dtype=torch.float64),
         "sink": torch.randn(H, generator=gen, dtype=torch.float64),
         "gate": torch.randn(H, generator=gen, dtype=torch.float64)}
    return x, p, torch.randn(rows, total, H, D, generator=gen, dtype=torch.float64)


def _worker(rank, size, port, cases, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    received = []
    plain_recv = dist.recv

    def counting_recv(tensor, *args, **kwargs):
        received.append(tensor.numel())
        return plain_recv(tensor, *args, **kwargs)

    dist.recv = counting_recv
    try:
        for i, (name, evict, rows, total, _, bounds) in enumerate(cases):
            x, p, do = _inputs(rows, total, seed=i)
            params = {n: (t if evict != "none" else None) for n, t in p.items()}
            kw = dict(window=W, block=C, evict=evict, backend="reference")
            full_x = {n: t.clone().requires_grad_() for n, t in x.items()}
            full_p = {n: (t.clone().requires_grad_() if t is not None else None) for n, t in params.items()}
            docs = Documents.of(torch.tensor(bounds), seq_len=total) if bounds else None
            o_full, _ = hola_attention(*full_x.values(), *full_p.values(), **kw, documents=docs)
            o_full.backward(do)

            shard = total // size
            lo, hi = rank * shard, (rank + 1) * shard
            local_docs = None
            starts = ends = True
            if bounds:
                inner = sorted({b - lo for b in bounds if lo < b < hi})
                local_docs = Documents.of(torch.tensor([0, *inner, shard]), seq_len=shard)
                starts, ends = lo in bounds, hi in bounds
            else:
                starts, ends = rank == 0, rank == size - 1
            c_in, c_out = crossing(local_docs, shard_starts_document=starts or rank == 0,
                                   shard_ends_document=ends or rank == size - 1, num_rows=rows)
            loc_x = {n: t[:, lo:hi].clone().requires_grad_() for n, t in x.items()}
            loc_p = {n: (t.clone().requires_grad_() if t is not None else None) for n, t in params.items()}
            before = len(received)
            o = pipelined_attention(*loc_x.values(), *loc_p.values(), window=W, block=C, evict=evict, group=None,
                                    documents=local_docs, continues_in=c_in, continues_out=c_out)
            got_messages = len(received) > before
            o.backward(do[:, lo:hi])
            err = {"o": (o - o_full[:, lo:hi]).abs().max().item()}
            for n in x:
                err[f"d{n}"] = (loc_x[n].grad - full_x[n].grad[:, lo:hi]).abs().max().item()
            for n, t in loc_p.items():
                if t is not None:
                    total_grad = t.grad.clone()
                    dist.all_reduce(total_grad)
                    err[f"d{n}"] = (total_grad - full_p[n].grad).abs().max().item()
            errors.append((name, rank, max(err.values()), bool(c_in), got_messages))
    finally:
        dist.recv = plain_recv
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("ranks", [2, 4])
def test_pipelined_attention_equals_one_process(ranks):
    manager = mp.Manager()
    errors = manager.list()
    mp.spawn(_worker, args=(ranks, _free_port(), CASES[ranks], errors), nprocs=ranks, join=True)
    results = list(errors)
    assert len(results) == ranks * len(CASES[ranks])
    for name, rank, err, continues, got_messages in results:
        assert err < 1e-10, (name, rank, err)
        # A rank receives exactly when a sequence crosses into its shard.
        assert got_messages == continues, (name, rank)
    if ranks == 4:
        starts = {rank: continues for name, rank, _, continues, _ in results if name == "score_shard_starts_doc"}
        assert starts == {0: False, 1: True, 2: False, 3: True}  # rank 2's shard starts a document at 20


def test_crossing_and_bad_neighbours():
    docs = Documents.of(torch.tensor([0, 3, 10]), seq_len=10)
    assert crossing(docs, shard_starts_document=False, shard_ends_document=False, num_rows=1) == ([0], [1])
    assert crossing(docs, shard_starts_document=True, shard_ends_document=True, num_rows=1) == ([], [])
    assert crossing(None, shard_starts_document=False, shard_ends_document=True, num_rows=3) == ([0, 1, 2], [])
