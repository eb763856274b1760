"""What both torch optimizers share: where a parameter's local slice sits, parameter names, and the
``step`` shell that walks every parameter with a gradient."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

import ragged
from torch_backend.placement import RaggedShard, ragged_mesh_dim


def local_slice(p: torch.Tensor, name: str) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A parameter's local flat tensor and every device's flat range of it.

    Plain tensors and replicated DTensors are whole on this device; a RaggedShard DTensor holds its
    ``RaggedShard`` range on the ragged mesh dim (the other mesh dims must be Replicate, as under HSDP).

    Raises:
        ragged.PlacementError: a DTensor placement other than RaggedShard / Replicate (naming ``name``).
    """
    if not isinstance(p, DTensor):
        return p.detach().view(-1), [(0, p.numel())]
    placements = p.placements
    bad = [q for q in placements if not isinstance(q, (RaggedShard, Replicate))]
    if bad:
        raise ragged.PlacementError(
            f"{name}: placements {tuple(placements)} are not supported by this optimizer; it needs "
            "RaggedShard on one mesh dim (Replicate elsewhere) so that blocks stay whole on one device"
        )
    local = p.to_local().detach().view(-1)
    m = ragged_mesh_dim(placements, name)
    if m is None:
        return local, [(0, p.numel())]
    return local, list(placements[m].core.ranges(tuple(p.shape), name))


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
