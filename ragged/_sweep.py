"""The padding sweep of the paper's Figure 11: our plans against the baselines, over models x world
sizes x granularities, written as CSV, PNG plots and a markdown summary.

Identical units (same shapes and blocks in the same order, e.g. the decoder layers of one model) are
planned once and counted as often as they occur, so a whole model costs a handful of plans.
A granularity that does not divide a tensor of a preset is reduced for that tensor to the largest
one of the same kind that does (``rows:128`` becomes ``rows:64`` on 576 rows); the CSV counts them.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from ragged._baselines import BASELINES, BaselineLayout, allgather_bytes, baseline_layouts
from ragged._granularity import Granularity, granularity_for
from ragged._layout import Layout, TensorSpec
from ragged._model_plan import plan_model
from ragged._planner import plan
from ragged._presets import model_shapes
from ragged._shapes_file import UnitSpecs

GRANULARITIES = ("rows:1", "rows:16", "rows:128", "tiles:32x32")
WORLD_SIZES = tuple(2**k for k in range(3, 11))  # 8 .. 1024
MODELS = ("gpt-oss-120b", "deepseek-v3", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b")
TARGET_MODELS = ("gpt-oss-120b", "deepseek-v3")  # the paper's Figure 11
TARGET_PADDING = 0.03
TARGET_PLAN_SECONDS = 0.3


@dataclass(frozen=True)
class UnitComparison:
    """One unit planned by us (``layout``, in ``seconds``) and sharded by every baseline.

    ``repeat_of`` names the earlier unit with the same shapes whose plan this one reuses.
    """

    name: str
    layout: Layout
    seconds: float
    baselines: tuple[BaselineLayout, ...]
    repeat_of: str | None = None

    def worse_than_whole_baseline(self) -> bool:
        """Whether a baseline that cuts no block of this unit pads it less than our layout."""
        return any(b.keeps_blocks_whole and b.padding < self.layout.padding for b in self.baselines)


def compare_unit(unit: UnitSpecs, world_size: int, *, itemsize: int = 4) -> UnitComparison:
    """Plan ``unit`` (timed) and compute every baseline for it with the same alignment."""
    t0 = time.perf_counter()
    layout = plan(unit.tensors, world_size, itemsize=itemsize, name=unit.name)
    seconds = time.perf_counter() - t0
    return UnitComparison(unit.name, layout, seconds, baseline_layouts(unit.tensors, world_size,
                                                                       align=layout.align))


def unit_signature(unit: UnitSpecs) -> tuple:
    """What a plan depends on: the shapes and blocks in order (names do not matter)."""
    return tuple((t.shape, t.block) for t in unit.tensors)


def distinct_units(units: Sequence[UnitSpecs]) -> list[tuple[UnitSpecs, int]]:
    """The distinct units (first occurrence) with how many times each occurs, in model order."""
    counts: dict[tuple, list] = {}
    for u in units:
        counts.setdefault(unit_signature(u), [u, 0])[1] += 1
    return [(u, n) for u, n in counts.values()]


def fit_granularity(shape: tuple[int, ...], granularity: Granularity) -> Granularity:
    """``granularity`` for a tensor of ``shape``, reduced to the largest of its kind that divides it.

    ``rows:N`` becomes ``rows:gcd(N, rows)`` and ``tiles:RxC`` becomes ``tiles:gcd(R, rows) x
    gcd(C, cols)``, where ``rows x cols`` is the tensor's 2-D view. Other kinds are returned as is.
    """
    if granularity.kind not in ("rows", "tiles") or math.prod(shape) == 0:
        return granularity
    cols = shape[-1]
    rows = math.prod(shape) // cols
    return Granularity(granularity.kind, math.gcd(granularity.n, rows),
                       math.gcd(granularity.cols, cols) if granularity.kind == "tiles" else 1)


def sweep_units(model: str, granularity: str) -> tuple[tuple[UnitSpecs, ...], int]:
    """The preset's units under the default rule with ``granularity`` fitted to each tensor.

    Returns:
        The units and how many tensors got a reduced granularity.
    """
    wanted = Granularity.parse(granularity)
    units, reduced = [], 0
    for u in model_shapes(model).units:
        specs = []
        for name, shape in u.tensors:
            g = granularity_for(shape, wanted)
            fitted = fit_granularity(shape, g)
            reduced += fitted != g
            specs.append(TensorSpec(name, shape, fitted))
        units.append(UnitSpecs(u.name, tuple(specs)))
    return tuple(units), reduced


@dataclass(frozen=True)
class SweepRow:
    """One method on one model, world size and granularity; sums over all units of the model.

    ``padding_ratio`` is padded over buffer elements of the whole model, ``worst_unit_ratio`` the
    largest one unit has, ``allgather_bytes`` what one device receives to unshard every unit once.
    For ``ours`` only: ``plan_seconds`` plans the distinct units; ``units_worse`` counts units with
    more padding than the best baseline that keeps that unit's blocks whole; ``best_whole_ratio`` is
    the least whole-model padding ratio among baselines that cut no block anywhere and
    ``best_whole_method`` names that baseline (both None if every baseline cuts one).
    """

    model: str
    world_size: int
    granularity: str
    method: str
    padding: int
    buffer_numel: int
    padding_ratio: float
    worst_unit_ratio: float
    split_blocks: int
    allgather_bytes: int
    reduced_tensors: int
    plan_seconds: float | None = None
    units_worse: int | None = None
    best_whole_ratio: float | None = None
    best_whole_method: str | None = None


def sweep_model(model: str, world_size: int, granularity: str, *, itemsize: int = 4) -> list[SweepRow]:
    """Rows for ``ours`` and every baseline on one model, world size and granularity."""
    units, reduced = sweep_units(model, granularity)
    compared = [(compare_unit(u, world_size, itemsize=itemsize), n) for u, n in distinct_units(units)]
    per_method: dict[str, list[tuple[int, int, int, int]]] = {}  # (padding, buffer, split, count)
    for c, n in compared:
        per_method.setdefault("ours", []).append((c.layout.padding, c.layout.total_numel, 0, n))
        for b in c.baselines:
            per_method.setdefault(b.method, []).append((b.padding, b.total_numel, b.split_blocks, n))
    rows = []
    for method, parts in per_method.items():
        padding = sum(p * n for p, _, _, n in parts)
        buffer = sum(t * n for _, t, _, n in parts)
        rows.append(SweepRow(
            model, world_size, granularity, method, padding, buffer, padding / buffer,
            max(p / t for p, t, _, _ in parts), sum(s * n for _, _, s, n in parts),
            sum(allgather_bytes(t // world_size, world_size, itemsize) * n for _, t, _, n in parts),
            reduced,
        ))
    best = min((r for r in rows[1:] if r.split_blocks == 0), key=lambda r: r.padding_ratio, default=None)
    rows[0] = replace(
        rows[0], plan_seconds=sum(c.seconds for c, _ in compared),
        units_worse=sum(n for c, n in compared if c.worse_than_whole_baseline()),
        best_whole_ratio=None if best is None else best.padding_ratio,
        best_whole_method=None if best is None else best.method,
    )
    return rows


def padding_sweep(models: Sequence[str] = MODELS, world_sizes: Sequence[int] = WORLD_SIZES,
                  granularities: Sequence[str] = GRANULARITIES, *, itemsize: int = 4) -> list[SweepRow]:
    """Figure 11's sweep: ``sweep_model`` over every model x world size x granularity.

    Args:
        models: preset names (``model_names()``).
        world_sizes: FSDP group sizes.
        granularities: the matrix granularity (1-D tensors stay element-wise).
        itemsize: bytes per element (sets the alignment, as in ``plan``, and the all-gather bytes).

    Returns:
        One ``SweepRow`` per model, world size, granularity and method (``ours`` first, then
        ``BASELINES``).
    """
    return [row for model in models for m in world_sizes for g in granularities
            for row in sweep_model(model, m, g, itemsize=itemsize)]


def time_whole_model(model: str, world_size: int, granularity: str = "rows:1", *, repeats: int = 3,
                     itemsize: int = 4) -> float:
    """Median seconds of ``plan_model`` on the preset (identical units planned once), one thread."""
    shapes = model_shapes(model)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan_model(shapes, world_size, granularity, itemsize=itemsize)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ----- report ----------------------------------------------------------------------------------------
def write_csv(rows: Sequence[SweepRow], path: Path) -> Path:
    names = [f.name for f in fields(SweepRow)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(r).items()})
    return path


def plot(rows: Sequence[SweepRow], out_dir: Path) -> list[Path]:
    """One PNG per model: padding % against world size, one panel per granularity.

    Baselines that cut blocks are dashed. Needs matplotlib (the ``experiments`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        grans = list(dict.fromkeys(r.granularity for r in mine))
        fig, axes = plt.subplots(1, len(grans), figsize=(4.2 * len(grans), 3.6), squeeze=False)
        for ax, g in zip(axes[0], grans):
            for method in ("ours", *BASELINES):
                pts = sorted((r.world_size, 100 * r.padding_ratio, r.split_blocks)
                             for r in mine if r.granularity == g and r.method == method)
                if not pts:
                    continue
                splits = any(s for _, _, s in pts)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                        linestyle="--" if splits else "-", linewidth=2.2 if method == "ours" else 1.2,
                        label=method + (" (cuts blocks)" if splits else ""))
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model}, {g}")
            ax.set_xlabel("FSDP world size")
            ax.set_ylabel("padding %")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"planner_sweep_{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def summary(rows: Sequence[SweepRow], timings: dict[tuple[str, int, str], float]) -> str:
    """The markdown summary: the acceptance statements, measured on ``rows`` and ``timings``."""
    ours = [r for r in rows if r.method == "ours"]
    lines = ["# Planner padding sweep (Figure 11)", "",
             "Generated by `python -m experiments.planner_sweep` (same as `ragged sweep`). Padding is "
             "padded over buffer elements of the whole model; 1-D tensors stay element-wise.", "",
             *_target_lines(ours), *_baseline_lines(rows, ours), *_timing_lines(timings), "",
             *_padding_table(ours), "", *_baseline_table(rows, ours)]
    reduced = {(r.model, r.granularity): r.reduced_tensors for r in ours if r.reduced_tensors}
    if reduced:
        lines += ["", "Granularities reduced to fit (tensors per model): " + ", ".join(
            f"{m} {g}: {n}" for (m, g), n in reduced.items()) + "."]
    return "\n".join(lines) + "\n"


def _target_lines(ours: list[SweepRow]) -> list[str]:
    target = [r for r in ours if r.model in TARGET_MODELS and r.granularity in ("rows:1", "rows:16")]
    small = [r for r in target if r.world_size <= 256]
    lines = []
    if small:
        worst = max(small, key=lambda r: r.padding_ratio)
        verdict = "met" if worst.padding_ratio <= TARGET_PADDING else "NOT met"
        lines.append(f"- Padding at rows:1 and rows:16, world size <= 256, on {', '.join(TARGET_MODELS)}: "
                     f"at most {_pct(worst.padding_ratio)} ({worst.model}, {worst.granularity}, "
                     f"m={worst.world_size}; target <= {_pct(TARGET_PADDING)}: {verdict}).")
    for m in (512, 1024):
        at = [r for r in target if r.world_size == m]
        if at:
            lines.append(f"- At m={m}: " + "; ".join(
                f"{r.model} {r.granularity} {_pct(r.padding_ratio)} (worst unit {_pct(r.worst_unit_ratio)})"
                for r in at) + ".")
    return lines


def _baseline_lines(rows: Sequence[SweepRow], ours: list[SweepRow]) -> list[str]:
    over = [r for r in ours if r.best_whole_ratio is not None and r.padding_ratio > r.best_whole_ratio]
    line = (f"- Against the best baseline that keeps blocks whole, whole model: ours has more padding in "
            f"{len(over)} of {len(ours)} configurations")
    if over:
        top = max(over, key=lambda r: r.padding_ratio - r.best_whole_ratio)
        line += (f" (against {', '.join(sorted({r.best_whole_method for r in over}))}), by at most "
                 f"{100 * (top.padding_ratio - top.best_whole_ratio):.2f} points ({top.model} "
                 f"{top.granularity} m={top.world_size}: {_pct(top.padding_ratio)} vs "
                 f"{top.best_whole_method} {_pct(top.best_whole_ratio)})")
    line += (f"; per unit, in {sum(r.units_worse for r in ours)} unit(s) over "
             f"{sum(1 for r in ours if r.units_worse)} configuration(s).")
    megatron = {(r.model, r.granularity, r.world_size): r.padding_ratio
                for r in rows if r.method == "megatron"}
    above = [r for r in ours if r.padding_ratio > megatron.get((r.model, r.granularity, r.world_size), 1.0)]
    return [line, f"- Against Megatron-style, the baseline that like ours keeps every tensor contiguous in "
                  f"the gathered buffer and cuts no block: more padding in {len(above)} of {len(ours)} "
                  f"configurations. FSDP2 and ZeRO-3 shard each tensor on its own (a rank-major gathered "
                  f"buffer that needs a copy-out), a looser problem than ours."]


def _timing_lines(timings: dict[tuple[str, int, str], float]) -> list[str]:
    return [f"- Whole-model planning time, {model}, m={m}, {g} (`plan_model`, distinct units once, median "
            f"of 3, one thread): {secs:.3f} s (target <= {TARGET_PLAN_SECONDS} s: "
            f"{'met' if secs <= TARGET_PLAN_SECONDS else 'NOT met'})."
            for (model, m, g), secs in timings.items()]


def _padding_table(ours: list[SweepRow]) -> list[str]:
    sizes = sorted({r.world_size for r in ours})
    lines = ["## Our padding by model, granularity and world size", "",
             "| model | granularity | " + " | ".join(f"m={m}" for m in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    cells = {(r.model, r.granularity, r.world_size): r.padding_ratio for r in ours}
    for model, g in dict.fromkeys((r.model, r.granularity) for r in ours):
        lines.append(f"| {model} | {g} | " + " | ".join(
            _pct(cells[model, g, m]) if (model, g, m) in cells else "" for m in sizes) + " |")
    return lines


def _baseline_table(rows: Sequence[SweepRow], ours: list[SweepRow]) -> list[str]:
    sizes = sorted({r.world_size for r in ours})
    shown = {sizes[0], 256, sizes[-1]}
    lines = ["## Every method at the smallest, 256 and the largest world size (blocks cut in brackets)", "",
             "| model | granularity | m | " + " | ".join(("ours", *BASELINES)) + " |",
             "|---|---|---|" + "---|" * (1 + len(BASELINES))]
    grouped: dict[tuple, dict[str, SweepRow]] = {}
    for r in rows:
        grouped.setdefault((r.model, r.granularity, r.world_size), {})[r.method] = r
    for (model, g, m), methods in grouped.items():
        if m in shown:
            lines.append(f"| {model} | {g} | {m} | " + " | ".join(
                _pct(methods[k].padding_ratio) + (f" ({methods[k].split_blocks} cut)"
                                                  if methods[k].split_blocks else "")
                for k in ("ours", *BASELINES) if k in methods) + " |")
    return lines


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def write_sweep(rows: Sequence[SweepRow], out_dir: str | Path,
                timings: dict[tuple[str, int, str], float] | None = None) -> list[Path]:
    """Write ``planner_sweep.csv``, ``planner_sweep_<model>.png`` and ``planner_sweep.md`` to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_csv(rows, out / "planner_sweep.csv"), *plot(rows, out)]
    md = out / "planner_sweep.md"
    md.write_text(summary(rows, timings or {}))
    return [*paths, md]


def run_sweep(models: Sequence[str] = MODELS, world_sizes: Sequence[int] = WORLD_SIZES,
              granularities: Sequence[str] = GRANULARITIES, out_dir: str | Path = "experiments/results", *,
              itemsize: int = 4) -> tuple[list[SweepRow], list[Path]]:
    """``padding_sweep`` plus the whole-model planning times, written by ``write_sweep``.

    Times every model of Figure 11 (``TARGET_MODELS``) in the sweep at its largest world size, at
    rows:1 and rows:16 where swept.

    Returns:
        The rows and the paths written (CSV, PNGs, markdown summary).
    """
    rows = padding_sweep(models, world_sizes, granularities, itemsize=itemsize)
    top = max(world_sizes)
    timings = {(m, top, g): time_whole_model(m, top, g, itemsize=itemsize)
               for m in models if m in TARGET_MODELS for g in granularities if g in ("rows:1", "rows:16")}
    return rows, write_sweep(rows, out_dir, timings)
