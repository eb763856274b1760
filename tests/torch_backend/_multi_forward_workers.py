"""What test_fsdp_multi_forward runs in each gloo worker: several forwards before one backward.

Each pattern trains a few AdamW steps in float64 single-process on the whole batch (the reference), under
our ``fully_shard`` and under PyTorch FSDP2 (each rank on its rows), and returns the worst relative loss
and parameter differences against the reference (rank 0), or the error each raised. Patterns:

- ``pair``: two forwards (a contrastive pair, DPO's chosen and rejected) then one backward of the sum;
- ``pair_no_grad``: the same with a third forward under ``no_grad`` between them (a frozen reference's
  logits computed with the same model);
- ``reuse``: a block applied twice at once, then another block between two calls of the first;
- ``max_norm_tied``: ``nn.Embedding(max_norm=1)`` whose weight the head shares (renormed rows are read
  by the head in the same forward, as in single-process training).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.torch_backend._dist import run_cases
from tests.torch_backend._dropin_workers import Block, D, V
from tests.torch_backend._user_model_workers import full_params, rel_errors

B, T, SEED, STEPS, LR = 24, 4, 0, 3, 1e-2  # 24 rows: two even halves on 2, 3, 4 ranks


class Net(nn.Module):
    """An embedding, two blocks, a head; ``pattern`` says how often each block runs per forward."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        tied = pattern == "max_norm_tied"
        self.embed = nn.Embedding(V, D, max_norm=1.0 if tied else None)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.calls = (0, 0, 1, 0, 1) if pattern == "reuse" else (0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i in self.calls:
            h = self.blocks[i](h)
        return self.head(h)


def build(pattern: str) -> Net:
    torch.manual_seed(SEED)
    return Net(pattern).double()


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def step_loss(model: nn.Module, pattern: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The step's loss on rows ``x``: one forward, or two (each on half the rows) summed."""
    if pattern in ("reuse", "max_norm_tied"):
        return cross_entropy(model, x, y)
    half = len(x) // 2
    first = cross_entropy(model, x[:half], y[:half])
    if pattern == "pair_no_grad":
        with torch.no_grad():
            first = first + 0.0 * cross_entropy(model, x, y)  # the value is used, its graph is not
    return (first + cross_entropy(model, x[half:], y[half:])) / 2


def rows(rank: int, world: int, x: torch.Tensor) -> torch.Tensor:
    """This rank's rows, with each half of them from the same half of the whole batch: the mean over
    ranks of their two-forward losses is the whole batch's."""
    half, n = len(x) // 2, len(x) // (2 * world)
    return torch.cat([x[rank * n:(rank + 1) * n], x[half + rank * n:half + (rank + 1) * n]])


def train(model: nn.Module, pattern: str, rank: int | None = None, world: int = 1) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
        if rank is not None:
            x, y = rows(rank, world, x), rows(rank, world, y)
        loss = step_loss(model, pattern, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if rank is not None:
            dist.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
    return losses


def shard(model: Net, mesh, which: str, reshard_after_forward: bool) -> Net:
    if which == "ours":
        from torch_backend import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if model.head.weight is not model.embed.weight:
        fully_shard(model.embed, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _case(mesh, rank: int, world: int, pattern: str, reshard_after_forward: bool) -> dict:
    plain = build(pattern)
    ref_losses = train(plain, pattern)
    ref_params = full_params(plain)
    out = {}
    for which in ("ours", "fsdp2"):
        try:
            model = shard(build(pattern), mesh, which, reshard_after_forward)
            losses = train(model, pattern, rank, world)
            out[which] = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                          "params": rel_errors(full_params(model), ref_params)}
        except Exception as e:  # noqa: BLE001 - FSDP2's failures are part of the comparison
            out[which] = {"error": f"{type(e).__name__}: {e}"}
    return out


PATTERNS = ("pair", "pair_no_grad", "reuse", "max_norm_tied")


def checks(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    cases = {}
    for pattern in PATTERNS:
        for reshard in (True, False):
            cases[f"{pattern} reshard={reshard}"] = (
                lambda p=pattern, r=reshard: _case(mesh, rank, world, p, r))
    return run_cases(cases)
