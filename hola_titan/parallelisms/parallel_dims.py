"""Parallel degrees and the device meshes built from them (torchtitan's ``ParallelDims`` layout).

The world is one mesh ``[dp_replicate, dp_shard, cp, tp]`` (dimensions of size 1 are left out). Flattened
views serve each purpose:

- ``dp``: ``dp_replicate x dp_shard``, the ranks that read different rows (data loading);
- ``dp_shard_cp``: ``dp_shard x cp``, the ranks FSDP shards over (context parallel is folded into FSDP);
- ``dp_cp``: ``dp_replicate x dp_shard x cp``, the ranks the loss and token counts are reduced over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Degrees whose product is the world size; ``build_mesh`` turns them into a ``DeviceMesh``."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "cp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism: degree {name} must be >= 1, got {getattr(self, name)}")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ValueError(f"parallelism: degrees multiply to {product}, but the world size is {self.world_size}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str) -> Meshes | None:
        """The world mesh with its flattened views, or None for one process without a process group."""
        if self.world_size == 1 and not dist.is_initialized():
            return None
        names, sizes = [], []
        for name, size in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("cp", self.cp),
                           ("tp", self.tp)):
            if size > 1:
                names.append(name)
                sizes.append(size)
        if not names:  # one rank in a process group: a 1-element mesh so the same code paths run
            names, sizes = ["dp_shard"], [1]
        world = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
        meshes = Meshes(world=world, named={name: world[name] for name in names})
        for flat, parts in (("dp", ("dp_replicate", "dp_shard")), ("dp_shard_cp", ("dp_shard", "cp")),
                            ("dp_cp", ("dp_replicate", "dp_shard", "cp"))):
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                # Flattened meshes are kept here: slicing them back out of the world mesh is deprecated.
                meshes.named[flat] = world[present]._flatten(mesh_dim_name=flat)
            elif len(present) == 1:
                meshes.named[flat] = world[present[0]]
        if self.dp_replicate > 1 and self.dp_shard > 1 and self.cp > 1:
            # HSDP with context parallelism shards over (dp_shard, cp) flattened and replicates over dp_replicate:
            # a 2-D mesh of an original and a flattened dimension, built as its own root (every rank builds the
            # same one) from the world layout [replicate, shard, cp, (tp)], cp varying fastest within a shard.
            shape = (self.dp_replicate, self.dp_shard * self.cp) + ((self.tp,) if self.tp > 1 else ())
            dim_names = ("dp_replicate", "dp_shard_cp") + (("tp",) if self.tp > 1 else ())
            root = DeviceMesh(device_type, world.mesh.reshape(shape), mesh_dim_names=dim_names)
            meshes.named["hsdp_cp"] = root["dp_replicate", "dp_shard_cp"] if self.tp > 1 else root
        return meshes


@dataclass
class Meshes:
    """The world mesh and its named (possibly flattened) one-dimensional views."""

    world: DeviceMesh
    named: dict[str, DeviceMesh]


def submesh(meshes: Meshes | None, name: str) -> DeviceMesh | None:
    """The mesh dimension or flattened view ``name``, or None when it does not exist."""
    if meshes is None:
        return None
    return meshes.named.get(name)


def mesh_rank_and_size(mesh: Meshes | None, name: str) -> tuple[int, int]:
    """This rank's coordinate and the size of dimension ``name`` (0, 1 when it does not exist)."""
    sub = submesh(mesh, name)
    if sub is None:
        return 0, 1
    return sub.get_local_rank(), sub.size()


def end_process_group(*, barrier: bool = True) -> None:
    """Leave the default process group, if one is up: a barrier first (with ``barrier``), so that no rank is still
    inside a collective, then ``destroy_process_group``. Free meshes and groups before calling it: a device mesh
    still alive when gloo is destroyed, or a rank still finishing a collective, made gloo abort the process now and
    then (std::terminate, seen with 2-4 CPU ranks)."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
