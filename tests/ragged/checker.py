"""An independent checker of planned layouts, written from the problem statement alone.

It reads a layout in its JSON form (``Layout.to_dict()``) and never calls the planner, ``Layout``'s
own checks or ``Granularity``: blocks are recomputed here from the granularity's definition, the
buffer is painted element by element with numpy when it is small, and every rule is tested directly:

- one buffer of ``world_size * shard_size`` elements, ``shard_size`` a positive multiple of ``align``;
- each tensor one interval ``[offset, offset + numel)`` inside it, ``offset`` a multiple of ``align``,
  tensors pairwise disjoint (so padding lies only between tensors);
- every shard boundary ``k * shard_size`` strictly inside a tensor is one of its block edges;
- ``local_units[d]`` is the number of the tensor's blocks inside device ``d``'s shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

PAINT_LIMIT = 1 << 22  # buffers up to this many elements are painted element by element


def expected_block(shape: Sequence[int], granularity: int | str) -> int:
    """The block in elements, from the definitions: N elements, ``element``, ``rows:N`` (N rows of the
    ``(prod(shape[:-1]), shape[-1])`` view), ``tiles:RxC`` (R rows, C dividing the last dim),
    ``whole``. Returns 1 for an empty tensor; raises ``AssertionError`` if it does not divide."""
    numel = math.prod(shape)
    if numel == 0:
        return 1
    g = str(granularity)
    if g == "whole":
        return numel
    if g == "element":
        return 1
    if g.isdigit():
        assert numel % int(g) == 0
        return int(g)
    cols = shape[-1] if shape else 1
    kind, _, size = g.partition(":")
    rows = int(size.split("x")[0])
    if kind == "tiles":
        assert cols % int(size.split("x")[1]) == 0
    assert (numel // cols) % rows == 0
    return rows * cols


def device_ranges(data: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """For each tensor, each device's range of the tensor's flat storage (``(0, 0)`` when none)."""
    m, s = data["world_size"], data["shard_size"]
    out = {}
    for t in data["tensors"]:
        lo, numel = t["offset"], math.prod(t["shape"])
        ranges = []
        for d in range(m):
            a, b = max(lo, d * s), min(lo + numel, (d + 1) * s)
            ranges.append((a - lo, b - lo) if a < b else (0, 0))
        out[t["name"]] = ranges
    return out


def check_layout(data: dict[str, Any], specs: Sequence[tuple[str, Sequence[int], int]] | None = None,
                 world_size: int | None = None, align: int | None = None) -> int:
    """Assert that ``data`` (a layout as ``to_dict()`` gives it) is valid; return its padding.

    Args:
        data: the layout's JSON form.
        specs: the request, ``(name, shape, block)`` per tensor in order, if it should be matched.
        world_size, align: the request's, if they should be matched.
    """
    m, s, a = data["world_size"], data["shard_size"], data["align"]
    assert m >= 1 and a >= 1, (m, a)
    assert s >= 1 and s % a == 0, f"shard size {s} is not a positive multiple of align {a}"
    if world_size is not None:
        assert m == world_size, (m, world_size)
    if align is not None:
        assert a == align, (a, align)
    tensors = data["tensors"]
    if specs is not None:
        assert [t["name"] for t in tensors] == [n for n, _, _ in specs], "tensors renamed or reordered"
        for t, (name, shape, block) in zip(tensors, specs):
            assert tuple(t["shape"]) == tuple(shape), (name, t["shape"], shape)
            assert t["block"] == block, (name, t["block"], block)
    total = m * s
    for t in tensors:
        name, numel, block, lo = t["name"], math.prod(t["shape"]), t["block"], t["offset"]
        assert t["numel"] == numel, (name, t["numel"], numel)
        assert block >= 1 and numel % block == 0, (name, numel, block)
        assert lo >= 0 and lo % a == 0, f"{name}: offset {lo} not a non-negative multiple of {a}"
        assert lo + numel <= total, f"{name}: [{lo}, {lo + numel}) leaves the buffer of {total}"
        for k in range(lo // s + 1, (lo + numel - 1) // s + 1 if numel else 0):
            if lo < k * s < lo + numel:
                assert (k * s - lo) % block == 0, f"{name}: boundary {k * s} cuts a block of {block}"
        units = t["local_units"]
        assert len(units) == m, (name, units)
        held = [max(0, min(lo + numel, (d + 1) * s) - max(lo, d * s)) for d in range(m)]
        if numel:
            assert all(h % block == 0 for h in held), (name, held, block)
            assert list(units) == [h // block for h in held], (name, units, held)
        else:
            assert sorted(units) == [0] * (m - 1) + [1], f"{name}: empty tensor units {units}"
    _check_disjoint(tensors, total)
    return total - sum(math.prod(t["shape"]) for t in tensors)


def _check_disjoint(tensors: list[dict[str, Any]], total: int) -> None:
    """Paint the buffer (small ones) or compare sorted neighbours (large ones)."""
    live = [t for t in tensors if math.prod(t["shape"])]
    if total <= PAINT_LIMIT:
        count = np.zeros(total + 1, dtype=np.int64)
        for t in live:
            count[t["offset"]] += 1
            count[t["offset"] + math.prod(t["shape"])] -= 1
        assert np.cumsum(count).max(initial=0) <= 1, "two tensors overlap"
        return
    spans = sorted((t["offset"], t["offset"] + math.prod(t["shape"]), t["name"]) for t in live)
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        assert end <= start, f"{name} overlaps {other}"
