"""Redistribution plans executed in numpy must rebuild the destination placement exactly."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged import (
    PlacementError,
    RaggedShard,
    box_intervals,
    chunk_sizes,
    ragged_holdings,
    replicate_holdings,
    shard_holdings,
    transfers,
)


def _local(flat, intervals):
    return np.concatenate([flat[a:b] for a, b in intervals]) if intervals else flat[:0]


def _reference_shard(full, dim, world):
    """Shard(dim) by torch.chunk's rule, via numpy: chunks of ceil(n / m) along dim."""
    size = full.shape[dim]
    step = -(-size // world) if size else 0
    return [np.take(full, range(min(i * step, size), min((i + 1) * step, size)), axis=dim).reshape(-1)
            for i in range(world)]


@st.composite
def placement_of(draw, shape, world):
    kind = draw(st.sampled_from(["ragged", "shard", "replicate"]))
    numel = math.prod(shape)
    if kind == "replicate":
        return replicate_holdings(numel, world)
    if kind == "shard":
        return shard_holdings(shape, draw(st.integers(0, len(shape) - 1)), world)
    rows = shape[0]
    divisors = [d for d in range(1, rows + 1) if rows % d == 0] or [1]
    total = draw(st.sampled_from(divisors))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    units = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    if sum(units) == 0:
        units[0] = 1
    return ragged_holdings(RaggedShard((0,), tuple(units)), shape)


@st.composite
def redistribution(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    world = draw(st.integers(1, 5))
    return shape, world, draw(placement_of(shape, world)), draw(placement_of(shape, world))


@settings(max_examples=500, deadline=None, derandomize=True)
@given(redistribution(), st.integers(0, 2**31 - 1))
def test_transfers_rebuild_the_destination(case, seed):
    shape, world, src, dst = case
    flat = np.random.default_rng(seed).standard_normal(math.prod(shape))
    src_local = [_local(flat, h) for h in src]
    out = [np.full(sum(b - a for a, b in h), np.nan) for h in dst]
    written = [np.zeros(len(o), dtype=int) for o in out]
    for t in transfers(src, dst):
        into = slice(t.dst_offset, t.dst_offset + t.length)
        out[t.dst][into] = src_local[t.src][t.src_offset:t.src_offset + t.length]
        written[t.dst][into] += 1
    for d in range(world):
        np.testing.assert_array_equal(out[d], _local(flat, dst[d]))
        assert (written[d] == 1).all()  # every element arrives exactly once


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=3), st.integers(1, 6))
def test_shard_holdings_match_torch_chunk_rule(shape, world):
    shape = tuple(shape)
    full = np.arange(math.prod(shape)).reshape(shape)
    for dim in range(len(shape)):
        got = [_local(full.reshape(-1), h) for h in shard_holdings(shape, dim, world)]
        for g, want in zip(got, _reference_shard(full, dim, world)):
            np.testing.assert_array_equal(g, want)


def test_replicated_source_prefers_local_copies():
    src = replicate_holdings(6, 2)
    dst = ragged_holdings(RaggedShard((0,), (1, 2)), (3, 2))
    assert all(t.src == t.dst for t in transfers(src, dst))


def test_chunk_sizes():
    assert chunk_sizes(10, 4) == (3, 3, 3, 1)
    assert chunk_sizes(2, 4) == (1, 1, 0, 0)
    with pytest.raises(PlacementError, match="world_size >= 1"):
        chunk_sizes(4, 0)


def test_errors():
    with pytest.raises(PlacementError, match="source holdings cover 2 devices and the destination 3"):
        transfers(replicate_holdings(4, 2), replicate_holdings(4, 3))
    with pytest.raises(PlacementError, match=r"elements \[\(2, 4\)\] wanted by device 0 are held by no"):
        transfers((((0, 2),),), (((0, 4),),))
    with pytest.raises(PlacementError, match=r"Shard\(2\) is out of range for shape \(3, 4\)"):
        shard_holdings((3, 4), 2, 2)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.data())
def test_box_intervals_are_the_box_range_in_the_whole_storage(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    box = tuple(data.draw(st.integers(0, n)) for n in shape)
    offset = tuple(data.draw(st.integers(0, n - b)) for n, b in zip(shape, box))
    numel = math.prod(box)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    full = np.arange(math.prod(shape)).reshape(shape)
    want = full[tuple(slice(o, o + b) for o, b in zip(offset, box))].reshape(-1)[start:stop]  # brute force
    got = box_intervals(shape, offset, box, start, stop)
    np.testing.assert_array_equal(_local(full.reshape(-1), got), want)
    assert all(a < b for a, b in got) and all(b <= c for (_, b), (c, _) in zip(got, got[1:]))  # sorted
    with pytest.raises(PlacementError, match="does not lie in shape"):
        box_intervals(shape, offset, tuple(n + 1 for n in shape), 0, 0)  # larger than the tensor
