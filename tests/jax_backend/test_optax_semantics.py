"""Optax on flat unit shards equals optax on the full params, or the step refuses the optimizer up front.

Element-wise recipes are run on the FSDP state and unit shards (``FSDP.init`` and the update inside
``shard_map``) and compared with plain optax on the full ``{fqn: array}`` pytree. Recipes the shards
cannot honor (masks by ndim, multi_transform by name, global-norm clipping, LAMB, adafactor, a transpose)
must raise ``UnsupportedOptimizerError`` from ``FSDP.init`` and ``FSDP.train_step``, before anything runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_reference import rel_err

import ragged
from jax_backend import (
    FSDP,
    Stage,
    UnsupportedOptimizerError,
    clip_by_global_norm,
    global_norm,
    make_mesh,
    on_shards,
    shard_map,
)
from jax_backend.optim import adamw8bit, shard_blocks

# Odd shapes, biases, a 3-D tensor, and tensors small enough that some device holds nothing of them.
SPECS = (("blocks.0.w", (7, 5)), ("blocks.0.b", (5,)), ("experts", (3, 4, 6)), ("head.w", (5, 9)),
         ("head.b", (1,)))
MESHES = {"1": ((1,), ("fsdp",), None), "3": ((3,), ("fsdp",), None), "4": ((4,), ("fsdp",), None),
          "hsdp2x2": ((2, 2), ("replica", "fsdp"), "replica")}
def NDIM_MASK(p):  # noqa: N802 - a mask, as users write it
    return jax.tree.map(lambda x: x.ndim > 1, p)


def _fsdp(config: str) -> FSDP:
    shape, names, replica = MESHES[config]
    layout = ragged.plan([ragged.TensorSpec(n, s, "element") for n, s in SPECS], shape[-1], name="unit")
    return FSDP(make_mesh(shape, names), (layout,), (Stage("unit", lambda p, h: h),),
                axis="fsdp", replica_axis=replica)


def _data(steps: int = 3):
    rng = np.random.default_rng(0)
    params = {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in SPECS}
    grads = [{n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in SPECS} for _ in range(steps)]
    return params, grads


SUPPORTED = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    # (reference, on shards): the grads' global norm is about 12, so the clip scales every step; SGD, not
    # Adam, after it, since Adam would undo a uniform scale (a per-shard norm would then go unnoticed)
    "clip_by_global_norm + sgd": (
        lambda: optax.chain(optax.clip_by_global_norm(2.0), optax.sgd(0.1, momentum=0.9)),
        lambda: on_shards(optax.chain(clip_by_global_norm(2.0, "fsdp"), optax.sgd(0.1, momentum=0.9)))),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-2, weight_decay=0.1),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "adam_schedule": lambda: optax.adam(optax.linear_schedule(1e-2, 1e-3, 3)),
}


@pytest.mark.parametrize("config", list(MESHES))
@pytest.mark.parametrize("recipe", list(SUPPORTED))
def test_elementwise_recipes_on_shards_equal_unsharded_optax(recipe, config):
    fsdp, (params, grads) = _fsdp(config), _data()
    if config == "4":  # the layout leaves some device without any piece of some tensor
        layout = fsdp.layouts[0]
        assert any(not [p for p in layout.local_pieces(d) if p.name == "head.b"] for d in range(4))
    make = SUPPORTED[recipe]
    tx, sharded_tx = (make[0](), make[1]()) if isinstance(make, tuple) else (make(), make())
    want, state = dict(params), tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, want)
        want = optax.apply_updates(want, updates)

    buffers = fsdp.shard(params)
    opt_state = fsdp.init(sharded_tx, buffers)
    specs = (fsdp._buffer_specs(), fsdp._state_specs(sharded_tx))

    def local_update(local, g, s):
        updates, s = sharded_tx.update(g, s, local)
        return optax.apply_updates(local, updates), s

    step = jax.jit(shard_map(local_update, fsdp.mesh, in_specs=(specs[0], specs[0], specs[1]),
                             out_specs=specs))
    for g in grads:
        buffers, opt_state = step(buffers, fsdp.shard(g), opt_state)
    got = fsdp.unshard(buffers)
    for n in params:
        assert rel_err(got[n], want[n]) <= 1e-6, (n, rel_err(got[n], want[n]))
        assert not np.allclose(np.asarray(got[n]), np.asarray(params[n])), f"{n} did not move"


@pytest.mark.parametrize("config", list(MESHES))
def test_global_norm_of_shards_equals_optax_global_norm(config):
    fsdp, (params, _) = _fsdp(config), _data(0)
    norm = jax.jit(shard_map(lambda b: global_norm(b, fsdp.axis), fsdp.mesh, in_specs=(fsdp._buffer_specs(),),
                             out_specs=jax.sharding.PartitionSpec()))(fsdp.shard(params))
    assert rel_err(norm, optax.tree.norm(params)) <= 1e-6  # optax.global_norm, renamed


UNSUPPORTED = {
    "weight decay on ndim > 1": (lambda: optax.adamw(1e-2, weight_decay=0.1, mask=NDIM_MASK),
                                 r"different program on parameter .*mask"),
    "optax.masked": (lambda: optax.masked(optax.add_decayed_weights(0.1), NDIM_MASK), "different program"),
    "multi_transform by name": (
        lambda: optax.multi_transform({"head": optax.sgd(0.1), "rest": optax.adam(1e-2)},
                                      lambda p: {k: "head" if k.startswith("head") else "rest" for k in p}),
        "different program"),
    "clip_by_global_norm": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
                            r"`reduce_sum` to parameter .*clip_by_global_norm"),
    "lamb": (lambda: optax.lamb(1e-2), r"`reduce_sum` to parameter"),
    "adafactor": (lambda: optax.adafactor(1e-2), r"to parameter \['"),
    "a constant shaped by ndim": (lambda: optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda x: x * jnp.full(x.shape, x.ndim), u), s)),
        "different program"),
    "transpose": (lambda: optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(lambda x: x.T * 1.0, u), s)),
        r"`transpose` to parameter \['(blocks\.0\.w|experts|head\.w)'\]"),
}


@pytest.mark.parametrize("config", list(MESHES))
@pytest.mark.parametrize("recipe", list(UNSUPPORTED))
def test_unsupported_recipes_raise_before_the_first_step(recipe, config):
    make, match = UNSUPPORTED[recipe]
    fsdp = _fsdp(config)
    buffers = fsdp.shard(_data(0)[0])
    with pytest.raises(UnsupportedOptimizerError, match=match):
        fsdp.init(make(), buffers)
    with pytest.raises(UnsupportedOptimizerError, match=match):
        fsdp.train_step(make(), lambda out, y: jnp.mean(out))


def test_layout_aware_optimizers_pass_only_when_marked():
    """adamw8bit with shard blocks takes the {unit: shard} dict: on_shards skips the check explicitly;
    unmarked, it fails on the full params (its blocks name units) and the error points to on_shards."""
    layout = ragged.plan([ragged.TensorSpec("w", (64, 32), "tiles:32x32")], 4, name="unit")
    fsdp = FSDP(make_mesh((4,), ("fsdp",)), (layout,), (Stage("unit", lambda p, h: h),))
    tx = adamw8bit(1e-3, blocks=shard_blocks(fsdp.layouts, fsdp.axis))
    buffers = fsdp.shard({"w": jnp.ones((64, 32))})
    with pytest.raises(UnsupportedOptimizerError, match=r"blocks are given for the units.*on_shards\(tx\)"):
        fsdp.init(tx, buffers)
    state = fsdp.init(on_shards(tx), buffers)
    assert state[0].m_codes["unit"].shape == (layout.total_numel,)  # 8-bit codes on the unit's shards
