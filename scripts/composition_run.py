"""Composition run: parallel layouts of one model through ``run_train.sh``, each against one GPU at the same batch.

One command per kind of machine, each fitting 8 minutes (``--budget-s``, default 470 s on GPUs): layouts run in the
order below (the most important first), each under its own time limit, and ``<out>/composition.json`` is rewritten
after every layout, so a call cut short keeps what finished. Layouts left out by the budget are named at the end
with the command that runs them; rows already in ``<out>`` (an earlier call on the same machine) serve as baselines,
and a finished layout is not run again: repeating the command goes on where the last call stopped.

    python scripts/composition_run.py --mode gpu2 --out outputs/two_gpu      # nvidia-h100-x2 / nvidia-h200-x2
    python scripts/composition_run.py --mode gpu4 --out outputs/four_gpu     # nvidia-h100-x4 / nvidia-h200-x4
    python scripts/composition_run.py --mode gpu8 --out outputs/eight_gpu    # nvidia-h100-x8 / nvidia-h200-x8
    python scripts/composition_run.py --mode gpu8 --tiny --out outputs/cpu8  # the same degrees on CPU (gloo)

``gpu2`` (issue 54): HOLA 340M at T 2048, 16 rows per GPU, compiled: one GPU, FSDP 2 (weak scaling), HSDP 2 and
TP 2; T 64k and 128k on one GPU against CP 2; float8 against bf16 at 1.3B width on one GPU; the longest sequences
over CP 2 (256k, 512k). ``gpu4`` / ``gpu8`` (issue 55): HOLA 1.3B at T 8192, one row per data-parallel rank,
activation checkpointing, compiled: one GPU, FSDP 4, FSDP 2 x TP 2 (x4); FSDP 8, FSDP 2 x TP 2 x CP 2, FSDP 4 x CP
2, HSDP 2 x 4 (x8); 7B with FSDP 8, against the 7B width with 4 layers on one GPU (FLOPs-scaled to 32 layers), and
that width in float8. Every layout of a model reads the same global batch (the one-GPU row accumulates it), so
its losses are compared with the one-GPU run's (bound 0.5% relative, bf16) besides its speed. Data and tokenizer
are the bundled ones (vocabulary 8192), so it runs without a network.

``--tiny`` runs the same layouts (same degrees, accumulation and checkpointing) on the CPU with gloo, with the
debug model's widths (depth kept for the 7B-width rows' 4 layers), eager and in float32 (float8 rows are left out):
what a machine without GPUs can check; losses must agree to 1e-5.

Each row of the JSON records ``layout``, ``world_size``, ``tokens_per_s``, ``speedup`` (tokens/s over its
baseline's: one GPU, same rows per data-parallel rank) and ``per_gpu_efficiency`` (speedup x baseline GPUs /
GPUs), with MFU, peak memory and the first losses against its parity reference. ``scripts/predict_layouts.py``
predicts the same rows from one GPU's measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "train_configs"


@dataclass
class Layout:
    """One run: a model config, its batch and parallel degrees, and what it is compared with."""

    name: str
    config: str
    """TOML under ``train_configs/``."""
    seq_len: int
    local_batch: int
    """Rows per data-parallel rank and micro-batch."""
    global_batch: int
    degrees: tuple[int, int, int, int] = (1, 1, 1, 1)
    """``(dp_replicate, dp_shard, cp, tp)``."""
    flags: list[str] = field(default_factory=list)
    """Further overrides (compile, activation checkpointing, float8, depth)."""
    reference: str | None = None
    """Layout whose first losses this one must reproduce."""
    baseline: str | None = None
    """Layout its tokens/s is compared with (one GPU at the same rows per data-parallel rank)."""
    baseline_scale: float = 1.0
    """Factor on the baseline's tokens/s (a shallower stand-in for a model one GPU cannot hold: its FLOPs per
    token over this model's)."""
    timeout_s: int = 90
    steps: int | None = None
    """Steps of this layout (default: ``--steps``)."""
    rows: list[dict] = field(default_factory=list)
    status: str = "not run"

    @property
    def nproc(self) -> int:
        replicate, shard, cp, tp = self.degrees
        return replicate * shard * cp * tp

    def config_path(self, *, tiny: bool) -> Path:
        return CONFIGS / ("debug_model.toml" if tiny else self.config)

    def overrides(self, *, steps: int, tiny: bool) -> list[str]:
        """The trainer's command-line overrides of ``config_path`` for this layout."""
        replicate, shard, cp, tp = self.degrees
        # The debug model's steps take milliseconds: --tiny runs --steps, the GPU rows their own count.
        run = ["--training.steps", str(steps if tiny else (self.steps or steps)), "--metrics.log_freq", "1",
               "--validation.enable", "false", "--checkpoint.enable", "false", "--training.seed", "0",
               "--metrics.enable_tensorboard", "false", "--parallelism.data_parallel_replicate_degree", str(replicate),
               "--parallelism.data_parallel_shard_degree", str(shard), "--parallelism.context_parallel_degree",
               str(cp), "--parallelism.tensor_parallel_degree", str(tp),
               "--training.local_batch_size", str(self.local_batch),
               "--training.global_batch_size", str(self.global_batch)]
        if tiny:
            # The debug model's widths at the same degrees; 128 tokens (whole cache blocks on up to 4 CP ranks) for all.
            flags = _pairs(self.flags, keep=("--activation_checkpoint.mode", "--model.n_layers"))
            return [*run, "--training.seq_len", "128", "--training.device", "cpu", *flags]
        return [*run, "--training.seq_len", str(self.seq_len),
                "--model.tokenizer_path", "bundled", "--model.vocab_size", "8192", "--data.dataset", "bundled",
                *self.flags]


def _pairs(flags: list[str], *, keep: tuple[str, ...]) -> list[str]:
    """The ``--key value`` pairs of ``flags`` whose key is in ``keep`` (bare flags such as ``--compile.enable`` are
    single items and never kept)."""
    out = []
    for i, flag in enumerate(flags):
        if flag in keep:
            out += [flag, flags[i + 1]]
    return out


COMPILE = ["--compile.enable"]
# Context parallelism hands state and cache over between compiled parts of each block (docs/training.md).
COMPILE_CP = ["--compile.enable", "--compile.fullgraph", "false"]
AC = ["--activation_checkpoint.mode", "full"]


def gpu2_layouts() -> list[Layout]:
    """Issue 54's rows, most important first (module docstring)."""
    m340, b13 = "hola_340M.toml", "hola_1.3B.toml"
    # 32 rows per step everywhere: 16 per GPU and micro-batch (the one GPU and TP 2 accumulate two), so that every
    # layout trains on the same batches as the one GPU and its losses can be compared.
    short = dict(config=m340, seq_len=2048, local_batch=16, global_batch=32)
    layouts = [
        Layout("340M_1gpu", **short, flags=COMPILE, timeout_s=110),
        Layout("340M_fsdp2", **short, degrees=(1, 2, 1, 1), flags=COMPILE, reference="340M_1gpu",
               baseline="340M_1gpu", timeout_s=90),
    ]
    for t, steps in ((65536, 10), (131072, 6)):
        single, cp2 = f"340M_T{t // 1024}k_1gpu", f"340M_T{t // 1024}k_cp2"
        long = dict(config=m340, seq_len=t, local_batch=1, global_batch=1, steps=steps)
        layouts += [Layout(single, **long, flags=[*AC, *COMPILE_CP], timeout_s=90),
                    Layout(cp2, **long, degrees=(1, 1, 2, 1), flags=[*AC, *COMPILE_CP], reference=single,
                           baseline=single, timeout_s=90)]
        if t == 65536:  # the data-parallel alternatives to FSDP come before the second length
            layouts += [Layout("340M_hsdp2", **short, degrees=(2, 1, 1, 1), flags=COMPILE, reference="340M_1gpu",
                               baseline="340M_1gpu", timeout_s=80),
                        Layout("340M_tp2", **short, degrees=(1, 1, 1, 2), flags=COMPILE, reference="340M_1gpu",
                               baseline="340M_1gpu", timeout_s=80)]
    # torchao's float8 casts are separate kernels unless compiled: bf16 and float8 both compiled.
    wide = dict(config=b13, seq_len=2048, local_batch=8, global_batch=8, steps=12)
    layouts += [Layout("1.3B_1gpu", **wide, flags=COMPILE, timeout_s=100),
                Layout("1.3B_1gpu_float8", **wide, flags=[*COMPILE, "--float8.enable"], baseline="1.3B_1gpu",
                       timeout_s=100)]
    # The longest sequences: 3 steps each, no one-GPU row (it would not fit); what counts is that they train.
    layouts += [Layout(f"340M_T{t // 1024}k_cp2", config=m340, seq_len=t, local_batch=1, global_batch=1,
                       degrees=(1, 1, 2, 1), flags=[*AC, *COMPILE_CP], steps=3, timeout_s=150)
                for t in (262144, 524288)]
    return layouts


def gpu4_layouts() -> list[Layout]:
    return [layout for layout in _large_layouts() if layout.name in ("1.3B_1gpu", "1.3B_fsdp4", "1.3B_fsdp2_tp2")]


def gpu8_layouts() -> list[Layout]:
    return [layout for layout in _large_layouts() if layout.name not in ("1.3B_fsdp4", "1.3B_fsdp2_tp2")]


def _large_layouts() -> list[Layout]:
    """Issue 55's rows: 1.3B and 7B at T 8192, one row per data-parallel rank and micro-batch, 8 rows per step
    (every layout reads the same batches; fewer data-parallel ranks accumulate)."""
    base = dict(config="hola_1.3B.toml", seq_len=8192, local_batch=1, global_batch=8, steps=12)
    compare = dict(reference="1.3B_1gpu", baseline="1.3B_1gpu")
    layouts = [Layout("1.3B_1gpu", **base, flags=[*AC, *COMPILE], timeout_s=150),
               Layout("1.3B_fsdp4", **base, degrees=(1, 4, 1, 1), flags=[*AC, *COMPILE], **compare),
               Layout("1.3B_fsdp2_tp2", **base, degrees=(1, 2, 1, 2), flags=[*AC, *COMPILE], **compare,
                      timeout_s=120),
               Layout("1.3B_fsdp8", **base, degrees=(1, 8, 1, 1), flags=[*AC, *COMPILE], **compare),
               Layout("1.3B_fsdp2_tp2_cp2", **base, degrees=(1, 2, 2, 2), flags=[*AC, *COMPILE_CP], **compare,
                      timeout_s=120),
               Layout("1.3B_fsdp4_cp2", **base, degrees=(1, 4, 2, 1), flags=[*AC, *COMPILE_CP], **compare),
               Layout("1.3B_hsdp2x4", **base, degrees=(2, 4, 1, 1), flags=[*AC, *COMPILE], **compare)]
    # 7B does not fit one GPU; its width with 4 of its 32 layers does, and stands for it scaled by FLOPs per token.
    wide = dict(config="hola_7B.toml", seq_len=8192, local_batch=1, global_batch=8, steps=10)
    shallow = ["--model.n_layers", "4", *AC, *COMPILE]
    layouts += [Layout("7B_w4_1gpu", **wide, flags=shallow, timeout_s=150),
                Layout("7B_fsdp8", **wide, degrees=(1, 8, 1, 1), flags=[*AC, *COMPILE], baseline="7B_w4_1gpu",
                       baseline_scale=_flops_ratio("7B", shallow=4, seq_len=8192), timeout_s=180),
                Layout("7B_w4_1gpu_float8", **wide, flags=[*shallow, "--float8.enable"], baseline="7B_w4_1gpu",
                       timeout_s=150)]
    return layouts


def _flops_ratio(size: str, *, shallow: int, seq_len: int) -> float:
    """Training FLOPs per token of ``size`` with ``shallow`` layers over those of the whole depth."""
    from hola_titan.flops import flops_per_token
    from hola_titan.models.args import model_args

    whole = model_args("hola", size, vocab_size=8192)
    part = model_args("hola", size, vocab_size=8192, n_layers=shallow)
    return flops_per_token(part, seq_len)["total"] / flops_per_token(whole, seq_len)["total"]


MODES = {"gpu2": gpu2_layouts, "gpu4": gpu4_layouts, "gpu8": gpu8_layouts}


def run(layout: Layout, out: Path, *, steps: int, tiny: bool, timeout_s: float) -> None:
    """Train ``layout`` through ``run_train.sh`` for at most ``timeout_s`` seconds (then its whole process group is
    stopped); the rows it logged are read either way."""
    folder = out / layout.name
    if folder.exists():
        # This script's own folder from a call that did not finish the layout: the layout starts again from step 0,
        # and rows of the earlier attempt (a compile step, a cut line) must not enter this one's timing.
        shutil.rmtree(folder)
    env = dict(os.environ, NGPU=str(layout.nproc), PYTHON=sys.executable,
               CONFIG_FILE=str(layout.config_path(tiny=tiny)))
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(folder), *layout.overrides(steps=steps, tiny=tiny)]
    print(f"== {layout.name}: {layout.nproc} processes, at most {timeout_s:.0f} s", flush=True)
    log = out / f"{layout.name}.log"
    with log.open("w") as sink:
        # A session of its own: on a timeout torchrun and every worker are stopped, not only the shell script.
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
    read_metrics(layout, folder / "metrics.jsonl")
    if code is None:
        layout.status = f"timed out after {timeout_s:.0f} s with {len(layout.rows)} steps"
    elif code != 0:
        layout.status = f"failed (exit {code}), {len(layout.rows)} steps"
    else:
        layout.status = "ok"
    if layout.status != "ok":
        print(f"   {layout.status}; log: {log}", flush=True)


def read_metrics(layout: Layout, metrics: Path) -> None:
    """The training rows (those with a loss) of a run's ``metrics.jsonl``, as every reader of it takes them
    (hola_titan/metrics_records.py: a line a stop cut short left out); none when it does not exist."""
    from hola_titan.metrics_records import read_metrics as read_records

    if metrics.is_file():
        layout.rows = [row for row in read_records(metrics) if "loss" in row]


def summarise(layouts: list[Layout], parity_bound: float) -> dict:
    """One row per layout (module docstring: the keys every row records), in the layouts' order."""
    by_name = {layout.name: layout for layout in layouts}
    table = []
    for layout in layouts:
        entry = {"layout": layout.name, "world_size": layout.nproc, "status": layout.status,
                 "degrees": dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), layout.degrees)),
                 "seq_len": layout.seq_len, "rows_per_step": layout.global_batch}
        if len(layout.rows) < 3:
            entry["status"] = layout.status if layout.status != "ok" else "too few steps"
            table.append(entry)
            continue
        # The first two steps compile (the second captures a second graph) and warm up.
        timed = layout.rows[2:]
        tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
        entry.update(tokens_per_s=tps, tokens_per_s_per_gpu=tps / layout.nproc,
                     mfu=sum(r["mfu"] for r in timed) / len(timed),
                     memory_gib=max(r["memory_gib"] for r in layout.rows),
                     first_losses=[r["loss"] for r in layout.rows[:10]])
        base = by_name.get(layout.baseline) if layout.baseline else None
        if base is not None and len(base.rows) >= 3:
            base_timed = base.rows[2:]
            base_tps = layout.baseline_scale * sum(r["tokens_per_s"] for r in base_timed) / len(base_timed)
            entry.update(baseline=base.name, baseline_tokens_per_s=base_tps, speedup=tps / base_tps,
                         per_gpu_efficiency=tps / base_tps * base.nproc / layout.nproc)
            if layout.baseline_scale != 1.0:
                entry["baseline_scale"] = layout.baseline_scale
        ref = by_name.get(layout.reference) if layout.reference else None
        if ref is not None and ref.rows:
            pairs = list(zip(entry["first_losses"], [r["loss"] for r in ref.rows[:10]]))
            worst = max(abs(a - b) / abs(b) for a, b in pairs)
            entry.update(loss_parity_vs=ref.name, loss_max_rel_diff=worst, loss_parity_ok=worst <= parity_bound)
        table.append(entry)
    return {"rows": table}


def print_table(summary: dict) -> None:
    print("\n| layout | GPUs | tokens/s | speedup | per-GPU efficiency | MFU | peak GiB | loss max rel diff | status |")
    print("|---|---|---|---|---|---|---|---|---|")
    for e in summary["rows"]:
        if "tokens_per_s" not in e:
            print(f"| {e['layout']} | {e['world_size']} | | | | | | | {e['status']} |")
            continue
        speed = (f"{e['speedup']:.2f}x vs {e['baseline']} | {100 * e['per_gpu_efficiency']:.1f}%"
                 if "speedup" in e else "- | -")
        parity = f"{e['loss_max_rel_diff']:.2e} vs {e['loss_parity_vs']}" if "loss_max_rel_diff" in e else "-"
        print(f"| {e['layout']} | {e['world_size']} | {e['tokens_per_s']:,.0f} | {speed} | {100 * e['mfu']:.1f}% "
              f"| {e['memory_gib']:.2f} | {parity} | {e['status']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true",
                        help="the same layouts on the CPU (gloo) with the debug model's widths (module docstring)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per layout where the layout names none (default: 15 on GPUs, 4 with --tiny)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the whole call may take (default: 470 on GPUs, none with --tiny); a layout "
                             "runs under the smaller of its own limit and what is left, and is not started with "
                             "less than 60 s left")
    parser.add_argument("--only", nargs="*", default=None, help="run only these layout names")
    parser.add_argument("--summarise-only", action="store_true",
                        help="run nothing: tabulate the layouts whose <out>/<layout>/metrics.jsonl exist (runs made "
                             "by several calls, e.g. on machines lent for a limited time)")
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.tiny else 15)
    budget = args.budget_s if args.budget_s is not None else (None if args.tiny else 470.0)
    layouts = MODES[args.mode]()
    if args.tiny:
        # float8 needs a GPU (the trainer refuses it on a CPU, tests/test_parallel.py).
        layouts = [layout for layout in layouts if "--float8.enable" not in layout.flags]
    names = {layout.name for layout in layouts}
    if args.only:
        unknown = set(args.only) - names
        if unknown:
            parser.error(f"--only: unknown layouts {sorted(unknown)} (this mode has {sorted(names)})")
    chosen = [layout for layout in layouts if not args.only or layout.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    # Rows an earlier call left in --out (on the same machine) serve as baselines and references.
    for layout in layouts:
        read_metrics(layout, args.out / layout.name / "metrics.jsonl")
        if layout.rows:
            layout.status = "from an earlier call"
    if args.summarise_only:
        if not any(layout.rows for layout in layouts):
            parser.error(f"--summarise-only: no <layout>/metrics.jsonl under {args.out}")
        chosen = []
    bound = 1e-5 if args.tiny else 0.005
    start, left_out = time.monotonic(), []
    for layout in chosen:
        if not args.only and len(layout.rows) >= (steps if args.tiny else (layout.steps or steps)):
            continue  # finished by an earlier call into --out: the same command goes on where it stopped
        limit = float(layout.timeout_s if not args.tiny else max(layout.timeout_s, 300))
        if budget is not None:
            left = budget - (time.monotonic() - start)
            if left < 60:
                layout.status = "not run: budget"
                left_out.append(layout.name)
                continue
            limit = min(limit, left)
        layout.rows = []
        run(layout, args.out, steps=steps, tiny=args.tiny, timeout_s=limit)
        # Rewritten after every layout, so that a call cut short keeps what finished.
        _write(args, layouts, bound)
    summary = _write(args, layouts, bound)
    print_table(summary)
    if left_out:
        print(f"\nnot run (budget): {' '.join(left_out)}\nnext call: python scripts/composition_run.py --mode "
              f"{args.mode} --out {args.out} --only {' '.join(left_out)}")
    return 0 if all(e.get("loss_parity_ok", True) for e in summary["rows"]) else 1


def _write(args, layouts: list[Layout], bound: float) -> dict:
    shown = [layout for layout in layouts if layout.rows or layout.status != "not run"]
    summary = summarise(shown, parity_bound=bound)
    summary.update(mode=args.mode, tiny=args.tiny, parity_bound=bound)
    (args.out / "composition.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
