"""What test_fsdp_data_dependent runs in each gloo worker: models whose modules run on some ranks only.

Routing decides per step which modules each rank's rows use, as a mixture-of-experts layer does when it
loops only over the experts that got tokens. Every case trains a few AdamW steps single-process on the
whole batch (the reference) and under ``fully_shard`` with each rank on its rows, and returns the worst
relative loss and parameter differences (rank 0) and what each rank's routing did (to prove the case
was exercised). PyTorch FSDP2 is not run here: on these cases it crashes or aborts the process (a
gradient missing on one rank changes its reduce-scatter's size).
"""

from __future__ import annotations

import copy
import functools
import os

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.torch_backend._dist import run_cases
from tests.torch_backend._user_model_workers import adamw_steps, full_params, rel_errors

os.environ.setdefault("HF_HUB_OFFLINE", "1")
B, D, SEED = 12, 8, 0  # 12 rows: an even split over 2, 3 and 4 ranks

# Each step's expert per row. With 2 ranks (rows 0-5 | 6-11): step 0 runs expert 0 on rank 0 only and
# the bonus on rank 1 only; step 1 uses neither expert 2 nor the bonus anywhere (their .grad stays None,
# AdamW skips them); step 2 runs expert 2 (twice per row) on rank 0 only; step 3 no expert at all: the
# blocks' projections get no gradient anywhere and the aux head none on rank 1. 3 and 4 ranks split
# these further (many experts empty on some ranks).
ROUTES = [
    [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 1],
    [1, 1, 1, 1, 1, 1, 0, 1, 0, 1, 0, 1],
    [2, 2, 3, 3, 2, 2, 0, 0, 0, 0, 0, 0],
    [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3],
]
STEPS = len(ROUTES)
BONUS = 3  # rows routed here use the root's ``bonus`` parameter and no expert


class RoutedBlock(nn.Module):
    """A norm, a projection and one module per expert; each row goes to the expert its route names.

    Only experts that got rows run (the MoE loop); expert 2 is applied twice (a parameter used twice).
    """

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(x))
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            y = expert(h[rows])
            out = out.index_add(0, rows, expert(y) if e == 2 else y)
        return x + torch.tanh(out)


class Routed(nn.Module):
    """Two routed blocks, a root parameter used only by some rows, and an auxiliary head whose loss
    term counts only the rows routed to expert 0 (zero where there are none).

    With ``skip_aux`` the term is left out where no row went to expert 0: the aux unit then runs
    forward on every rank but gets no gradient on some, which no FSDP can reduce without knowing it.
    """

    def __init__(self, skip_aux: bool = False) -> None:
        super().__init__()
        self.skip_aux = skip_aux
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(RoutedBlock() for _ in range(2))
        self.bonus = nn.Parameter(0.1 * torch.randn(D))
        self.head = nn.Linear(D, 1)
        self.aux = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, route)
        bonus = route == BONUS
        if bonus.any():
            h = h + bonus[:, None] * self.bonus
        loss = self.head(h).square().mean()
        aux = self.aux(h)
        first = route == 0
        if first.any() or not self.skip_aux:  # / the rank's row count: the mean over ranks is the whole
            loss = loss + aux[first].square().sum() / len(h)
        return loss


# Routes of ``SideTowers``' two experts: over 2 or 4 ranks, the first half of the rows uses both experts
# on every rank, the second half only expert 0, so one rank's routed unit gets every gradient and
# another's misses expert 1's.
SIDE_ROUTES = [[0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0]]


class SideTowers(nn.Module):
    """A linear and a routed block both on the raw input (no gradient), their product into the head.

    The routed block's backward runs first (autograd runs the later-built nodes first) and ends, on
    a rank where every expert got rows, when its last gradient lands (its input needs none): before
    the linear's backward starts there, but on a rank where expert 1 got no rows only at the end of
    backward. Its reduce-scatter must wait for every rank, not go out when one rank is done.
    """

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(D, D)
        self.second = RoutedBlock(experts=2)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.head(self.first(x) * self.second(x, route)).square().mean()


def _side_towers(mesh, rank: int, world: int) -> dict:
    from torch_backend import fully_shard

    torch.manual_seed(SEED)
    plain = SideTowers()
    model = copy.deepcopy(plain)
    fully_shard(model.first, mesh=mesh)
    fully_shard(model.second, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rows = slice(rank * B // world, (rank + 1) * B // world)

    def run(m: nn.Module, rows: slice) -> list[float]:
        def step_loss(step: int) -> torch.Tensor:
            x = torch.randn(B, D, generator=torch.Generator().manual_seed(300 + step))
            return m(x[rows], torch.tensor(SIDE_ROUTES[step % 2])[rows])
        return adamw_steps(m, step_loss, STEPS, rows != slice(None))

    losses = run(model, rows)
    params = full_params(model)
    reference = (run(plain, slice(None)), full_params(plain))
    experts = [sorted({int(e) for e in torch.tensor(SIDE_ROUTES[s % 2][rows]).unique()})
               for s in range(STEPS)]
    return against(reference, losses, params) | {"routes": experts}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(100 + step))
    return x, torch.tensor(ROUTES[step])


def build(skip_aux: bool = False) -> Routed:
    torch.manual_seed(SEED)
    return Routed(skip_aux)


def train(model: nn.Module, rows: slice = slice(None)) -> list[float]:
    """AdamW on ``rows`` of each batch; returns the mean loss over every rank."""
    return adamw_steps(model, lambda step: model(*(t[rows] for t in batch(step))), STEPS, rows != slice(None))


def against(reference: tuple[list[float], dict], losses: list[float], params: dict) -> dict:
    want_losses, want_params = reference
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
            "params": rel_errors(params, want_params)}


def _routed(mesh, rank: int, world: int, reentrant: bool | None = None) -> dict:
    """Blocks, the aux head and the root as units; each rank trains on its rows. ``reentrant``: the
    blocks run under activation checkpointing (torch.utils.checkpoint, that mode; None: without)."""
    from torch.utils.checkpoint import checkpoint

    from torch_backend import fully_shard

    plain = build()
    model = copy.deepcopy(plain)
    if reentrant is not None:
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=reentrant)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.aux, mesh=mesh)
    fully_shard(model, mesh=mesh)
    replicas = mesh.size(0) if mesh.ndim == 2 else 1
    n = mesh.size()
    rows = slice(rank * B // n, (rank + 1) * B // n)
    losses = train(model, rows)
    params = full_params(model)
    reference = (train(plain), full_params(plain))
    experts = [sorted({int(e) for e in torch.tensor(r[rows]).unique()}) for r in ROUTES]
    return against(reference, losses, params) | {"routes": experts, "replicas": replicas}


def _units_on_some_ranks(mesh, rank: int, world: int, experts_as_units: bool) -> dict:
    """Each expert its own unit (skipped, forward and backward, on the ranks none of whose rows it
    got), or the aux unit with no gradient on some ranks (its loss term left out there): the schedule
    gathers and reduces them on every rank anyway, so training equals single-process training."""
    from torch_backend import fully_shard

    plain = build(skip_aux=not experts_as_units)
    model = copy.deepcopy(plain)
    for block in model.blocks:
        if experts_as_units:
            for expert in block.experts:
                fully_shard(expert, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model.aux, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    losses = train(model, rows)
    params = full_params(model)
    return against((train(plain), full_params(plain)), losses, params)


def _switch_transformers(mesh, rank: int, world: int) -> dict:
    """HuggingFace SwitchTransformers (experts are separate modules, run only when hit), one unit per
    block and the root, against single-process training; returns which experts each rank hit."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        SwitchTransformersTop1Router,
    )

    from torch_backend import fully_shard

    config = SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, expert_capacity=64, num_layers=2, num_decoder_layers=2,
        num_heads=2, num_experts=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        router_jitter_noise=0.0, dropout_rate=0.0, router_z_loss_coef=0.0, router_aux_loss_coef=0.0,
        decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(SEED)
    plain = SwitchTransformersForConditionalGeneration(config)
    for m in plain.modules():  # the config has no float64 router: each forward would cast it to float32
        if isinstance(m, SwitchTransformersTop1Router):
            m.dtype = torch.float64
    model = copy.deepcopy(plain)
    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    hits: list[set[str]] = []
    for name, m in model.named_modules():
        if ".expert_" in name and name.rsplit(".", 1)[-1].startswith("expert_"):
            m.register_forward_pre_hook(lambda _m, _a, name=name: hits[-1].add(name))

    def tokens(step: int) -> torch.Tensor:
        return torch.randint(0, 64, (B, 8), generator=torch.Generator().manual_seed(200 + step))

    def step_loss(m: nn.Module, rows: slice, step: int) -> torch.Tensor:
        if m is model:
            hits.append(set())
        t = tokens(step)[rows]
        return m(input_ids=t, labels=t.flip(1)).loss  # same length rows: the mean over ranks is whole

    rows = slice(rank * B // world, (rank + 1) * B // world)
    losses = adamw_steps(model, functools.partial(step_loss, model, rows), 3, sharded=True)
    params = full_params(model)
    reference = (adamw_steps(plain, functools.partial(step_loss, plain, slice(None)), 3, sharded=False),
                 full_params(plain))
    return against(reference, losses, params) | {"hits": [sorted(h) for h in hits]}


def checks(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)  # every model and batch below: parity far from rounding
    cases = {}
    mesh = init_device_mesh("cpu", (world,))
    cases["routed"] = lambda: _routed(mesh, rank, world)
    if world == 4:
        cases["routed_hsdp"] = lambda: _routed(init_device_mesh("cpu", (2, 2)), rank, world)
    if world == 2:
        for reentrant in (False, True):
            case = f"routed_checkpointed_reentrant={reentrant}"
            cases[case] = lambda r=reentrant: _routed(mesh, rank, world, r)
    cases["switch"] = lambda: _switch_transformers(mesh, rank, world)
    if world in (2, 4):
        cases["side_towers"] = lambda: _side_towers(mesh, rank, world)
    cases["experts_as_units"] = lambda: _units_on_some_ranks(mesh, rank, world, experts_as_units=True)
    cases["aux_without_gradient"] = lambda: _units_on_some_ranks(mesh, rank, world, experts_as_units=False)
    return run_cases(cases)
