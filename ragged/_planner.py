"""The structure-aware planner: pack one unit's tensors into ``m`` equal shards of minimal size.

Problem (veScale-FSDP, Section 5): choose a shard size S and, for every tensor, an offset in a buffer
of ``m * S`` elements so that tensors do not overlap, every shard boundary ``k * S`` strictly inside a
tensor lies on one of its block edges, offsets and S are multiples of ``align``, and S is minimal.

Heuristic (the paper's, in small composable stages):
1. ``orderings``: a few tensor orders (given, by block size, by size).
2. ``candidate_bases``: a tensor that contains a whole shard forces S to a multiple of its block, so
   S is searched over multiples of the LCM prefixes of the sorted block sizes (and ``align``).
3. ``search_shard_size``: binary search over those multiples, then a short scan below the result
   because feasibility is not monotone in S.
4. ``place_in_order``: greedy earliest-start placement, exact for a fixed order (an earlier end
   never hurts the tensors after it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ragged._errors import PlanningError
from ragged._granularity import Granularity
from ragged._layout import Layout, TensorSlot, TensorSpec, _ceil_to, shard_size_lower_bound

Item = tuple[int, int]  # (numel, block)

_SCAN_BELOW = 16  # candidates re-checked below the binary search's answer


def earliest_start(cur: int, numel: int, block: int, shard: int, align: int) -> int | None:
    """The smallest aligned offset ``>= cur`` where a tensor fits with no block cut, or None.

    Within the shard window holding the start, the tensor either ends before the window's end
    boundary ``b``, or crosses ``b`` at a block edge (offset congruent to ``b`` modulo
    ``lcm(block, align)``); crossing a second boundary needs ``shard % block == 0``. A window
    entered at its start is a translate of every later one, so two windows decide it.
    """
    start = _ceil_to(cur, align)
    if numel == 0:
        return start
    step = math.lcm(block, align)
    for _ in range(2):
        window_end = (start // shard + 1) * shard
        if start + numel <= window_end:
            return start
        p = window_end - ((window_end - start) // step) * step  # smallest p >= start, p = b mod step
        if p < window_end and (p + numel <= window_end + shard or shard % block == 0):
            return p
        start = window_end
    return None


def place_in_order(items: Sequence[Item], order: Sequence[int], shard: int, world_size: int,
                   align: int) -> list[int] | None:
    """Greedy earliest-start offsets for ``items`` taken in ``order``, or None if they overflow."""
    capacity = shard * world_size
    offsets = [0] * len(items)
    cur = 0
    for i in order:
        numel, block = items[i]
        p = earliest_start(cur, numel, block, shard, align)
        if p is None or p + numel > capacity:
            return None
        offsets[i] = p
        cur = p + numel
    return offsets


def orderings(items: Sequence[Item]) -> list[list[int]]:
    """The orders tried: as given, by block size (largest first), by size (largest first)."""
    given = list(range(len(items)))
    by_block = sorted(given, key=lambda i: (-items[i][1], -items[i][0], i))
    by_size = sorted(given, key=lambda i: (-items[i][0], -items[i][1], i))
    unique = []
    for order in (given, by_block, by_size):
        if order not in unique:
            unique.append(order)
    return unique


def candidate_bases(items: Sequence[Item], align: int) -> list[int]:
    """``align`` and the LCM prefixes of the sorted distinct block sizes (each times ``align``)."""
    bases = [align]
    acc = align
    for block in sorted({g for e, g in items if e}):
        acc = math.lcm(acc, block)
        if acc not in bases:
            bases.append(acc)
    return bases


def search_shard_size(items: Sequence[Item], order: Sequence[int], base: int, world_size: int,
                      align: int, upper: int) -> tuple[int, list[int]] | None:
    """Smallest feasible multiple of ``base`` in ``[lower bound, upper]`` found for ``order``."""
    lo = -(-shard_size_lower_bound(list(items), world_size, align) // base)
    hi = upper // base
    if lo > hi:
        return None
    best = None
    top = place_in_order(items, order, hi * base, world_size, align)
    if top is None:
        return None
    best = (hi, top)
    while lo < hi:  # binary search for the smallest multiple that the greedy accepts
        mid = (lo + hi) // 2
        offsets = place_in_order(items, order, mid * base, world_size, align)
        if offsets is None:
            lo = mid + 1
        else:
            hi = mid
            best = (mid, offsets)
    k = best[0]
    floor = -(-shard_size_lower_bound(list(items), world_size, align) // base)
    for cand in range(max(floor, k - _SCAN_BELOW), k):  # feasibility is not monotone in S
        offsets = place_in_order(items, order, cand * base, world_size, align)
        if offsets is not None:
            best = (cand, offsets)
            break
    return best[0] * base, best[1]


def _as_spec(t: Any, default: Granularity) -> TensorSpec:
    if isinstance(t, TensorSpec):
        return t
    if isinstance(t, dict):
        return TensorSpec(t["name"], tuple(t["shape"]), t.get("granularity", default))
    name, shape, *rest = t
    return TensorSpec(name, tuple(shape), rest[0] if rest else default)


def plan(tensors: Iterable[TensorSpec | tuple | dict], world_size: int, *, align: int | None = None,
         itemsize: int = 4, granularity: Granularity | int | str = "element",
         name: str = "") -> Layout:
    """Plan one FSDP unit's global buffer.

    Args:
        tensors: ``TensorSpec``s, ``(name, shape[, granularity])`` tuples or dicts with those keys.
        world_size: the number of devices ``m`` (shards).
        align: the collective unit in elements; offsets and S are multiples of it. Defaults to
            16 bytes of the buffer dtype (``16 // itemsize``).
        itemsize: bytes per element of the buffer dtype (used for the default ``align``).
        granularity: the default for tensors given without one.
        name: the unit's name, carried into the Layout and its errors.

    Returns:
        A ``Layout`` whose ``shard_size`` is the smallest the heuristic found.

    Raises:
        PlanningError: bad world size, alignment or duplicate names; GranularityError when a
            granularity does not divide its tensor.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanningError(f"unit {name!r}: world_size must be an int >= 1, got {world_size!r}")
    if align is None:
        align = max(1, 16 // itemsize)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise PlanningError(f"unit {name!r}: align must be an int >= 1, got {align!r}")
    specs = [_as_spec(t, Granularity.parse(granularity)) for t in tensors]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise PlanningError(f"unit {name!r}: duplicate tensor names {dupes}")
    items = [(s.numel, s.block) for s in specs]
    # Everything fits in one shard: a safe upper bound for every base.
    upper = sum(_ceil_to(e, align) for e, _ in items) or align
    best: tuple[int, list[int]] | None = None
    for base in candidate_bases(items, align):
        cap = _ceil_to(upper, base)
        for order in orderings(items):
            limit = cap if best is None else min(cap, best[0])
            found = search_shard_size(items, order, base, world_size, align, limit)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
    if best is None:  # unreachable: the one-shard upper bound is always feasible
        raise PlanningError(f"unit {name!r}: no feasible shard size found")
    shard, offsets = best
    slots = tuple(TensorSlot(s.name, s.shape, s.block, off) for s, off in zip(specs, offsets))
    return Layout(world_size, shard, slots, align=align, name=name)


def timed_plan(*args: Any, **kwargs: Any) -> tuple[Layout, float]:
    """``plan`` plus its wall time in seconds."""
    t0 = time.perf_counter()
    layout = plan(*args, **kwargs)
    return layout, time.perf_counter() - t0
