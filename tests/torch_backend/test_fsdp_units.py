"""fully_shard's pieces in one process: plan_module, DBuffer views, the FSDPModule API, prefetch.

Planning and DBuffers need no process group. The module API runs on a one-rank gloo group created in
this process (no fork), which is enough to see states, views and prefetch decisions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ragged
import ragged.checkpoint
import ragged.models
import torch_backend
from torch_backend import (
    MixedPrecisionPolicy,
    fully_shard,
    load_dcp_checkpoint,
    plan_module,
    save_dcp_checkpoint,
)
from torch_backend.fsdp import DBuffer, UnitState, units
from torch_backend.models import Llama, cross_entropy, parallelize

UNIT_GROUPS = {
    "tok_embeddings": lambda m: [m.tok_embeddings],
    **{f"layers.{i}": (lambda m, i=i: [m.layers[i]]) for i in range(4)},
    "output": lambda m: [m.norm, m.output],
}


def _meta_llama() -> Llama:
    with torch.device("meta"):
        return Llama()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_plan_module_equals_the_jax_backend_layouts(world):

    model = _meta_llama()
    want = ragged.plan_model(ragged.models.model_shapes("llama-tiny").units, world)
    got = tuple(plan_module(group(model), world, root=model) for group in UNIT_GROUPS.values())
    assert got == want


def test_plan_module_names_and_granularity():
    model = _meta_llama()
    relative = plan_module(model.layers[1], 4)
    assert [t.name for t in relative.tensors][:2] == ["attention.wq.weight", "attention.wk.weight"]
    assert [t.name for t in plan_module([model.norm, model.output], 4).tensors] == ["0.weight", "1.weight"]
    rows16 = plan_module(model.layers[1], 4, "rows:16", root=model)
    for t in rows16.tensors:  # matrices in blocks of 16 whole rows, vectors element-wise
        assert t.block == (16 * t.shape[-1] if len(t.shape) == 2 else 1), t
    seen = []
    by_fn = plan_module(model.layers[1], 4, lambda name, shape: seen.append(name) or "whole")
    assert all(t.block == t.numel for t in by_fn.tensors) and seen[0] == "attention.wq.weight"
    with pytest.raises(ragged.GranularityError, match="feed_forward.w1.weight.*rows:32"):
        plan_module(model.layers[1], 4, "rows:32")  # 176 rows are not a multiple of 32
    with pytest.raises(ValueError, match="not inside root"):
        plan_module(model.layers[1], 4, root=model.layers[0])


def test_dbuffer_views_share_its_storage_and_survive_free():
    layout = ragged.plan([("a", (5, 3), "rows:1"), ("b", (7,)), ("c", (2, 4), "rows:1")], 3, align=1)
    buf = DBuffer(layout, 1, torch.float32, torch.device("cpu"))
    assert not buf.full_allocated
    for piece in layout.local_pieces(1):
        view = buf.shard_view(piece.name)
        assert view.untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr()
        assert view.storage_offset() == piece.local_offset and view.numel() == piece.stop - piece.start
        assert buf.local_range(piece.name) == (piece.start, piece.stop)
    held = {p.name for p in layout.local_pieces(1)}
    for t in layout.tensors:
        if t.name not in held:
            assert buf.shard_view(t.name).numel() == 0
    buf.alloc_full()
    values = torch.arange(layout.total_numel, dtype=torch.float32)
    buf.full.copy_(values)
    for t in layout.tensors:
        assert torch.equal(buf.full_view(t.name).reshape(-1), values[t.offset:t.end])
    buf.free_full()
    assert buf.full.untyped_storage().size() == 0
    buf.alloc_full()
    buf.full.fill_(2.0)
    assert torch.equal(buf.full_view("a"), torch.full((5, 3), 2.0))  # the old views see the new storage


def test_dbuffer_group_ops_run_once_over_the_shard():
    from torch_backend import debug_counter

    layout = ragged.plan([("a", (5, 3), "rows:1"), ("b", (7,))], 2, align=4)
    buf = DBuffer(layout, 0, torch.float32, torch.device("cpu"))
    x = torch.arange(float(layout.shard_size))
    with debug_counter() as c:
        buf.copy_(x)
    assert torch.equal(buf.shard, x) and c.copy_bytes == x.numel() * 4 and c.cast_bytes == 0
    buf.scale_(0.5)
    buf.add_(torch.ones(layout.shard_size))
    expect = x * 0.5 + 1
    assert torch.equal(buf.shard, expect)
    torch.testing.assert_close(buf.norm(3.0), torch.tensor(float(np.linalg.norm(expect.numpy(), 3))))
    assert torch.equal(buf.shard_view("a"), expect[:buf.shard_view("a").numel()])  # views see the ops
    buf.zero_()
    assert not buf.shard.any()
    with debug_counter() as c:
        buf.copy_(x.double())
    assert c.cast_bytes == x.numel() * 4 and c.copy_bytes == 0
    with pytest.raises(KeyError, match="'d'"):
        buf.shard_view("d")


def test_mixed_precision_policy_validates_and_resolves():
    policy = MixedPrecisionPolicy(torch.bfloat16)
    assert policy.compute_dtype(torch.float32) == torch.bfloat16
    assert policy.reduction_dtype(torch.float32) == torch.bfloat16
    assert MixedPrecisionPolicy(torch.bfloat16, torch.float32).reduction_dtype(torch.float32) == torch.float32
    assert MixedPrecisionPolicy().compute_dtype(torch.float32) == torch.float32
    with pytest.raises(TypeError, match="param_dtype"):
        MixedPrecisionPolicy(torch.int32)


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_sharded_parameters_and_gradients_are_views_into_the_buffers(mesh):
    model = parallelize(Llama(), mesh)
    block = model.layers[0]
    unit = units(block)[0]
    x = torch.randint(0, 256, (2, 8))
    cross_entropy(model(x), x).backward()
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    for ref, p in zip(unit.refs, unit.sharded):
        assert getattr(ref.module, ref.attr) is p  # sharded again after backward
        assert storage(p.to_local()) == storage(unit.master.shard)
        assert storage(p.grad.to_local()) == storage(unit.main_grad.shard)
    assert not unit.compute.full_allocated and not unit.grads.full_allocated  # freed after backward


def test_debug_counter_times_the_collective_waits(mesh):
    from torch_backend import debug_counter

    model = parallelize(Llama(), mesh)
    x = torch.randint(0, 256, (2, 8))
    with debug_counter() as idle:
        pass
    with debug_counter() as c:
        cross_entropy(model(x), x).backward()
    assert c.per_label("all_gather") and c.per_label("reduce_scatter")
    assert c.wait_seconds > 0 and idle.wait_seconds == 0


def test_unshard_reshard_and_prefetch(mesh):
    model = parallelize(Llama(), mesh)
    unit = units(model.layers[2])[0]
    assert unit.state is UnitState.SHARDED
    handle = model.layers[2].unshard(async_op=True)
    handle.wait()
    assert unit.state is UnitState.UNSHARDED and unit.compute.full_allocated
    assert type(model.layers[2].attention.wq.weight) is torch.nn.Parameter  # the unsharded view
    model.layers[2].reshard()
    assert unit.state is UnitState.SHARDED and not unit.compute.full_allocated

    seen = {}
    model.layers[0].set_modules_to_forward_prefetch([model.layers[2]])

    def look(*_):
        seen["layers.2 when layers.1 starts"] = (unit.state is UnitState.UNSHARDED
                                                 or unit._pending_all_gather is not None)

    model.layers[1].register_forward_pre_hook(look)
    model(torch.randint(0, 256, (2, 8)))
    assert seen == {"layers.2 when layers.1 starts": True}
    with pytest.raises(TypeError, match="is not sharded"):
        model.layers[0].set_modules_to_backward_prefetch([torch.nn.Linear(2, 2)])


def test_fully_shard_a_list_and_the_root_names_units_by_fqn(mesh):
    model = Llama()
    fully_shard([model.norm, model.output], mesh=mesh)
    assert units(model.output)[0] is units(model.norm)[0]
    assert [r.name for r in units(model.output)[0].refs] == ["0.weight", "1.weight"]
    fully_shard(model, mesh=mesh)
    unit = units(model.output)[0]
    assert unit.name == "output" and [r.name for r in unit.refs] == ["norm.weight", "output.weight"]
    assert unit.layout == plan_module([model.norm, model.output], 1, root=model)


class _Partial(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.used(x))


def test_unused_and_frozen_parameters(mesh):
    """A parameter without a gradient keeps ``grad is None`` (FSDP2's behaviour: optimizers skip it);
    a frozen one gets no gradient at all."""
    torch.manual_seed(0)
    plain = _Partial()
    model = _Partial()
    model.load_state_dict(plain.state_dict())
    fully_shard(model, mesh=mesh)
    x = torch.randn(2, 4)
    for m in (plain, model):
        m(x).sum().backward()
    torch.testing.assert_close(model.used.weight.grad.full_tensor(), plain.used.weight.grad)
    assert model.unused.weight.grad is None and plain.unused.weight.grad is None
    assert model.frozen.weight.grad is None


def test_apply_changing_dtype_rebuilds_the_unit_and_keeps_views(mesh):
    """``model.double()`` (any ``nn.Module._apply``): values kept, parameters are views of a new shard."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), mesh=mesh)
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters()):
            p.to_local().copy_(q.reshape(-1))
    before = list(model.parameters())
    model.double()
    plain.double()
    unit = units(model)[0]
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert list(model.parameters()) == before  # the same parameter objects (an optimizer keeps them)
    for p in model.parameters():
        assert p.dtype == torch.float64 and storage(p.to_local()) == storage(unit.master.shard)
    x = torch.randn(5, 4, dtype=torch.float64)
    model(x).sum().backward()
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q)
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)


def test_dcp_checkpoint_refusals_raise_the_core_checkpoint_error(tmp_path):
    """One checkpoint error for every format: DCP's refusals (before any collective) are ragged's."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ragged.checkpoint.CheckpointError, match="save_dcp_checkpoint: .* exists already"):
        save_dcp_checkpoint(tmp_path, model)
    with pytest.raises(ragged.checkpoint.CheckpointError,
                       match="load_dcp_checkpoint: .* not a complete checkpoint"):
        load_dcp_checkpoint(tmp_path / "missing", model)
    assert torch_backend.CheckpointError is ragged.checkpoint.CheckpointError
