"""The padding sweep of the paper's Figure 11: our plans against the baselines, over models x world
sizes x granularities. The report (CSV, plots, acceptance targets) is ``experiments/planner_sweep.py``.

Identical units (same shapes and blocks in the same order, e.g. the decoder layers of one model) are
planned once and counted as often as they occur, so a whole model costs a handful of plans.
A granularity that does not divide a tensor of a preset is reduced for that tensor to the largest
one of the same kind that does (``rows:128`` becomes ``rows:64`` on 576 rows); the CSV counts them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ragged._baselines import BaselineLayout, allgather_bytes, baseline_layouts
from ragged._granularity import Granularity, granularity_for
from ragged._layout import Layout, TensorSpec
from ragged._planner import plan
from ragged._units import UnitSpecs
from ragged.models._presets import model_shapes

SWEEP_GRANULARITIES = ("rows:1", "rows:16", "rows:128", "tiles:32x32")
SWEEP_WORLD_SIZES = tuple(2**k for k in range(3, 11))  # 8 .. 1024
SWEEP_MODELS = ("gpt-oss-120b", "deepseek-v3", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b")


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


def compare_units(units: Sequence[UnitSpecs], world_size: int, *, itemsize: int = 4) -> list[UnitComparison]:
    """``compare_unit`` on each unit in order; a repeat of an earlier unit reuses its plan (time 0)."""
    done: dict[tuple, UnitComparison] = {}
    out = []
    for u in units:
        first = done.get(unit_signature(u))
        if first is None:
            first = done[unit_signature(u)] = compare_unit(u, world_size, itemsize=itemsize)
            out.append(first)
        else:
            layout = first.layout.renamed(tuple(t.name for t in u.tensors), u.name)
            out.append(UnitComparison(u.name, layout, 0.0, first.baselines, repeat_of=first.name))
    return out


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


def padding_sweep(models: Sequence[str] = SWEEP_MODELS, world_sizes: Sequence[int] = SWEEP_WORLD_SIZES,
                  granularities: Sequence[str] = SWEEP_GRANULARITIES, *, itemsize: int = 4) -> list[SweepRow]:
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
