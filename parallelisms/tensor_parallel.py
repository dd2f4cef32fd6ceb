"""Tensor parallelism (Megatron-style, head-sharded) with sequence parallelism for the norms.

Per block, for every flavour:

- ``attention_norm``, ``ffn_norm`` (and the final ``norm``) run sequence-parallel: activations between blocks are
  sharded along the sequence (``Shard(1)``) and gathered to ``Replicate`` at the entry of the token mixer and MLP;
- the q/k/v (and HOLA's a/b gate and optional output-gate) projections are column-parallel, so each rank holds
  ``H / tp`` whole heads; ``o_proj`` is row-parallel and reduce-scatters back to sequence shards;
- per-head parameters (short-convolution channels, ``A_log``, ``dt_bias``, ``sink``, ``gate``) are sharded by head
  (``Shard(0)``); ``gamma_q``, ``gamma_k`` and the per-head output norm act on D and are replicated: each rank's
  gradient covers only its heads, so the forward reads them as local tensors whose gradient is ``Partial`` and
  is summed over the tensor-parallel ranks. The HOLA cache is per head, so it stays local to a rank.
- SwiGLU: ``w1``, ``w3`` column-parallel, ``w2`` row-parallel;
- embedding row-parallel over the vocabulary; output head column-parallel over the vocabulary with the logits
  left sharded for a loss-parallel cross-entropy (a tied head shares the embedding's vocabulary shards).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)


def local_view(param):
    """The tensor a head-sharded forward computes with: the local shard of a ``Shard`` parameter, or the local
    copy of a ``Replicate`` parameter whose gradient is ``Partial`` (summed over the tensor-parallel ranks)."""
    if not isinstance(param, DTensor):
        return param
    if all(p.is_replicate() for p in param.placements):
        return param.to_local(grad_placements=tuple(Partial() for _ in param.placements))
    return param.to_local()


def _distribute_param(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = getattr(module, name)
    module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                                                 requires_grad=param.requires_grad))


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
            _shard_heads(block.attn, tp_mesh)


def _shard_heads(mixer: nn.Module, mesh: DeviceMesh) -> None:
    """Per-head parameters of a HOLA/GDN mixer: head-sharded or replicated with partial gradients."""
    for conv in (mixer.q_conv, mixer.k_conv, mixer.v_conv):
        _distribute_param(conv, "weight", mesh, Shard(0))
        conv.param_view = local_view
    for name in ("A_log", "dt_bias", "sink", "gate"):
        if hasattr(mixer, name):
            _distribute_param(mixer, name, mesh, Shard(0))
    for name in ("gamma_q", "gamma_k"):
        if hasattr(mixer, name):
            _distribute_param(mixer, name, mesh, Replicate())
    _distribute_param(mixer.o_norm, "weight", mesh, Replicate())
    mixer.o_norm.param_view = local_view
    mixer.param_view = local_view
