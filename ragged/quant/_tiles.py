"""Quantization tiles of 8-bit optimizer state, and where they live on each device.

8-bit Adam keeps one scale per block of its state. Each tensor's block (``quant_tile``) is a rectangle
of its 2-D view ``(prod(shape[:-1]), shape[-1])``, numbered row-major over the block grid:

- a matrix the tile ``R x C`` divides (default 32 x 32) is *tiled*: its blocks are the ``R x C`` tiles;
  a stack of matrices ``[..., m, n]`` (fused experts ``[E, m, n]``) is tiled when the tile divides each
  matrix ``(m, n)``, so no tile spans two experts and an expert-parallel split (whole experts per EP rank)
  never cuts one: an EP rank's slice has the same tiles as the whole stack;
- another matrix has one block per row (``1 x cols``);
- a 1-D tensor has one element per block (its state stays at full precision; norms and biases are small).

A block lives on one device when every device's flat range of the tensor starts and ends on a band edge
(a multiple of ``block_rows * cols`` elements): that is what the granularity ``tiles:RxC`` guarantees for
tiled matrices (``rows:1`` for the others; ``tile_granularity`` picks it), so each device quantizes its own
blocks with no metadata communication. A placement that cuts a block is rejected with ``TileError``
naming the tensor. Backends read the block of every local element from here (``tile_ids``,
``local_tile_ids``, ``piece_table``) instead of recomputing offsets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ragged._errors import GranularityError
from ragged._granularity import Granularity, granularity_for
from ragged._layout import Layout

Shape = tuple[int, ...]
TILE = (32, 32)


class TileError(GranularityError):
    """A placement or layout that cuts a quantization tile across devices."""


def tile_grid(shape: Shape, tile: tuple[int, int] = TILE) -> tuple[int, int] | None:
    """The tile grid ``(rows // R, cols // C)`` of a tiled matrix or stack of matrices (the tile divides
    each matrix ``shape[-2:]``); ``None`` if the tensor is not tiled."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    cols = shape[-1]
    rows = math.prod(shape) // cols
    if shape[-2] % tile[0] or cols % tile[1]:
        return None
    return rows // tile[0], cols // tile[1]


def quant_tile(shape: Shape, tile: tuple[int, int] = TILE) -> tuple[int, int]:
    """The quantization tile ``(rows, cols)`` of a tensor's 2-D view: the tile, one row, or one element."""
    if tile_grid(shape, tile):
        return tile
    if len(shape) >= 2:
        return 1, int(shape[-1])
    return 1, 1


def _width(shape: Shape) -> int:
    """Columns of the view the blocks tile: the last dim of a matrix; 1 for a vector (one element a row)."""
    return int(shape[-1]) if len(shape) >= 2 else 1


def tile_granularity(shape: Shape, otherwise: Granularity | int | str = "rows:1",
                     tile: tuple[int, int] = TILE) -> Granularity:
    """``tiles:RxC`` for a tiled matrix, else ``granularity_for(shape, otherwise)``: the planner rule that
    keeps every quantization tile on one device (the paper's granularity for 8-bit Adam)."""
    if tile_grid(shape, tile):
        return Granularity("tiles", tile[0], tile[1])
    return granularity_for(shape, otherwise)


def check_tiles_local(
    shape: Shape, ranges: Sequence[tuple[int, int]], name: str = "tensor", tile: tuple[int, int] = TILE
) -> None:
    """Raise ``TileError`` if a device's flat range ``[start, stop)`` cuts a quantization tile.

    Args:
        shape: the tensor's global shape.
        ranges: each device's half-open range of the flattened tensor (``RaggedShard.ranges``).
        name: the tensor's name for the error.
        tile: the tile ``(R, C)``.

    Raises:
        TileError: naming the tensor, the device, its range, the block and the granularity to plan with.
    """
    rows, cols = quant_tile(shape, tile)
    band = rows * _width(shape)
    for rank, (start, stop) in enumerate(ranges):
        if start < stop and (start % band or stop % band):
            rule = tile_granularity(tuple(shape), tile=tile)
            raise TileError(
                f"{name}: device {rank} holds elements [{start}, {stop}) of shape {tuple(shape)}, which cuts "
                f"its {rows}x{cols} quantization tiles (a device must hold whole bands of {band} "
                f"elements); plan this tensor with granularity '{rule}' (ragged.quant.tile_granularity)"
            )


def check_split_tiles(
    shape: Shape, splits: Sequence[tuple[int, int]], name: str = "tensor", tile: tuple[int, int] = TILE
) -> Shape:
    """Raise ``TileError`` if cutting ``shape`` into equal parts cuts a quantization tile; return one part.

    ``splits`` are ``(dim, parts)`` applied in order, each into ``parts`` equal slices of ``dim``: what
    tensor parallelism's ``Shard(dim)`` over ``parts`` devices does. A part keeps every tile whole iff
    (with ``quant_tile(shape) = (R, C)``) a split of the last dim leaves a multiple of ``C`` columns, and a
    split of an earlier dim ``d`` leaves a multiple of ``R`` rows of the 2-D view in each contiguous run
    (``prod(part[d:-1])``). Then the part's own tiles (``quant_tile`` of the part's shape) are exactly the
    whole tensor's tiles inside it, so 8-bit Adam on the parts gives the bits it gives on the whole tensor.

    Raises:
        TileError: naming the tensor, the split, and the tile it cuts.
        ValueError: ``parts`` does not divide ``shape[dim]`` (parts of different shapes).
    """
    part = tuple(int(s) for s in shape)
    for dim, parts in splits:
        if part[dim] % parts:
            raise ValueError(f"{name}: dim {dim} of shape {part} does not split into {parts} equal parts")
        whole, part = part, part[:dim] + (part[dim] // parts,) + part[dim + 1:]
        if parts == 1 or len(whole) < 2:
            continue  # a vector's tile is one element
        rows, cols = quant_tile(whole, tile)
        last = dim == len(whole) - 1
        kept = part[-1] if last else math.prod(part[dim:-1])
        unit, what = (cols, "columns") if last else (rows, "rows")
        if kept % unit:
            raise TileError(
                f"{name}: Shard({dim}) over {parts} devices cuts the {rows}x{cols} quantization tiles of "
                f"shape {whole}: each device gets {kept} {what} of them, not a multiple of {unit}; 8-bit "
                "Adam needs every tile whole on one device (use a tile that divides each device's part, or "
                "a tensor-parallel plan that does not split this tensor)"
            )
    return part


def tile_ids(
    shape: Shape, start: int, stop: int, name: str = "tensor", tile: tuple[int, int] = TILE
) -> np.ndarray:
    """The quantization tile of each element of ``[start, stop)`` of the flattened tensor.

    Blocks (``quant_tile``) are numbered row-major over the block grid, from 0 at the first block of
    the range.

    Returns:
        An int32 array of ``stop - start`` tile ids.

    Raises:
        TileError: the range cuts a block.
    """
    check_tiles_local(shape, [(start, stop)], name, tile)
    rows, cols = quant_tile(shape, tile)
    width = _width(shape)
    flat = np.arange(start, stop, dtype=np.int64)
    per_band = width // cols
    ids = (flat // width // rows) * per_band + (flat % width) // cols
    first = (start // width // rows) * per_band  # the range starts on a band edge
    return (ids - first).astype(np.int32)


def local_tile_ids(layout: Layout, rank: int, tile: tuple[int, int] = TILE) -> tuple[np.ndarray, int]:
    """Block ids of every element of device ``rank``'s shard, numbered in buffer order.

    Each piece (``Layout.local_pieces``) contributes its own blocks after the previous pieces'; padding
    elements get the id ``-1``.

    Returns:
        ``(ids, count)``: an int32 array of ``shard_size`` ids and the number of blocks on this device.

    Raises:
        TileError: a piece cuts a tile of its tensor (naming it).
    """
    ids = np.full(layout.shard_size, -1, dtype=np.int32)
    count = 0
    for piece in layout.local_pieces(rank):
        slot = layout.slot(piece.name)
        local = tile_ids(slot.shape, piece.start, piece.stop, piece.name, tile)
        size = piece.stop - piece.start
        ids[piece.local_offset:piece.local_offset + size] = local + count
        count += int(local.max()) + 1
    return ids, count


class PieceTable(NamedTuple):
    """Every device's pieces with their block geometry, padded to one count: a small static table.

    SPMD code picks its row with the device index and derives each element's tile id on the fly
    (``searchsorted`` over ``offset``, then the block formula of ``tile_ids``), so the table holds a few
    ints per piece instead of one id per element. Missing pieces have ``offset = shard_size`` and length 0.
    Padding elements belong to the spare block ``count``, so segment reductions take ``count + 1`` segments.
    """

    offset: np.ndarray  # (world_size, pieces) int32: where the piece starts in the shard, ascending
    length: np.ndarray  # (world_size, pieces) int32: elements in the piece
    first: np.ndarray  # (world_size, pieces) int32: tile id of the piece's first block on this device
    width: np.ndarray  # (world_size, pieces) int32: columns of the tensor's 2-D view (1 for vectors)
    rows: np.ndarray  # (world_size, pieces) int32: block rows (quant_tile)
    cols: np.ndarray  # (world_size, pieces) int32: block columns (quant_tile)
    count: int  # the most blocks any device holds


def piece_table(layout: Layout, tile: tuple[int, int] = TILE) -> PieceTable:
    """The ``PieceTable`` of ``layout``: tile ids equal ``local_tile_ids`` on every device.

    Raises:
        TileError: a piece cuts a quantization tile of its tensor (naming it).
    """
    per_rank, count = [], 0
    for rank in range(layout.world_size):
        rows, first = [], 0
        for piece in layout.local_pieces(rank):
            shape = layout.slot(piece.name).shape
            length = piece.stop - piece.start
            check_tiles_local(shape, [(piece.start, piece.stop)], piece.name, tile)
            r, c = quant_tile(shape, tile)
            width = _width(shape)
            rows.append((piece.local_offset, length, first, width, r, c))
            first += length // (r * width) * (width // c)
        per_rank.append(rows)
        count = max(count, first)
    most = max(1, max(len(rows) for rows in per_rank))
    empty = (layout.shard_size, 0, 0, 1, 1, 1)
    table = np.array([rows + [empty] * (most - len(rows)) for rows in per_rank], dtype=np.int64)
    if table.max() >= 2**31:
        raise TileError(f"layout {layout.name!r}: shard size {layout.shard_size} overflows int32 tile ids")
    return PieceTable(*(table[:, :, k].astype(np.int32) for k in range(6)), count)
