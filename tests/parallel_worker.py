"""A torchrun worker for the parity tests: trains a few steps with the given overrides, saves the losses, the
validation losses, the gradient norms, the full (unsharded) gradients of step 1 and the initial weights to
``OUT/result.pt`` on rank 0.

Usage: ``torchrun --nproc_per_node N tests/parallel_worker.py OUT [--section.key value ...]``, or
``... tests/parallel_worker.py OUT --runs RUNS.json`` for several runs one after another in the same processes
(``RUNS.json``: ``{name: [overrides]}``; run ``name`` writes ``OUT/name/result.pt``). Each run is a new ``Trainer``
from the same seed (on CPU, starting the processes costs more than training the debug model for 3 steps); rank 0
prints ``parallel_worker: run NAME`` before each, so that a failure names the run it happened in.
"""

import json
import os
import sys
from pathlib import Path

import torch

from hola_titan.config import parse_config
from hola_titan.fqn import strip_wrappers
from hola_titan.parallelisms.parallel_dims import end_process_group
from hola_titan.train import Trainer


def train_one(out: Path, overrides: list[str]) -> None:
    config = parse_config(overrides + ["--job.dump_folder", str(out)])
    trainer = Trainer(config)
    # The initial weights, gathered whole (before any step).
    init = {strip_wrappers(name): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in trainer.model.named_parameters()}
    grads = {}

    def probe(t: Trainer) -> None:
        if t.state.step != 0:
            return
        for name, param in t.model.named_parameters():
            grad = param.grad
            full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[strip_wrappers(name)] = full.detach().clone()

    trainer.gradient_probe = probe
    rows = trainer.train()
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"losses": [r["loss"] for r in rows if "loss" in r],
                    "val_losses": [r["val_loss"] for r in rows if "val_loss" in r],
                    "cache_gates": [r.get("cache_gate") for r in rows if "val_loss" in r],
                    "cache_gammas": [r.get("cache_gamma_qk") for r in rows if "val_loss" in r],
                    "grad_norms": [r["grad_norm"] for r in rows if "grad_norm" in r], "grads": grads, "init": init},
                   out / "result.pt")


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2:3] != ["--runs"]:
        train_one(out, sys.argv[2:])
        return
    runs = json.loads(Path(sys.argv[3]).read_text())
    for name, overrides in runs.items():
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"parallel_worker: run {name}", flush=True)
        train_one(out / name, overrides)
    # The trainers' meshes and groups are garbage by now; leave the process group cleanly (gloo aborts otherwise).
    end_process_group()


if __name__ == "__main__":
    main()
