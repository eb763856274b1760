"""The ``ragged`` command: ``plan``, ``sweep``, ``advise``, ``memory`` and ``simulate`` (see docs/cli.md).

Human output is a rich table; ``--json OUT`` writes the machine-readable result (``-`` for stdout).
Bad input prints one line, ``ragged: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ragged import Granularity, Layout, RaggedError
from ragged.advise import Advice, advise
from ragged.bench import BASELINES, SWEEP_GRANULARITIES, SWEEP_MODELS, SWEEP_WORLD_SIZES, padding_sweep
from ragged.bench._sweep import UnitComparison, compare_units
from ragged.models import llama_tp_shapes, model_names, model_units, read_shapes_file
from ragged.models._memory_cli import add_parser as add_memory_parser
from ragged.simulate._cli import add_parser as add_simulate_parser
from ragged.simulate._cli import run_advise as simulate_advise
from ragged.viz import METHODS, Picture, draw_plan

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ragged`` command line; returns the exit status (0 ok, 2 bad input)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage and its message
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.run(args)
    except (RaggedError, OSError) as e:
        print(f"ragged: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ragged", description="Structure-aware FSDP layouts.")
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("plan", help="plan every FSDP unit of a model and compare with the baselines")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=f"a preset: {', '.join(model_names())}")
    src.add_argument("--shapes", metavar="FILE.json", help="a shapes file (see docs/cli.md)")
    q.add_argument("--world-size", type=int, required=True, help="FSDP group size m")
    q.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree (llama presets): plan each TP rank's local tensors")
    q.add_argument("--granularity", default="rows:1", help="matrix granularity (default rows:1)")
    q.add_argument("--itemsize", type=int, default=4, help="bytes per element; alignment = 16 bytes")
    q.add_argument("--json", metavar="OUT", help="write the layouts as JSON to OUT ('-' for stdout)")
    q.add_argument("--svg", metavar="FILE.svg",
                   help="draw each distinct unit as planned, under FSDP2 and under GSPMD, to an SVG file")
    q.add_argument("--show", action="store_true", help="draw each distinct unit in the terminal")
    q.set_defaults(run=_run_plan)

    s = sub.add_parser("sweep", help="the Figure 11 padding sweep against the baselines")
    s.add_argument("--models", default=",".join(SWEEP_MODELS), help="comma-separated presets")
    s.add_argument("--world-sizes", default=",".join(map(str, SWEEP_WORLD_SIZES)), help="comma-separated")
    s.add_argument("--granularities", default=",".join(SWEEP_GRANULARITIES), help="comma-separated")
    s.add_argument("--itemsize", type=int, default=4)
    s.add_argument("--json", metavar="OUT", help="write every row as JSON to OUT ('-' for stdout)")
    s.set_defaults(run=_run_sweep)

    a = sub.add_parser("advise", help="recommend an HSDP group size and unit grouping")
    a.add_argument("--model", required=True, help=f"a preset: {', '.join(model_names())}")
    a.add_argument("--gpus", type=int, required=True, help="number of devices N")
    a.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree (llama presets): groups divide N / tp, TP-local tensors")
    a.add_argument("--granularity", default="rows:1", help="matrix granularity (default rows:1)")
    a.add_argument("--max-padding", default="3%", help="target, e.g. 3%% or 0.03 (default 3%%)")
    a.add_argument("--merge-factors", default="1,2,4", help="adjacent layers per unit to try")
    a.add_argument("--all-groups", action="store_true",
                   help="evaluate every group size, not only down to the recommended one")
    a.add_argument("--itemsize", type=int, default=4)
    a.add_argument("--json", metavar="OUT", help="write every option as JSON to OUT ('-' for stdout)")
    a.add_argument("--hardware",
                   help="rank by simulated step time on this profile (h800, ...) instead of padding")
    a.set_defaults(run=_run_advise)
    add_memory_parser(sub)
    add_simulate_parser(sub)
    return p


# ----- plan --------------------------------------------------------------------------------------
def _run_plan(args: argparse.Namespace) -> int:
    _positive("--world-size", args.world_size)
    _positive("--itemsize", args.itemsize)
    _positive("--tp", args.tp)
    matrix = Granularity.parse(args.granularity)
    if args.tp > 1 and not args.model:
        raise RaggedError("--tp splits the llama presets' tensors (--model); a shapes file gives each TP "
                          "rank's local shapes itself")
    model = llama_tp_shapes(args.model, args.tp) if args.tp > 1 else args.model
    units = model_units(model, matrix) if args.model else read_shapes_file(args.shapes, matrix)
    compared = compare_units(units, args.world_size, itemsize=args.itemsize)
    if args.json:
        _write_json(args.json, plan_json(compared, args.world_size))
    if args.json != "-":
        source = f"{args.model} (TP {args.tp}: each TP rank's tensors)" if args.tp > 1 else args.model
        _print_plan(compared, source or args.shapes, args.world_size, matrix)
    if args.svg or args.show:
        picture = _plan_picture([c.layout for c in compared])
        if args.svg:
            with open(args.svg, "w") as f:
                f.write(picture.svg())
            print(f"wrote {args.svg}")
        if args.show:
            _console().print(picture)
    return 0


def _plan_picture(layouts: Sequence[Layout]) -> Picture:
    """Each distinct unit (repeats drawn once) as planned, then under FSDP2 and GSPMD."""
    per_method = [draw_plan(layouts, method).drawings for method in METHODS]
    return Picture(tuple(d for same_unit in zip(*per_method) for d in same_unit))


def plan_json(compared: Sequence[UnitComparison], world_size: int) -> dict[str, Any]:
    """``{"world_size", "units": [{"name", "shard_size", "align", "tensors": [...]}]}``, block in elements."""
    units = []
    for c in compared:
        d = c.layout.to_dict()
        units.append({"name": c.name, "shard_size": d["shard_size"], "align": d["align"],
                      "tensors": d["tensors"]})
    return {"world_size": world_size, "units": units}


def _print_plan(compared: Sequence[UnitComparison], source: str, m: int, matrix: Granularity) -> None:
    table = _table(f"{source}: m={m}, granularity {matrix} (1-D tensors element-wise)",
                   ["unit", "S (elems)", "padding", "gap to LB", "plan ms", *BASELINES])
    for c in compared:
        time_cell = f"= {c.repeat_of}" if c.repeat_of else f"{1e3 * c.seconds:.1f}"
        table.add_row(c.name, f"{c.layout.shard_size:,}", _pct(c.layout.padding_ratio), _pct(c.layout.gap),
                      time_cell, *(_baseline_cell(b.padding_ratio, b.split_blocks) for b in c.baselines))
    total_s = sum(c.layout.shard_size for c in compared)
    total_buf = sum(c.layout.total_numel for c in compared)
    lower = sum(c.layout.lower_bound for c in compared)
    cells = []
    for i in range(len(BASELINES)):
        bs = [c.baselines[i] for c in compared]
        cells.append(_baseline_cell(sum(b.padding for b in bs) / sum(b.total_numel for b in bs),
                                    sum(b.split_blocks for b in bs)))
    table.add_section()
    table.add_row("total", f"{total_s:,}", _pct(sum(c.layout.padding for c in compared) / total_buf),
                  _pct(total_s / lower - 1), f"{1e3 * sum(c.seconds for c in compared):.1f}", *cells)
    _console().print(table)
    _console().print("S: elements per device. '= unit': same shapes as that unit, planned once. "
                     "Baselines: padding (blocks their cuts split).")


def _baseline_cell(ratio: float, split: int) -> str:
    return _pct(ratio) + (f" ({split:,} cut)" if split else "")


# ----- sweep -------------------------------------------------------------------------------------
def _run_sweep(args: argparse.Namespace) -> int:
    models = _list(args.models, "--models")
    unknown = [m for m in models if m not in model_names()]
    if unknown:
        raise RaggedError(f"--models: unknown model(s) {unknown}; known models: {', '.join(model_names())}")
    sizes = [_int_item(x, "--world-sizes") for x in _list(args.world_sizes, "--world-sizes")]
    grans = [str(Granularity.parse(g)) for g in _list(args.granularities, "--granularities")]
    _positive("--itemsize", args.itemsize)
    rows = padding_sweep(models, sizes, grans, itemsize=args.itemsize)
    if args.json:
        _write_json(args.json, {"rows": [asdict(r) for r in rows]})
    if args.json == "-":
        return 0
    table = _table("padding sweep (ours vs the best baseline that keeps blocks whole)",
                   ["model", "granularity", "m", "ours", "best whole", "units worse", "plan ms"])
    for r in rows:
        if r.method == "ours":
            table.add_row(r.model, r.granularity, str(r.world_size), _pct(r.padding_ratio),
                          "-" if r.best_whole_ratio is None else _pct(r.best_whole_ratio),
                          str(r.units_worse), f"{1e3 * r.plan_seconds:.1f}")
    _console().print(table)
    print("The full report (CSV, plots, the targets): python -m experiments.planner_sweep")
    return 0


# ----- advise ------------------------------------------------------------------------------------
def _run_advise(args: argparse.Namespace) -> int:
    _positive("--gpus", args.gpus)
    _positive("--tp", args.tp)
    if args.hardware:
        if args.tp > 1:
            raise RaggedError("--hardware simulates FSDP/HSDP steps without tensor parallelism; drop --tp")
        return simulate_advise(args)
    _positive("--itemsize", args.itemsize)
    target = _ratio(args.max_padding)
    merges = [_int_item(x, "--merge-factors") for x in _list(args.merge_factors, "--merge-factors")]
    advice = advise(args.model, args.gpus, args.granularity, tp=args.tp, max_padding=target,
                    merge_factors=merges, exhaustive=args.all_groups, itemsize=args.itemsize)
    if args.json:
        _write_json(args.json, asdict(advice))
    if args.json != "-":
        _print_advice(advice, args.model, args.itemsize)
    return 0


def _print_advice(advice: Advice, model: str, itemsize: int) -> None:
    tp = f" = TP {advice.tp} x {advice.gpus // advice.tp} data-parallel" if advice.tp > 1 else ""
    table = _table(f"{model} on {advice.gpus} devices{tp}, granularity {advice.granularity}, "
                   f"target padding <= {_pct(advice.max_padding)}",
                   ["group", "replicas", "merge", "padding", "largest unit", "shard/device",
                    "all-gather/device/step", ""])
    for o in advice.options:
        mark = "<- recommended" if o == advice.recommended else ("" if o.padding_ratio <= advice.max_padding
                                                                 else "over target")
        table.add_row(str(o.group_size), str(o.replicas), str(o.merge), _pct(o.padding_ratio),
                      f"{o.unit_numel / 1e6:,.1f}M", _bytes(o.shard_numel * itemsize),
                      _bytes(o.allgather_bytes), mark)
    _console().print(table)
    r = advice.recommended
    if r is None:
        print(f"no option keeps padding <= {_pct(advice.max_padding)}: "
              "try a finer granularity or larger merge factors")
    else:
        tp = f" x TP {advice.tp}" if advice.tp > 1 else ""
        print(f"recommended: FSDP group of {r.group_size} x {r.replicas} replicas (HSDP){tp}, {r.merge} "
              f"layer(s) per unit: padding {_pct(r.padding_ratio)}")


# ----- helpers -----------------------------------------------------------------------------------
def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise RaggedError(f"{flag} must be >= 1, got {value}")


def _list(text: str, flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise RaggedError(f"{flag}: give at least one value")
    return items


def _int_item(text: str, flag: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise RaggedError(f"{flag}: {text!r} is not an int >= 1")
    return int(text)


def _ratio(text: str) -> float:
    """``3%`` or ``0.03`` -> 0.03."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise RaggedError(f"--max-padding: {text!r} is not a percentage (3%) or a ratio (0.03)") from None
    if not 0 <= value < 1:
        raise RaggedError(f"--max-padding: {text!r} must be in [0%, 100%)")
    return value


def _write_json(out: str, data: dict[str, Any]) -> None:
    text = json.dumps(data)
    if out == "-":
        print(text)
    else:
        with open(out, "w") as f:
            f.write(text + "\n")


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:,.1f} {units[i]}"


def _table(title: str, columns: list[str]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    return table


def _console() -> Any:
    from rich.console import Console

    # Wide enough for the baseline columns when piped (rich falls back to 80 columns otherwise).
    return Console(width=None if sys.stdout.isatty() else 200)
