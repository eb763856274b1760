"""The FSDP step's optimizer equals optax on the full params pytree, or the step refuses it up front.

Element-wise recipes run on the flat unit shards; recipes over the params pytree (masks, multi_transform
by path, clip_by_global_norm, a global norm logged in the state, LAMB, scale_by_trust_ratio) run on each
device's pieces of every parameter (``shard_optimizer``). Both are run inside ``shard_map`` and compared
with plain optax on the full pytree (the synthetic ``SPECS`` units, and the pure-function model of
``any_models.py`` at 1, 3, 4, 8 devices and HSDP 2 x 4). Recipes the shards cannot honor (adafactor, a
transpose, two parameters mixed, a reduction over some axes) must raise ``UnsupportedOptimizerError`` from
``FSDP.init`` and ``FSDP.train_step``, before anything runs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import ragged
from jax_backend import (
    FSDP,
    UnsupportedOptimizerError,
    clip_by_global_norm,
    flatten_params,
    global_norm,
    make_mesh,
    on_shards,
    shard_map,
    shard_model,
)
from jax_backend._names import fqn
from jax_backend.optim import adamw8bit, shard_tiles
from tests.jax_backend.any_models import BLOCKS, batches, mlp_apply, mlp_loss, mlp_params, train_reference
from tests.jax_backend.jax_reference import assert_float64_parity, float64, float64_bound, rel_err

# Odd shapes, biases, a 3-D tensor, and tensors small enough that some device holds nothing of them.
SPECS = (("blocks.0.w", (7, 5)), ("blocks.0.b", (5,)), ("experts", (3, 4, 6)), ("head.w", (5, 9)),
         ("head.b", (1,)))
MESHES = {"1": ((1,), ("fsdp",), None), "3": ((3,), ("fsdp",), None), "4": ((4,), ("fsdp",), None),
          "hsdp2x2": ((2, 2), ("replica", "fsdp"), "replica")}
def NDIM_MASK(p):  # noqa: N802 - a mask, as users write it
    return jax.tree.map(lambda x: x.ndim > 1, p)


# The parity tests run in float64 (the ``x64`` fixture, float64 params and gradients), within
# jax_reference.float64_bound of their three updates, 6.7e-11: given the same gradients, only reductions
# (global norms, LAMB's and the trust ratio's norms) sum in another order (in fp32 the bound was 1e-6, ~8
# eps). Measured: at most 6.8e-17, also with XLA's ISA limited to AVX2 or SSE4.2; a global norm of the
# local shards only (its psum lost) fails the clip and norm tests at every size above one device.
BOUND = float64_bound(3)

# These programs are checked for values, not speed: XLA's cheapest CPU code generation halves their compile.
QUICK = {"xla_backend_optimization_level": 0}


def _one_unit(layout, mesh, replica_axis=None, dtype=jnp.float32) -> FSDP:
    """FSDP of a pure function that returns its input, every parameter in its one (root) unit ``layout``:
    only the optimizer runs on the parameters."""
    params = {t.name: jax.ShapeDtypeStruct(t.shape, dtype) for t in layout.tensors}
    return shard_model(lambda p, h: h, mesh, params=params, units=(), root=layout.name, layouts=(layout,),
                       replica_axis=replica_axis)


def _fsdp(config: str, dtype=jnp.float32) -> FSDP:
    shape, names, replica = MESHES[config]
    layout = ragged.plan([ragged.TensorSpec(n, s, "element") for n, s in SPECS], shape[-1], name="unit")
    return _one_unit(layout, make_mesh(shape, names), replica, dtype)


def _data(steps: int = 3, dtype=np.float32):
    """Params and ``steps`` gradients of ``SPECS`` (float64 for the parity tests, under x64: numpy arrays,
    which jax takes in their own dtype)."""
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s).astype(dtype) for n, s in SPECS}
    grads = [{n: rng.standard_normal(s).astype(dtype) for n, s in SPECS} for _ in range(steps)]
    return params, grads


def _pack(fsdp, tree) -> dict:
    """``{unit: (W * S,)}`` in numpy: each tensor at its Layout offset (the independent packing)."""
    flat = flatten_params(tree)
    out = {}
    for lay in fsdp.layouts:
        buf = np.zeros(lay.total_numel, np.result_type(*[np.asarray(flat[t.name]) for t in lay.tensors]))
        for t in lay.tensors:
            buf[t.offset:t.end] = np.ravel(flat[t.name])
        out[lay.name] = buf
    return out


def _unpack(fsdp, buffers) -> dict:
    return {t.name: np.asarray(buffers[lay.name])[t.offset:t.end].reshape(t.shape)
            for lay in fsdp.layouts for t in lay.tensors}


def _steps(tx):
    """``(params, stacked grads) -> (params, state)``: ``tx.init`` then one update per grads (a scan)."""
    def run(params, stacked):
        def step(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return lax.scan(step, (params, tx.init(params)), stacked)[0]

    return run


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
    # the schedule's ends float64: of Python floats optax computes it in fp32 even under x64, and the two
    # programs round its fp32 arithmetic differently (3e-9 on the parameters)
    "adam_schedule": lambda: optax.adam(optax.linear_schedule(np.float64(1e-2), np.float64(1e-3), 3)),
    # On the pieces: lax.cond on parameter values (every branch runs, select_n picks), a global is_finite
    # (reduce_and), and adafactor while no dim reaches min_dim_size_to_factor (per-parameter RMS clipping
    # and parameter scale: full reductions).
    "MultiSteps(apply_if_finite(adafactor), 2)": lambda: optax.MultiSteps(
        optax.apply_if_finite(optax.adafactor(1e-2), 3), 2).gradient_transformation(),
}


def _pair(recipe: str) -> tuple:
    """(the reference transformation, the one given to the step)."""
    make = SUPPORTED[recipe]
    return (make[0](), make[1]()) if isinstance(make, tuple) else (make(), make())


@pytest.fixture(scope="module")
def references() -> dict:
    """Per recipe: plain optax on the full ``{fqn: array}`` pytree, three updates (params and state), in
    float64."""
    params, grads = _data(dtype=np.float64)
    stacked = jax.tree.map(lambda *g: np.stack(g), *grads)
    with jax.enable_x64(True):
        return {recipe: jax.jit(_steps(_pair(recipe)[0]), compiler_options=QUICK)(params, stacked)
                for recipe in SUPPORTED}


@pytest.mark.parametrize("config", list(MESHES))
@pytest.mark.parametrize("recipe", list(SUPPORTED))
def test_elementwise_recipes_on_shards_equal_unsharded_optax(x64, recipe, config, references):
    fsdp, (params, grads) = _fsdp(config, jnp.float64), _data(dtype=np.float64)
    if config == "4":  # the layout leaves some device without any piece of some tensor
        layout = fsdp.layouts[0]
        assert any(not [p for p in layout.local_pieces(d) if p.name == "head.b"] for d in range(4))
    tx, sharded_tx = _pair(recipe)
    want, state = references[recipe]

    buffers = fsdp.shard_params(params)
    opt_state = fsdp.init(sharded_tx, buffers)
    sharded_tx = fsdp.shard_optimizer(sharded_tx)  # itself, but for adafactor: that runs on the pieces
    specs = (fsdp._buffer_specs(), fsdp._state_specs(sharded_tx))

    def local_update(local, g, s):
        updates, s = sharded_tx.update(g, s, local)
        return optax.apply_updates(local, updates), s

    step = jax.jit(shard_map(local_update, fsdp.mesh, in_specs=(specs[0], specs[0], specs[1]),
                             out_specs=specs), compiler_options=QUICK)
    for g in grads:
        buffers, opt_state = step(buffers, _pack(fsdp, g), opt_state)
    got = _unpack(fsdp, buffers)
    for n in params:
        assert got[n].dtype == np.float64 and rel_err(got[n], want[n]) <= BOUND, (n, rel_err(got[n], want[n]))
        assert not np.allclose(np.asarray(got[n]), np.asarray(params[n])), f"{n} did not move"
    if recipe == "adamw" and config == "hsdp2x2":  # the flat-shard state, as optax keeps it on the pytree
        full = fsdp.full_optimizer_state(tx, opt_state)
        assert jax.tree.structure(full) == jax.tree.structure(state)
        assert all(rel_err(x, y) <= BOUND for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(state)))


@pytest.mark.parametrize("config", list(MESHES))
def test_global_norm_of_shards_equals_optax_global_norm(x64, config):
    fsdp, (params, _) = _fsdp(config, jnp.float64), _data(0, np.float64)
    norm = jax.jit(shard_map(lambda b: global_norm(b, fsdp.axis), fsdp.mesh, in_specs=(fsdp._buffer_specs(),),
                             out_specs=jax.sharding.PartitionSpec()))(fsdp.shard_params(params))
    assert norm.dtype == np.float64 and rel_err(norm, optax.tree.norm(params)) <= BOUND  # optax.global_norm


def _tx(update):
    return optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (update(u), s))


UNSUPPORTED = {
    "adafactor, factored": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
                            r"`reduce_sum` to parameter (blocks\.0\.w|experts|head\.w) \(shape .*axes=\(\d"),
    "transpose": (lambda: _tx(lambda u: jax.tree.map(lambda x: x.T * 1.0, u)),
                  r"`transpose` to parameter (blocks\.0\.w|experts|head\.w)"),
    "a reduction over some axes": (
        lambda: _tx(lambda u: {**u, "experts": u["experts"] - u["experts"].mean(0)}),
        r"`reduce_sum` to parameter experts"),
    "a slice": (lambda: _tx(lambda u: {**u, "blocks.0.b": u["blocks.0.b"] * u["head.w"][0, :5]}),
                r"`slice` to parameter head\.w"),
    "a product of two parameters": (
        lambda: _tx(lambda u: {**u, "blocks.0.b": (u["blocks.0.w"] @ u["head.w"]).sum(0)[:5]}),
        r"`dot_general` to parameter blocks\.0\.w"),
}


@pytest.mark.parametrize("config", list(MESHES))
@pytest.mark.parametrize("recipe", list(UNSUPPORTED))
def test_unsupported_recipes_raise_before_the_first_step(recipe, config):
    make, match = UNSUPPORTED[recipe]
    fsdp = _fsdp(config)
    buffers = fsdp.shard_params(_data(0)[0])
    with pytest.raises(UnsupportedOptimizerError, match=match):
        fsdp.init(make(), buffers)
    with pytest.raises(UnsupportedOptimizerError, match=match):
        fsdp.train_step(make(), lambda out, y: jnp.mean(out))


def test_layout_aware_optimizers_pass_only_when_marked():
    """adamw8bit with shard blocks takes the {unit: shard} dict: on_shards skips the check explicitly;
    unmarked, it fails on the full params (its blocks name units) and the error points to on_shards."""
    layout = ragged.plan([ragged.TensorSpec("w", (64, 32), "tiles:32x32")], 4, name="unit")
    fsdp = _one_unit(layout, make_mesh((4,), ("fsdp",)))
    tx = adamw8bit(1e-3, tiles=shard_tiles(fsdp.layouts, fsdp.axis))
    buffers = fsdp.shard_params({"w": jnp.ones((64, 32))})
    with pytest.raises(UnsupportedOptimizerError, match=r"tiles are given for the units.*on_shards\(tx\)"):
        fsdp.init(tx, buffers)
    state = fsdp.init(on_shards(tx), buffers)
    assert state[0].m_codes["unit"].shape == (layout.total_numel,)  # 8-bit codes on the unit's shards


# ----- recipes over the params pytree, on the pure-function model of any_models.py --------------------
MODEL_MESHES = {1: ((1,), ("fsdp",)), 3: ((3,), ("fsdp",)), 4: ((4,), ("fsdp",)), 8: ((8,), ("fsdp",)),
                "2x4": ((2, 4), ("replica", "fsdp"))}
CLIP = 20.0
SCALES = (1.0, 8.0, 0.25)  # the grads' global norm is about 53, 424 and 13: clipped, clipped, not clipped


class LoggedNorm(NamedTuple):
    norm: jax.Array  # f32[]


def log_global_norm() -> optax.GradientTransformation:
    """Keeps ``optax.global_norm`` of the incoming updates in its state: logging from inside optax."""
    return optax.GradientTransformation(lambda p: LoggedNorm(jnp.zeros([])),
                                        lambda u, s, p=None: (u, LoggedNorm(optax.tree.norm(u))))


def by_path(params):
    """multi_transform labels from each parameter's path: one rule per layer, sgd for the rest."""
    rules = {f"layers.{i}": r for i, r in enumerate(("lamb", "masked adam", "trust ratio"))}
    return jax.tree_util.tree_map_with_path(lambda path, _: rules.get(fqn(path)[:8], "sgd"), params)


PYTREE_RECIPES = {
    "global norm logged, clip_by_global_norm, adamw with decay on ndim > 1": lambda: optax.chain(
        log_global_norm(), optax.clip_by_global_norm(CLIP),
        optax.adamw(1e-2, weight_decay=0.5, mask=NDIM_MASK)),
    "multi_transform by path: lamb, optax.masked adam, scale_by_trust_ratio, sgd": (
        lambda: optax.multi_transform({"lamb": optax.lamb(1e-2, weight_decay=0.1),
         "masked adam": optax.chain(optax.masked(optax.scale_by_adam(), NDIM_MASK), optax.scale(-1e-2)),
         "trust ratio": optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale(-1e-2)),
         "sgd": optax.sgd(0.1, momentum=0.9)}, by_path)),
}


def _grads(params) -> list:
    rng = np.random.default_rng(1)
    return [jax.tree.map(lambda x, c=c: (c * rng.standard_normal(x.shape)).astype(x.dtype), params)
            for c in SCALES]


@pytest.fixture(scope="module")
def mlp64() -> dict:
    """``mlp_params()`` in float64, drawn without x64 (under it jax.random draws other values)."""
    return float64(mlp_params())


@pytest.fixture(scope="module")
def pytree_references(mlp64) -> dict:
    """Per recipe: optax on the full params pytree (one device), three updates: params and state, in
    float64."""
    params = mlp64
    stacked = jax.tree.map(lambda *g: np.stack(g), *_grads(params))
    with jax.enable_x64(True):
        return {recipe: jax.jit(_steps(make()), compiler_options=QUICK)(params, stacked)
                for recipe, make in PYTREE_RECIPES.items()}


@pytest.mark.parametrize("mesh_key", list(MODEL_MESHES))
@pytest.mark.parametrize("recipe", list(PYTREE_RECIPES))
def test_pytree_recipes_equal_unsharded_optax(x64, recipe, mesh_key, mlp64, pytree_references):
    """``FSDP.shard_optimizer``'s init and three updates inside ``shard_map`` (one program: a scan) equal
    optax on the full params pytree in float64 within ``BOUND`` (reductions sum in another order): the params
    per tensor and the state's replicated leaves (step counts, the logged global norm: over every shard
    and replica) at every mesh, the whole state (``full_optimizer_state``) at HSDP 2 x 4."""
    shape, names = MODEL_MESHES[mesh_key]
    params = mlp64
    fsdp = shard_model(mlp_apply, make_mesh(shape, names), params=params,
                       units=[f"layers.{i}" for i in range(BLOCKS)],
                       replica_axis="replica" if len(shape) == 2 else None)
    grads, tx = _grads(params), PYTREE_RECIPES[recipe]()
    want, want_state = pytree_references[recipe]
    sharded = fsdp.shard_optimizer(tx)
    assert sharded is not tx  # not one element-wise program: it runs on the pieces
    buffer_specs, state_specs = fsdp._buffer_specs(), fsdp._state_specs(sharded)

    stacked = {u: np.stack([_pack(fsdp, g)[u] for g in grads]) for u in buffer_specs}
    grad_specs = {u: P(None, fsdp.axis) for u in stacked}
    run = shard_map(_steps(sharded), fsdp.mesh, in_specs=(buffer_specs, grad_specs),
                    out_specs=(buffer_specs, state_specs))
    buffers, state = jax.jit(run, compiler_options=QUICK)(_pack(fsdp, params), stacked)
    got, want = _unpack(fsdp, buffers), flatten_params(want)
    for n in want:
        assert got[n].dtype == np.float64 and rel_err(got[n], want[n]) <= BOUND, (n, rel_err(got[n], want[n]))
        assert rel_err(got[n], flatten_params(params)[n]) > 1e-3, f"{n} did not move"
    scalars = [leaf for leaf in jax.tree.leaves(want_state) if not jnp.ndim(leaf)]
    assert len(state.rest) == len(scalars)
    assert all(rel_err(a, b) <= BOUND for a, b in zip(state.rest, scalars))
    if "logged" in recipe:
        norms = [float(optax.tree.norm(g)) for g in grads]
        assert norms[0] > CLIP and norms[1] > CLIP and norms[2] < CLIP
        assert rel_err(optax.tree_utils.tree_get(want_state, "norm"), norms[-1]) <= BOUND
    if mesh_key == "2x4":
        got_state = fsdp.full_optimizer_state(tx, state)
        assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
        for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
            assert rel_err(a, b) <= BOUND


def test_pytree_recipe_trains_the_model_like_single_device(x64):
    """The whole step (train_step: reduce-scatter, replica all-reduce, then the pieces) at HSDP 2 x 4
    against single-device training with the same recipe: three steps in float64, losses and params within
    jax_reference.float64_bound, 6.7e-11 (measured 4.3e-13 on parameters, 2.7e-16 on losses; in fp32 1.4e-6,
    the clip's global norm and AdamW)."""
    data, params = batches()[:3], float64(mlp_params())
    make = PYTREE_RECIPES["global norm logged, clip_by_global_norm, adamw with decay on ndim > 1"]
    reference = train_reference(mlp_apply, params, mlp_loss, data, opt=make())
    fsdp = shard_model(mlp_apply, make_mesh((2, 4), ("replica", "fsdp")), params=params,
                       units=[f"layers.{i}" for i in range(BLOCKS)], replica_axis="replica")
    opt = make()
    buffers = fsdp.shard_params(params)
    state, losses = fsdp.init(opt, buffers), []
    step = fsdp.train_step(opt, mlp_loss).lower(buffers, state, data[0, :, :-1], data[0, :, 1:])
    step = step.compile(QUICK)
    for b in data:
        buffers, state, loss = step(buffers, state, b[:, :-1], b[:, 1:])
        losses.append(float(loss))
    assert_float64_parity(losses, _unpack(fsdp, buffers), reference)
