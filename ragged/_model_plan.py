"""Whole-model planning: one Layout per FSDP unit, planning each distinct unit only once.

Decoder layers of a model repeat: deepseek-v3's 58 MoE layers have the same tensor shapes, so their
layouts are the same offsets under different names. ``plan_model`` keys units by their shapes and
blocks, plans the first unit of each key and renames that layout for the others. The dedupe lives
inside the call: no module-level cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ragged._errors import PlanningError
from ragged._granularity import Granularity, granularity_for
from ragged._layout import Layout, TensorSpec
from ragged._planner import plan
from ragged._presets import ModelShapes, UnitShapes
from ragged._shapes_file import UnitSpecs

Shape = tuple[int, ...]
GranularityRule = Callable[[str, Shape], Granularity | int | str]


def plan_model(units: ModelShapes | Iterable[Any], world_size: int,
               granularity: Granularity | int | str | GranularityRule = "rows:1", *,
               align: int | None = None, itemsize: int = 4) -> tuple[Layout, ...]:
    """Plan every FSDP unit of a model, in order: the one core entry point both backends plan through.

    A tensor given as ``(fqn, shape)`` gets ``granularity(fqn, shape)`` when ``granularity`` is a
    function, else ``granularity_for(shape, granularity)``: the given granularity for tensors of two or
    more dims, element-wise for 1-D ones. A ``TensorSpec`` keeps its own. Units with the same sequence of
    shapes and blocks share one planning run (their layouts differ only in names), which is what makes
    a 61-layer model cost about as much as its four distinct units.

    Args:
        units: a ``ModelShapes`` (from ``model_shapes``), or its ``UnitShapes``, ``UnitSpecs`` (from a
            shapes file), or ``(unit_name, [(fqn, shape) | TensorSpec, ...])`` pairs, in model order.
        world_size: devices per FSDP group.
        granularity: the matrix granularity (see ``Granularity.parse``), or a function
            ``(fqn, shape) -> granularity`` (e.g. 32-row blocks for some tensors only).
        align: the collectives' alignment in elements; defaults to 16 bytes of the buffer dtype.
        itemsize: bytes per element of the buffer dtype (for the default ``align``).

    Returns:
        One ``Layout`` per unit, named after the unit, in the model's order.

    Raises:
        PlanningError / GranularityError: as ``plan``, naming the unit and tensor.

    Example:
        >>> layouts = plan_model(model_shapes("llama-tiny"), 4, "rows:1")
        >>> [layout.name for layout in layouts][:2]
        ['tok_embeddings', 'layers.0']
    """
    if isinstance(units, ModelShapes):
        units = units.units
    if callable(granularity):
        rule = granularity
    else:
        matrix = Granularity.parse(granularity)
        rule = lambda fqn, shape: granularity_for(shape, matrix)  # noqa: E731
    planned: dict[tuple, Layout] = {}
    out = []
    for unit in units:
        name, specs = _unit_specs(unit, rule)
        key = tuple((t.shape, t.block) for t in specs)
        if key not in planned:
            planned[key] = plan(specs, world_size, align=align, itemsize=itemsize, name=name)
            out.append(planned[key])
        else:
            out.append(planned[key].renamed(tuple(t.name for t in specs), name))
    return tuple(out)


def _unit_specs(unit: Any, rule: GranularityRule) -> tuple[str, list[TensorSpec]]:
    """``(name, specs)`` of one unit given as ``UnitShapes``, ``UnitSpecs`` or a ``(name, tensors)`` pair."""
    if isinstance(unit, (UnitShapes, UnitSpecs)):
        name, tensors = unit.name, unit.tensors
    elif isinstance(unit, Sequence) and len(unit) == 2 and isinstance(unit[0], str):
        name, tensors = unit
    else:
        raise PlanningError(f"plan_model: a unit must be UnitShapes, UnitSpecs or (name, tensors), "
                            f"got {unit!r}")
    specs = []
    for t in tensors:
        if isinstance(t, TensorSpec):
            specs.append(t)
        else:
            fqn, shape = t
            specs.append(TensorSpec(fqn, tuple(shape), rule(fqn, tuple(shape))))
    return name, specs
