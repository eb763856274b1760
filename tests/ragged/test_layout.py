"""Layout's own checks and the independent checker reject the same broken layouts."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged import Layout, PlanningError, TensorSlot, plan
from ragged._layout import ShardGrid, basic_lower_bound
from tests.ragged.checker import check_layout


def _data(world, shard, tensors, align=1):
    """A layout's JSON form with local_units derived by hand."""
    out = []
    for name, shape, block, offset in tensors:
        numel = 1
        for d in shape:
            numel *= d
        units = [max(0, min(offset + numel, (d + 1) * shard) - max(offset, d * shard)) // block
                 for d in range(world)]
        if numel == 0:
            units[min(offset // shard, world - 1)] = 1
        out.append({"name": name, "shape": list(shape), "numel": numel, "block": block, "offset": offset,
                    "local_units": units})
    return {"name": "u", "world_size": world, "shard_size": shard, "align": align, "tensors": out}


GOOD = _data(3, 8, [("a", (3, 4), 4, 0), ("b", (5,), 1, 12), ("c", (2, 2), 2, 17)])

BROKEN = [
    ("a block is cut", _data(2, 8, [("a", (3, 4), 4, 2)]), "a: a shard boundary cuts one of its blocks"),
    ("overlap", _data(2, 8, [("a", (4,), 1, 0), ("b", (4,), 1, 2)]), "b: overlaps a"),
    ("past the end", _data(2, 8, [("a", (4,), 1, 14)]), "a: ends at 18, past the buffer"),
    ("misaligned", _data(2, 8, [("a", (4,), 1, 2)], align=4),
     "a: offset 2 is not a non-negative multiple of 4"),
    ("shard not aligned", _data(2, 6, [("a", (4,), 1, 0)], align=4),
     "shard_size 6 must be a positive multiple"),
    ("block does not divide", _data(2, 8, [("a", (6,), 4, 0)]), "a: block 4 does not divide numel 6"),
    ("two shards, block does not divide S", _data(4, 6, [("a", (18,), 9, 3)]), "a: a shard boundary cuts"),
    ("no devices", {**_data(1, 8, []), "world_size": 0}, "world_size 0 must be >= 1"),
]


def test_good_layout_passes_both():
    layout = Layout.from_dict(GOOD)
    assert check_layout(GOOD) == layout.padding == 24 - 21
    assert layout.to_dict() == GOOD


@pytest.mark.parametrize("label,data,match", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_layouts_are_rejected_by_both(label, data, match):
    with pytest.raises(PlanningError, match=match):
        Layout.from_dict(data)
    with pytest.raises(AssertionError):
        check_layout(data)


def test_duplicate_names():
    with pytest.raises(PlanningError, match=r"duplicate tensor names \['a'\]"):
        Layout(2, 8, (TensorSlot("a", (2,), 1, 0), TensorSlot("a", (2,), 1, 4)))


def test_json_derived_fields_are_checked():
    tampered = json.loads(json.dumps(GOOD))
    tampered["tensors"][0]["local_units"] = [1, 2, 0]
    with pytest.raises(PlanningError, match=r"a: local_units \[1, 2, 0\] do not match the offsets"):
        Layout.from_dict(tampered)
    tampered = json.loads(json.dumps(GOOD))
    tampered["tensors"][1]["numel"] = 6
    with pytest.raises(PlanningError, match="b: numel 6 does not match shape"):
        Layout.from_dict(tampered)
    missing = json.loads(json.dumps(GOOD))
    del missing["tensors"][2]["offset"]
    with pytest.raises(PlanningError, match="lacks the key 'offset'"):
        Layout.from_dict(missing)


def test_lookups():
    layout = Layout.from_dict(GOOD)
    assert layout.local_units("a") == (2, 1, 0)
    assert layout.placement("a").ranges((3, 4)) == ((0, 8), (8, 12), (12, 12))
    assert layout.placement("c").dims == (0,)
    assert [tuple(p) for p in layout.local_pieces(1)] == [("a", 8, 12, 0), ("b", 0, 4, 4)]
    assert layout.shard_range(2) == (16, 24)
    with pytest.raises(PlanningError, match="rank 3 is outside world size 3"):
        layout.shard_range(3)
    with pytest.raises(KeyError, match="'zz' is not in layout 'u'"):
        layout.slot("zz")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([1, 2, 3, 4, 6, 8])), max_size=6),
       st.integers(1, 9), st.sampled_from([1, 2, 4]), st.integers(0, 200))
def test_shard_grid_is_the_set_of_structurally_valid_sizes(items, world, align, start):
    """next_valid(x) is the first size >= x that is aligned and divisible by every block of a
    tensor of two shards or more (checked by direct search)."""
    items = [(k * g, g) for k, g in items]

    def valid(s):
        return s % align == 0 and all(s % g == 0 for e, g in items if e >= 2 * s)
    want = next(s for s in range(max(start, 1), 10**6) if valid(s))
    assert ShardGrid.build(items, align).next_valid(start) == want
    bound = basic_lower_bound(items, world, align)
    assert plan([(f"t{i}", (e,), g) for i, (e, g) in enumerate(items)], world, align=align).lower_bound \
        == ShardGrid.build(items, align).next_valid(bound)
