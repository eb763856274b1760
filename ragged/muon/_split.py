"""Splitting one matrix's Newton-Schulz over a small group of devices: the plan (both runtimes run it).

Whole-matrix NS devices (``assign_ns_devices``) cannot balance a step whose largest matrix costs more than
the mean per device: the device that gets it runs ``max_cost``, so ``max / mean >= max_cost / mean`` for
*every* one-NS-device-per-matrix assignment (llama3-8b's decoder layers at 256 devices: 224 matrices, and
one FFN matrix alone is 2.11x the mean). Getting under that bound needs one matrix's Newton-Schulz on
several devices. The scheme, on the wide orientation ``X`` (``m x n``, ``m <= n``), ``g`` dividing ``m``
and ``n``:

- member ``i`` of the group holds the column block ``X_i`` (``m x n/g``); ``||X||_F^2`` is one scalar
  all-reduce (each member sends its partial sum);
- each of the ``steps`` iterations: ``A = sum_i X_i X_i^T`` (local ``2 m^2 n/g``, then an all-reduce of
  ``m x m``); member ``i`` computes its row block ``B_i = b A_i + c A_i A`` (``2 m^3/g``) and the blocks
  are all-gathered into ``B``; then ``X_i <- a X_i + B X_i`` (``2 m^2 n/g``) locally.

Each member runs exactly ``newton_schulz_flops(shape) / g`` matmul FLOPs and receives, per iteration, the
all-reduce (``2 (g-1)/g m^2`` elements as reduce-scatter + all-gather) and the all-gather of ``B``
(``(g-1)/g m^2``), instead of nothing. ``split_newton_schulz_reference`` runs the scheme in numpy (a test
checks it against the one-device result and counts its FLOPs and bytes).

``assign_groups`` decides which matrices split and over how many devices: first plain LPT (no split; the
runtimes' ``assign_ns_devices``); while ``max/mean`` is above the target, every matrix whose cost exceeds
a cap (the mean per device, then half of it, ...) is split over the smallest ``g`` that brings its pieces
under the cap, and the pieces are placed greedily largest-first, each matrix's ``g`` pieces on the ``g``
least-loaded distinct devices. Deterministic: ties go to the lower index.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from ragged._errors import PlanningError
from ragged.muon._ns_devices import NS_COEFFS, NS_STEPS, Shape, assign_ns_devices, newton_schulz_flops


def _wide(shape: Shape) -> tuple[int, int]:
    if len(shape) != 2:
        raise PlanningError(f"Newton-Schulz runs on 2-D matrices, got shape {tuple(shape)}")
    return min(shape), max(shape)


def _check_group(shape: Shape, g: int) -> tuple[int, int]:
    m, n = _wide(shape)
    if g < 1 or m % g or n % g:
        raise PlanningError(f"split Newton-Schulz: a group of {g} must divide both sides of {tuple(shape)}")
    return m, n


def split_newton_schulz_flops(shape: Shape, group: int, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs each of ``group`` devices runs for one matrix: ``newton_schulz_flops(shape) / group``."""
    m, n = _check_group(shape, group)
    return steps * (4 * m * m * n + 2 * m ** 3) // group


def split_newton_schulz_bytes(shape: Shape, group: int, steps: int = NS_STEPS, itemsize: int = 4) -> int:
    """Bytes each member receives inside the group during Newton-Schulz (not the gather and scatter of
    ``X``, which move ``1/group`` of the matrix per member, as whole-matrix NS devices move all of it to one).

    Per iteration: the all-reduce of ``A`` (``2 (g-1)/g m^2`` elements) and the all-gather of ``B``
    (``(g-1)/g m^2``); once, the squared norm's partial sums from the other members (``g - 1`` elements).
    0 for a group of 1.
    """
    m, _ = _check_group(shape, group)
    per_step = 3 * (group - 1) * m * m // group
    return itemsize * (steps * per_step + group - 1)


def split_newton_schulz_reference(x: np.ndarray, group: int, steps: int = NS_STEPS,
                                  eps: float = 1e-7) -> tuple[np.ndarray, list[int], int]:
    """The split scheme run in numpy, one loop iteration per member: the result (``x``'s shape), the
    matmul FLOPs each member ran, and the elements one member received (reduce-scatter + all-gather for
    each all-reduce, all-gather of ``B``)."""
    m, n = _check_group(x.shape, group)
    a, b, c = NS_COEFFS
    tall = x.shape[0] > x.shape[1]
    xw = x.T if tall else x
    cols, rows = n // group, m // group
    blocks = [xw[:, i * cols:(i + 1) * cols].astype(np.float64) for i in range(group)]
    flops = [0] * group
    received = group - 1  # the other members' partial squared norms
    norm = math.sqrt(sum(float((blk ** 2).sum()) for blk in blocks))
    blocks = [blk / (norm + eps) for blk in blocks]
    for _ in range(steps):
        partial = []
        for i, blk in enumerate(blocks):
            partial.append(blk @ blk.T)
            flops[i] += 2 * m * m * cols
        gram = sum(partial)  # all-reduce
        received += 2 * (group - 1) * m * m // group
        rows_b = []
        for i in range(group):
            own = gram[i * rows:(i + 1) * rows]
            rows_b.append(b * own + c * (own @ gram))
            flops[i] += 2 * rows * m * m
        poly = np.concatenate(rows_b)  # all-gather
        received += (group - 1) * m * m // group
        for i in range(group):
            blocks[i] = a * blocks[i] + poly @ blocks[i]
            flops[i] += 2 * m * m * cols
    out = np.concatenate(blocks, axis=1)
    return (out.T if tall else out), flops, received


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def _place(costs: Sequence[int], groups: Sequence[int], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Largest piece first, each matrix's ``groups[i]`` pieces on that many least-loaded distinct devices."""
    loads = [(0, rank) for rank in range(world_size)]
    out: list[tuple[int, ...]] = [()] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-(costs[i] // groups[i]), i)):
        taken = [heapq.heappop(loads) for _ in range(groups[i])]
        out[i] = tuple(sorted(rank for _, rank in taken))
        for load, rank in taken:
            heapq.heappush(loads, (load + costs[i] // groups[i], rank))
    return tuple(out)


def group_load(shapes: Sequence[Shape], groups: Sequence[Sequence[int]], world_size: int) -> np.ndarray:
    """Newton-Schulz FLOPs each device runs when matrix ``k`` runs on the devices ``groups[k]``."""
    if len(shapes) != len(groups):
        raise PlanningError(f"group_load: {len(shapes)} shapes but {len(groups)} groups")
    out = np.zeros(world_size, np.int64)
    for shape, devices in zip(shapes, groups):
        if not devices or len(set(devices)) != len(devices) or not all(0 <= d < world_size for d in devices):
            raise PlanningError(f"group_load: group {tuple(devices)} of {tuple(shape)} is not distinct "
                                f"devices among {world_size}")
        for d in devices:
            out[d] += split_newton_schulz_flops(tuple(shape), len(devices))
    return out


def assign_groups(shapes: Sequence[Shape], world_size: int, *,
                  max_imbalance: float | None = 1.1) -> tuple[tuple[int, ...], ...]:
    """The devices that run each matrix's Newton-Schulz (one device, or a split group), balanced.

    Args:
        shapes: the 2-D matrices, in parameter order.
        world_size: the number of devices.
        max_imbalance: the target ``max / mean`` of per-device FLOPs (``group_load``); ``None``: one NS
            device per matrix (``assign_ns_devices``), never split (the runtimes' default).

    Returns:
        Per matrix, the sorted devices of its group. With no split needed these are
        ``assign_ns_devices``'s NS devices; otherwise the first cap (mean per device, halved until it is
        reached or no matrix can split further) whose placement meets ``max_imbalance``, or the most
        balanced one tried.

    Raises:
        PlanningError: ``world_size < 1``, ``max_imbalance < 1`` or a shape that is not 2-D.
    """
    if world_size < 1:
        raise PlanningError(f"assign_groups: world_size {world_size} must be >= 1")
    if max_imbalance is not None and not max_imbalance >= 1:
        raise PlanningError(f"assign_groups: max_imbalance={max_imbalance} is a max / mean ratio, "
                            "it must be >= 1")
    costs = [newton_schulz_flops(tuple(s)) for s in shapes]
    if max_imbalance is None:  # whole matrices: one NS device each, never split
        return tuple((device,) for device in assign_ns_devices(costs, world_size))
    options = [[d for d in _divisors(math.gcd(*_wide(tuple(s)))) if d <= world_size] for s in shapes]
    mean = sum(costs) / world_size

    def imbalance(groups: tuple[tuple[int, ...], ...]) -> float:
        return float(group_load(shapes, groups, world_size).max() / mean) if mean else 1.0

    best = _place(costs, [1] * len(costs), world_size)
    cap = mean
    while imbalance(best) > max_imbalance:
        sizes = [next((d for d in opts if c / d <= cap), opts[-1]) for c, opts in zip(costs, options)]
        tried = _place(costs, sizes, world_size)
        if imbalance(tried) < imbalance(best):
            best = tried
        if all(size == opts[-1] for size, opts in zip(sizes, options)) or cap < 1:
            break  # every matrix is as split as it can be
        cap /= 2
    return best
