"""Tune fla-core's kernels once on this GPU and write the configurations the trainer ships (``kernels/configs/``).

Every fla kernel on the training path is autotuned at the shapes of the recipes: for each size, a one-layer model
of that width runs through the real ``Trainer`` in each recurrent flavour (bf16 autocast, as training runs):
training steps on packed rows (``cu_seqlens``) and on plain rows, then a chunked prefill (a forward with a cache,
then one continuing from it, as evaluation and decoding run). ``--references fla_gdn`` adds fla's own
``GatedDeltaNetForCausalLM`` at 340M in both precision policies of ``scripts/bench_train.py``, so that benchmark's
reference rows start tuned too. Each size runs in its own child process, ``--jobs`` at a time (the cost is
mostly ``ptxas`` compiling candidate configurations, which uses one CPU core per process).

The winners (every autotuner's ``cache``, see ``kernels/tuned_configs.py``) are merged and written to
``kernels/configs/<GPU>__fla-<v>__triton-<v>.json`` with the GPU, the fla-core, Triton, torch and CUDA versions,
the date and the command; an existing file for the same GPU and versions is merged into (new results first), and
its keys are served to the children instead of tuned again, so the tuning can be spread over several runs.
The trainer picks the file up by itself (``model.kernel_configs = auto``). GPU only::

    python scripts/tune_kernels.py                          # all recipe sizes, 3 processes at a time
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
    parser.add_argument("--first-rows", default="packed", choices=("packed", "plain"),
                        help="tune packed rows (data.varlen, the text recipes) or plain rows (MQAR) first")
    parser.add_argument("--jobs", type=int, default=3, help="child processes at a time")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each child may take")
    parser.add_argument("--out", type=Path, default=None,
                        help="file to write (default: the shipped file for this GPU and versions)")
    parser.add_argument("--no-merge", action="store_true", help="replace an existing file instead of merging")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-configs", default="off", help=argparse.SUPPRESS)
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


def _tune_ours(size: str, flavour: str, precision: str, args, folder: Path) -> None:
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
        "--job.dump_folder", str(folder / f"{size}_{flavour}_{precision}")]))
    vocab = trainer.model_args.vocab_size
    order = ((0, True), (1, True), (2, False)) if args.first_rows == "packed" else ((2, False), (0, True), (1, True))
    for seed, packed in order:
        trainer.train_step([_batch(args.rows, args.seq_len, vocab, packed=packed, seed=seed)])
    trainer.resolve_pending()
    tokens = _batch(1, args.seq_len, vocab, packed=False, seed=3)["input_ids"].to(trainer.device)
    half = args.seq_len // 2
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=trainer.autocast):
        cache = ModelCache()
        trainer.model(tokens[:, :half], cache=cache)
        trainer.model(tokens[:, half:], cache=cache)
    torch.cuda.synchronize()


def _tune_reference(args) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from bench_train import bench_reference

    ns = argparse.Namespace(vocab_size=32000, steps=1, warmup=1, profile=False, profile_keep=0)
    for precision in ("bf16_weights", "fp32_master"):
        bench_reference(name="fla_gdn", precision=precision, seq_len=args.seq_len, batch_size=args.rows, args=ns,
                        device=torch.device("cuda"), measured_tflops=1.0)


def child(args) -> int:
    """Tune one size (or the reference) in this process and write what the autotuners chose."""
    sys.path.insert(0, str(ROOT))
    from hola_titan.kernels import tuned_configs
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

    threading.Thread(target=keep_saving, daemon=True).start()

    with tempfile.TemporaryDirectory(prefix="tune_kernels_") as tmp:
        if args.child == "fla_gdn":
            _tune_reference(args)
            timings["fla_gdn"] = time.time() - t0
            save()
        else:
            for flavour in _split(args.flavours):
                for precision in PRECISIONS.get(args.child, ("bfloat16",)):
                    t1 = time.time()
                    _tune_ours(args.child, flavour, precision, args, Path(tmp))
                    timings[f"{flavour}_{precision}"] = time.time() - t1
                    save()
                    print(f"tuned {args.child} {flavour} {precision} in {time.time() - t1:.0f} s", flush=True)
    return 0


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.child:
        return child(args)
    sys.path.insert(0, str(ROOT))
    import torch

    from hola_titan.kernels import tuned_configs

    if not torch.cuda.is_available():
        raise SystemExit("error: tune_kernels.py needs a CUDA GPU (it times kernels on the GPU they will run on)")
    versions = tuned_configs.versions()
    gpu = torch.cuda.get_device_name(0)
    out = args.out or tuned_configs.shipped_file(gpu, versions["fla"], versions["triton"])
    parts = [*_split(args.sizes), *_split(args.references)]
    for part in parts:
        if part not in (*SIZES, "fla_gdn"):
            raise SystemExit(f"error: unknown size or reference {part!r}; expected {', '.join(SIZES)} or fla_gdn")
    results, log = [], {}
    with tempfile.TemporaryDirectory(prefix="tune_kernels_") as tmp:
        pending = list(parts)
        running: list[tuple[str, subprocess.Popen, float, Path]] = []
        while pending or running:
            while pending and len(running) < args.jobs:
                part = pending.pop(0)
                part_out = Path(tmp) / f"{part}.json"
                # Keys the file already holds are served from it, so a run that continues an earlier (merged) one
                # tunes only what is missing; what the tables served is not written again.
                known = str(out) if out.exists() and not args.no_merge else "off"
                cmd = [sys.executable, __file__, "--child", part, "--child-out", str(part_out),
                       "--child-configs", known, "--flavours", args.flavours, "--seq-len", str(args.seq_len),
                       "--rows", str(args.rows), "--first-rows", args.first_rows]
                running.append((part, subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1")),
                                time.time(), part_out))
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
                seconds = time.time() - started
                log[part] = {"seconds": round(seconds, 1)}
                if part_out.exists():  # a child that stopped early still wrote the models it finished
                    data = json.loads(part_out.read_text())
                    results.append(data["kernels"])
                    log[part].update(phases=data["seconds"], kernels=len(data["kernels"]))
                if code != 0:
                    log[part]["error"] = f"exit {code}"
                print(f"{part}: {log[part]}", flush=True)
    kernels = tuned_configs.merge(results)
    if out.exists() and not args.no_merge:
        kernels = tuned_configs.merge([kernels, tuned_configs.read_file(out)["kernels"]])
    meta = {"gpu": gpu, **versions, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "scripts/tune_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
            "parts": log}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"format": tuned_configs.FORMAT, "meta": meta, "kernels": kernels}, indent=1,
                              sort_keys=True) + "\n")
    entries = sum(len(k["entries"]) for k in kernels.values())
    print(f"\n{'part':<10} {'seconds':>8} {'kernels':>8}")
    for part, row in log.items():
        print(f"{part:<10} {row['seconds']:>8.0f} {row.get('kernels', 0):>8}  {row.get('error', '')}")
    print(f"wrote {out}: {len(kernels)} kernels, {entries} entries")
    return 0 if all("error" not in row for row in log.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
