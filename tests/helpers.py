"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

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
