"""torchrun worker for the context-parallel tests (``tests/test_context_parallel.py``); gloo on CPU.

    TRITON_INTERPRET=1 python -m torch.distributed.run --nproc_per_node R tests/cp_worker.py CASE [CASE ...]

Every rank runs the one-process reference on the whole input itself, then its shard under context
parallelism, and compares its shard of the output and of every input gradient, and the parameter gradients
summed over the cp group. Rank 0 prints one JSON line per case (``{"case", "errors": {name: relative error}}``);
a failed check or an exception exits non-zero. Cases are named ``kind:variant``, see ``CASES``.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The "_triton" cases run the Triton kernels in the interpreter: the launcher (tests/test_context_parallel.py) sets
# TRITON_INTERPRET=1 in this process's environment, as Triton reads it when the kernels are defined. CPU only:
# the reference backend, used everywhere else here, does not touch Triton.
if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("cp_worker.py: run with TRITON_INTERPRET=1 (tests/test_context_parallel.py does)")

from helpers import NUDGED_RUNS, nudge_weights  # noqa: E402
from hola_titan import hola_attention  # noqa: E402
from hola_titan.kernels.runtime.documents import Documents  # noqa: E402
from hola_titan.models.args import model_args, replace  # noqa: E402
from hola_titan.models.context import BatchContext  # noqa: E402
from hola_titan.models.model import HolaTitanLM  # noqa: E402
from hola_titan.ops import HolaSettings  # noqa: E402
from hola_titan.parallelisms.context_parallel import (ContextParallel, build_layout,  # noqa: E402
                                                      context_parallel_for)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
INPUTS = ("q", "k", "v", "g", "beta")
PARAMS = ("gamma_q", "gamma_k", "sink", "gate")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (the scale of the tensor, not of each element)."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        raise AssertionError(f"shape {list(a.shape)} vs {list(e.shape)}")
    if not torch.isfinite(a).all():
        return float("inf")
    scale = e.abs().max().item() if e.numel() else 0.0
    return (a - e).abs().max().item() / max(scale, 1e-300) if e.numel() else 0.0


# ------------------------------------------------------------------------------------------------------------
# hola_attention under context parallelism
# ------------------------------------------------------------------------------------------------------------

def attention_inputs(batch: int, seq_len: int, heads: int, dim: int, dtype, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": randn(batch, seq_len, heads, dim), "k": randn(batch, seq_len, heads, dim),
         "v": randn(batch, seq_len, heads, dim), "g": -F.softplus(randn(batch, seq_len, heads)) * 0.3,
         "beta": torch.sigmoid(randn(batch, seq_len, heads)), "gamma_q": 1.0 + 0.3 * randn(dim),
         "gamma_k": 1.0 + 0.3 * randn(dim), "sink": randn(heads), "gate": randn(heads),
         "weight": randn(batch, seq_len, heads, dim)}
    return {name: t.to(dtype) for name, t in x.items()}


# Packed streams of 4 shards of L tokens (R = 2 merges them in pairs): each list is cu_seqlens over R*L tokens
# for L = 8, C = 4, scaled by the shard length when it differs.
PACKED_DOCS = {
    # one document over everything: crosses every boundary, passes through the middle shards
    "one_doc": [0, 32],
    # crosses one boundary with a block head (starts at 3, boundary at 8: head of 1 token), ends inside the
    # next shard; a document ending exactly on a boundary (16); a short document of 2 tokens crossing 24
    "mixed": [0, 3, 13, 16, 23, 25, 32],
    # a document from 5 spanning three boundaries (8, 16, 24) with an odd head, another one inside
    "spanning": [0, 5, 30, 32],
    # documents of length 1 at shard edges (7, 8, 17, 23 and 24 of 32) around documents that cross 16 and 24
    "singles": [0, 7, 8, 9, 17, 18, 23, 25, 32],
    # every shard starts a document (for any number of ranks: run_attention_case puts the boundaries there)
    "at_boundaries": [0, 32],
}


def run_attention_case(cp: ContextParallel, *, layout_kind: str, docs: str | None, evict: str, window: int,
                       block: int, shard: int, dtype, seed: int = 0, batch: int = 2, dim: int = 8,
                       backend: str = "reference", before=None, after=None, frozen: tuple[str, ...] = (),
                       layer: dict | None = None) -> dict:
    """``backend`` runs the shards (the one-process run is always the reference): "triton" runs the Triton
    kernels in Triton's interpreter (continuing from the caches and states the ranks hand over). ``before`` and
    ``after`` are called before this rank's shard runs and after its backward (before any collective). ``frozen``:
    inputs that need no gradient here (both sides of every boundary must still exchange the backward message).
    ``layer``: more of the layer's settings (``scale``, ``mix``), the same for the shards and the one-process run."""
    layer = layer or {}
    heads = 2
    size = cp.cp_size
    if layout_kind == "packed":
        total = 4 * shard
        # The document layouts are written for 4 shards of 8 tokens; R = 2 holds two of them per rank.
        cu = [0] + [s * shard // 8 for s in PACKED_DOCS[docs][1:-1]] + [total]
        if docs == "at_boundaries":  # every rank's shard starts a document, whatever the number of ranks
            cu = list(range(0, total + 1, total // size))
        x = attention_inputs(1, total, heads, dim, dtype, seed)
        rows, row_len, cu_list = 1, total, cu
    else:
        row_len = size * shard
        x = attention_inputs(batch, row_len, heads, dim, dtype, seed)
        rows, cu_list = batch, None
    layout = build_layout(cp_rank=cp.cp_rank, cp_size=size, num_rows=rows, row_len=row_len, cu_seqlens=cu_list)
    cp_batch = cp.batch(layout)
    def cache_args(d):
        return [None] * 4 if evict == "none" else [d[p] for p in PARAMS]

    ref = {name: t.clone().requires_grad_() for name, t in x.items() if name != "weight"}
    cu_t = torch.tensor(cu_list, dtype=torch.int64) if cu_list else None
    o_ref, _ = hola_attention(*(ref[n] for n in INPUTS), *cache_args(ref), window=window, block=block, evict=evict,
                              cu_seqlens=cu_t, backend="reference", **layer)
    weight = x["weight"]
    if layer.get("mix") == "parts":  # o holds both reads side by side: weigh them differently
        weight = torch.cat([weight, 0.5 - weight], dim=-1)
    (o_ref * weight).sum().backward()

    cols = slice(layout.shard_start, layout.shard_start + layout.shard_len)
    local = {name: (t[:, cols] if name in INPUTS else t).clone().requires_grad_(name not in frozen)
             for name, t in x.items() if name != "weight"}
    cu_local = torch.tensor(layout.local_cu_seqlens, dtype=torch.int64) if cu_list else None
    if before is not None:
        before()
    cp.bytes_received = 0
    settings = HolaSettings(window=window, block=block, evict=evict, backend=backend, **layer)
    layer = cp_batch.layer("attn", head_dim=dim, settings=settings)
    o, _ = layer.attention(*(local[n] for n in INPUTS), *cache_args(local), cu_seqlens=cu_local)
    received = cp.bytes_received
    (o * weight[:, cols]).sum().backward()
    if after is not None:
        after()

    errors = {"o": rel_err(o, o_ref[:, cols])}
    for name in INPUTS:
        if name not in frozen:
            errors[f"d{name}"] = rel_err(local[name].grad, ref[name].grad[:, cols])
    if evict != "none":
        for name in PARAMS:
            grad = local[name].grad.clone()
            dist.all_reduce(grad)
            errors[f"d{name}"] = rel_err(grad, ref[name].grad)
    return {"errors": errors, "bytes_received": received, "tol": TOL[dtype]}


# ------------------------------------------------------------------------------------------------------------
# The whole debug model under context parallelism
# ------------------------------------------------------------------------------------------------------------

def tiny_args(flavour: str, vocab: int = 96):
    args = model_args(flavour, "debug", vocab_size=vocab)
    return replace(args, dim=32, n_layers=2, mlp_hidden=64, head_dim=8, block=4, window=6)


def run_model_case(mesh, *, flavour: str, packed: bool, dtype, seed: int = 0, bsz: int = 2, ac: str = "none",
                   ac_option: str = "1", changes: dict | None = None) -> dict:
    """``ac``: activation checkpointing of the cp model (``full``, or ``selective`` with ``ac_option``): the
    re-run forward reads the messages its first run received and sends nothing. ``changes``: other ModelArgs fields
    (the layer's open choices)."""
    args = replace(tiny_args(flavour), **(changes or {}))
    torch.manual_seed(seed)
    model = HolaTitanLM(args, backend="reference")
    model.init_weights()
    model.to(dtype)
    cp_model = copy.deepcopy(model)
    if ac != "none":
        from hola_titan.parallelisms.parallelize import apply_activation_checkpointing
        apply_activation_checkpointing(cp_model, mode=ac, selective_option=ac_option)
    cp = context_parallel_for(cp_model.args, mesh)

    seq_len = 16 * cp.cp_size
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, args.vocab_size, (bsz, seq_len), generator=gen)
    labels = torch.randint(0, args.vocab_size, (bsz, seq_len), generator=gen)
    labels[0, 5] = -100
    batch = {"input_ids": tokens, "labels": labels,
             "position_ids": torch.arange(seq_len).expand(bsz, seq_len).clone()}
    if packed:
        # The packed stream is sharded as one row of bsz * seq_len tokens, S per rank: a document of 3
        # tokens crossing the first boundary with 2 of them before it (the conv tail holds another
        # document's token), then one up to 3 tokens before the end, crossing every later boundary.
        total = bsz * seq_len
        shard = total // cp.cp_size
        cuts = set(range(0, total, seq_len)) | {3, shard - 2, shard + 1, total - 3, total}
        batch["cu_seqlens"] = torch.tensor(sorted(cuts), dtype=torch.int32)

    def one_process(m):
        logits = m(tokens, cu_seqlens=batch.get("cu_seqlens"))
        F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100,
                        reduction="sum").backward()
        return logits, {name: p.grad for name, p in m.named_parameters()}

    logits_ref, grads_ref = one_process(model)
    local = cp.shard_batch(batch)
    documents = None
    if "cu_seqlens" in local:
        documents = Documents.from_host(local["cu_seqlens"], device="cpu", seq_len=local["input_ids"].numel())
    logits = cp_model(local["input_ids"], context=BatchContext(documents=documents, cp=cp.batch(local["cp_layout"])))
    F.cross_entropy(logits.flatten(0, 1).double(), local["labels"].flatten(), ignore_index=-100,
                    reduction="sum").backward()
    layout = local["cp_layout"]
    cols = slice(layout.shard_start, layout.shard_start + layout.shard_len)

    def shard(x):
        return x.reshape(layout.num_rows, layout.row_len, -1)[:, cols]

    actual = {"logits": logits}
    for name, param in cp_model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        grad = param.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        actual[f"d.{name}"] = grad
    expected = {"logits": shard(logits_ref), **{f"d.{n}": g for n, g in grads_ref.items()}}
    if dtype == torch.float64:
        return {"errors": {n: rel_err(actual[n], expected[n]) for n in actual}, "tol": TOL[dtype]}
    # float32 (DESIGN §7): against float64, at most twice the error of one process in float32 (plus 1e-6, about
    # 8 units of float32 roundoff, for tensors that one process happens to get almost exact), that error being
    # the largest over the plain run and runs at weights moved by one ulp (helpers.NUDGED_RUNS: one run's error
    # on the decay-parameter gradients, sums with heavy cancellation, can be lucky by a factor of ten). Reported
    # as the ratio error / bound. A fixed 1e-5 would not do: one process alone is 7e-6 away from float64 there.
    logits64, grads64 = one_process(_double_copy(model))
    exact = {"logits": shard(logits64), **{f"d.{n}": g for n, g in grads64.items()}}
    runs = [expected]
    for k in range(NUDGED_RUNS):
        logits_k, grads_k = one_process(nudge_weights(_fresh_copy(model), k))
        runs.append({"logits": shard(logits_k), **{f"d.{n}": g for n, g in grads_k.items()}})
    return {"errors": {n: rel_err(actual[n], exact[n]) / (2 * max(rel_err(r[n], exact[n]) for r in runs) + 1e-6)
                       for n in actual}, "tol": 1.0}


def _fresh_copy(model):
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    return m


def _double_copy(model):
    return _fresh_copy(model).double()


# ------------------------------------------------------------------------------------------------------------

def cases(cp: ContextParallel, mesh) -> dict:
    f64, f32 = torch.float64, torch.float32
    att = lambda **kw: (lambda: run_attention_case(cp, **kw))  # noqa: E731
    common = dict(block=4, shard=8)
    return {
        # Packed documents: crossing one and several shards, block heads, cache larger than a shard (W=12 > L=8).
        "attn:packed_score": att(layout_kind="packed", docs="mixed", evict="score", window=3, dtype=f64, **common),
        "attn:spanning_score": att(layout_kind="packed", docs="spanning", evict="score", window=3, dtype=f64,
                                   **common),
        "attn:one_doc_big_window": att(layout_kind="packed", docs="one_doc", evict="score", window=12, dtype=f64,
                                       **common),
        "attn:spanning_big_window": att(layout_kind="packed", docs="spanning", evict="score", window=12,
                                        dtype=f64, **common),
        "attn:packed_recency": att(layout_kind="packed", docs="mixed", evict="recency", window=5, dtype=f64,
                                   **common),
        "attn:spanning_recency": att(layout_kind="packed", docs="spanning", evict="recency", window=12,
                                     dtype=f64, **common),
        "attn:packed_gdn": att(layout_kind="packed", docs="spanning", evict="none", window=0, dtype=f64, **common),
        "attn:spanning_scale1_parts": att(layout_kind="packed", docs="spanning", evict="score", window=3, dtype=f64,
                                          layer=dict(scale=1.0, mix="parts"), **common),
        "attn:rows_gdn_scale1": att(layout_kind="rows", docs=None, evict="none", window=0, dtype=f64,
                                    layer=dict(scale=1.0), **common),
        "attn:packed_window0": att(layout_kind="packed", docs="mixed", evict="score", window=0, dtype=f64, **common),
        "attn:rows_score": att(layout_kind="rows", docs=None, evict="score", window=6, dtype=f64, **common),
        "attn:rows_recency": att(layout_kind="rows", docs=None, evict="recency", window=10, dtype=f64, **common),
        "attn:rows_gdn": att(layout_kind="rows", docs=None, evict="none", window=0, dtype=f64, **common),
        "attn:packed_fp32": att(layout_kind="packed", docs="spanning", evict="score", window=3, dtype=f32,
                                **common),
        # Longer shards with the real chunk of the state path (64) inside a shard.
        "attn:long_fp32": att(layout_kind="packed", docs="mixed", evict="score", window=8, dtype=f32, block=16,
                              shard=96),
        # The shards on the Triton backend (interpreter, float32, head dim 16): continuing from the handed-over
        # caches, with block heads, a cache larger than a shard, recency and unpacked rows.
        "attn:packed_score_triton": att(layout_kind="packed", docs="mixed", evict="score", window=3, dtype=f32,
                                        dim=16, backend="triton", **common),
        "attn:spanning_big_window_triton": att(layout_kind="packed", docs="spanning", evict="score", window=12,
                                               dtype=f32, dim=16, backend="triton", **common),
        "attn:packed_recency_triton": att(layout_kind="packed", docs="mixed", evict="recency", window=5, dtype=f32,
                                          dim=16, backend="triton", **common),
        "attn:rows_score_triton": att(layout_kind="rows", docs=None, evict="score", window=6, dtype=f32, dim=16,
                                      backend="triton", **common),
        "model:hola_packed": lambda: run_model_case(mesh, flavour="hola", packed=True, dtype=f64, bsz=1),
        "model:hola_packed_scale1_per_path": lambda: run_model_case(
            mesh, flavour="hola", packed=True, dtype=f64, bsz=1,
            changes=dict(state_read_scale="one", cache_mix="per_path_norm")),
        "model:hola_packed_rows": lambda: run_model_case(mesh, flavour="hola", packed=True, dtype=f64, bsz=3),
        "model:hola_rows": lambda: run_model_case(mesh, flavour="hola", packed=False, dtype=f64),
        "model:recency_packed": lambda: run_model_case(mesh, flavour="hola_recency", packed=True, dtype=f64, bsz=1),
        "model:gdn_packed": lambda: run_model_case(mesh, flavour="gdn", packed=True, dtype=f64, bsz=1),
        "model:transformer": lambda: run_model_case(mesh, flavour="transformer", packed=False, dtype=f64),
        "model:hola_fp32": lambda: run_model_case(mesh, flavour="hola", packed=True, dtype=f32, bsz=1),
        # Activation checkpointing: every block, and op-level selective (the messages are kept per layer).
        "model:hola_packed_ac": lambda: run_model_case(mesh, flavour="hola", packed=True, dtype=f64, bsz=1,
                                                       ac="full"),
        "model:hola_packed_ac_op": lambda: run_model_case(mesh, flavour="hola", packed=True, dtype=f64, bsz=1,
                                                          ac="selective", ac_option="op"),
        # Queries need no gradient (a frozen projection): the backward messages must still flow both ways.
        "attn:frozen_q": att(layout_kind="packed", docs="spanning", evict="score", window=3, dtype=f64,
                             frozen=("q",), **common),
        "model:gdn_rows_ac_op": lambda: run_model_case(mesh, flavour="gdn", packed=False, dtype=f64, ac="selective",
                                                       ac_option="op"),
        # Length-1 documents at shard edges; shards that end inside a block (6 tokens, blocks of 4).
        "attn:singles_score": att(layout_kind="packed", docs="singles", evict="score", window=3, dtype=f64, **common),
        "attn:odd_shard_score": att(layout_kind="packed", docs="mixed", evict="score", window=5, dtype=f64, block=4,
                                    shard=6),
        "attn:odd_shard_rows": att(layout_kind="rows", docs=None, evict="recency", window=5, dtype=f64, block=4,
                                   shard=6),
        "attn:odd_shard_triton": att(layout_kind="packed", docs="spanning", evict="score", window=5, dtype=f32,
                                     dim=16, backend="triton", block=4, shard=6),
        "attn:fresh_starts_wait_for_nothing": lambda: fresh_case(cp),
    }


def bytes_case(cp: ContextParallel) -> dict:
    """Bytes each rank receives for one layer at two sequence lengths (shards of 8 and 32 tokens), per rank."""
    out = {}
    for shard in (8, 32):
        result = run_attention_case(cp, layout_kind="packed", docs="spanning", evict="score", window=3, block=4,
                                    shard=shard, dtype=torch.float32)
        counts = [None] * cp.cp_size
        dist.all_gather_object(counts, result["bytes_received"], group=cp.mesh.get_group())
        out[f"shard_{shard}"] = counts
    return {"bytes": out}


def fresh_case(cp: ContextParallel) -> dict:
    """Every shard starts a document. Rank 0 starts only after every other rank has run its forward and backward
    and said so, so a rank that waited for anything from an earlier rank would hang here (a 60 s timeout); and no
    rank receives a byte."""
    from datetime import timedelta

    group, rank, size = cp.mesh.get_group(), cp.cp_rank, cp.cp_size
    token = torch.zeros(1)

    def before():
        if rank == 0:
            for src in range(1, size):
                dist.irecv(token, src=dist.get_global_rank(group, src), group=group).wait(timedelta(seconds=60))

    def after():
        if rank > 0:
            dist.send(token, dst=dist.get_global_rank(group, 0), group=group)

    result = run_attention_case(cp, layout_kind="packed", docs="at_boundaries", evict="score", window=3, block=4,
                                shard=8, dtype=torch.float64, before=before, after=after)
    counts = [None] * size
    dist.all_gather_object(counts, result["bytes_received"], group=group)
    result["errors"]["bytes_received_max"] = float(max(counts))
    return result


def run(names: list[str]) -> bool:
    """Run the cases; True if all passed. Every object holding a process group dies with this frame."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    cp = ContextParallel(mesh, recurrent=True, conv_size=4)
    table = cases(cp, mesh)
    failed = False
    # "all": every case; "all_but_triton": without the Triton-interpreter cases (the slowest, run at R = 2).
    expand = {"all": list(table), "all_but_triton": [n for n in table if not n.endswith("_triton")]}
    for name in [n for pattern in names for n in expand.get(pattern, [pattern])]:
        start = time.perf_counter()
        if name == "bytes":
            result = bytes_case(cp)
        else:
            result = table[name]()
            bad = {k: v for k, v in result["errors"].items() if not v <= result["tol"]}
            result["failed"] = bad
            failed |= bool(bad)
        result["case"] = name
        result["seconds"] = round(time.perf_counter() - start, 2)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
        elif result.get("failed"):
            print(json.dumps({"case": name, "rank": dist.get_rank(), "failed": result["failed"]}), flush=True)
    return not failed


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    passed = run(argv)
    # Gloo aborts the process (std::terminate) when a process group object outlives destroy_process_group
    # into interpreter shutdown, or when a rank tears down while another still finishes a collective.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
