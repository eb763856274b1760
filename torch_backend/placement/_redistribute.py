"""Execute the core's redistribution plans for RaggedShard DTensors with plain torch collectives.

The core (``ragged.transfers``) says which flat intervals move between which devices; this module
only executes those plans on one mesh dim at a time. It uses collectives that gloo and NCCL both
accept: ``all_to_all_single`` with uneven splits (RaggedShard <-> Shard / RaggedShard), an equal-size
``all_gather_into_tensor`` over padded locals (-> Replicate), ``broadcast`` (one device holds it all
-> Replicate) and a padded ``reduce_scatter_tensor`` (Partial -> RaggedShard). Buffers are created
on the local tensor's device, so the device always comes from the mesh.

A RaggedShard on mesh dim ``m`` applies to the *box*: the sub-tensor that the placements on the other
mesh dims (Shard / Replicate / Partial) leave to this device. Its local tensor is the flat slice of the
box's row-major storage. With a 1-D mesh the box is the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

import ragged
from torch_backend._collectives import all_gather_flat, all_to_all, reduce_scatter_flat, side_stream
from torch_backend.placement._placement import RaggedShard, ragged_mesh_dim

Shape = tuple[int, ...]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided by the group size afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def validate(
    placements: Sequence[Placement],
    mesh: DeviceMesh,
    shape: Shape,
    box_shapes: Sequence[Shape],
    name: str = "tensor",
) -> None:
    """Check a placement tuple on every box it may see, so that every rank raises the same error.

    Args:
        placements: one placement per mesh dim.
        mesh: the device mesh.
        shape: the global shape.
        box_shapes: every box shape the RaggedShard can see (one per coordinate of the other dims).
        name: the tensor's name for error messages.

    Raises:
        ragged.PlacementError: two RaggedShards, a wrong number of blocks, or blocks that cut a sub-tensor.
    """
    if len(placements) != mesh.ndim:
        raise ragged.PlacementError(
            f"{name}: {len(placements)} placements {tuple(placements)} for a {mesh.ndim}-D mesh"
        )
    m = ragged_mesh_dim(placements, name)
    if m is None:
        return
    core = placements[m].core
    for box in box_shapes:
        where = name if tuple(box) == tuple(shape) else f"{name} (box {tuple(box)} of shape {tuple(shape)})"
        core.validate(tuple(box), where, world_size=mesh.size(m))


def local_numel_shape(placement: Placement, box: Shape, world: int, rank: int) -> Shape:
    """The local tensor's shape for one mesh dim's placement applied to ``box``."""
    if isinstance(placement, RaggedShard):
        return placement.core.local_shape(box, rank)
    if isinstance(placement, Shard):
        out = list(box)
        out[placement.dim] = ragged.chunk_sizes(box[placement.dim], world)[rank]
        return tuple(out)
    return tuple(box)


def holdings(placement: Placement, box: Shape, world: int) -> ragged.Holdings:
    """The core's holdings of ``placement`` on one mesh dim of ``world`` devices."""
    if isinstance(placement, RaggedShard):
        return ragged.ragged_holdings(placement.core, box)
    if isinstance(placement, Shard):
        return ragged.shard_holdings(box, placement.dim, world)
    if isinstance(placement, Replicate):
        return ragged.replicate_holdings(math.prod(box), world)
    raise NotImplementedError(f"no holdings for placement {placement}")


def redistribute_dim(
    local: torch.Tensor,
    box: Shape,
    src: Placement,
    dst: Placement,
    mesh: DeviceMesh,
    mesh_dim: int,
) -> torch.Tensor:
    """Change the placement of one mesh dim from ``src`` to ``dst``, where one of them is a RaggedShard.

    Mechanism: Partial -> RaggedShard is a padded reduce-scatter. Otherwise the core's holdings of
    both placements are intersected (``ragged.transfers``) and the plan is executed: a broadcast when
    one device holds everything and the target is Replicate, a padded all-gather for other targets
    that are Replicate, else one ``all_to_all_single`` that carries only the intervals that change
    hands (elements already on the right device are copied locally). No collective runs when no
    element changes device (for example Replicate -> RaggedShard, a local slice).

    Args:
        local: this device's local tensor for ``src`` (its box-level view).
        box: the shape the mesh dim's placement applies to.
        src: the current placement on ``mesh_dim``.
        dst: the target placement on ``mesh_dim``.
        mesh: the device mesh.
        mesh_dim: the mesh dim that changes.

    Returns:
        The local tensor for ``dst`` (1-D for a RaggedShard, the chunk shape for Shard, ``box`` for
        Replicate).
    """
    world = mesh.size(mesh_dim)
    rank = mesh.get_local_rank(mesh_dim)
    group = mesh.get_group(mesh_dim)
    out_shape = local_numel_shape(dst, box, world, rank)
    if isinstance(src, Partial):
        if not isinstance(dst, RaggedShard):
            raise NotImplementedError(f"Partial -> {dst} is torch's own path")
        return _reduce_scatter(local, box, src, dst, group, rank, world).view(out_shape)
    flat = local.contiguous().view(-1)
    src_h = holdings(src, box, world)
    dst_h = holdings(dst, box, world)
    if isinstance(dst, Replicate):
        return _gather(flat, src_h, math.prod(box), group, rank, world).view(out_shape)
    plan = ragged.transfers(src_h, dst_h)
    return start_all_to_all(flat, plan, math.prod(out_shape), group, rank, world)().view(out_shape)


def start_all_to_all(
    flat: torch.Tensor,
    plan: Sequence[ragged.Transfer],
    out_numel: int,
    group: dist.ProcessGroup,
    rank: int,
    world: int,
    *,
    stream: torch.cuda.Stream | None = None,
    what: str = "redistribute",
) -> Callable[[], torch.Tensor]:
    """Issue ``plan`` as one asynchronous ``all_to_all_single``; calling the result finishes it.

    Transfers that stay on this device are copied now; the finisher waits for the exchange, unpacks what
    arrived and returns the local output (``out_numel`` elements). On CUDA with ``stream`` the packing and
    the exchange run on that stream after the current stream's work, and finishing makes the then current
    stream wait for them (``side_stream``); on CPU the exchange runs on the backend's own thread.

    The side stream reads ``flat`` (packing), so the finisher holds it until the current stream waits
    for that read: a caller that drops ``flat`` (a temporary ``torch.cat``, Newton-Schulz's output) cannot
    have its memory handed to the current stream's next kernels while the side stream still reads it.
    ``flat`` must not be written before the finisher is called.
    """
    out = flat.new_empty(out_numel)
    for t in plan:
        if t.src == rank and t.dst == rank:
            out[t.dst_offset : t.dst_offset + t.length] = flat[t.src_offset : t.src_offset + t.length]
    if all(t.src == t.dst for t in plan):
        return lambda: out  # every rank sees the same plan, so every rank skips the collective
    # Both sides walk the same sorted plan, so transfers between one pair arrive in the order they left.
    sends = [t for t in plan if t.src == rank and t.dst != rank]
    recvs = [t for t in plan if t.dst == rank and t.src != rank]
    in_splits = [sum(t.length for t in sends if t.dst == d) for d in range(world)]
    out_splits = [sum(t.length for t in recvs if t.src == s) for s in range(world)]
    with side_stream(stream):
        send_buf = (
            torch.cat([flat[t.src_offset : t.src_offset + t.length] for t in sorted(sends, key=_by_dst)])
            if sends
            else flat.new_empty(0)
        )
        recv_buf = flat.new_empty(sum(out_splits))
        pending = all_to_all(recv_buf, send_buf, out_splits, in_splits, group, label=what)

    def finish() -> torch.Tensor:
        nonlocal flat
        pending.wait()  # the current stream now waits for the side stream, hence for its read of flat,
        flat = None  # so flat's memory may go back to the current stream's pool
        pos = 0
        for t in sorted(recvs, key=_by_src):
            out[t.dst_offset : t.dst_offset + t.length] = recv_buf[pos : pos + t.length]
            pos += t.length
        return out

    return finish


def _by_dst(t: ragged.Transfer) -> tuple[int, int]:
    return (t.dst, t.src_offset)


def _by_src(t: ragged.Transfer) -> tuple[int, int]:
    return (t.src, t.src_offset)


def _gather(
    flat: torch.Tensor,
    src_h: ragged.Holdings,
    numel: int,
    group: dist.ProcessGroup,
    rank: int,
    world: int,
) -> torch.Tensor:
    sizes = [sum(b - a for a, b in h) for h in src_h]
    holders = [i for i, n in enumerate(sizes) if n]
    if len(holders) == 1 and sizes[holders[0]] == numel:
        # One device holds everything (one-hot blocks): a broadcast moves numel, not world * numel.
        out = flat.clone() if sizes[rank] else flat.new_empty(numel)
        dist.broadcast(out, group=group, group_src=holders[0])
        return out
    pad = max(sizes)
    padded = flat.new_zeros(pad)
    padded[: flat.numel()] = flat
    gathered = flat.new_empty(world * pad)
    all_gather_flat(gathered, padded, group=group)
    out = flat.new_empty(numel)
    for s, intervals in enumerate(src_h):
        pos = s * pad
        for a, b in intervals:
            out[a:b] = gathered[pos : pos + b - a]
            pos += b - a
    return out


def _reduce_scatter(
    local: torch.Tensor,
    box: Shape,
    src: Partial,
    dst: RaggedShard,
    group: dist.ProcessGroup,
    rank: int,
    world: int,
) -> torch.Tensor:
    if src.reduce_op not in _REDUCE_OPS:
        raise NotImplementedError(f"Partial({src.reduce_op}) -> {dst}: only sum/avg/max/min reduce")
    ranges = dst.core.ranges(box)
    pad = max(b - a for a, b in ranges)
    flat = local.contiguous().view(-1)
    send = flat.new_zeros(world * pad)
    for i, (a, b) in enumerate(ranges):
        send[i * pad : i * pad + b - a] = flat[a:b]
    recv = flat.new_empty(pad)
    reduce_scatter_flat(recv, send, op=_REDUCE_OPS[src.reduce_op], group=group)
    a, b = ranges[rank]
    out = recv[: b - a]
    if src.reduce_op == "avg":
        out = out / world
    return out.clone()


def redistribute(
    local: torch.Tensor,
    mesh: DeviceMesh,
    shape: Shape,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    *,
    native,
    boxes,
    name: str = "tensor",
) -> torch.Tensor:
    """Redistribute a local tensor between placement tuples where at least one holds a RaggedShard.

    Mechanism: when only one mesh dim changes and the change can be read inside the box left by the
    other mesh dims, it is one ``redistribute_dim`` step (every 1-D mesh takes this path). Otherwise the
    source RaggedShard dim is first gathered to Replicate inside its box, torch's own redistribute
    (``native``) moves the remaining standard placements, and the target RaggedShard dim is cut out
    of its box locally.

    Args:
        local: this device's local tensor under ``src``.
        mesh: the device mesh.
        shape: the global shape.
        src: the current placements.
        dst: the target placements.
        native: ``native(local, src, dst)``, torch's redistribute for placements without RaggedShard.
        boxes: ``boxes(placements)`` -> (this device's box shape, every box shape on the mesh).
        name: the tensor's name for error messages.

    Raises:
        ragged.PlacementError: on every rank, before any collective, if a placement cannot hold ``shape``.
    """
    src, dst = tuple(src), tuple(dst)
    for placements in (src, dst):
        validate(placements, mesh, shape, boxes(placements)[1], name)
    m_src = ragged_mesh_dim(src)
    if m_src is not None:
        expected = src[m_src].core.local_numel(boxes(src)[0], mesh.get_local_rank(m_src))
        if local.numel() != expected:
            raise ragged.PlacementError(
                f"{name}: this rank's local tensor has {local.numel()} elements but {src[m_src]} gives it "
                f"{expected} (was it built with DTensor.from_local from another layout?)"
            )
    if src == dst:
        return local
    diff = [i for i in range(mesh.ndim) if src[i] != dst[i]]
    if len(diff) == 1 and _box_local(src, dst, diff[0]):
        m = diff[0]
        box = boxes(tuple(Replicate() if i == m else p for i, p in enumerate(src)))[0]
        return redistribute_dim(local, box, src[m], dst[m], mesh, m)
    cur, cur_placements = local, list(src)
    if m_src is not None:
        cur = redistribute_dim(cur, boxes(src)[0], src[m_src], Replicate(), mesh, m_src)
        cur_placements[m_src] = Replicate()
    mid = list(dst)
    m_dst = ragged_mesh_dim(dst)
    if m_dst is not None:
        mid[m_dst] = Replicate()
    cur = native(cur, tuple(cur_placements), tuple(mid))
    if m_dst is not None:
        cur = redistribute_dim(cur, boxes(tuple(mid))[0], Replicate(), dst[m_dst], mesh, m_dst)
    return cur


def _box_local(src: tuple[Placement, ...], dst: tuple[Placement, ...], m: int) -> bool:
    """Whether changing mesh dim ``m`` alone can run inside the box of the other mesh dims.

    True when one side is a RaggedShard and the other is Replicate, a RaggedShard, Partial (source
    only), or a Shard whose tensor dim no earlier mesh dim also shards (torch applies Shards on the
    same tensor dim left to right, so a later mesh dim's chunk is not the chunk of the box).
    """
    s, d = src[m], dst[m]
    if not (isinstance(s, RaggedShard) or isinstance(d, RaggedShard)):
        return False
    if isinstance(d, Partial) or (isinstance(s, Partial) and type(s) is not Partial):
        # Partial subclasses (norm partials, masked partials) reduce in their own way: torch's path.
        return False
    shard = s if isinstance(s, Shard) else d if isinstance(d, Shard) else None
    if shard is None:
        return True
    return not any(isinstance(p, Shard) and p.dim == shard.dim for j, p in enumerate(src) if j != m and j > m)


def infer_global_numel(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> int:
    """The global numel of ``from_local`` without ``shape``: the flat 1-D tensor the locals tile.

    Mechanism: a device with ``n > 0`` blocks knows the block size (``local.numel() / n``); when some
    device has zero blocks every device of the mesh dim takes the max over the group (all devices know
    ``local_units``, so all of them join the same collective). Shard(0) on other mesh dims sums the boxes.

    Raises:
        ragged.PlacementError: if the RaggedShard has more than one dim (no 1-D shape fits it) or the
            local numel is not a multiple of this device's block count.
    """
    m = ragged_mesh_dim(placements)
    core = placements[m].core
    if len(core.dims) > 1:
        raise ragged.PlacementError(
            f"from_local: the global shape of a RaggedShard with dims={core.dims} cannot be inferred from "
            "a flat local tensor (only a 1-D shape can); pass shape= and stride="
        )
    rank = mesh.get_local_rank(m)
    blocks = core.local_units[rank]
    if blocks and local.numel() % blocks:
        raise ragged.PlacementError(
            f"from_local: local numel {local.numel()} is not a multiple of this device's "
            f"{blocks} blocks (local_units={core.local_units})"
        )
    block = local.numel() // blocks if blocks else 0
    if 0 in core.local_units:
        t = torch.tensor([block], dtype=torch.int64, device=local.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(m))
        block = int(t.item())
    numel = block * sum(core.local_units)
    for j, p in enumerate(placements):
        if j != m and isinstance(p, Shard):
            t = torch.tensor([numel], dtype=torch.int64, device=local.device)
            dist.all_reduce(t, group=mesh.get_group(j))
            numel = int(t.item())
    return numel


def check_local_numel(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: Shape, box: Shape
) -> None:
    """Check every rank's RaggedShard local size with one all_gather, so every rank raises the same error.

    Raises:
        ragged.PlacementError: on every rank of the mesh, if any rank's local numel differs from the
            one the layout gives it (for ``DTensor.from_local``).
    """
    m = ragged_mesh_dim(placements)
    rank = mesh.get_local_rank(m)
    mine = torch.tensor(
        [local.numel(), placements[m].core.local_numel(box, rank)], dtype=torch.int64, device=mesh.device_type
    )
    every = mine.new_empty(mesh.size(m) * 2)
    all_gather_flat(every, mine, group=mesh.get_group(m))
    pairs = every.view(-1, 2).tolist()
    wrong = {r: (got, want) for r, (got, want) in enumerate(pairs) if got != want}
    anywhere = torch.tensor([len(wrong)], dtype=torch.int64, device=mesh.device_type)
    for j in range(mesh.ndim):
        if j != m:
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=mesh.get_group(j))
    if wrong or anywhere.item():
        where = ", ".join(f"index {r} has {a} elements, its blocks give {b}" for r, (a, b) in wrong.items())
        where = where or "a rank on another slice of the mesh has a local of the wrong size"
        raise ragged.PlacementError(
            f"from_local: local tensors do not match {placements[m]} of shape {tuple(shape)} on mesh dim {m} "
            f"({where}); build each rank's local as the flat slice its blocks give it"
        )
