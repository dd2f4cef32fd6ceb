"""Launch to first finished training step, per phase, for a recipe: what a new node or container costs.

Runs the real ``Trainer`` of a config (``--job.config_file`` and ``--section.key value`` overrides, as the trainer
takes them) through its first step on the recipe's own data and times, from the process's start (read from
``/proc``, so the interpreter's start-up counts):

- ``imports``: torch and the trainer module;
- ``build``: the config and ``Trainer(config)`` without the two phases below (model, data, optimizer, compile
  wrapping);
- ``kernel_configs``: choosing fla's launch configurations, fla's import included (``model.kernel_configs``);
- ``fla640_check``: fla's #640 gradient check, or reading its kept verdict (``job.cache_folder``);
- ``first_batch``: the data loader's first batch;
- ``first_forward``, ``first_backward``, ``first_optimizer``: the first micro-batch's loss, its backward, and
  the clipped AdamW update, each up to a device synchronisation (compilation and autotuning land here);
- ``second_step``: one more step, for comparison with a warm one.

It writes one JSON (``--out``) with the phases, the end-to-end ``first_step_s``, which launch configurations were
served (``kernel_configs``), Dynamo's compile counters, the paths the trainer chose, the GPU and versions, and the
state of the caches at start (Triton's and Inductor's folders: absent, or how many files). ``--procs N`` starts N
such processes side by side (each with its own run folder) and writes their results together with the slowest
one's ``first_step_s``: how long N runs sharing a GPU wait for their first step. Examples::

    python scripts/first_step.py --out first.json --job.config_file train_configs/mqar_hola.toml
    python scripts/first_step.py --procs 9 --out nine.json --job.config_file train_configs/mqar_hola.toml
    python scripts/first_step.py --out c.json --job.config_file train_configs/hola_340M.toml --compile.enable true \\
        --data.dataset bundled --model.tokenizer_path bundled --model.vocab_size 8192 --checkpoint.enable false
"""

from __future__ import annotations

import os
import time

_T_IMPORT_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def process_start_time() -> float:
    """This process's start (epoch seconds) from ``/proc`` (Linux); the script's first line elsewhere."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + start_ticks / ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return _T_IMPORT_START


def cache_state() -> dict:
    """Triton's and Inductor's cache folders as this process finds them (a fresh machine has neither)."""
    import getpass

    triton = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    inductor = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                   Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"))

    def count(folder: Path):
        return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.exists() else None

    return {"triton_dir": str(triton), "triton_files": count(triton), "inductor_dir": str(inductor),
            "inductor_files": count(inductor)}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--procs", type=int, default=1, help="processes started side by side")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each process may take")
    args, overrides = parser.parse_known_args(argv)
    if args.procs < 1:
        parser.error("--procs must be >= 1")
    return args, overrides


def watch_compiles(phase: list[str]) -> list[dict]:
    """Every Triton compile the main thread does (kernel, seconds, the phase it fell in), through Triton's own
    hooks: what the run still compiled at launch after the precompile workers (a load from Triton's disk cache
    shows as a few milliseconds). Returns the list the hooks fill."""
    import threading

    from triton import knobs

    from hola_titan.kernels.runtime import precompile

    compiles: list[dict] = []
    starts: dict = {}

    def before(*, key, **_):
        if threading.current_thread() is threading.main_thread():
            starts[key] = time.time()
        return None  # a true value would skip the compile

    def after(*, key, fn, compile=None, **_):  # noqa: A002 (Triton's keyword)
        began = starts.pop(key, None)
        if began is not None:
            record = {"kernel": f"{fn.module}.{fn.name}", "seconds": round(time.time() - began, 3),
                      "phase": phase[0]}
            if compile and compile.get("specialization_data"):
                record["spec"] = precompile.sanitize(compile["specialization_data"])
            compiles.append(record)

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    return compiles


def one(out: Path, overrides: list[str]) -> int:
    launched = process_start_time()
    phases: dict[str, float] = {}
    state_at_start = cache_state()
    t = time.time()
    phases["imports"] = t - launched
    sys.path.insert(0, str(ROOT))
    import torch

    import hola_titan.train as train_module
    from hola_titan.config import parse_config
    from hola_titan.metrics import setup_logging

    phases["imports"] = time.time() - launched
    setup_logging(0)
    phase = ["build"]
    compiles = watch_compiles(phase) if torch.cuda.is_available() else []
    # Inside the trainer's build: the model arguments (tokenizer), the backend's resolution (which imports fla),
    # installing the kernel configurations, the #640 check.
    timed: dict[str, float] = {"model_args": 0.0, "backend": 0.0, "kernel_configs": 0.0, "fla640_check": 0.0}

    def timing(name, fn):
        def wrapper(*a, **k):
            t0, outer = time.time(), phase[0]
            phase[0] = name
            try:
                return fn(*a, **k)
            finally:
                timed[name] += time.time() - t0
                phase[0] = outer
        return wrapper

    # Wrapped from outside, so the phases need nothing in the trainer.
    train_module.prepare_backward = timing("fla640_check", train_module.prepare_backward)
    train_module.model_args_of = timing("model_args", train_module.model_args_of)
    trainer_cls = train_module.Trainer
    trainer_cls._resolve_attention_backend = timing("backend", trainer_cls._resolve_attention_backend)
    trainer_cls._install_kernel_configs = timing("kernel_configs", trainer_cls._install_kernel_configs)
    t0 = time.time()
    trainer = trainer_cls(parse_config(overrides))
    phases["build"] = time.time() - t0 - sum(timed.values())
    phases.update(timed)
    device = trainer.device

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    phase[0] = "first_batch"
    t0 = time.time()
    data = iter(trainer.dataloader)
    batch = next(data)
    phases["first_batch"] = time.time() - t0
    phase[0] = "first_forward"
    t0 = time.time()
    loss = trainer.loss_sum(batch)
    sync()
    phases["first_forward"] = time.time() - t0
    phase[0] = "first_backward"
    t0 = time.time()
    loss.backward()
    sync()
    phases["first_backward"] = time.time() - t0
    phase[0] = "first_optimizer"
    t0 = time.time()
    trainer.clip_grad_norm()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    sync()
    phases["first_optimizer"] = time.time() - t0
    first_step_s = time.time() - launched
    phase[0] = "second_step"
    t0 = time.time()
    trainer.train_step([next(data) for _ in range(trainer.degrees.grad_accum_steps)])
    trainer.resolve_pending()
    sync()
    phases["second_step"] = time.time() - t0
    from torch._dynamo.utils import counters

    from hola_titan.kernels.runtime.tuned_configs import versions

    from hola_titan.kernels.runtime.precompile import plan_difference

    plan = trainer.precompile.plan
    for record in compiles:  # which of the main thread's compiles the plan lacked, and by what
        spec = record.pop("spec", None)
        if spec is not None and plan:
            record["plan"] = plan_difference(spec, plan) or "held (a load from the disk cache)"
    result = {
        "first_step_s": first_step_s, "finished_at": launched + first_step_s, "phases": phases,
        "loss": float(loss.detach()),
        "kernel_configs": trainer.kernel_configs.record(), "paths": trainer.paths,
        "precompile": trainer.precompile.record(), "main_thread_compiles": compiles,
        "dynamo": {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break")},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}",
        "versions": versions(), "caches_at_start": state_at_start, "overrides": overrides,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"first step {first_step_s:.1f} s after launch: " +
          ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    slow = [c for c in compiles if c["seconds"] > 0.2]
    print(f"main thread: {len(compiles)} Triton compiles or cache loads, {len(slow)} over 0.2 s taking "
          f"{sum(c['seconds'] for c in slow):.1f} s: " + ", ".join(
              f"{c['kernel'].rsplit('.', 1)[-1]} {c['seconds']:.1f} ({c['phase']})" for c in slow), flush=True)
    for c in slow:
        if c.get("plan"):
            print(f"  {c['kernel'].rsplit('.', 1)[-1]}: {c['plan']}", flush=True)
    return 0


def many(args, overrides: list[str]) -> int:
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="first_step_") as tmp:
        procs = []
        for i in range(args.procs):
            out = Path(tmp) / f"{i}.json"
            cmd = [sys.executable, __file__, "--out", str(out), *overrides, "--job.dump_folder",
                   str(Path(tmp) / f"run{i}"), "--training.seed", str(i)]
            procs.append((out, subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))))
        results = []
        for out, proc in procs:
            try:
                code = proc.wait(timeout=max(1.0, args.timeout - (time.time() - started)))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "timeout"
            results.append(json.loads(out.read_text()) if code == 0 and out.exists() else {"error": f"exit {code}"})
    done = [r["first_step_s"] for r in results if "first_step_s" in r]
    # From this script's start to the last process's first finished step: what N runs side by side wait.
    all_done = max((r["finished_at"] for r in results if "finished_at" in r), default=None)
    summary = {"procs": args.procs, "finished": len(done), "slowest_first_step_s": max(done) if done else None,
               "fastest_first_step_s": min(done) if done else None,
               "all_at_step_1_s": all_done - process_start_time() if all_done is not None else None, "runs": results}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{len(done)} of {args.procs} processes finished their first step; slowest "
          f"{summary['slowest_first_step_s']} s after its launch, all within {summary['all_at_step_1_s']} s of this "
          "script's", flush=True)
    return 0 if len(done) == args.procs else 1


def main(argv=None) -> int:
    args, overrides = _parse(sys.argv[1:] if argv is None else argv)
    return one(args.out, overrides) if args.procs == 1 else many(args, overrides)


if __name__ == "__main__":
    sys.exit(main())
