"""Distributed Muon (veScale-FSDP Algorithm 2) on RaggedShard DTensors, AdamW for the other parameters.

For each 2-D parameter: the momentum update runs on the local shard; the (Nesterov) momentum is
redistributed to ``RaggedShard.whole_on(root)`` (one gather), Newton-Schulz orthogonalizes it on the root
only (the other devices hold nothing and skip it), and the result is redistributed back to the
parameter's placement (one scatter) and applied. Roots are chosen once by the core's load balancing
(``ragged.assign_roots`` over ``ragged.newton_schulz_cost``), the same way on every device. Plain tensors
(single process) and replicated DTensors run Newton-Schulz locally.

The update is scaled by ``sqrt(max(1, rows / cols))`` (Keller Jordan's shape rule, so that tall matrices
get the same per-row step). Weight decay is decoupled. Parameters that are not 2-D use AdamW with
fp32 state (``adamw_lr``, ``adamw_betas``, ``adamw_eps``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import ragged
from torch_backend._placement import RaggedShard
from torch_backend.optim._adam8bit import adam_direction
from torch_backend.optim._params import ParamwiseOptimizer, local_slice, named_params


def newton_schulz(g: torch.Tensor, steps: int = ragged.NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalize a matrix: 5 quintic steps on ``X / ||X||_F`` (fp32).

    Each step maps the singular values by ``p(s) = a s + b s^3 + c s^5`` (``ragged.NS_COEFFS``) and keeps
    the singular vectors, so the result is ``U p^steps(S / ||G||_F) V^T``: close to the polar factor
    ``U V^T``, with singular values in roughly [0.7, 1.2]. Works on the wide orientation (transposed when
    rows > cols) so ``X X^T`` is the smaller Gram matrix.
    """
    a, b, c = ragged.NS_COEFFS
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def orthogonalize(update: torch.Tensor, p: torch.Tensor, root: int) -> torch.Tensor:
    """Newton-Schulz of the whole matrix ``p`` from the local flat slice ``update``; returns the local slice.

    A RaggedShard DTensor goes to ``root`` and back (two redistributions); anything else is whole here.
    """
    if not (isinstance(p, DTensor) and any(isinstance(q, RaggedShard) for q in p.placements)):
        return newton_schulz(update.view(p.shape)).reshape(-1)
    mesh, placements = p.device_mesh, p.placements
    dim = next(i for i, q in enumerate(placements) if isinstance(q, RaggedShard))
    on_root = list(placements)
    on_root[dim] = RaggedShard.whole_on(root, mesh.size(dim))
    # run_check=False: both locals are cut from the layout here, so skip from_local's size all_gather.
    sharded = DTensor.from_local(update, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
    whole = sharded.redistribute(mesh, on_root).to_local()  # the full matrix on root, empty elsewhere
    if whole.numel():
        whole = newton_schulz(whole.view(p.shape)).reshape(-1)
    back = DTensor.from_local(whole, mesh, on_root, run_check=False, shape=p.shape, stride=p.stride())
    return back.redistribute(mesh, placements).to_local()


class Muon(ParamwiseOptimizer):
    """Muon for 2-D parameters (distributed as in veScale-FSDP Algorithm 2), AdamW for the rest.

    Args:
        params: parameters or ``named_parameters()`` (names appear in errors).
        lr: Muon's learning rate; momentum: its momentum; nesterov: use the Nesterov update.
        weight_decay: decoupled weight decay for every parameter.
        adamw_lr, adamw_betas, adamw_eps: AdamW for parameters that are not 2-D.

    Raises:
        ragged.PlacementError: a DTensor placement other than RaggedShard / Replicate, or matrices sharded
            over mesh dims of different sizes.

    Example:
        >>> opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4)
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, adamw_lr: float = 3e-4,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps))
        matrices = []
        for p, name, _ in named_params(self):
            local_slice(p, name)  # placement check, before any collective
            if p.ndim == 2:
                matrices.append(p)
        worlds = sorted({_ragged_world(p) for p in matrices} - {1})
        if len(worlds) > 1:
            raise ragged.PlacementError(
                f"Muon: 2-D parameters are ragged-sharded over meshes of {worlds} devices; roots are "
                "balanced over one mesh dim, use one sharding mesh size (or one optimizer per mesh)"
            )
        world = worlds[0] if worlds else 1
        roots = ragged.assign_roots([ragged.newton_schulz_cost(tuple(p.shape)) for p in matrices], world)
        self._roots = {id(p): r for p, r in zip(matrices, roots)}

    def root(self, p: torch.Tensor) -> int:
        """The device that orthogonalizes 2-D parameter ``p``."""
        return self._roots[id(p)]

    def _update(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        (self._muon if p.ndim == 2 else self._adamw)(p, name, group)

    def _muon(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        local, _ = local_slice(p, name)
        grad, _ = local_slice(p.grad, name + ".grad")
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(local, dtype=torch.float32)
        buf, mu = state["momentum"], group["momentum"]
        buf.lerp_(grad.float(), 1 - mu)
        update = torch.lerp(grad.float(), buf, mu) if group["nesterov"] else buf.clone()
        ortho = orthogonalize(update, p, self.root(p))
        local.mul_(1 - group["lr"] * group["weight_decay"])
        local.add_(ortho.to(local.dtype), alpha=-group["lr"] * ragged.muon_scale(tuple(p.shape)))

    def _adamw(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        local, _ = local_slice(p, name)
        grad, _ = local_slice(p.grad, name + ".grad")
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(local, dtype=torch.float32),
                         exp_avg_sq=torch.zeros_like(local, dtype=torch.float32))
        state["step"] += 1
        direction = adam_direction(state["exp_avg"], state["exp_avg_sq"], grad.float(), state["step"],
                                   group["adamw_betas"], group["adamw_eps"])
        local.mul_(1 - group["adamw_lr"] * group["weight_decay"])
        local.add_(direction.to(local.dtype), alpha=-group["adamw_lr"])


def _ragged_world(p: torch.Tensor) -> int:
    """Devices on the mesh dim that ragged-shards ``p`` (1 for plain or replicated tensors)."""
    if isinstance(p, DTensor):
        for i, q in enumerate(p.placements):
            if isinstance(q, RaggedShard):
                return p.device_mesh.size(i)
    return 1
