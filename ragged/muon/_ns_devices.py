"""Which device runs Newton-Schulz for each matrix in distributed Muon, what that costs, in what order.

Muon orthogonalizes every matrix's momentum on one device, its *NS device*. The NS devices are chosen once,
the same way on every device, by greedy largest-first assignment (LPT) over the exact Newton-Schulz FLOPs:
matrices in decreasing cost, each to the least-loaded device so far, ties broken by the lower index, so the
result is deterministic. LPT's makespan is at most the optimum plus the largest single cost. No
one-NS-device-per-matrix assignment gets below ``max(costs) / mean`` in ``max / mean``: the largest matrix's
device runs at least that (llama3-8b's layers at 256 devices: 2.11, which LPT reaches). Below it, a matrix's
Newton-Schulz must split over several devices: ``ragged.muon.assign_groups`` (a plan only, ``_split``).

The overlapped schedule works in *buckets*: bucket ``j`` holds the ``j``-th matrix of every NS device, so in
one bucket each device orthogonalizes at most one matrix while the others do the same, and a bucket's
gathers (and scatters) are one exchange: the holdings of its matrices, concatenated
(``bucket_holdings``), go through one ``ragged.transfers`` plan.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from ragged._errors import PlanningError
from ragged._redistribute import Holdings

Shape = tuple[int, ...]

# Newton-Schulz quintic coefficients (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X (Keller Jordan's).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def muon_scale(shape: Shape) -> float:
    """Keller Jordan's shape rule for the orthogonalized update: ``sqrt(max(1, rows / cols))``."""
    return max(1.0, shape[0] / shape[1]) ** 0.5


def newton_schulz_flops(shape: Shape, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of Newton-Schulz on a matrix (2 per multiply-add; the elementwise work is left out).

    On the wide orientation ``X`` (``m x n``, ``m = min(shape) <= n``) each step computes ``A = X X^T``
    (``2 m^2 n``), ``A A`` (``2 m^3``) and ``(b A + c A^2) X`` (``2 m^2 n``).
    """
    if len(shape) != 2:
        raise PlanningError(f"Newton-Schulz runs on 2-D matrices, got shape {tuple(shape)}")
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def assign_ns_devices(costs: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Greedy largest-first assignment of jobs to the least-loaded device.

    Args:
        costs: one non-negative cost per matrix (e.g. ``newton_schulz_flops``), in parameter order.
        world_size: the number of devices.

    Returns:
        The NS device of each matrix, in the order of ``costs``.

    Raises:
        PlanningError: ``world_size < 1`` or a negative cost.
    """
    if world_size < 1:
        raise PlanningError(f"assign_ns_devices: world_size {world_size} must be >= 1")
    bad = [i for i, c in enumerate(costs) if c < 0]
    if bad:
        raise PlanningError(f"assign_ns_devices: costs at positions {bad} are negative")
    loads = [(0, rank) for rank in range(world_size)]  # (load, rank): the heap pops the lower rank on ties
    ns_devices = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        ns_devices[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    return tuple(ns_devices)


def newton_schulz_load(shapes: Sequence[Shape], ns_devices: Sequence[int], world_size: int) -> np.ndarray:
    """Newton-Schulz FLOPs each device runs: ``out[d]`` sums ``newton_schulz_flops`` of its matrices.

    Returns:
        ``(world_size,)`` int64; ``out.max() / out.mean()`` is the load imbalance of the step.
    """
    if len(shapes) != len(ns_devices):
        raise PlanningError(f"newton_schulz_load: {len(shapes)} shapes but {len(ns_devices)} NS devices")
    out = np.zeros(world_size, np.int64)
    for shape, device in zip(shapes, ns_devices):
        if not 0 <= device < world_size:
            raise PlanningError(f"newton_schulz_load: NS device {device} is outside the {world_size} devices")
        out[device] += newton_schulz_flops(tuple(shape))
    return out


def ns_device_buckets(ns_devices: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Matrix indices grouped so that bucket ``j`` holds the ``j``-th matrix (in order) of every NS device.

    Every device is the NS device of at most one matrix per bucket; the buckets are in order and each
    lists its matrices in ascending index, so every device derives the same schedule.
    """
    seen: dict[int, int] = {}
    buckets: list[list[int]] = []
    for i, device in enumerate(ns_devices):
        j = seen.get(device, 0)
        seen[device] = j + 1
        if j == len(buckets):
            buckets.append([])
        buckets[j].append(i)
    return tuple(tuple(b) for b in buckets)


def bucket_holdings(parts: Sequence[Holdings], numels: Sequence[int]) -> Holdings:
    """Holdings of the concatenation of several tensors' flat storages (tensor ``k`` shifted by the
    numels before it). A device's local buffer for them is its local pieces concatenated in order."""
    if len(parts) != len(numels) or len({len(p) for p in parts}) > 1:
        raise PlanningError("bucket_holdings: one holdings per tensor, all over the same devices")
    world = len(parts[0]) if parts else 0
    bases = np.cumsum([0, *numels[:-1]]).tolist() if numels else []
    return tuple(tuple((base + a, base + b) for part, base in zip(parts, bases) for a, b in part[d])
                 for d in range(world))
