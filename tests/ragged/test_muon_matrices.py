"""ragged.muon's matrices: which parameters Muon orthogonalizes, and where each matrix of a stack lies.

References: the rule written out per case, and brute force over element indices (each device's interval of
the stack intersected with each matrix's interval).
"""

from __future__ import annotations

import math

import pytest

import ragged
import ragged.muon


@pytest.mark.parametrize("name,shape,count", [
    ("layers.0.feed_forward.experts.gate_up_proj", (8, 64, 96), 8),  # a fused stack: one per expert
    ("layers.0.feed_forward.experts.gate_up_proj_bias", (8, 96), 0),  # E bias vectors, not a matrix
    ("layers.1.feed_forward.experts.down_proj_bias[4:8]", (4, 64), 0),  # a composed EP layout's name
    ("layers.1.feed_forward.experts.down_proj[4:8]", (4, 48, 64), 4),
    ("layers.0.attention.wq.weight", (64, 64), 1),
    ("norm.weight", (64,), 0),
    ("conv.weight", (8, 4, 3, 3), 0),
])
def test_muon_matrices(name, shape, count):
    assert ragged.muon.muon_matrices(name, shape) == count


def _held(ranges, lo, hi):
    """Each device's elements of ``[lo, hi)``, brute force, shifted to start at 0."""
    return [[i - lo for i in range(a, b) if lo <= i < hi] for a, b in ranges]


def test_matrix_placement_is_each_devices_part_of_each_matrix():
    shape = (3, 4, 18)  # 72 elements a matrix
    placement = ragged.RaggedShard((0, 1, 2), (50, 0, 100, 66))
    size = math.prod(shape[1:])
    for e in range(shape[0]):
        got = ragged.muon.matrix_placement(placement, shape, e).ranges(shape[1:])
        want = _held(placement.ranges(shape), e * size, (e + 1) * size)
        assert [list(range(a, b)) for a, b in got] == want, e


def test_matrix_layout_keeps_the_buffer_and_names_each_matrix_of_a_stack():
    layout = ragged.plan([("experts.gate_up_proj", (3, 32, 48), "rows:1"),
                          ("experts.gate_up_proj_bias", (3, 48), "rows:1"), ("w", (48, 32), "rows:1"),
                          ("norm", (7,), "element")], 3)
    matrices = ragged.muon.matrix_layout(layout)
    assert (matrices.world_size, matrices.shard_size, matrices.name) == (3, layout.shard_size, layout.name)
    assert [(t.name, t.shape) for t in matrices.tensors] == [
        ("experts.gate_up_proj[0]", (32, 48)), ("experts.gate_up_proj[1]", (32, 48)),
        ("experts.gate_up_proj[2]", (32, 48)), ("w", (48, 32))]
    stack = layout.slot("experts.gate_up_proj")
    for e in range(3):  # the same buffer elements as the stack's matrix e, on the same devices
        ranges = [(d * layout.shard_size, (d + 1) * layout.shard_size) for d in range(3)]
        lo = stack.offset + e * 32 * 48
        want = _held(ranges, lo, lo + 32 * 48)
        got = matrices.placement(f"experts.gate_up_proj[{e}]").ranges((32, 48))
        assert [list(range(a, b)) for a, b in got] == want, e
    assert matrices.placement("w") == layout.placement("w")
