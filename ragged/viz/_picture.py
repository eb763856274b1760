"""Pictures: drawings of one or more units, shown as SVG (Jupyter, ``ragged plan --svg``) or as
colored rows in a terminal (rich, ``ragged plan --show``).

Imports run one way: ``_picture`` -> ``_svg`` / ``_rich_picture`` -> ``_drawing`` -> the core. The rich
renderer is imported on first use, so ``ragged.viz`` itself needs only the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from ragged._layout import Layout
from ragged.viz._drawing import METHODS, LayoutDrawing, draw_layout
from ragged.viz._svg import picture_svg


@dataclass(frozen=True)
class Picture:
    """Drawings shown one under the other: Jupyter shows it as SVG, a rich console as colored rows."""

    drawings: tuple[LayoutDrawing, ...]

    def __repr__(self) -> str:
        return "\n".join(f"{d.title}: {d.caption}" for d in self.drawings)

    def svg(self, width: int = 880) -> str:
        return picture_svg(self.drawings, width)

    def _repr_svg_(self) -> str:
        return self.svg()

    def __rich__(self):  # noqa: ANN204 (a rich renderable)
        from ragged.viz._rich_picture import picture_renderable  # rich is loaded only to show one

        return picture_renderable(self.drawings)


def draw_side_by_side(layout: Layout) -> Picture:
    """The same unit as planned, under FSDP2's per-parameter chunking and GSPMD's per-tensor sharding."""
    return Picture(tuple(draw_layout(layout, m) for m in METHODS))


def draw_plan(layouts: Iterable[Layout], method: str = "ragged") -> Picture:
    """A whole-model plan: one drawing per distinct unit (repeats of a layer are drawn once).

    Units are the same when their shapes, blocks and offsets are; a repeated unit's drawing is titled
    after its first unit with the repeat count, e.g. ``layers.0 (x32: layers.0 .. layers.31)``.
    """
    groups: dict[tuple, list[Layout]] = {}
    for layout in layouts:
        key = (layout.world_size, layout.shard_size,
               tuple((t.shape, t.block, t.offset) for t in layout.tensors))
        groups.setdefault(key, []).append(layout)
    drawings = []
    for same in groups.values():
        d = draw_layout(same[0], method)
        if len(same) > 1:
            d = replace(d, unit=f"{same[0].name} (x{len(same)}: {same[0].name} .. {same[-1].name})")
        drawings.append(d)
    return Picture(tuple(drawings))
