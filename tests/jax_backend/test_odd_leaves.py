"""Leaves that are not matrices (issue 22): 0-d parameters under every kind of optax recipe the shards
honor, and ``full_params`` of one mesh loaded on another. References: plain optax on the full pytree
(``any_models.train_reference``) and the unsharded values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_backend import make_mesh, shard_model
from tests.jax_backend.any_models import train_reference
from tests.jax_backend.jax_reference import assert_float64_parity, float64


def params() -> dict:
    keys = jax.random.split(jax.random.key(1), 2)
    return {"w": 0.5 * jax.random.normal(keys[0], (5, 4)), "scale": jnp.asarray(1.5),
            "layers": [{"w": 0.5 * jax.random.normal(keys[1], (4, 4)), "gain": jnp.asarray(-0.7)}]}


def apply(p: dict, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ p["w"] * p["scale"])
    return h @ p["layers"][0]["w"] * p["layers"][0]["gain"]


def loss(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out - y[:, :4]) ** 2)


DATA = np.random.default_rng(0).normal(size=(3, 24, 6))  # float64; x = [:, :-1], y = [:, 1:]
# Element-wise on flat shards (adam, momentum) and on the pieces (a mask, a global norm, trust ratios).
RECIPES = {
    "adam": lambda: optax.adam(3e-2),
    "momentum": lambda: optax.sgd(3e-2, momentum=0.9),
    "adamw_mask": lambda: optax.adamw(3e-2, mask=lambda p: jax.tree.map(lambda a: a.ndim > 0, p)),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(3e-2)),
    "lamb": lambda: optax.lamb(3e-2),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_scalar_params_train_like_optax_on_the_full_pytree(x64, recipe):
    """Both 0-d parameters (one in the root, one in a unit) equal optax's after three steps at 3 devices,
    in float64 (sums in another order: within jax_reference.float64_bound, 6.7e-11; measured at most 9.8e-17
    on parameters, 3.7e-16 on losses)."""
    opt, start = RECIPES[recipe](), float64(params())
    fsdp = shard_model(apply, make_mesh((3,), ("fsdp",)), params=start, units=["layers.0"])
    buffers = fsdp.shard_params(start)
    state, step, losses = fsdp.init(opt, buffers), fsdp.train_step(opt, loss), []
    for b in DATA:
        buffers, state, value = step(buffers, state, b[:, :-1], b[:, 1:])
        losses.append(float(value))
    got = {k: np.asarray(v) for k, v in fsdp.full_params(buffers).items()}
    assert_float64_parity(losses, got, train_reference(apply, start, loss, DATA, opt))
    assert got["scale"] != 1.5 and got["layers.0.gain"] != -0.7


def test_full_params_of_one_mesh_load_on_another():
    """``full_params`` at 4 devices into ``shard_params`` at 3 (and HSDP 2 x 2): no host copy by hand."""
    meshes = [make_mesh((4,), ("fsdp",)), make_mesh((3,), ("fsdp",))]
    four, three = (shard_model(apply, m, params=params(), units=["layers.0"]) for m in meshes)
    full = four.full_params(four.shard_params(params()))
    back = three.full_params(three.shard_params(full))
    hsdp = shard_model(apply, make_mesh((2, 2), ("replica", "fsdp")), params=params(), units=["layers.0"],
                       replica_axis="replica")
    again = hsdp.full_params(hsdp.shard_params(back))
    want = {k: np.asarray(v) for k, v in four.model.flatten(params()).items()}
    for got in (back, again):
        assert all(np.array_equal(np.asarray(got[k]), want[k]) for k in want)
