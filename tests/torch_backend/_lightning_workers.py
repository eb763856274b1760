"""What test_lightning runs in each gloo worker: Lightning's ``ModelParallelStrategy`` with ``fully_shard``.

The user's parallelize function (Fabric's ``parallelize_fn``, the Trainer's ``configure_model``) shards a
small llama bottom-up with ``torch_backend.fully_shard``, or with PyTorch FSDP2's on the same case; a
single-process loop on the whole batches is the reference. Lightning runs inside the harness's gloo
processes: ``LOCAL_RANK`` in the environment tells it the processes exist already (it launches none) and
it keeps the process group it finds. Every case returns plain numbers (relative errors) that the test
bounds.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ragged.models import LlamaConfig
from tests.torch_backend._dist import run_cases, shared_dir
from tests.torch_backend._user_model_workers import full_params, rel_errors
from torch_backend.models import Llama, cross_entropy
from torch_backend.models.tensor_parallel import apply_tensor_parallel

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
B, T, STEPS, LR = 8, 8, 4, 1e-2  # 8 rows split evenly over 2 and 4 data-parallel ranks
SAVE_AT = 2  # the checkpoint cases save after this many steps and resume for the rest


def build(seed: int = 0) -> Llama:
    """The llama in float64 (tests/parity.py: the sharded runs and the reference then differ by float64
    roundings only; Lightning's default ``32-true`` precision leaves a module's dtype as it is)."""
    model = Llama(CONFIG)
    model.init_weights(seed)
    return model.double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s (B, T) inputs and next-token targets (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(epoch_steps: int = STEPS) -> dict:
    """Single-process AdamW on the whole batches, each step's loss and the parameters after each step.

    Step ``s`` trains on ``batch(s % epoch_steps)``: the Trainer's epochs repeat their batches.
    """
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, params = [], []
    for step in range(STEPS):
        x, y = batch(step % epoch_steps)
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append(full_params(model))
    return {"losses": losses, "params": params}


# ----- the user's parallelize function ------------------------------------------------------------
def parallelize_fn(which: str, layout: str) -> Callable[[nn.Module, DeviceMesh], nn.Module]:
    """What a Lightning user writes: (TP, then) ``fully_shard`` bottom-up on the strategy's mesh.

    ``layout``: ``fsdp`` (the ``data_parallel`` dim), ``hsdp`` (replicate 2 x shard, a mesh the function
    builds over the same ranks), ``tp`` (torchtitan's llama plan on ``tensor_parallel``, then FSDP on
    ``data_parallel``: a 2-D mesh).
    """
    if which == "ours":
        from torch_backend import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard

    def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if layout == "tp":
            apply_tensor_parallel(model, mesh["tensor_parallel"], loss_parallel=False)
        dp_mesh = mesh["data_parallel"]
        if layout == "hsdp":
            dp_mesh = init_device_mesh(mesh.device_type, (2, dp_mesh.size() // 2),
                                       mesh_dim_names=("replicate", "shard"))
        for unit in (model.tok_embeddings, *model.layers, [model.norm, model.output]):
            fully_shard(unit, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model

    return parallelize


def _sizes(layout: str, world: int) -> dict:
    tp = 2 if layout == "tp" else 1
    return {"data_parallel_size": world // tp, "tensor_parallel_size": tp}


def _dp_rows(mesh: DeviceMesh) -> slice:
    """This rank's rows of each batch: its share along ``data_parallel`` (TP ranks share rows)."""
    dp = mesh["data_parallel"]
    n = B // dp.size()
    return slice(dp.get_local_rank() * n, (dp.get_local_rank() + 1) * n)


def _remove(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)


# ----- Fabric ---------------------------------------------------------------------------------------
def fabric_run(which: str, layout: str, world: int, steps: range, *, seed: int = 0, load: str | None = None,
               save: str | None = None) -> tuple[list[float], dict]:
    """Train ``steps`` under Fabric, each as two micro-batches (gradient accumulation); optionally load a
    checkpoint first, and save one after step ``SAVE_AT``.

    Returns each step's loss (the mean over data-parallel ranks) and the full parameters at the end.
    """
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize_fn(which, layout), **_sizes(layout, world))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup(build(seed))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    if load is not None:
        state = {"model": model, "optimizer": opt, "step": 0}
        fabric.load(load, state)
        if state["step"] != steps.start:
            raise AssertionError(f"checkpoint holds step {state['step']}, expected {steps.start}")
    rows = _dp_rows(strategy.device_mesh)
    losses = []
    for step in steps:
        x, y = (t[rows] for t in batch(step))
        # two micro-batches, the first under no_backward_sync (each FSDPModule's
        # set_requires_gradient_sync(False, recurse=False)): the gradient of the rows' mean loss
        half = len(x) // 2
        loss = torch.zeros((), dtype=torch.float64)
        for part in (slice(0, half), slice(half, None)):
            with fabric.no_backward_sync(model, enabled=part.start == 0):
                micro = cross_entropy(model(x[part]), y[part]) / 2
                fabric.backward(micro)
            loss += micro.detach()
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss, reduce_op="mean").item())
        if save is not None and step + 1 == SAVE_AT:
            fabric.save(save, {"model": model, "optimizer": opt, "step": SAVE_AT})
    return losses, full_params(model.module)


def _errors(losses: list[float], params: dict, ref: dict, steps: range) -> dict:
    return {"loss": max(abs(a - ref["losses"][s]) / abs(ref["losses"][s]) for a, s in zip(losses, steps)),
            "params": rel_errors(params, ref["params"][steps.stop - 1])}


def fabric_trains_and_resumes(layout: str, world: int, ref: dict) -> dict:
    """Fabric: ours and FSDP2 against the reference and each other, each saving a checkpoint after
    ``SAVE_AT`` steps; then ours built from another seed loads each checkpoint and trains the rest,
    against ours trained without a break."""
    out, params, paths = {}, {}, {}
    for which in ("ours", "fsdp2"):
        paths[which] = shared_dir()
        losses, params[which] = fabric_run(which, layout, world, range(STEPS), save=paths[which])
        out[which] = _errors(losses, params[which], ref, range(STEPS))
    out["ours_vs_fsdp2"] = rel_errors(params["ours"], params["fsdp2"])
    for writer, path in paths.items():
        losses, resumed = fabric_run("ours", layout, world, range(SAVE_AT, STEPS), seed=1, load=path)
        _remove(path)
        out[f"resumed_from_{writer}"] = {**_errors(losses, resumed, ref, range(SAVE_AT, STEPS)),
                                         "vs_writer": rel_errors(resumed, params[writer])}
    return out


# ----- Trainer ---------------------------------------------------------------------------------------
def _lit_module(which: str, layout: str, seed: int, save: str | None):
    import lightning as L

    class LitLlama(L.LightningModule):
        """The user's LightningModule: the model built in ``__init__``, sharded in ``configure_model``."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build(seed)
            self.losses: list[torch.Tensor] = []

        def configure_model(self) -> None:
            parallelize_fn(which, layout)(self.model, self.device_mesh)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = cross_entropy(self.model(x), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

        def on_train_epoch_end(self) -> None:
            if save is not None and self.current_epoch == 0:  # where ModelCheckpoint would save
                self.trainer.save_checkpoint(save)

    return LitLlama()


def _trainer_data(world: int, layout: str) -> torch.utils.data.DataLoader:
    """One epoch of ``SAVE_AT`` steps whose rows over the data-parallel ranks are each step's ``batch``.

    An unshuffled ``DistributedSampler`` gives data-parallel rank ``r`` the rows ``r, r + dp, ...`` in
    order, so the dataset interleaves each batch's per-rank slices. (Lightning's own sampler would shuffle
    a training set.) TP ranks ``rank // tp`` share a data-parallel rank, as on Lightning's mesh.
    """
    sizes = _sizes(layout, world)
    dp = sizes["data_parallel_size"]
    n = B // dp
    xs, ys = [], []
    for step in range(SAVE_AT):
        x, y = batch(step)
        order = [r * n + j for j in range(n) for r in range(dp)]  # row j of rank r's slice at index j*dp + r
        xs.append(x[order])
        ys.append(y[order])
    dataset = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=dp,
                                                  rank=dist.get_rank() // sizes["tensor_parallel_size"],
                                                  shuffle=False)
    return torch.utils.data.DataLoader(dataset, batch_size=n, sampler=sampler)


def trainer_run(which: str, layout: str, world: int, epochs: int, *, seed: int = 0,
                ckpt_path: str | None = None, save: str | None = None) -> tuple[list[float], dict]:
    """``Trainer.fit`` for ``epochs`` epochs (``SAVE_AT`` steps each, the same batches every epoch),
    optionally resuming from ``ckpt_path`` and saving with ``trainer.save_checkpoint(save)`` at the end
    of the first epoch."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    module = _lit_module(which, layout, seed, save)
    strategy = ModelParallelStrategy(**_sizes(layout, world))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, _trainer_data(world, layout), ckpt_path=ckpt_path)
    losses = []
    for loss in module.losses:
        dist.all_reduce(loss)
        losses.append(loss.item() / world)  # TP ranks repeat their data-parallel rank's loss
    return losses, full_params(module.model)


def trainer_trains_and_resumes(layout: str, world: int, ref: dict) -> dict:
    """Trainer: ours and FSDP2 for 2 epochs, each saving a checkpoint after the first; ours from another
    seed resumed from each checkpoint against the run that wrote it. ``ref``: ``reference(SAVE_AT)``."""
    out, params, paths = {}, {}, {}
    for which in ("ours", "fsdp2"):
        paths[which] = shared_dir()
        ckpt = os.path.join(paths[which], "epoch1.ckpt")  # a directory: DCP's files and Lightning's meta.pt
        losses, params[which] = trainer_run(which, layout, world, 2, save=ckpt)
        out[which] = _errors(losses, params[which], ref, range(STEPS))
    out["ours_vs_fsdp2"] = rel_errors(params["ours"], params["fsdp2"])
    for writer, path in paths.items():
        losses, resumed = trainer_run("ours", layout, world, 2, seed=1,
                                      ckpt_path=os.path.join(path, "epoch1.ckpt"))
        _remove(path)
        out[f"resumed_from_{writer}"] = {**_errors(losses, resumed, ref, range(SAVE_AT, STEPS)),
                                         "vs_writer": rel_errors(resumed, params[writer])}
    return out


def checks(rank: int, world: int, layouts: tuple[str, ...]) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    ref, ref_epochs = reference(), reference(epoch_steps=SAVE_AT)  # Fabric's data, the Trainer's
    cases: dict[str, Callable[[], object]] = {}
    for layout in layouts:
        cases[f"fabric_{layout}"] = functools.partial(fabric_trains_and_resumes, layout, world, ref)
        cases[f"trainer_{layout}"] = functools.partial(trainer_trains_and_resumes, layout, world, ref_epochs)
    return run_cases(cases)
