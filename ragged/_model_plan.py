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
from ragged._units import ModelShapes, UnitShapes, UnitSpecs

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
    rule = granularity if callable(granularity) else None
    matrix = None if rule else Granularity.parse(granularity)
    planned: dict[tuple, Layout] = {}
    out = []
    for unit in units:
        name, tensors = _unit_tensors(unit, rule)
        key = tuple((shape, g) for _, shape, g in tensors)  # what a plan depends on (names do not)
        if key not in planned:
            specs = [TensorSpec(fqn, shape, granularity_for(shape, matrix) if g is None else g)
                     for fqn, shape, g in tensors]
            planned[key] = plan(specs, world_size, align=align, itemsize=itemsize, name=name)
            out.append(planned[key])
        else:
            out.append(planned[key].renamed(tuple(fqn for fqn, _, _ in tensors), name))
    return tuple(out)


def _unit_tensors(unit: Any, rule: GranularityRule | None) -> tuple[str, list[tuple]]:
    """``(name, [(fqn, shape, granularity or None), ...])`` of a unit given as ``UnitShapes``, ``UnitSpecs``
    or a ``(name, tensors)`` pair; None means the default rule (it depends on the shape only), so the
    61 layers of a large MoE model cost no spec building but their first's."""
    if rule is None and isinstance(unit, UnitShapes):  # a preset's unit: shapes are tuples already
        return unit.name, [(fqn, shape, None) for fqn, shape in unit.tensors]
    if isinstance(unit, (UnitShapes, UnitSpecs)):
        name, tensors = unit.name, unit.tensors
    elif isinstance(unit, Sequence) and len(unit) == 2 and isinstance(unit[0], str):
        name, tensors = unit
    else:
        raise PlanningError(f"plan_model: a unit must be UnitShapes, UnitSpecs or (name, tensors), "
                            f"got {unit!r}")
    out = []
    for t in tensors:
        if isinstance(t, TensorSpec):
            out.append((t.name, t.shape, t.granularity))
        else:
            fqn, shape = t[0], tuple(t[1])
            out.append((fqn, shape, None if rule is None else Granularity.parse(rule(fqn, shape))))
    return name, out
