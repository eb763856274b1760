"""Layout drawings in a terminal, with rich (``ragged plan --show``; ``rich.print(picture)``).

Each device is a bar of ``width`` cells; a cell takes the color of the interval at its middle (``█`` a
tensor, ``▓`` a copy, ``░`` padding), and a cell that holds a cut block edge is a red ``┃``.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.text import Text

from ragged.viz._drawing import LayoutDrawing
from ragged.viz._svg import color, shown_devices

GLYPH = {"tensor": "█", "copy": "▓", "padding": "░"}


def picture_renderable(drawings: Sequence[LayoutDrawing], width: int = 64) -> Group:
    lines: list[Text] = []
    for d in drawings:
        lines.append(Text(d.title, style="bold"))
        rows = d.rows()
        for dev in shown_devices(d.world_size):
            if dev is None:
                lines.append(Text("       ..."))
                continue
            lines.append(Text(f"{dev:>6} │") + _bar(d, rows[dev], dev, width) + Text("│"))
        lines.append(Text(d.caption, style="dim"))
        legend = Text()
        for name in d.tensors:
            legend += Text("█ ", style=color(d, name)) + Text(name + "  ")
        lines += [legend, Text("")]
    return Group(*lines)


def _bar(d: LayoutDrawing, row: list, dev: int, width: int) -> Text:
    cell = d.shard_size / width
    cut_cells = {min(int(e.at / cell), width - 1) for e in d.cuts if e.device == dev}
    bar = Text()
    for i in range(width):
        if i in cut_cells:
            bar.append("┃", style="bold red")
            continue
        mid = (i + 0.5) * cell
        s = next((s for s in row if s.start <= mid < s.stop), row[-1])
        bar.append(GLYPH[s.kind], style="grey50" if s.kind == "padding" else color(d, s.tensor))
    return bar
