"""Small helpers for RaggedShard DTensors: make one from a local tensor, cut a full tensor's local piece.

The FSDP runtime, Muon and the DTensor patches (``_dtensor_patches``) build on these. They read torch's
private DTensor types from ``torch_backend._torch_internals`` and patch nothing.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from torch_backend._torch_internals import DTensorSpec, TensorMeta, compute_local_shape_and_global_offset
from torch_backend.placement._placement import RaggedShard, ragged_mesh_dim


def has_ragged(placements: Sequence[Placement]) -> bool:
    """Whether any mesh dim holds a RaggedShard."""
    return any(isinstance(p, RaggedShard) for p in placements)


def boxes(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]):
    """(this device's box shape, every box shape on the mesh) for the non-ragged placements.

    Uses torch's own ``_compute_local_shape_and_global_offset``, which skips placements that are not
    Shard, so a RaggedShard (and Replicate/Partial) leave the box whole on their mesh dims.
    """
    shape, placements = tuple(shape), tuple(placements)
    if not any(isinstance(p, Shard) for p in placements):
        return shape, [shape]  # every 1-D FSDP mesh: the box is the tensor
    return _shard_boxes(shape, mesh, placements, tuple(mesh.get_coordinate() or ()))


@functools.lru_cache(maxsize=4096)
def _shard_boxes(shape, mesh, placements, mine):
    # Every box on the mesh is checked on every rank, so all ranks raise the same error (no hang).
    everything = sorted(
        {
            tuple(compute_local_shape_and_global_offset(shape, mesh.shape, list(c), placements)[0])
            for c in itertools.product(*(range(n) for n in mesh.shape))
        }
    )
    own = (
        compute_local_shape_and_global_offset(shape, mesh.shape, list(mine), placements)[0]
        if mine
        else shape
    )
    return tuple(own), everything


def box_offset(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement], coordinate):
    """(box shape, box global offset) of the device at ``coordinate``."""
    local, offset = compute_local_shape_and_global_offset(
        tuple(shape), mesh.shape, list(coordinate), placements
    )
    return tuple(local), tuple(offset)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def make_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    requires_grad: bool = False,
) -> DTensor:
    """A DTensor from a local tensor and its global shape, without autograd history (a leaf)."""
    spec = DTensorSpec(
        mesh,
        tuple(placements),
        tensor_meta=TensorMeta(torch.Size(shape), contiguous_stride(shape), local.dtype),
    )
    return DTensor(local, spec, requires_grad=requires_grad)


def local_piece(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This device's flat local slice of a full (global-shaped) tensor, without communication."""
    m = ragged_mesh_dim(placements)
    box, offset = box_offset(full.shape, mesh, placements, mesh.get_coordinate())
    boxed = full[tuple(slice(o, o + n) for o, n in zip(offset, box))]
    a, b = placements[m].core.ranges(box)[mesh.get_local_rank(m)]
    return boxed.reshape(-1)[a:b]
