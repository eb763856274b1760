"""The RaggedShard placement object, the checkpoint box split and the op rules, in one process (no ranks).

The multi-rank behaviour lives in test_redistribute.py, test_ops.py and test_dcp.py.
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

import ragged
from torch_backend import RaggedShard, UnsupportedRaggedOp
from torch_backend.placement import _dcp, _ops, ragged_mesh_dim

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


# Run in a fresh interpreter: torch's DTensor dispatch before and after each step.
_FIRST_USE = """
import threading
import torch
import torch.distributed as dist
import torch.distributed._state_dict_utils as sd_utils
import torch.distributed.tensor._api as dt_api
import torch.distributed.tensor._redistribute as dt_redistribute
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

def dispatch():
    # everything of torch's that the patches replace, as torch holds it
    return {
        "redistribute_local_tensor": dt_redistribute.redistribute_local_tensor.__code__,
        "distribute_tensor": dt_api.distribute_tensor.__code__,
        "_dtensor_init_helper": dt_api._dtensor_init_helper.__code__,
        "compute_global_tensor_info": dt_api.compute_global_tensor_info,
        "from_local": DTensor.from_local,
        "to_local_backward": dt_api._ToTorchTensor.backward,
        "propagate": ShardingPropagator.propagate_op_sharding_non_cached,
        "propagate_cache": DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding,
        "handlers": dict(DTensor._op_dispatcher._custom_op_handlers),
        "__create_write_items__": DTensor.__create_write_items__,
        "__create_chunk_list__": DTensor.__create_chunk_list__,
        "__get_tensor_shard__": DTensor.__get_tensor_shard__,
        "_distribute_tensors": sd_utils._distribute_tensors,
    }

torch_own = dispatch()
import torch_backend
import torch_backend.fsdp, torch_backend.models, torch_backend.optim
assert dispatch() == torch_own, "importing torch_backend changed DTensor's dispatch"

threads = [threading.Thread(target=torch_backend.RaggedShard, args=((0,), (2,))) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
patched = dispatch()
same = sorted(k for k in torch_own if k != "handlers" and patched[k] is torch_own[k])
assert not same, f"not patched by the first RaggedShard: {same}"
assert patched["handlers"] != torch_own["handlers"]

from torch_backend.placement import _dtensor_patches
# installed once: the originals kept are torch's own (a second install would keep the patches instead)
originals = _dtensor_patches._ORIGINAL
for name in ("redistribute_local_tensor", "distribute_tensor", "_dtensor_init_helper"):
    assert originals[name].__code__ is torch_own[name], name
for name in ("compute_global_tensor_info", "from_local", "to_local_backward", "propagate",
             "_distribute_tensors", "__create_write_items__", "__create_chunk_list__",
             "__get_tensor_shard__"):
    assert originals[name] is torch_own[name], name
torch_backend.RaggedShard((0,), (1,))
assert dispatch() == patched, "a second RaggedShard patched again"

dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
mesh = init_device_mesh("cpu", (1,))
w = torch.arange(6.0).reshape(2, 3)
x = distribute_tensor(w, mesh, [torch_backend.RaggedShard((0,), (2,))])
assert torch.equal(x.full_tensor(), w) and torch.equal(x.to_local(), w.reshape(-1))
print("ok", flush=True)
import os
if dist.is_initialized():
    dist.destroy_process_group()
os._exit(0)  # never finalize while a gloo thread may still free a tensor (experiments/_distributed.py)
"""


def _run_fresh(code: str) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = os.environ | {"PYTHONPATH": repo}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_import_patches_nothing_and_the_first_ragged_shard_patches_once() -> None:
    """``import torch_backend`` leaves DTensor's dispatch as torch has it; the first RaggedShard (eight
    threads racing to build it) installs every patch once, and RaggedShard DTensors then work."""
    _run_fresh(_FIRST_USE)


_IMPORTED_FIRST = """
import os, torch, torch.distributed as dist
from torch.distributed.tensor import distribute_tensor, DTensor, zeros   # before torch_backend
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # one process: no port
mesh = init_device_mesh("cpu", (1,))
import torch_backend
p = torch_backend.RaggedShard((0,), (2,))
w = torch.arange(6.0).reshape(2, 3)
x = distribute_tensor(w, mesh, [p])
assert x.placements == (p,) and torch.equal(x.full_tensor(), w)
assert zeros(2, 3, device_mesh=mesh, placements=[p]).placements == (p,)
patch = redistribute_local_tensor.__kwdefaults__["_ragged_patch"]
assert patch.__module__ == "torch_backend.placement._dtensor_patches"
print("ok", flush=True)
import os
if dist.is_initialized():
    dist.destroy_process_group()
os._exit(0)  # never finalize while a gloo thread may still free a tensor (experiments/_distributed.py)
"""


def test_ragged_shard_works_when_torch_names_were_imported_first() -> None:
    """The patches reach torch functions imported before ``torch_backend`` (their code is rebound)."""
    _run_fresh(_IMPORTED_FIRST)



# DTensor has dispatched every kind of op the patches take over (and cached its sharding decisions)
# before the first RaggedShard: the patches installed then must still reach RaggedShard DTensors.
_USED_FIRST = """
import torch, torch.distributed as dist
import torch.distributed.tensor as dtensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
mesh = init_device_mesh("cpu", (1,))
w = torch.arange(12.0).reshape(3, 4)
s = distribute_tensor(w, mesh, [Shard(0)])
s.sum(1), s.amax(0), torch._foreach_norm([s]), s[0], s.sum().item(), s.redistribute(mesh, [Replicate()])
s.copy_(distribute_tensor(w, mesh, [Shard(0)])), s.uniform_(), (s * 2).full_tensor()
dtensor.zeros(3, 4, device_mesh=mesh, placements=[Shard(0)]), DTensor.from_local(w, mesh, [Replicate()])

from torch_backend import RaggedShard
p = RaggedShard((0,), (3,))
x = distribute_tensor(w, mesh, [p])
assert x.to_local().shape == (12,) and torch.equal(x.full_tensor(), w)
assert torch.equal(x.sum(1).full_tensor(), w.sum(1)) and torch.equal(x.amax(0).full_tensor(), w.amax(0))
assert torch.equal(torch._foreach_norm([x])[0].full_tensor(), torch._foreach_norm([w])[0])
x.copy_(w + 1)
assert torch.equal(x.full_tensor(), w + 1) and torch.equal(x[1].full_tensor(), w[1] + 1)
assert x.sum().item() == float((w + 1).sum()) and torch.equal((x * 2).full_tensor(), (w + 1) * 2)
torch.manual_seed(0)
x.uniform_()
torch.manual_seed(0)
assert torch.equal(x.full_tensor(), torch.empty(3, 4).uniform_())
assert dtensor.zeros(3, 4, device_mesh=mesh, placements=[p]).to_local().shape == (12,)
print("ok", flush=True)
import os
if dist.is_initialized():
    dist.destroy_process_group()
os._exit(0)  # never finalize while a gloo thread may still free a tensor (experiments/_distributed.py)
"""


def test_ragged_shard_works_when_dtensor_ran_ops_before_the_first_ragged_shard() -> None:
    """Patching on first use is late for a process that already ran DTensor ops: they reach it anyway."""
    _run_fresh(_USED_FIRST)
