"""Which device runs Newton-Schulz for each matrix in distributed Muon (load balancing).

Muon orthogonalizes every matrix's momentum on one *root* device. The roots are chosen once, the same
way on every device, by greedy largest-first assignment (LPT): matrices in decreasing cost, each to the
least-loaded device so far, ties broken by the lower index, so the result is deterministic. LPT's
makespan is at most the optimum plus the largest single cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ragged._errors import PlanningError

Shape = tuple[int, ...]

# Newton-Schulz quintic coefficients (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X (Keller Jordan's).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def muon_scale(shape: Shape) -> float:
    """Keller Jordan's shape rule for the orthogonalized update: ``sqrt(max(1, rows / cols))``."""
    return max(1.0, shape[0] / shape[1]) ** 0.5


def newton_schulz_cost(shape: Shape) -> int:
    """Multiply-adds of one Newton-Schulz step on a matrix, up to a constant: ``rows * cols * min``."""
    if len(shape) != 2:
        raise PlanningError(f"Newton-Schulz runs on 2-D matrices, got shape {tuple(shape)}")
    rows, cols = shape
    return rows * cols * min(rows, cols)


def assign_roots(costs: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Greedy largest-first assignment of jobs to the least-loaded device.

    Args:
        costs: one non-negative cost per matrix (e.g. ``newton_schulz_cost``), in parameter order.
        world_size: the number of devices.

    Returns:
        The root device of each matrix, in the order of ``costs``.

    Raises:
        PlanningError: ``world_size < 1`` or a negative cost.
    """
    if world_size < 1:
        raise PlanningError(f"assign_roots: world_size {world_size} must be >= 1")
    bad = [i for i, c in enumerate(costs) if c < 0]
    if bad:
        raise PlanningError(f"assign_roots: costs at positions {bad} are negative")
    loads = [(0, rank) for rank in range(world_size)]  # (load, rank): the heap pops the lower rank on ties
    roots = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        roots[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    return tuple(roots)
