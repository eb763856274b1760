"""8-bit Adam(W) as optax transformations, with 32x32 quantization tiles that never cross devices.

Every element of every leaf belongs to one quantization tile (``ragged.quant.tile_ids``): the 32x32 tiles of
a matrix the tile divides, one row of another matrix, one element of a 1-D tensor (whose state so stays
at full precision). Quantization uses the core's dynamic codebooks (``ragged.quant.codebook``, the table the
torch ``Adam8bit`` loads): one fp32 absmax scale per tile (a segment max over the tile ids) and a uint8
code per element, the nearest entry of

- ``SIGNED`` for the first moment ``m``;
- ``UNSIGNED`` for ``sqrt(v)``, the square root of the second moment (``v = (entry * scale) ** 2``).

Each step dequantizes, updates ``m`` and ``v`` in fp32, takes Adam's direction from the fp32 values and
stores the requantized moments. The float32 operations on the moments are the torch optimizer's, in its
order, so both stacks store the same codes from the same gradients (tested bit for bit).

Tiles of a leaf come from its ``tiles`` entry: ``WholeTiles`` (default: the leaf is a whole tensor) or
``ShardTiles`` (the leaf is an FSDP unit's local shard inside ``shard_map``: the core's static
``PieceTable`` of every device, indexed by ``lax.axis_index``, so one trace serves all devices). Tiles
are local by construction (granularity ``ragged.quant.tile_granularity``), so no scale or code ever
crosses devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import ragged
import ragged.quant
from ragged import Layout
from ragged.quant.codebook import SIGNED, UNSIGNED, Codebook

Tile = tuple[int, int]
_ZERO_M = int(SIGNED.values.searchsorted(0.0))  # the code of 0 (UNSIGNED: code 0)


# ----- which tile each element belongs to ----------------------------------------------------------
@dataclass(frozen=True)
class WholeTiles:
    """Tiles of a leaf that is a whole tensor of ``shape`` (on one device, or replicated)."""

    shape: tuple[int, ...]
    tile: Tile = ragged.quant.TILE
    _ids: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        numel = int(np.prod(self.shape))
        object.__setattr__(self, "_ids", ragged.quant.tile_ids(self.shape, 0, numel, tile=self.tile))

    @property
    def count(self) -> int:
        """Segments a reduction needs."""
        return int(self._ids.max()) + 1 if self._ids.size else 1

    def ids(self) -> jax.Array:
        return jnp.asarray(self._ids)


def piece_of(offset: jax.Array, length: jax.Array, size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each element ``i < size`` of a shard: its piece ``k``, its index ``j`` there, whether it is in one.

    ``offset`` (ascending) and ``length`` describe the device's pieces (a row of a core table).
    """
    i = jnp.arange(size, dtype=jnp.int32)
    k = jnp.clip(jnp.searchsorted(offset, i, side="right") - 1, 0, offset.shape[0] - 1)
    j = i - offset[k]
    return k, j, (j >= 0) & (j < length[k])


@dataclass(frozen=True)
class ShardTiles:
    """Tiles of one FSDP unit's local shard ``(S,)``, for use inside ``shard_map`` over ``axis``.

    ``table`` is the core's ``PieceTable`` (a few ints per piece and device); each device picks its row
    with ``lax.axis_index`` and derives every element's tile id, padding in the spare tile.
    """

    table: ragged.quant.PieceTable
    axis: str
    shard_size: int

    @property
    def count(self) -> int:
        return self.table.count + 1  # the spare tile collects padding

    def ids(self) -> jax.Array:
        t = self.table
        offset, length, first, width, rows, cols = (jnp.asarray(a)[lax.axis_index(self.axis)] for a in t[:6])
        k, j, inside = piece_of(offset, length, self.shard_size)
        w = width[k]
        tile = first[k] + (j // w // rows[k]) * (w // cols[k]) + (j % w) // cols[k]  # ragged.quant.tile_ids
        return jnp.where(inside, tile, t.count)


def shard_tiles(layouts: Sequence[Layout], axis: str, tile: Tile = ragged.quant.TILE
                ) -> dict[str, ShardTiles]:
    """``{unit: ShardTiles}`` for the FSDP step's local shards (``FSDP.train_step``'s optimizer).

    Raises:
        ragged.quant.TileError: a tensor whose layout cuts a quantization tile (e.g. a matrix planned with
            element granularity), naming it; plan with ``ragged.quant.tile_granularity``.
    """
    return {lay.name: ShardTiles(ragged.quant.piece_table(lay, tile), axis, lay.shard_size)
            for lay in layouts}


# ----- quantization over tile ids -------------------------------------------------------------------
def quantize(x: jax.Array, ids: jax.Array, count: int, book: Codebook) -> tuple[jax.Array, jax.Array]:
    """Flat fp32 values -> uint8 codes (nearest ``book`` entry of ``x / absmax``) and one scale per tile."""
    scale = jnp.maximum(jax.ops.segment_max(jnp.abs(x), ids, num_segments=count), 0.0)  # empty: -inf
    unit = x / jnp.where(scale > 0, scale, 1.0)[ids]
    return jnp.searchsorted(jnp.asarray(book.thresholds), unit, side="right").astype(jnp.uint8), scale


def dequantize(codes: jax.Array, scale: jax.Array, ids: jax.Array, book: Codebook) -> jax.Array:
    """``book.values[codes] * scale`` per element's tile."""
    return jnp.asarray(book.values)[codes.astype(jnp.int32)] * scale[ids]


def _product(x: jax.Array, factor: float) -> jax.Array:
    """``x * factor``, rounded to float32 before the sum it feeds.

    XLA contracts ``a * b + c`` into one fused multiply-add (rounded once) wherever its fusion allows, so
    the last bit of a moment would depend on how each program happens to fuse; torch rounds every product.
    A select cannot be contracted through (a NaN ``x`` gives NaN, as the product would).
    """
    return jnp.where(x == x, x * factor, x)


# ----- the transform ---------------------------------------------------------------------------------
class ScaleByAdam8bitState(NamedTuple):
    """State of ``scale_by_adam8bit``: per leaf, flat 8-bit codes and one fp32 scale per tile."""

    count: jax.Array  # () int32: steps taken
    m_codes: Any  # per leaf (n,) uint8
    m_scale: Any  # per leaf (tiles,) fp32
    v_codes: Any  # per leaf (n,) uint8
    v_scale: Any  # per leaf (tiles,) fp32


def _tiles_for(tree: Any, tiles: Mapping[str, Any] | None, tile: Tile) -> Any:
    """A tree of tile specs with ``tree``'s structure: ``tiles`` as given, else ``WholeTiles``."""
    if tiles is None:
        return jax.tree.map(lambda x: WholeTiles(tuple(x.shape), tile), tree)
    if not isinstance(tree, Mapping) or set(tree) != set(tiles):
        got = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
        raise ValueError(f"scale_by_adam8bit: tiles are given for the units {sorted(tiles)}, but the "
                         f"updates are {got}; pass the FSDP step's {{unit: shard}} dict (or tiles=None)")
    return {k: tiles[k] for k in tree}


def scale_by_adam8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                      tiles: Mapping[str, Any] | None = None,
                      tile: Tile = ragged.quant.TILE) -> optax.GradientTransformation:
    """Rescale updates by Adam's direction, keeping the moments in 8 bits per quantization tile.

    Args:
        b1, b2, eps: as ``optax.scale_by_adam``.
        tiles: ``None`` when the leaves are whole tensors; for the FSDP step's local shards, the
            ``{unit: ShardTiles}`` of ``shard_tiles(layouts, axis)`` (a dict like the updates).
        tile: the quantization tile for ``WholeTiles``.

    Returns:
        An ``optax.GradientTransformation`` whose state is a ``ScaleByAdam8bitState``.
    """

    def init_fn(params: Any) -> ScaleByAdam8bitState:
        specs = _tiles_for(params, tiles, tile)
        m_codes = jax.tree.map(lambda p: jnp.full(p.size, _ZERO_M, jnp.uint8), params)
        v_codes = jax.tree.map(lambda p: jnp.zeros(p.size, jnp.uint8), params)
        scales = jax.tree.map(lambda _, b: jnp.zeros(b.count, jnp.float32), params, specs)
        return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), m_codes, scales, v_codes, scales)

    def update_fn(updates: Any, state: ScaleByAdam8bitState, params: Any = None) -> tuple:
        del params
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        specs = _tiles_for(updates, tiles, tile)

        def leaf(g, mq, ms, vq, vs, spec):
            ids, n = spec.ids(), spec.count
            grad = g.reshape(-1).astype(jnp.float32)
            m = _product(dequantize(mq, ms, ids, SIGNED), b1) + _product(grad, 1 - b1)
            v_old = jnp.square(dequantize(vq, vs, ids, UNSIGNED))
            v = _product(v_old, b2) + _product(jnp.square(grad), 1 - b2)
            direction = (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps)
            return (direction.reshape(g.shape).astype(g.dtype), *quantize(m, ids, n, SIGNED),
                    *quantize(jnp.sqrt(v), ids, n, UNSIGNED))

        out = jax.tree.map(leaf, updates, state.m_codes, state.m_scale, state.v_codes, state.v_scale, specs)
        treedef = jax.tree.structure(updates)
        parts = [treedef.unflatten(p) for p in zip(*treedef.flatten_up_to(out))]
        return parts[0], ScaleByAdam8bitState(count, *parts[1:])

    return optax.GradientTransformation(init_fn, update_fn)


def adamw8bit(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
              weight_decay: float = 1e-4, *, tiles: Mapping[str, Any] | None = None,
              tile: Tile = ragged.quant.TILE) -> optax.GradientTransformation:
    """AdamW with 8-bit tile-quantized moments: ``scale_by_adam8bit``, decoupled weight decay, learning rate.

    Example:
        >>> tiled = lambda name, shape: ragged.quant.tile_granularity(shape)
        >>> fsdp = parallelize(model, mesh, granularity=tiled)
        >>> opt = adamw8bit(1e-3, tiles=shard_tiles(fsdp.layouts, fsdp.axis))
        >>> step = fsdp.train_step(jax_backend.on_shards(opt), loss_fn)

    References:
        Dettmers et al., 8-bit Optimizers via Block-wise Quantization (2022); veScale-FSDP (2026).
    """
    return optax.chain(
        scale_by_adam8bit(b1, b2, eps, tiles=tiles, tile=tile),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
