"""Initial weights of a parallelised model, identical to one process's, without building the model whole.

The trainer builds the model on the meta device, parallelises it (FSDP, TP, CP, AC, compile) and materialises it
with ``to_empty``: every rank then holds only its shards, on its device. :func:`init_like_one_process` fills them
with exactly the values ``HolaTitanLM.init_weights`` would draw in one process from the same RNG state: it
replays the model's own init sequence (``HolaTitanLM.init_parts``) one part at a time on a CPU copy of that part
(the embedding, then one block, ...), and each rank keeps the slice of every parameter that its layout gives it.
Every rank draws the same numbers (same seed, same order), so no data moves between ranks, and the host holds
one part at a time instead of the model (the 7B model in float32 is about 27 GB).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hola_titan.fqn import strip_wrappers


def init_like_one_process(model: nn.Module, template: nn.Module) -> None:
    """Fill ``model``'s parameters (plain, or DTensors of any layout) with what ``template.init_weights()`` draws.

    ``template`` is the same model class and arguments on the meta device (its parts give the init order and the
    modules to copy; it is never materialised whole). The global RNG advances exactly as in one process.
    """
    targets = {strip_wrappers(name): param for name, param in model.named_parameters()}
    filled = set()
    with torch.no_grad():
        for prefix, module, init in template.init_parts():
            part = copy.deepcopy(module).to_empty(device="cpu")
            init(part)
            for name, value in part.named_parameters():
                key = f"{prefix}.{name}"
                if key not in targets:
                    raise KeyError(f"init: {key} is not a parameter of the parallelised model")
                _copy_full(targets[key], value)
                filled.add(key)
            del part
    missing = sorted(set(targets) - filled)
    if missing:
        raise KeyError(f"init: parameters no init part covers: {missing[:4]}")


def _copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        # Every rank holds the same full tensor: each keeps its own slice, with no communication.
        shard = distribute_tensor(full.to(target.device), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(shard)
    else:
        target.copy_(full)
