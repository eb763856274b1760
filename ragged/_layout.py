"""Layout: where each tensor of one FSDP unit lives in the unit's global flat buffer.

The buffer holds ``world_size * shard_size`` elements; device ``d`` owns the contiguous shard
``[d * S, (d + 1) * S)``. Each tensor is one contiguous interval ``[offset, offset + numel)``, padding
lies only between tensors, and no shard boundary falls strictly inside one of a tensor's blocks.
Backends read offsets and per-device pieces from here; they never recompute them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ragged._errors import PlanningError
from ragged._granularity import Granularity
from ragged._placement import RaggedShard

Shape = tuple[int, ...]


def ceil_to(x: int, k: int) -> int:
    """The least multiple of ``k`` that is ``>= x``."""
    return -(-x // k) * k


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to plan: its name, shape and granularity (resolved to ``block`` elements)."""

    name: str
    shape: Shape
    granularity: Granularity = Granularity("elements", 1)
    block: int = field(init=False)

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if any(s < 0 for s in shape):
            raise PlanningError(f"{self.name}: shape {shape} has a negative dim")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "granularity", Granularity.parse(self.granularity))
        object.__setattr__(self, "block", self.granularity.block_numel(shape, self.name))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TensorSlot:
    """A planned tensor: its interval ``[offset, offset + numel)`` in the global buffer."""

    name: str
    shape: Shape
    block: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


class Piece(NamedTuple):
    """The part of one tensor that one device holds.

    ``[start, stop)`` indexes the tensor's flattened storage; ``local_offset`` is where that part
    begins inside the device's shard of ``shard_size`` elements.
    """

    name: str
    start: int
    stop: int
    local_offset: int


class PaddedBuffer:
    """Sizes of a unit's buffer of ``world_size`` equal shards, for anything with ``world_size``,
    ``shard_size`` and ``used_numel`` (our ``Layout`` and the baselines' ``BaselineLayout``)."""

    world_size: int
    shard_size: int
    used_numel: int

    @property
    def total_numel(self) -> int:
        """Elements in the global buffer: ``world_size * shard_size``."""
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        return self.total_numel - self.used_numel

    @property
    def padding_ratio(self) -> float:
        """Padded elements over buffer elements."""
        return self.padding / self.total_numel if self.total_numel else 0.0


@dataclass(frozen=True)
class Layout(PaddedBuffer):
    """The planned global buffer of one FSDP unit. Tensors keep the order they were given in."""

    world_size: int
    shard_size: int
    tensors: tuple[TensorSlot, ...]
    align: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        _check_layout(self)

    # ----- sizes -------------------------------------------------------------------------------
    @property
    def used_numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def lower_bound(self) -> int:
        """A lower bound on any valid shard size for these tensors, world size and alignment.

        Every element must fit (``ceil(used / world_size)``), every block must fit inside one shard
        (``max block``), the shard size is a multiple of ``align``, and every tensor of at least two
        shards contains a whole one, so its block divides the shard size (see ``ShardGrid``).
        """
        return shard_size_lower_bound(
            [(t.numel, t.block) for t in self.tensors], self.world_size, self.align
        )

    @property
    def gap(self) -> float:
        """How far ``shard_size`` is above ``lower_bound``, as a ratio (0.0 proves it optimal)."""
        return self.shard_size / self.lower_bound - 1.0

    # ----- lookups -----------------------------------------------------------------------------
    def slot(self, name: str) -> TensorSlot:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"tensor {name!r} is not in layout {self.name!r}")

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Device ``rank``'s half-open range of the global buffer."""
        if not 0 <= rank < self.world_size:
            raise PlanningError(f"rank {rank} is outside world size {self.world_size}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def local_units(self, name: str) -> tuple[int, ...]:
        """Blocks of tensor ``name`` held by each device."""
        t = self.slot(name)
        units = []
        for d in range(self.world_size):
            lo, hi = self.shard_range(d)
            units.append(max(0, min(hi, t.end) - max(lo, t.offset)) // t.block)
        if t.numel == 0:  # an empty tensor is "held" by the device its offset falls in
            units[min(t.offset // max(self.shard_size, 1), self.world_size - 1)] = 1
        return tuple(units)

    def placement(self, name: str) -> RaggedShard:
        """Tensor ``name``'s ``RaggedShard``: the coarsest prefix dims whose block divides its block."""
        t = self.slot(name)
        k = 0
        while t.numel and t.block % math.prod(t.shape[k:]):
            k += 1
        if t.numel == 0:
            k = 0
        return RaggedShard(tuple(range(k)), self.local_units(name))

    def local_pieces(self, rank: int) -> tuple[Piece, ...]:
        """The pieces of tensors that device ``rank`` holds, in buffer order."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for t in self.tensors:
            start, stop = max(lo, t.offset), min(hi, t.end)
            if start < stop:
                pieces.append(Piece(t.name, start - t.offset, stop - t.offset, start - lo))
        return tuple(sorted(pieces, key=lambda p: p.local_offset))

    def renamed(self, names: tuple[str, ...], name: str) -> Layout:
        """The same layout with its tensors renamed (in order) and the unit named ``name``.

        Offsets, shapes and blocks are unchanged, so only the new names need checking; this is how
        ``plan_model`` reuses one plan for every repeat of a layer.
        """
        if len(names) != len(self.tensors):
            raise PlanningError(
                f"layout {name!r}: {len(names)} names for {len(self.tensors)} tensors"
            )
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise PlanningError(f"layout {name!r}: duplicate tensor names {dupes}")
        out = object.__new__(Layout)  # skip __post_init__: the checked geometry is reused as is
        tensors = tuple(TensorSlot(n, t.shape, t.block, t.offset) for n, t in zip(names, self.tensors))
        for key, value in (("world_size", self.world_size), ("shard_size", self.shard_size),
                           ("tensors", tensors), ("align", self.align), ("name", name)):
            object.__setattr__(out, key, value)
        return out

    def _repr_svg_(self) -> str:
        """Jupyter's picture of the layout: one row per device (see ``ragged.viz.draw_layout``)."""
        # Imported on call, not at the top: the viewer builds on the core (it draws Layouts), so a top
        # import would make a circle, and importing the core would load drawing code. Jupyter calls this
        # after both are loaded. The one such import (tests/ragged/test_imports.py checks it).
        from ragged.viz import Picture, draw_layout

        return Picture((draw_layout(self),)).svg()

    # ----- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "align": self.align,
            "tensors": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "numel": t.numel,
                    "block": t.block,
                    "offset": t.offset,
                    "local_units": list(self.local_units(t.name)),
                }
                for t in self.tensors
            ],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any], world_size: int | None = None) -> Layout:
        """Rebuild a Layout; derived fields (numel, local_units) are checked, not trusted.

        Raises:
            PlanningError: a missing key, or a layout that breaks a rule (naming the tensor).
        """
        try:
            world = int(data.get("world_size", world_size or 0))
            layout = cls(
                world_size=world,
                shard_size=int(data["shard_size"]),
                tensors=tuple(TensorSlot(t["name"], tuple(int(d) for d in t["shape"]), int(t["block"]),
                                         int(t["offset"])) for t in data["tensors"]),
                align=int(data.get("align", 1)),
                name=str(data.get("name", "")),
            )
        except KeyError as err:
            raise PlanningError(f"layout {data.get('name', '')!r}: the JSON lacks the key {err}") from None
        for t in data["tensors"]:
            if "numel" in t and int(t["numel"]) != math.prod(t["shape"]):
                raise PlanningError(f"{t['name']}: numel {t['numel']} does not match shape {t['shape']}")
            if "local_units" in t and tuple(t["local_units"]) != layout.local_units(t["name"]):
                raise PlanningError(
                    f"{t['name']}: local_units {t['local_units']} do not match the offsets "
                    f"(expected {list(layout.local_units(t['name']))})"
                )
        return layout

    @classmethod
    def from_json(cls, text: str) -> Layout:
        return cls.from_dict(json.loads(text))


class ShardGrid(NamedTuple):
    """The shard sizes that pass the structural necessary condition, as a searchable grid.

    A tensor of ``numel >= 2 * S`` always contains a whole shard ``[k * S, (k + 1) * S]`` with at
    least one of its two boundaries strictly inside, so both boundaries are block edges and its block
    must divide ``S``. Sorting tensors by size, the tensors forced this way at ``S`` are a prefix that
    shrinks as ``S`` grows, so the valid sizes are, segment by segment, the multiples of that
    prefix's LCM (with ``align``).
    """

    numels: tuple[int, ...]  # non-empty tensors' numels, largest first
    bases: tuple[int, ...]  # bases[j]: lcm(align, blocks of the j largest tensors)

    @classmethod
    def build(cls, items: list[tuple[int, int]], align: int) -> ShardGrid:
        ranked = sorted(((e, g) for e, g in items if e), reverse=True)
        bases = [align]
        for _, g in ranked:
            bases.append(math.lcm(bases[-1], g))
        return cls(tuple(e for e, _ in ranked), tuple(bases))

    def next_valid(self, start: int) -> int:
        """The smallest valid shard size ``>= start``: a multiple of ``align`` and of every forced block."""
        s = ceil_to(max(start, 1), self.bases[0])
        while True:
            j = _count_at_least(self.numels, 2 * s)  # the forced prefix at s
            cand = ceil_to(s, self.bases[j])
            if j == 0:
                return cand
            leave = self.numels[j - 1] // 2 + 1  # from here on the smallest forced tensor is free
            if cand < leave:  # within [s, leave) the forced set is exactly this prefix
                return cand
            s = ceil_to(leave, self.bases[0])


    def take(self, start: int, limit: int, count: int) -> list[int]:
        """Up to ``count`` valid sizes in ``[start, limit]``, smallest first."""
        sizes: list[int] = []
        s = self.next_valid(start)
        while s <= limit and len(sizes) < count:
            sizes.append(s)
            s = self.next_valid(s + 1)
        return sizes


def _count_at_least(desc: tuple[int, ...], value: int) -> int:
    """How many entries of the descending tuple ``desc`` are ``>= value`` (binary search)."""
    lo, hi = 0, len(desc)
    while lo < hi:
        mid = (lo + hi) // 2
        if desc[mid] >= value:
            lo = mid + 1
        else:
            hi = mid
    return lo


def basic_lower_bound(items: list[tuple[int, int]], world_size: int, align: int) -> int:
    """``max(ceil(sum numel / m), max block)`` rounded up to ``align``; at least ``align``.

    Every element must fit in ``m`` shards, and every block lies inside one shard.
    """
    used = sum(e for e, _ in items)
    biggest = max((g for e, g in items if e), default=1)
    return max(ceil_to(-(-used // world_size), align), ceil_to(biggest, align), align)


def shard_size_lower_bound(items: list[tuple[int, int]], world_size: int, align: int) -> int:
    """A lower bound on the shard size: the first size on the ``ShardGrid`` at or above the basic bound."""
    return ShardGrid.build(items, align).next_valid(basic_lower_bound(items, world_size, align))


def _check_layout(layout: Layout) -> None:
    """Reject a layout that breaks the buffer's rules, naming the tensor and the rule."""
    m, s, align = layout.world_size, layout.shard_size, layout.align
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise PlanningError(f"layout {layout.name!r}: world_size {m} must be >= 1")
    if align < 1 or s < 1 or s % align:
        raise PlanningError(
            f"layout {layout.name!r}: shard_size {s} must be a positive multiple of align {align}"
        )
    names = [t.name for t in layout.tensors]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise PlanningError(f"layout {layout.name!r}: duplicate tensor names {dupes}")
    prev_end, prev_name = 0, None
    for t in sorted(layout.tensors, key=lambda t: (t.offset, t.numel)):
        if any(d < 0 for d in t.shape):
            raise PlanningError(f"{t.name}: shape {t.shape} has a negative dim")
        if t.block < 1 or (t.numel and t.numel % t.block):
            raise PlanningError(f"{t.name}: block {t.block} does not divide numel {t.numel}")
        if t.offset < 0 or t.offset % align:
            raise PlanningError(f"{t.name}: offset {t.offset} is not a non-negative multiple of {align}")
        if t.end > m * s:
            raise PlanningError(f"{t.name}: ends at {t.end}, past the buffer's {m} x {s} elements")
        if t.numel and t.offset < prev_end:
            raise PlanningError(f"{t.name}: overlaps {prev_name} (starts at {t.offset} < {prev_end})")
        first = t.offset // s + 1  # the first boundary index strictly after the offset
        last = (t.end - 1) // s  # the last boundary index strictly before the end
        if t.numel and first <= last:
            if (first * s - t.offset) % t.block or (last > first and s % t.block):
                raise PlanningError(
                    f"{t.name}: a shard boundary cuts one of its blocks of {t.block} elements "
                    f"(offset {t.offset}, shard size {s})"
                )
        if t.numel:
            prev_end, prev_name = t.end, t.name
