"""The 8-bit codebooks of 8-bit Adam's state: one numpy table that the torch and the JAX optimizers load.

A block's values are divided by the block's absmax scale (into [-1, 1]) and each is stored as the index
of the nearest codebook entry. The codebooks are *dynamic* (Dettmers 2016, the bitsandbytes and torchao
8-bit optimizers): a decimal exponent in unary followed by a linear fraction, so they span seven orders of
magnitude below the block's maximum with about two significant digits each. A linear code (``round(x *
127)``) instead sends every value under 1/254 of the block's maximum to 0; in a 32x32 tile most Adam
moments are that small, and a second moment of 0 makes Adam divide by ``eps`` (docs/optimizers.md).

- ``SIGNED``: the first moment ``m`` (256 entries in [-1, 1], with 0 and 1);
- ``UNSIGNED``: the square root of the second moment, ``sqrt(v)`` (256 entries in [0, 1], with 0 and 1);
  storing the root halves the decades to cover, so only ``v`` below ``1e-14`` of the block's maximum is 0.

Both stacks quantize with the same float32 operations: ``x = value / scale``, the code is the number of
``thresholds`` (float32 midpoints between neighbouring entries) that are ``<= x``, and the value read back
is ``values[code] * scale``. Comparisons are exact, so equal inputs give equal codes on either stack.

That count needs no search: ``buckets`` splits the float32 line by the top ``32 - BUCKET_SHIFT`` bits of
``x`` (sign, exponent, 8 mantissa bits: 0.4% wide, narrower than any gap between thresholds), so a bucket
holds at most one threshold, and the code is ``bucket_base[key] + (x >= bucket_threshold[key])``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

DECADES = 7
BUCKET_SHIFT = 15  # key = float32 bits >> 15: 2**17 buckets


class Codebook(NamedTuple):
    """A sorted 256-entry codebook, its rounding thresholds and their bucket tables (float32)."""

    values: np.ndarray  # (256,) float32, ascending
    thresholds: np.ndarray  # (255,) float32: midpoints; code = #thresholds <= x (ties round up)
    bucket_base: np.ndarray  # (2**17,) int32: the code of the lowest float32 whose bits >> 15 are the key
    bucket_threshold: np.ndarray  # (2**17,) float32: the bucket's one threshold above that, else +inf


def dynamic_values(signed: bool) -> np.ndarray:
    """The dynamic-tree codebook of bitsandbytes' ``create_dynamic_map`` (without its zero padding).

    Decade ``i`` (``10**(i - 6)`` to ``10**(i - 5)``, i = 0..6) holds the midpoints of ``2**i`` (signed)
    or ``2**(i + 1)`` (unsigned) equal steps over ``[0.1, 1]`` times ``10**(i - 6)``, mirrored for the
    signed codebook: 127 (signed: 2 x 127) entries, then 0 and 1. Finer steps for the larger decades.

    Returns:
        256 ascending float32 values.
    """
    data: list[float] = [0.0, 1.0]
    for i in range(DECADES):
        edges = np.linspace(0.1, 1.0, (2**i if signed else 2 ** (i + 1)) + 1)
        means = 10.0 ** (i - DECADES + 1) * (edges[:-1] + edges[1:]) / 2
        data += list(means) + (list(-means) if signed else [])
    assert len(data) == 256, len(data)
    return np.sort(np.asarray(data, dtype=np.float64)).astype(np.float32)


def buckets(thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(bucket_base, bucket_threshold)``: for every float32 bit pattern's key ``bits >> BUCKET_SHIFT``,
    the number of ``thresholds`` at or below the bucket's lowest float and the one threshold inside it.

    Raises:
        ValueError: two thresholds in one finite bucket (a codebook finer than the buckets).
    """
    keys = np.arange(1 << (32 - BUCKET_SHIFT), dtype=np.uint32) << BUCKET_SHIFT
    ends = keys.view(np.float32), (keys | ((1 << BUCKET_SHIFT) - 1)).view(np.float32)
    low, high = np.minimum(*ends), np.maximum(*ends)  # a negative bucket's first bits are its largest value
    with np.errstate(invalid="ignore"):
        base = np.searchsorted(thresholds, low, side="right")
        inside = np.searchsorted(thresholds, high, side="right") - base  # NaN buckets: 0
    if inside.max() > 1:
        raise ValueError(f"a bucket of 2**{BUCKET_SHIFT} float32 values holds {inside.max()} thresholds; "
                         "lower BUCKET_SHIFT")
    threshold = np.where(inside == 1, thresholds[np.minimum(base, len(thresholds) - 1)], np.inf)
    return base.astype(np.int32), threshold.astype(np.float32)


def codebook(values: np.ndarray) -> Codebook:
    """``values``, the float32 midpoints between neighbours (computed in float64, then rounded), and
    their bucket tables."""
    v64 = values.astype(np.float64)
    thresholds = ((v64[:-1] + v64[1:]) / 2).astype(np.float32)
    return Codebook(values, thresholds, *buckets(thresholds))


SIGNED = codebook(dynamic_values(signed=True))
UNSIGNED = codebook(dynamic_values(signed=False))
