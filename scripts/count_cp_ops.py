"""How many ATen operations one context-parallel layer call issues around its kernels, by the function that issued
them: the host work of the handover and of the continuation, counted on a CPU.

On a GPU an eager layer call is partly bound by the host issuing operations; this counts them without one. The
Triton backend runs in Triton's interpreter, and its heavy part, the shard's state path, is replaced by a
one-operation stand-in (on a GPU it is a few fla kernels; on the CPU it would run the reference's Python chunk
loop). What remains is the handover's own work and the Triton backend's plumbing (selection, cache layout).
Counts are operations at the dispatcher (a composite op counts as the ops it decomposes into; sends and receives
are not counted), for one forward + backward, per rank, one document across all ranks.

    torchrun --nproc_per_node 2 scripts/count_cp_ops.py --seq-len 256
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _CountByCaller(TorchDispatchMode):
    """Counts every ATen operation under the innermost function of this repository that issued it."""

    def __init__(self):
        super().__init__()
        self.by_function = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = "(autograd engine)"
        for frame in reversed(traceback.extract_stack()):
            path = Path(frame.filename)
            if ROOT in path.parents and ".venv" not in path.parts and path.name != Path(__file__).name:
                where = f"{path.name}:{frame.name}"
                break
        self.by_function[where] += 1
        return func(*args, **(kwargs or {}))


def _stub_heavy_parts() -> None:
    import hola_titan.kernels.hola.triton_backend as hola_triton

    def state_path(q, k, v, g, beta, *, initial_state, cu_seqlens, output_final_state, impl="auto", chunk_indices=None,
                   recompute_norms=False, scale=None):
        m = (k.float().norm(dim=-1) * beta.float()).detach()
        final = None
        if output_final_state:  # keeps the incoming state in the graph, as the real state path does
            final = initial_state if initial_state is not None else q.new_zeros(1, q.shape[2], q.shape[3], q.shape[3],
                                                                               dtype=torch.float32)
            final = final + 0
        return q + k + v + g[..., None] + beta[..., None], m, final

    hola_triton.state_path = state_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=256, help="tokens of the whole row (split over the ranks)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--top", type=int, default=12, help="functions listed per rank")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun with at least 2 processes (see --help)")
    _stub_heavy_parts()
    from torch.distributed.device_mesh import init_device_mesh

    from hola_titan.ops import HolaSettings
    from hola_titan.parallelisms.context_parallel import ContextParallel, build_layout

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    cp = ContextParallel(mesh, recurrent=True, conv_size=4)
    layout = build_layout(cp_rank=rank, cp_size=world, num_rows=1, row_len=args.seq_len,
                          cu_seqlens=[0, args.seq_len])
    gen = torch.Generator().manual_seed(0)
    shard, h, d = args.seq_len // world, args.heads, args.dim
    x = dict(q=torch.randn(1, shard, h, d, generator=gen), k=torch.randn(1, shard, h, d, generator=gen),
             v=torch.randn(1, shard, h, d, generator=gen), g=-0.1 * torch.rand(1, shard, h, generator=gen),
             beta=torch.rand(1, shard, h, generator=gen), gamma_q=torch.ones(d), gamma_k=torch.ones(d),
             sink=torch.zeros(h), gate=torch.zeros(h))
    x = {name: t.requires_grad_() for name, t in x.items()}
    cu_seqlens = torch.tensor(layout.local_cu_seqlens)

    def call():
        # A new batch each call: the count includes making the layout's index tensors.
        settings = HolaSettings(window=args.window, block=args.block, evict="score", backend="triton")
        layer = cp.batch(layout).layer("count", head_dim=d, settings=settings)
        o, _ = layer.attention(*x.values(), cu_seqlens=cu_seqlens)
        o.sum().backward()

    call()  # warm: the interpreter's first launches
    counter = _CountByCaller()
    with counter:
        call()
    for r in range(world):
        if r == rank:
            total = sum(counter.by_function.values())
            print(f"rank {rank}: {total} ATen operations per layer call (forward + backward, T {args.seq_len})")
            for where, n in counter.by_function.most_common(args.top):
                print(f"    {n:6d}  {where}")
            sys.stdout.flush()
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
