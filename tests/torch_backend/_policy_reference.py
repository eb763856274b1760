"""Single-process training as a mixed-precision (or fp32) sharded run computes it: the reference of the
spread bounds (``tests.parity.assert_within_spread``).

Each step's rows go in as many micro-batches as the run has data-parallel devices, each one's forward and
backward apart on the master cast to ``compute`` (bf16: the policy's casts of parameters and float inputs;
fp32: none), so each block's gradient is rounded as each device's is; the gradients are summed in the
master's dtype and averaged, then (optionally) clipped and stepped. ``order`` trains the same steps
summed in another order: each step's rows permuted before they are split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call


def permuted(rows: Sequence[torch.Tensor], order: int | None, step: int) -> tuple[torch.Tensor, ...]:
    """``rows`` (tensors that share dim 0) in the row order of ``(order, step)``; unchanged for None."""
    if order is None:
        return tuple(rows)
    perm = torch.randperm(len(rows[0]), generator=torch.Generator().manual_seed(1000 * order + step))
    return tuple(t[perm] for t in rows)


def train(model: nn.Module, batch: Callable[[int], Sequence[torch.Tensor]],
          loss_of: Callable[[Callable[..., object], Sequence[torch.Tensor]], torch.Tensor], steps: int,
          micro: int, optimizer: torch.optim.Optimizer, compute: torch.dtype = torch.float32,
          order: int | None = None, clip: Callable[[nn.Module], float] | None = None) -> dict:
    """Train ``model`` (the masters) ``steps`` steps of ``optimizer`` on ``batch(step)``'s rows in ``micro``
    micro-batches; ``loss_of(call, rows)`` is a micro-batch's loss, ``call(*inputs)`` the model on the cast
    parameters (float inputs cast too). Returns each step's mean loss, the ``clip`` norms and the final
    parameters (float64 copies)."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out: dict = {"losses": [], "norms": []}
    for step in range(steps):
        total = 0.0
        for chunk in zip(*(t.chunk(micro) for t in permuted(batch(step), order, step))):
            cast = {n: p.to(compute) for n, p in named.items()}  # a differentiable cast (none in fp32)

            def call(*inputs, cast=cast):
                inputs = [x.to(compute) if x.is_floating_point() else x for x in inputs]
                return functional_call(model, cast, tuple(inputs))

            loss = loss_of(call, chunk)
            grads = torch.autograd.grad(loss, list(cast.values()), allow_unused=True)
            for p, g in zip(named.values(), grads):
                if g is not None:  # a parameter no row used keeps .grad None, as in plain training
                    g = g.to(p.dtype) / micro
                    p.grad = g if p.grad is None else p.grad + g
            total += float(loss.detach()) / micro
        if clip is not None:
            out["norms"].append(clip(model))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(total)
    out["params"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    return out
