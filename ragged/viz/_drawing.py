"""Layout pictures as data: where every element of one FSDP unit lives on every device.

A ``LayoutDrawing`` is one row per device: the intervals of the device's memory for the unit, each a
tensor's piece (with the elements of the tensor's flattened storage it holds), padding, or a full
copy. The same unit can be drawn three ways, so the differences are visible rather than described:

- ``ragged``: the planned ``Layout`` (``local_pieces``): one shard of ``S`` elements per device, tensors
  contiguous, padding only between tensors, no block ever cut;
- ``fsdp2``: PyTorch FSDP2's per-parameter ``Shard(0)`` chunking: every device holds
  ``ceil(dim0 / m)`` rows of every tensor, padded (``torch.chunk`` rows), whatever the blocks are;
- ``gspmd``: per-tensor GSPMD FSDP (as in ``experiments/jax_vs_gspmd``): each tensor sharded on its
  largest dim that ``m`` divides (a column split is strided in memory), or copied whole to every
  device when no dim divides.

Block edges (the granularity's blocks, where a cut is allowed) and tile edges (8-bit Adam's
quantization tiles, ``quant_tile``: bands of ``32 x cols`` for tiled matrices) are recorded where
they are coarse enough to see; a ``cut`` is a device boundary strictly inside a block. The renderers
(``Picture.svg``, ``Picture.__rich__`` in ``_picture``; ``experiments/layout_png.py``) only draw
this data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ragged._baselines import count_split_blocks
from ragged._layout import Layout, TensorSlot, ceil_to
from ragged.quant._tiles import quant_tile

METHODS = ("ragged", "fsdp2", "gspmd")
MAX_EDGES = 16  # per interval: finer blocks would paint the row solid (and bloat the SVG): left out


class Segment(NamedTuple):
    """One interval ``[start, stop)`` of one device's memory for the unit (local element offsets).

    ``kind`` is ``tensor`` (a part of the tensor), ``copy`` (the whole tensor, replicated on every
    device) or ``padding``. ``elements`` is the ``[lo, hi)`` range of the tensor's flattened storage
    held there, or ``None`` when the part is strided (a GSPMD split of a later dim). ``label`` says
    which part, e.g. ``layers.0.attention.wq.weight[0:4096)`` or ``w2[:, 44:88]``.
    """

    device: int
    start: int
    stop: int
    tensor: str
    kind: str
    elements: tuple[int, int] | None
    label: str


class Edge(NamedTuple):
    """A boundary at local offset ``at`` of ``device``'s row, inside or at the end of ``tensor``."""

    device: int
    at: int
    tensor: str


@dataclass(frozen=True)
class LayoutDrawing:
    """One unit under one method, as rows of intervals (see the module docstring).

    ``shard_size`` is the elements each device holds (the row length, padding and copies included);
    ``lower_bound`` is the planner's lower bound on any ragged shard size for the unit; ``cut_blocks``
    counts blocks that device boundaries split; ``copied`` the elements held again by devices
    other than the first (GSPMD's replicated tensors).
    """

    unit: str
    method: str
    world_size: int
    shard_size: int
    lower_bound: int
    padding: int
    copied: int
    cut_blocks: int
    tensors: tuple[str, ...]
    segments: tuple[Segment, ...]
    block_edges: tuple[Edge, ...]
    tile_edges: tuple[Edge, ...]
    cuts: tuple[Edge, ...]

    @property
    def padding_ratio(self) -> float:
        return self.padding / (self.world_size * self.shard_size) if self.shard_size else 0.0

    @property
    def title(self) -> str:
        names = {"ragged": "ragged (planned Layout)", "fsdp2": "FSDP2 per-parameter Shard(0)",
                 "gspmd": "GSPMD per-tensor sharding"}
        return f"{self.unit + ': ' if self.unit else ''}{names[self.method]}, {self.world_size} devices"

    @property
    def caption(self) -> str:
        parts = [f"S = {self.shard_size:,} elements per device", f"padding {self.padding_ratio:.2%}",
                 f"lower bound {self.lower_bound:,}"]
        if self.method == "ragged":
            parts[-1] += " (optimal)" if self.shard_size == self.lower_bound else \
                f" (+{self.shard_size / self.lower_bound - 1:.2%})"
        parts.append(f"{self.cut_blocks:,} blocks cut")
        if self.copied:
            parts.append(f"{self.copied:,} elements copied")
        return ", ".join(parts)

    def rows(self) -> list[list[Segment]]:
        """The segments of each device, in memory order."""
        out: list[list[Segment]] = [[] for _ in range(self.world_size)]
        for s in self.segments:
            out[s.device].append(s)
        return out


def draw_layout(layout: Layout, method: str = "ragged") -> LayoutDrawing:
    """Draw one unit's ``Layout`` as planned (``ragged``), or its tensors under ``fsdp2`` or ``gspmd``.

    Example:
        >>> import ragged
        >>> layout = ragged.plan([("w", (6, 4), "rows:1"), ("b", (3,), "element")], world_size=2)
        >>> [s.elements for s in draw_layout(layout).segments if s.kind == "tensor"]
        [(0, 12), (12, 24), (0, 3)]
    """
    if method not in METHODS:
        raise ValueError(f"unknown drawing method {method!r}; expected one of {', '.join(METHODS)}")
    m = layout.world_size
    if method == "ragged":
        rows = [[(p.local_offset, p.local_offset + p.stop - p.start, layout.slot(p.name), "tensor",
                  (p.start, p.stop), f"{p.name}[{p.start}:{p.stop})") for p in layout.local_pieces(d)]
                for d in range(m)]
        shard, cut = layout.shard_size, {}  # the Layout's own check rejects any cut block
    else:
        split = _fsdp2_split if method == "fsdp2" else _gspmd_split
        rows = [[] for _ in range(m)]
        shard, cut = 0, {}
        for t in layout.tensors:
            if not t.numel:
                continue
            size, run, parts = split(t, m)
            for d, (kind, elements, label) in enumerate(parts):
                held = size if elements is None else elements[1] - elements[0]
                if held:
                    rows[d].append((shard, shard + held, t, kind, elements, label))
            # runs of ``run`` elements go to successive devices; a copy cuts nothing
            cut[t.name] = count_split_blocks(0, t.numel, t.block, run, -(-t.numel // run) - 1)
            shard += size
        shard = ceil_to(max(shard, 1), layout.align)
    return _assemble(layout, method, shard, cut, rows)


# ----- the two per-parameter baselines ------------------------------------------------------------
def _fsdp2_split(t: TensorSlot, m: int) -> tuple[int, int, list]:
    """FSDP2 ``Shard(0)``: ``(elements per device with padding, run, [(kind, elements, label)] per device)``.

    Every device reserves ``ceil(rows / m)`` rows (``torch.chunk``); the last ones may hold fewer or none.
    """
    rows = t.shape[0] if t.shape else 1
    chunk = -(-rows // m) * (t.numel // rows)
    parts = []
    for d in range(m):
        lo, hi = min(d * chunk, t.numel), min((d + 1) * chunk, t.numel)
        parts.append(("tensor", (lo, hi), f"{t.name}[{lo}:{hi})"))
    return chunk, chunk, parts


def _gspmd_split(t: TensorSlot, m: int) -> tuple[int, int, list]:
    """GSPMD: the largest dim ``m`` divides is split (strided unless every earlier dim is 1), else a copy."""
    dims = sorted((k for k in range(len(t.shape)) if t.shape[k] % m == 0), key=lambda k: -t.shape[k])
    if not dims:
        return t.numel, t.numel, [("copy", (0, t.numel), f"{t.name} (copy)")] * m
    k = dims[0]
    run = t.shape[k] // m * math.prod(t.shape[k + 1:])  # contiguous elements one device holds in a row
    rows = t.shape[k] // m
    parts = []
    for d in range(m):
        index = ", ".join([":"] * k + [f"{d * rows}:{(d + 1) * rows}"])
        elements = (d * run, (d + 1) * run) if math.prod(t.shape[:k]) == 1 else None
        parts.append(("tensor", elements, f"{t.name}[{index}]"))
    return t.numel // m, run, parts


# ----- assembly ------------------------------------------------------------------------------------
def _assemble(layout: Layout, method: str, shard: int, cut: dict[str, int], rows: list[list[tuple]]
              ) -> LayoutDrawing:
    """Fill each row's gaps with padding and collect the edges; ``cut`` is the blocks cut per tensor."""
    segments, blocks, tiles, cuts = [], [], [], []
    copied = 0
    for d, row in enumerate(rows):
        pos = 0
        for start, stop, t, kind, elements, label in sorted(row, key=lambda r: r[0]):
            if start > pos:
                segments.append(Segment(d, pos, start, "", "padding", None, "padding"))
            segments.append(Segment(d, start, stop, t.name, kind, elements, label))
            if kind == "copy" and d:
                copied += stop - start
            if elements is not None:
                lo, hi = elements
                blocks += _edges(d, start, lo, hi, t.block, t.name)
                tiles += _edges(d, start, lo, hi, _tile_band(t), t.name)
                cuts += [Edge(d, at, t.name) for at, inside in ((start, lo), (stop, hi))
                         if inside % t.block and 0 < inside < t.numel]
            elif cut.get(t.name):  # a strided split that cuts blocks cuts them on every device
                cuts.append(Edge(d, start, t.name))
            pos = stop
        if pos < shard:
            segments.append(Segment(d, pos, shard, "", "padding", None, "padding"))
    padding = sum(s.stop - s.start for s in segments if s.kind == "padding")
    return LayoutDrawing(layout.name, method, layout.world_size, shard, layout.lower_bound, padding, copied,
                         sum(cut.values()), tuple(t.name for t in layout.tensors), tuple(segments),
                         tuple(blocks), tuple(tiles), tuple(dict.fromkeys(cuts)))


def _edges(device: int, start: int, lo: int, hi: int, block: int, name: str) -> list[Edge]:
    """Block edges strictly inside a tensor's piece ``[lo, hi)``, at local offsets; none if too dense."""
    first = lo // block + 1
    last = (hi - 1) // block
    if block <= 1 or last < first or last - first + 1 > MAX_EDGES:
        return []
    return [Edge(device, start + k * block - lo, name) for k in range(first, last + 1)]


def _tile_band(t: TensorSlot) -> int:
    """Elements in one band of 8-bit Adam's quantization tiles (tile rows x columns; 1 for vectors)."""
    rows, _ = quant_tile(t.shape)
    return rows * t.shape[-1] if len(t.shape) >= 2 else 1
