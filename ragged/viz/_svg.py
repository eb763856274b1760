"""SVG of layout drawings, written with the standard library (Jupyter shows it; ``ragged plan --svg``).

One row per device, scaled so the row is the device's shard; each interval is a ``<rect>`` whose
``data-*`` attributes carry its device, local ``[start, stop)``, tensor and kind, and whose ``<title>``
is the part it holds (hover text). Block edges are thin white lines, 8-bit Adam tile edges dark dashes,
cut blocks red bars. Large meshes show their first 8 and last 4 devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from ragged.viz._drawing import LayoutDrawing

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#86bcb6")
ROW, GAP, LEFT, LINE = 18, 4, 64, 15
CHAR = 6.2  # px per character of 10px sans-serif, to decide whether a label fits


def shown_devices(world_size: int) -> list[int | None]:
    """The devices drawn, ``None`` standing for the elided middle of a large mesh."""
    if world_size <= 16:
        return list(range(world_size))
    return [*range(8), None, *range(world_size - 4, world_size)]


def color(drawing: LayoutDrawing, tensor: str) -> str:
    return PALETTE[drawing.tensors.index(tensor) % len(PALETTE)]


def short_name(name: str) -> str:
    """``layers.0.attention.wq.weight`` -> ``wq.weight``: what fits inside a bar."""
    return ".".join(name.split(".")[-2:])


def picture_svg(drawings: Sequence[LayoutDrawing], width: int = 880) -> str:
    """One SVG document with the drawings stacked top to bottom."""
    parts, y = [], 0
    for d in drawings:
        body, height = _drawing(d, width, y)
        parts += body
        y += height
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" viewBox="0 0 {width} {y}" '
            'font-family="sans-serif" font-size="10">')
    defs = ('<defs><pattern id="padding" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eeeeee"/>'
            '<line x1="0" y1="0" x2="0" y2="6" stroke="#bbbbbb" stroke-width="2"/></pattern></defs>')
    return "\n".join([head, defs, *parts, "</svg>"])


def _drawing(d: LayoutDrawing, width: int, top: int) -> tuple[list[str], int]:
    scale = (width - LEFT - 8) / max(d.shard_size, 1)
    x = lambda at: LEFT + at * scale
    out = [f'<g class="drawing" data-unit={quoteattr(d.unit)} data-method="{d.method}" '
           f'data-shard-size="{d.shard_size}">',
           f'<text class="title" x="4" y="{top + 13}" font-size="12" font-weight="bold">'
           f'{escape(d.title)}</text>']
    ys: dict[int, float] = {}
    y = top + 20
    for dev in shown_devices(d.world_size):
        if dev is None:
            out.append(f'<text x="{LEFT - 6}" y="{y + 10}" text-anchor="end">...</text>')
            y += ROW // 2 + GAP
            continue
        ys[dev] = y
        out.append(f'<text x="{LEFT - 6}" y="{y + 13}" text-anchor="end">device {dev}</text>')
        y += ROW + GAP
    rows = d.rows()
    for dev, ry in ys.items():
        for s in rows[dev]:
            fill = "url(#padding)" if s.kind == "padding" else color(d, s.tensor)
            opacity = ' fill-opacity="0.45"' if s.kind == "copy" else ""
            w = (s.stop - s.start) * scale
            out.append(f'<rect class="{s.kind}" x="{x(s.start):.2f}" y="{ry}" width="{w:.2f}" height="{ROW}" '
                       f'fill="{fill}"{opacity} stroke="white" stroke-width="0.5" data-device="{dev}" '
                       f'data-start="{s.start}" data-stop="{s.stop}" data-tensor={quoteattr(s.tensor)}>'
                       f'<title>{escape(s.label)}</title></rect>')
            text = short_name(s.tensor) + (" (copy)" if s.kind == "copy" else "")
            if s.kind != "padding" and len(text) * CHAR + 4 < w:
                out.append(f'<text class="label" x="{x(s.start) + 3:.2f}" y="{ry + 13}" fill="white">'
                           f'{escape(text)}</text>')
    for edges, cls, style in ((d.block_edges, "block", 'stroke="white" stroke-width="0.6"'),
                              (d.tile_edges, "tile",
                               'stroke="#222222" stroke-width="0.8" stroke-dasharray="2,2"'),
                              (d.cuts, "cut", 'stroke="#d62728" stroke-width="2.5"')):
        pad = 3 if cls == "cut" else 0
        for e in edges:
            if e.device in ys:
                ry = ys[e.device]
                out.append(f'<line class="{cls}" x1="{x(e.at):.2f}" x2="{x(e.at):.2f}" y1="{ry - pad}" '
                           f'y2="{ry + ROW + pad}" {style} data-device="{e.device}" data-at="{e.at}" '
                           f'data-tensor={quoteattr(e.tensor)}/>')
    y += 8
    out.append(f'<text class="caption" x="4" y="{y}">{escape(d.caption)}</text>')
    y += 4
    cx = 4.0
    for name in d.tensors:
        w = 14 + len(name) * CHAR
        if cx + w > width:
            cx, y = 4.0, y + LINE
        out.append(f'<rect x="{cx:.1f}" y="{y + 3}" width="9" height="9" fill="{color(d, name)}"/>'
                   f'<text class="legend" x="{cx + 12:.1f}" y="{y + 11}">{escape(name)}</text>')
        cx += w + 8
    out.append("</g>")
    return out, y + LINE + 12 - top
