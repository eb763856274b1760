"""Redistribution plans: which flat intervals of a tensor move between which devices.

Every placement of a tensor on one mesh dim is described by its *holdings*: for each device, the
sorted, disjoint half-open intervals of the tensor's flattened row-major storage that it holds. A
device's local tensor, flattened, is the concatenation of its intervals in order (true for
``RaggedShard``, for ``Shard(d)`` with torch's ``chunk`` rule, and for ``Replicate``).

``transfers(src, dst)`` intersects two holdings and says, for every pair of devices, which local
ranges to send and where they land. Backends only execute these plans.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ragged._errors import PlacementError
from ragged._placement import RaggedShard

Interval = tuple[int, int]
Holdings = tuple[tuple[Interval, ...], ...]  # per device, sorted disjoint intervals


class Transfer(NamedTuple):
    """Move ``length`` elements from ``src``'s local offset ``src_offset`` to ``dst``'s ``dst_offset``."""

    src: int
    dst: int
    src_offset: int
    dst_offset: int
    length: int


def ragged_holdings(placement: RaggedShard, shape: tuple[int, ...], name: str = "tensor") -> Holdings:
    """Holdings of a ``RaggedShard``: one interval per device that holds anything."""
    return tuple(((a, b),) if b > a else () for a, b in placement.ranges(shape, name))


def chunk_sizes(size: int, world_size: int) -> tuple[int, ...]:
    """torch.chunk's rule: chunks of ``ceil(size / m)``, the last ones smaller or empty."""
    if world_size < 1 or size < 0:
        raise PlacementError(f"chunk_sizes: need size >= 0 and world_size >= 1, got {size}, {world_size}")
    step = -(-size // world_size) if size else 0
    return tuple(max(0, min(step, size - i * step)) for i in range(world_size))


def shard_holdings(shape: tuple[int, ...], dim: int, world_size: int) -> Holdings:
    """Holdings of ``Shard(dim)``: per outer index, one contiguous chunk of ``dim``."""
    if not 0 <= dim < len(shape):
        raise PlacementError(f"Shard({dim}) is out of range for shape {tuple(shape)}")
    outer = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1:])
    size = shape[dim]
    out = []
    start = 0
    for n in chunk_sizes(size, world_size):
        lo, hi = start * inner, (start + n) * inner
        start += n
        out.append(tuple((o * size * inner + lo, o * size * inner + hi) for o in range(outer) if hi > lo))
    return tuple(out)


def replicate_holdings(numel: int, world_size: int) -> Holdings:
    """Holdings of ``Replicate``: every device holds the whole tensor."""
    return tuple(((0, numel),) if numel else () for _ in range(world_size))


def box_intervals(shape: tuple[int, ...], offset: tuple[int, ...], box: tuple[int, ...],
                  start: int = 0, stop: int | None = None) -> tuple[Interval, ...]:
    """The intervals of ``shape``'s flat storage that hold the flat range ``[start, stop)`` of a box.

    The box is the sub-tensor ``t[offset[0]:offset[0] + box[0], ...]`` (a ``Shard`` part of the tensor, as
    tensor parallelism cuts it), its storage read row-major; ``stop`` defaults to the box's numel. The
    intervals come in the box's order (which is also ascending), so a device whose local tensor is that
    range of the box holds them as ``Holdings`` say.
    """
    numel = math.prod(box)
    stop = numel if stop is None else stop
    if not (len(shape) == len(offset) == len(box) and 0 <= start <= stop <= numel
            and all(0 <= o and o + b <= s for s, o, b in zip(shape, offset, box))):
        raise PlacementError(f"box_intervals: [{start}, {stop}) of the box {tuple(box)} at {tuple(offset)} "
                             f"does not lie in shape {tuple(shape)}")
    if start == stop:
        return ()
    cut = [d for d in range(len(shape)) if box[d] != shape[d]]
    if not cut:
        return ((start, stop),)
    # dims after the last cut one are whole, so the box is runs of prod(box[t:]) contiguous elements
    t = cut[-1]
    run = math.prod(box[t:])
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    runs = np.arange(start // run, (stop - 1) // run + 1, dtype=np.int64)
    index = np.unravel_index(runs, box[:t]) if t else ()
    base = offset[t] * strides[t] + sum((o + i) * st for o, i, st in zip(offset, index, strides))
    lo = np.maximum(start, runs * run) - runs * run
    hi = np.minimum(stop, (runs + 1) * run) - runs * run
    return tuple(zip((base + lo).tolist(), (base + hi).tolist()))


def local_numels(holdings: Holdings) -> tuple[int, ...]:
    """Elements each device holds."""
    return tuple(sum(b - a for a, b in h) for h in holdings)


def transfers(src: Holdings, dst: Holdings, *, prefer_local: bool = True) -> tuple[Transfer, ...]:
    """The transfers that turn ``src`` holdings into ``dst`` holdings.

    Every element a destination needs comes from exactly one source. When several sources hold it
    (a replicated source), the destination itself is preferred (no communication), else the lowest
    rank that holds it.

    Raises:
        PlacementError: the two holdings span different numbers of devices, or a destination wants
            elements that no source holds.
    """
    if len(src) != len(dst):
        raise PlacementError(
            f"transfers: the source holdings cover {len(src)} devices and the destination {len(dst)}; "
            f"redistribute within one mesh dim"
        )
    world = len(src)
    out: list[Transfer] = []
    src_local = [_local_starts(h) for h in src]
    for d, wanted in enumerate(dst):
        dst_starts = _local_starts(wanted)
        for (lo, hi), dst_base in zip(wanted, dst_starts):
            order = ([d] if prefer_local else []) + [s for s in range(world) if not (prefer_local and s == d)]
            missing = [(lo, hi)]
            for s in order:
                still = []
                for a, b in missing:
                    for (sa, sb), s_base in zip(src[s], src_local[s]):
                        x, y = max(a, sa), min(b, sb)
                        if x < y:
                            out.append(Transfer(s, d, s_base + x - sa, dst_base + x - lo, y - x))
                    still.extend(_subtract((a, b), src[s]))
                missing = still
                if not missing:
                    break
            if missing:
                raise PlacementError(
                    f"transfers: elements {missing} wanted by device {d} are held by no device"
                )
    return tuple(sorted(out))


def _local_starts(intervals: tuple[Interval, ...]) -> list[int]:
    starts, acc = [], 0
    for a, b in intervals:
        starts.append(acc)
        acc += b - a
    return starts


def _subtract(interval: Interval, holes: tuple[Interval, ...]) -> list[Interval]:
    """The parts of ``interval`` outside every interval in ``holes`` (sorted, disjoint)."""
    a, b = interval
    out = []
    for x, y in holes:
        if y <= a or x >= b:
            continue
        if x > a:
            out.append((a, x))
        a = max(a, y)
    if a < b:
        out.append((a, b))
    return out
