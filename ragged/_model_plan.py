"""Whole-model planning: one Layout per FSDP unit, planning each distinct unit only once.

Decoder layers of a model repeat: deepseek-v3's 58 MoE layers have the same tensor shapes, so their
layouts are the same offsets under different names. ``plan_model`` keys units by their shapes (the
granularity rule is the same for every unit of one call), plans the first unit of each key and
renames that layout for the others. The dedupe lives inside the call: no module-level cache.
"""

from __future__ import annotations

from collections.abc import Iterable

from ragged._granularity import Granularity, granularity_for
from ragged._layout import Layout, TensorSpec
from ragged._planner import plan
from ragged._presets import ModelShapes, UnitShapes


def plan_model(units: ModelShapes | Iterable[UnitShapes], world_size: int,
               granularity: Granularity | int | str = "rows:1", *, align: int | None = None,
               itemsize: int = 4) -> tuple[Layout, ...]:
    """Plan every FSDP unit of a model, in order.

    Each tensor gets ``granularity_for(shape, granularity)``: the given granularity for tensors of
    two or more dims, element-wise for 1-D ones. Units with the same sequence of shapes share one
    planning run (their layouts differ only in names), which is what makes a 61-layer model cost
    about as much as its four distinct units.

    Args:
        units: a ``ModelShapes`` (from ``model_shapes``) or its ``UnitShapes``.
        world_size: devices per FSDP group.
        granularity: the matrix granularity (see ``Granularity.parse``).
        align: the collective unit in elements; defaults to 16 bytes of the buffer dtype.
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
    matrix = Granularity.parse(granularity)
    planned: dict[tuple, Layout] = {}
    out = []
    for unit in units:
        key = tuple(shape for _, shape in unit.tensors)
        names = tuple(fqn for fqn, _ in unit.tensors)
        if key not in planned:
            specs = [TensorSpec(fqn, shape, granularity_for(shape, matrix)) for fqn, shape in unit.tensors]
            planned[key] = plan(specs, world_size, align=align, itemsize=itemsize, name=unit.name)
            out.append(planned[key])
        else:
            out.append(planned[key].renamed(names, unit.name))
    return tuple(out)
