"""Ragged redistribution in JAX (to one device, to every device, to row blocks, and back) against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ragged
import ragged.models
from jax_backend import make_mesh, shard_map
from jax_backend._redistribute import gather_rows, gather_tensor, scatter_rows, scatter_tensor
from ragged import plan_model

UNIT = ragged.models.model_shapes("llama-tiny").units[1]  # layers.0: nine tensors of five shapes


def rows32(name: str, shape: tuple[int, ...]) -> str:
    return "rows:32" if len(shape) == 2 and shape[0] % 32 == 0 else ragged.granularity_for(shape, "rows:1")


@pytest.mark.parametrize("world, granularity", [(1, "rows:1"), (3, "rows:1"), (4, rows32), (8, "rows:1")])
def test_gather_and_scatter_match_numpy(world, granularity):
    (layout,) = plan_model([UNIT], world, granularity=granularity)
    mesh = make_mesh((world,), ("fsdp",))
    rng = np.random.default_rng(world)
    buffer = rng.standard_normal(layout.total_numel).astype(np.float32)  # padding holds junk on purpose
    names = [t.name for t in layout.tensors]
    ns_devices = {name: i % world for i, name in enumerate(names)}  # spread as Muon balances load
    new = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in layout.tensors}

    def body(local, new):
        rank = jax.lax.axis_index("fsdp")
        out = {}
        for name in names:
            on_device = gather_tensor(local, layout, name, "fsdp", device=ns_devices[name])
            everywhere = gather_tensor(local, layout, name, "fsdp")
            # The other devices' copies of the input are garbage: the scatter must read the NS device's only.
            from_device = jnp.where(rank == ns_devices[name], new[name], jnp.nan)
            out[name] = (on_device[None], everywhere[None],
                         scatter_tensor(from_device, local, layout, name, "fsdp", device=ns_devices[name]),
                         scatter_tensor(new[name], local, layout, name, "fsdp"))
        return out

    spec = {n: (P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp")) for n in names}
    run = jax.jit(shard_map(body, mesh, in_specs=(P("fsdp"), P()), out_specs=spec))
    got = run(buffer, new)
    for t in layout.tensors:
        want = buffer[t.offset:t.end].reshape(t.shape)
        on_device, everywhere, from_device, from_all = (np.asarray(x) for x in got[t.name])
        for rank in range(world):
            np.testing.assert_array_equal(on_device[rank], want if rank == ns_devices[t.name] else 0 * want)
            np.testing.assert_array_equal(everywhere[rank], want)
        written = buffer.copy()
        written[t.offset:t.end] = new[t.name].ravel()
        np.testing.assert_array_equal(from_device, written)
        np.testing.assert_array_equal(from_all, written)


def test_gather_and_scatter_rows_match_numpy():
    """Uneven row blocks of two rows each on 3 of 4 devices (split Newton-Schulz gives ``rows / g`` to
    each member of its group, and nothing to the others)."""
    world = 4
    (layout,) = plan_model([UNIT], world, granularity=rows32)
    mesh = make_mesh((world,), ("fsdp",))
    rng = np.random.default_rng(0)
    buffer = rng.standard_normal(layout.total_numel).astype(np.float32)
    matrices = [t for t in layout.tensors if len(t.shape) == 2]
    halves = {t.name: t.shape[0] // 2 for t in matrices}  # blocks of two rows
    units = {n: (h // 2, 0, h // 4, h - h // 2 - h // 4) for n, h in halves.items()}
    rows = {n: ragged.RaggedShard((0,), u) for n, u in units.items()}
    starts = {n: 2 * np.cumsum((0, *u)) for n, u in units.items()}
    new = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in matrices}

    def block(name, rank):  # the rows ``rank`` holds, padded with NaN (never read by the scatter)
        most, (lo, hi) = 2 * max(units[name]), starts[name][rank:rank + 2]
        padded = np.full((most, new[name].shape[1]), np.nan, np.float32)
        padded[:hi - lo] = new[name][lo:hi]
        return padded

    blocks = {n: np.stack([block(n, r) for r in range(world)]) for n in new}

    def body(local, blocks):
        return {n: (gather_rows(local, layout, n, "fsdp", rows[n])[None],
                    scatter_rows(blocks[n][0], local, layout, n, "fsdp", rows[n])) for n in new}

    spec = {n: (P("fsdp"), P("fsdp")) for n in new}
    got = jax.jit(shard_map(body, mesh, in_specs=(P("fsdp"), {n: P("fsdp") for n in new}), out_specs=spec))(
        buffer, blocks)
    for t in matrices:
        want = buffer[t.offset:t.end].reshape(t.shape)
        gathered, written = (np.asarray(x) for x in got[t.name])
        for rank in range(world):
            lo, hi = starts[t.name][rank:rank + 2]
            np.testing.assert_array_equal(gathered[rank][:hi - lo], want[lo:hi])
            np.testing.assert_array_equal(gathered[rank][hi - lo:], 0)  # padding rows are zeros
        expected = buffer.copy()
        expected[t.offset:t.end] = new[t.name].ravel()
        np.testing.assert_array_equal(written, expected)


def test_bad_calls_name_the_tensor():
    (layout,) = plan_model([UNIT], 2)
    with pytest.raises(ValueError, match=r"layers.0.attention.wq.weight: local shard has shape \(7,\)"):
        gather_tensor(jnp.zeros(7), layout, "layers.0.attention.wq.weight", "fsdp")
    with pytest.raises(ValueError, match="device 2 is outside the 2 devices"):
        gather_tensor(jnp.zeros(layout.shard_size), layout, "layers.0.attention.wq.weight", "fsdp", device=2)
    with pytest.raises(KeyError, match="layers.0.nope"):
        gather_tensor(jnp.zeros(layout.shard_size), layout, "layers.0.nope", "fsdp")
    with pytest.raises(ValueError, match=r"full tensor has shape \(3,\), the layout has \(64, 64\)"):
        scatter_tensor(jnp.zeros(3), jnp.zeros(layout.shard_size), layout, "layers.0.attention.wq.weight",
                       "fsdp")
    local, wq = jnp.zeros(layout.shard_size), "layers.0.attention.wq.weight"
    with pytest.raises(ValueError, match=r"wq.weight: row blocks need a RaggedShard over dims \(0,\) on 2"):
        gather_rows(local, layout, wq, "fsdp", ragged.RaggedShard((), (1, 1)))
    with pytest.raises(ValueError, match=r"row block has shape \(3,\), the placement gives \(32, 64"):
        scatter_rows(jnp.zeros(3), local, layout, wq, "fsdp", ragged.RaggedShard((0,), (1, 1)))
