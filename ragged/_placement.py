"""RaggedShard: veScale-FSDP's placement over a tensor's flattened row-major storage.

A tensor of shape ``shape`` is viewed as ``prod(shape[:k])`` sub-tensors ``t[i_0, ..., i_{k-1}]`` of
``prod(shape[k:])`` elements each, where ``dims = (0, ..., k-1)``. The storage is cut into
``sum(local_units)`` equal *blocks* of whole sub-tensors, and device ``i`` holds ``local_units[i]``
consecutive blocks (veScale calls them units; ``local_units`` keeps veScale's signature, and every other
name here says block: docs/glossary.md). Element-wise (``k = ndim``), row-wise (``k = ndim - 1``),
N-row blocks, uneven splits, empty shards (zero blocks) and "one device holds it all" (``dims = ()``,
one-hot ``local_units``) are special cases.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from itertools import accumulate

from ragged._errors import PlacementError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class RaggedShard:
    """Placement of one tensor over ``len(local_units)`` devices.

    Args:
        dims: a prefix ``(0, ..., k-1)`` of the tensor's dims; a block is a whole number of
            sub-tensors ``t[i_0, ..., i_{k-1}]``. ``()`` means one block: the whole tensor.
        local_units: the number of blocks each device holds (zero allowed, uneven allowed).

    Example:
        >>> p = RaggedShard(dims=(0,), local_units=(1, 0, 2))
        >>> p.ranges((6, 4))
        ((0, 8), (8, 8), (8, 24))
    """

    dims: tuple[int, ...]
    local_units: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", _ints("dims", self.dims))
        object.__setattr__(self, "local_units", _ints("local_units", self.local_units))
        if self.dims != tuple(range(len(self.dims))):
            raise PlacementError(
                f"RaggedShard dims={self.dims} must be a prefix (0, ..., k-1) of the tensor's dims; "
                f"use dims={tuple(range(len(self.dims)))} or shard a reshaped tensor"
            )
        if not self.local_units:
            raise PlacementError("RaggedShard local_units is empty: give one entry per device")
        negative = [i for i, u in enumerate(self.local_units) if u < 0]
        if negative:
            raise PlacementError(
                f"RaggedShard local_units={self.local_units} has negative units on device(s) {negative}"
            )
        if sum(self.local_units) == 0:
            raise PlacementError(
                f"RaggedShard local_units={self.local_units} sums to 0: some device must hold the tensor"
            )

    @property
    def world_size(self) -> int:
        """The number of devices: one ``local_units`` entry each."""
        return len(self.local_units)

    def subtensor_numel(self, shape: Shape) -> int:
        """Elements in one sub-tensor ``t[i_0, ..., i_{k-1}]`` of the dims prefix: ``prod(shape[k:])``."""
        return math.prod(shape[len(self.dims):])

    def block_numel(self, shape: Shape, name: str = "tensor") -> int:
        """Elements in one block (``numel // sum(local_units)``), after validating ``shape``."""
        self.validate(shape, name)
        return math.prod(shape) // sum(self.local_units)

    def validate(self, shape: Shape, name: str = "tensor", world_size: int | None = None) -> None:
        """Raise ``PlacementError`` naming ``name`` if this placement cannot shard ``shape``."""
        shape = tuple(shape)
        if any(s < 0 for s in shape):
            raise PlacementError(f"{name}: shape {shape} has a negative dim")
        if len(self.dims) > len(shape):
            raise PlacementError(
                f"{name}: RaggedShard dims={self.dims} has more dims than the tensor's shape {shape}"
            )
        if world_size is not None and world_size != self.world_size:
            raise PlacementError(
                f"{name}: RaggedShard local_units has {self.world_size} entries but the mesh dim has "
                f"{world_size} devices"
            )
        numel = math.prod(shape)
        total = sum(self.local_units)
        if numel % total:
            raise PlacementError(
                f"{name}: numel {numel} of shape {shape} is not divisible by sum(local_units)={total} "
                f"(local_units={self.local_units}): blocks must be equal whole parts of the tensor"
            )
        sub = self.subtensor_numel(shape)
        if sub and (numel // total) % sub:
            raise PlacementError(
                f"{name}: a block of {numel // total} elements (numel {numel} / sum(local_units) {total}) "
                f"would cut a sub-tensor of {sub} elements (dims={self.dims}, shape {shape}); "
                f"sum(local_units) must divide prod(shape[:{len(self.dims)}])="
                f"{math.prod(shape[:len(self.dims)])}"
            )

    def ranges(self, shape: Shape, name: str = "tensor") -> tuple[tuple[int, int], ...]:
        """Each device's half-open element range ``[start, end)`` of the flattened tensor."""
        block = self.block_numel(shape, name)
        cum = (0, *accumulate(self.local_units))
        return tuple((cum[i] * block, cum[i + 1] * block) for i in range(self.world_size))

    def local_numel(self, shape: Shape, rank: int, name: str = "tensor") -> int:
        """Elements device ``rank`` holds."""
        if not 0 <= rank < self.world_size:
            raise PlacementError(f"{name}: rank {rank} is outside the {self.world_size} devices")
        start, end = self.ranges(shape, name)[rank]
        return end - start

    def local_shape(self, shape: Shape, rank: int, name: str = "tensor") -> tuple[int]:
        """The local tensor is the flat 1-D slice of the row-major storage."""
        return (self.local_numel(shape, rank, name),)

    @staticmethod
    def whole_on(device: int, world_size: int) -> RaggedShard:
        """One device (``device``) holds the whole tensor; the others hold nothing."""
        if not 0 <= device < world_size:
            raise PlacementError(f"device {device} is outside the {world_size} devices")
        return RaggedShard((), tuple(int(i == device) for i in range(world_size)))


def _ints(label: str, values: tuple[int, ...]) -> tuple[int, ...]:
    """``values`` as a tuple of ints; floats, bools and strings are an error, not truncated."""
    out = tuple(values)
    bad = [v for v in out if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if bad:
        raise PlacementError(f"RaggedShard {label}={out} must hold ints, got {bad}")
    return tuple(int(v) for v in out)
