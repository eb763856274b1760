"""What test_fsdp_moe runs in each gloo worker: the MoE decoders under ``parallelize`` with empty experts.

Every case trains the tiny MoE presets (per-expert modules, fused experts, sigmoid router with a shared
expert and a dense first layer) for a few AdamW steps with one unit per decoder layer, the embedding, the
head and the root, each rank on its rows, and the same steps single-process (the reference). Rows 0 and
1 of every batch repeat one token: attention then mixes equal values, every position routes alike, and
the rank(s) holding them run only ``top_k`` experts per layer while the others run more; so experts go
empty on some ranks and not on others, and some steps leave an expert unused everywhere.

The reference is FSDP-free. Its loss is the mean of each rank's batch loss, computed apart, because the
load-balancing loss is a product of per-batch means (data-parallel training defines it per rank's
batch). Under the mixed-precision policy it applies the policy's casts and nothing else: every batch's
forward and backward run on a bf16 copy of the fp32 master, and the bf16 gradients are summed in fp32.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ragged.models import MOE_CONFIGS
from tests.torch_backend._user_model_workers import rel_errors

MODELS = ("mixtral-tiny", "gpt-oss-tiny", "deepseek-v3-tiny")
STEPS, ROWS, SEQ, SEED, LR, WEIGHT_DECAY = 5, 4, 8, 0, 1e-2, 0.1  # 4 rows: an even split over 2 and 4 ranks


def batch(step: int, vocab: int) -> torch.Tensor:
    """(ROWS, SEQ + 1) token ids; rows 0 and 1 are one token repeated (those ranks route alike)."""
    rng = np.random.default_rng([SEED, step])
    rows = rng.integers(0, vocab, (ROWS, SEQ + 1))
    rows[:2] = rng.integers(0, vocab)
    return torch.from_numpy(rows)


def reference(name: str, world: int, dtype: torch.dtype) -> tuple[list[float], dict]:
    """Single-process training: each step, every rank's rows forward and backward apart on a ``dtype``
    copy of the fp32 master; gradients summed in fp32 and averaged; AdamW on the master."""
    from torch_backend.models import MoEDecoder, moe_loss

    c = MOE_CONFIGS[name]
    master = MoEDecoder(c)
    master.init_weights(SEED)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
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


def sharded(name: str, mesh, rank: int, world: int, bf16: bool) -> tuple[list[float], dict, list]:
    """``parallelize`` and train on this rank's rows; returns the mean losses, the full parameters and
    the experts each MoE layer's router chose here, per step."""
    from torch_backend import MixedPrecisionPolicy
    from torch_backend.models import MoEDecoder, moe_loss, parallelize

    c = MOE_CONFIGS[name]
    model = MoEDecoder(c)
    model.init_weights(SEED)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    parallelize(model, mesh, mp_policy=mp)
    routes: list[list[list[int]]] = []
    for layer in model.layers[c.n_dense_layers:]:
        layer.feed_forward.router.register_forward_hook(
            lambda _m, _args, out: routes[-1].append(sorted(set(out[1].flatten().tolist()))))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    n = ROWS // world
    losses = []
    for step in range(STEPS):
        routes.append([])
        rows = batch(step, c.vocab_size)[rank * n:(rank + 1) * n]
        loss = moe_loss(model(rows[:, :-1]), rows[:, 1:], c.aux_loss_coef)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().float()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses, full_params(model), routes


def case(name: str, mesh, rank: int, world: int, bf16: bool) -> dict:
    losses, params, routes = sharded(name, mesh, rank, world, bf16)
    out = {"routes": routes, "top_k": MOE_CONFIGS[name].top_k, "n_experts": MOE_CONFIGS[name].n_experts}
    if rank == 0:
        for label, dtype in [("fp32", torch.float32)] + ([("policy", torch.bfloat16)] if bf16 else []):
            want_losses, want_params = reference(name, world, dtype)
            out[label] = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
                          "params": rel_errors(params, want_params)}
        out["losses"] = losses
    return out


def checks(rank: int, world: int) -> dict:
    out = {}

    def run(label: str, fn: Callable[[], object]) -> None:
        try:
            out[label] = fn()
        except BaseException:
            out[label] = {"traceback": traceback.format_exc()}

    mesh = init_device_mesh("cpu", (world,))
    for name in MODELS:
        run(f"{name}/fp32", lambda name=name: case(name, mesh, rank, world, bf16=False))
        run(f"{name}/bf16", lambda name=name: case(name, mesh, rank, world, bf16=True))
    dist.barrier()
    return out
