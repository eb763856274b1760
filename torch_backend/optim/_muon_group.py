"""Muon's NS group of a sharded matrix: the devices its pieces are spread over, and what each one holds.

FSDP ragged-shards a matrix over one mesh dim (its ``RaggedShard``) and tensor parallelism splits it over
others (``Shard(dim)``), so a piece of it sits on every device of those mesh dims together: its *NS
group*, those mesh dims flattened (member ``k`` is group rank ``k`` of a torch process group over them;
HSDP's ``Replicate`` dims hold copies, and each replica's group runs the same Newton-Schulz). NS devices
and split groups are members' indices. Member ``k`` holds the range ``RaggedShard.ranges(box)`` of its
TP part (the box); the core maps that to intervals of the whole matrix (``ragged.box_intervals``), so
the core's transfer plans move the matrix whole to one member and back, whatever the TP split.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import ragged
from torch_backend.placement import RaggedShard
from torch_backend.placement._dtensor import box_offset


@dataclass(frozen=True, eq=False)  # one per (mesh, dims), compared and hashed by identity
class NSGroup:
    """The devices of one mesh's ``dims`` that hold pieces of a matrix, as one process group."""

    mesh: DeviceMesh
    dims: tuple[int, ...]  # the RaggedShard and Shard mesh dims, ascending
    group: dist.ProcessGroup
    rank: int  # this device's member index (its group rank)
    members: tuple[tuple[int, ...], ...]  # every member's mesh coordinate, by member index

    @property
    def world(self) -> int:
        return len(self.members)


def group_dims(p: torch.Tensor) -> tuple[int, ...]:
    """The mesh dims a matrix's pieces are spread over: its RaggedShard and Shard ones (none: whole here)."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(i for i, q in enumerate(p.placements) if isinstance(q, (RaggedShard, Shard)))


def new_ns_group(mesh: DeviceMesh, dims: tuple[int, ...]) -> NSGroup:
    """The NS group over ``dims`` of ``mesh`` that holds this device.

    One mesh dim is the mesh's own group. Several are flattened: every rank of the job learns every
    rank's slice (one ``all_gather_object``: a sub-mesh, e.g. one pipeline stage's, knows only its own
    ranks) and calls ``new_group`` for each, in the same order (as ``new_group`` needs), keeping its own.
    """
    me = dist.get_rank()
    coordinate = tuple(mesh.get_coordinate())
    if len(dims) == 1:
        d = dims[0]
        members = tuple(coordinate[:d] + (i,) + coordinate[d + 1:] for i in range(mesh.size(d)))
        return NSGroup(mesh, dims, mesh.get_group(d), mesh.get_local_rank(d), members)
    others = [d for d in range(mesh.ndim) if d not in dims]
    rows = mesh.mesh.permute(*others, *dims).reshape(-1, math.prod(mesh.size(d) for d in dims)).tolist()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, next(tuple(r) for r in rows if me in r))
    mine = None
    for ranks in sorted(set(every)):
        group = dist.new_group(list(ranks))
        if me in ranks:
            mine = group
    # every mesh coordinate, row-major as mesh.mesh.flatten(); member k is the one at group rank k
    where = dict(zip(mesh.mesh.flatten().tolist(), itertools.product(*(range(n) for n in mesh.shape))))
    members = tuple(where[dist.get_global_rank(mine, k)] for k in range(dist.get_world_size(mine)))
    return NSGroup(mesh, dims, mine, dist.get_rank(mine), members)


def holdings(p: DTensor, ns: NSGroup, name: str) -> ragged.Holdings:
    """What each member of ``ns`` holds of matrix ``p``: intervals of its flat storage, in local order."""
    shape, placements = tuple(p.shape), p.placements
    ragged_dims = [d for d in ns.dims if isinstance(placements[d], RaggedShard)]
    out = []
    for coordinate in ns.members:
        box, offset = box_offset(shape, ns.mesh, placements, coordinate)
        start, stop = (placements[ragged_dims[0]].core.ranges(box, name)[coordinate[ragged_dims[0]]]
                       if ragged_dims else (0, math.prod(box)))
        out.append(ragged.box_intervals(shape, offset, box, start, stop))
    return tuple(out)
