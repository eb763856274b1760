"""The HSDP advisor: which FSDP group size and unit grouping keep padding under a target.

Padding grows with the FSDP group size ``g``: the shard size S shrinks towards the blocks, so the
waste at each of the ``g - 1`` boundaries weighs more. The paper's advice is to use HSDP (shard over
groups of ``g`` devices, replicate over ``N / g`` groups) and to pick ``g`` by offline simulation;
this module is that simulation. It also tries merging ``k`` adjacent decoder layers into one FSDP
unit: a bigger unit spreads the same per-boundary waste over more elements.

For group sizes dividing ``N``, largest first, and every merge factor it re-plans the whole model and
reports padding, the largest unit, the elements each device holds and the all-gather traffic per step.
It stops after the first group size at which the smallest merge factor meets the target: the
recommendation cannot change below it, and smaller groups only cost more memory per device
(``exhaustive=True`` evaluates them all).

Recommendation rule: among the options whose whole-model padding is at most the target, take the
smallest merge factor (merging k layers multiplies the unsharded unit every device materialises by
k), and for it the largest group size (each device then holds the smallest share of the model).
None when no option meets the target. The table shows every option, for those who weigh it otherwise.

With tensor parallelism (``tp``, the llamas) each TP rank's FSDP shards its TP-local tensors over the
``N / tp`` data-parallel devices, so the options are group sizes dividing ``N / tp`` over the TP-local
units (``ragged.models.llama_tp_shapes``); what fits in memory is ``ragged.models.memory_plan``'s question
(``ragged memory --tp 1,2,4,8`` compares the degrees).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ragged._baselines import allgather_bytes
from ragged._errors import RaggedError
from ragged._granularity import Granularity
from ragged._planner import plan
from ragged._units import ModelShapes, UnitSpecs
from ragged.bench._sweep import distinct_units
from ragged.models._shapes_file import model_units
from ragged.models._tensor_parallel import llama_tp_shapes, tp_local_shapes

LAYER_PREFIX = "layers."


@dataclass(frozen=True)
class HsdpOption:
    """One HSDP configuration and what it costs.

    ``allgather_bytes`` is what one device receives per training step: every unit is all-gathered
    in the forward and again in the backward (FSDP's default, resharding after forward), padding
    included. ``shard_numel`` is the elements each device holds (sum of the units' shard sizes).
    """

    group_size: int
    replicas: int
    merge: int
    padding_ratio: float
    unit_numel: int
    shard_numel: int
    allgather_bytes: int


@dataclass(frozen=True)
class Advice:
    """The options evaluated (largest group first) and the recommended one (None if none meets the target)."""

    gpus: int
    granularity: str
    max_padding: float
    options: tuple[HsdpOption, ...]
    recommended: HsdpOption | None
    tp: int = 1


def merge_layers(units: Sequence[UnitSpecs], merge: int) -> tuple[UnitSpecs, ...]:
    """Merge every ``merge`` adjacent decoder-layer units (named ``layers.*``) into one unit.

    Other units (embedding, output) stay as they are; a last group may hold fewer layers. A merged
    unit is named after its first and last layer, ``layers.0-3``.
    """
    if isinstance(merge, bool) or not isinstance(merge, int) or merge < 1:
        raise RaggedError(f"merge factor must be an int >= 1, got {merge!r}")
    out: list[UnitSpecs] = []
    run: list[UnitSpecs] = []
    for u in [*units, None]:
        if u is not None and u.name.startswith(LAYER_PREFIX) and len(run) < merge:
            run.append(u)
            continue
        if run:
            name = run[0].name if len(run) == 1 else f"{run[0].name}-{run[-1].name[len(LAYER_PREFIX):]}"
            out.append(UnitSpecs(name, tuple(t for r in run for t in r.tensors)))
            run = []
        if u is not None and u.name.startswith(LAYER_PREFIX):
            run.append(u)
        elif u is not None:
            out.append(u)
    return tuple(out)


def evaluate(units: Sequence[UnitSpecs], gpus: int, group_size: int, merge: int, *, itemsize: int = 4
             ) -> HsdpOption:
    """Plan the model with ``merge`` layers per unit over ``group_size`` devices and measure it."""
    merged = merge_layers(units, merge)
    padding = buffer = shard = traffic = 0
    for u, count in distinct_units(merged):
        layout = plan(u.tensors, group_size, itemsize=itemsize, name=u.name)
        padding += layout.padding * count
        buffer += layout.total_numel * count
        shard += layout.shard_size * count
        traffic += 2 * allgather_bytes(layout.shard_size, group_size, itemsize) * count
    return HsdpOption(group_size, gpus // group_size, merge, padding / buffer if buffer else 0.0,
                      max(sum(t.numel for t in u.tensors) for u in merged), shard, traffic)


def advise(model: str | ModelShapes, gpus: int, granularity: Granularity | int | str = "rows:1", *,
           tp: int = 1, max_padding: float = 0.03, merge_factors: Iterable[int] = (1, 2, 4),
           group_sizes: Iterable[int] | None = None, exhaustive: bool = False, itemsize: int = 4) -> Advice:
    """Recommend an HSDP group size and a unit grouping for ``model`` on ``gpus`` devices.

    Args:
        model: a preset name or ``ModelShapes``; matrices get ``granularity``, 1-D tensors element.
        gpus: the number of devices N.
        granularity: the matrix granularity (``granularity_for``'s rule).
        tp: the tensor-parallel degree (llamas): the units are the TP-local shapes (``llama_tp_shapes`` of
            a preset, ``tp_local_shapes`` of ``ModelShapes``) and the groups divide the ``N / tp``
            data-parallel devices.
        max_padding: the target, a ratio of padded to buffer elements (0.03 is 3%).
        merge_factors: the numbers of adjacent decoder layers per unit to try.
        group_sizes: FSDP group sizes to try (each must divide ``N / tp``); default all divisors.
        exhaustive: evaluate every group size, not only down to the recommended one.
        itemsize: bytes per element (alignment, as in ``plan``, and the all-gather bytes).

    Returns:
        An ``Advice`` (see the module docstring for the recommendation rule).

    Raises:
        RaggedError: ``gpus`` < 1, a group size that does not divide it, a bad merge factor or
            ``max_padding`` outside [0, 1); the errors of ``model_units`` for the model.

    Example:
        >>> advice = advise("llama-tiny", 8, max_padding=0.01)
        >>> advice.recommended.group_size, advice.recommended.merge
        (8, 1)
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise RaggedError(f"gpus must be an int >= 1, got {gpus!r}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or gpus % tp:
        raise RaggedError(f"tp={tp!r} must be an int >= 1 dividing gpus={gpus}")
    dp = gpus // tp
    if not 0 <= max_padding < 1:
        raise RaggedError(f"max_padding must be a ratio in [0, 1), got {max_padding!r}")
    sizes = sorted(set(group_sizes) if group_sizes is not None else
                   {d for d in range(1, dp + 1) if dp % d == 0}, reverse=True)
    bad = [g for g in sizes if isinstance(g, bool) or not isinstance(g, int) or g < 1 or dp % g]
    if bad:
        per_tp = f" / tp={tp} = {dp} data-parallel devices" if tp > 1 else ""
        raise RaggedError(f"group sizes {bad} do not divide gpus={gpus}{per_tp}")
    merges = sorted(set(merge_factors))
    if tp > 1:
        model = llama_tp_shapes(model, tp) if isinstance(model, str) else tp_local_shapes(model, tp)
    units = model_units(model, granularity)
    options: list[HsdpOption] = []
    for g in sizes:
        row = [evaluate(units, dp, g, k, itemsize=itemsize) for k in merges]
        options += row
        if not exhaustive and row[0].padding_ratio <= max_padding:
            break  # the smallest merge factor meets the target: the recommendation is final
    meeting = [o for o in options if o.padding_ratio <= max_padding]
    best = min(meeting, key=lambda o: (o.merge, -o.group_size), default=None)
    return Advice(gpus, str(Granularity.parse(granularity)), max_padding, tuple(options), best, tp)
