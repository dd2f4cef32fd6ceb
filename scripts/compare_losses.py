"""Losses of the first steps of one run under two settings, batch for batch.

Builds the trainer twice from the same config and seed, trains ``--steps`` steps on the same batches of the
configured data, and prints the losses side by side with the largest absolute and relative difference; writes JSON
(``--out``). The two runs differ in ``model.kernels`` (``--kernels-a`` and ``--kernels-b``, default ``triton`` and
``reference``: this project's fused kernels against the PyTorch forms they replace) and in any overrides given to
one of them (``--set-a`` / ``--set-b SECTION.KEY=VALUE``, repeatable), e.g. the cache backward with and without its
kept output. Extra arguments after ``--`` are trainer overrides for both runs (``--section.key value``).

    python scripts/compare_losses.py --steps 20 --out outputs/compare_losses.json -- \\
        --job.config_file train_configs/hola_340M.toml --data.dataset bundled --model.tokenizer_path bundled
    python scripts/compare_losses.py --kernels-b triton --set-a model.save_cache_output=true -- ...
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kernels-a", default="triton")
    p.add_argument("--kernels-b", default="reference")
    p.add_argument("--set-a", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a trainer override for run a only (repeatable)")
    p.add_argument("--set-b", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a trainer override for run b only (repeatable)")
    p.add_argument("--out", type=Path, default=Path("outputs/compare_losses.json"))
    args = p.parse_args(own)
    runs = {}  # label -> overrides; the label is the kernels setting, with the run's own overrides after it
    for kernels, sets, flag in ((args.kernels_a, args.set_a, "--set-a"), (args.kernels_b, args.set_b, "--set-b")):
        overrides = ["--model.kernels", kernels]
        for item in sets:
            key, eq, value = item.partition("=")
            if not eq or not key:
                p.error(f"{flag} {item!r}: expected SECTION.KEY=VALUE")
            overrides += [f"--{key}", value]
        runs[" ".join([kernels, *sets])] = overrides
    if len(runs) < 2:
        p.error("the two runs have the same settings: give them different --kernels-a/-b or --set-a/-b")
    label_a, label_b = runs
    sys.path.insert(0, str(ROOT))
    from hola_titan.config import parse_config
    from hola_titan.metrics import setup_logging
    from hola_titan.train import Trainer

    setup_logging(0)
    losses, paths = {}, {}
    for label, overrides in runs.items():
        with tempfile.TemporaryDirectory(prefix="compare_losses_") as tmp:
            config = parse_config([*extra, *overrides, "--training.steps", str(args.steps),
                                   "--checkpoint.enable", "false", "--validation.enable", "false",
                                   "--metrics.enable_tensorboard", "false", "--job.dump_folder", tmp])
            trainer = Trainer(config)
            paths[label] = trainer.paths
            batches = iter(trainer.dataloader)
            run = []
            for _ in range(args.steps):
                micro = [next(batches) for _ in range(trainer.degrees.grad_accum_steps)]
                run.append(trainer.train_step(micro).result()["loss"])
            losses[label] = run
            del trainer
    a, b = losses[label_a], losses[label_b]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    rel = [d / abs(y) for d, y in zip(diffs, b)]
    print(f"a: {label_a}\nb: {label_b}")
    print(f"{'step':>5}{'a':>14}{'b':>14}{'|diff|':>12}")
    for i, (x, y, d) in enumerate(zip(a, b, diffs), 1):
        print(f"{i:>5}{x:>14.6f}{y:>14.6f}{d:>12.2e}")
    print(f"max |diff| {max(diffs):.3e}, max relative {max(rel):.3e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(losses=losses, paths=paths, max_abs=max(diffs), max_rel=max(rel),
                                        overrides=extra, runs=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
