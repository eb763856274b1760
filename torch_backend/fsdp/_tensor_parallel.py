"""Parameters that tensor parallelism already made DTensors: what ``fully_shard`` accepts, and their meshes.

torchtitan applies TP first (``parallelize_module(model, mesh["tp"], plan)``) and FSDP after
(``fully_shard(block, mesh=mesh["dp"])``), so a unit may hold parameters that are DTensors on a TP mesh
cut from the same mesh as the data-parallel one. As in FSDP2, FSDP then shards each TP rank's *local*
tensor: the planner packs the TP-local shapes, the sharded parameter is a DTensor on the joined
``(dp..., tp)`` mesh whose RaggedShard applies to the TP rank's box (the placement layer's box rule,
``placement/_redistribute.py``), and the unsharded parameter seen in forward is again a DTensor on the
TP mesh with its TP placement, so the TP module hooks keep working. Only ``Shard(d)`` and ``Replicate``
compose this way; everything else is refused here, before any collective, with the same message on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from torch_backend._torch_internals import source_mesh


def shard_dims_split(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                     placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """``shape`` with each ``Shard(d)`` mesh dim's split applied (even splits); other placements, our
    ``RaggedShard`` among them, leave it whole."""
    out = list(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            out[p.dim] //= size
    return tuple(out)


@dataclass(frozen=True)
class TensorParallel:
    """How one parameter is split by tensor parallelism (its DTensor spec before ``fully_shard``)."""

    mesh: DeviceMesh  # the TP mesh (cut from the same mesh as the data-parallel mesh)
    placements: tuple[Placement, ...]  # Shard(d) or Replicate, one per TP mesh dim
    shape: tuple[int, ...]  # the global shape

    @property
    def sharded(self) -> bool:
        """Each TP rank holds a different part (its gradient norm is summed over the TP ranks)."""
        return any(isinstance(p, Shard) for p in self.placements)

    def local_shape(self) -> tuple[int, ...]:
        """The TP-local shape, the same on every TP rank (``check`` refuses uneven splits)."""
        return shard_dims_split(self.shape, tuple(self.mesh.shape), self.placements)


def tensor_parallel(name: str, param: torch.Tensor, dp_mesh: DeviceMesh) -> TensorParallel | None:
    """The TP split of parameter ``name`` (None for a plain tensor), checked against ``dp_mesh``.

    Raises:
        ValueError: a DTensor ``fully_shard`` cannot compose with; the message names the parameter and
            the rule broken.
    """
    if not isinstance(param, DTensor):
        return None
    tp = TensorParallel(param.device_mesh, tuple(param.placements), tuple(param.shape))
    where = f"fully_shard: parameter {name!r} is a DTensor {tp.placements} on mesh {_describe(tp.mesh)}"
    if tp.mesh.ndim != 1:
        raise ValueError(f"{where}; fully_shard composes with a 1-D TP mesh only (one TP group per unit)")
    for p in tp.placements:
        if type(p) not in (Shard, Replicate):  # _StridedShard subclasses Shard: refused too
            raise ValueError(
                f"{where}; fully_shard composes with tensor parallelism's Shard(dim) and Replicate only, not "
                f"{p!r} (a Partial parameter has no value of its own to shard, a strided or ragged one is "
                "already sharded by data parallelism)")
    for size, p in zip(tp.mesh.shape, tp.placements):
        dim = p.dim % len(tp.shape) if isinstance(p, Shard) else None
        if dim is not None and tp.shape[dim] % size:
            raise ValueError(
                f"{where}; its dim {dim} of size {tp.shape[dim]} does not split evenly over {size} TP ranks: "
                "every TP rank's local tensor must have the same shape (the unit's one layout packs it); "
                "pad the dim to a multiple of the TP degree")
    dp_names, tp_names = _names(dp_mesh), _names(tp.mesh)
    if dp_names is None or tp_names is None or source_mesh(dp_mesh) != source_mesh(tp.mesh):
        raise ValueError(
            f"{where}, but the data-parallel mesh is {_describe(dp_mesh)}; both must be named sub-meshes of "
            "one device mesh (e.g. mesh['dp'] and mesh['tp'] of init_device_mesh(..., mesh_dim_names=("
            "'dp', 'tp')))")
    if set(dp_names) & set(tp_names):
        raise ValueError(f"{where}, which shares the dims {sorted(set(dp_names) & set(tp_names))} with the "
                         f"data-parallel mesh {_describe(dp_mesh)}; FSDP shards over dims TP does not use")
    return tp


def check_one_tp_mesh(name: str, tps: list[TensorParallel | None]) -> None:
    """One unit, one TP mesh: its gradient norm and its joined mesh are taken over one TP group."""
    meshes = {tp.mesh for tp in tps if tp is not None}
    if len(meshes) > 1:
        raise ValueError(f"fully_shard: unit {name!r} holds DTensor parameters on {len(meshes)} different TP "
                         f"meshes ({', '.join(_describe(m) for m in meshes)}); shard each group of them in "
                         "its own fully_shard call")


def joined_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The ``(dp..., tp...)`` mesh of a sharded TP parameter, cut from the mesh both come from."""
    names = _names(dp_mesh) + _names(tp_mesh)
    root = source_mesh(dp_mesh)
    return root if names == root.mesh_dim_names else root[names]


def _names(mesh: DeviceMesh) -> tuple[str, ...] | None:
    return tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None


def _describe(mesh: DeviceMesh) -> str:
    return f"{tuple(mesh.shape)} named {_names(mesh)}"
