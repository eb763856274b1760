"""Property tests: thousands of random plans, each checked by the independent checker.

Instances mix odd world sizes, zero-size and one-element tensors, element-wise to ``whole``
granularities and align 1, 2, 4, 8. Examples are derandomized so CI sees the same instances.
"""

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragged import Layout, plan
from tests.ragged.checker import check_layout, device_ranges, expected_block
from tests.ragged.planner_instances import instance

FAST = settings(max_examples=1500, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def _plan(tensors, world, align):
    layout = plan(tensors, world, align=align)
    specs = [(n, s, expected_block(s, g)) for n, s, g in tensors]
    return layout, specs


@FAST
@given(instance())
def test_every_plan_passes_the_independent_checker(case):
    tensors, world, align = case
    layout, specs = _plan(tensors, world, align)
    padding = check_layout(layout.to_dict(), specs, world, align)
    assert padding == layout.padding
    used = sum(math.prod(s) for _, s, _ in specs)
    biggest = max((b for _, s, b in specs if math.prod(s)), default=1)
    bound = max(-(-used // world), biggest, 1)  # every element fits, every block fits in a shard
    assert layout.shard_size >= bound and layout.shard_size < bound + max(align, 1) + used + biggest * align


@settings(max_examples=300, deadline=None, derandomize=True)
@given(instance(max_tensors=5, max_world=1100, scale=1000))
def test_large_tensors_and_world_sizes_pass_the_checker(case):
    tensors, world, align = case
    layout, specs = _plan(tensors, world, align)
    check_layout(layout.to_dict(), specs, world, align)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(instance())
def test_json_round_trip(case):
    layout, _ = _plan(*case)
    again = Layout.from_json(layout.to_json())
    assert again == layout
    assert again.to_dict() == layout.to_dict()


@settings(max_examples=400, deadline=None, derandomize=True)
@given(instance())
def test_placements_partition_each_tensor(case):
    """Each tensor's RaggedShard ranges tile [0, numel) in device order and match the buffer."""
    layout, _ = _plan(*case)
    ranges = device_ranges(layout.to_dict())
    for t in layout.tensors:
        got = layout.placement(t.name).ranges(t.shape)
        cursor = 0
        for start, stop in got:
            assert start == cursor and stop >= start
            cursor = stop
        assert cursor == t.numel
        if t.numel:
            assert [r for r in got] == [r if r[1] > r[0] else (got[i][0], got[i][0])
                                        for i, r in enumerate(ranges[t.name])]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(instance(), st.integers(0, 2**31 - 1))
def test_local_pieces_rebuild_every_shard(case, seed):
    """Scatter random tensors into the buffer by offset; each device's pieces must read its shard."""
    layout, _ = _plan(*case)
    rng = np.random.default_rng(seed)
    values = {t.name: rng.standard_normal(t.numel) for t in layout.tensors}
    buffer = np.zeros(layout.total_numel)
    for t in layout.tensors:
        buffer[t.offset:t.end] = values[t.name]
    for rank in range(layout.world_size):
        lo, hi = layout.shard_range(rank)
        shard = buffer[lo:hi]
        rebuilt = np.zeros(layout.shard_size)
        for p in layout.local_pieces(rank):
            rebuilt[p.local_offset:p.local_offset + p.stop - p.start] = values[p.name][p.start:p.stop]
        np.testing.assert_array_equal(rebuilt, shard)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(instance())
def test_plans_are_deterministic(case):
    assert plan(case[0], case[1], align=case[2]) == plan(case[0], case[1], align=case[2])
