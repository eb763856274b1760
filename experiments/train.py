"""Train a llama at any preset's size with ragged-fsdp, on PyTorch or on JAX: one entry point for clusters.

    torchrun --nnodes N --nproc-per-node 8 -m experiments.train --stack torch --model llama3-8b ...
    torchrun --nnodes N --nproc-per-node 8 -m experiments.train --stack torch --model llama3-70b --tp 8
    python -m experiments.train --stack jax --model llama3-8b ...        # one process per host
    python -m experiments.train --model llama3-70b --gpus 256 --dry-run  # the per-device memory plan

Before anything is built, every rank plans the model's units for its shard group and estimates what one
device holds (``ragged.models.memory_plan``); a run that does not fit is refused with that estimate. Then each
rank builds only its shards (torch: meta device, ``fully_shard``, init one unit at a time; JAX: abstract
model, one sharded jitted init per unit), trains on synthetic tokens or a ``.bin`` token file, shows a
progress bar with loss, tokens/s, MFU and peak memory, writes a JSON line per step, and checkpoints every
``--save-interval`` steps; a relaunch with the same ``--checkpoint-dir`` resumes from the newest one.
Models: see ``ragged.models.trained_model_names()``: the llamas, and the mixture-of-experts presets
(``mixtral-8x7b``, ``gpt-oss-120b``, ``deepseek-v3`` at full size, ``*-tiny`` at CPU size), which both stacks
train as MoE decoders (docs/moe.md), with expert parallelism composed with FSDP under ``--ep N``; the
llamas take tensor parallelism inside each data-parallel group under ``--tp N`` (both stacks). Cluster
recipes: docs/cluster.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import ragged
import ragged.advise
import ragged.models
import ragged.quant
from experiments._distributed import leave_and_exit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=("torch", "jax"), default="torch")
    p.add_argument("--model", default="llama-tiny", choices=ragged.models.trained_model_names())
    p.add_argument("--hsdp", default="1", help="HSDP replica count R (shard over world/R devices), or 'auto' "
                   "for the advisor's choice (ragged advise)")
    p.add_argument("--ep", type=int, default=1,
                   help="MoE models, both stacks: expert-parallel degree (each EP rank keeps E/ep experts of "
                        "every MoE layer, sharded over world / (R ep) ranks and replicated R times; the rest "
                        "over all, as --hsdp says; docs/moe.md)")
    p.add_argument("--tp", type=int, default=1,
                   help="llamas: tensor-parallel degree inside each data-parallel group (torch: torchtitan's "
                        "plan with sequence and loss parallel, mesh (replicate, shard, tp); JAX: a 'tensor' "
                        "axis); the logits stay split by vocabulary")
    p.add_argument("--granularity", default="auto",
                   help="matrix granularity (rows:N, tiles:RxC, element, ...); auto: rows:1, 32x32 tiles for "
                        "adam8bit")
    p.add_argument("--optimizer", choices=("adamw", "adam8bit", "muon"), default="adamw")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="compute dtype (master weights and optimizer state stay fp32)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in the backward")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (all devices together)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="a .bin file of token ids (nanoGPT's convention); default: synthetic")
    p.add_argument("--data-dtype", default="uint16", choices=("uint16", "uint32"))
    p.add_argument("--checkpoint-dir", help="save here and resume from the newest checkpoint here")
    p.add_argument("--save-interval", type=int, default=100)
    p.add_argument("--checkpoint-format", choices=("npz", "orbax"), default="npz",
                   help="JAX: each process's shards (npz: resume on the same mesh) or an async Orbax "
                        "checkpoint of per-parameter arrays (orbax: any mesh; llamas, adamw, no --tp)")
    p.add_argument("--log", type=Path, help="JSON lines, one per step (default: <checkpoint-dir>/log.jsonl)")
    p.add_argument("--summary", type=Path, help="write the final summary here as JSON")
    p.add_argument("--dry-run", action="store_true", help="print the per-device memory plan and exit")
    p.add_argument("--gpus", type=int, help="devices for --dry-run (default: this launch's world size)")
    p.add_argument("--memory-limit-gib", type=float,
                   help="memory one device may use (default: the GPU's, or available RAM / local ranks)")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: from the device name)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="torch: where to train")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--coordinator", help="JAX: coordinator host:port (when the cluster is not auto-detected)")
    p.add_argument("--num-processes", type=int, help="JAX: number of processes")
    p.add_argument("--process-id", type=int, help="JAX: this process's index")
    p.add_argument("--fail-after-step", type=int, help=argparse.SUPPRESS)  # tests: die like a killed job
    args = p.parse_args(argv)
    if args.log is None and args.checkpoint_dir:
        args.log = Path(args.checkpoint_dir) / "log.jsonl"
    if args.save_interval < 1:
        p.error("--save-interval must be at least 1")
    if args.ep < 1:
        p.error(f"--ep {args.ep}: expert parallelism is a positive degree")
    return args


def memory_plan(args: argparse.Namespace, config: ragged.models.LlamaConfig | ragged.models.MoeConfig,
                world: int) -> ragged.models.MemoryPlan:
    """The per-device plan for ``world`` devices; sets ``args.replicas`` from ``--hsdp`` (auto: advisor)."""
    shapes = ragged.models.trained_shapes(args.model, config)
    granularity = ("tiles" if args.optimizer == "adam8bit" else "rows:1") if args.granularity == "auto" \
        else args.granularity
    if args.tp < 1 or world % args.tp or args.seq_len % args.tp:
        raise SystemExit(f"--tp {args.tp}: the tensor-parallel degree must divide the {world} devices and "
                         f"--seq-len {args.seq_len} (sequence parallel)")
    if args.tp > 1 and args.optimizer == "adam8bit":  # refuse here what Adam8bit refuses on every rank
        for fqn, shape in (t for u in shapes.units for t in u.tensors):
            if (dim := ragged.models.tp_split_dim(fqn)) is not None:
                try:
                    ragged.quant.check_split_tiles(shape, [(dim, args.tp)], fqn)
                except ragged.quant.TileError as e:
                    raise SystemExit(f"--tp {args.tp} --optimizer adam8bit: {e}") from None
    if args.hsdp == "auto":
        # the runtimes keep one unit per layer: merge 1
        advice = ragged.advise.advise(shapes, world, granularity, tp=args.tp)
        fits = [o for o in advice.options if o.merge == 1 and o.padding_ratio <= advice.max_padding
                and o.group_size % args.ep == 0]  # EP splits each shard group
        replicas = max(fits, key=lambda o: o.group_size).replicas if fits else 1
    else:
        replicas = int(args.hsdp)
    dp = world // args.tp  # devices that see different rows
    if replicas < 1 or dp % replicas:
        raise SystemExit(f"--hsdp {replicas}: the replica count must divide the {dp} data-parallel devices")
    if (dp // replicas) % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide the {dp // replicas} devices of each replica's shard "
                         f"group (--hsdp {replicas}): each EP rank's experts shard over group / EP devices")
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {dp} data-parallel devices")
    args.replicas = replicas
    return ragged.models.memory_plan(args.model, config, world, replicas=replicas, tp=args.tp, ep=args.ep,
                              granularity=granularity, dtype=args.dtype, optimizer=args.optimizer,
                              batch_per_device=args.batch // dp,
                              seq_len=args.seq_len, activation_checkpointing=args.activation_checkpointing,
                              shapes=shapes)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    config, modelled = ragged.models.trained_model(args.model)
    if args.ep != 1 and not isinstance(config, ragged.models.MoeConfig):
        raise SystemExit(f"--ep {args.ep}: it trains mixture-of-experts models only (got {args.model})")
    if args.ep != 1 and config.n_experts % args.ep:
        raise SystemExit(f"--ep {args.ep}: it must divide the {config.n_experts} experts of {args.model}")
    if args.tp > 1 and isinstance(config, ragged.models.MoeConfig):
        raise SystemExit(f"--tp {args.tp}: tensor parallelism is wired for the llamas only, not {args.model}")
    if args.tp > 1 and args.stack == "jax" and args.optimizer != "adamw":
        raise SystemExit("--tp: on the JAX stack tensor parallelism runs with adamw (jax_backend runs "
                         "element-wise optimizers on its (T, S) shards)")

    def plan_check(world: int, capacity: int, rank0: bool) -> None:
        """Every rank computes the same plan from the same (agreed) capacity, so all refuse or none."""
        plan = memory_plan(args, config, world)
        limit = int(args.memory_limit_gib * 2**30) if args.memory_limit_gib else capacity
        if rank0:
            print(f"{args.model}: {modelled}", file=sys.stderr)
            print(plan.describe(), file=sys.stderr)
        if plan.total > limit:
            need, have = ragged.models.gib(plan.total), ragged.models.gib(limit)
            raise SystemExit(f"out of memory: {args.model} needs about {need} per device "
                             f"on {world} devices, this device has {have}; refused before "
                             "allocating. Use more devices, --activation-checkpointing, a smaller --batch or "
                             "--seq-len, or adam8bit.")

    if args.dry_run:
        gpus = args.gpus or int(os.environ.get("WORLD_SIZE", 1))
        print(f"{args.model}: {modelled}")
        print(memory_plan(args, config, gpus).describe())
        return {}
    settings = {k: getattr(args, k) for k in ("stack", "model", "hsdp", "granularity", "optimizer", "lr",
                                              "weight_decay", "dtype", "batch", "seq_len", "seed", "data")}
    if args.tp > 1:  # only then: checkpoints written before --tp existed still resume
        settings["tp"] = args.tp
    if args.ep > 1 and args.stack == "jax":  # torch checkpoints use one-process names: any --ep resumes them
        settings["ep"] = args.ep
    if args.checkpoint_format == "orbax":  # only then: npz runs written before it existed still resume
        moe = isinstance(config, ragged.models.MoeConfig)
        if args.stack != "jax" or args.optimizer != "adamw" or args.tp > 1 or moe:
            raise SystemExit("--checkpoint-format orbax: the JAX stack, a llama, adamw, no --tp (the Orbax "
                             "tree holds the optimizer state as optax keeps it on the full params)")
        settings["checkpoint_format"] = "orbax"
    if args.stack == "torch":
        from experiments._train import torch_run

        summary = torch_run.run(args, config, plan_check, settings)
    else:
        from experiments._train import jax_run

        summary = jax_run.run(args, args.model, config, plan_check, settings)
    if args.summary is not None and summary:
        run = {k: getattr(args, k) for k in ("model", "stack", "optimizer", "dtype", "batch", "seq_len")}
        args.summary.write_text(json.dumps({**run, **summary}, indent=1))
    return summary


if __name__ == "__main__":
    main()
    leave_and_exit()  # gloo threads outlive the process group: never finalize (experiments._distributed)
