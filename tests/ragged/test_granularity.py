"""Granularity parsing and block sizes against the definitions, and its error paths."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged import Granularity, GranularityError, block_numel, granularity_for
from tests.ragged.checker import expected_block


@pytest.mark.parametrize("value,text", [
    (1, "element"), ("element", "element"), ("elements", "element"), (12, "12"), ("12", "12"),
    ("rows:16", "rows:16"), (" ROWS:4 ", "rows:4"), ("tiles:32x32", "tiles:32x32"), ("whole", "whole"),
])
def test_parse_round_trips_through_str(value, text):
    g = Granularity.parse(value)
    assert str(g) == text and Granularity.parse(str(g)) == g and Granularity.parse(g) is g


@pytest.mark.parametrize("value,match", [
    (0, "positive number of elements"), (-4, "positive number"), (True, "not an int or a string"),
    (2.5, "not an int or a string"), ("rows", "is not one of"), ("rows:x", "is not one of"),
    ("tiles:4", "is not one of"), ("rows:0", "sizes >= 1"), ("tiles:4x0", "sizes >= 1"),
    ("cols:2", "not one of"),
])
def test_bad_granularities(value, match):
    with pytest.raises(GranularityError, match=match):
        Granularity.parse(value)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=4),
       st.sampled_from(["element", "whole", "1", "2", "3", "4", "rows:1", "rows:2", "rows:3", "tiles:2x2",
                        "tiles:1x3"]))
def test_block_numel_matches_the_definition(shape, g):
    shape = tuple(shape)
    try:
        want = expected_block(shape, g)
    except AssertionError:
        with pytest.raises(GranularityError, match=r"^w: granularity .* does not divide the tensor"):
            block_numel(g, shape, "w")
        return
    assert block_numel(g, shape, "w") == want
    assert math.prod(shape) % want == 0


def test_errors_name_the_tensor():
    with pytest.raises(GranularityError, match=r"experts: granularity rows:16 does not divide the tensor: "
                                               r"its 2-D view has 24 rows"):
        block_numel("rows:16", (2, 12, 8), "experts")
    with pytest.raises(GranularityError, match=r"o: granularity tiles:4x32 .* last dim 48 .* tile width 32"):
        block_numel("tiles:4x32", (8, 48), "o")
    with pytest.raises(GranularityError, match=r"b: granularity 5 does not divide .* numel 12"):
        block_numel(5, (12,), "b")
    with pytest.raises(GranularityError, match="b: shape .* has a negative dim"):
        block_numel(1, (3, -1), "b")


def test_default_rule():
    assert granularity_for((4, 8)) == Granularity("rows", 1)
    assert granularity_for((4, 8, 2), "rows:16") == Granularity("rows", 16)
    assert granularity_for((8,), "rows:16") == Granularity("elements", 1)
    assert block_numel(granularity_for((6, 5), "rows:3"), (6, 5)) == 15
