"""8-bit AdamW quantized per tile, each tile kept whole on one device.

The math is plain functions over flat local tensors; ``Adam8bit`` is a thin ``torch.optim.Optimizer``
shell that owns the state. Tiles come from the core (``ragged.quant.quant_tile``,
``ragged.quant.check_tiles_local``):
32x32 of matrices the tile divides, one row of other matrices, one element of 1-D tensors (whose
state so stays at full precision). A local slice is whole bands of tiles, so ``to_tiles`` is a reshape
+ permute of the local tensor into ``(tiles, tile numel)`` in the core's tile order, and each device
quantizes its own tiles with no communication.

Quantization (per tile, state stored in tile order) uses the core's dynamic codebooks
(``ragged.quant.codebook``, the same table as the JAX ``adamw8bit``): one fp32 absmax scale per tile and a
uint8 code per element, the nearest entry of

- ``SIGNED`` for the first moment ``m``;
- ``UNSIGNED`` for ``sqrt(v)``, the square root of the second moment (``v = (entry * scale) ** 2``).

Each step dequantizes, updates ``m`` and ``v`` in fp32, computes the AdamW direction from the fp32 values
(as bitsandbytes does) and stores the requantized moments. Every float32 operation on the moments is
written in the JAX transform's order (no fused multiply-add), so both stacks store the same codes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

import ragged
import ragged.quant
from ragged.quant.codebook import BUCKET_SHIFT, SIGNED, UNSIGNED
from torch_backend.optim._params import ParamwiseOptimizer, local_slice, named_params, shard_splits

Tile = tuple[int, int]
_ZERO_M, _ZERO_V = int(SIGNED.values.searchsorted(0.0)), 0  # the codes of 0


# ----- quantization (rows are tiles) -------------------------------------------------------------
class DeviceBook(NamedTuple):
    """A ``Codebook``'s tables as tensors on one device."""

    values: torch.Tensor  # (256,) fp32
    bucket_base: torch.Tensor  # (2**17,) int32
    bucket_threshold: torch.Tensor  # (2**17,) fp32


@functools.cache
def device_book(signed: bool, device: torch.device) -> DeviceBook:
    """``SIGNED`` or ``UNSIGNED`` on ``device``, copied there once."""
    book = SIGNED if signed else UNSIGNED
    return DeviceBook(*(torch.from_numpy(a).to(device) for a in (book.values, book.bucket_base,
                                                                 book.bucket_threshold)))


def quantize(x: torch.Tensor, book: DeviceBook) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tiles, n)`` fp32 -> uint8 codes (nearest ``book`` entry of ``x / absmax``) and the absmax scales.

    The code is the number of thresholds ``<= x / absmax``, read from the codebook's buckets (one table
    look-up and one comparison per element, ``ragged.quant.codebook``). An all-zero tile has scale 0 and the
    code of the entry 0.
    """
    scale = x.abs().amax(dim=1)
    unit = x / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    key = (unit.view(torch.int32) >> BUCKET_SHIFT) & ((1 << (32 - BUCKET_SHIFT)) - 1)
    codes = book.bucket_base.index_select(0, key.view(-1)).view(key.shape)
    codes += unit >= book.bucket_threshold.index_select(0, key.view(-1)).view(key.shape)
    return codes.to(torch.uint8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, book: DeviceBook) -> torch.Tensor:
    """``book.values[codes] * scale`` per tile."""
    return book.values.index_select(0, codes.view(-1).int()).view(codes.shape).mul_(scale[:, None])


def sqrt_rounded(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (XLA's), which torch's vectorized CPU ``sqrt`` misses in
    the last bit for about 0.6% of inputs: numpy's on CPU, else the float64 square root rounded once."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.sqrt(x.contiguous().numpy()))
    return x.double().sqrt().float()


def quantize_m(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(m, device_book(True, m.device))


def dequantize_m(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize(codes, scale, device_book(True, codes.device))


def quantize_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``sqrt(v)``: the scale is ``max sqrt(v)`` of the tile."""
    return quantize(sqrt_rounded(v), device_book(False, v.device))


def dequantize_v(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize(codes, scale, device_book(False, codes.device)).square_()


# ----- tiles of a local slice --------------------------------------------------------------------
def _grid(shape: tuple[int, ...], tile: Tile) -> tuple[int, int, int]:
    """``(tile rows, tiles per band, tile cols)`` of the core's ``quant_tile``."""
    r, c = ragged.quant.quant_tile(shape, tile)
    width = shape[-1] if len(shape) >= 2 else 1
    return r, width // c, c


def to_tiles(flat: torch.Tensor, shape: tuple[int, ...], tile: Tile) -> torch.Tensor:
    """A local flat slice of whole bands (``ragged.quant.check_tiles_local``) -> ``(tiles, tile numel)``.

    Tiles come out in the core's order (``ragged.quant.tile_ids``): bands top to bottom, tiles left to right.
    """
    r, per_band, c = _grid(shape, tile)
    return flat.reshape(-1, r, per_band, c).permute(0, 2, 1, 3).reshape(-1, r * c)


def from_tiles(tiles: torch.Tensor, shape: tuple[int, ...], tile: Tile) -> torch.Tensor:
    """The inverse of ``to_tiles``: ``(tiles, tile numel)`` -> the flat local slice."""
    r, per_band, c = _grid(shape, tile)
    return tiles.reshape(-1, per_band, r, c).permute(0, 2, 1, 3).reshape(-1)


def requantize_moments(m: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...],
                       tile: Tile = ragged.quant.TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``Adam8bit`` reads back after storing fp32 moments: one 8-bit store and load of each.

    Args:
        m, v: fp32 first and second moments of a flat local slice of a parameter of ``shape`` (whole
            bands of tiles, as ``to_tiles`` takes them).
        shape: the parameter's full shape, which decides its tiles (``ragged.quant.quant_tile``).
        tile: the quantization tile ``(R, C)``.

    Returns:
        ``(m, v)`` flat, as ``Adam8bit`` holds them: ``m`` on the ``SIGNED`` codebook and ``sqrt(v)`` on
        the ``UNSIGNED`` one, each tile scaled by its absmax.
    """
    def trip(x: torch.Tensor, quantize_x, dequantize_x) -> torch.Tensor:
        return from_tiles(dequantize_x(*quantize_x(to_tiles(x, shape, tile))), shape, tile)

    return trip(m, quantize_m, dequantize_m), trip(v, quantize_v, dequantize_v)


# ----- the AdamW math --------------------------------------------------------------------------------
def adam_direction(m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, step: int,
                   betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Update the fp32 moments in place; return Adam's direction ``m_hat / (sqrt(v_hat) + eps)``."""
    beta1, beta2 = betas
    m.mul_(beta1).add_(grad * (1 - beta1))  # each product rounded before the sum, as in the JAX transform
    v.mul_(beta2).add_(grad.square() * (1 - beta2))
    return (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt_().add_(eps))


class Adam8bitState(NamedTuple):
    """One parameter's 8-bit state, in tile order (``to_tiles``)."""

    m_codes: torch.Tensor  # (tiles, n) uint8
    m_scale: torch.Tensor  # (tiles,) fp32
    v_codes: torch.Tensor  # (tiles, n) uint8
    v_scale: torch.Tensor  # (tiles,) fp32


def init_state(num_tiles: int, tile_numel: int, device: torch.device) -> Adam8bitState:
    """All-zero moments: scales 0 and the codes of the entry 0."""
    return Adam8bitState(
        torch.full((num_tiles, tile_numel), _ZERO_M, dtype=torch.uint8, device=device),
        torch.zeros(num_tiles, device=device),
        torch.full((num_tiles, tile_numel), _ZERO_V, dtype=torch.uint8, device=device),
        torch.zeros(num_tiles, device=device),
    )


def adam8bit_direction(grad_tiles: torch.Tensor, state: Adam8bitState, step: int,
                       betas: tuple[float, float], eps: float) -> tuple[torch.Tensor, Adam8bitState]:
    """Adam's direction for one parameter's tiles from 8-bit state; returns it and the new state."""
    m = dequantize_m(state.m_codes, state.m_scale)
    v = dequantize_v(state.v_codes, state.v_scale)
    direction = adam_direction(m, v, grad_tiles.float(), step, betas, eps)
    return direction, Adam8bitState(*quantize_m(m), *quantize_v(v))


# ----- the optimizer shell ------------------------------------------------------------------------------
class Adam8bit(ParamwiseOptimizer):
    """AdamW with 8-bit state quantized per 32x32 tile, each tile on one device.

    Works on plain tensors and on RaggedShard DTensors (``fully_shard`` with granularity
    ``tiles:32x32``, ``distribute_tensor(full, mesh, [layout.placement(fqn)])``), tensor-parallel ones
    included (``Shard(dim)`` mesh dims whose split keeps the tiles whole,
    ``ragged.quant.check_split_tiles``: each device then quantizes tiles of its TP part, which are tiles
    of the whole tensor). Every local tile is quantized on its own device, so the sharded optimizer gives
    the same bits as the unsharded one. Weight decay is decoupled (``p -= lr * weight_decay * p``), as in
    ``torch.optim.AdamW``.

    Args:
        params: parameters or ``named_parameters()`` (names appear in errors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        tile: the quantization tile ``(R, C)``.

    Raises:
        ragged.quant.TileError: a placement that cuts a quantization tile (e.g. an element-granularity layout
            of a matrix, or a tensor-parallel split that leaves 16 rows of a 32x32-tiled matrix), raised at
            construction on every rank, naming the parameter (and the split).
        ragged.PlacementError: a placement other than RaggedShard / Shard / Replicate, or an uneven Shard.

    Example:
        >>> opt = Adam8bit(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, tile: Tile = ragged.quant.TILE) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, tile=tile))
        for p, name, group in named_params(self):
            ragged.quant.check_split_tiles(tuple(p.shape), shard_splits(p, name), name, group["tile"])
            where = local_slice(p, name)
            ragged.quant.check_tiles_local(where.box, where.ranges, name, group["tile"])

    def _update(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        tile = group["tile"]
        local, box, _ = local_slice(p, name)
        tiles = to_tiles(local_slice(p.grad, name + ".grad").flat, box, tile)
        state = self.state[p]  # plain tensors under Adam8bitState's field names, so state_dict round-trips
        if not state:
            state.update(step=0, **init_state(tiles.shape[0], tiles.shape[1], local.device)._asdict())
        state["step"] += 1
        current = Adam8bitState(*(state[f] for f in Adam8bitState._fields))
        direction, new = adam8bit_direction(tiles, current, state["step"], group["betas"], group["eps"])
        state.update(new._asdict())
        local.mul_(1 - group["lr"] * group["weight_decay"])
        local.add_(from_tiles(direction, box, tile).to(local.dtype), alpha=-group["lr"])
