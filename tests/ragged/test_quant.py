"""Quantization tiles (ragged.quant) against brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest

import ragged
import ragged.models
import ragged.quant
from ragged.quant._tiles import (
    TileError,
    check_split_tiles,
    check_tiles_local,
    local_tile_ids,
    piece_table,
    quant_tile,
    tile_grid,
    tile_ids,
)


def _tile_of_every_element(shape, tile):
    """Brute force: label each element of the 2-D view with its tile's row-major index."""
    cols = shape[-1] if shape else 1
    rows = math.prod(shape) // cols
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return ((r // tile[0]) * (cols // tile[1]) + c // tile[1]).reshape(-1)


@pytest.mark.parametrize("shape,tile,grid", [
    ((64, 96), (32, 32), (2, 3)), ((2, 32, 64), (32, 32), (2, 2)), ((8, 12), (4, 3), (2, 4)),
    ((48, 32), (32, 32), None), ((64,), (32, 32), None), ((0, 32), (32, 32), None),
    ((2, 48, 64), (32, 32), None),  # a stack: 96 rows, but a 32-row tile would span two 48-row matrices
])
def test_tile_grid(shape, tile, grid):
    assert tile_grid(shape, tile) == grid


@pytest.mark.parametrize("shape,tile", [((64, 96), (32, 32)), ((12, 6), (4, 3)), ((3, 8, 6), (4, 2))])
def test_tile_ids_match_brute_force_on_every_band_range(shape, tile):
    full = _tile_of_every_element(shape, tile)
    band, numel = tile[0] * shape[-1], math.prod(shape)
    for start in range(0, numel, band):
        for stop in range(start + band, numel + 1, band):
            want = full[start:stop] - full[start]
            np.testing.assert_array_equal(tile_ids(shape, start, stop, tile=tile), want)


def test_tile_granularity_tiles_what_the_tile_divides():
    assert str(ragged.quant.tile_granularity((256, 64))) == "tiles:32x32"
    assert str(ragged.quant.tile_granularity((176, 64))) == "rows:1"
    assert str(ragged.quant.tile_granularity((64,))) == "element"


def test_untiled_matrices_have_row_blocks_and_vectors_element_blocks():
    assert quant_tile((48, 32)) == (1, 32) and quant_tile((7,)) == (1, 1)
    assert quant_tile((64, 64)) == (32, 32)
    np.testing.assert_array_equal(tile_ids((7,), 2, 6), [0, 1, 2, 3])
    np.testing.assert_array_equal(tile_ids((6, 4), 8, 20), np.repeat([0, 1, 2], 4))  # 6 rows: not tiled
    with pytest.raises(TileError, match=r"w2.*1x4 quantization tiles.*'rows:1'"):
        tile_ids((6, 4), 2, 8, name="w2")


def test_a_range_that_cuts_a_tile_is_rejected_naming_the_tensor():
    with pytest.raises(TileError, match=r"layers\.0\.w.*\[0, 1056\).*tiles:32x32"):
        check_tiles_local((64, 32), [(0, 1056), (1056, 2048)], "layers.0.w")
    check_tiles_local((64, 32), [(0, 1024), (1024, 1024), (1024, 2048)], "ok")  # bands, one empty


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_local_tile_ids_keep_each_tile_on_one_device(world):
    specs = [ragged.TensorSpec("a", (96, 64), "tiles:32x32"), ragged.TensorSpec("n", (64,), "element"),
             ragged.TensorSpec("b", (64, 32), "tiles:32x32"), ragged.TensorSpec("c", (40, 8), "rows:1")]
    layout = ragged.plan(specs, world)
    table = piece_table(layout)
    holder: dict[tuple[str, int], int] = {}  # (tensor, global block) -> device
    for rank in range(world):
        ids, count = local_tile_ids(layout, rank)
        np.testing.assert_array_equal(_ids_from_pieces(table, rank, layout.shard_size),
                                      np.where(ids < 0, table.count, ids))
        assert count <= table.count
        seen = set()
        for p in layout.local_pieces(rank):
            slot = layout.slot(p.name)
            local = ids[p.local_offset:p.local_offset + p.stop - p.start]
            seen |= set(local.tolist())
            glob = _tile_of_every_element(slot.shape, quant_tile(slot.shape))[p.start:p.stop]
            # local ids are a relabelling of the global blocks: same partition of the elements
            pairs = set(zip(glob.tolist(), local.tolist()))
            assert len(pairs) == len(set(glob.tolist())) == len(set(local.tolist()))
            for g in set(glob.tolist()):
                assert holder.setdefault((p.name, g), rank) == rank, f"{p.name} block {g} on two devices"
        assert seen == set(range(count))  # dense numbering
    # every block of every tensor is somewhere
    assert len(holder) == 6 + 64 + 2 + 40  # tiles of a, elements of n, tiles of b, rows of c


def _ids_from_pieces(table, rank: int, shard_size: int) -> np.ndarray:
    """Each element's block id from the compact table, element by element (padding: the spare block)."""
    out = np.full(shard_size, table.count)
    for off, n, first, width, r, c in zip(*(a[rank] for a in table[:6])):
        for j in range(n):
            out[off + j] = first + (j // width // r) * (width // c) + (j % width) // c
    return out


def test_piece_table_rejects_an_element_layout_that_cuts_a_tile():
    layout = ragged.plan([ragged.TensorSpec("layers.1.wq.weight", (64, 64), "element")], 3)
    with pytest.raises(TileError, match=r"layers\.1\.wq\.weight"):
        piece_table(layout)


@pytest.mark.parametrize("tile", [(32, 32), (4, 2)])
def test_check_split_tiles_refuses_exactly_the_splits_that_cut_a_tile(tile):
    # Brute force over shapes and splits: the parts' tiles (tile ids of each part) must be the whole
    # tensor's tiles, each inside one part; the check passes iff they are, and returns the part's shape.
    rng = np.random.default_rng(0)
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]
    cases = 0
    for _ in range(400):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(rng.choice(sizes)) for _ in range(ndim))
        dim = int(rng.integers(0, ndim))
        parts = int(rng.choice([d for d in (2, 3, 4) if shape[dim] % d == 0] or [1]))
        part = shape[:dim] + (shape[dim] // parts,) + shape[dim + 1:]
        whole_ids = _tile_of_every_element(shape, quant_tile(shape, tile)).reshape(shape)
        keeps = True
        for k in range(parts):
            inside = np.take(whole_ids, range(k * part[dim], (k + 1) * part[dim]), axis=dim).reshape(-1)
            own = _tile_of_every_element(part, quant_tile(part, tile))
            pairs = set(zip(own.tolist(), inside.tolist()))
            keeps &= len(pairs) == len(set(own.tolist())) == len(set(inside.tolist()))  # one-to-one
            keeps &= np.isin(whole_ids, inside).sum() == inside.size  # no tile reaches outside the part
        if keeps:
            assert check_split_tiles(shape, [(dim, parts)], "w", tile) == part
        else:
            with pytest.raises(TileError, match=rf"^w: Shard\({dim}\) over {parts} devices cuts"):
                check_split_tiles(shape, [(dim, parts)], "w", tile)
        cases += not keeps
    assert 0 < cases < 400  # both outcomes were seen


def test_check_split_tiles_names_the_split_and_the_tile():
    assert check_split_tiles((64, 64), [(0, 2), (1, 2)]) == (32, 32)
    with pytest.raises(TileError, match=r"wk: Shard\(0\) over 2 devices cuts the 32x32 .* gets 16 rows"):
        check_split_tiles((32, 64), [(0, 2)], "wk")
    with pytest.raises(TileError, match=r"w2: Shard\(1\) over 2 devices cuts the 1x176 .* 88 columns"):
        check_split_tiles((64, 176), [(1, 2)], "w2")
    with pytest.raises(ValueError, match="does not split into 2 equal parts"):
        check_split_tiles((3, 64), [(0, 2)])


@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b"])
def test_llama3_tp_parts_keep_every_32x32_tile_whole_up_to_tp_8(model):
    # torchtitan's llama3 plan (torch_backend.models.apply_tensor_parallel): the embedding, wq/wk/wv, w1/w3
    # and the output split their rows (Shard(0)), wo and w2 their columns (Shard(1)); norms stay whole.
    rowwise = ("attention.wo.weight", "feed_forward.w2.weight")
    tensors = [t for unit in ragged.models.model_shapes(model).units for t in unit.tensors]
    for tp in (2, 4, 8):
        for name, shape in tensors:
            if len(shape) == 2:
                check_split_tiles(shape, [(1 if name.endswith(rowwise) else 0, tp)], name)
    assert ("layers.0.attention.wk.weight", (1024, 4096 if model == "llama3-8b" else 8192)) in tensors
