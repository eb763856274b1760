"""An exact solver for small planning instances, to measure the heuristic against.

Why it is exact:
- Any valid layout orders its tensors by offset. Placing them in that order, each at its earliest
  valid start (``earliest_start``), ends every tensor no later than the layout does, because the
  earliest start is monotone in the cursor (it is the first valid offset at or after it, and the
  set of valid offsets depends only on S). So a shard size is feasible iff some order fits greedily.
- The best order need not be enumerated: over subsets, the smallest end of a set of tensors is
  ``min over its last tensor t of earliest_start(best end of the rest) + numel_t`` (same
  monotonicity), a DP over ``2^n`` subsets instead of ``n!`` orders.
- Shard sizes off the ``ShardGrid`` are infeasible, and sizes are tried upward from the lower bound,
  so the first feasible one is the optimum. The DP runs on a vector of shard sizes at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ragged._errors import PlanningError
from ragged._layout import ShardGrid, basic_lower_bound
from ragged._packing import Item, earliest_start, earliest_starts, upper_shard_size

MAX_TENSORS = 12  # 2^12 subsets: beyond that the DP is too slow to be a test oracle

_NONE = np.iinfo(np.int64).max


def min_ends(items: Sequence[Item], shards: np.ndarray, world_size: int, align: int) -> np.ndarray:
    """For each shard size, the smallest end any order of ``items`` reaches (``_NONE`` if none fits)."""
    n = len(items)
    shard = np.asarray(shards, dtype=np.int64)
    capacity = shard * world_size
    best = np.full((1 << n, shard.size), _NONE, dtype=np.int64)
    best[0] = 0
    for mask in range(1, 1 << n):
        for t in range(n):
            if not mask >> t & 1:
                continue
            prev = best[mask ^ (1 << t)]
            live = prev != _NONE
            place = earliest_starts(np.where(live, prev, 0), items[t][0], items[t][1], shard, align)
            end = np.where(live & (place >= 0), place + items[t][0], _NONE)
            end = np.where(end <= capacity, end, _NONE)
            np.minimum(best[mask], end, out=best[mask])
    return best[-1]


def best_order(items: Sequence[Item], shard: int, world_size: int, align: int) -> list[int] | None:
    """An order whose greedy placement fits at ``shard`` (the DP with parent pointers), or None."""
    n = len(items)
    capacity = shard * world_size
    end: list[int | None] = [None] * (1 << n)
    last = [-1] * (1 << n)
    end[0] = 0
    for mask in range(1, 1 << n):
        for t in range(n):
            prev = end[mask ^ (1 << t)] if mask >> t & 1 else None
            if prev is None:
                continue
            p = earliest_start(prev, items[t][0], items[t][1], shard, align)
            stop = None if p is None else p + items[t][0]
            if stop is not None and stop <= capacity and (end[mask] is None or stop < end[mask]):
                end[mask], last[mask] = stop, t
    if end[-1] is None:
        return None
    order, mask = [], (1 << n) - 1
    while mask:
        order.append(last[mask])
        mask ^= 1 << last[mask]
    return order[::-1]


def exact_plan(items: Sequence[Item], world_size: int, align: int, *, limit: int | None = None,
               max_sizes: int | None = None) -> tuple[int, list[int]] | None:
    """The optimal shard size and offsets for ``items`` (``(numel, block)`` pairs).

    Args:
        items: at most ``MAX_TENSORS`` non-empty tensors (empty ones are free and take offset 0).
        world_size: the number of shards.
        align: the collectives' alignment in elements.
        limit: only shard sizes ``<= limit`` are tried (default: the always-feasible upper bound).
        max_sizes: give up (return None) after this many grid sizes.

    Returns:
        ``(S, offsets)`` with S minimal over every valid layout, or None when no size within
        ``limit`` and ``max_sizes`` is feasible.

    Raises:
        PlanningError: more than ``MAX_TENSORS`` non-empty tensors.
    """
    live = [i for i, (e, _) in enumerate(items) if e]
    if len(live) > MAX_TENSORS:
        raise PlanningError(
            f"exact_plan: {len(live)} non-empty tensors; the exact solver takes at most {MAX_TENSORS}"
        )
    sub = [items[i] for i in live]
    grid = ShardGrid.build(list(items), align)
    top = upper_shard_size(items, align) if limit is None else limit
    start = basic_lower_bound(list(items), world_size, align)
    remaining, batch = max_sizes, 16
    while True:
        count = batch if remaining is None else min(batch, remaining)
        sizes = grid.take(start, top, count) if count else []
        if not sizes:
            return None
        hits = np.flatnonzero(min_ends(sub, np.array(sizes), world_size, align) != _NONE)
        if hits.size:
            shard = sizes[int(hits[0])]
            order = best_order(sub, shard, world_size, align)
            assert order is not None  # the vector DP and the scalar one agree
            offsets, cur = [0] * len(items), 0
            for t in order:
                offsets[live[t]] = earliest_start(cur, sub[t][0], sub[t][1], shard, align)
                cur = offsets[live[t]] + sub[t][0]
            return shard, offsets
        start, batch = sizes[-1] + 1, min(4 * batch, 1024)
        if remaining is not None:
            remaining -= len(sizes)
