"""PNG pictures of layouts with matplotlib (the core draws SVG and terminal pictures only; it never imports
a plotting library). The geometry is the core's ``LayoutDrawing`` data, so the PNG shows what the SVG shows.

    python -m experiments.layout_png --model llama3-8b --world-size 8 --unit layers.0 --out layout.png

draws that unit as planned, under FSDP2's per-parameter chunking and under GSPMD's per-tensor sharding.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import ragged  # noqa: E402
import ragged.models  # noqa: E402
import ragged.viz  # noqa: E402

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#86bcb6")


def save_png(picture: ragged.viz.Picture, path: str, width: float = 10.0) -> None:
    """Draw every drawing of ``picture`` as one panel (rows = devices) and save a PNG."""
    fig = figure(picture, width)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def figure(picture: ragged.viz.Picture, width: float = 10.0) -> plt.Figure:
    """The matplotlib figure: one bar per interval, one red line per cut block."""
    drawings: Sequence[ragged.viz.LayoutDrawing] = picture.drawings
    heights = [min(d.world_size, 12) + 2.5 for d in drawings]
    fig, axes = plt.subplots(len(drawings), 1, figsize=(width, 0.28 * sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, d in zip(axes[:, 0], drawings):
        shown = list(range(d.world_size)) if d.world_size <= 12 else [*range(8), *range(d.world_size - 4,
                                                                                        d.world_size)]
        rows = d.rows()
        for y, dev in enumerate(shown):
            for s in rows[dev]:
                color = PALETTE[d.tensors.index(s.tensor) % len(PALETTE)] if s.tensor else "#eeeeee"
                ax.barh(y, s.stop - s.start, left=s.start, height=0.8, color=color, edgecolor="white",
                        linewidth=0.5, hatch="///" if s.kind == "padding" else None,
                        alpha=0.45 if s.kind == "copy" else 1.0)
            for e in d.cuts:
                if e.device == dev:
                    ax.plot([e.at, e.at], [y - 0.5, y + 0.5], color="#d62728", linewidth=2.5)
        ax.set_yticks(range(len(shown)), [f"device {dev}" for dev in shown], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, d.shard_size)
        ax.set_title(d.title, fontsize=9, loc="left")
        ax.set_xlabel(d.caption, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=PALETTE[i % len(PALETTE)])
               for i in range(len(drawings[0].tensors))]
    fig.legend(handles, [ragged_short(n) for n in drawings[0].tensors], loc="lower center",
               ncol=min(5, len(handles)), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def ragged_short(name: str) -> str:
    return ".".join(name.split(".")[-3:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny", help=", ".join(ragged.models.model_names()))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--granularity", default="rows:1")
    parser.add_argument("--unit", default="layers.0", help="the unit to draw")
    parser.add_argument("--out", default="layout.png")
    args = parser.parse_args(argv)
    layouts = ragged.plan_model(ragged.models.model_shapes(args.model), args.world_size, args.granularity)
    unit = next((lay for lay in layouts if lay.name == args.unit), None)
    if unit is None:
        parser.error(f"--unit {args.unit!r} is not a unit of {args.model}: {[lay.name for lay in layouts]}")
    save_png(ragged.viz.draw_side_by_side(unit), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
