"""jax_backend.optim: 8-bit tile Adam and distributed Muon as optax transforms, whole tensors and FSDP shards.

Sharded runs apply the optimizer to unit shards inside ``shard_map`` (one trace for every device, block
ids and masks picked by ``axis_index``) and are compared with the same optimizer on the full tensors on
one device. Independent references: optax.adamw, numpy SVD (Newton-Schulz closed form), the core's plans.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import ragged
from jax_backend import full_params, make_mesh, on_shards, shard_map, shard_params
from jax_backend.models import parallelize
from jax_backend.optim import adamw8bit, muon, muon_plan, newton_schulz, shard_tiles
from tests.jax_backend.jax_reference import (
    SPREAD_ORDERS,
    assert_params_within_spread,
    assert_within_spread,
    permuted_rows,
    train_fsdp,
    train_references,
)
from tests.numpy_references import assert_tracks_fp32_adamw, newton_schulz_closed_form

WORLDS = (1, 2, 3, 4)
ADAM_SPECS = (("w_in", (96, 64), "tiles:32x32"), ("norm", (64,), "element"),
              ("w_out", (64, 32), "tiles:32x32"), ("odd", (40, 8), "rows:1"))
MUON_SPECS = (("wide", (32, 96), "rows:1"), ("norm", (24,), "element"), ("tall", (80, 16), "rows:1"),
              ("sq", (48, 48), "rows:4"))


def _fulls(specs, seed: int, steps: int):
    rng = np.random.default_rng(seed)
    params = {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s, _ in specs}
    grads = [{n: jnp.asarray(rng.standard_normal(s) * (1 + k), jnp.float32) for n, s, _ in specs}
             for k in range(steps)]
    return params, grads


def _run_full(opt, params, grads):
    return _run_fulls(opt, [(params, grads)])[0]


def _run_fulls(opt, runs):
    """``opt`` on the full tensors for each ``(params, grads)`` of ``runs`` (of one shape), one program."""
    @jax.jit
    def step(p, g, s):  # one program, as on the shards: XLA fuses (and contracts) the same way
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    out = []
    for params, grads in runs:
        state = opt.init(params)
        for g in grads:
            params, state = step(params, g, state)
        out.append(params)
    return out


def _orders(seed: int, params: dict) -> dict:
    """Per tensor, a permutation of each dim's indices."""
    rng = np.random.default_rng(seed)
    return {n: [rng.permutation(k) for k in np.shape(p)] for n, p in params.items()}


def _permute(tree: dict, orders: dict, inverse: bool = False) -> dict:
    def one(x, perms):
        x = np.asarray(x)
        for axis, perm in enumerate(perms):
            x = np.take(x, np.argsort(perm) if inverse else perm, axis=axis)
        return jnp.asarray(x)
    return {n: one(x, orders[n]) for n, x in tree.items()}


def _full_orders(opt, params, grads) -> tuple[dict, list[dict]]:
    """``opt`` on the full tensors (``_run_full``), and with every tensor's rows and columns (a vector's
    elements) in ``SPREAD_ORDERS`` other orders, permuted back: the same update summed in other orders
    (Muon's Newton-Schulz commutes with permuting a matrix's rows or columns, AdamW and weight decay are
    element-wise), the spread that bounds a sharded run (jax_reference.assert_params_within_spread). One
    program for all."""
    perms = [_orders(seed, params) for seed in range(SPREAD_ORDERS)]
    runs = [(params, grads)] + [(_permute(params, o), [_permute(g, o) for g in grads]) for o in perms]
    want, *others = _run_fulls(opt, runs)
    return want, [_permute(p, o, inverse=True) for p, o in zip(others, perms)]


def _run_sharded(make_opt, specs, params, grads, world):
    """The same steps on unit shards: one unit planned over ``world`` devices, the update in shard_map."""
    mesh = make_mesh((world,), ("fsdp",))
    layouts = (ragged.plan([ragged.TensorSpec(n, s, g) for n, s, g in specs], world, name="unit"),)
    opt = make_opt(layouts)
    spec = {"unit": P("fsdp")}
    state_specs = jax.tree.map(lambda x: P() if x.ndim == 0 else P("fsdp"),
                               jax.eval_shape(opt.init, {"unit": jnp.zeros(layouts[0].shard_size)}))

    def local_step(p, g, s):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    init = jax.jit(shard_map(opt.init, mesh, in_specs=(spec,), out_specs=state_specs))
    step = jax.jit(shard_map(local_step, mesh, in_specs=(spec, spec, state_specs),
                             out_specs=(spec, state_specs)))
    bufs = shard_params(params, layouts, mesh, "fsdp")
    state = init(bufs)
    for g in grads:
        bufs, state = step(bufs, shard_params(g, layouts, mesh, "fsdp"), state)
    return full_params(bufs, layouts), (step, bufs, shard_params(grads[0], layouts, mesh, "fsdp"), state)


# ----- 8-bit Adam ------------------------------------------------------------------------------------
@functools.cache
def _adam_reference():
    params, grads = _fulls(ADAM_SPECS, seed=0, steps=3)
    return params, grads, _run_full(adamw8bit(1e-2, weight_decay=0.1), params, grads)


@functools.cache
def _muon_reference():
    """Single-device Muon, and in other summation orders (``_full_orders``)."""
    params, grads = _fulls(MUON_SPECS, seed=1, steps=3)
    return params, grads, *_full_orders(_muon(), params, grads)


@pytest.mark.parametrize("world", WORLDS)
def test_adamw8bit_on_shards_gives_the_same_bits_as_on_full_tensors(world):
    params, grads, want = _adam_reference()
    got, (step, bufs, g, state) = _run_sharded(
        lambda lays: adamw8bit(1e-2, weight_decay=0.1, tiles=shard_tiles(lays, "fsdp")),
        ADAM_SPECS, params, grads, world)
    for n in params:
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]), err_msg=n)
        assert not np.array_equal(np.asarray(got[n]), np.asarray(params[n])), f"{n} did not move"
    text = step.lower(bufs, g, state).as_text()  # tiles are local: no collective at all
    assert not any(c in text for c in ("all_gather", "all_reduce", "collective_permute", "all_to_all")), text


@pytest.mark.parametrize("world", (3, 4))
def test_tile_ids_and_muon_masks_on_each_device_match_the_core(world):
    from ragged.quant._tiles import local_tile_ids

    layout = ragged.plan([ragged.TensorSpec(n, s, g) for n, s, g in ADAM_SPECS], world, name="unit")
    tiles, plan = shard_tiles([layout], "fsdp")["unit"], muon_plan([layout], "fsdp")
    mesh = make_mesh((world,), ("fsdp",))
    ids, mask = jax.jit(shard_map(lambda: (tiles.ids(), plan.mask("unit")), mesh, in_specs=(),
                                  out_specs=(P("fsdp"), P("fsdp"))))()
    ids, mask = np.asarray(ids).reshape(world, -1), np.asarray(mask).reshape(world, -1)
    for rank in range(world):
        want, _ = local_tile_ids(layout, rank)
        np.testing.assert_array_equal(ids[rank], np.where(want < 0, tiles.count - 1, want))
        dense = np.zeros(layout.shard_size, bool)
        for p in layout.local_pieces(rank):
            dense[p.local_offset:p.local_offset + p.stop - p.start] = len(layout.slot(p.name).shape) == 2
        np.testing.assert_array_equal(mask[rank], dense)


def test_a_layout_that_cuts_tiles_is_rejected_naming_the_tensor():
    layout = ragged.plan([ragged.TensorSpec("layers.0.feed_forward.w1.weight", (64, 64), "element")], 3)
    with pytest.raises(ragged.quant.TileError, match=r"layers\.0\.feed_forward\.w1\.weight.*tiles:32x32"):
        shard_tiles([layout], "fsdp")


def test_tiles_for_other_units_are_rejected():
    layout = ragged.plan([ragged.TensorSpec("w", (64, 32), "tiles:32x32")], 2, name="layers.0")
    opt = adamw8bit(1e-3, tiles=shard_tiles([layout], "fsdp"))
    with pytest.raises(ValueError, match=r"\['layers\.0'\].*\['layers\.1'\]"):
        opt.init({"layers.1": jnp.zeros(layout.shard_size)})


def test_adamw8bit_tracks_optax_adamw_on_a_regression_problem():
    rng = np.random.default_rng(0)
    x, w_true = rng.standard_normal((512, 64)), rng.standard_normal((64, 32))
    y = jnp.asarray(x @ w_true + 0.1 * rng.standard_normal((512, 32)), jnp.float32)
    x = jnp.asarray(x, jnp.float32)

    def train(opt) -> list[float]:
        params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
        loss_fn = lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)  # noqa: E731

        @jax.jit
        def step(p, s):
            loss, g = jax.value_and_grad(loss_fn)(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        state, losses = opt.init(params), []
        for _ in range(300):
            params, state, loss = step(params, state)
            losses.append(float(loss))
        return losses

    ours, ref = train(adamw8bit(3e-2, weight_decay=1e-4)), train(optax.adamw(3e-2, weight_decay=1e-4))
    assert_tracks_fp32_adamw(ours, ref)


# ----- Muon ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(32, 96), (80, 16)])
def test_newton_schulz_matches_the_singular_value_closed_form(shape):
    x = np.random.default_rng(1).standard_normal(shape)
    got = np.asarray(newton_schulz(jnp.asarray(x, jnp.float32)), np.float64)
    # Bound: fp32 iteration vs the float64 closed form of the same polynomial: 5 steps of fp32 matmuls on
    # entries of order 1/sqrt(n), each step's rounding amplified by the quintic's slope (up to ~3.4).
    np.testing.assert_allclose(got, newton_schulz_closed_form(x), atol=2e-4)
    sv = np.linalg.svd(got, compute_uv=False)
    assert sv.min() > 0.5 and sv.max() < 1.25


def _muon(plan=None):
    return muon(0.02, weight_decay=0.01, adamw_learning_rate=1e-2, plan=plan)


@pytest.mark.parametrize("world", (3, 4))  # 2 devices: the llama-tiny FSDP test below
def test_distributed_muon_equals_single_device_muon(world):
    params, grads, want, orders = _muon_reference()
    got, (step, bufs, g, state) = _run_sharded(lambda lays: _muon(muon_plan(lays, "fsdp")), MUON_SPECS,
                                              params, grads, world)
    # Bound: Muon computes in fp32, so the spread of single-device Muon over orders of each matrix's rows
    # and columns (the Newton-Schulz devices gather each matrix whole: its sums as one device's, in
    # XLA's order for that program).
    assert_params_within_spread(got, want, orders)
    for n in params:
        assert not np.array_equal(np.asarray(got[n]), np.asarray(params[n])), f"{n} did not move"
    # Communication: only the core's NS-device transfers (one ppermute each way per cross-device piece).
    layout = ragged.plan([ragged.TensorSpec(n, s, gr) for n, s, gr in MUON_SPECS], world, name="unit")
    plan = muon_plan([layout], "fsdp")
    moves = 0
    for m in plan.matrices["unit"]:
        pieces = ragged.ragged_holdings(layout.placement(m.name), m.shape, m.name)
        whole = ragged.ragged_holdings(ragged.RaggedShard.whole_on(m.ns_device, world), m.shape, m.name)
        moves += sum(t.src != t.dst for t in ragged.transfers(pieces, whole))
        moves += sum(t.src != t.dst for t in ragged.transfers(whole, pieces))
    text = step.lower(bufs, g, state).as_text()
    assert text.count("collective_permute") == moves, (text.count("collective_permute"), moves)
    assert "all-gather" not in text and "all_gather" not in text and "all_reduce" not in text


def test_scale_by_muon_without_a_plan_rejects_leaves_that_are_not_matrices():
    from jax_backend.optim import scale_by_muon

    opt, params = scale_by_muon(), {"norm": jnp.ones(4), "w": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match=r"'norm'.*\(4,\).*2-D"):
        opt.update(params, opt.init(params))


def test_muon_ns_devices_are_balanced_over_the_devices():
    layout = ragged.plan([ragged.TensorSpec(n, s, g) for n, s, g in MUON_SPECS], 3, name="unit")
    ns_devices = [m.ns_device for m in muon_plan([layout], "fsdp").matrices["unit"]]
    assert sorted(ns_devices) == [0, 1, 2]  # three matrices, three devices


# ----- both optimizers in the FSDP training step on llama-tiny ----------------------------------------
@functools.cache
def _tiny():
    from jax_backend.models import Llama

    batch = np.random.default_rng(0).integers(0, 256, size=(8, 17)).astype(np.int32)
    return Llama(rngs=nnx.Rngs(0)), np.stack([batch] * 4)  # one batch again and again: the loss must fall


@pytest.mark.parametrize("name", ["adamw8bit", "muon"])
def test_fsdp_train_step_with_structure_aware_optimizers_matches_single_device(name):
    model, batches = _tiny()
    tiled = lambda n, s: ragged.quant.tile_granularity(s)
    fsdp = parallelize(model, make_mesh((2,), ("fsdp",)), granularity=tiled)
    if name == "adamw8bit":
        tiles = shard_tiles(fsdp.layouts, fsdp.axis)
        sharded, full = adamw8bit(3e-3, weight_decay=0.1, tiles=tiles), adamw8bit(3e-3, weight_decay=0.1)
    else:
        sharded, full = _muon(muon_plan(fsdp.layouts, fsdp.axis)), _muon()
    losses, params = train_fsdp(fsdp, model, batches, on_shards(sharded))  # layout-aware: no check_optimizer
    assert losses[-1] < losses[0] - 0.05, losses  # it trains
    # Bound: these optimizers compute in fp32, so the spread of the single-device reference over row
    # orders in 2 micro-batches (jax_reference.assert_within_spread; 8-bit codes and Newton-Schulz see the
    # same data-parallel rounding). Measured parameters 1.2e-4 (spread 1.4e-4: 8-bit codes that flip) for
    # adamw8bit, 1.6e-6 (2.2e-6) for muon; losses 0 (1.2e-7), 4.5e-8 (1.1e-7).
    if name == "muon":
        reference, *others = tiny_muon_references()
    else:
        orders = [batches, *(permuted_rows(batches, seed) for seed in range(SPREAD_ORDERS))]
        reference, *others = train_references(model, orders, opt=full, micro_batches=2)
    assert_within_spread(losses, params, reference, others)


@functools.cache
def tiny_muon_references() -> list[tuple]:
    """Single-device Muon on ``_tiny()``'s batches and on ``SPREAD_ORDERS`` row orders of them, in 2
    micro-batches: trained once per session (test_muon_split's 4-device run is bounded by the same
    spread; in fp32 the number of blocks is one more summation order)."""
    model, batches = _tiny()
    orders = [batches, *(permuted_rows(batches, seed) for seed in range(SPREAD_ORDERS))]
    return train_references(model, orders, opt=_muon(), micro_batches=2)
