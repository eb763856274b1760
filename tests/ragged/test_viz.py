"""Layout pictures: what is drawn, checked against the Layout, the baselines and numpy brute force."""

import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from rich.console import Console

import ragged
import ragged.viz
from ragged import TensorSpec
from ragged.bench import baseline_layouts
from ragged.cli import main
from ragged.models import model_shapes
from ragged.viz import draw_layout, draw_plan, draw_side_by_side

CASES = [
    ([("wq", (64, 64), "rows:1"), ("w1", (176, 64), "tiles:16x16"), ("w2", (64, 176), "rows:1"),
      ("norm", (64,), "element")], 3),
    ([("experts", (8, 12, 32), "rows:4"), ("router", (6, 32), "whole"), ("bias", (10,), "element")], 4),
    ([("a", (5, 7), "rows:1"), ("b", (2, 8, 16), "rows:16")], 2),
]


def _layout(case):
    tensors, m = case
    return ragged.plan([TensorSpec(n, s, g) for n, s, g in tensors], world_size=m)


def _held(drawing):
    """{(device, tensor): [(elements, local start, local stop)]} of the drawn tensor intervals."""
    out = {}
    for s in drawing.segments:
        if s.kind != "padding":
            out.setdefault((s.device, s.tensor), []).append((s.elements, s.start, s.stop))
    return out


def _check_rows_tile(drawing):
    for d, row in enumerate(drawing.rows()):
        assert row[0].start == 0 and row[-1].stop == drawing.shard_size
        assert all(a.stop == b.start for a, b in zip(row, row[1:])), (d, row)


@pytest.mark.parametrize("case", CASES)
def test_ragged_drawing_is_the_layouts_local_pieces(case):
    layout = _layout(case)
    drawing = draw_layout(layout)
    _check_rows_tile(drawing)
    expected = {(d, p.name): [((p.start, p.stop), p.local_offset, p.local_offset + p.stop - p.start)]
                for d in range(layout.world_size) for p in layout.local_pieces(d)}
    assert _held(drawing) == expected
    for t in layout.tensors:  # and the RaggedShard ranges, independently of local_pieces
        ranges = layout.placement(t.name).ranges(t.shape)
        drawn = [next((e for e, _, _ in expected.get((d, t.name), [])), None)
                 for d in range(layout.world_size)]
        assert [r for r in ranges if r[1] > r[0]] == [r for r in drawn if r is not None]
    assert drawing.padding == layout.padding and drawing.shard_size == layout.shard_size
    assert drawing.cut_blocks == 0 and drawing.cuts == ()
    assert f"S = {layout.shard_size:,}" in drawing.caption
    assert f"lower bound {layout.lower_bound:,}" in drawing.caption


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_drawing_is_torch_chunk_of_dim0(case):
    layout = _layout(case)
    m = layout.world_size
    drawing = draw_layout(layout, "fsdp2")
    _check_rows_tile(drawing)
    held = _held(drawing)
    cut = 0
    for t in layout.tensors:
        flat = np.arange(t.numel).reshape(t.shape)
        chunk = math.ceil(t.shape[0] / m)
        owner = np.full(t.numel, -1)
        for d in range(m):
            part = flat[d * chunk:(d + 1) * chunk].ravel()
            if part.size:
                assert [e for e, _, _ in held[(d, t.name)]] == [(int(part[0]), int(part[-1]) + 1)]
                owner[part] = d
        cut += _cut_blocks(owner, t.block)
    base = baseline_layouts([TensorSpec(t.name, t.shape, t.block) for t in layout.tensors], m,
                            align=layout.align)[1]
    assert drawing.shard_size == base.shard_size and drawing.cut_blocks == base.split_blocks == cut


def _cut_blocks(owner, block):
    """Blocks whose elements are on more than one device (brute force)."""
    ids = np.arange(owner.size) // block
    return sum(len(set(owner[ids == b])) > 1 for b in np.unique(ids))


@pytest.mark.parametrize("case", CASES)
def test_gspmd_drawing_splits_the_largest_divisible_dim_or_copies(case):
    layout = _layout(case)
    m = layout.world_size
    drawing = draw_layout(layout, "gspmd")
    _check_rows_tile(drawing)
    held = _held(drawing)
    cut = copied = 0
    for t in layout.tensors:
        divisible = [k for k in range(len(t.shape)) if t.shape[k] % m == 0]
        if not divisible:
            assert [held[(d, t.name)][0][0] for d in range(m)] == [(0, t.numel)] * m
            copied += (m - 1) * t.numel
            continue
        k = max(divisible, key=lambda k: (t.shape[k], -k))
        flat = np.arange(t.numel).reshape(t.shape)
        owner = np.full(t.numel, -1)
        for d, part in enumerate(np.split(flat, m, axis=k)):
            owner[part.ravel()] = d
            (elements, start, stop), = held[(d, t.name)]
            assert stop - start == part.size
            contiguous = np.array_equal(np.diff(np.sort(part.ravel())), np.ones(part.size - 1))
            assert elements == ((int(part.min()), int(part.max()) + 1) if contiguous else None)
        cut += _cut_blocks(owner, t.block)
    local = sum(t.numel // m if any(d % m == 0 for d in t.shape) else t.numel for t in layout.tensors)
    assert drawing.cut_blocks == cut and drawing.copied == copied
    assert drawing.shard_size == -(-local // layout.align) * layout.align  # no padding but the alignment
    assert drawing.padding == m * (drawing.shard_size - local)


def test_block_and_tile_edges_and_cuts_are_where_the_blocks_are():
    layout = ragged.plan([TensorSpec("w", (64, 32), "rows:1")], world_size=3)  # 32x32 tiles, cut by rows:1
    drawing = draw_layout(layout)
    band = 32 * 32
    for s in drawing.segments:
        if s.kind == "tensor":
            lo, hi = s.elements
            tiles = [e.at for e in drawing.tile_edges if e.device == s.device]
            assert tiles == [s.start + k - lo for k in range(lo + 1, hi) if k % band == 0]
    fsdp2 = draw_layout(ragged.plan([TensorSpec("w", (64, 32), "rows:32")], world_size=3), "fsdp2")
    # 22 rows per device: the boundaries at rows 22 and 44 fall inside the two 32-row blocks
    assert [(e.device, e.at) for e in fsdp2.cuts] == [(0, 22 * 32), (1, 0), (1, 22 * 32), (2, 0)]
    assert fsdp2.cut_blocks == 2


def test_svg_elements_match_the_drawing():
    layout = _layout(CASES[0])
    picture = draw_side_by_side(layout)
    root = ET.fromstring(picture.svg())
    ns = {"s": "http://www.w3.org/2000/svg"}
    groups = root.findall("s:g", ns)
    assert [g.get("data-method") for g in groups] == ["ragged", "fsdp2", "gspmd"]
    for g, drawing in zip(groups, picture.drawings):
        rects = [(int(r.get("data-device")), int(r.get("data-start")), int(r.get("data-stop")),
                  r.get("data-tensor"), r.get("class"), r.find("s:title", ns).text)
                 for r in g.findall("s:rect", ns) if r.get("data-device") is not None]
        assert rects == [(s.device, s.start, s.stop, s.tensor, s.kind, s.label) for d in [drawing.rows()]
                         for row in d for s in row]
        cuts = [(int(e.get("data-device")), int(e.get("data-at")))
                for e in g.findall("s:line[@class='cut']", ns)]
        assert cuts == [(e.device, e.at) for e in drawing.cuts]
        texts = [t.text for t in g.findall("s:text", ns)]
        assert drawing.caption in texts and drawing.title in texts
        assert set(drawing.tensors) <= set(texts)  # the legend
    assert layout._repr_svg_() == ragged.viz.Picture((draw_layout(layout),)).svg()


def test_large_mesh_draws_first_and_last_devices():
    layout = ragged.plan([TensorSpec("w", (256, 8), "rows:1")], world_size=64)
    root = ET.fromstring(ragged.viz.Picture((draw_layout(layout),)).svg())
    devices = {r.get("data-device") for r in root.iter("{http://www.w3.org/2000/svg}rect")} - {None}
    assert devices == {str(d) for d in [*range(8), 60, 61, 62, 63]}


def test_whole_model_draws_each_distinct_unit_once():
    layouts = ragged.plan_model(model_shapes("llama-tiny"), 4)
    picture = draw_plan(layouts)
    assert [d.unit for d in picture.drawings] == ["tok_embeddings", "layers.0 (x4: layers.0 .. layers.3)",
                                                   "output"]


def test_terminal_picture_marks_cuts():
    picture = draw_side_by_side(ragged.plan([TensorSpec("w", (64, 32), "rows:32")], world_size=3))
    console = Console(record=True, width=120, color_system=None)
    console.print(picture)
    lines = console.export_text().splitlines()
    rows = [line for line in lines if "│" in line]
    assert len(rows) == 9  # 3 devices x 3 methods
    assert all("┃" not in r for r in rows[:3]) and any("┃" in r for r in rows[3:6])
    assert picture.drawings[1].caption in lines


def test_cli_writes_the_svg(tmp_path, capsys):
    out = tmp_path / "plan.svg"
    assert main(["plan", "--model", "llama-tiny", "--world-size", "2", "--svg", str(out)]) == 0
    root = ET.fromstring(out.read_text())
    methods = [g.get("data-method") for g in root.findall("{http://www.w3.org/2000/svg}g")]
    assert methods == ["ragged", "fsdp2", "gspmd"] * 3
    units = [g.get("data-unit") for g in root.findall("{http://www.w3.org/2000/svg}g")]
    assert units == [u for u in ["tok_embeddings", "layers.0 (x4: layers.0 .. layers.3)", "output"]
                     for _ in range(3)]


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="unknown drawing method 'zero'"):
        draw_layout(_layout(CASES[0]), "zero")
