"""The torch side of test_checkpoint's cross-stack training: 4 gloo ranks (``tests.torch_backend._dist``).

Every case reads a neutral checkpoint that JAX wrote before the launch and writes one JAX reads after it:

- ``tp``: the llama under tensor parallelism + FSDP on ``(dp 2, tp 2)`` (``apply_tensor_parallel``, then
  ``parallelize``) loads JAX's ``(fsdp 4, tensor 2)`` checkpoint (every parameter compared with the saved
  bits), trains ``PRE_STEPS`` steps, saves; a fresh model loads that save and trains ``STEPS`` more
  steps with a fresh AdamW, the run JAX repeats from the same file.
- ``moe/<preset>``: the MoE decoder from one initial checkpoint, ``STEPS`` AdamW steps under FSDP over 4
  ranks and under expert parallelism ``(ep 2, fsdp 2)``; the EP model first loads JAX's EP save (each rank
  compares the experts it holds) and saves its own at the end. A forward hook counts every step's tokens
  per expert over all ranks: the cross-stack loss equality holds only when no expert is idle (docs/moe.md).

Data and recipe are the demo's (``experiments.demo``): the same global batch per step on both stacks, each
data-parallel rank its consecutive rows, AdamW with its learning rate and weight decay.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from experiments.demo import LR, WEIGHT_DECAY, batch
from ragged.models import MOE_CONFIGS
from tests.torch_backend._dist import run_cases

PRE_STEPS, STEPS = 2, 4  # steps before a save; steps both stacks train from one checkpoint
MOE_PRESETS = ("mixtral-tiny", "gpt-oss-tiny")  # per-expert modules and fused experts


def train(model: nn.Module, loss_fn: Callable, steps: range, dp_rank: int, dp_size: int,
          count: Callable[[], object] = lambda: None) -> list[float]:
    """AdamW on this data-parallel rank's rows of each step's batch; the mean loss over all rows."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in steps:
        x, y = (torch.from_numpy(a) for a in batch(step))
        rows = slice(dp_rank * len(x) // dp_size, (dp_rank + 1) * len(x) // dp_size)
        count()
        with loss_parallel():  # the TP llama's logits stay split by vocabulary; plain tensors: no effect
            loss = loss_fn(model(x[rows]), y[rows])
            loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the ranks of one dp rank (TP) hold the same loss: divide by the world
        losses.append(float(total) / dist.get_world_size())
    return losses


def worst_difference(model: nn.Module, saved: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between this rank's parameters (whole over their FSDP and TP dims)
    and the checkpoint's tensors, each expert compared with its one-process tensor (or rows of it)."""
    worst = 0.0
    for name, p in model.named_parameters():
        how = getattr(p, "checkpoint_as", None)
        want = saved[name] if how is None else how.local_part(saved[how.fqn(name)])
        got = p.full_tensor() if isinstance(p, DTensor) else p
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.shape, want.shape)
        worst = max(worst, float((got.detach() - want).abs().max()))
    return worst


# ----- tensor parallelism ---------------------------------------------------------------------------
def tp_llama(mesh: DeviceMesh) -> nn.Module:
    from torch_backend.models import Llama, apply_tensor_parallel, parallelize

    return parallelize(apply_tensor_parallel(Llama(), mesh["tp"]), mesh["dp"])


def tp(workdir: Path) -> dict:
    from torch_backend import load_neutral_checkpoint, save_neutral_checkpoint
    from torch_backend.models import cross_entropy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = (mesh.get_local_rank("dp"), 2)
    model = tp_llama(mesh)
    loaded = worst_difference(model, load_neutral_checkpoint(workdir / "jax_tp", model))
    train(model, cross_entropy, range(PRE_STEPS), *dp)
    save_neutral_checkpoint(workdir / "torch_tp", model)
    dist.barrier()  # rank 0 wrote it
    fresh = tp_llama(mesh)
    reloaded = worst_difference(fresh, load_neutral_checkpoint(workdir / "torch_tp", fresh))
    losses = train(fresh, cross_entropy, range(PRE_STEPS, PRE_STEPS + STEPS), *dp)
    return {"loaded": loaded, "reloaded": reloaded, "losses": losses}


# ----- mixture of experts ---------------------------------------------------------------------------
def moe(preset: str, workdir: Path) -> dict:
    """FSDP over 4 ranks and EP (2, 2) from ``<preset>_init``: losses and the fewest tokens any expert got
    in any MoE layer, per step; the EP model loads ``<preset>_jax_ep`` first and saves ``_torch_ep``."""
    from torch_backend import load_neutral_checkpoint, save_neutral_checkpoint
    from torch_backend.models import MoEDecoder, moe_loss, parallelize
    from torch_backend.models.expert_parallel import expert_parallel

    c = MOE_CONFIGS[preset]
    world = dist.get_world_size()
    ep_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "fsdp"))
    out = {}
    for kind in ("fsdp", "ep"):
        model = MoEDecoder(c)
        model.init_weights(1)  # every rank alike (expert_parallel keeps slices); the checkpoint replaces it
        if kind == "ep":
            expert_parallel(model, ep_mesh)
        parallelize(model, init_device_mesh("cpu", (world,)))
        if kind == "ep":
            jax_ep = load_neutral_checkpoint(workdir / f"{preset}_jax_ep", model)
            out["loaded"] = worst_difference(model, jax_ep)
        load_neutral_checkpoint(workdir / f"{preset}_init", model)
        fewest = _count_tokens(model, c)
        losses = train(model, lambda output, y: moe_loss(output, y, c.aux_loss_coef), range(STEPS),
                       dist.get_rank(), world, count=fewest.append_step)
        out[kind] = {"losses": losses, "fewest_tokens": fewest.per_step()}
        if kind == "ep":  # every EP rank's experts saved: each rank reads its own back
            save_neutral_checkpoint(workdir / f"{preset}_torch_ep", model)
            dist.barrier()  # rank 0 wrote it
            out["saved"] = worst_difference(model, load_neutral_checkpoint(workdir / f"{preset}_torch_ep"))
    return out


class _TokenCounts:
    """Tokens per expert, summed over the ranks' batches, of every MoE layer in every step."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def append_step(self) -> None:
        self.steps.append([])

    def per_step(self) -> list[int]:
        """The fewest tokens any expert of any MoE layer received in each step (0: an idle expert)."""
        out = []
        for layers in self.steps:
            counts = torch.stack(layers)  # (MoE layers, E)
            dist.all_reduce(counts)
            out.append(int(counts.min()))
        return out


def _count_tokens(model: nn.Module, c) -> _TokenCounts:
    counts = _TokenCounts()
    for layer in model.layers[c.n_dense_layers:]:
        layer.feed_forward.router.register_forward_hook(  # out: (weights, chosen experts (N, k), probs)
            lambda _m, _args, out: counts.steps[-1].append(torch.bincount(out[1].flatten(),
                                                                          minlength=c.n_experts)))
    return counts


def checks(rank: int, world: int, workdir: str) -> dict:
    torch.manual_seed(0)
    cases = {"tp": lambda: tp(Path(workdir))}
    for preset in MOE_PRESETS:
        cases[f"moe/{preset}"] = lambda preset=preset: moe(preset, Path(workdir))
    return run_cases(cases)
