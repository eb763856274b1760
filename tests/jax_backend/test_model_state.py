"""Everything a flax model keeps besides its Params, through ``shard_model``: BatchNorm statistics, the
Dropout streams of ``nnx.Rngs``, user Variables, in the root and inside units (issue 22).

The reference (``vision_models.train_data_parallel``) is flax and optax on one device running N-way data
parallelism by its definition: each device's rows of the batch with its own copy of the model state (its
RNG keys folded with its index when N > 1). At N = 1 it is plain single-device ``nnx`` training. Public
API only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_backend import LayoutMismatchError, UnitError, flatten_params, make_mesh, shard_model
from tests.jax_backend.jax_reference import float64, float64_bound, rel_err
from tests.jax_backend.vision_models import (
    BLOCKS,
    CNN,
    STEPS,
    ViT,
    assert_params_near,
    assert_state_close,
    cross_entropy,
    data_parallel_steps,
    float64_model,
    float64_reference,
    image_batches,
    near_error,
    per_device_state,
    sgd,
    state_leaves,
)

MESHES = {1: ((1,), ("fsdp",)), 3: ((3,), ("fsdp",)), 4: ((4,), ("fsdp",)), 8: ((8,), ("fsdp",)),
          "2x2": ((2, 2), ("replica", "fsdp")), "2x4": ((2, 4), ("replica", "fsdp"))}
MODES = {"keep": {"reshard_after_forward": False}, "reshard": {"reshard_after_forward": True},
         "remat": {"remat": True}}
DEVICES = {1: 1, 3: 3, 4: 4, 8: 8, "2x2": 4, "2x4": 8}
# The reference does each device's arithmetic itself (its rows, its BatchNorm means, its Dropout keys), so
# what differs is the order of the sums across devices (the reduce-scatter against the mean of the devices'
# gradients) and XLA's kernels. The training tests run in float64 (the ``x64`` fixture; the models' Params
# and BatchNorm statistics and the images in float64: jax_reference.float64), bounded by
# jax_reference.float64_bound of their step count (3 steps: 6.7e-11). SGD with momentum, not AdamW: its
# update is linear in the gradient, so that rounding is not amplified, while some gradients are zero in
# exact arithmetic (a bias before BatchNorm, attention's key bias). Parameters and state are measured by
# near_error (relative, or absolute RMS where values cancel to near zero). Measured, worst of losses,
# parameters and state: CNN 1.1e-16, ViT 2.2e-16, with synchronised statistics 1.9e-16, also with XLA's ISA
# limited to AVX2 or SSE4.2 (in fp32 1.1e-7, 1.5e-7 and 5.8e-8, CPU-dependent); a shard one element off,
# an HSDP replica sum left out, a gradient summed where its mean is due: all fail.
BOUND = float64_bound(STEPS)


def shard(model, mesh_key, **kw):
    shape, names = MESHES[mesh_key]
    return shard_model(model, make_mesh(shape, names), replica_axis="replica" if len(shape) == 2 else None,
                       **kw)


def train(fsdp, model, images, labels, opt=None, buffers=None, model_state=None):
    opt = sgd() if opt is None else opt
    buffers = fsdp.shard_params(model) if buffers is None else buffers
    model_state = fsdp.shard_model_state(model) if model_state is None else model_state
    state, step, losses = fsdp.init(opt, buffers), fsdp.train_step(opt, cross_entropy), []
    for x, y in zip(images, labels):
        buffers, state, loss, model_state = step(buffers, state, x, y, model_state)
        losses.append(float(loss))
    return losses, {k: np.asarray(v) for k, v in fsdp.full_params(buffers).items()}, model_state


def assert_float64_run(losses, params, model_state, ref_losses, ref_params, ref_state,
                       bound: float = BOUND) -> None:
    """A float64 run's losses, Params and model state within ``bound`` of the reference's (near_error for
    parameters and state)."""
    assert all(np.asarray(v).dtype == np.float64 for v in (*params.values(), *ref_params.values())), \
        "a float64 test ran in another dtype"
    assert rel_err(losses, ref_losses) <= bound, (losses, ref_losses)
    assert_params_near(params, ref_params, bound)
    assert_state_close(model_state, ref_state, bound)


@pytest.fixture(scope="module")
def mnist():
    return image_batches((28, 28, 1), dtype=np.float64)


@pytest.fixture(scope="module")
def cifar_like():
    return image_batches((16, 16, 3), dtype=np.float64)


@pytest.fixture(scope="module")
def models() -> dict:
    """The float64 models of the training tests (vision_models.float64_model: built once)."""
    return {"cnn": float64_model("cnn", 0.2), "cnn_no_dropout": float64_model("cnn", 0.0),
            "vit": float64_model("vit", 0.2)}


@pytest.fixture(scope="module")
def reference():
    """``reference(model_name, n)``: vision_models.float64_reference of that model at ``n`` devices,
    trained once per session (the 8-device reference serves both 8 and HSDP 2 x 4)."""
    def get(name: str, n: int):
        return float64_reference(*{"cnn": ("cnn", 0.2), "cnn_no_dropout": ("cnn", 0.0),
                                   "vit": ("vit", 0.2)}[name], n)

    return get


# CNN units: conv2, batch_norm2 (its scale and bias, and its statistics updated inside the unit's call) and
# linear1; conv1, batch_norm1, both Dropouts and linear2 are the root's (state in the root). The three ways
# of keeping a unit for its backward alternate.
@pytest.mark.parametrize("mesh_key, mode", [(1, "keep"), (3, "remat"), (8, "reshard"), ("2x4", "keep")])
def test_cnn_with_batchnorm_and_dropout_matches_data_parallel_nnx(x64, models, reference, mnist, mesh_key,
                                                                   mode):
    images, labels = mnist
    model = models["cnn"]
    fsdp = shard(model, mesh_key, units=["conv2", "batch_norm2", "linear1"], **MODES[mode])
    losses, params, model_state = train(fsdp, model, images, labels)
    ref_losses, ref_params, ref_state = reference("cnn", DEVICES[mesh_key])
    assert_float64_run(losses, params, model_state, ref_losses, ref_params, ref_state)
    counts = state_leaves(model_state)
    counts = [v for k, v in counts.items() if "['count']" in k]
    assert len(counts) == 2 and all((c == STEPS).all() for c in counts)  # both Dropouts: a mask per step


# ViT units: the encoder blocks (attention dropout, MLP dropouts and a counter inside each); the patch
# embedding, class token, position embeddings, embedding Dropout, a 0-d logit scale and a counter in the root.
@pytest.mark.parametrize("mesh_key, mode", [(1, "reshard"), (3, "keep"), (8, "remat"), ("2x4", "reshard")])
def test_vit_with_dropout_matches_data_parallel_nnx(x64, models, reference, cifar_like, mesh_key, mode):
    images, labels = cifar_like
    model = models["vit"]
    fsdp = shard(model, mesh_key, units="blocks.*", **MODES[mode])
    losses, params, model_state = train(fsdp, model, images, labels)
    ref_losses, ref_params, ref_state = reference("vit", DEVICES[mesh_key])
    assert_float64_run(losses, params, model_state, ref_losses, ref_params, ref_state)
    assert params["logit_scale"].shape == () and params["logit_scale"] != 1.0  # the 0-d Param trained
    calls = [v for k, v in state_leaves(model_state).items() if "['calls']" in k]
    assert len(calls) == 1 + BLOCKS and all((c == STEPS).all() for c in calls)  # per device, root and blocks
    assert int(model.calls[...]) == 0  # the user's model is never changed


def test_sync_batch_stats_equals_single_device_training_on_the_global_batch(x64, models, reference, mnist):
    """With ``sync_batch_stats=True`` BatchNorm normalizes by the global batch's statistics (the
    data-parallel mean of the devices' means and of their squares' means), so 8 devices (and HSDP 2 x 4)
    equal plain single-device training, running statistics included, on every device (Dropout off: its
    masks are equal in distribution only)."""
    images, labels = mnist
    model = models["cnn_no_dropout"]
    ref_losses, ref_params, ref_state = reference("cnn_no_dropout", 1)
    for mesh_key in (8, "2x4"):
        fsdp = shard(model, mesh_key, units=["conv2", "batch_norm2", "linear1"], sync_batch_stats=True)
        losses, params, model_state = train(fsdp, model, images, labels)
        stats, ref_stats = (nnx.filter_state(s, nnx.BatchStat) for s in (model_state, ref_state))
        for d in range(8):
            assert_float64_run(losses, params, fsdp.full_model_state(stats, d), ref_losses, ref_params,
                               fsdp.full_model_state(ref_stats, 0))
    fsdp = shard(model, 8, units=["conv2", "batch_norm2", "linear1"])  # per device by default: differs
    assert rel_err(train(fsdp, model, images, labels)[0], ref_losses) > 1e-3


class _DropBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(64, 64, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)  # draws from the stream its caller passes

    def __call__(self, x, rngs):
        return self.dropout(self.linear(x), rngs=rngs)


class _DropNet(nnx.Module):
    """A unit whose Dropout draws from the root's ``nnx.Rngs`` (passed to the unit's call, as flax's newer
    tutorials pass ``rngs`` to ``__call__``), and a Dropout in the root with its own stream."""

    def __init__(self, rngs):
        self.block = _DropBlock(rngs)
        self.out = nnx.Linear(64, 64, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.rngs = nnx.Rngs(dropout=1)

    def __call__(self, x):
        return self.block(x, self.rngs), self.dropout(self.out(x))


@pytest.mark.parametrize("mode", ["keep", "remat"])
def test_dropout_draws_a_new_mask_every_step_and_on_every_device(mode):
    """Two devices given equal rows, no learning: the masks (inside the unit and in the root) are returned
    as aux, averaged over the devices, so an element that is 0.5 was kept on one device only. Dropped
    fraction over both devices and steps: Binomial(2048, 0.5) per module, within 4 sigma of one half."""
    model = _DropNet(nnx.Rngs(0))
    fsdp = shard_model(model, make_mesh((2,), ("fsdp",)), units="block", **MODES[mode])
    opt = optax.sgd(0.0)

    def loss_fn(outputs, targets):
        return jnp.mean(outputs[0]) * 0, tuple((o == 0).astype(jnp.float32) for o in outputs)

    step, buffers = fsdp.train_step(opt, loss_fn), fsdp.shard_params(model)
    state, model_state = fsdp.init(opt, buffers), fsdp.shard_model_state(model)
    x = jnp.tile(jnp.ones((1, 64)) + jnp.arange(64.0) / 64, (8, 1))  # every row alike, no zero in linear(x)
    masks = []
    for _ in range(2):
        buffers, state, _, aux, model_state = step(buffers, state, x, x, model_state)
        masks.append([np.asarray(a) for a in aux])
    for m in (0, 1):  # the unit's, the root's
        assert not np.array_equal(masks[0][m], masks[1][m])  # fresh every step
        assert (masks[0][m] == 0.5).any() and (masks[1][m] == 0.5).any()  # different per device
        dropped = (masks[0][m].mean() + masks[1][m].mean()) / 2
        assert abs(dropped - 0.5) <= 4 * np.sqrt(0.25 / 2048), dropped
    assert (np.asarray(model_state["rngs"]["dropout"]["count"][...]) == 2).all()


def test_abstract_model_with_batchnorm_and_dropout_initializes_all_its_state(x64, mnist):
    """``nnx.eval_shape`` + ``init_params`` + ``init_model_state``, with remat: the same training as from
    the built model (Params and model state from the same seed), in float64. The model draws its Params in
    float64 (``param_dtype``; BatchNorm keeps its statistics in fp32 whatever it is given, hence the
    float64 copy): the jitted init and the eager one round the initializers' arithmetic differently, so
    fp32 draws differ in the last bit (1.5e-8 and 4.5e-8 on the two Linear kernels), float64 draws by
    float64 rounding only. Measured: 0 (the two inits and trainings equal)."""
    images, labels = mnist
    make = lambda: float64(CNN(nnx.Rngs(0), rate=0.2, param_dtype=jnp.float64))  # noqa: E731
    fsdp = shard(nnx.eval_shape(make), 3, units=["conv2", "batch_norm2", "linear1"], remat=True)
    got = train(fsdp, None, images[:2], labels[:2], buffers=fsdp.init_params(make),
                model_state=fsdp.init_model_state(make))
    model = make()
    want = train(shard(model, 3, units=["conv2", "batch_norm2", "linear1"], remat=True), model, images[:2],
                 labels[:2])
    assert_float64_run(*got, *want, bound=float64_bound(2))


def _decay_matrices_sgd() -> optax.GradientTransformation:
    """Weight decay on the matrices only, then SGD with momentum: not one element-wise program for every
    parameter, so the step runs it on the parameters' pieces (a ``ShardedState``)."""
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    return optax.chain(optax.add_decayed_weights(1e-2, mask=mask), sgd())


@pytest.mark.parametrize("target, opt", [(3, sgd), ("2x2", _decay_matrices_sgd)])
def test_training_moves_to_another_mesh_with_its_optimizer_and_model_state(x64, models, target, opt):
    """Issue 35: three steps at 4 devices, then two on a mesh of other devices (3, HSDP 2 x 2) by the
    documented path: ``full_params``, ``full_optimizer_state``, ``full_model_state(device=0)`` copied into
    a fresh model, then the new FSDP's ``shard_params``, ``shard_optimizer_state``, ``shard_model_state``
    (all of which take the old mesh's arrays, or one device's). The reference is flax and optax on one
    device doing the same: 4-way data parallelism, then device 0's model state re-stacked for the new size
    (its RNG keys folded with the new devices' indices) and data parallelism at that size. BatchNorm
    statistics, Dropout counts and keys, the user's optimizer state (momentum; the masked decay's pieces)
    all carry over. In float64, within float64_bound of the 5 steps (measured 1.2e-16)."""
    opt = opt()
    images, labels = image_batches((28, 28, 1), steps=5, dtype=np.float64)
    model, units = models["cnn"], ["conv2", "batch_norm2", "linear1"]
    fsdp4 = shard(model, 4, units=units)
    buffers = fsdp4.shard_params(model)
    opt_state, model_state = fsdp4.init(opt, buffers), fsdp4.shard_model_state(model)
    step, losses = fsdp4.train_step(opt, cross_entropy), []
    for x, y in zip(images[:3], labels[:3]):
        buffers, opt_state, loss, model_state = step(buffers, opt_state, x, y, model_state)
        losses.append(float(loss))

    fresh = float64(CNN(nnx.Rngs(1), rate=0.2))
    nnx.update(fresh, fsdp4.full_model_state(model_state, device=0))
    fsdp = shard(fresh, target, units=units)
    buffers = fsdp.shard_params(fsdp4.full_params(buffers))
    opt_state = fsdp.shard_optimizer_state(opt, fsdp4.full_optimizer_state(opt, opt_state))
    model_state = fsdp.shard_model_state(fresh)
    assert_state_close(fsdp.init_model_state(lambda: fresh), model_state, 0.0)  # the same from a closure
    one_device = jax.device_put(nnx.state(fresh, nnx.Not(nnx.Param)), jax.devices()[7])  # and from one device
    assert_state_close(fsdp.stack_model_state(one_device), model_state, 0.0)
    step = fsdp.train_step(opt, cross_entropy)
    for x, y in zip(images[3:], labels[3:]):
        buffers, opt_state, loss, model_state = step(buffers, opt_state, x, y, model_state)
        losses.append(float(loss))

    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    ref_losses, params, ref_opt, states = data_parallel_steps(
        graphdef, params, opt.init(params), per_device_state(state, 4), images[:3], labels[:3], 4, opt)
    n = DEVICES[target]
    states = per_device_state(jax.tree.map(lambda a: a[0], states), n)
    more, params, ref_opt, states = data_parallel_steps(graphdef, params, ref_opt, states, images[3:],
                                                        labels[3:], n, opt)
    assert_float64_run(losses, {k: np.asarray(v) for k, v in fsdp.full_params(buffers).items()}, model_state,
                       ref_losses + more, {k: np.asarray(v) for k, v in flatten_params(params).items()},
                       states, bound=float64_bound(5))
    got_opt, want_opt = (jax.tree.leaves(o) for o in (fsdp.full_optimizer_state(opt, opt_state), ref_opt))
    assert len(got_opt) == len(want_opt) and all(
        near_error(a, b) <= float64_bound(5) for a, b in zip(got_opt, want_opt))


def test_a_model_with_state_needs_its_model_state(mnist):
    model = CNN(nnx.Rngs(0))
    fsdp = shard(model, 1, units=["conv2"])
    opt = sgd()
    buffers = fsdp.shard_params(model)
    step, x, y = fsdp.train_step(opt, cross_entropy), *[a[0] for a in mnist]
    with pytest.raises(TypeError, match=r"batch_norm1\.mean.*model_state=fsdp\.shard_model_state"):
        step(buffers, fsdp.init(opt, buffers), x, y)
    other = shard(model, 3, units=["conv2"]).shard_model_state(model)  # 3 copies, for 3 devices
    with pytest.raises(LayoutMismatchError, match=r"batch_norm1\.mean has shape \(3, 8\).*1 here"):
        step(buffers, fsdp.init(opt, buffers), x, y, other)
    with pytest.raises(LayoutMismatchError, match="not this model's"):
        step(buffers, fsdp.init(opt, buffers), x, y, shard(ViT(nnx.Rngs(0)), 1, units="blocks.*")
             .shard_model_state(ViT(nnx.Rngs(0))))


def test_int_params_are_refused_by_name():
    model = CNN(nnx.Rngs(0))
    model.linear2.bias = nnx.Param(jnp.zeros((10,), jnp.int32))
    with pytest.raises(UnitError, match=r"'linear2\.bias'.*int32.*nnx\.Variable"):
        shard(model, 1, units=["conv2"])
    with pytest.raises(UnitError, match=r"'b'.*int32.*inputs"):
        shard(lambda p, x: x * p["w"], 1, params={"w": jnp.ones(3), "b": jnp.zeros(3, jnp.int32)},
              units=["w"])
