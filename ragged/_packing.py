"""Packing at a fixed shard size: where each tensor goes when S is given.

The stages of the planner's search (``_planner``) and the exact solver (``_exact``) share these:

- ``earliest_start``: the first aligned offset at or after a cursor where a tensor keeps its blocks
  whole; ``earliest_starts`` is the same rule on vectors of (cursor, shard size) lanes.
- ``place_in_order``: the paper's greedy, each tensor of a fixed order at its earliest start. It is
  exact for that order: the earliest start is monotone in the cursor, so an earlier end never hurts
  the tensors after it. ``fits_in_order`` answers the same for many shard sizes at once.
- ``place_by_class``: list scheduling over classes of identical ``(numel, block)`` tensors, the
  packer that beats fixed orders on MoE layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ragged._layout import ceil_to

Item = tuple[int, int]  # (numel, block)
Classes = tuple[tuple[Item, tuple[int, ...]], ...]  # ((numel, block), member indices in given order)


def earliest_start(cur: int, numel: int, block: int, shard: int, align: int) -> int | None:
    """The smallest aligned offset ``>= cur`` where a tensor fits with no block cut, or None.

    Within the shard window holding the start, the tensor either ends before the window's end
    boundary ``b``, or crosses ``b`` at a block edge (offset congruent to ``b`` modulo
    ``lcm(block, align)``); crossing a second boundary needs ``shard % block == 0``. A window
    entered at its start is a translate of every later one, so two windows decide it.
    """
    start = ceil_to(cur, align)
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


def earliest_starts(cur: np.ndarray, numel: int, block: int, shard: np.ndarray, align: int) -> np.ndarray:
    """``earliest_start`` for one tensor on a vector of lanes (cursor, shard size); -1 for none."""
    step = math.lcm(block, align)
    start = -(-cur // align) * align
    multi = shard % block == 0  # crossing a second boundary is allowed
    place = np.full_like(shard, -1)
    for _ in range(2):
        window_end = (start // shard + 1) * shard
        p = window_end - ((window_end - start) // step) * step
        crosses = (p < window_end) & ((p + numel <= window_end + shard) | multi)
        found = np.where(start + numel <= window_end, start, np.where(crosses, p, -1))
        place = np.where(place < 0, found, place)
        start = window_end
    return place


def place_in_order(items: Sequence[Item], order: Sequence[int], shard: int, world_size: int | None,
                   align: int) -> list[int] | None:
    """Greedy earliest-start offsets for ``items`` taken in ``order``, or None if they overflow.

    Empty tensors take offset 0: they hold nothing, so any aligned offset is valid. With
    ``world_size=None`` the buffer is unbounded, so the caller can see how far the packing reaches.
    """
    capacity = _capacity(shard, world_size)
    offsets = [0] * len(items)
    cur = 0
    for i in order:
        numel, block = items[i]
        if numel == 0:
            continue
        p = earliest_start(cur, numel, block, shard, align)
        if p is None or p + numel > capacity:
            return None
        offsets[i] = p
        cur = p + numel
    return offsets


def fits_in_order(items: Sequence[Item], order: Sequence[int], shards: np.ndarray, world_size: int,
                  align: int) -> np.ndarray:
    """``place_in_order(...) is not None`` for many shard sizes at once (a boolean per size).

    One lane per shard size, so a scan over thousands of sizes costs one pass over the tensors.
    """
    shard = np.asarray(shards, dtype=np.int64)
    cur = np.zeros_like(shard)
    ok = np.ones(shard.shape, dtype=bool)
    capacity = shard * world_size
    for i in order:
        numel, block = items[i]
        if numel == 0:
            continue
        place = earliest_starts(cur, numel, block, shard, align)
        ok &= (place >= 0) & (place + numel <= capacity)
        cur = np.where(place >= 0, place + numel, cur)
    return ok


def item_classes(items: Sequence[Item]) -> Classes:
    """Non-empty items grouped by identical ``(numel, block)``, in order of first appearance."""
    groups: dict[Item, list[int]] = {}
    for i, item in enumerate(items):
        if item[0]:
            groups.setdefault(item, []).append(i)
    return tuple((item, tuple(members)) for item, members in groups.items())


def place_by_class(items: Sequence[Item], classes: Classes, shard: int, world_size: int | None,
                   align: int, tolerant: bool = True, rigid_first: bool = False) -> list[int] | None:
    """List scheduling over classes: repeatedly place the class whose earliest start wastes least.

    Ties go to the larger tensor, then to the rigid one (its block does not divide ``shard``, so it
    has fewer valid offsets), then to the larger block: flexible and small tensors are kept to fill
    the gaps that rigid ones would leave. With ``tolerant``, a waste below the class's own offset
    step (``lcm(block, align)``, what a boundary crossing costs it at worst) counts as none, so
    flexible tensors are not spent on gaps that small; that keeps them for the places where a rigid
    tensor would have to skip a whole window. A class with no waste ends the scan early, so a run of
    identical tensors costs one probe each. With ``rigid_first``, every rigid class ranks before
    every flexible one (a rigid tensor placed late may find no window left). Members of a class keep
    their given order. ``world_size=None`` means an unbounded buffer, as in ``place_in_order``.
    """
    def rank(c: int) -> tuple:
        (numel, block), members = classes[c]
        flexible = shard % block == 0
        if rigid_first:
            return (flexible, -numel, -block, members[0])
        return (-numel, flexible, -block, members[0])

    ranked = sorted(range(len(classes)), key=rank)
    free = [math.lcm(classes[c][0][1], align) if tolerant else 1 for c in range(len(classes))]
    capacity = _capacity(shard, world_size)
    offsets = [0] * len(items)
    left = [len(classes[c][1]) for c in range(len(classes))]
    live = list(ranked)
    cur = 0
    while live:
        start = ceil_to(cur, align)
        best, best_p, best_cost = -1, 0, 0
        for c in live:
            numel, block = classes[c][0]
            p = earliest_start(start, numel, block, shard, align)
            if p is None:
                continue
            cost = 0 if p - start < free[c] else p - start
            if best < 0 or cost < best_cost:
                best, best_p, best_cost = c, p, cost
                if cost == 0:
                    break
        if best < 0:
            return None
        (numel, _), members = classes[best]
        if best_p + numel > capacity:
            return None
        offsets[members[len(members) - left[best]]] = best_p
        left[best] -= 1
        if not left[best]:
            live.remove(best)
        cur = best_p + numel
    return offsets


def _capacity(shard: int, world_size: int | None) -> float:
    return math.inf if world_size is None else shard * world_size


def extent(items: Sequence[Item], offsets: Sequence[int]) -> int:
    """Where the packed tensors end: the buffer must hold this many elements."""
    return max((o + e for o, (e, _) in zip(offsets, items) if e), default=0)


def orderings(items: Sequence[Item]) -> list[list[int]]:
    """The paper's orders: as given, by block size (largest first), by size (largest first)."""
    given = list(range(len(items)))
    by_block = sorted(given, key=lambda i: (-items[i][1], -items[i][0], i))
    by_size = sorted(given, key=lambda i: (-items[i][0], -items[i][1], i))
    unique = []
    for order in (given, by_block, by_size):
        if order not in unique:
            unique.append(order)
    return unique


def upper_shard_size(items: Sequence[Item], align: int) -> int:
    """A shard size that always works: every tensor, aligned, inside the first shard."""
    return sum(ceil_to(e, align) for e, _ in items) or align
