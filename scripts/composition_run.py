"""Composition run: several parallel layouts of one model through ``run_train.sh``, compared with a smaller layout.

GPU mode (the issue's run; needs 4 and 8 GPUs):
    python scripts/composition_run.py --mode gpu --out outputs/composition
runs, 50 steps each, the 1.3B HOLA at T = 8192 with FSDP 2 x TP 2 (4 GPUs) and FSDP 2 x TP 2 x CP 2 (8 GPUs), the
7B HOLA with FSDP 8 at T = 4096, and the smaller layouts they are compared with (1.3B on 1 and 2 GPUs, same seed).
Two-GPU mode (FSDP, float8, activation checkpointing, compile and context parallelism on one and two GPUs):
    python scripts/composition_run.py --mode gpu2 --out outputs/two_gpu
runs HOLA 340M at T = 2048 on one GPU in bf16, float8, with full activation checkpointing and with compile, and
with FSDP 2 (weak scaling: 16 rows per GPU); HOLA 1.3B in bf16 and float8 on one GPU; and HOLA 340M at T = 32k,
64k and 128k with CP 2 against one GPU (activation checkpointing on). Data and tokenizer are the bundled ones, so
it runs on a machine without a network; the vocabulary (8192) is smaller than the papers' 32k.
CPU mode (gloo, the debug model; what a machine without GPUs can check):
    python scripts/composition_run.py --mode cpu --out outputs/composition_cpu
runs the same layouts at 1, 4 and 8 processes.

Prints a table (tokens/s, per-device tokens/s, MFU, peak memory, first losses against the reference layout) and a
scaling-efficiency table, and writes both to ``<out>/composition.json``. The first-10-loss parity bound is 0.5%
relative (bf16 on GPU); on CPU (fp32) the losses agree to rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Layout:
    name: str
    nproc: int
    config: str
    overrides: list[str]
    reference: str | None = None  # layout whose first losses this one must reproduce
    baseline: str | None = None  # one-process layout its per-device throughput is compared with
    rows: list[dict] = field(default_factory=list)


def _degrees(shard: int, tp: int = 1, cp: int = 1) -> list[str]:
    return ["--parallelism.data_parallel_shard_degree", str(shard), "--parallelism.tensor_parallel_degree", str(tp),
            "--parallelism.context_parallel_degree", str(cp)]


def gpu_layouts(steps: int) -> list[Layout]:
    common = ["--training.steps", str(steps), "--metrics.log_freq", "1", "--validation.enable", "false",
              "--checkpoint.enable", "false", "--training.seed", "0", "--activation_checkpoint.mode", "full"]
    b13 = str(ROOT / "train_configs" / "hola_1.3B.toml")
    b7 = str(ROOT / "train_configs" / "hola_7B.toml")
    t8k = ["--training.seq_len", "8192", "--training.local_batch_size", "1", "--training.global_batch_size", "8"]
    t4k = ["--training.seq_len", "4096", "--training.local_batch_size", "1", "--training.global_batch_size", "8"]
    return [
        Layout("1.3B_1gpu", 1, b13, [*common, *t8k, *_degrees(1)]),
        Layout("1.3B_fsdp2", 2, b13, [*common, *t8k, *_degrees(2)], reference="1.3B_1gpu"),
        Layout("1.3B_fsdp2_tp2", 4, b13, [*common, *t8k, *_degrees(2, 2)], reference="1.3B_1gpu"),
        Layout("1.3B_fsdp2_tp2_cp2", 8, b13, [*common, *t8k, *_degrees(2, 2, 2)], reference="1.3B_1gpu"),
        Layout("7B_fsdp8", 8, b7, [*common, *t4k, *_degrees(8)]),
    ]


def gpu2_layouts(steps: int) -> list[Layout]:
    common = ["--training.steps", str(steps), "--metrics.log_freq", "1", "--validation.enable", "false",
              "--checkpoint.enable", "false", "--training.seed", "0", "--model.tokenizer_path", "bundled",
              "--data.dataset", "bundled", "--metrics.enable_tensorboard", "false"]
    m340 = str(ROOT / "train_configs" / "hola_340M.toml")
    b13 = str(ROOT / "train_configs" / "hola_1.3B.toml")

    def rows(t: int, local: int, world: int) -> list[str]:
        return ["--training.seq_len", str(t), "--training.local_batch_size", str(local),
                "--training.global_batch_size", str(local * world)]

    ac = ["--activation_checkpoint.mode", "full"]
    layouts = [
        Layout("340M_1gpu", 1, m340, [*common, *rows(2048, 16, 1), *_degrees(1)]),
        Layout("340M_1gpu_float8", 1, m340, [*common, *rows(2048, 16, 1), *_degrees(1), "--float8.enable"],
               baseline="340M_1gpu"),
        Layout("340M_1gpu_ac", 1, m340, [*common, *rows(2048, 16, 1), *_degrees(1), *ac], baseline="340M_1gpu"),
        Layout("340M_1gpu_compile", 1, m340, [*common, *rows(2048, 16, 1), *_degrees(1), "--compile.enable"],
               baseline="340M_1gpu"),
        Layout("340M_fsdp2", 2, m340, [*common, *rows(2048, 16, 2), *_degrees(2)], baseline="340M_1gpu"),
        # Eager steps are partly bound by the host launching kernels (bench_train --profile: 478 ms of kernels in a
        # 696 ms step), and FSDP adds host work per block; compiled, the step is the GPU's.
        Layout("340M_fsdp2_compile", 2, m340, [*common, *rows(2048, 16, 2), *_degrees(2), "--compile.enable"],
               baseline="340M_1gpu_compile"),
        # torchao's float8 casts and scales are separate kernels unless compiled (measured: 0.52x of bf16 eager
        # at 340M), so float8 is also compared with compile on both sides.
        Layout("340M_1gpu_compile_float8", 1, m340,
               [*common, *rows(2048, 16, 1), *_degrees(1), "--compile.enable", "--float8.enable"],
               baseline="340M_1gpu_compile"),
        Layout("1.3B_1gpu", 1, b13, [*common, *rows(2048, 8, 1), *_degrees(1)]),
        Layout("1.3B_1gpu_float8", 1, b13, [*common, *rows(2048, 8, 1), *_degrees(1), "--float8.enable"],
               baseline="1.3B_1gpu"),
        Layout("1.3B_1gpu_compile", 1, b13, [*common, *rows(2048, 8, 1), *_degrees(1), "--compile.enable"],
               baseline="1.3B_1gpu"),
        Layout("1.3B_1gpu_compile_float8", 1, b13,
               [*common, *rows(2048, 8, 1), *_degrees(1), "--compile.enable", "--float8.enable"],
               baseline="1.3B_1gpu_compile"),
    ]
    for t in (32768, 65536, 131072):
        single, cp2 = f"340M_T{t // 1024}k_1gpu", f"340M_T{t // 1024}k_cp2"
        layouts += [Layout(single, 1, m340, [*common, *rows(t, 1, 1), *_degrees(1), *ac]),
                    Layout(cp2, 2, m340, [*common, *rows(t, 1, 1), *_degrees(1, 1, 2), *ac], reference=single,
                           baseline=single)]
    # Compiled blocks around the eager handover of state and cache (compile.fullgraph must be false under CP).
    compiled = ["--compile.enable", "--compile.fullgraph", "false"]
    layouts += [Layout("340M_T64k_1gpu_compile", 1, m340, [*common, *rows(65536, 1, 1), *_degrees(1), *ac, *compiled],
                       baseline="340M_T64k_1gpu"),
                Layout("340M_T64k_cp2_compile", 2, m340, [*common, *rows(65536, 1, 1), *_degrees(1, 1, 2), *ac,
                                                          *compiled],
                       reference="340M_T64k_1gpu_compile", baseline="340M_T64k_1gpu_compile")]
    return layouts


def cpu_layouts(steps: int) -> list[Layout]:
    common = ["--training.steps", str(steps), "--metrics.log_freq", "1", "--validation.enable", "false",
              "--checkpoint.enable", "false", "--training.seed", "0", "--training.seq_len", "128",
              "--training.local_batch_size", "2", "--training.global_batch_size", "4", "--training.device", "cpu",
              "--metrics.enable_tensorboard", "false"]
    debug = str(ROOT / "train_configs" / "debug_model.toml")
    return [
        Layout("debug_1proc", 1, debug, [*common, *_degrees(1)]),
        Layout("debug_fsdp2_tp2", 4, debug, [*common, *_degrees(2, 2)], reference="debug_1proc"),
        Layout("debug_fsdp2_tp2_cp2", 8, debug, [*common, *_degrees(2, 2, 2)], reference="debug_1proc"),
        Layout("debug_fsdp8", 8, debug, [*common, "--training.global_batch_size", "16", *_degrees(8)]),
    ]


def run(layout: Layout, out: Path) -> None:
    folder = out / layout.name
    env = dict(os.environ, NGPU=str(layout.nproc), CONFIG_FILE=layout.config, PYTHON=sys.executable)
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(folder), *layout.overrides]
    print(f"== {layout.name}: {layout.nproc} processes", flush=True)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out / f"{layout.name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        print(f"   failed (exit {result.returncode}); log: {out / (layout.name + '.log')}", flush=True)
        return
    read_metrics(layout, folder / "metrics.jsonl")


def read_metrics(layout: Layout, metrics: Path) -> None:
    """The training rows (those with a loss) of a run's ``metrics.jsonl``; none when it does not exist."""
    if metrics.is_file():
        layout.rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]


def summarise(layouts: list[Layout], parity_bound: float) -> dict:
    by_name = {layout.name: layout for layout in layouts}
    table = []
    for layout in layouts:
        if not layout.rows:
            table.append({"layout": layout.name, "processes": layout.nproc, "status": "failed or not run"})
            continue
        timed = layout.rows[2:] or layout.rows  # the first steps include compilation and warm-up
        tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
        entry = {"layout": layout.name, "processes": layout.nproc, "tokens_per_s": tps,
                 "tokens_per_s_per_device": tps / layout.nproc,
                 "mfu": sum(r["mfu"] for r in timed) / len(timed),
                 "memory_gib": max(r["memory_gib"] for r in layout.rows),
                 "first_losses": [r["loss"] for r in layout.rows[:10]]}
        ref = by_name.get(layout.reference) if layout.reference else None
        if ref is not None and ref.rows:
            pairs = list(zip(entry["first_losses"], [r["loss"] for r in ref.rows[:10]]))
            worst = max(abs(a - b) / abs(b) for a, b in pairs)
            entry["loss_parity_vs"] = ref.name
            entry["loss_max_rel_diff"] = worst
            entry["loss_parity_ok"] = worst <= parity_bound
        table.append(entry)
    named = {e["layout"]: e for e in table if "tokens_per_s" in e}
    scaling = []
    for entry, layout in zip(table, layouts):
        # Scaling is against a declared baseline, else against the parity reference of a multi-process layout.
        base_name = layout.baseline or (layout.reference if layout.nproc > 1 else None)
        base = named.get(base_name) if base_name else None
        if base is not None and base is not entry and "tokens_per_s" in entry:
            scaling.append({"layout": entry["layout"], "processes": entry["processes"], "baseline": base["layout"],
                            "per_device_vs_1": entry["tokens_per_s_per_device"] / base["tokens_per_s_per_device"],
                            "total_vs_1": entry["tokens_per_s"] / base["tokens_per_s"]})
    return {"layouts": table, "scaling": scaling}


def print_tables(summary: dict) -> None:
    print("\n| layout | procs | tokens/s | tokens/s/device | MFU | peak GiB | loss max rel diff |")
    print("|---|---|---|---|---|---|---|")
    for e in summary["layouts"]:
        if "tokens_per_s" not in e:
            print(f"| {e['layout']} | {e['processes']} | {e['status']} | | | | |")
            continue
        parity = f"{e['loss_max_rel_diff']:.2e} vs {e['loss_parity_vs']}" if "loss_max_rel_diff" in e else "-"
        print(f"| {e['layout']} | {e['processes']} | {e['tokens_per_s']:,.0f} | {e['tokens_per_s_per_device']:,.0f} "
              f"| {100 * e['mfu']:.1f}% | {e['memory_gib']:.2f} | {parity} |")
    print("\n| layout | procs | baseline | tokens/s vs baseline | per-device vs baseline |")
    print("|---|---|---|---|---|")
    for s in summary["scaling"]:
        print(f"| {s['layout']} | {s['processes']} | {s['baseline']} | {s['total_vs_1']:.2f}x "
              f"| {100 * s['per_device_vs_1']:.1f}% |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("gpu", "gpu2", "cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=None, help="steps per layout (default: 50 GPU, 4 CPU)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these layout names")
    parser.add_argument("--summarise-only", action="store_true",
                        help="run nothing: tabulate the layouts whose <out>/<layout>/metrics.jsonl exist (runs made "
                             "by several calls, e.g. on machines lent for a limited time)")
    args = parser.parse_args()
    steps = args.steps or (50 if args.mode == "gpu" else 4)
    layouts = {"gpu": gpu_layouts, "gpu2": gpu2_layouts, "cpu": cpu_layouts}[args.mode](steps)
    if args.only:
        unknown = set(args.only) - {layout.name for layout in layouts}
        if unknown:
            parser.error(f"--only: unknown layouts {sorted(unknown)}")
        layouts = [layout for layout in layouts if layout.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    bound = 1e-5 if args.mode == "cpu" else 0.005
    if args.summarise_only:
        for layout in layouts:
            read_metrics(layout, args.out / layout.name / "metrics.jsonl")
        layouts = [layout for layout in layouts if layout.rows]
        if not layouts:
            parser.error(f"--summarise-only: no <layout>/metrics.jsonl under {args.out}")
    summary = None
    for layout in layouts:
        if not args.summarise_only:
            run(layout, args.out)
        # Rewritten after every layout, so that a run cut short by a time limit keeps what finished.
        summary = summarise(layouts, parity_bound=bound)
        summary["mode"] = args.mode
        (args.out / "composition.json").write_text(json.dumps(summary, indent=1))
    print_tables(summary)
    return 0 if all(e.get("loss_parity_ok", True) for e in summary["layouts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
