"""RaggedShard as a ``torch.distributed.tensor.Placement``.

The placement is a thin torch-side twin of the core :class:`ragged.RaggedShard`: it carries the same
``dims`` and ``local_units`` and asks the core for every range, validation and plan. On its mesh dim,
device ``i``'s local tensor is the flat 1-D slice ``[start_i, end_i)`` of the global tensor's row-major
storage (empty for zero blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Placement

import ragged


class RaggedShard(Placement):
    """A DTensor placement that holds ``local_units[i]`` equal blocks of the flattened tensor on device ``i``.

    The tensor is cut into ``sum(local_units)`` equal blocks along its flattened row-major storage
    (veScale's name ``local_units`` counts blocks); a block is a whole number of sub-tensors of
    ``prod(shape[len(dims):])`` elements (so ``dims=(0,)`` keeps rows whole, ``dims=tuple(range(ndim))``
    is element granularity and ``dims=()`` with one-hot blocks puts the whole tensor on one device).
    The local tensor is always 1-D.

    Args:
        dims: a prefix ``(0, ..., k-1)`` of the tensor's dims.
        local_units: the number of blocks on each device of the mesh dim (zeros and uneven allowed).

    Raises:
        ragged.PlacementError: if ``dims`` is not a prefix or ``local_units`` is empty, negative or all zero.

    Example:
        >>> from torch.distributed.tensor import DTensor
        >>> p = RaggedShard(dims=(0,), local_units=(1, 0, 2))
        >>> p.core.ranges((6, 4))
        ((0, 8), (8, 8), (8, 24))
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]) -> None:
        super().__init__()
        # The core validates (prefix dims, non-negative counts, nonzero sum) at construction.
        self._core = ragged.RaggedShard(tuple(dims), tuple(local_units))
        _install_dtensor_patches()

    @property
    def core(self) -> ragged.RaggedShard:
        """The framework-agnostic placement that defines every range."""
        return self._core

    @property
    def dims(self) -> tuple[int, ...]:
        return self._core.dims

    @property
    def local_units(self) -> tuple[int, ...]:
        return self._core.local_units

    @staticmethod
    def from_core(core: ragged.RaggedShard) -> RaggedShard:
        return RaggedShard(core.dims, core.local_units)

    @staticmethod
    def whole_on(device: int, world_size: int) -> RaggedShard:
        """One device (``device``) holds the whole tensor: ``dims=()`` with one-hot blocks."""
        return RaggedShard.from_core(ragged.RaggedShard.whole_on(device, world_size))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedShard) and self._core == other._core

    def __hash__(self) -> int:
        return hash(("RaggedShard", self._core))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS({self.dims}, {self.local_units})"

    def __reduce__(self):
        # Placements travel through pickling (DCP metadata, spawn workers); rebuild from the two fields.
        return (RaggedShard, (self.dims, self.local_units))


def _install_dtensor_patches() -> None:
    """Patch torch's DTensor for RaggedShard (once per process): the first RaggedShard is the first use.

    Imported here, not at the top: the patches module builds on this one.
    """
    from torch_backend.placement._dtensor_patches import install

    install()


def ragged_mesh_dim(placements: Sequence[Placement], name: str = "tensor") -> int | None:
    """The mesh dim that holds a RaggedShard (``None`` if none).

    Raises:
        ragged.PlacementError: if more than one mesh dim holds a RaggedShard.
    """
    found = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if len(found) > 1:
        raise ragged.PlacementError(
            f"{name}: placements {tuple(placements)} put a RaggedShard on mesh dims {found}; a tensor "
            "may be ragged-sharded on one mesh dim only (use Shard or Replicate on the others)"
        )
    return found[0] if found else None
