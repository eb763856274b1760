"""What the fully_shard tests run: a single-process reference and the checks each gloo worker runs.

``reference()`` trains llama-tiny in one process (plain modules, ``torch.optim.AdamW``,
``torch.nn.utils.clip_grad_norm_``). The workers train the same model, data and seed under
``fully_shard`` and send back, from rank 0, the global losses and the final full parameters
(``DTensor.full_tensor()``, the placement's own gather, not the runtime's). Each check builds a fresh
model, so one launch per world size runs several of them (``tests/torch_backend/_dist.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ragged.models import LLAMA_TINY
from tests.torch_backend._dist import run_cases

B, T, STEPS, SAVE_AT = 12, 16, 10, 5  # 12 rows split evenly over 1, 2, 3 and 4 ranks
# The parity checks' dtype (masters, compute, gloo's reductions): far from rounding (tests/parity.py). The
# bf16 policy keeps fp32 masters and the debug counter counts fp32 bytes (the simulator's).
FULL = torch.float64
LR, WEIGHT_DECAY, MAX_NORM, SEED = 1e-3, 0.1, 1.0, 0


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def reference(steps: int = STEPS) -> dict:
    """Single-process training in ``FULL``: losses of every step and the parameters at the end."""
    from torch_backend.models import Llama, cross_entropy

    model = Llama()
    model.init_weights(SEED)
    model.to(FULL)
    opt = optimizer(model)
    out = {"losses": []}
    for step in range(steps):
        x, y = batch(step)
        loss = cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {n: p.detach().clone().numpy() for n, p in model.named_parameters()}
    return out


# ----- helpers run inside the workers ---------------------------------------------------------------
def _sharded_model(mesh, seed: int = SEED, dtype: torch.dtype = FULL, **kwargs) -> torch.nn.Module:
    from torch_backend.models import Llama, parallelize

    model = Llama()
    model.init_weights(seed)
    return parallelize(model.to(dtype), mesh, **kwargs)


def _fsdp2_model(mesh) -> torch.nn.Module:
    """The baseline: FSDP2's ``fully_shard`` over the same units as ``parallelize``."""
    from torch.distributed.fsdp import fully_shard

    from torch_backend.models import Llama

    model = Llama()
    model.init_weights(SEED)
    model.to(FULL)
    for unit in (model.tok_embeddings, *model.layers, [model.norm, model.output], model):
        fully_shard(unit, mesh=mesh)
    return model


def _train(model, opt, steps: range, dp_rank: int, dp_size: int, micro: int = 1,
           on_step: Callable[[int], None] | None = None) -> list[float]:
    """Train on this data-parallel rank's rows; returns the global mean loss of each step."""
    from torch_backend import FSDPModule, clip_grad_norm_
    from torch_backend.models import cross_entropy

    if not isinstance(model, FSDPModule):  # FSDP2's model: torch's clipping over its DTensor gradients
        def clip_grad_norm_(m, max_norm):
            return torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)

    losses = []
    rows = B // dp_size
    for step in steps:
        x, y = batch(step)
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        total = torch.zeros((), dtype=torch.float64)
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            model.set_requires_gradient_sync(i == micro - 1)  # reduce once, after the last micro-batch
            loss = cross_entropy(model(xm), ym) / micro
            loss.backward()
            total += loss.detach()
        clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        if on_step is not None:
            on_step(step)
    return losses


def _full_params(model) -> dict[str, np.ndarray]:
    return {n: p.full_tensor().detach().clone().numpy() for n, p in model.named_parameters()}


# ----- the checks of one launch ---------------------------------------------------------------------
def parity_checks(rank: int, world: int, ckpt_dir: str) -> dict:
    """``FULL`` parity at every world size, plus the extra checks a world size hosts."""
    mesh = init_device_mesh("cpu", (world,))

    def full() -> dict:
        model = _sharded_model(mesh)
        opt = optimizer(model)
        save, out = None, {}
        if world == 4:  # the checkpoint that the 2-rank launch resumes from
            from torch_backend import save_dcp_checkpoint

            def save(step: int) -> None:
                if step + 1 == SAVE_AT:
                    save_dcp_checkpoint(Path(ckpt_dir) / "step5", model, opt)
                    out["params_at_save"] = _full_params(model)
        losses = _train(model, opt, range(STEPS), rank, world, on_step=save)
        return {"losses": losses, "params": _full_params(model), **out}

    def fsdp2() -> dict:
        model = _fsdp2_model(mesh)
        _train(model, optimizer(model), range(STEPS), rank, world)
        return {"params": _full_params(model)}

    checks = {"full": full, "full fsdp2": fsdp2}
    if world == 4:
        checks |= {"counter": lambda: _counter(mesh), "bf16": lambda: _bf16(mesh),
                   "hsdp": lambda: _hsdp(rank), "hsdp fsdp2": lambda: _hsdp(rank, fsdp2=True)}
    if world == 2:
        checks |= {"accumulate": lambda: _accumulate(mesh, rank),
                   "accumulate fsdp2": lambda: _accumulate(mesh, rank, fsdp2=True),
                   "resume": lambda: _resume(mesh, rank, ckpt_dir), "errors": lambda: _errors(mesh, rank)}
    if world == 3:
        checks |= {"meta_init": lambda: _meta_init(mesh), "layouts": lambda: _layouts(mesh)}
    return run_cases(checks)


def _counter(mesh) -> dict:
    """Per-unit collectives and copy bytes of one steady-state step, for both reshard settings."""
    from torch_backend import debug_counter
    from torch_backend.fsdp import units

    out = {}
    for reshard in (False, True):
        model = _sharded_model(mesh, dtype=torch.float32, reshard_after_forward=reshard)
        opt = optimizer(model)
        _train(model, opt, range(2), mesh.get_rank(), mesh.size())  # warm-up: optimizer state exists
        with debug_counter() as c:
            _train(model, opt, range(2, 3), mesh.get_rank(), mesh.size())
        out[f"reshard={reshard}"] = {
            "all_gather": c.per_label("all_gather"), "reduce_scatter": c.per_label("reduce_scatter"),
            "all_reduce": c.per_label("all_reduce"), "copy_bytes": c.copy_bytes, "cast_bytes": c.cast_bytes,
            "bytes": dict(c.bytes), "units": [u.name for u in units(model)], "issued": c.issued,
            "host_syncs": dict(c.host_syncs),
            "padded_numel": {u.name: u.layout.total_numel for u in units(model)},
        }
    return out


def policy_reference(micro: int, order: int | None = None) -> dict:
    """Single-process training under the bf16 policy's casts: fp32 masters, each step's rows in ``micro``
    micro-batches (the run's ranks), each one's forward and backward on a bf16 cast of the master, the
    gradients summed in fp32, clipped, AdamW (``_policy_reference.train``); ``order``: the rows permuted."""
    from tests.torch_backend import _policy_reference
    from torch_backend.models import Llama, cross_entropy

    model = Llama()
    model.init_weights(SEED)
    clip = lambda m: float(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))  # noqa: E731
    out = _policy_reference.train(model, batch, lambda call, rows: cross_entropy(call(rows[0]), rows[1]),
                                  STEPS, micro, optimizer(model), torch.bfloat16, order, clip)
    return {"losses": out["losses"], "params": {n: p.numpy() for n, p in out["params"].items()}}


def _bf16(mesh) -> dict:
    from tests.parity import SPREAD_ORDERS
    from tests.torch_backend._dist import shared
    from torch_backend import MixedPrecisionPolicy

    refs = shared({order: lambda order=order: policy_reference(mesh.size(), order)
                   for order in (None, *range(SPREAD_ORDERS))})  # one each on 4 ranks
    model = _sharded_model(mesh, dtype=torch.float32,
                           mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    opt = optimizer(model)
    losses = _train(model, opt, range(STEPS), mesh.get_rank(), mesh.size())
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"losses": losses, "params": _full_params(model), "master_dtypes": dtypes,
            "policy": refs[None], "orders": [refs[k] for k in range(SPREAD_ORDERS)]}


def _hsdp(rank: int, fsdp2: bool = False) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _fsdp2_model(mesh) if fsdp2 else _sharded_model(mesh)
    opt = optimizer(model)
    losses = _train(model, opt, range(STEPS), rank, 4)
    return {"losses": losses, "params": _full_params(model),
            "placements": str(next(iter(model.parameters())).placements)}


def _accumulate(mesh, rank: int, fsdp2: bool = False) -> dict:
    model = _fsdp2_model(mesh) if fsdp2 else _sharded_model(mesh)
    opt = optimizer(model)
    losses = _train(model, opt, range(STEPS), rank, mesh.size(), micro=2)
    return {"losses": losses, "params": _full_params(model)}


def _resume(mesh, rank: int, ckpt_dir: str) -> dict:
    """Load the 4-rank checkpoint of step 5 into a differently initialised 2-rank model, train on."""
    from torch_backend import load_dcp_checkpoint

    model = _sharded_model(mesh, seed=123)
    opt = optimizer(model)
    load_dcp_checkpoint(Path(ckpt_dir) / "step5", model, opt)
    loaded = _full_params(model)
    losses = _train(model, opt, range(SAVE_AT, STEPS), rank, mesh.size())
    return {"loaded": loaded, "losses": losses, "params": _full_params(model)}


def _errors(mesh, rank: int) -> dict:
    """Bad input raises the same clear error on every rank, before any collective (no hang after)."""
    from torch_backend import fully_shard
    from torch_backend.models import Llama

    messages = {}

    def expect(name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as e:  # the test checks the type and the message
            messages[name] = f"{type(e).__name__}: {e}"
        else:
            messages[name] = "no error"

    model = Llama()
    expect("granularity", lambda: fully_shard(model.layers[0], mesh=mesh, granularity="rows:7"))
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).double())
    expect("dtypes", lambda: fully_shard(mixed, mesh=mesh))
    ints = torch.nn.Module()
    ints.weight = torch.nn.Parameter(torch.ones(4, dtype=torch.int64), requires_grad=False)
    expect("int", lambda: fully_shard(ints, mesh=mesh))
    fully_shard(model.layers[1], mesh=mesh)
    expect("twice", lambda: fully_shard(model.layers[1], mesh=mesh))
    expect("mesh3d", lambda: fully_shard(model.layers[2], mesh=init_device_mesh("cpu", (2, 1, 1))))
    dist.barrier()  # every rank got here: nobody is stuck in a collective
    return messages


def _meta_init(mesh) -> dict:
    """Built on meta, sharded, then initialised through ``unsharded``: bit-equal to a CPU init."""
    from torch_backend import unsharded
    from torch_backend.models import Llama, parallelize

    with torch.device("meta"):
        model = Llama()
    parallelize(model, mesh)
    with unsharded(model):
        model.init_weights(SEED)
    plain = Llama()
    plain.init_weights(SEED)
    expected = dict(plain.named_parameters())
    return {n: bool(torch.equal(p.full_tensor(), expected[n])) for n, p in model.named_parameters()}


def _layouts(mesh) -> dict:
    """Each unit's runtime Layout equals the pure ``plan_module`` of its modules under the model."""
    from torch_backend import plan_module
    from torch_backend.fsdp import units
    from torch_backend.models import Llama

    model = _sharded_model(mesh, dtype=torch.float32)
    plain = Llama()
    groups = {"tok_embeddings": [plain.tok_embeddings], "output": [plain.norm, plain.output],
              **{f"layers.{i}": [b] for i, b in enumerate(plain.layers)}}
    return {u.name: u.layout == plan_module(groups[u.name], mesh.size(), root=plain)
            for u in units(model)}


# ----- faults ---------------------------------------------------------------------------------------
def sleep_checks(rank: int, world: int, seconds: float) -> dict:
    """The last rank sleeps (a hang outside any collective, which no process group timeout ends)."""
    if rank == world - 1:
        time.sleep(seconds)
    return {"slept": rank == world - 1}


def fault_checks(rank: int, world: int, ckpt_dir: str, how: str) -> dict:
    """Rank ``world - 1`` dies (``kill``: ``os._exit``; ``raise``: an exception), stops answering
    (``hang``) in the middle of a step, or dies while writing a checkpoint (``kill_saving``); the
    others report what they saw.
    """
    from torch_backend import save_dcp_checkpoint

    mesh = init_device_mesh("cpu", (world,))
    model = _sharded_model(mesh)
    opt = optimizer(model)
    _train(model, opt, range(1), rank, world)
    save_dcp_checkpoint(Path(ckpt_dir) / "complete", model, opt)
    victim = rank == world - 1

    if how == "kill_saving":
        if victim:
            import torch.distributed.checkpoint as dcp

            def die(*args, **kwargs):
                os._exit(1)  # killed while its files are being written

            dcp.FileSystemWriter.write_data = die
        target = "saving"
        step = lambda: save_dcp_checkpoint(Path(ckpt_dir) / "torn", model, opt)  # noqa: E731
    else:
        if victim:
            def fail(*_):
                if how == "kill":
                    os._exit(1)
                if how == "hang":
                    time.sleep(3600)  # alive, connected, silent: only the timeout can end the others' wait
                raise RuntimeError("injected failure on the last rank")

            model.layers[2].register_forward_pre_hook(fail)
        target = "training"
        step = lambda: _train(model, opt, range(1, 2), rank, world)  # noqa: E731

    t0 = time.perf_counter()
    try:
        step()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0, "during": target}
    return {"error": None, "seconds": time.perf_counter() - t0, "during": target}
