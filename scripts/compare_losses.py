"""Losses of the first steps of one run under two settings of ``model.kernels``, batch for batch.

Builds the trainer twice from the same config and seed (``--kernels-a`` and ``--kernels-b``, default ``triton`` and
``reference``: this project's fused kernels against the PyTorch forms they replace), trains ``--steps`` steps on the
same batches of the configured data, and prints the losses side by side with the largest absolute and relative
difference; writes JSON (``--out``). Extra arguments after ``--`` are trainer overrides (``--section.key value``).

    python scripts/compare_losses.py --steps 20 --out outputs/compare_losses.json -- \\
        --job.config_file train_configs/hola_340M.toml --data.dataset bundled --model.tokenizer_path bundled
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
    p.add_argument("--out", type=Path, default=Path("outputs/compare_losses.json"))
    args = p.parse_args(own)
    sys.path.insert(0, str(ROOT))
    from hola_titan.config import parse_config
    from hola_titan.metrics import setup_logging
    from hola_titan.train import Trainer

    setup_logging(0)
    losses, paths = {}, {}
    for kernels in (args.kernels_a, args.kernels_b):
        with tempfile.TemporaryDirectory(prefix="compare_losses_") as tmp:
            config = parse_config([*extra, "--model.kernels", kernels, "--training.steps", str(args.steps),
                                   "--checkpoint.enable", "false", "--validation.enable", "false",
                                   "--metrics.enable_tensorboard", "false", "--job.dump_folder", tmp])
            trainer = Trainer(config)
            paths[kernels] = trainer.paths
            batches = iter(trainer.dataloader)
            run = []
            for _ in range(args.steps):
                micro = [next(batches) for _ in range(trainer.degrees.grad_accum_steps)]
                run.append(trainer.train_step(micro).result()["loss"])
            losses[kernels] = run
            del trainer
    a, b = losses[args.kernels_a], losses[args.kernels_b]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    rel = [d / abs(y) for d, y in zip(diffs, b)]
    print(f"{'step':>5}{args.kernels_a:>14}{args.kernels_b:>14}{'|diff|':>12}")
    for i, (x, y, d) in enumerate(zip(a, b, diffs), 1):
        print(f"{i:>5}{x:>14.6f}{y:>14.6f}{d:>12.2e}")
    print(f"max |diff| {max(diffs):.3e}, max relative {max(rel):.3e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(losses=losses, paths=paths, max_abs=max(diffs), max_rel=max(rel),
                                        overrides=extra), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
