"""The RaggedShard placement object, the checkpoint box split and the op rules, in one process (no ranks).

The multi-rank behaviour lives in test_redistribute_torch.py, test_ops_torch.py and test_dcp_torch.py.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.tensor._redistribute as dt_redistribute
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

import ragged
import torch_backend
from torch_backend import RaggedShard, UnsupportedRaggedOp
from torch_backend.placement import _dcp, _dtensor_hooks, _ops, ragged_mesh_dim

aten = torch.ops.aten


def test_is_a_placement_with_value_semantics() -> None:
    p = RaggedShard([0], [1, 0, 2])
    assert isinstance(p, Placement)
    assert p == RaggedShard((0,), (1, 0, 2)) and hash(p) == hash(RaggedShard((0,), (1, 0, 2)))
    assert p != RaggedShard((0,), (2, 0, 1)) and p != Shard(0) and p != Replicate()
    assert pickle.loads(pickle.dumps(p)) == p
    assert not (p.is_shard() or p.is_replicate() or p.is_partial())
    assert p.core == ragged.RaggedShard((0,), (1, 0, 2))
    assert RaggedShard.whole_on(2, 3) == RaggedShard((), (0, 0, 1))


@pytest.mark.parametrize(
    ("dims", "units", "needle"),
    [((1,), (1, 1), "prefix"), ((0,), (), "empty"), ((0,), (1, -1), "negative"), ((0,), (0, 0), "sums to 0")],
)
def test_bad_placements_name_the_rule(dims, units, needle) -> None:
    with pytest.raises(ragged.PlacementError, match=needle):
        RaggedShard(dims, units)


def test_one_ragged_mesh_dim_only() -> None:
    p = RaggedShard((0,), (1, 1))
    assert ragged_mesh_dim((Shard(0), p)) == 1
    with pytest.raises(ragged.PlacementError, match="one mesh dim"):
        ragged_mesh_dim((p, p), "w")


@pytest.mark.parametrize("shape", [(3, 4), (7,), (2, 3, 4), (5, 3, 6, 7), (1, 5, 1)])
def test_flat_range_boxes_tile_the_range_in_order(shape) -> None:
    numel = math.prod(shape)
    index = np.arange(numel).reshape(shape)
    step = max(1, numel // 40)
    for start in range(0, numel + 1, step):
        for stop in range(start, numel + 1, step):
            boxes = _dcp.flat_range_boxes(shape, start, stop)
            covered = [
                int(i) for o, s in boxes for i in index[tuple(slice(a, a + b) for a, b in zip(o, s))].ravel()
            ]
            assert covered == list(range(start, stop)), (start, stop, boxes)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_chunks_are_views_of_the_flat_local() -> None:
    local = torch.arange(9.0)
    pieces = _dcp.chunks((3, 4), (10, 0), 2, 11)
    assert [c.offsets for c in pieces] == [(10, 2), (11, 0), (12, 0)]
    view = _dcp.chunk_view(local, pieces[1])
    view.fill_(-1)
    assert local[2:6].eq(-1).all() and view.shape == (1, 4)


def _rs(units=(2, 1)) -> RaggedShard:
    return RaggedShard((0,), units)


def test_rules_keep_ragged_for_elementwise_and_reshard_replicate() -> None:
    x = _ops.Operand((3, 4), (_rs(),))
    rep = _ops.Operand((3, 4), (Replicate(),))
    scalar = _ops.Operand((), (Replicate(),))
    rule = _ops.rule(aten.add.Tensor, (x, rep), {}, (3, 4))
    assert rule.outputs == [(_rs(),)] and rule.reshard == {1: (_rs(),)}
    assert _ops.rule(aten.mul.Tensor, (x, scalar), {}, (3, 4)).reshard == {}
    assert _ops.rule(aten.sum.default, (x,), {}, ()).outputs == [(Partial("sum"),)]
    norms = _ops.rule(aten._foreach_norm.Scalar, ([x, _ops.Operand((5,), (Shard(0),))], 2), {}, [(), ()])
    assert norms.outputs == [(_ops.PartialNorm(2.0),), (_ops.PartialNorm(2.0),)]


@pytest.mark.parametrize(
    ("op", "args", "needle"),
    [
        (aten.mm.default, "x_w", "aten.mm.default"),
        (aten.add.Tensor, "x_y", "must share"),
        (aten.add.Tensor, "x_row", "(4,)"),
        (aten.add.Tensor, "x_partial", "Partial"),
        (aten.copy_.default, "rep_x", "in-place"),
    ],
)
def test_unsupported_rules_name_op_and_placement(op, args, needle) -> None:
    x = _ops.Operand((3, 4), (_rs(),))
    others = {
        "x_w": (x, _ops.Operand((4, 5), (Replicate(),))),
        "x_y": (x, _ops.Operand((3, 4), (_rs((1, 2)),))),
        "x_row": (x, _ops.Operand((4,), (Replicate(),))),
        "x_partial": (x, _ops.Operand((3, 4), (Partial(),))),
        "rep_x": (_ops.Operand((3, 4), (Replicate(),)), x),
    }
    with pytest.raises(UnsupportedRaggedOp) as err:
        _ops.rule(op, others[args], {}, (3, 4))
    assert needle in str(err.value) and "RaggedShard(dims=(0,)" in str(err.value)


def test_hooks_are_installed_once_on_this_torch() -> None:
    """The hooked torch functions are ours, and registering again changes nothing."""
    before = (dt_redistribute.redistribute_local_tensor, DTensor.__create_write_items__)
    _dtensor_hooks.register()
    assert (dt_redistribute.redistribute_local_tensor, DTensor.__create_write_items__) == before
    # torch's own function objects run the hooks (whoever holds a reference to them).
    hooked = dt_redistribute.redistribute_local_tensor.__kwdefaults__["_ragged_hook"]
    assert hooked is _dtensor_hooks._redistribute_local_tensor
    hooked = torch.distributed.tensor.distribute_tensor.__kwdefaults__["_ragged_hook"]
    assert hooked is _dtensor_hooks._distribute_tensor
    handlers = DTensor._op_dispatcher._custom_op_handlers
    assert all(handlers[op] is _dtensor_hooks._reduction_handler for op in _ops.REDUCTIONS_WITH_DIM)
    assert all(handlers[op] is _dtensor_hooks._random_fill_handler for op in _ops.RANDOM_FILLS)
    assert {"RaggedShard", "UnsupportedRaggedOp"} <= set(torch_backend.__all__)
