"""The JAX stack of ``experiments.train``: one process per host, a ``Mesh`` over every device, sharded init.

Processes join with ``jax.distributed.initialize()`` (cluster auto-detection: SLURM, Open MPI, TPU pods,
``JAX_COORDINATOR_ADDRESS``; or explicit ``--coordinator/--num-processes/--process-id``). The model is built
abstractly (``nnx.eval_shape``, nothing allocated) and sharded by the llama's ``parallelize``; each unit
buffer is then initialised by ``FSDP.init_params``, one jitted program per unit whose output is sharded over
the mesh: the values equal ``Llama(config, rngs=nnx.Rngs(seed))`` at every device count. An MoE preset
trains as the MoE decoder under ``parallelize_moe`` on a ``(replica?, ep, fsdp)`` mesh (``--ep``): it is
built in full on each process and sharded (``ExpertParallel.shard_params``), so CPU-sized presets only.
A checkpoint is each process's addressable shards of the buffers and the optimizer state
(``process_<i>.npz``), so a resume needs the same mesh, and restores every bit; with ``--checkpoint-format
orbax`` it is an Orbax ``CheckpointManager`` step (async) of ``fsdp.checkpoint_tree`` in ``<dir>/orbax``,
per-parameter arrays that restore onto any mesh (docs/orbax.md).
"""

from __future__ import annotations

import functools
import os
import resource
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ragged
import ragged.models
import ragged.quant
from experiments._train import checkpoints
from experiments._train.data import TokenSource
from experiments._train.metrics import Monitor, peak_tflops

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES")


def init_distributed(args) -> None:
    """Join the other processes: explicit flags first, then cluster auto-detection; else run alone."""
    if args.coordinator or args.num_processes:
        if not (args.coordinator and args.num_processes and args.process_id is not None):
            raise SystemExit("--coordinator, --num-processes and --process-id go together")
        try:  # CPU collectives across processes (newer JAX may default to gloo and drop the option)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, KeyError, ValueError):
            pass
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=120)
    elif any(k in os.environ for k in _CLUSTER_ENV):
        jax.distributed.initialize()


def device_capacity() -> int:
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return available // jax.local_device_count()


def build(args, name: str, config: ragged.models.LlamaConfig, mesh, replicas: int):
    """The llama's ``parallelize`` on an abstract model (``nnx.eval_shape``: shapes only, no allocation)."""
    from flax import nnx

    from jax_backend import MixedPrecisionPolicy
    from jax_backend.models import Llama, parallelize

    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(args.seed)))
    granularity = _granularity(args)
    bf16 = args.dtype == "bf16"
    mp_policy = MixedPrecisionPolicy(jnp.bfloat16, jnp.float32) if bf16 else MixedPrecisionPolicy()
    return parallelize(abstract, mesh, replica_axis="replica" if replicas > 1 else None,
                       granularity=granularity, mp_policy=mp_policy, remat=args.activation_checkpointing,
                       preset=name, tensor_axis="tensor" if args.tp > 1 else None)


def _granularity(args):
    """``--granularity``; auto: 32x32 tiles for adam8bit (``ragged.quant.tile_granularity``), else rows."""
    if args.granularity != "auto":
        return args.granularity
    return (lambda fqn, shape: ragged.quant.tile_granularity(shape)) if args.optimizer == "adam8bit" \
        else "rows:1"


def build_moe(args, config: ragged.models.MoeConfig, mesh, replicas: int):
    """The MoE decoder (built in full) under ``parallelize_moe``: the runtime and the sharded parameters."""
    from flax import nnx

    from jax_backend import MixedPrecisionPolicy
    from jax_backend.models import model_params
    from jax_backend.models.expert_parallel import parallelize_moe
    from jax_backend.models.moe import MoEDecoder

    model = MoEDecoder(config, rngs=nnx.Rngs(args.seed))
    bf16 = args.dtype == "bf16"
    mp_policy = MixedPrecisionPolicy(jnp.bfloat16, jnp.float32) if bf16 else MixedPrecisionPolicy()
    runtime = parallelize_moe(model, mesh, replica_axis="replica" if replicas > 1 else None,
                              granularity=_granularity(args), mp_policy=mp_policy)
    return runtime, runtime.shard_params(model_params(model))


def optimizer(args, fsdp):
    import optax

    from jax_backend import on_shards
    from jax_backend.optim import adamw8bit, muon, muon_plan, shard_tiles

    if args.optimizer == "adamw":
        return optax.adamw(args.lr, weight_decay=args.weight_decay)
    if args.optimizer == "adam8bit":
        tiles = shard_tiles(fsdp.layouts, fsdp.axis)
        return on_shards(adamw8bit(args.lr, weight_decay=args.weight_decay, tiles=tiles))
    # both are layout-aware (tiles, Newton-Schulz roots), so they run on the unit shards as they are (under
    # expert parallelism on the composed layouts over (ep, fsdp))
    return on_shards(muon(args.lr, weight_decay=args.weight_decay, plan=muon_plan(fsdp.layouts, fsdp.axis)))


# ----- checkpoints: each process's addressable shards ----------------------------------------------------
class OrbaxCheckpoints:
    """``--checkpoint-format orbax``: an async ``CheckpointManager`` of ``fsdp.checkpoint_tree`` (params,
    the optimizer state as optax has it on the full params, the model state), restorable on any mesh."""

    def __init__(self, root: Path, fsdp, opt):
        import orbax.checkpoint as ocp

        self.ocp, self.fsdp, self.opt = ocp, fsdp, opt
        self.manager = ocp.CheckpointManager(root / "orbax", options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=True))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def load(self, step: int) -> tuple:
        target = self.fsdp.abstract_checkpoint_tree(self.opt)
        tree = self.manager.restore(step, args=self.ocp.args.StandardRestore(target))
        return self.fsdp.from_checkpoint_tree(tree, self.opt)

    def save(self, step: int, buffers, state, model_state) -> None:
        tree = self.fsdp.checkpoint_tree(buffers, self.opt, state, model_state)
        self.manager.save(step, args=self.ocp.args.StandardSave(tree))  # written while training goes on

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def save(path: Path, state: tuple) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for i, leaf in enumerate(jax.tree.leaves(state)):
        for shard in leaf.addressable_shards:
            arrays[f"{i}_{shard.device.id}"] = np.asarray(shard.data)
    np.savez(partial / f"process_{jax.process_index()}.npz", **arrays)
    multihost_utils.sync_global_devices(f"saved {path}")
    if jax.process_index() == 0:
        os.rename(partial, path)
    multihost_utils.sync_global_devices(f"renamed {path}")


def load(path: Path, like: tuple) -> tuple:
    stored = np.load(path / f"process_{jax.process_index()}.npz")
    leaves, treedef = jax.tree.flatten(like)
    out = []
    for i, leaf in enumerate(leaves):
        shards = [jax.device_put(stored[f"{i}_{s.device.id}"], s.device) for s in leaf.addressable_shards]
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards))
    return jax.tree.unflatten(treedef, out)


def collective_bytes(fsdp) -> int:
    """Bytes one device's collectives move per step, counted as the torch debug counter does (the whole
    buffer an all-gather writes or a reduce-scatter reads): each unit gathered in the forward (and again
    in the backward with remat) in the compute dtype, reduce-scattered in the reduce dtype, and under HSDP
    its shard's gradient all-reduced over the replicas. The step is one XLA program, so this is read from
    the Layouts rather than measured."""
    total = 0
    for layout in fsdp.layouts:
        param = jnp.dtype(fsdp.mp_policy.param_dtype or jnp.float32).itemsize
        reduce = jnp.dtype(fsdp.mp_policy.reduce_dtype or fsdp.mp_policy.param_dtype or jnp.float32).itemsize
        gathered = fsdp.expert_layouts.get(layout.name, layout)  # EP: an experts unit gathers over fsdp only
        total += gathered.total_numel * (param * (2 if fsdp.remat else 1) + reduce)
        if fsdp.replica_axis is not None:
            total += layout.shard_size * reduce
    return total


def _peak_memory() -> int:
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats.get("peak_bytes_in_use", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def run(args, name: str, config: ragged.models.LlamaConfig | ragged.models.MoeConfig, plan_check,
        settings: dict) -> dict:
    from jax_backend import make_mesh
    from jax_backend.models import cross_entropy

    init_distributed(args)
    world, rank0 = jax.device_count(), jax.process_index() == 0
    capacity = device_capacity()
    if jax.process_count() > 1:  # one number on every process: all refuse, or none (MiB: JAX ints are 32-bit)
        capacity = int(np.min(multihost_utils.process_allgather(np.int32(capacity >> 20)))) << 20
    plan_check(world, capacity, rank0)
    replicas, tp, moe = args.replicas, args.tp, isinstance(config, ragged.models.MoeConfig)
    if moe:  # --tp is refused for MoE models, --ep checked against the replicas (experiments/train.py)
        shape = (replicas, args.ep, world // (replicas * args.ep))
        mesh = make_mesh(shape, ("replica", "ep", "fsdp")) if replicas > 1 else \
            make_mesh(shape[1:], ("ep", "fsdp"))
    else:
        if world % (replicas * tp):
            raise SystemExit(f"--hsdp {replicas} x --tp {tp} must divide the {world} devices")
        shape, names = (replicas, world // (replicas * tp), tp), ("replica", "fsdp", "tensor")
        keep = [i for i, size in enumerate(shape) if size > 1 or names[i] == "fsdp"]  # no axes of size 1
        mesh = make_mesh([shape[i] for i in keep], [names[i] for i in keep])
    ckpt_root = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt_root is not None:
        if rank0:
            checkpoints.check_settings(ckpt_root, settings, write=True)
        multihost_utils.sync_global_devices("settings")
        checkpoints.check_settings(ckpt_root, settings, write=False)
    if moe:
        from jax_backend.models.moe import moe_loss

        runtime, buffers = build_moe(args, config, mesh, replicas)
        fsdp, model_state = runtime.fsdp, runtime.init_model_state()  # model state: the drop counts
        loss_fn = functools.partial(moe_loss, aux_loss_coef=config.aux_loss_coef)
    else:
        from flax import nnx

        from jax_backend.models import Llama

        fsdp, model_state, loss_fn = build(args, name, config, mesh, replicas), None, cross_entropy
        buffers = fsdp.init_params(lambda: Llama(config, rngs=nnx.Rngs(args.seed)))  # one unit at a time
    opt = optimizer(args, fsdp)
    state = fsdp.init(opt, buffers)
    first = 0
    orbax = None if ckpt_root is None or args.checkpoint_format != "orbax" else OrbaxCheckpoints(
        ckpt_root, fsdp, opt)
    if orbax is not None and (step := orbax.latest()) is not None:
        first = step
        buffers, state, restored_state = orbax.load(step)
        model_state = model_state if restored_state is None else restored_state
    elif orbax is None and (found := checkpoints.latest(ckpt_root)) is not None:
        first, path = found
        buffers, state = load(path, (buffers, state))
    step_fn = fsdp.train_step(opt, loss_fn)
    comm_bytes = collective_bytes(fsdp)
    data = TokenSource(config.vocab_size, args.seq_len, args.batch, args.seed, args.data, args.data_dtype)
    batch_sharding = NamedSharding(mesh, P(fsdp.data_axes))
    rows = sorted({(s[0].start or 0, s[0].stop or args.batch) for s in
                   batch_sharding.addressable_devices_indices_map((args.batch, args.seq_len)).values()})
    start, stop = rows[0][0], rows[-1][1]  # this process's devices hold consecutive rows
    device = jax.devices()[0]
    monitor = Monitor(rank0=rank0, steps=args.steps, first_step=first,
                      tokens_per_step=args.batch * args.seq_len,
                      flops_per_token=ragged.models.flops_per_token(config, args.seq_len), devices=world,
                      peak=peak_tflops(getattr(device, "device_kind", device.platform), args.peak_tflops),
                      log_path=args.log, show_bar=args.progress)
    with monitor:
        for step in range(first, args.steps):
            tokens = data.rows(step, start, stop)
            x, y = (jax.make_array_from_process_local_data(batch_sharding, a, (args.batch, args.seq_len))
                    for a in (tokens[:, :-1], tokens[:, 1:]))
            t0 = time.perf_counter()
            if model_state is None:
                buffers, state, loss = step_fn(buffers, state, x, y)
            else:
                buffers, state, loss, model_state = step_fn(buffers, state, x, y, model_state)
            loss_value = float(loss)  # waits for the step
            monitor.step(step, loss_value, time.perf_counter() - t0, None, _peak_memory(), comm_bytes)
            if args.fail_after_step is not None and step == args.fail_after_step:
                os._exit(17)
            done = step + 1
            if ckpt_root is not None and (done % args.save_interval == 0 or done == args.steps):
                if orbax is not None:
                    orbax.save(done, buffers, state, model_state)
                else:
                    save(checkpoints.step_dir(ckpt_root, done), (buffers, state))
    if orbax is not None:
        orbax.close()
    summary = monitor.print_summary(f"JAX, {world} device(s) in {jax.process_count()} process(es)")
    if jax.process_count() > 1:
        jax.distributed.shutdown()
    return summary
