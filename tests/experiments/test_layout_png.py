"""The matplotlib PNG (outside the core) draws the core's drawing data: a bar per interval, a line per cut."""

import matplotlib.pyplot as plt

import ragged
import ragged.viz
from experiments.layout_png import figure, save_png


def test_png_bars_are_the_drawn_intervals(tmp_path):
    specs = [ragged.TensorSpec("w", (64, 32), "rows:32"), ragged.TensorSpec("b", (7,))]
    layout = ragged.plan(specs, world_size=3)
    picture = ragged.viz.draw_side_by_side(layout)
    fig = figure(picture)
    for ax, drawing in zip(fig.axes, picture.drawings):
        bars = sorted((round(p.get_y() + p.get_height() / 2), int(p.get_x()), int(p.get_x() + p.get_width()))
                      for p in ax.patches)
        assert bars == sorted((s.device, s.start, s.stop) for s in drawing.segments)
        assert len(ax.lines) == len(drawing.cuts) and drawing.caption == ax.get_xlabel()
    plt.close(fig)
    save_png(picture, tmp_path / "w.png")
    assert (tmp_path / "w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
