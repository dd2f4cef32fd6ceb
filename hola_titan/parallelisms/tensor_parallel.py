"""Tensor parallelism (Megatron-style, head-sharded) with sequence parallelism for the norms.

Per block, for every flavour (the token mixer's part is what its class declares: ``TP_COLWISE``, ``TP_ROWWISE``,
``TP_PER_HEAD``; ``hola_titan.models.flavours``):

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
        mixer = block.attn
        plan = {
            "attention_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True),
            # The mixer's own projections, as its class declares them (absent optional ones are skipped).
            **{f"attn.{name}": ColwiseParallel() for name in mixer.TP_COLWISE if getattr(mixer, name) is not None},
            **{f"attn.{name}": RowwiseParallel(output_layouts=Shard(1)) for name in mixer.TP_ROWWISE},
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)
        for name, style in _head_plan(mixer.TP_PER_HEAD):
            parallelize_module(mixer.get_submodule(name), tp_mesh, style)


_PLACEMENTS = {"shard": Shard(0), "replicate": Replicate()}


def _head_plan(per_head: dict[str, dict[str, str]]) -> list[tuple[str, HeadParallel]]:
    """``(submodule of the mixer, style)`` from the mixer's ``TP_PER_HEAD``: its per-head parameters head-sharded
    (``shard``), or replicated with partial gradients (``replicate``; "" is the mixer itself, which a plan
    dictionary cannot name beside its submodules)."""
    return [(name, HeadParallel({param: _PLACEMENTS[kind] for param, kind in params.items()}))
            for name, params in per_head.items()]
