"""RaggedShard against a numpy reference of the row-major split, and its error paths."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged import PlacementError, RaggedShard


def _reference_ranges(shape, dims, units):
    """Device i holds flat[cum[i] * block : cum[i + 1] * block], block = numel / sum(units)."""
    block = math.prod(shape) // sum(units)
    cum = np.concatenate([[0], np.cumsum(units)])
    return [(int(cum[i] * block), int(cum[i + 1] * block)) for i in range(len(units))]


@st.composite
def placements(draw):
    ndim = draw(st.integers(1, 3))
    k = draw(st.integers(0, ndim))
    world = draw(st.integers(1, 7))
    units = draw(st.lists(st.integers(0, 4), min_size=world, max_size=world).filter(lambda u: sum(u) > 0))
    if k == 0:
        units = [0] * world
        units[draw(st.integers(0, world - 1))] = 1
    inner = [draw(st.integers(1, 3)) for _ in range(ndim - k)]
    # the sharded prefix has a multiple of sum(units) sub-tensors
    outer = []
    if k:
        outer = [sum(units) * draw(st.integers(0, 2))] + [draw(st.integers(1, 3)) for _ in range(k - 1)]
    return tuple(outer + inner), tuple(range(k)), tuple(units)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(placements())
def test_ranges_partition_the_tensor_and_match_the_reference(case):
    shape, dims, units = case
    p = RaggedShard(dims, units)
    got = p.ranges(shape)
    assert list(got) == _reference_ranges(shape, dims, units)
    assert got[0][0] == 0 and got[-1][1] == math.prod(shape)
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    sub = math.prod(shape[len(dims):])
    for rank, (start, stop) in enumerate(got):
        assert start % sub == 0 and stop % sub == 0  # sub-tensors stay whole
        assert p.local_shape(shape, rank) == (stop - start,) == (p.local_numel(shape, rank),)


def test_examples():
    assert RaggedShard((0,), (1, 0, 2)).ranges((6, 4)) == ((0, 8), (8, 8), (8, 24))
    assert RaggedShard((0, 1), (1, 1)).ranges((2, 3)) == ((0, 3), (3, 6))
    assert RaggedShard.whole_on(2, 3).ranges((5, 2)) == ((0, 0), (0, 0), (0, 10))
    assert RaggedShard((0,), (2, 1)).ranges((0, 4)) == ((0, 0), (0, 0))


@pytest.mark.parametrize("dims,units,match", [
    ((1,), (1, 1), r"dims=\(1,\) must be a prefix \(0, ..., k-1\)"),
    ((0, 2), (1,), r"must be a prefix"),
    ((0,), (), "local_units is empty"),
    ((0,), (2, -1, 1), r"negative units on device\(s\) \[1\]"),
    ((0,), (0, 0), "sums to 0"),
    ((0,), (1.5, 1), "must hold ints"),
    ((0.0,), (1,), "must hold ints"),
])
def test_bad_construction(dims, units, match):
    with pytest.raises(PlacementError, match=match):
        RaggedShard(dims, units)


def test_validate_names_the_tensor_and_the_rule():
    with pytest.raises(PlacementError, match="layers.0.wq: RaggedShard local_units has 2 entries but the "
                                             "mesh dim has 3 devices"):
        RaggedShard((0,), (1, 1)).validate((4, 4), "layers.0.wq", world_size=3)
    with pytest.raises(PlacementError, match=r"w: numel 12 of shape \(3, 4\) is not divisible by "
                                             r"sum\(local_units\)=5"):
        RaggedShard((0,), (2, 3)).ranges((3, 4), "w")
    with pytest.raises(PlacementError, match=r"w: a block of 6 elements .* would cut a sub-tensor of 4"):
        RaggedShard((0,), (1, 1)).ranges((3, 4), "w")
    with pytest.raises(PlacementError, match=r"w: RaggedShard dims=\(0, 1, 2\) has more dims than"):
        RaggedShard((0, 1, 2), (1,)).ranges((3, 4), "w")
    with pytest.raises(PlacementError, match="negative dim"):
        RaggedShard((0,), (1,)).ranges((3, -4), "w")
    with pytest.raises(PlacementError, match="rank 3 is outside the 2 devices"):
        RaggedShard((0,), (1, 1)).local_numel((2, 2), 3, "w")
    with pytest.raises(PlacementError, match="device 4 is outside the 3 devices"):
        RaggedShard.whole_on(4, 3)
