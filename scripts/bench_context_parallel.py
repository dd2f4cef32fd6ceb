"""One HOLA token mixer under context parallelism: forward + backward time, communication, peak memory.

Every rank draws the same whole row (one document of T tokens, or ``--docs`` equal documents), keeps its shard
and runs ``ContextParallel.attention`` (the exact sequence-parallel scan of ``hola_titan.parallelisms``) forward
and backward; rank 0 then runs ``hola_attention`` on the whole row alone, the one-GPU baseline (reported as out
of memory where it does not fit). Rows (medians over ``--reps`` calls, CUDA events):

- ``cp_ms`` / ``single_ms``: forward + backward of the layer, CP against one GPU, and ``speedup`` = single / cp;
- ``comm_ms``: wall time of the forward all-gathers in a separate pass that synchronises around each (so it
  serialises them: an upper bound on what the timed pass spends waiting), ``comm_bytes`` received per rank;
- ``cp_peak_gib`` / ``single_peak_gib``: peak allocated memory of one forward + backward.

A whole model adds the MLPs and projections, which CP splits perfectly; ``scripts/composition_run.py --mode
gpu2`` measures the model. Shapes default to the 340M layer (4 heads x 256, window 64, block 256, bf16).

    torchrun --nproc_per_node 2 scripts/bench_context_parallel.py --seq-lens 32768 65536 131072 --out cp.json
    torchrun --nproc_per_node 2 scripts/bench_context_parallel.py --device cpu --seq-lens 64 --block 8 \\
        --window 4 --heads 2 --dim 16 --reps 1 --out /tmp/cp.json     # a smoke test (gloo, reference backend)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--docs", type=int, default=1, help="equal documents per row")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--evict", default="score", choices=("score", "recency", "none"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    p.add_argument("--profile", action="store_true",
                   help="also profile the CP call and the single call (scripts/profiling.py): kernel time "
                        "against wall time, top kernels, ATen calls per call")
    p.add_argument("--out", type=Path, default=Path("bench_context_parallel.json"))
    return p.parse_args(argv)


def inputs(t, args, device, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h, d = args.heads, args.dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x = {"q": randn(1, t, h, d), "k": randn(1, t, h, d), "v": randn(1, t, h, d),
         "g": -torch.nn.functional.softplus(randn(1, t, h)) * 0.1, "beta": torch.sigmoid(randn(1, t, h)),
         "gamma_q": 1 + 0.1 * randn(d), "gamma_k": 1 + 0.1 * randn(d), "sink": randn(h), "gate": randn(h) - 4}
    out = {n: (x[n].to(dtype) if n in ("q", "k", "v", "gamma_q", "gamma_k", "sink", "gate") else x[n])
           for n in x}
    return out, randn(1, t, h, d).to(dtype)


NAMES = ("q", "k", "v", "g", "beta", "gamma_q", "gamma_k", "sink", "gate")


class Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self, fn, reps):
        """Median milliseconds of ``reps`` calls (one untimed call first), and the peak GiB of one call."""
        cuda = self.device.type == "cuda"
        fn()
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        peak = None  # CPU: not measured
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            peak = (torch.cuda.max_memory_allocated(self.device) - base) / 2 ** 30
        return sorted(times)[len(times) // 2], peak


def count_host_syncs(fn, device) -> int | None:
    """How many times one call of ``fn`` made the host wait for the GPU (CUDA's sync debug mode), None on CPU.
    Each wait leaves the GPU idle while the host issues what comes next."""
    if device.type != "cuda":
        return None
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _cell(row: dict, key: str, fmt: str) -> str:
    val = row.get(key)
    if val is None or (isinstance(val, float) and math.isnan(val)):
        return "-"
    return fmt.format(val) if isinstance(val, (int, float)) else str(val)


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed = "RANK" in os.environ
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    from hola_titan import hola_attention
    from hola_titan.kernels.seqlens import Documents
    from hola_titan.parallelisms.context_parallel import ContextParallel, build_layout
    from hola_titan.parallelisms.parallel_dims import end_process_group

    cp = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))["cp"]
        cp = ContextParallel(mesh, recurrent=True, conv_size=4, block=args.block)
    timer = Timer(device)
    kw = dict(window=args.window, block=args.block, evict=args.evict)
    rows = []
    for t in args.seq_lens:
        row = {"T": t, "docs": args.docs, "cp": world, "heads": args.heads, "dim": args.dim, **kw}
        if t % (world * args.block) or t % args.docs:
            raise SystemExit(f"--seq-lens: {t} must split into {world} shards of whole blocks of {args.block} "
                             f"and into {args.docs} documents")
        cu_list = [i * t // args.docs for i in range(args.docs + 1)]
        x, do = inputs(t, args, device, dtype)
        if cp is not None:
            layout = build_layout(cp_rank=rank, cp_size=world, num_rows=1, row_len=t, cu_seqlens=cu_list)
            view = {"batch": cp.batch(layout)}
            cols = slice(layout.shard_start, layout.shard_start + layout.shard_len)
            local = {n: (x[n][:, cols] if n in ("q", "k", "v", "g", "beta") else x[n]).contiguous()
                     .requires_grad_() for n in NAMES}
            # As the trainer does: checked from the host copy, so no layer reads it back from the device.
            docs_local = Documents.from_host(torch.tensor(layout.local_cu_seqlens), device=device,
                                             seq_len=layout.shard_len)
            do_local = do[:, cols].contiguous()

            def cp_step():
                o, _ = view["batch"].layer().attention(*(local[n] for n in NAMES), documents=docs_local, **kw)
                o.backward(do_local)
                for n in NAMES:
                    local[n].grad = None

            try:
                dist.barrier()
                row["cp_ms"], row["cp_peak_gib"] = timer(cp_step, args.reps)
                cp.time_collectives, cp.comm_seconds, cp.bytes_received = True, 0.0, 0
                cp_step()
                row["comm_ms"], row["comm_bytes"] = 1e3 * cp.comm_seconds, cp.bytes_received
                cp.time_collectives = False
                view["batch"] = cp.batch(layout)  # a new batch: the count includes making the layout's index tensors
                row["cp_host_syncs"] = count_host_syncs(cp_step, device)
                if args.profile:
                    from hola_titan.profiling import kernel_profile
                    row["cp_profile"] = kernel_profile(cp_step, device=device, timed_ms=row["cp_ms"], iters=2,
                                                       label=f"rank {rank} CP T={t}")
            except torch.OutOfMemoryError:
                row["cp_ms"] = "out of memory"
            del local
        if rank == 0 and not args.no_single:
            full = {n: x[n].clone().requires_grad_() for n in NAMES}
            docs_full = Documents.from_host(torch.tensor(cu_list), device=device, seq_len=t)

            def single_step():
                o, _ = hola_attention(*(full[n] for n in NAMES), documents=docs_full, **kw)
                o.backward(do)
                for n in NAMES:
                    full[n].grad = None

            try:
                row["single_ms"], row["single_peak_gib"] = timer(single_step, args.reps)
                row["single_host_syncs"] = count_host_syncs(single_step, device)
                if args.profile:
                    from hola_titan.profiling import kernel_profile
                    row["single_profile"] = kernel_profile(single_step, device=device, timed_ms=row["single_ms"],
                                                           iters=2, label=f"single T={t}")
            except torch.OutOfMemoryError:
                row["single_ms"] = "out of memory"
            del full
        if isinstance(row.get("cp_ms"), float) and isinstance(row.get("single_ms"), float):
            row["speedup"] = row["single_ms"] / row["cp_ms"]
        if use_cuda:
            torch.cuda.empty_cache()
        if distributed:
            dist.barrier()
        if rank == 0:
            print("row:", json.dumps(row), flush=True)
        rows.append(row)
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
                                        "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
        print(f"\n{'T':>8} {'docs':>5} {'CP ms':>10} {'1 GPU ms':>10} {'speedup':>8} {'comm ms':>9} "
              f"{'comm KiB':>9} {'CP GiB':>8} {'1 GPU GiB':>10} {'CP syncs':>9}")
        for r in rows:
            r = dict(r, comm_kib=r["comm_bytes"] / 1024) if "comm_bytes" in r else r
            print(f"{r['T']:>8} {r['docs']:>5} {_cell(r, 'cp_ms', '{:.2f}'):>10} {_cell(r, 'single_ms', '{:.2f}'):>10} "
                  f"{_cell(r, 'speedup', '{:.2f}x'):>8} {_cell(r, 'comm_ms', '{:.2f}'):>9} "
                  f"{_cell(r, 'comm_kib', '{:.1f}'):>9} {_cell(r, 'cp_peak_gib', '{:.2f}'):>8} "
                  f"{_cell(r, 'single_peak_gib', '{:.2f}'):>10} {_cell(r, 'cp_host_syncs', '{}'):>9}")
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
