"""The layouts the torch_backend tests sweep, and independent references for them.

References here never call the core: a device's flat range is ``cumsum(units) * numel / sum(units)``
computed from scratch, and Shard references come from ``torch.chunk``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# (shape, dims, total units): element, row and multi-row granularities.
_SHAPES = (
    ((25, 3), (0,), 25),  # rows
    ((25, 3), (0,), 5),  # 5-row blocks
    ((3, 26), (0, 1), 78),  # elements
    ((3, 26), (0, 1), 13),  # 2-element blocks
    ((7,), (0,), 7),  # elements of a vector
    ((5, 3, 6, 7), (0, 1), 5),  # 3 blocks of 42 per unit
    ((5, 3, 6, 7), (0,), 5),  # whole (3, 6, 7) slabs
)


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    units: tuple[int, ...]


def units_for(kind: str, total: int, world: int, seed: int) -> tuple[int, ...]:
    """Units of one kind: random multinomial, one-hot (last device), or with zeros (first device empty)."""
    rng = np.random.default_rng(seed)
    if kind == "onehot":
        return tuple(int(i == world - 1) * total for i in range(world))
    if kind == "zeros" and world > 1:
        return (0, *(int(u) for u in rng.multinomial(total, [1 / (world - 1)] * (world - 1))))
    return tuple(int(u) for u in rng.multinomial(total, [1 / world] * world))


def cases(world: int) -> list[Case]:
    """Every (shape, granularity, units kind) layout for ``world`` devices."""
    out = []
    for i, (shape, dims, total) in enumerate(_SHAPES):
        for kind in ("multinomial", "onehot", "zeros"):
            units = units_for(kind, total, world, seed=100 * i + world)
            name = f"{'x'.join(map(str, shape))}-d{len(dims)}-u{total}-{kind}"
            out.append(Case(name, shape, dims, units))
    return out


def full(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Small integer-valued floats: sums and redistributions of them are exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(torch.float32)


def flat_range(numel: int, units: tuple[int, ...], rank: int) -> tuple[int, int]:
    unit = numel // sum(units)
    return sum(units[:rank]) * unit, sum(units[: rank + 1]) * unit


def ragged_local(t: torch.Tensor, units: tuple[int, ...], rank: int) -> torch.Tensor:
    a, b = flat_range(t.numel(), units, rank)
    return t.reshape(-1)[a:b]


def chunk_local(t: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    pieces = torch.chunk(t, world, dim)
    return pieces[rank] if rank < len(pieces) else t.narrow(dim, 0, 0)


def moved_elements(numel: int, src: tuple[int, ...], dst: tuple[int, ...]) -> int:
    """Brute force: how many elements change device between two ragged layouts."""
    owner = np.empty((2, numel), dtype=np.int64)
    for row, units in enumerate((src, dst)):
        for r in range(len(units)):
            a, b = flat_range(numel, units, r)
            owner[row, a:b] = r
    return int((owner[0] != owner[1]).sum())


def prod(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
