"""What test_fsdp_moe runs in each gloo worker: the MoE decoders under ``parallelize`` with empty experts.

Every case trains the tiny MoE presets (per-expert modules, fused experts, sigmoid router with a shared
expert and a dense first layer) for a few AdamW steps with one unit per decoder layer, the embedding, the
head and the root, each rank on its rows, and the same steps single-process (the reference). Rows 0 and
1 of every batch repeat one token: attention then mixes equal values, every position routes alike, and
the rank(s) holding them run only ``top_k`` experts per layer while the others run more; so experts go
empty on some ranks and not on others. At step 0 every row repeats one token but for a few positions (an
all-equal batch would leave attention's q and k projections a gradient that is exactly zero, whose
rounding noise Adam amplifies): few experts run, many are unused everywhere (``.grad`` None), and under
expert parallelism the experts of some EP ranks receive no token.

The reference is FSDP-free. Its loss is the mean of each rank's batch loss, computed apart, because the
load-balancing loss is a product of per-batch means (data-parallel training defines it per rank's
batch). Under the mixed-precision policy it applies the policy's casts and nothing else: every batch's
forward and backward run on a bf16 copy of the fp32 master, and the bf16 gradients are summed in fp32.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ragged.models import MOE_CONFIGS
from tests.torch_backend._dist import run_cases
from tests.torch_backend._user_model_workers import rel_errors

MODELS = ("mixtral-tiny", "gpt-oss-tiny", "deepseek-v3-tiny")
STEPS, ROWS, SEQ, SEED, LR, WEIGHT_DECAY = 5, 4, 8, 0, 1e-2, 0.1  # 4 rows: an even split over 2 and 4 ranks


SKEWED = "+skewed"  # a router bias of +5 on experts 0 .. top_k-1 of every MoE layer: every token goes there


def config(name: str):
    return MOE_CONFIGS[name.removesuffix(SKEWED)]


def build(name: str):
    """The model of ``name`` with its init; ``+skewed``: routing fixed on the first experts (the experts
    of the other EP ranks then receive nothing, every step)."""
    from torch_backend.models import MoEDecoder

    c = config(name)
    model = MoEDecoder(c)
    model.init_weights(SEED)
    if name.endswith(SKEWED):
        with torch.no_grad():
            for layer in model.layers[c.n_dense_layers:]:
                layer.feed_forward.router.bias[:c.top_k] += 5.0
    return model


def batch(step: int, vocab: int) -> torch.Tensor:
    """(ROWS, SEQ + 1) token ids; rows 0 and 1 are one token repeated (those ranks route alike), and at
    step 0 every row is but the last row's second half (few experts run: many are idle everywhere)."""
    rng = np.random.default_rng([SEED, step])
    rows = rng.integers(0, vocab, (ROWS, SEQ + 1))
    rows[:ROWS if step == 0 else 2] = rng.integers(0, vocab)
    if step == 0:  # a few tokens differ: attention still gets a gradient (all-equal rows give none)
        rows[-1, SEQ // 2:] = rng.integers(0, vocab, SEQ // 2 + 1)
    return torch.from_numpy(rows)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def reference(name: str, world: int | tuple[int, ...], dtype: torch.dtype,
              optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = adamw
              ) -> tuple[list[float], dict]:
    """Single-process training: each step, every rank's rows forward and backward apart on a ``dtype``
    copy of the fp32 master; gradients summed in fp32 and averaged; ``optimizer`` (AdamW) on the master.
    ``world``: the ranks, or the ranks of each step (a run resumed at another world size)."""
    from torch_backend.models import moe_loss

    c = config(name)
    master = build(name)
    opt = optimizer(master)
    losses = []
    worlds = (world,) * STEPS if isinstance(world, int) else world
    for step, world in enumerate(worlds):
        step_loss = 0.0
        for rows in batch(step, c.vocab_size).chunk(world):
            compute = copy.deepcopy(master).to(dtype)
            loss = moe_loss(compute(rows[:, :-1]), rows[:, 1:], c.aux_loss_coef)
            loss.backward()
            for p, q in zip(master.parameters(), compute.parameters()):
                if q.grad is not None:  # an expert no row chose keeps .grad None, as in plain training
                    g = q.grad.float() / world
                    p.grad = g if p.grad is None else p.grad + g
            step_loss += loss.item() / world
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    return losses, full_params(master)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in model.named_parameters()}


def sharded(name: str, mesh, rank: int, world: int, bf16: bool, ep_mesh=None, optimizer=adamw,
            granularity=None) -> tuple:
    """``parallelize`` (after ``expert_parallel`` on ``ep_mesh``, both with ``granularity``) and train on
    this rank's rows with ``optimizer`` (AdamW).

    Returns the mean losses, the full parameters and the experts each MoE layer's router chose here per
    step (with ``ep_mesh``: and the rows this rank's experts received, per step and layer)."""
    from torch_backend import MixedPrecisionPolicy
    from torch_backend.models import parallelize
    from torch_backend.models.expert_parallel import expert_parallel

    c = config(name)
    model = build(name)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    if ep_mesh is not None:
        expert_parallel(model, ep_mesh, mp_policy=mp, granularity=granularity)
    parallelize(model, mesh, mp_policy=mp, granularity=granularity)
    routes: list[list[list[int]]] = []
    received: list[list[int]] = []  # expert parallelism: rows this rank's experts received, per layer
    for layer in model.layers[c.n_dense_layers:]:
        layer.feed_forward.router.register_forward_hook(
            lambda _m, _args, out: routes[-1].append(sorted(set(out[1].flatten().tolist()))))
        if ep_mesh is not None:  # runs after the dispatch hook: sees what arrived
            layer.feed_forward.experts.register_forward_pre_hook(
                lambda _m, args: received[-1].append(len(args[0])))
    opt = optimizer(model)
    losses = train(model, opt, name, rank, world, range(STEPS),
                   before_step=lambda: (routes.append([]), received.append([])))
    return losses, full_params(model), routes if ep_mesh is None else (routes, received)


def train(model, opt, name: str, rank: int, world: int, steps: range,
          before_step: Callable[[], object] = lambda: None) -> list[float]:
    """Optimizer steps ``steps`` of the sharded ``model`` on this rank's rows; the mean loss of each step."""
    from torch_backend.models import moe_loss

    c = config(name)
    n = ROWS // world
    losses = []
    for step in steps:
        before_step()
        rows = batch(step, c.vocab_size)[rank * n:(rank + 1) * n]
        loss = moe_loss(model(rows[:, :-1]), rows[:, 1:], c.aux_loss_coef)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().float()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def case(name: str, mesh, rank: int, world: int, bf16: bool) -> dict:
    losses, params, routes = sharded(name, mesh, rank, world, bf16)
    out = {"routes": routes, "top_k": config(name).top_k, "n_experts": config(name).n_experts}
    if rank == 0:
        for label, dtype in [("fp32", torch.float32)] + ([("policy", torch.bfloat16)] if bf16 else []):
            want_losses, want_params = reference(name, world, dtype)
            out[label] = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
                          "params": rel_errors(params, want_params)}
        out["losses"] = losses
    return out


def global_expert_names(params: dict, name: str, ep_mesh) -> dict:
    """This EP rank's experts under their global names (index or slice) for comparison with the reference."""
    c = config(name)
    n_local = c.n_experts // ep_mesh.size(0)
    lo = ep_mesh.get_local_rank("ep") * n_local
    out = {}
    for n, p in params.items():
        head, _, tail = n.partition(".experts.")
        if not tail:
            out[n] = p
        elif c.experts == "fused":
            out[n] = (lo, p)  # rows [lo, lo + n_local) of the reference's tensor
        else:
            local, _, rest = tail.partition(".")
            out[f"{head}.experts.{lo + int(local)}.{rest}"] = p
    return out


def ep_case(name: str, rank: int, world: int, ep: int, optimizer=adamw, granularity=None) -> dict:
    """Expert parallelism on an (ep, world / ep) mesh, every other parameter over all ranks, fp32; trained
    and referenced with ``optimizer`` (AdamW), sharded with ``granularity``."""
    ep_mesh = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "fsdp"))
    losses, params, (routes, received) = sharded(name, init_device_mesh("cpu", (world,)), rank, world, False,
                                                 ep_mesh, optimizer, granularity)
    want_losses, want = reference(name, world, torch.float32, optimizer)
    got, ref = held_and_reference(params, name, ep_mesh, want)
    held = sum(p.numel() for n, p in got.items() if ".experts." in n)
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    return {"routes": routes, "received": received, "top_k": config(name).top_k,
            "n_experts": config(name).n_experts, "fp32": {"loss": loss, "params": rel_errors(got, ref)},
            "expert_numel_held": held,
            "expert_numel_total": sum(p.numel() for n, p in want.items() if ".experts." in n)}


def held_and_reference(params: dict, name: str, ep_mesh, want: dict) -> tuple[dict, dict]:
    """The parameters this EP rank holds and the reference's same tensors (or rows), by global name."""
    got, ref = {}, {}
    for n, p in global_expert_names(params, name, ep_mesh).items():
        if isinstance(p, tuple):
            lo, p = p
            got[n], ref[n] = p, want[n][lo:lo + len(p)]
        else:
            got[n], ref[n] = p, want[n]
    return got, ref


def checks(rank: int, world: int) -> dict:
    cases = {}
    mesh = init_device_mesh("cpu", (world,))
    for name in MODELS:
        cases[f"{name}/fp32"] = lambda name=name: case(name, mesh, rank, world, bf16=False)
        cases[f"{name}/bf16"] = lambda name=name: case(name, mesh, rank, world, bf16=True)
        for ep in {2: (2,), 4: (2, 4)}[world]:
            cases[f"{name}/ep{ep}"] = lambda name=name, ep=ep: ep_case(name, rank, world, ep)
    if world == 4:
        skewed = f"gpt-oss-tiny{SKEWED}"
        for ep in (2, 4):
            cases[f"{skewed}/ep{ep}"] = lambda ep=ep: ep_case(skewed, rank, world, ep)
    return run_cases(cases)
