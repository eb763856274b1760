"""The main job: one llama-tiny, one planned layout, trained on PyTorch and on JAX side by side.

1. The core plans every FSDP unit of llama-tiny for W devices (the same Layouts serve both stacks).
2. PyTorch: W gloo CPU processes train it with ``torch_backend.fully_shard`` (DBuffer, RaggedShard).
3. JAX: W host CPU devices train it with ``jax_backend`` (``shard_map``, flax NNX, optax), starting
   from the torch initial weights through the framework-neutral checkpoint.
4. A single-process torch run is the reference; the table shows every step's loss on all three and
   the largest relative difference of the final parameters, beside the differences that come from
   rounding alone: the reference run again on the ranks' rows as W micro-batches (what data parallelism
   changes), and JAX on one device (what XLA's kernels change). fp32 rounding in another order, which
   AdamW amplifies where a gradient is near zero.

Run: ``python -m experiments.demo [--world-size 4] [--steps 10]`` (``make demo``). JAX runs in its own
process because XLA reads the host device count once, at import, and torch workers never fork.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from experiments._distributed import rendezvous, spawn_ranks
from experiments._xla import host_devices_flags

if TYPE_CHECKING:  # torch is imported where it runs: the JAX worker never loads it
    import torch
    from torch.distributed.device_mesh import DeviceMesh

BATCH, SEQ, LR, WEIGHT_DECAY, SEED = 16, 32, 3e-3, 0.1, 0
# How far a sharded run's loss may be from the reference's: a step's loss is the mean over the batch's
# BATCH * SEQ tokens, which a sharded run sums in another order (each rank its rows, then the ranks), and
# n terms summed in another order differ by at most (n - 1) fp32 unit roundoffs (eps / 2), relative.
# The parameters' tiny differences add far less over these few steps (measured: 3e-7 at most).
LOSS_RTOL = (BATCH * SEQ - 1) * float(np.finfo(np.float32).eps) / 2  # 3.0e-5


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: framework-neutral (numpy) so both stacks see the same tokens.

    Each row counts up by a stride from a random start (mod the vocabulary): learnable in context, so
    the loss visibly falls within a few steps.
    """
    from ragged.models import LLAMA_TINY

    rng = np.random.default_rng(1000 + step)
    start = rng.integers(0, LLAMA_TINY.vocab_size, (BATCH, 1))
    stride = rng.integers(1, 4, (BATCH, 1))
    tokens = (start + stride * np.arange(SEQ + 1)) % LLAMA_TINY.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


# ----- PyTorch ---------------------------------------------------------------------------------------
def torch_reference(model: torch.nn.Module, steps: int, init: Path, out: Path,
                    micro_batches: int = 1) -> list[float]:
    """Single-process training of ``model`` (any module: token ids -> logits) from the initial weights
    ``init``; writes the final weights to ``out``. With ``micro_batches`` W, each step's batch is split
    into the W ranks' rows and the gradients averaged, as data-parallel training splits it."""
    import torch

    from torch_backend import load_neutral_checkpoint, save_neutral_checkpoint
    from torch_backend.models import cross_entropy

    load_neutral_checkpoint(init, model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        x, y = (torch.from_numpy(a) for a in batch(step))
        loss = 0.0
        for rows_x, rows_y in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            part = cross_entropy(model(rows_x), rows_y) / micro_batches
            part.backward()
            loss += part.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    save_neutral_checkpoint(out, model)
    return losses


def sharded_llama(mesh: DeviceMesh) -> torch.nn.Module:
    """llama-tiny with ``fully_shard`` on the embedding, each layer, [norm, output] and the root."""
    from torch_backend.models import Llama, parallelize

    return parallelize(Llama(), mesh)


def _torch_worker(rank: int, rendezvous_dir: str, world_size: int, steps: int, init: str, workdir: str,
                  build: Callable[[DeviceMesh], torch.nn.Module]) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch_backend import load_neutral_checkpoint, save_neutral_checkpoint
    from torch_backend.models import cross_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous(rendezvous_dir), rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    model = build(mesh)
    load_neutral_checkpoint(init, model)  # full tensors in, each rank keeps its ragged shards
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    rows = BATCH // world_size
    losses = []
    for step in range(steps):
        x, y = (torch.from_numpy(a[rank * rows:(rank + 1) * rows]) for a in batch(step))
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(global_loss := loss.detach().clone())
        losses.append(global_loss.item() / world_size)
    save_neutral_checkpoint(Path(workdir) / "torch_final", model)
    return losses


def torch_fsdp(world_size: int, steps: int, init: Path, workdir: Path,
               build: Callable[[DeviceMesh], torch.nn.Module] = sharded_llama) -> list[float]:
    """Train on ``world_size`` gloo processes (``experiments._distributed.spawn_ranks``); ``build(mesh)``
    returns the model with ``fully_shard`` applied. The workers import ``build`` by name: it must live in
    a module (a file on ``sys.path``), not in a notebook cell. Writes ``workdir/torch_final``; returns the
    losses."""
    return spawn_ranks(world_size, _torch_worker, world_size, steps, str(init), str(workdir), build)[0]


# ----- JAX (in its own process) -------------------------------------------------------------------
def jax_main(world_sizes: list[int], steps: int, init: Path, workdir: Path) -> None:
    """Train on the first ``n`` host devices for each ``n`` of ``world_sizes``, one after another: writes
    ``workdir/jax_<n>_final`` and ``workdir/jax_<n>_losses.json``."""
    import optax
    from flax import nnx

    from jax_backend import load_neutral_params, make_mesh, save_neutral_checkpoint
    from jax_backend.models import Llama, cross_entropy, parallelize

    for world_size in world_sizes:
        mesh = make_mesh((world_size,), ("fsdp",))
        fsdp = parallelize(Llama(rngs=nnx.Rngs(SEED)), mesh)
        opt = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
        buffers = fsdp.shard_params(load_neutral_params(init))
        state = fsdp.init(opt, buffers)
        step_fn = fsdp.train_step(opt, cross_entropy)
        losses = []
        for step in range(steps):
            x, y = batch(step)
            buffers, state, loss = step_fn(buffers, state, x, y)
            losses.append(float(loss))
        save_neutral_checkpoint(workdir / f"jax_{world_size}_final", buffers, fsdp.layouts)
        (workdir / f"jax_{world_size}_losses.json").write_text(json.dumps(losses))


def jax_fsdp(world_sizes: list[int], steps: int, init: Path, workdir: Path) -> dict[int, list[float]]:
    """``jax_main`` in one process with ``max(world_sizes)`` host devices (one interpreter's imports for
    every run); returns each world size's losses."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=host_devices_flags(max(world_sizes)))
    subprocess.run([sys.executable, "-m", "experiments.demo", "--jax-worker", "--world-sizes",
                    ",".join(map(str, world_sizes)), "--steps", str(steps), "--init", str(init), "--workdir",
                    str(workdir)],
                   env=env, check=True, cwd=Path(__file__).resolve().parents[1])  # `-m` works from any cwd
    return {n: json.loads((workdir / f"jax_{n}_losses.json").read_text()) for n in world_sizes}


# ----- report ------------------------------------------------------------------------------------------
def max_relative_difference(a: Path, b: Path) -> float:
    from ragged.checkpoint import load_neutral_checkpoint

    ta, tb = load_neutral_checkpoint(a).tensors, load_neutral_checkpoint(b).tensors
    worst = 0.0
    for name in ta:
        x, y = ta[name].bits.astype(np.float64), tb[name].bits.astype(np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)))
    return worst


class DemoResult(NamedTuple):
    """Per-step losses of the three runs, and each sharded run's final-parameter distance from the
    1-process reference (largest per-tensor ``||a - b|| / ||b||``), beside the same distance of the
    reference trained on the ranks' rows as micro-batches (what data parallelism alone changes) and of
    JAX on one device (what XLA's kernels alone change)."""

    reference: list[float]
    torch: list[float]
    jax: list[float]
    torch_params: float
    jax_params: float
    data_parallel_params: float
    jax_one_device_params: float


def run(world_size: int, steps: int) -> DemoResult:
    """Train the three ways from one initial checkpoint, in a temporary directory."""
    import torch

    from torch_backend import save_neutral_checkpoint
    from torch_backend.models import Llama

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        init = workdir / "init"
        model = Llama()
        model.init_weights(SEED)
        save_neutral_checkpoint(init, model)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            reference = torch_reference(Llama(), steps, init, workdir / "reference_final")
            torch_reference(Llama(), steps, init, workdir / "data_parallel_final", micro_batches=world_size)
        finally:
            torch.set_num_threads(threads)
        torch_losses = torch_fsdp(world_size, steps, init, workdir)
        jax_losses = jax_fsdp(sorted({world_size, 1}), steps, init, workdir)[world_size]
        ref = workdir / "reference_final"
        return DemoResult(reference, torch_losses, jax_losses,
                          max_relative_difference(ref, workdir / "torch_final"),
                          max_relative_difference(ref, workdir / f"jax_{world_size}_final"),
                          max_relative_difference(ref, workdir / "data_parallel_final"),
                          max_relative_difference(ref, workdir / "jax_1_final"))


def print_plan(world_size: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from ragged import plan_model
    from ragged.models import model_shapes

    layouts = plan_model(model_shapes("llama-tiny").units, world_size, "rows:1")
    table = Table(title=f"llama-tiny planned for {world_size} devices (rows:1, the Layouts of both stacks)")
    for col in ("unit", "tensors", "S (elements)", "padding"):
        table.add_column(col, justify="right" if col != "unit" else "left")
    for layout in layouts:
        table.add_row(layout.name, str(len(layout.tensors)), f"{layout.shard_size:,}",
                      f"{layout.padding_ratio:.2%}")
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jax-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world-sizes", help=argparse.SUPPRESS)  # the JAX worker's: comma-separated
    parser.add_argument("--init", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jax_worker:
        jax_main([int(n) for n in args.world_sizes.split(",")], args.steps, args.init, args.workdir)
        return
    if not 1 <= args.world_size <= BATCH or BATCH % args.world_size:
        parser.error(f"--world-size {args.world_size} must divide the batch of {BATCH}")

    from rich.console import Console
    from rich.table import Table

    print_plan(args.world_size)
    result = run(args.world_size, args.steps)
    table = Table(title=f"llama-tiny, AdamW, {args.world_size} devices: loss per step")
    for col in ("step", "torch, 1 process", f"torch fully_shard, {args.world_size} gloo processes",
                f"JAX shard_map, {args.world_size} host devices"):
        table.add_column(col, justify="right")
    for step, row in enumerate(zip(result.reference, result.torch, result.jax)):
        table.add_row(str(step), *(f"{v:.6f}" for v in row))
    console = Console()
    console.print(table)
    console.print(f"final parameters, largest relative difference from the 1-process reference: "
                  f"torch fully_shard {result.torch_params:.1e}, JAX {result.jax_params:.1e}; rounding "
                  f"alone: torch on {args.world_size} micro-batches {result.data_parallel_params:.1e}, "
                  f"JAX on 1 device {result.jax_one_device_params:.1e}")

if __name__ == "__main__":
    main()
