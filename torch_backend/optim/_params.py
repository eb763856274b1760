"""What both torch optimizers share: where a parameter's local slice sits, parameter names, and the
``step`` shell that walks every parameter with a gradient."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import ragged
from torch_backend.placement import RaggedShard, ragged_mesh_dim


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to at least fp32 (the optimizers' state and arithmetic): fp32 for bf16, fp16
    and fp32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


class LocalSlice(NamedTuple):
    """Where a parameter's local elements sit in the tensor."""

    flat: torch.Tensor  # this device's elements, 1-D (a view: updating it updates the parameter)
    box: tuple[int, ...]  # the part of the tensor the Shard (tensor-parallel) mesh dims leave this device
    ranges: list[tuple[int, int]]  # every device's flat range of ``box`` on the ragged mesh dim


def shard_splits(p: torch.Tensor, name: str) -> tuple[tuple[int, int], ...]:
    """``(tensor dim, parts)`` of each ``Shard`` mesh dim of ``p``, in mesh order (none for plain tensors).

    Raises:
        ragged.PlacementError: a placement other than RaggedShard / Shard / Replicate, or a Shard that
            does not split its dim evenly (naming ``name``); before any collective, on every rank alike.
    """
    if not isinstance(p, DTensor):
        return ()
    placements = p.placements
    bad = [q for q in placements if type(q) not in (RaggedShard, Shard, Replicate)]  # _StridedShard too
    if bad:
        raise ragged.PlacementError(
            f"{name}: placements {tuple(placements)} are not supported by this optimizer; it needs "
            "RaggedShard on at most one mesh dim and Shard(dim) (tensor parallelism) or Replicate elsewhere, "
            "so that each device's elements are one range of one part of the tensor"
        )
    splits = tuple((q.dim % p.ndim, n) for q, n in zip(placements, p.device_mesh.shape) if type(q) is Shard)
    try:
        split_box(tuple(p.shape), splits)
    except ValueError as e:
        raise ragged.PlacementError(f"{name}: placements {tuple(placements)} split a dim unevenly ({e}); "
                                    "this optimizer needs every device's part of the same shape") from None
    return splits


def split_box(shape: tuple[int, ...], splits: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """``shape`` cut by each ``(dim, parts)`` of ``splits`` in turn (ValueError if one is uneven)."""
    box = list(shape)
    for dim, parts in splits:
        if box[dim] % parts:
            raise ValueError(f"dim {dim} of size {box[dim]} over {parts} devices")
        box[dim] //= parts
    return tuple(box)


def local_slice(p: torch.Tensor, name: str) -> LocalSlice:
    """A parameter's local flat tensor, its box and every device's flat range of the box.

    Plain tensors and replicated DTensors are whole on this device. A DTensor's ``Shard`` mesh dims
    (tensor parallelism) cut its box, evenly; a ``RaggedShard`` then holds its range of the box on the
    ragged mesh dim (the placement layer's box rule); ``Replicate`` dims (HSDP) change nothing.

    Raises:
        ragged.PlacementError: as ``shard_splits``, naming ``name``.
    """
    splits = shard_splits(p, name)
    if not isinstance(p, DTensor):
        return LocalSlice(p.detach().view(-1), tuple(p.shape), [(0, p.numel())])
    box = split_box(tuple(p.shape), splits)
    local = p.to_local().detach().view(-1)
    m = ragged_mesh_dim(p.placements, name)
    ranges = [(0, math.prod(box))] if m is None else list(p.placements[m].core.ranges(box, name))
    return LocalSlice(local, box, ranges)


def param_names(group: dict[str, Any], index: int) -> list[str]:
    """The names of a param group's parameters (``named_parameters`` input), else ``param {i}``."""
    names = group.get("param_names")
    return list(names) if names else [f"param {index + i}" for i in range(len(group["params"]))]


def named_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, str, dict]]:
    """``(param, name, group)`` for every parameter of ``optimizer``, in param-group order."""
    seen = 0
    for group in optimizer.param_groups:
        yield from ((p, name, group) for p, name in zip(group["params"], param_names(group, seen)))
        seen += len(group["params"])




class ParamwiseOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``step`` calls ``_update(param, name, group)`` for every
    parameter that has a gradient, then ``_finish_step()``; subclasses own the math and the state."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, name, group in named_params(self):
            if p.grad is not None:
                self._update(p, name, group)
        self._finish_step()
        return loss

    def _finish_step(self) -> None:
        """Work over the whole step's updates once every parameter was seen (Muon batches its Newton-Schulz
        here); nothing by default."""

    def _update(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        raise NotImplementedError
