"""Tensor parallelism (Megatron-style, head-sharded) with sequence parallelism for the norms.

Per block, for every flavour:

- ``attention_norm``, ``ffn_norm`` (and the final ``norm``) run sequence-parallel: activations between blocks are
  sharded along the sequence (``Shard(1)``) and gathered to ``Replicate`` at the entry of the token mixer and MLP;
- the q/k/v (and HOLA's a/b gate and optional output-gate) projections are column-parallel, so each rank holds
  ``H / tp`` whole heads; ``o_proj`` is row-parallel and reduce-scatters back to sequence shards;
- per-head parameters (short-convolution channels, ``A_log``, ``dt_bias``, ``sink``, ``gate``) are sharded by head
  (``Shard(0)``); ``gamma_q``, ``gamma_k`` and the per-head output norm act on D and are replicated: each rank's
  gradient covers only its heads, so the forward reads them as local tensors whose gradient is ``Partial`` and
  is summed over the tensor-parallel ranks. The plan style :class:`HeadParallel` distributes them and records
  those placements on the module (``LocalParams.local_grad_placements``), which the model reads through
  ``param(name)``. The HOLA cache is per head, so it stays local to a rank.
- SwiGLU: ``w1``, ``w3`` column-parallel, ``w2`` row-parallel;
- embedding row-parallel over the vocabulary; output head column-parallel over the vocabulary with the logits
  left sharded for a loss-parallel cross-entropy (a tied head shares the embedding's vocabulary shards).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)


class HeadParallel(ParallelStyle):
    """A plan style for a module of the head-sharded region: distribute its parameters ``{name: placement}``
    over the mesh, and have its forward compute with their local tensors (``LocalParams``): a ``Shard``
    parameter's gradient is the local shard's; a ``Replicate`` one's is ``Partial`` (summed over the ranks,
    since each rank's heads give part of it)."""

    def __init__(self, placements: dict):
        super().__init__()
        self.placements = dict(placements)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        local = {}
        for name, placement in self.placements.items():
            if not hasattr(module, name):
                continue  # GDN has no cache parameters
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, device_mesh, [placement]),
                                                         requires_grad=param.requires_grad))
            local[name] = (Partial(),) if placement.is_replicate() else (placement,)
        module.local_grad_placements = local
        return module


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard ``model`` (a ``HolaTitanLM``) over ``tp_mesh`` in place (see the module docstring)."""
    args = model.args
    if args.n_heads % tp_mesh.size():
        raise ValueError(f"parallelism.tensor_parallel_degree: {args.n_heads} heads are not divisible by "
                         f"{tp_mesh.size()}")
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # The head needs whole sequences: gather the final norm's output.
        "norm": SequenceParallel(),
    }
    parallelize_module(model, tp_mesh, root_plan)
    parallelize_module(model.norm, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                                desired_output_layouts=Replicate(),
                                                                use_local_output=False))
    if model.output is not None:
        parallelize_module(model, tp_mesh, {"output": ColwiseParallel(input_layouts=Replicate(),
                                                                      output_layouts=Shard(-1),
                                                                      use_local_output=False)})
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True),
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if args.is_recurrent:
            plan["attn.a_proj"] = ColwiseParallel()
            plan["attn.b_proj"] = ColwiseParallel()
            if block.attn.g_proj is not None:
                plan["attn.g_proj"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)
        if args.is_recurrent:
            for name, style in _head_plan():
                parallelize_module(block.attn.get_submodule(name), tp_mesh, style)


def _head_plan() -> list[tuple[str, HeadParallel]]:
    """``(submodule of the mixer, style)``: its per-head parameters head-sharded, or replicated with partial
    gradients ("" is the mixer itself, which a plan dictionary cannot name beside its submodules)."""
    by_head = HeadParallel({"weight": Shard(0)})
    return [("q_conv", by_head), ("k_conv", by_head), ("v_conv", by_head),
            ("o_norm", HeadParallel({"weight": Replicate()})),
            ("", HeadParallel({"A_log": Shard(0), "dt_bias": Shard(0), "sink": Shard(0), "gate": Shard(0),
                               "gamma_q": Replicate(), "gamma_k": Replicate()}))]
