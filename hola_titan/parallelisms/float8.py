"""Float8 training of the linear layers through torchao (rowwise or tensorwise scaling).

Runs first in the parallelisation order (a module swap before any sharding). Converted: every ``nn.Linear`` whose
in and out features are multiples of 16, except the modules named in ``float8.filter_fqns`` and the per-head gate
projections (``a_proj``, ``b_proj``: H outputs, too small to gain and below the 16-multiple rule at small H). A
tied output head is not an ``nn.Linear`` and stays in bf16, as recommended for the head.
"""

from __future__ import annotations

import torch
from torch import nn

_TINY = ("a_proj", "b_proj")


def float8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` runs float8 matmuls (NVIDIA compute capability 8.9+), and why not."""
    if device.type != "cuda":
        return False, f"float8 needs a CUDA GPU, the device is {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return False, f"float8 needs compute capability 8.9 or newer, {torch.cuda.get_device_name(device)} has " \
                      f"{capability[0]}.{capability[1]}"
    return True, ""


def apply_float8(model: nn.Module, *, device: torch.device, recipe: str, filter_fqns: list[str]) -> list[str]:
    """Swap eligible linears to torchao's ``Float8Linear``; returns the converted module names."""
    ok, reason = float8_supported(device)
    if not ok:
        raise ValueError(f"float8.enable: {reason}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(fqn == f or fqn.endswith("." + f) for f in filter_fqns) or fqn.endswith(_TINY):
            return False
        if module.in_features % 16 or module.out_features % 16:
            return False
        converted.append(fqn)
        return True

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)
    return converted
