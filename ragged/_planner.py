"""The structure-aware planner: pack one unit's tensors into ``m`` equal shards of minimal size.

Problem (veScale-FSDP, Section 5): choose a shard size S and, for every tensor, an offset in a buffer
of ``m * S`` elements so that tensors do not overlap, every shard boundary ``k * S`` strictly inside a
tensor lies on one of its block edges, offsets and S are multiples of ``align``, and S is minimal.

The search, in small stages (docs/planner.md explains the choices and measures them):
1. ``ShardGrid`` (in ``_layout``): only sizes that pass the structural necessary condition (every
   tensor of two shards or more has its block dividing S) are tried, from the lower bound up.
2. ``pack``: the packers tried at one S (``_packing``): list scheduling over classes of identical
   tensors in three variants, then the paper's greedy for its three fixed orders.
3. ``search_shard_size``: the bound; jumps past sizes too small for the room the packers needed;
   ``candidate_bases`` (sizes where more tensors turn flexible); a scan or binary search below the
   best size found; the model-order first fit on the sizes just above the bound.
4. ``plan_items``: the best of that, the exact solver on units of at most six tensors, and the
   Megatron-FSDP-style baseline, so ``plan`` never pads more than that baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ragged._baselines import megatron, megatron_offsets
from ragged._errors import PlanningError
from ragged._exact import exact_plan
from ragged._granularity import Granularity
from ragged._layout import Layout, ShardGrid, TensorSlot, TensorSpec, basic_lower_bound, ceil_to
from ragged._packing import (
    Classes,
    Item,
    extent,
    fits_in_order,
    item_classes,
    orderings,
    place_by_class,
    place_in_order,
    upper_shard_size,
)

_SCAN = 8  # jumps up the grid; also: fewer sizes than this below the best are each tried
_RESCAN = 256  # grid sizes above the bound checked with the model-order first fit at the end
_SCHEDULES = ((True, False), (False, False), (True, True))  # place_by_class's (tolerant, rigid_first)
_EXACT_TENSORS = 6  # units this small are also solved exactly ...
_EXACT_SIZES = 4096  # ... unless more grid sizes than this lie between the bound and the heuristic


def pack(items: Sequence[Item], classes: Classes, orders: Sequence[Sequence[int]], shard: int,
         world_size: int, align: int) -> tuple[list[int] | None, int | None]:
    """Offsets from the first packer that fits at ``shard`` (list scheduling, then the fixed orders),
    and the least extent any packer reached (None if a tensor found no valid offset at all).

    The packers run on an unbounded buffer so a miss still says how much room they needed, which
    lets ``search_shard_size`` jump past sizes that could not hold it."""
    runs = [lambda t=t, r=r: place_by_class(items, classes, shard, None, align, t, r) for t, r in _SCHEDULES]
    runs += [lambda o=o: place_in_order(items, o, shard, None, align) for o in orders]
    least = None
    for run in runs:
        offsets = run()
        if offsets is None:
            continue
        reach = extent(items, offsets)
        if reach <= shard * world_size:
            return offsets, reach
        least = reach if least is None else min(least, reach)
    return None, least


def first_fit_shard_size(items: Sequence[Item], world_size: int, align: int, *, start: int = 0,
                         limit: int | None = None,
                         max_sizes: int | None = None) -> tuple[int, list[int]] | None:
    """The model-order first fit: the smallest valid S where the given order fits greedily.

    The paper's production setting: tensors in model order, each at its earliest start that keeps
    its blocks whole, S grown from the lower bound (or ``start``) until they fit. Sizes off the
    ``ShardGrid`` are skipped (no packing can meet them) and sizes are checked in vectorized
    batches. Returns None if no S ``<= limit`` fits within the first ``max_sizes`` grid sizes.
    """
    grid = ShardGrid.build(list(items), align)
    order = range(len(items))
    top = upper_shard_size(items, align) if limit is None else limit
    start = max(start, basic_lower_bound(list(items), world_size, align))
    left = math.inf if max_sizes is None else max_sizes
    batch = 64
    while left > 0 and (sizes := grid.take(start, top, int(min(batch, left)))):
        hits = np.flatnonzero(fits_in_order(items, order, np.array(sizes), world_size, align))
        if hits.size:
            found = sizes[int(hits[0])]
            return found, place_in_order(items, order, found, world_size, align)
        start, batch, left = sizes[-1] + 1, min(4 * batch, 4096), left - len(sizes)
    return None


def candidate_bases(items: Sequence[Item], shard: int, align: int) -> list[int]:
    """Bases whose multiples make more tensors flexible (block dividing S) near ``shard``.

    The paper walks the LCM prefixes of the sorted block sizes. Here: each block of a tensor that
    must cross a boundary (numel > shard) on its own, then the LCM prefixes of those blocks taken
    from the most common (by elements) to the least, each with ``align``.
    """
    weight: dict[int, int] = {}
    for e, g in items:
        if e > shard and g > 1:
            weight[g] = weight.get(g, 0) + e
    ranked = sorted(weight, key=lambda g: (-weight[g], g))
    bases = [math.lcm(align, g) for g in ranked]
    acc = align
    for g in ranked:
        acc = math.lcm(acc, g)
        bases.append(acc)
    return sorted(set(bases))


Fit = Callable[[int], tuple[list[int] | None, int | None]]  # shard size -> (offsets, room needed)
Found = tuple[int, list[int]]  # (shard size, offsets)


def jump_up(fit: Fit, grid: ShardGrid, lowest: int, world_size: int) -> Found | None:
    """From the bound up: after a miss, go to the first grid size whose buffer holds the least room
    the packers needed there (at least one size up), for at most ``_SCAN`` tries."""
    s = lowest
    for _ in range(_SCAN):
        offsets, reach = fit(s)
        if offsets is not None:
            return s, offsets
        s = grid.next_valid(max(s + 1, -(-(reach or 0) // world_size)))
    return None


def refine_down(fit: Fit, grid: ShardGrid, lowest: int, best: Found, items: Sequence[Item],
                align: int) -> Found:
    """Smaller sizes than ``best``: the candidate bases, then every grid size in between when there
    are fewer than ``_SCAN``, else a binary search over them (feasibility is not monotone in S)."""
    for base in candidate_bases(items, lowest, align):
        probe = grid.next_valid(ceil_to(lowest, base))
        offsets = fit(probe)[0] if probe < best[0] else None
        if offsets is not None:
            best = (probe, offsets)
    between = grid.take(lowest + 1, best[0] - 1, _SCAN)
    if len(between) < _SCAN:
        for probe in between:
            offsets = fit(probe)[0]
            if offsets is not None:
                return probe, offsets
        return best
    lo, hi = lowest + 1, best[0]
    while lo < hi:  # over start points x; the probe is the grid size at or above x
        mid = (lo + hi) // 2
        probe = grid.next_valid(mid)
        offsets = fit(probe)[0] if probe < best[0] else None
        if offsets is not None:
            best = (probe, offsets)
        if probe >= best[0]:
            hi = mid
        else:
            lo = mid + 1
    return best


def search_shard_size(items: Sequence[Item], world_size: int, align: int) -> Found:
    """The smallest shard size the packers reach, with its offsets.

    The lower bound first (when it fits it is optimal), then ``jump_up`` (else the always-feasible
    ``upper_shard_size``), ``refine_down``, and the model-order first fit on the ``_RESCAN`` grid
    sizes just above the bound.
    """
    grid = ShardGrid.build(list(items), align)
    classes, orders = item_classes(items), orderings(items)

    def fit(s: int) -> tuple[list[int] | None, int | None]:
        return pack(items, classes, orders, s, world_size, align)

    lowest = grid.next_valid(basic_lower_bound(list(items), world_size, align))
    best = jump_up(fit, grid, lowest, world_size)
    if best is None:
        top = upper_shard_size(items, align)
        best = (top, place_in_order(items, range(len(items)), top, world_size, align))
    best = refine_down(fit, grid, lowest, best, items, align)
    first_fit = first_fit_shard_size(items, world_size, align, start=lowest, limit=best[0] - 1,
                                     max_sizes=_RESCAN)
    return first_fit or best


def plan_items(specs: Sequence[TensorSpec], world_size: int, align: int) -> tuple[int, list[int]]:
    """The best of the candidates: the heuristic search, the exact solver on small units, and the
    Megatron-FSDP-style baseline (so ``plan`` never pads more than it)."""
    items = [(s.numel, s.block) for s in specs]
    shard, offsets = search_shard_size(items, world_size, align)
    if sum(1 for e, _ in items if e) <= _EXACT_TENSORS:
        found = exact_plan(items, world_size, align, limit=shard - 1, max_sizes=_EXACT_SIZES)
        if found is not None:
            shard, offsets = found
    # Megatron's shards are whole chunks of lcm(align, blocks) holding every element: when ours is
    # no larger than the smallest such size, its layout cannot beat ours and is not computed.
    chunk = math.lcm(align, *(g for e, g in items if e))
    used = sum(e for e, _ in items)
    if shard > max(1, -(-used // (world_size * chunk))) * chunk:
        megatron_shard = megatron(specs, world_size, align).shard_size
        if megatron_shard < shard:
            shard, offsets = megatron_shard, megatron_offsets(specs, align)[0]
    return shard, offsets


def _as_spec(t: Any, default: Granularity, index: int, unit: str) -> TensorSpec:
    """A ``TensorSpec`` from a spec, a ``{"name", "shape"[, "granularity"]}`` dict or a
    ``(name, shape[, granularity])`` tuple."""
    if isinstance(t, TensorSpec):
        return t
    if isinstance(t, dict) and "name" in t and "shape" in t:
        return TensorSpec(t["name"], tuple(t["shape"]), t.get("granularity", default))
    if isinstance(t, (tuple, list)) and len(t) in (2, 3) and isinstance(t[1], (tuple, list)):
        return TensorSpec(t[0], tuple(t[1]), t[2] if len(t) == 3 else default)
    raise PlanningError(
        f"unit {unit!r}: tensor #{index} ({t!r}) is not a TensorSpec, a dict with 'name' and 'shape', "
        f"or a (name, shape[, granularity]) tuple"
    )


def plan(tensors: Iterable[TensorSpec | tuple | dict], world_size: int, *, align: int | None = None,
         itemsize: int = 4, granularity: Granularity | int | str = "element",
         name: str = "") -> Layout:
    """Plan one FSDP unit's global buffer.

    Args:
        tensors: ``TensorSpec``s, ``(name, shape[, granularity])`` tuples or dicts with those keys.
        world_size: the number of devices ``m`` (shards).
        align: the collectives' alignment in elements; offsets and S are multiples of it. Defaults to
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
    default = Granularity.parse(granularity)
    specs = [_as_spec(t, default, i, name) for i, t in enumerate(tensors)]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise PlanningError(f"unit {name!r}: duplicate tensor names {dupes}")
    shard, offsets = plan_items(specs, world_size, align)
    slots = tuple(TensorSlot(s.name, s.shape, s.block, off) for s, off in zip(specs, offsets))
    return Layout(world_size, shard, slots, align=align, name=name)

