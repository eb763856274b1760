"""The simulated step as an SVG timeline (standard library only): one band per method, a compute row and
a communication row, every op a ``<rect>`` with its kind, unit and times in ``data-*`` and ``<title>``.

All bands share one time axis, so a longer step is a longer band.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from ragged.simulate._schedule import COMM, COMPUTE
from ragged.simulate._step import StepResult

TIMELINE_COLORS = {"forward": "#4e79a7", "backward": "#76b7b2", "optimizer": "#59a14f", "copy_out": "#e15759",
          "copy_in": "#ff9da7", "all_gather": "#f28e2b", "reduce_scatter": "#b07aa1", "all_reduce": "#9c755f"}
ROW, LEFT, RIGHT = 16, 96, 12


def timeline_svg(results: Sequence[StepResult], width: int = 960) -> str:
    """One SVG document: the step of each result, on a shared time axis in milliseconds."""
    horizon = max(r.step_s for r in results)
    scale = (width - LEFT - RIGHT) / horizon
    parts, y = [], 8
    for r in results:
        parts.append(f'<g class="step" data-method="{r.method}" data-step-s="{r.step_s:.6g}">')
        parts.append(f'<text x="4" y="{y + 12}" font-weight="bold">{escape(r.label)}: step '
                     f'{1e3 * r.step_s:,.1f} ms, exposed comm {1e3 * r.exposed_comm_s:,.1f} ms, MFU '
                     f'{100 * r.mfu:.1f}%</text>')
        y += 18
        for stream in (COMPUTE, COMM):
            parts.append(f'<text x="{LEFT - 6}" y="{y + 12}" text-anchor="end">{stream}</text>')
            for o in r.ops:
                if o.stream != stream or o.seconds <= 0:
                    continue
                parts.append(
                    f'<rect class="{o.kind}" x="{LEFT + o.start * scale:.2f}" y="{y}" '
                    f'width="{max(o.seconds * scale, 0.3):.2f}" height="{ROW}" '
                    f'fill="{TIMELINE_COLORS[o.kind]}" '
                    f'data-kind="{o.kind}" data-unit={quoteattr(o.unit)} data-start="{o.start:.6g}" '
                    f'data-seconds="{o.seconds:.6g}"><title>{escape(o.unit)} {o.phase} {o.kind}: '
                    f'{1e3 * o.seconds:.3f} ms at {1e3 * o.start:.3f} ms</title></rect>')
            y += ROW + 4
        parts.append("</g>")
        y += 10
    ticks = _ticks(horizon)
    for t in ticks:
        x = LEFT + t * scale
        parts.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="4" y2="{y}" stroke="#cccccc" stroke-width="0.5"/>'
                     f'<text x="{x:.2f}" y="{y + 12}" text-anchor="middle">{1e3 * t:,.0f} ms</text>')
    y += 20
    cx = 4.0
    for kind, colour in TIMELINE_COLORS.items():
        parts.append(f'<rect x="{cx:.1f}" y="{y}" width="9" height="9" fill="{colour}"/>'
                     f'<text x="{cx + 12:.1f}" y="{y + 9}">{kind}</text>')
        cx += 24 + 6.2 * len(kind)
    y += 18
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" viewBox="0 0 {width} {y}" '
            'font-family="sans-serif" font-size="10">')
    return "\n".join([head, *parts, "</svg>"])


def _ticks(horizon: float) -> list[float]:
    """About eight round tick positions (1, 2 or 5 times a power of ten seconds) up to ``horizon``."""
    raw = horizon / 8
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(horizon / step) + 1)]
