"""A torchrun worker for the parity tests: trains a few steps with the given overrides, saves the losses, the
gradient norms, the full (unsharded) gradients of step 1 and the initial weights to ``OUT/result.pt`` on rank 0.

Usage: ``torchrun --nproc_per_node N tests/parallel_worker.py OUT [--section.key value ...]``
"""

import os
import sys

import torch

from hola_titan.config import parse_config
from hola_titan.fqn import strip_wrappers
from hola_titan.train import Trainer


def main() -> None:
    out = sys.argv[1]
    config = parse_config(sys.argv[2:] + ["--job.dump_folder", out])
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
                    "grad_norms": [r["grad_norm"] for r in rows if "grad_norm" in r], "grads": grads, "init": init},
                   os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
