"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from hola_titan.models.args import model_args, replace
from hola_titan.models.model import HolaTitanLM, build_model


def tiny_model(flavour: str, *, vocab_size: int = 97, seed: int = 0) -> HolaTitanLM:
    """The debug flavour with block 4 and window 3, so 20-odd tokens cross several blocks and cache merges.

    After the standard init the cache parameters are moved off their init values (gate -4 would scale the
    cache path by 0.018 and hide its errors; gammas of 1 and sink 0 would hide a missing norm weight or sink).
    """
    args = replace(model_args(flavour, "debug", vocab_size=vocab_size), block=4, window=3)
    torch.manual_seed(seed)
    model = build_model(args, device="cpu")
    if flavour in ("hola", "hola_recency"):
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for block in model.layers.values():
                mixer = block.attn
                mixer.gate.copy_(0.5 + 0.5 * torch.randn(mixer.gate.shape, generator=gen))
                mixer.sink.copy_(torch.randn(mixer.sink.shape, generator=gen))
                mixer.gamma_q.copy_(1 + 0.2 * torch.randn(mixer.gamma_q.shape, generator=gen))
                mixer.gamma_k.copy_(1 + 0.2 * torch.randn(mixer.gamma_k.shape, generator=gen))
    return model.eval()


ROOT = Path(__file__).resolve().parents[1]


def run_parallel_worker(out: Path, nproc: int, args: list[str], *, timeout: float = 600) -> dict:
    """``torchrun`` ``nproc`` processes of ``tests/parallel_worker.py`` with the config overrides ``args``;
    returns rank 0's ``result.pt`` (losses, gradient norms, gradients of step 1)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOLA_TITAN_CACHE=str(out / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", str(ROOT / "tests" / "parallel_worker.py"), str(out), *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return torch.load(out / "result.pt")


def flat_cache(cache) -> list[torch.Tensor]:
    """Every tensor of a recurrent model's ``ModelCache``, layer by layer (tails, state, then the HOLA cache)."""
    from hola_titan.decoding import flatten_layer
    return [t for layer in cache.layers.values() for t in flatten_layer(layer)]
