"""Apply parallelism to a ``HolaTitanLM`` built on the meta device, in one fixed order.

Order (each step needs the previous one's modules): float8 swap -> tensor parallel -> activation checkpointing
-> per-block ``torch.compile`` -> FSDP2 (blocks, then root). Context parallelism changes no module: its
per-batch view reaches the layers through ``forward`` (``hola_titan.parallelisms.context_parallel``). The model
code never sees ``torch.distributed``; everything distributed happens here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from hola_titan.parallelisms.float8 import apply_float8
from hola_titan.parallelisms.parallel_dims import Meshes, ParallelDims
from hola_titan.parallelisms.tensor_parallel import apply_tensor_parallel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize_model(model: nn.Module, *, dims: ParallelDims, mesh: Meshes | None, device: torch.device,
                      ac_mode: str, selective_ac_option: str, compile_enable: bool, compile_fullgraph: bool,
                      float8_enable: bool, param_dtype: str, reduce_dtype: str, cpu_offload: bool,
                      float8_recipe: str = "rowwise", float8_filter: tuple[str, ...] = ("output",)) -> nn.Module:
    """Apply the configured parallelisms in place and return the model (see the module docstring)."""
    if float8_enable:
        model.float8_converted = apply_float8(model, device=device, recipe=float8_recipe, filter_fqns=float8_filter)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh.named["tp"])
    if ac_mode != "none":
        apply_activation_checkpointing(model, mode=ac_mode, selective_option=selective_ac_option)
    if compile_enable:
        apply_compile(model, fullgraph=compile_fullgraph)
    if mesh is not None and (dims.fsdp_enabled or dims.hsdp_enabled):
        # On CPU, compute stays float32 whatever the config says: bf16 matmuls there are slow and inexact.
        compute = _DTYPES[param_dtype] if device.type == "cuda" else torch.float32
        apply_fsdp(model, mesh=_fsdp_mesh(mesh, dims), param_dtype=compute, reduce_dtype=_DTYPES[reduce_dtype],
                   cpu_offload=cpu_offload)
    return model


def _fsdp_mesh(mesh: Meshes, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards over: ``dp_shard_cp``, or ``[dp_replicate, dp_shard (x cp)]`` for HSDP."""
    if dims.hsdp_enabled:
        if dims.cp > 1:
            # Shard over (dp_shard, cp), replicate over dp_replicate.
            return mesh.named["hsdp_cp"] if dims.dp_shard > 1 else mesh.world["dp_replicate", "cp"]
        if dims.dp_shard == 1:
            # Replicate only: the mesh has no shard dimension, so FSDP2 shards over the replicate ranks. Same
            # function and gradients as replication (tested), ZeRO-3 memory and communication instead of DDP's.
            return mesh.named["dp_replicate"]
        return mesh.world["dp_replicate", "dp_shard"]
    return mesh.named["dp_shard_cp"]


def apply_activation_checkpointing(model: nn.Module, *, mode: str, selective_option: str) -> None:
    """Wrap blocks in activation checkpointing: every block (``full``) or every N-th (``selective`` with N)."""
    every, wrapper_kwargs = 1, {}
    if mode == "selective" and selective_option == "op":
        wrapper_kwargs["context_fn"] = _save_matmuls_context
    elif mode == "selective":
        if not selective_option.isdigit() or int(selective_option) < 1:
            raise ValueError("activation_checkpoint.selective_ac_option: expected 'op' or a positive integer N, got "
                             f"{selective_option!r}")
        every = int(selective_option)
    for index, (name, block) in enumerate(list(model.layers.items())):
        if index % every == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, **wrapper_kwargs)


# Op-level selective checkpointing keeps the outputs of matmuls and attention (expensive to recompute, and
# every other op of a block is cheap elementwise work) and recomputes the rest.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _save_matmuls_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls_context():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def apply_compile(model: nn.Module, *, fullgraph: bool) -> None:
    """Compile every block separately (repeated blocks share one compiled graph)."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=fullgraph)


def apply_fsdp(model: nn.Module, *, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               cpu_offload: bool) -> None:
    """FSDP2 on every block, then on the root (embeddings, final norm and head stay with the root, so a tied
    output head and the embedding are one parameter in one unit)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=mesh, mp_policy=policy)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right away by the root's backward: keep them gathered.
        fully_shard(block, reshard_after_forward=index < len(blocks) - 1, **kwargs)
    fully_shard(model, **kwargs)
    # The trainer calls ``flat_hidden_states`` (the chunked loss applies the head itself), evaluations
    # ``hidden_states``: register them so that FSDP's pre- and post-forward logic (unshard, backward hooks) runs
    # around them as around ``forward``.
    for method in ("hidden_states", "flat_hidden_states"):
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
