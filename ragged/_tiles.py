"""Quantization blocks of 8-bit optimizer state, and where they live on each device.

8-bit Adam keeps one scale per block of its state. A matrix whose 2-D view ``(prod(shape[:-1]),
shape[-1])`` the tile ``R x C`` divides (default 32 x 32) is *tiled*: its blocks are the ``R x C``
tiles, numbered row-major over the tile grid. Every other tensor (1-D, or a matrix the tile does not
divide) has one element per block, so its state is kept at full precision (one fp32 scale per element).

A tile lives on one device when every device's flat range of the tensor starts and ends on a band
edge (a multiple of ``R * cols`` elements): that is what the granularity ``tiles:RxC`` guarantees, so
each device quantizes its own tiles with no metadata communication. A placement that cuts a tile is
rejected with ``TileError`` naming the tensor. Backends read the block of every local element from
here (``block_ids``, ``local_block_ids``, ``block_table``) instead of recomputing offsets.
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
    """The tile grid ``(rows // R, cols // C)`` of a tiled matrix; ``None`` if the tensor is not tiled."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    cols = shape[-1]
    rows = math.prod(shape) // cols
    if rows % tile[0] or cols % tile[1]:
        return None
    return rows // tile[0], cols // tile[1]


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
    """Raise ``TileError`` if a device's flat range ``[start, stop)`` of a tiled matrix cuts a tile.

    Args:
        shape: the tensor's global shape.
        ranges: each device's half-open range of the flattened tensor (``RaggedShard.ranges``).
        name: the tensor's name for the error.
        tile: the tile ``(R, C)``.

    Raises:
        TileError: naming the tensor, the device, its range and the band size; tensors that are not
            tiled are never rejected (their blocks are single elements).
    """
    if tile_grid(shape, tile) is None:
        return
    band = tile[0] * shape[-1]
    for rank, (start, stop) in enumerate(ranges):
        if start < stop and (start % band or stop % band):
            raise TileError(
                f"{name}: device {rank} holds elements [{start}, {stop}) of shape {tuple(shape)}, which cuts "
                f"its {tile[0]}x{tile[1]} quantization tiles (a device must hold whole bands of {band} "
                f"elements); plan this tensor with granularity 'tiles:{tile[0]}x{tile[1]}'"
            )


def block_ids(
    shape: Shape, start: int, stop: int, name: str = "tensor", tile: tuple[int, int] = TILE
) -> np.ndarray:
    """The quantization block of each element of ``[start, stop)`` of the flattened tensor.

    Blocks are numbered from 0 at the first block of the range: tiles row-major over the local bands
    of a tiled matrix, one block per element otherwise.

    Returns:
        An int32 array of ``stop - start`` block ids.

    Raises:
        TileError: the range cuts a tile.
    """
    check_tiles_local(shape, [(start, stop)], name, tile)
    flat = np.arange(start, stop, dtype=np.int64)
    if tile_grid(shape, tile) is None:
        return (flat - start).astype(np.int32)
    cols = shape[-1]
    row, col = flat // cols, flat % cols
    tiles_per_band = cols // tile[1]
    tile_id = (row // tile[0]) * tiles_per_band + col // tile[1]
    first = (start // cols // tile[0]) * tiles_per_band  # the range starts on a band edge
    return (tile_id - first).astype(np.int32)


def local_block_ids(layout: Layout, rank: int, tile: tuple[int, int] = TILE) -> tuple[np.ndarray, int]:
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
        local = block_ids(slot.shape, piece.start, piece.stop, piece.name, tile)
        size = piece.stop - piece.start
        ids[piece.local_offset:piece.local_offset + size] = local + count
        count += int(local.max()) + 1
    return ids, count


class BlockTable(NamedTuple):
    """Every device's block ids, for SPMD code that picks its row with the device index.

    ``ids[d]`` holds device ``d``'s block id per shard element, padding mapped to ``count`` (a spare
    block that collects it), so segment reductions take ``count + 1`` segments.
    """

    ids: np.ndarray  # (world_size, shard_size) int32
    count: int  # the most blocks any device holds


def block_table(layout: Layout, tile: tuple[int, int] = TILE) -> BlockTable:
    """``local_block_ids`` of every device of ``layout`` as one static table (see ``BlockTable``)."""
    rows = [local_block_ids(layout, rank, tile) for rank in range(layout.world_size)]
    count = max(c for _, c in rows)
    table = np.stack([np.where(ids < 0, count, ids) for ids, _ in rows]).astype(np.int32)
    return BlockTable(table, count)
