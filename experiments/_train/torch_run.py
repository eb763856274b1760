"""The torch stack of ``experiments.train``: torchrun processes, meta-device model, ``fully_shard``, DCP.

Launched by ``torchrun`` (or as one plain process): NCCL with one GPU per process (``LOCAL_RANK``) when CUDA
is there, gloo on CPU otherwise; a caller that initialised a process group itself (a notebook, its own
launcher: the tests fork their ranks from a preloaded server) trains in that group, and keeps it. The model
(a ``Llama`` or an ``MoEDecoder``) is built on the meta device and sharded; its values are then written one
FSDP unit at a time (``unsharded(unit)`` + ``init_weights(only=...)``), so a rank holds its shards plus at
most one unit in full, and the values equal a single-process init with the same seed.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

import ragged
import ragged.models
import ragged.quant
from experiments._train import checkpoints
from experiments._train.data import TokenSource
from experiments._train.metrics import Monitor, peak_tflops


def init_distributed(device: str) -> tuple[int, int, torch.device, bool]:
    """Join the process group torchrun describes (or a 1-process group), or keep the one the caller already
    initialised; returns rank, world, device, and whether the group is this run's own (to destroy at its
    end: a caller's group outlives the run)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dev, False
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(minutes=10)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=dev if use_cuda else None)
    else:  # one plain process: a private file store, no port to pick
        store = dist.FileStore(tempfile.mktemp(prefix="ragged-train-"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), dev, True


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def device_capacity(dev: torch.device) -> int:
    """Bytes one rank may use: the GPU's memory, or the host's available memory over its local ranks."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[1]
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def build(args, config: ragged.models.LlamaConfig | ragged.models.MoeConfig, mesh: DeviceMesh,
          dev: torch.device, tp_mesh: DeviceMesh | None = None):
    """Meta-device model -> tensor parallelism on ``tp_mesh`` -> activation checkpointing -> ``parallelize``
    on the data-parallel ``mesh`` -> values one unit at a time (torchtitan's order).

    With ``--ep N``: ``expert_parallel`` on an ``(ep, fsdp) = (N, world / N)`` mesh (under HSDP
    ``(replicate, ep, fsdp) = (R, N, world / (R N))``) keeps this rank's experts of the meta-device model
    before ``parallelize``; each gets the value it has in one process (``MoEDecoder.one_process_places``)."""
    from torch_backend import MixedPrecisionPolicy, unsharded
    from torch_backend.models import Llama, MoEDecoder, apply_tensor_parallel, parallelize
    from torch_backend.models.expert_parallel import expert_parallel

    with torch.device("meta"):
        model = MoEDecoder(config) if isinstance(config, ragged.models.MoeConfig) else Llama(config)
    if tp_mesh is not None:  # the logits stay split by vocabulary: the step runs under loss_parallel()
        apply_tensor_parallel(model, tp_mesh, loss_parallel=True)
    if args.activation_checkpointing:
        for block in model.layers:  # before fully_shard: the recompute runs inside the unit's backward
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    bf16 = args.dtype == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    granularity = (lambda name, shape: ragged.quant.tile_granularity(shape)) if args.granularity == "auto" \
        and args.optimizer == "adam8bit" else (None if args.granularity == "auto" else args.granularity)
    if args.ep > 1:
        dims = {"replicate": mesh.size(0)} if mesh.ndim == 2 else {}  # HSDP: the replicas of the dp mesh
        dims.update(ep=args.ep, fsdp=mesh.size(mesh.ndim - 1) // args.ep)
        ep_mesh = init_device_mesh(dev.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        expert_parallel(model, ep_mesh, mp_policy=mp, granularity=granularity)
    parallelize(model, mesh, mp_policy=mp, granularity=granularity)
    for unit in [model.tok_embeddings, *model.layers, model.norm]:  # norm: the [norm, output] unit
        names = {f"{prefix}.{n}" for prefix, m in _unit_modules(model, unit) for n, _ in m.named_parameters()}
        with unsharded(unit):
            model.init_weights(args.seed, only=names)
    return model


def _unit_modules(model, unit) -> list:
    if unit is model.norm:
        return [("norm", model.norm), ("output", model.output)]
    return [(name, m) for name, m in model.named_modules() if m is unit]


def optimizer(args, model) -> torch.optim.Optimizer:
    from torch_backend.optim import Adam8bit, Muon

    if args.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.optimizer == "adam8bit":
        return Adam8bit(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return Muon(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay)


def _rank_state(path: Path) -> Path:
    return path.with_name(path.name + ".optim") / f"rank_{dist.get_rank()}.pt"


def save(path: Path, model, opt: torch.optim.Optimizer, optimizer_name: str) -> None:
    """The model (and AdamW's state) through DCP, reshardable; 8-bit Adam's and Muon's state, which are
    local tensors per rank (not shaped like the parameters), as each rank's ``state_dict`` beside it,
    written first: ``step_<N>`` appears last, complete."""
    from torch_backend import save_dcp_checkpoint

    if optimizer_name == "adamw":
        save_dcp_checkpoint(path, model, opt)
        return
    _rank_state(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(opt.state_dict(), _rank_state(path))
    save_dcp_checkpoint(path, model)


def load(path: Path, model, opt: torch.optim.Optimizer, optimizer_name: str) -> None:
    from torch_backend import load_dcp_checkpoint

    if optimizer_name == "adamw":
        load_dcp_checkpoint(path, model, opt)
        return
    load_dcp_checkpoint(path, model)
    if not _rank_state(path).exists():
        raise SystemExit(f"{path}: no {optimizer_name} state for rank {dist.get_rank()} (its state is per "
                         "rank: resume at the world size it was saved with)")
    opt.load_state_dict(torch.load(_rank_state(path), weights_only=True))


def peak_memory(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def loss_function(config: ragged.models.LlamaConfig | ragged.models.MoeConfig):
    """``(model output, targets) -> loss``: cross entropy, plus the load-balancing loss for an MoE."""
    from torch_backend.models import cross_entropy, moe_loss

    if isinstance(config, ragged.models.MoeConfig):
        return functools.partial(moe_loss, aux_loss_coef=config.aux_loss_coef)
    return cross_entropy


def run(args, config: ragged.models.LlamaConfig | ragged.models.MoeConfig, plan_check, settings: dict
        ) -> dict:
    """Train; ``plan_check(world, capacity)`` refuses a run that does not fit, before anything is built."""
    from torch_backend import debug_counter

    rank, world, dev, own_group = init_distributed(args.device)
    try:
        capacity = torch.tensor([device_capacity(dev)], dtype=torch.int64, device=dev)
        dist.all_reduce(capacity, dist.ReduceOp.MIN)  # one number on every rank: all refuse, or none
        plan_check(world, int(capacity.item()), rank == 0)
        replicas, tp = args.replicas, args.tp
        dims = {"replicate": replicas, "shard": world // replicas // tp, "tp": tp}
        dims = {name: size for name, size in dims.items() if size > 1 or name == "shard"}
        mesh = init_device_mesh(dev.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        dp_names = tuple(name for name in dims if name != "tp")
        dp_mesh = mesh if tp == 1 else mesh[dp_names]
        ckpt_root = Path(args.checkpoint_dir) if args.checkpoint_dir else None
        if ckpt_root is not None:
            if rank == 0:
                checkpoints.check_settings(ckpt_root, settings, write=True)
            dist.barrier()
            checkpoints.check_settings(ckpt_root, settings, write=False)
        model = build(args, config, dp_mesh, dev, mesh["tp"] if tp > 1 else None)
        loss_fn = loss_function(config)
        # under TP the loss and its backward run on the logits' vocabulary parts (torchtitan's train context)
        loss_context = loss_parallel if tp > 1 else contextlib.nullcontext
        opt = optimizer(args, model)
        first = 0
        if (found := checkpoints.latest(ckpt_root)) is not None:
            first, path = found
            load(path, model, opt, args.optimizer)
        data = TokenSource(config.vocab_size, args.seq_len, args.batch, args.seed, args.data, args.data_dtype)
        rows = args.batch // (world // tp)
        dp_rank = rank // tp  # the mesh is row-major with tp last: a dp group's TP ranks read the same rows
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        monitor = Monitor(rank0=rank == 0, steps=args.steps, first_step=first,
                          tokens_per_step=args.batch * args.seq_len,
                          flops_per_token=ragged.models.flops_per_token(config, args.seq_len), devices=world,
                          peak=peak_tflops(name, args.peak_tflops), log_path=args.log, show_bar=args.progress)
        with monitor:
            for step in range(first, args.steps):
                first_row = dp_rank * rows
                tokens = torch.from_numpy(data.rows(step, first_row, first_row + rows)).long().to(dev)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                with debug_counter() as counter:
                    with loss_context():
                        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
                        loss.backward()
                    opt.step()
                    opt.zero_grad()
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss)
                loss_value = global_loss.item() / world  # waits for the step's work, on every device
                step_s = time.perf_counter() - t0
                monitor.step(step, loss_value, step_s, counter.wait_seconds, peak_memory(dev),
                             sum(counter.bytes.values()))
                if args.fail_after_step is not None and step == args.fail_after_step:
                    os._exit(17)  # tests: die like a killed job, without saving or cleaning up
                done = step + 1
                if ckpt_root is not None and (done % args.save_interval == 0 or done == args.steps):
                    save(checkpoints.step_dir(ckpt_root, done), model, opt, args.optimizer)
        summary = monitor.print_summary(f"torch, {world} {dev.type} process(es)")
        dist.barrier()  # no rank closes its connections while a peer is still in a collective
        return summary
    finally:
        if own_group:
            dist.destroy_process_group()
