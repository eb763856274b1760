"""Unit buffers: the JAX side's Layouts are the core planner's, and params <-> buffers is exact."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import ragged
import ragged.models
from jax_backend import LayoutMismatchError, full_params, make_mesh, shard_params
from jax_backend._buffers import check_params, unpack_unit
from jax_backend.models import model_params, parallelize
from ragged import plan_model

UNITS = ragged.models.model_shapes("llama-tiny").units


def rows32(name: str, shape: tuple[int, ...]) -> str:
    """32-row blocks (the paper's 8-bit Adam tiles) for matrices whose rows allow it, else whole rows."""
    if len(shape) < 2:
        return "element"
    return "rows:32" if shape[0] % 32 == 0 else "rows:1"


def core_layouts(world: int, rule) -> list[ragged.Layout]:
    """The reference: the core planner called directly on the preset, tensor by tensor."""
    return [ragged.plan([ragged.TensorSpec(n, s, rule(n, s)) for n, s in u.tensors], world, name=u.name)
            for u in UNITS]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("granularity", ["rows:1", "rows:32"])
def test_layouts_are_the_core_planners(model, world, granularity):
    mesh = make_mesh((world,), ("fsdp",))
    got = parallelize(model, mesh, granularity="rows:1" if granularity == "rows:1" else rows32).layouts
    rule = (lambda n, s: ragged.granularity_for(s, "rows:1")) if granularity == "rows:1" else rows32
    for mine, ref in zip(got, core_layouts(world, rule), strict=True):
        assert mine.to_dict() == ref.to_dict()  # S, offsets, blocks, local_units
        assert [mine.local_pieces(r) for r in range(world)] == [ref.local_pieces(r) for r in range(world)]


@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("granularity", ["rows:1", "rows:32"])
def test_layouts_are_the_torch_backends(model, world, granularity):
    """The torch backend plans each ``fully_shard`` unit of its llama the same way: identical Layouts."""
    import torch

    from torch_backend import plan_module
    from torch_backend.models import Llama as TorchLlama

    with torch.device("meta"):
        torch_model = TorchLlama()
    units = [torch_model.tok_embeddings, *torch_model.layers, [torch_model.norm, torch_model.output]]
    rule = "rows:1" if granularity == "rows:1" else rows32  # one function for both stacks
    mine = parallelize(model, make_mesh((world,), ("fsdp",)), granularity=rule).layouts
    theirs = [plan_module(unit, world, rule, root=torch_model) for unit in units]
    assert [lay.to_dict() for lay in mine] == [lay.to_dict() for lay in theirs]


def numpy_buffer(params: dict, layout: ragged.Layout) -> np.ndarray:
    """Independent reference: a zero buffer with each flattened tensor written at its offset."""
    buf = np.zeros(layout.world_size * layout.shard_size, np.float32)
    for t in layout.tensors:
        buf[t.offset:t.offset + t.numel] = np.asarray(params[t.name]).ravel()
    return buf


@pytest.mark.parametrize("world", [1, 3, 8])
def test_round_trip_is_exact_and_shards_are_the_layouts(model, world):
    mesh = make_mesh((world,), ("fsdp",))
    layouts = plan_model(UNITS, world, granularity=rows32)
    params = model_params(model)
    buffers = shard_params(params, layouts, mesh, "fsdp")
    for layout in layouts:
        buf = buffers[layout.name]
        assert buf.shape == (layout.world_size * layout.shard_size,)
        assert buf.sharding == NamedSharding(mesh, PartitionSpec("fsdp"))
        want = numpy_buffer(params, layout)
        for shard in buf.addressable_shards:
            rank = mesh.devices.tolist().index(shard.device)
            lo, hi = layout.shard_range(rank)
            np.testing.assert_array_equal(np.asarray(shard.data), want[lo:hi])
    back = full_params(buffers, layouts)
    assert list(back) == [t.name for layout in layouts for t in layout.tensors]
    for name, value in params.items():
        assert np.array_equal(np.asarray(back[name]), np.asarray(value)), name


def test_units_of_one_structure_share_their_programs_and_keep_every_tensor_in_place():
    """Twelve tensors in a unit (more than 10: their programs' positional names sort otherwise), planned
    twice under other names: the second model's round trip is exact (numpy's buffer) and compiles no
    program of its own (the conversions are compiled for the structure, not the names)."""
    from jax_backend import _buffers

    mesh = make_mesh((4,), ("fsdp",))
    shapes = [(3 + i, 5) if i % 2 else (7 * i + 1,) for i in range(12)]

    def round_trip(prefix: str, seed: int) -> int:
        layout = ragged.plan([ragged.TensorSpec(f"{prefix}.{i}", s) for i, s in enumerate(shapes)], 4,
                             name=prefix)
        rng = np.random.default_rng(seed)
        params = {t.name: jnp.asarray(rng.standard_normal(t.shape), jnp.float32) for t in layout.tensors}
        buffers = shard_params(params, [layout], mesh, "fsdp")
        np.testing.assert_array_equal(np.asarray(buffers[prefix]), numpy_buffer(params, layout))
        back = full_params(buffers, [layout])
        assert list(back) == list(params)
        for name, value in params.items():
            assert np.array_equal(np.asarray(back[name]), np.asarray(value)), name
        return _buffers._unpacked._cache_size() + _buffers.sharded_program.cache_info().currsize

    compiled = round_trip("first", 0)
    assert round_trip("second", 1) == compiled


def test_thirty_two_row_blocks_stay_on_one_device():
    layouts = plan_model(UNITS, 8, granularity=rows32)
    for layout in layouts:
        for rank in range(8):
            for piece in layout.local_pieces(rank):
                t = layout.slot(piece.name)
                if rows32(t.name, t.shape) == "rows:32":
                    block = 32 * t.shape[1]
                    assert piece.start % block == 0 and (piece.stop % block == 0 or piece.stop == t.numel)


def test_bad_buffers_and_params_raise():
    layouts = plan_model(UNITS[:1], 2)
    with pytest.raises(LayoutMismatchError, match=r"unit 'tok_embeddings': buffer has shape \(7,\)"):
        unpack_unit(jnp.zeros(7), layouts[0])
    with pytest.raises(LayoutMismatchError, match=r"unit 'tok_embeddings': buffer has shape \(7,\)"):
        full_params({"tok_embeddings": jnp.zeros(7)}, layouts)  # named, though its program's layout is not
    with pytest.raises(LayoutMismatchError, match=r"unexpected \['extra.weight'\]"):
        check_params({"tok_embeddings.weight": jnp.zeros((256, 64)), "extra.weight": jnp.zeros(3)}, layouts)
    out = plan_model(UNITS[-1:], 2)
    with pytest.raises(LayoutMismatchError, match=r"unit 'output' mixes dtypes \['bfloat16', 'float32'\]"):
        check_params({"norm.weight": jnp.zeros(64, jnp.bfloat16), "output.weight": jnp.zeros((256, 64))}, out)
    with pytest.raises(LayoutMismatchError, match=r"buffers miss the units \['tok_embeddings'\]"):
        full_params({}, layouts)
