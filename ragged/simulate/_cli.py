"""``ragged simulate``: one training step on N GPUs of a hardware profile, ours vs FSDP2 vs Megatron-FSDP.

Registered by ``ragged.cli``; the table is for people, ``--json OUT`` writes every number and
``--svg FILE`` the step's timeline.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ragged import Granularity, RaggedError
from ragged.models import (
    llama_shapes,
    model_names,
    model_shapes,
    read_shapes_file,
    trained_llama,
    trained_model_names,
)
from ragged.simulate._advise_step import advise_step_time
from ragged.simulate._calibration import calibrate, load_calibration
from ragged.simulate._efficiency import Efficiency
from ragged.simulate._hardware import PROFILES, hardware
from ragged.simulate._step import StepConfig, StepResult, simulate
from ragged.simulate._timeline_svg import timeline_svg
from ragged.simulate._workload import METHODS

_AC_NAMES = {True: "full", False: "none"}

def add_parser(sub: Any) -> None:
    """Add the ``simulate`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("simulate",
                       help="simulate one training step on N GPUs: ours vs FSDP2 vs Megatron-FSDP")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=f"a preset: {', '.join(trained_model_names())}")
    src.add_argument("--shapes", metavar="FILE.json", help="a shapes file (needs --like for compute)")
    p.add_argument("--like",
                   help="with --shapes: the preset whose llama stands in for compute and activations")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs N")
    p.add_argument("--hardware", default="h800", help=f"{', '.join(PROFILES)} or a profile FILE.json")
    p.add_argument("--hsdp", type=int, default=1, metavar="R", help="HSDP replicas (FSDP group = N / R)")
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU (default 1)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--granularity", default="rows:1", help="matrix granularity (default rows:1)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam8bit", "muon"))
    p.add_argument("--activation-checkpointing", dest="ac", default="full",
                   choices=("full", "none", "selective-op"),
                   help="full (default): recompute each layer in backward; none; selective-op: torchtitan's "
                        "op policy (every second matmul of a layer recomputed)")
    p.add_argument("--no-activation-checkpointing", dest="ac", action="store_const", const="none",
                   help="the same as --activation-checkpointing none")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: ours, fsdp2, megatron")
    p.add_argument("--calibration", metavar="FILE.json",
                   help="measured times to calibrate on (docs/simulate.md)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT ('-' for stdout)")
    p.add_argument("--svg", metavar="FILE.svg", help="draw the step's timeline for each method")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    hw = hardware(args.hardware)
    source = args.model or args.like
    if args.shapes and not args.like:
        raise RaggedError("--shapes needs --like PRESET: the llama whose compute and activations stand in")
    c, modelled = trained_llama(source)
    matrix = str(Granularity.parse(args.granularity))
    if args.shapes:
        units = read_shapes_file(args.shapes, matrix)
    else:  # a trained llama that is not a shape preset (llama3.2-1b) has the llama's own shapes
        units = model_shapes(args.model) if args.model in model_names() else llama_shapes(args.model, c)
    config = StepConfig(args.gpus, args.hsdp, args.batch, args.seq_len, matrix, optimizer=args.optimizer,
                        activation_checkpointing=args.ac)
    eff = Efficiency()
    if args.calibration:
        eff = calibrate(load_calibration(args.calibration), units, c, hw, granularity=matrix)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    results = simulate(units, c, hw, config, methods=methods, efficiency=eff, name=source)
    if args.json:
        text = json.dumps({"model": args.model or args.shapes, "compute_model": modelled,
                           "hardware": hw.to_dict(), "efficiency": eff.to_dict(),
                           "results": [r.summary() | {"fits": r.fits(hw)} for r in results]})
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(timeline_svg(results))
    if args.json != "-":
        _print(results, args.model or args.shapes, modelled, hw.hbm_bytes)
        if args.svg:
            print(f"wrote {args.svg}")
    return 0


def _print(results: list[StepResult], model: str, modelled: str, hbm: float) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = results[0].config
    title = (f"{model} on {cfg.gpus} {results[0].hardware} ({cfg.replicas} x {cfg.group_size}), "
             f"{cfg.batch_per_device} x {cfg.seq_len} tokens/GPU, {cfg.optimizer}, activation "
             f"checkpointing {_AC_NAMES.get(cfg.activation_checkpointing, cfg.activation_checkpointing)}")
    table = Table(title=title, title_justify="left")
    cols = ["method", "step ms", "compute ms", "copies ms", "comm ms", "exposed comm ms", "tokens/s/GPU",
            "MFU", "padding", "memory plan", "held", "with reserve", "fits"]
    for i, col in enumerate(cols):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    for r in results:
        ms = [f"{1e3 * t:,.1f}" for t in (r.step_s, r.compute_s, r.copy_s, r.comm_s, r.exposed_comm_s)]
        table.add_row(r.label, *ms, f"{r.tokens_per_s_per_gpu:,.0f}", f"{100 * r.mfu:.1f}%",
                      f"{100 * r.padding_ratio:.2f}%", _gib(r.memory.total),
                      _gib(r.held_bytes), _gib(r.peak_bytes), "yes" if r.peak_bytes <= hbm else "NO (OOM)")
    console = Console(width=220)
    console.print(table)
    console.print(f"compute modelled as: {modelled}. 'with reserve' adds the allocator reserve the paper "
                  "measured for each baseline (not derived here). See docs/simulate.md.")


def run_advise(args: argparse.Namespace) -> int:
    """``ragged advise --hardware H``: rank the HSDP options by simulated step time (1 x 4096 tokens per
    GPU, AdamW, activation checkpointing, default efficiencies) and recommend the fastest that fits."""
    from dataclasses import asdict

    c, _ = trained_llama(args.model)
    merges = [int(x) for x in args.merge_factors.split(",") if x.strip()]
    options, best = advise_step_time(model_shapes(args.model), c, hardware(args.hardware), args.gpus,
                                     merge_factors=merges, granularity=args.granularity)
    if args.json:
        text = json.dumps({"options": [asdict(o) for o in options], "recommended": best and asdict(best)})
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.model} on {args.gpus} {args.hardware}: HSDP options by simulated step time "
                        "(ours, 1 x 4096 tokens/GPU, AdamW, activation checkpointing)", title_justify="left")
    for i, col in enumerate(["group", "replicas", "merge", "padding", "step ms", "tokens/s/GPU", "peak", ""]):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    for o in options:
        mark = "<- recommended" if o == best else ("" if o.fits else "out of memory")
        table.add_row(str(o.group_size), str(o.replicas), str(o.merge), f"{100 * o.padding_ratio:.2f}%",
                      f"{1e3 * o.step_s:,.1f}", f"{o.tokens_per_s_per_gpu:,.0f}", _gib(o.peak_bytes), mark)
    Console(width=200).print(table)
    if best is None:
        print("no option fits in memory: more GPUs, adam8bit, or a shorter sequence")
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"
