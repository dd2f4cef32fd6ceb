"""Tune fla-core's kernels once on this GPU and write the configurations the trainer ships
(``hola_titan/kernels/runtime/configs/``).

Every fla kernel on the training path is autotuned at the shapes of the recipes: for each size, a one-layer model
of that width runs through the real ``Trainer`` in each recurrent flavour and compute precision the recipes of
that size train in: training steps on packed rows (``cu_seqlens``) or on plain rows, and after the plain rows a
chunked prefill (a forward with a cache, then one continuing from it, as evaluation and decoding run). Each
combination also runs the calls of a context-parallel run (continuing from an incoming state and cache with their
gradients, passing a final state on), whose fla state kernels have keys of their own.
``--references fla_gdn`` adds fla's own ``GatedDeltaNetForCausalLM`` at 340M in both precision policies of
``scripts/bench_train.py``, so that benchmark's reference rows start tuned too. Every combination of size,
flavour, precision and row kind runs in its own child process, ``--jobs`` at a time: the cost is mostly
``ptxas`` compiling candidate configurations, one CPU core per process, so a GPU host's cores tune the
combinations side by side (packed and plain rows, float32 and bf16 are different autotuning keys).

A second phase (``--phases plan``, on by default) runs each combination's trainer start and training steps again
with every configuration served and records what Triton compiled: the combination's compile *plan*, which
``hola_titan/kernels/runtime/precompile.py`` compiles in parallel at a run's start.

The winners (every autotuner's ``cache``, see ``hola_titan/kernels/runtime/tuned_configs.py``) and the plans are merged
and written to ``hola_titan/kernels/runtime/configs/<GPU>__fla-<v>__triton-<v>.json`` with the GPU, the fla-core,
Triton, torch and CUDA versions, the date and the command; an existing file for the same GPU and versions is merged into
(new results first), and its keys are served to the children instead of tuned again, so the tuning can be spread
over several runs.
The trainer picks the file up by itself (``model.kernel_configs = auto``). GPU only::

    python scripts/tune_kernels.py --jobs 12                # every recipe combination, 12 processes at a time
    python scripts/tune_kernels.py --sizes 340M --references fla_gdn --out /tmp/h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = ("debug", "small", "340M", "1.3B", "7B")
FLAVOURS = ("hola", "hola_recency", "gdn")
# The compute precisions the recipes of each size train in (the MQAR recipes run the debug width in float32).
PRECISIONS = {"debug": ("float32", "bfloat16")}


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated model sizes to tune at")
    parser.add_argument("--flavours", default=",".join(FLAVOURS), help="comma-separated recurrent flavours")
    parser.add_argument("--references", default="none",
                        help="'fla_gdn' to tune fla's own model too (needs the flash-linear-attention package, whose "
                             "fla.models fla-core does not ship), or 'none'")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row of the tuning batches")
    parser.add_argument("--rows", type=int, default=2, help="rows per tuning batch")
    parser.add_argument("--row-kinds", default="packed,plain",
                        help="comma-separated: packed (data.varlen, the text recipes) and/or plain rows (MQAR, "
                             "benchmarks, prefill)")
    parser.add_argument("--jobs", type=int, default=3, help="child processes at a time")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each child may take")
    parser.add_argument("--out", type=Path, default=None,
                        help="file to write (default: the shipped file for this GPU and versions)")
    parser.add_argument("--no-merge", action="store_true", help="replace an existing file instead of merging")
    parser.add_argument("--check", action="store_true",
                        help="say which table a run on this node takes (its own, another GPU's of the same "
                             "architecture, or none) and whether it is current; exit 0 only for its own")
    parser.add_argument("--phases", default="tune,plan",
                        help="tune: autotune what the file lacks; plan: record each combination's compile plan "
                             "(hola_titan/kernels/runtime/precompile.py) with the file served")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-configs", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--child-combo", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-phase", default="tune", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]


def _batch(rows: int, seq_len: int, vocab: int, *, packed: bool, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=gen)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if packed:
        cuts = {0, rows * seq_len}
        for r in range(rows):
            cuts.add(r * seq_len)
            cuts.update(r * seq_len + int(c) for c in torch.randint(1, seq_len, (3,), generator=gen))
        batch["cu_seqlens"] = torch.tensor(sorted(cuts), dtype=torch.int32)
    return batch


def _tune_ours(size: str, flavour: str, precision: str, rows: str, args, folder: Path, *, prefill: bool = True) -> str:
    """One combination's training steps; with ``prefill`` (the tuning phase, not the plan's) also a
    context-parallel run's calls (:func:`_shard_calls`) and, on plain rows, a chunked prefill, whose launch keys
    evaluation and decoding need; returns its plan key."""
    import torch

    from hola_titan.config import parse_config
    from hola_titan.models.model import ModelCache
    from hola_titan.train import Trainer

    trainer = Trainer(parse_config([
        "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--model.flavour", flavour,
        "--model.size", size, "--model.n_layers", "1", "--model.kernel_configs", args.child_configs,
        "--training.device", "cuda",
        "--training.mixed_precision_param", precision, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.rows), "--training.steps", "100", "--validation.enable", "false",
        "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false", "--lr_scheduler.warmup_steps", "1",
        "--model.precompile_workers", "0", "--job.cache_folder", str(folder / "cache"),
        "--job.dump_folder", str(folder / f"{size}_{flavour}_{precision}_{rows}")]))
    from hola_titan.kernels.gdn.fla_bridge import padded_head_dim
    from hola_titan.kernels.runtime.precompile import plan_key

    key = plan_key(flavour, padded_head_dim(trainer.model_args.head_dim, trainer.device), trainer.model_args.n_heads,
                   precision, packed=rows == "packed")
    vocab = trainer.model_args.vocab_size
    # Two steps on packed rows: their documents cut at other places, as consecutive batches of a run do.
    for seed in ((0, 1) if rows == "packed" else (2,)):
        trainer.train_step([_batch(args.rows, args.seq_len, vocab, packed=rows == "packed", seed=seed)])
    trainer.resolve_pending()
    if prefill:
        for line in _shard_calls(trainer, precision, packed=rows == "packed"):
            print(f"{size}/{flavour}/{precision}/{rows}: context-parallel shard call: {line}", flush=True)
    if rows == "packed" or not prefill:
        torch.cuda.synchronize()
        return key
    tokens = _batch(1, args.seq_len, vocab, packed=False, seed=3)["input_ids"].to(trainer.device)
    half = args.seq_len // 2
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=trainer.autocast):
        cache = ModelCache()
        trainer.model(tokens[:, :half], cache=cache)
        trainer.model(tokens[:, half:], cache=cache)
    torch.cuda.synchronize()
    return key


def _shard_calls(trainer, precision: str, *, packed: bool) -> list[str]:
    """The calls of a context-parallel run that a one-process training step does not make: the layer's op
    continuing from an incoming state (and cache) and returning their gradients, with and without a final state to
    pass on, and a fresh call that passes its final state on (rank 0, and the documents that start in a shard).
    fla's state kernels see other autotuning keys there (the incoming state's gradient and the final state's are
    extra float32 arguments), which a context-parallel run would otherwise tune at its start. The shapes
    of ``hola_titan/parallelisms/context_parallel.py``: the continuing document alone as one row, and on packed
    rows the shard's documents as one stream with ``cu_seqlens``. Not part of the compile plan: only
    context-parallel runs need them. Returns what ran, one line per call."""
    import torch

    if str(ROOT / "scripts") not in sys.path:  # a child runs this file as a script; tests load it by path
        sys.path.insert(0, str(ROOT / "scripts"))
    from bench_context_parallel import NAMES, boundary_cache, inputs
    from hola_titan.ops import hola_attention

    margs, device = trainer.model_args, trainer.device
    h, d, evict = margs.n_heads, margs.head_dim, margs.evict
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[precision]
    t = 4 * margs.block
    cu = torch.tensor([0, margs.block // 2, 3 * margs.block, t], device=device, dtype=torch.int32)
    ran = []
    for n in [1, 3] if packed else [1]:
        for incoming, final in [(True, False), (True, True), (False, True)]:
            what = (f"{'one row' if n == 1 else f'{n} packed documents'}, "
                    f"{'incoming state' if incoming else 'fresh'}, final state {'out' if final else 'not out'}")
            x, do = inputs(t, argparse.Namespace(heads=h, dim=d), device, dtype, seed=n + 2 * final + 4 * incoming)
            x = {name: x[name].requires_grad_() for name in NAMES}
            kw = dict(window=margs.window, block=margs.block, evict=evict, cu_seqlens=cu if n > 1 else None,
                      output_final_state=final)
            state = None
            if incoming:
                state = (0.01 * torch.randn(n, h, d, d, device=device)).requires_grad_()
                kw["initial_state"] = state
            if evict != "none":
                kw["output_final_cache"] = final
                if incoming:
                    kw["initial_cache"] = boundary_cache(n, h, d, window=margs.window, block=margs.block,
                                                         evict=evict, dtype=dtype, device=device)[0]
            o, *finals = hola_attention(*(x[name] for name in NAMES), **kw)
            loss = (o.float() * do.float()).sum()
            if final:
                if finals[0].shape[0] != n:
                    raise RuntimeError(f"tune_kernels: {what}: a final state for {finals[0].shape[0]} sequences")
                loss = loss + finals[0].float().square().sum()
                if evict != "none":
                    loss = loss + finals[1].k.float().square().sum() + finals[1].v.float().square().sum()
            loss.backward()
            grad = state.grad if incoming else x["q"].grad
            if grad is None or not torch.isfinite(grad).all():
                raise RuntimeError(f"tune_kernels: {what}: no finite gradient "
                                   f"{'to the incoming state' if incoming else 'to q'}, so the backward that "
                                   "needs tuning did not run")
            ran.append(what)
    return ran


def _tune_reference(args) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from bench_train import bench_reference

    ns = argparse.Namespace(vocab_size=32000, steps=1, warmup=1, profile=False, profile_keep=0)
    for precision in ("bf16_weights", "fp32_master"):
        bench_reference(name="fla_gdn", precision=precision, seq_len=args.seq_len, batch_size=args.rows, args=ns,
                        device=torch.device("cuda"), measured_tflops=1.0)


def read_child_output(phase: str, path: Path, code):
    """``(what a child wrote or None, its exit code)``: a plan child that exited without writing a plan (its file
    missing, or holding anything but a plan) counts as failed, so the run reports it and goes on."""
    data = json.loads(path.read_text()) if path.exists() else None
    if phase == "plan" and (data is None or "specs" not in data):
        return None, code or "0 without a plan"
    return data, code


def child(args) -> int:
    """Tune one combination (or the reference) in this process and write what the autotuners chose."""
    sys.path.insert(0, str(ROOT))
    from hola_titan.kernels.runtime import tuned_configs
    from hola_titan.metrics import setup_logging

    setup_logging(0)
    t0 = time.time()
    timings = {}

    def save():  # often: a child stopped by its time limit keeps what it tuned so far
        for _ in range(5):
            try:  # another thread may be adding a key while this one reads the tables
                kernels = tuned_configs.tuned_entries()
                break
            except RuntimeError:
                time.sleep(0.1)
        else:
            return
        tmp_out = args.child_out.with_suffix(".tmp")
        tmp_out.write_text(json.dumps({"kernels": kernels, "seconds": timings}) + "\n")
        tmp_out.replace(args.child_out)

    def keep_saving():
        while True:
            time.sleep(15.0)
            save()

    if args.child == "fla_gdn" or args.child_phase == "tune":
        # Not in the plan phase, whose child writes its plan once at the end into the same file: a save after that
        # replaced the plan with the tuning tables (seen on an H200, 2026-12-02: the parent read no plan).
        threading.Thread(target=keep_saving, daemon=True).start()

    with tempfile.TemporaryDirectory(prefix="tune_kernels_") as tmp:
        if args.child == "fla_gdn":
            _tune_reference(args)
            timings["fla_gdn"] = time.time() - t0
            save()
        elif args.child_phase == "plan":
            _record_plan(args, Path(tmp))
        else:
            size, flavour, precision, rows = args.child_combo.split("/")
            t1 = time.time()
            _tune_ours(size, flavour, precision, rows, args, Path(tmp))
            timings[args.child_combo] = time.time() - t1
            save()
            print(f"tuned {args.child_combo} in {time.time() - t1:.0f} s", flush=True)
    return 0


# Recipes whose runs add keys to a config: ablate_small.py's small screens and replicate_small.py's text runs pin
# block 64 (their earlier runs' block) on the small configs, which hold 256. A test keeps this beside the scripts'.
PINNED_RECIPES = (("small_hola_text.toml", ("--model.block", "64")),)


def recipe_selections(head_dim_of) -> dict[str, list[tuple[int, int]]]:
    """Compile plan key -> ``(window, block)`` of each recipe in ``train_configs/`` whose runs take that plan and
    select by score: the selection kernels take both as compile-time arguments, and a combination's steps run at
    its size's defaults, so its plan also records these (a recipe with another window or block would otherwise
    compile both kernels on its main thread). Recipes of sizes this script does not step (46M shares the small
    size's plan) count too. ``head_dim_of``: the head dim fla's kernels see on this GPU
    (``fla_bridge.padded_head_dim``)."""
    from hola_titan.builder import build_model_args
    from hola_titan.config import parse_config
    from hola_titan.kernels.runtime.precompile import plan_key

    found: dict[str, list[tuple[int, int]]] = {}
    recipes = [(path, ()) for path in sorted((ROOT / "train_configs").glob("*.toml"))]
    recipes += [(ROOT / "train_configs" / name, keys) for name, keys in PINNED_RECIPES]
    for recipe, keys in recipes:
        config = parse_config(["--job.config_file", str(recipe), *keys])
        margs = build_model_args(config, 8192)  # the vocabulary plays no part here
        if not margs.is_recurrent or margs.evict != "score" or config.training.device == "cpu":
            continue  # a recipe pinned to the CPU (micro_text.toml) never takes a GPU's plan
        dtype = "bfloat16" if config.training.mixed_precision_param == "bfloat16" else "float32"
        shapes = found.setdefault(plan_key(margs.flavour, head_dim_of(margs.head_dim), margs.n_heads, dtype,
                                           config.data.varlen), [])
        if (margs.window, margs.block) not in shapes:
            shapes.append((margs.window, margs.block))
    return found


def _select_at(window: int, block: int, heads: int, *, packed: bool) -> None:
    """One launch of the selection kernels at ``window`` and ``block`` (what a recipe's step launches)."""
    import torch

    from hola_titan.kernels.hola.selection import select_topw
    from hola_titan.kernels.runtime.documents import build_block_table

    t = 4 * block
    cu = torch.tensor([0, block // 2, 3 * block, t], dtype=torch.int32, device="cuda") if packed else None
    table = build_block_table(1, t, cu, block, torch.device("cuda"))
    select_topw(torch.rand(t, heads, device="cuda"), table, window)
    torch.cuda.synchronize()


def _record_plan(args, folder: Path) -> None:
    """Run one combination with every configuration served from the file and keep what Triton compiled: the plan
    that hola_titan/kernels/runtime/precompile.py compiles in parallel at a run's start."""
    from hola_titan.kernels.runtime import precompile, tuned_configs

    t1 = time.time()
    size, flavour, precision, rows = args.child_combo.split("/")
    # A training run's plan: the trainer's start (the #640 check) and its steps, not the prefill of evaluation.
    with precompile.Recorder() as recorder:
        key = _tune_ours(size, flavour, precision, rows, args, folder, prefill=False)
        import torch

        from hola_titan.kernels.gdn.fla_bridge import padded_head_dim

        heads = int(key.split("/")[2][1:])
        for window, block in recipe_selections(lambda d: padded_head_dim(d, torch.device("cuda"))).get(key, []):
            _select_at(window, block, heads, packed=rows == "packed")
    # With every key served, what Triton compiled is the plan. A key the file did not serve was autotuned here (the
    # log of the phase counts them): what its autotuner compiled only to time it is not part of a run's plan.
    autotuned = tuned_configs.tuned_entries()
    # Slowest to compile first: the order a run's precompile workers take them in.
    specs = recorder.slowest_first(recorder.specs)
    if autotuned:
        chosen = {name: [tuned_configs.config_to_json(c) for c in {id(c): c for c in tuner.cache.values()}.values()]
                  for name, tuner in tuned_configs.find_autotuners().items() if name in autotuned}
        specs = precompile.chosen_only(specs, chosen)
    slowest = [[json.loads(spec)["name"].rsplit(".", 1)[-1], recorder.seconds.get(spec, 0.0)] for spec in specs[:5]]
    args.child_out.write_text(json.dumps({"plan": key, "specs": specs, "recorded": len(recorder.specs),
                                          "slowest": slowest,
                                          "autotuned": sum(len(k["entries"]) for k in autotuned.values()),
                                          "seconds": time.time() - t1}) + "\n")
    print(f"plan {key}: {len(specs)} specialisations in {time.time() - t1:.0f} s", flush=True)


def file_meta(before: dict, *, gpu: str, capability: list[int], versions: dict, runs: list[dict]) -> dict:
    """The file's ``meta`` after a run: the GPU and its compute capability (what lets another GPU of the same
    architecture take the file: tuned_configs.nearest_shipped), the versions, every run, and the notes the file
    carried (what a person wrote about how its entries came to be; a merge must not drop them)."""
    meta = {"gpu": gpu, "capability": list(capability), **versions, "runs": runs}
    if before.get("notes"):
        meta["notes"] = list(before["notes"])
    return meta


def check(torch, tuned_configs) -> int:
    """``--check``: one line saying which table ``model.kernel_configs = auto`` takes on this node's first GPU.
    Exit 0: this GPU's own file for the installed fla-core and Triton; 1: another GPU's of the same architecture,
    or none (fla autotunes at run time); 2: no CUDA GPU."""
    if not torch.cuda.is_available():
        print("no CUDA GPU on this node: kernel configurations apply to CUDA devices only")
        return 2
    located = tuned_configs.locate("auto", "cuda:0")
    gpu = torch.cuda.get_device_name(0)
    if located.source == "shipped":
        print(f"current: {gpu} takes its own table {located.path} ({located.kernels} kernels; {located.why})")
        return 0
    if located.source == "nearest_gpu":
        print(f"not current: {gpu} takes {located.path} ({located.why}); python scripts/tune_kernels.py writes "
              "its own")
        return 1
    print(f"not current: {gpu} autotunes at run time ({located.why})")
    return 1


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.child:
        return child(args)
    sys.path.insert(0, str(ROOT))
    import torch

    from hola_titan.kernels.runtime import tuned_configs

    if args.check:
        return check(torch, tuned_configs)
    if not torch.cuda.is_available():
        raise SystemExit("error: tune_kernels.py needs a CUDA GPU (it times kernels on the GPU they will run on)")
    versions = tuned_configs.versions()
    gpu = torch.cuda.get_device_name(0)
    capability = list(torch.cuda.get_device_capability(0))
    out = args.out or tuned_configs.shipped_file(gpu, versions["fla"], versions["triton"])
    for size in _split(args.sizes):
        if size not in SIZES:
            raise SystemExit(f"error: --sizes: unknown size {size!r}; expected some of {', '.join(SIZES)}")
    for flavour in _split(args.flavours):
        if flavour not in FLAVOURS:
            raise SystemExit(f"error: --flavours: unknown flavour {flavour!r}; expected some of {', '.join(FLAVOURS)}")
    for rows in _split(args.row_kinds):
        if rows not in ("packed", "plain"):
            raise SystemExit(f"error: --row-kinds: unknown row kind {rows!r}; expected packed and/or plain")
    for reference in _split(args.references):
        if reference != "fla_gdn":
            raise SystemExit(f"error: --references: unknown reference {reference!r}; expected fla_gdn or none")
    # Flavours outermost: the first flavour's combinations of every size tune first, and the file is rewritten as
    # each child ends, so a later child (another flavour calls mostly the same fla kernels) is served what the
    # earlier ones tuned instead of tuning it again.
    parts = [f"{size}/{flavour}/{precision}/{rows}" for flavour in _split(args.flavours)
             for size in _split(args.sizes) for precision in PRECISIONS.get(size, ("bfloat16",))
             for rows in _split(args.row_kinds)] + _split(args.references)
    before = tuned_configs.read_file(out) if out.exists() and not args.no_merge else {"kernels": {}, "meta": {}}
    # What the file records of the runs that wrote it (a file from before runs were listed: its one run).
    earlier_runs = before["meta"].get("runs") or ([{k: before["meta"][k] for k in (
        "date", "command", "torch", "cuda", "parts", "coverage") if k in before["meta"]}] if before["meta"] else [])
    command = " ".join(["python", "scripts/tune_kernels.py", *(argv if argv is not None else sys.argv[1:])])
    results, plans, log = [], {}, {}

    def write() -> dict:
        """The file as it stands: this run's results first, then what the file held before (atomically)."""
        kernels = tuned_configs.merge([*results, before["kernels"]])
        runs = [*earlier_runs, {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "torch": versions["torch"], "cuda": versions["cuda"], "parts": log}]
        meta = file_meta(before["meta"], gpu=gpu, capability=capability, versions=versions, runs=runs)
        record = {"format": tuned_configs.FORMAT, "meta": meta, "kernels": kernels,
                  "plans": {**before.get("plans", {}), **plans}}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_suffix(".tmp")
        tmp_out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        tmp_out.replace(out)
        return kernels

    def run_children(phase: str, names: list[str], tmp: str) -> None:
        pending = list(names)
        running: list[tuple[str, subprocess.Popen, float, Path]] = []
        while pending or running:
            while pending and len(running) < args.jobs:
                part = pending.pop(0)
                part_out = Path(tmp) / f"{phase}_{part.replace('/', '_')}.json"
                # Keys the file already holds are served from it, so a run that continues an earlier (merged) one,
                # or a child started after others ended, tunes only what is missing; what the tables served is not
                # written again. The plan phase runs with the whole file served.
                known = str(out) if out.exists() else "off"
                cmd = [sys.executable, __file__, "--child", "fla_gdn" if part == "fla_gdn" else "ours",
                       "--child-phase", phase, "--child-combo", part, "--child-out", str(part_out),
                       "--child-configs", known, "--seq-len", str(args.seq_len), "--rows", str(args.rows)]
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                if phase == "plan":
                    # Each plan child compiles in a Triton cache of its own: the seconds it records per compile
                    # order the plan (slowest first), and a kernel another child had compiled would load in
                    # milliseconds and be ordered last.
                    env["TRITON_CACHE_DIR"] = str(Path(tmp) / f"triton_{part.replace('/', '_')}")
                running.append((part, subprocess.Popen(cmd, env=env), time.time(), part_out))
            time.sleep(1.0)
            for item in list(running):
                part, proc, started, part_out = item
                code = proc.poll()
                if code is None and time.time() - started > args.timeout:
                    proc.kill()
                    code = "timeout"
                if code is None:
                    continue
                running.remove(item)
                row = log.setdefault(f"{phase} {part}", {})
                row["seconds"] = round(time.time() - started, 1)
                data, code = read_child_output(phase, part_out, code)
                if data is not None:  # a tuning child that stopped early still wrote what it tuned so far
                    if phase == "plan":
                        plans[data["plan"]] = data["specs"]
                        row.update(plan=data["plan"], specs=len(data["specs"]), recorded=data["recorded"],
                                   autotuned=data["autotuned"], slowest=data.get("slowest"))
                    else:
                        results.append(data["kernels"])
                        row.update(phases=data["seconds"], kernels=len(data["kernels"]))
                if code != 0:
                    row["error"] = f"exit {code}"
                print(f"{phase} {part}: {row}", flush=True)
                write()

    phases = _split(args.phases)
    with tempfile.TemporaryDirectory(prefix="tune_kernels_") as tmp:
        if "tune" in phases:
            run_children("tune", parts, tmp)
        if "plan" in phases:
            run_children("plan", [p for p in parts if p != "fla_gdn"], tmp)
    kernels = write()
    entries = sum(len(k["entries"]) for k in kernels.values())
    print(f"\n{'part':<38} {'seconds':>8} {'kernels':>8} {'specs':>6}")
    for part, row in log.items():
        print(f"{part:<38} {row['seconds']:>8.0f} {row.get('kernels', '-'):>8} {row.get('specs', '-'):>6}  "
              f"{row.get('error', '')}")
    print(f"wrote {out}: {len(kernels)} kernels, {entries} entries, {len(plans)} plans recorded")
    return 0 if all("error" not in row for row in log.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
