"""Predicted tokens/s of every layout of ``scripts/composition_run.py``, from one GPU's committed measurements.

Runs on a CPU in a second; reads only JSON under ``docs/results/`` (``--train-json``, ``--stages-json``,
``--large-json``, optionally ``--collectives-json``) and writes ``<out>/predictions.json`` with a table:

- one GPU's block, head and optimizer times: HOLA 340M compiled at T 2048 x 16 (``bench_train.py``'s row: median
  step, the forward / backward split of the same row, its optimizer), the head per token from the stage timings of
  ``bench_context_parallel.py --predict`` (vocabulary 32000, as bench_train), so a block is (step - head -
  optimizer) / 24; 1.3B from its one-GPU composition row (compiled, full activation checkpointing, T 2048 x 8,
  vocabulary 8192) the same way, with the optimizer scaled by the parameters and the head by width and vocabulary;
  7B from 1.3B's block time per token scaled by the FLOPs of a block (the same MFU assumed). Other lengths: a block
  scales with its FLOPs per token (``hola_titan.flops``); activation checkpointing adds one forward to a backward.
- FSDP2 / HSDP / TP from ``hola_titan.parallelisms.step_model`` (the overlap of the next block's all-gather with
  this block's compute, of reduce-scatters with the backward), with the bytes of each block's parameters (bf16
  all-gather, fp32 reduce-scatter: ``training.mixed_precision_reduce``) at ``--bus-gbps`` (284 GB/s: an NCCL
  all-gather of 1 GiB per rank over NVLink on a lent two-GPU H100 host, issue 54; no JSON of it is committed, so
  ``--collectives-json`` takes ``bench_collectives.py``'s measurement at one block's size when there is one).
- context parallelism from ``hola_titan.parallelisms.critical_path`` (the pipelined protocol's longest path) with
  the continuing shard's extra time measured at 64k tokens per rank, spread over the blocks, then FSDP over
  ``dp_shard x cp`` as above.

The predicted step is of the same batch the composition run trains (its rows per step and micro-batches), and the
speedup is against one GPU reading that batch (accumulating it), as the composition run measures it.

    python scripts/predict_layouts.py --out docs/results/predict_layouts_2026-12-05
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from composition_run import MODES, Layout  # noqa: E402

from hola_titan.parallelisms.critical_path import Stages, message_ms, pipelined_step_ms  # noqa: E402
from hola_titan.parallelisms.step_model import (StepCosts, allreduce_ms, collective_ms, fsdp_step_ms,  # noqa: E402
                                                tensor_parallel_block)

RESULTS = ROOT / "docs" / "results"
TARGETS = {"340M_fsdp2": ("speedup", 1.85), "340M_T64k_cp2": ("speedup", 1.8), "340M_T128k_cp2": ("speedup", 1.8)}
EFFICIENCY_TARGET = 0.85  # issue 55: per-GPU tokens/s at least 85% of one GPU's


@dataclass(frozen=True)
class OneGpu:
    """One GPU's times for a model size, per token of a micro-batch (milliseconds), at the size's reference length."""

    size: str
    seq_len: int
    block_fwd_per_token: float
    block_bwd_per_token: float
    """Without activation checkpointing."""
    head_per_token: float
    optimizer: float
    vocab_size: int
    source: str


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-json", type=Path,
                   default=RESULTS / "hola_gluon_round4_h200_2026-12-04" / "c7_bench_train_default.json")
    p.add_argument("--stages-json", type=Path, nargs="+",
                   default=[RESULTS / "hola_cp_h200_2026-12-03e" / "cp_prefix_tiles.json",
                            RESULTS / "cp_stages_h200_2026-12-02b.json"],
                   help="bench_context_parallel --predict outputs, newest first: the head per token and the "
                        "continuing shard's extra time come from the first that has the length")
    p.add_argument("--large-json", type=Path,
                   default=RESULTS / "composition_2026-11-30" / "call3_1.3B_compile.json")
    p.add_argument("--collectives-json", type=Path, default=None,
                   help="bench_collectives.py output: the bus bandwidths at one block's size replace --bus-gbps")
    p.add_argument("--bus-gbps", type=float, default=284.0, help="collective bus bandwidth, GB/s")
    p.add_argument("--latency-us", type=float, default=20.0, help="latency per ring step or message")
    p.add_argument("--out", type=Path, default=RESULTS / "predict_layouts_2026-12-05")
    return p.parse_args(argv)


def _size_of(layout: Layout) -> str:
    return tomllib.loads((ROOT / "train_configs" / layout.config).read_text())["model"]["size"]


def _margs(size: str, *, vocab_size: int, n_layers: int | None = None):
    from hola_titan.models.args import model_args
    return model_args("hola", size, vocab_size=vocab_size, n_layers=n_layers)


def _block_flops(size: str, seq_len: int) -> float:
    """Training FLOPs per token of one block (the head's taken out)."""
    from hola_titan.flops import flops_per_token
    args = _margs(size, vocab_size=8192)
    head = 3 * 2.0 * args.vocab_size * args.dim
    return (flops_per_token(args, seq_len)["total"] - head) / args.n_layers


def _param_counts(size: str, *, vocab_size: int) -> tuple[int, int]:
    """Parameters of one block and of the root (embedding, final norm; the head is tied), from the model itself."""
    from hola_titan.models.model import build_model
    model = build_model(_margs(size, vocab_size=vocab_size, n_layers=1), device="meta")
    block = sum(p.numel() for p in model.layers["0"].parameters())
    return block, sum(p.numel() for p in model.parameters()) - block


def _stages_at(paths: list[Path], tokens: int) -> tuple[dict, str]:
    """The stage timings at ``tokens`` per rank from the first file that has them, else the nearest length of the
    first file."""
    for path in paths:
        timings = json.loads(path.read_text())["timings"]
        if str(tokens) in timings:
            return timings[str(tokens)], f"{path.relative_to(ROOT)} at {tokens}"
    timings = json.loads(paths[0].read_text())["timings"]
    nearest = min(timings, key=lambda k: abs(int(k) - tokens))
    return timings[nearest], f"{paths[0].relative_to(ROOT)} at {nearest} (nearest to {tokens})"


def one_gpu_measurements(args) -> dict[str, OneGpu]:
    rows = json.loads(args.train_json.read_text())
    row = next(r for r in rows if r["flavour"] == "hola" and r["seq_len"] == 2048 and r["batch_size"] == 16)
    stages, stages_from = _stages_at(args.stages_json, 65536)
    head_per_token = stages["head"] / 65536
    tokens = row["seq_len"] * row["batch_size"]
    step, opt = row["step_ms_median"], row["optimizer_ms"]
    blocks = (step - head_per_token * tokens - opt) / 24
    fwd_share = row["forward_ms"] / (row["forward_ms"] + row["backward_ms"])
    m340 = OneGpu("340M", 2048, fwd_share * blocks / tokens, (1 - fwd_share) * blocks / tokens, head_per_token, opt,
                  32000, f"{args.train_json.relative_to(ROOT)} (hola, T 2048 x 16: median step {step:.1f} ms, "
                         f"forward {row['forward_ms']:.1f}, backward {row['backward_ms']:.1f}, optimizer {opt:.1f}); "
                         f"head {stages['head']:.2f} ms per 65536 tokens from {stages_from}")
    large = json.loads(args.large_json.read_text())
    entry = next(e for e in large["layouts"] if e["layout"] == "1.3B_1gpu_compile")
    tokens13 = 2048 * 8
    step13 = tokens13 / entry["tokens_per_s"] * 1e3
    b340, r340 = _param_counts("340M", vocab_size=32000)
    b13, r13 = _param_counts("1.3B", vocab_size=8192)
    opt13 = opt * (24 * b13 + r13) / (24 * b340 + r340)
    head13 = head_per_token * (2048 / 1024) * (8192 / 32000)
    # Its blocks ran with full activation checkpointing: forward f, backward b + f, in 340M's proportion of f to b.
    blocks13 = (step13 - head13 * tokens13 - opt13) / 24 / tokens13
    f13 = blocks13 * fwd_share / (1 + fwd_share)
    m13 = OneGpu("1.3B", 2048, f13, blocks13 - 2 * f13, head13, opt13, 8192,
                 f"{args.large_json.relative_to(ROOT)} (1.3B_1gpu_compile: {entry['tokens_per_s']:,.0f} tokens/s at "
                 f"T 2048 x 8, AC full: step {step13:.1f} ms); optimizer and head scaled from 340M")
    b7, r7 = _param_counts("7B", vocab_size=8192)
    scale = _block_flops("7B", 2048) / _block_flops("1.3B", 2048)
    m7 = OneGpu("7B", 2048, m13.block_fwd_per_token * scale, m13.block_bwd_per_token * scale, head13 * 2,
                opt13 * (32 * b7 + r7) / (24 * b13 + r13), 8192,
                f"1.3B's block time per token x {scale:.2f} (a 7B block's FLOPs over a 1.3B block's at T 2048)")
    return {m.size: m for m in (m340, m13, m7)}


def _bandwidths(args, block_bytes_bf16: int) -> tuple[float, float, str]:
    """All-gather and reduce-scatter bus bandwidths (GB/s) and where they come from."""
    if args.collectives_json is None:
        return args.bus_gbps, args.bus_gbps, f"--bus-gbps {args.bus_gbps:g} (issue 54: all-gather of 1 GiB per rank)"
    rows = json.loads(args.collectives_json.read_text())["rows"]

    def nearest(name: str, nbytes: int) -> float:
        of = [r for r in rows if r["collective"] == name]
        return min(of, key=lambda r: abs(r["bytes"] - nbytes))["bus_gb_s"]

    return (nearest("all_gather bf16", block_bytes_bf16), nearest("reduce_scatter fp32", 2 * block_bytes_bf16),
            f"{args.collectives_json} at the size nearest one block")


def predict(layout: Layout, gpu: OneGpu, args) -> dict:
    """The layout's step, tokens/s, speedup and per-GPU efficiency against one GPU reading the same batch."""
    replicate, shard, cp, tp = layout.degrees
    size = gpu.size
    flags = layout.flags
    ac = "--activation_checkpoint.mode" in flags and flags[flags.index("--activation_checkpoint.mode") + 1] != "none"
    margs = _margs(size, vocab_size=8192)
    layers = margs.n_layers
    scale = _block_flops(size, layout.seq_len) / _block_flops(size, gpu.seq_len)
    # Tokens of one rank's micro-batch, and the micro-batches of a step.
    dp = replicate * shard
    tokens = layout.local_batch * layout.seq_len // cp
    micro = layout.global_batch // (layout.local_batch * dp)
    fwd = gpu.block_fwd_per_token * scale * tokens
    bwd = gpu.block_bwd_per_token * scale * tokens + (fwd if ac else 0.0)
    head = gpu.head_per_token * tokens
    bus = dict(latency_us=args.latency_us)
    block_params, root_params = _param_counts(size, vocab_size=8192)
    ag_gbps, rs_gbps, bw_from = _bandwidths(args, 2 * block_params)
    fwd, bwd = tensor_parallel_block(fwd, bwd, tp=tp, activation_bytes=tokens * margs.dim * 2, bus_gbps=ag_gbps,
                                     latency_us=args.latency_us)  # exposed: inside the block's time
    head /= tp
    if cp > 1:
        # The pipelined protocol's path through this rank's blocks, spread evenly over them.
        stages64, _ = _stages_at(args.stages_json, 65536)
        from hola_titan.parallelisms.context_parallel import message_bytes
        sizes = message_bytes(rows=layout.local_batch, conv_size=margs.conv_size, heads=margs.n_heads // tp,
                              head_dim=margs.head_dim, window=margs.window, block=margs.block, evict=margs.evict,
                              crossing=layout.local_batch)
        cont_f = stages64["layer_fwd_cont"] / stages64["layer_fwd_fresh"]
        cont_b = stages64["layer_bwd_cont"] / stages64["layer_bwd_fresh"]
        st = Stages(layer_fwd_fresh=fwd, layer_bwd_fresh=bwd, layer_fwd_cont=fwd * cont_f,
                    layer_bwd_cont=bwd * cont_b, head=head, optimizer=0.0,
                    message=sum(message_ms(s, bandwidth_gbps=ag_gbps, latency_us=args.latency_us) for s in sizes if s),
                    allreduce=0.0)
        path = pipelined_step_ms(st, num_layers=layers, ranks=cp) - head
        fwd, bwd = path * fwd / (fwd + bwd) / layers, path * bwd / (fwd + bwd) / layers
    group = shard * cp if shard * cp > 1 else replicate  # replicate-only HSDP shards over the replicas
    rep = replicate if shard * cp > 1 else 1
    per_rank_block = 2 * block_params / tp  # bf16 bytes of this TP rank's part of a block
    per_rank_root = 2 * root_params / tp
    costs = StepCosts(
        block_fwd=fwd, block_bwd=bwd, head=head, optimizer=gpu.optimizer / (group * tp),
        gather=collective_ms(per_rank_block, ranks=group, bus_gbps=ag_gbps, **bus),
        scatter=collective_ms(2 * per_rank_block, ranks=group, bus_gbps=rs_gbps, **bus),
        replicate=allreduce_ms(2 * per_rank_block / group, ranks=rep, bus_gbps=rs_gbps, **bus),
        root_gather=collective_ms(per_rank_root, ranks=group, bus_gbps=ag_gbps, **bus),
        root_scatter=collective_ms(2 * per_rank_root, ranks=group, bus_gbps=rs_gbps, **bus),
        root_replicate=allreduce_ms(2 * per_rank_root / group, ranks=rep, bus_gbps=rs_gbps, **bus))
    step = fsdp_step_ms(costs, num_layers=layers, microbatches=micro)
    # One GPU reading the same batch: every rank's rows one after another, nothing gathered.
    one_tokens = layout.local_batch * layout.seq_len
    one_fwd = gpu.block_fwd_per_token * scale * one_tokens
    one = StepCosts(block_fwd=one_fwd, block_bwd=gpu.block_bwd_per_token * scale * one_tokens + (one_fwd if ac else 0),
                    head=gpu.head_per_token * one_tokens, optimizer=gpu.optimizer)
    one_step = fsdp_step_ms(one, num_layers=layers, microbatches=layout.global_batch // layout.local_batch)
    step_tokens = layout.global_batch * layout.seq_len
    speedup = one_step / step
    return dict(layout=layout.name, world_size=layout.nproc, size=size, seq_len=layout.seq_len,
                degrees=dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), layout.degrees)),
                rows_per_step=layout.global_batch, microbatches=micro, activation_checkpointing=ac,
                tokens_per_s=step_tokens / step * 1e3, one_gpu_tokens_per_s=step_tokens / one_step * 1e3,
                speedup=speedup, per_gpu_efficiency=speedup / layout.nproc, step_ms=step, one_gpu_step_ms=one_step,
                exposed_ms=step - (micro * (layers * (costs.block_fwd + costs.block_bwd) + costs.head)
                                   + costs.optimizer),
                tp_collectives_ms_per_block=8 * collective_ms(tokens * margs.dim * 2, ranks=tp, bus_gbps=ag_gbps,
                                                              **bus),
                costs=asdict(costs), bandwidth_from=bw_from, one_gpu_from=gpu.source)


def main(argv=None) -> int:
    args = parse_args(argv)
    gpus = one_gpu_measurements(args)
    rows = []
    for mode, make in MODES.items():
        for layout in make():
            if layout.nproc == 1 or "--float8.enable" in layout.flags:
                continue  # one-GPU rows are the baselines; float8 has no model here
            if any(r["layout"] == layout.name for r in rows):
                continue  # shared by the four- and eight-GPU modes
            row = predict(layout, gpus[_size_of(layout)], args)
            row["mode"] = mode
            kind, target = TARGETS.get(layout.name, ("per_gpu_efficiency", EFFICIENCY_TARGET))
            row.update(target_key=kind, target=target, meets_target=row[kind] >= target)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    assumptions = ("compute divides by tp and cp without loss of kernel efficiency; the host never lags the GPU; "
                   "collectives run one after another on one link, in FSDP2's issue order; TP's sequence-parallel "
                   "collectives are exposed; a block's time scales with its FLOPs per token")
    (args.out / "predictions.json").write_text(json.dumps(
        {"date": "2026-12-05", "inputs": {"one_gpu": {k: asdict(v) for k, v in gpus.items()},
                                          "bus_gbps": args.bus_gbps, "latency_us": args.latency_us},
         "assumptions": assumptions, "rows": rows}, indent=1) + "\n")
    print("| layout | GPUs | predicted tokens/s | one GPU | speedup | per-GPU efficiency | exposed ms/step | target |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        target = f"{r['target_key'].replace('_', ' ')} >= {r['target']:g}: {'met' if r['meets_target'] else 'missed'}"
        print(f"| {r['layout']} | {r['world_size']} | {r['tokens_per_s']:,.0f} | {r['one_gpu_tokens_per_s']:,.0f} | "
              f"{r['speedup']:.2f}x | {100 * r['per_gpu_efficiency']:.1f}% | {r['exposed_ms']:.1f} | {target} |")
    print(f"assumptions: {assumptions}")
    for size, gpu in gpus.items():
        print(f"one GPU {size}: {gpu.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
