"""``ragged memory``: the per-device memory plan of a training run, one TP degree or several side by side.

Registered by ``ragged.cli``. One degree prints ``MemoryPlan.describe()`` (what ``experiments.train
--dry-run`` prints); several (``--tp 1,2,4,8``) print one column per degree at the same global batch and
say which fit in ``--memory-gib``: the smallest that fits is suggested (a larger TP degree adds
communication inside every block).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from ragged._errors import RaggedError
from ragged.models._memory import (
    DTYPE_BYTES,
    OPTIMIZER_STATE_BYTES,
    MemoryPlan,
    gib,
    memory_plan,
    trained_model,
    trained_model_names,
)


def add_parser(sub: Any) -> None:
    """Add the ``memory`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("memory", help="per-device memory of a training run (FSDP, HSDP, TP, EP)")
    p.add_argument("--model", required=True, help=f"a trained model: {', '.join(trained_model_names())}")
    p.add_argument("--gpus", type=int, required=True, help="number of devices N")
    p.add_argument("--tp", default="1", help="tensor-parallel degree(s): 8, or 1,2,4,8 to compare (llamas)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE presets; default 1)")
    p.add_argument("--hsdp", type=int, default=1, metavar="R", help="HSDP replicas (default 1)")
    p.add_argument("--batch", type=int, help="global batch in sequences (default: N, one per device at TP 1)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--granularity", default="rows:1", help="matrix granularity, or tiles (8-bit Adam's)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE_BYTES))
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                   help="under TP, count the logits gathered to the full vocabulary on every TP rank "
                        "(default: split by vocabulary through the loss, as both runtimes train)")
    p.add_argument("--memory-gib", type=float, default=80.0, help="memory of one device (default 80)")
    p.add_argument("--json", metavar="OUT", help="write the plans as JSON to OUT ('-' for stdout)")
    p.set_defaults(run=run)


def plans(args: argparse.Namespace, degrees: list[int]) -> list[MemoryPlan]:
    """One plan per TP degree, every one at the global batch ``args.batch``."""
    c, _ = trained_model(args.model)
    out = []
    for tp in degrees:
        if args.gpus % tp:
            raise RaggedError(f"--tp {tp} must divide the {args.gpus} devices")
        batch, dp = args.gpus if args.batch is None else args.batch, args.gpus // tp
        if batch % dp:
            raise RaggedError(f"--batch {batch}: the global batch must split evenly over the {dp} "
                              f"data-parallel ranks of TP {tp}")
        out.append(memory_plan(args.model, c, args.gpus, replicas=args.hsdp, tp=tp, ep=args.ep,
                               granularity=args.granularity, dtype=args.dtype, optimizer=args.optimizer,
                               batch_per_device=batch // dp, seq_len=args.seq_len,
                               activation_checkpointing=args.activation_checkpointing,
                               loss_parallel=args.loss_parallel))
    return out


def run(args: argparse.Namespace) -> int:
    degrees = [_degree(x) for x in args.tp.split(",") if x.strip()]
    if args.gpus < 1 or not degrees or args.memory_gib <= 0:
        raise RaggedError("memory: --gpus >= 1, at least one --tp degree and --memory-gib > 0 are needed")
    found = plans(args, degrees)
    limit = int(args.memory_gib * 2**30)
    fitting = [p for p in found if p.total <= limit]
    if args.json:
        text = json.dumps({"memory_bytes": limit,
                           "plans": [asdict(p) | {"total": p.total, "fits": p.total <= limit}
                                     for p in found]})
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if len(found) == 1:
        print(found[0].describe())
    else:
        _print_table(found, limit)
    verdict = (f"smallest TP degree that fits in {args.memory_gib:g} GiB: {fitting[0].tp}" if fitting else
               f"no TP degree fits in {args.memory_gib:g} GiB: more devices, --activation-checkpointing, a "
               "smaller --batch or --seq-len, or adam8bit")
    print(verdict if len(found) > 1 else
          f"{'fits' if fitting else 'does not fit'} in {args.memory_gib:g} GiB")
    return 0


def _print_table(found: list[MemoryPlan], limit: int) -> None:
    from rich.console import Console
    from rich.table import Table

    p = found[0]
    title = (f"{p.model} on {p.gpus} devices, {p.granularity}, {p.dtype}, {p.optimizer}, "
             f"{p.tokens_per_device * (p.gpus // p.tp):,} tokens per step, activation "
             f"checkpointing {'on' if p.activation_checkpointing else 'off'}")
    table = Table(title=title, title_justify="left")
    table.add_column("per device", no_wrap=True)
    for q in found:
        table.add_column(f"TP {q.tp} ({q.replicas} x {q.shard_group})", justify="right", no_wrap=True)
    table.add_row("tokens per TP group", *(f"{q.tokens_per_device:,}" for q in found))
    table.add_row("loss parallel (logits vocab / TP)", *(
        "-" if q.tp == 1 else "on" if q.loss_parallel else "off" for q in found))
    table.add_row("planner padding", *(f"{q.padding_ratio:.2%}" for q in found))
    for i, (name, _) in enumerate(p.rows()):
        table.add_row(name, *(gib(q.rows()[i][1]) for q in found))
    table.add_row(f"fits in {gib(limit)}", *("yes" if q.total <= limit else "NO" for q in found))
    Console(width=200).print(table)


def _degree(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise RaggedError(f"--tp: {text!r} is not an int >= 1")
    return int(text)
