"""The interconnect as FSDP uses it: all-gather and reduce-scatter bandwidth at the message sizes of one block.

FSDP2 all-gathers each block's parameters (bf16) in forward and again in backward, and reduce-scatters its
gradients (fp32 with ``training.mixed_precision_reduce = "float32"``). Whether that hides behind compute depends on
the link: over NVLink it is a few milliseconds per step at 340M, through host memory (no peer-to-peer, e.g. GPUs
passed into a virtual machine) it can be a third of the step. This prints, per collective and message size, the
median time and the bus bandwidth (NCCL's convention: bytes x (R - 1) / R / time), and the time one training step
of a model of ``--params`` parameters spends in them if none of it overlaps compute. Writes JSON.

    torchrun --nproc_per_node 2 scripts/bench_collectives.py --params 341.6e6 --blocks 24 --out collectives.json
    python scripts/predict_layouts.py --collectives-json collectives.json   # the prediction at the measured link
    NCCL_DEBUG=INFO torchrun ...   # NCCL then logs the transport it chose (P2P/NVLink, SHM, NET)
    torchrun --nproc_per_node 2 scripts/bench_collectives.py --device cpu --sizes-mib 1 --large-mib 0 --reps 2  # gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hola_titan.parallelisms.parallel_dims import end_process_group


# torch 2.13 renamed the single-tensor collectives; 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=341.6e6, help="model parameters, for the per-step estimate")
    p.add_argument("--blocks", type=int, default=24, help="FSDP units (blocks); one message per unit")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=None,
                   help="all-gather output sizes in MiB (default: one block's bf16 parameters, and 4x, 1/4x)")
    p.add_argument("--large-mib", type=float, default=1024.0,
                   help="one more size, in MiB per rank's whole buffer: the size at which the link's peak was quoted "
                        "(issue 54: 284 GB/s all-gather bus bandwidth at 1 GiB), beside FSDP's own; 0 leaves it out")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", type=Path, default=Path("collectives.json"))
    return p.parse_args(argv)


def _time(fn, reps: int, device: torch.device) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, each ended by a device synchronisation."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun with at least 2 processes (see --help)")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    block_mib = args.params / args.blocks * 2 / 2**20  # one block's parameters in bf16
    sizes = args.sizes_mib or [block_mib / 4, block_mib, 4 * block_mib]
    if args.large_mib > 0:
        sizes = [*sizes, args.large_mib]
    rows = []
    for mib in sizes:
        for name, dtype in (("all_gather bf16", torch.bfloat16), ("reduce_scatter fp32", torch.float32)):
            # The same element count for both: the gradients of the parameters that the all-gather carries.
            numel = max(world, int(mib * 2**20 / 2) // world * world)
            full = torch.zeros(numel, dtype=dtype, device=device)
            shard = torch.zeros(numel // world, dtype=dtype, device=device)
            if name.startswith("all_gather"):
                def fn():
                    _all_gather_single(full, shard)
            else:
                def fn():
                    _reduce_scatter_single(shard, full)
            seconds = _time(fn, args.reps, device)
            nbytes = full.numel() * full.element_size()
            rows.append({"collective": name, "bytes": nbytes, "ms": 1e3 * seconds,
                         "bus_gb_s": nbytes * (world - 1) / world / seconds / 1e9})
    # One step of FSDP: parameters gathered twice (forward, and again in backward after resharding) and
    # gradients reduce-scattered once, at the bandwidth measured at one block's size.
    at_block = {r["collective"]: r for r in rows if abs(r["bytes"] / 2**20 / (1 if "bf16" in r["collective"] else 2)
                                                         - block_mib) < 0.5 * block_mib}
    step_ms = None
    if len(at_block) == 2:
        gather, scatter = at_block["all_gather bf16"], at_block["reduce_scatter fp32"]
        step_ms = args.blocks * (2 * gather["ms"] + scatter["ms"])
    if rank == 0:
        print(f"{world} ranks, {device.type}; one block = {block_mib:.1f} MiB of bf16 parameters")
        print(f"{'collective':<22}{'MiB':>9}{'ms':>9}{'bus GB/s':>10}")
        for r in rows:
            print(f"{r['collective']:<22}{r['bytes'] / 2**20:>9.1f}{r['ms']:>9.3f}{r['bus_gb_s']:>10.1f}")
        if step_ms is not None:
            print(f"FSDP collectives of one step ({args.params / 1e6:.0f}M parameters, {args.blocks} blocks), "
                  f"if none overlapped compute: {step_ms:.1f} ms")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "world": world,
            "torch": torch.__version__, "params": args.params, "blocks": args.blocks, "rows": rows,
            "fsdp_step_ms_unoverlapped": step_ms}, indent=1) + "\n")
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
