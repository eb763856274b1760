"""ragged.muon's matrices: which parameters Muon orthogonalizes, and where each matrix of a stack lies.

References: the rule written out per case, and brute force over element indices (each device's elements of
the stack, RaggedShard ranges or a tensor-parallel box's runs, intersected with each matrix's interval).
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


def _held(intervals, lo, hi):
    """Each device's elements of ``[lo, hi)`` in its local order, brute force, shifted to start at 0."""
    return [[i - lo for a, b in device for i in range(a, b) if lo <= i < hi] for device in intervals]


def _elements(holdings):
    return [[i for a, b in device for i in range(a, b)] for device in holdings]


@pytest.mark.parametrize("case", ["ragged", "tensor-parallel box"])
def test_matrix_holdings_is_each_devices_part_of_each_matrix(case):
    shape = (3, 4, 18)  # 72 elements a matrix
    if case == "ragged":  # a RaggedShard cutting matrices, and a device holding nothing
        stack = ragged.ragged_holdings(ragged.RaggedShard((0, 1, 2), (50, 0, 100, 66)), shape)
    else:  # Shard(2) over 2 devices (boxes (3, 4, 9)), each box ragged-sharded over 2: runs of 9 elements
        box = (3, 4, 9)
        ranges = ragged.RaggedShard((0, 1, 2), (60, 48)).ranges(box)
        stack = tuple(ragged.box_intervals(shape, (0, 0, 9 * t), box, a, b)
                      for t in range(2) for a, b in ranges)
    size = math.prod(shape[1:])
    for e in range(shape[0]):
        held, local = ragged.muon.matrix_holdings(stack, shape, e)
        assert _elements(held) == _held(stack, e * size, (e + 1) * size), e
        for device, (lo, hi) in zip(_elements(stack), local):  # where the matrix sits among local elements
            assert [i - e * size for i in device[lo:hi]] == _held([[(i, i + 1) for i in device]], e * size,
                                                                  (e + 1) * size)[0], e
    with pytest.raises(IndexError, match="matrix 3 of a stack of 3"):
        ragged.muon.matrix_holdings(stack, shape, 3)


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
        want = _held([[r] for r in ranges], lo, lo + 32 * 48)
        got = matrices.placement(f"experts.gate_up_proj[{e}]").ranges((32, 48))
        assert [list(range(a, b)) for a, b in got] == want, e
    assert matrices.placement("w") == layout.placement("w")
