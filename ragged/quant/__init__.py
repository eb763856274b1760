"""8-bit Adam's quantization in the core: tiles (the blocks that share one scale) and where each
device's tiles are, so every device quantizes its own with no communication.

- ``quant_tile``, ``tile_grid``, ``TILE``: a tensor's tile; ``tile_granularity``: the granularity that
  keeps its tiles whole on every device; ``check_tiles_local`` / ``TileError``: the check;
  ``check_split_tiles``: whether tensor parallelism's even split keeps the tiles whole;
- ``tile_ids``, ``piece_table`` / ``PieceTable``: the tile of every local element, for the runtimes;
- ``ragged.quant.codebook``: the 8-bit codebooks both runtimes load (``SIGNED``, ``UNSIGNED``).
"""

from ragged.quant._tiles import (
    TILE,
    PieceTable,
    TileError,
    check_split_tiles,
    check_tiles_local,
    piece_table,
    quant_tile,
    tile_granularity,
    tile_grid,
    tile_ids,
)

__all__ = [
    "TILE",
    "TileError",
    "quant_tile",
    "tile_grid",
    "tile_granularity",
    "check_tiles_local",
    "check_split_tiles",
    "tile_ids",
    "PieceTable",
    "piece_table",
]
