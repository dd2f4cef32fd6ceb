"""Losses of the first steps of one run under two settings, batch for batch.

Builds the trainer twice from the same config and seed, trains ``--steps`` steps on the same batches of the
configured data, and prints the losses side by side with the largest absolute and relative difference; writes JSON
(``--out``; runs named ``a`` and ``b``). The two runs differ in ``model.kernels`` (``--kernels-a`` and
``--kernels-b``, default ``triton`` and ``reference``: this project's fused kernels against the PyTorch forms they
replace) and in any overrides given to one of them (``--set-a`` / ``--set-b SECTION.KEY=VALUE``, repeatable, applied
after the rest), e.g. the cache backward with and without its kept output. Extra arguments after ``--`` are trainer
overrides for both runs (``--section.key value``). Two runs whose settings come out equal are refused.

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


# Settings this script gives both runs itself (after every override), so a --set-a/-b of them would be ignored.
SET_BY_THIS_SCRIPT = ("training.steps", "checkpoint.enable", "validation.enable", "metrics.enable_tensorboard",
                      "job.dump_folder")


def _pairs(overrides: list[str]) -> dict:
    """``--section.key value`` pairs of a trainer command line as a dict (later ones win)."""
    out, i = {}, 0
    while i < len(overrides):
        flag = overrides[i]
        if flag.startswith("--") and "=" in flag:
            key, _, value = flag[2:].partition("=")
            out[key] = value
            i += 1
        elif flag.startswith("--") and i + 1 < len(overrides):
            out[flag[2:]] = overrides[i + 1]
            i += 2
        else:
            out[flag] = None
            i += 1
    return out


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
    # Each run's settings as the trainer will read them (later overrides win): the shared ones after "--", then its
    # kernels, then its own; two runs are refused when these are equal, whatever the spelling of the flags.
    shared = _pairs(extra)
    runs = {}
    for name, kernels, sets, flag in (("a", args.kernels_a, args.set_a, "--set-a"),
                                      ("b", args.kernels_b, args.set_b, "--set-b")):
        own_settings = {"model.kernels": kernels}
        for item in sets:
            key, eq, value = item.partition("=")
            key = key.strip().lstrip("-")
            if not eq or "." not in key:
                p.error(f"{flag} {item!r}: expected SECTION.KEY=VALUE")
            if key in SET_BY_THIS_SCRIPT:
                p.error(f"{flag} {item!r}: {key} is set by this script for both runs (--steps for training.steps)")
            own_settings[key] = value
        overrides = [arg for key, value in own_settings.items() for arg in (f"--{key}", value)]
        runs[name] = dict(label=" ".join(f"{k}={v}" for k, v in own_settings.items()), overrides=overrides,
                          settings={**shared, **own_settings})
    if runs["a"]["settings"] == runs["b"]["settings"]:
        p.error("the two runs have the same settings: give them different --kernels-a/-b or --set-a/-b")
    sys.path.insert(0, str(ROOT))
    from hola_titan.config import parse_config
    from hola_titan.metrics import setup_logging
    from hola_titan.train import Trainer

    setup_logging(0)
    losses, paths = {}, {}
    for name, run_spec in runs.items():
        with tempfile.TemporaryDirectory(prefix="compare_losses_") as tmp:
            config = parse_config([*extra, *run_spec["overrides"], "--training.steps", str(args.steps),
                                   "--checkpoint.enable", "false", "--validation.enable", "false",
                                   "--metrics.enable_tensorboard", "false", "--job.dump_folder", tmp])
            trainer = Trainer(config)
            paths[name] = trainer.paths
            batches = iter(trainer.dataloader)
            run = []
            for _ in range(args.steps):
                micro = [next(batches) for _ in range(trainer.degrees.grad_accum_steps)]
                run.append(trainer.train_step(micro).result()["loss"])
            losses[name] = run
            del trainer
    a, b = losses["a"], losses["b"]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    rel = [d / abs(y) for d, y in zip(diffs, b)]
    print(f"a: {runs['a']['label']}\nb: {runs['b']['label']}")
    print(f"{'step':>5}{'a':>14}{'b':>14}{'|diff|':>12}")
    for i, (x, y, d) in enumerate(zip(a, b, diffs), 1):
        print(f"{i:>5}{x:>14.6f}{y:>14.6f}{d:>12.2e}")
    print(f"max |diff| {max(diffs):.3e}, max relative {max(rel):.3e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(losses=losses, paths=paths, max_abs=max(diffs), max_rel=max(rel),
                                        overrides=extra,
                                        runs={n: dict(label=r["label"], overrides=r["overrides"]) for n, r in
                                              runs.items()}), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
