"""Two vision models written as flax's tutorials write them, with state besides their Params, and their
single-device reference training.

- ``CNN``: flax's MNIST tutorial CNN (conv, BatchNorm, Dropout, conv, BatchNorm, avg-pool, linear,
  Dropout, linear) on MNIST shapes (28 x 28 x 1, 10 classes), widths 8 / 16 / 64 instead of the
  tutorial's 32 / 64 / 256 so that a CPU test compiles and runs in seconds.
- ``ViT``: the JAX AI stack tutorial's vision transformer, small: patch embedding, class token, learned
  position embeddings, embedding Dropout, pre-norm encoder blocks (MultiHeadAttention with attention
  dropout, an MLP with Dropout), a final LayerNorm and a linear head. Added to it: a learned 0-d logit
  scale (a scalar Param) and two user ``nnx.Variable`` counters, one in the root and one in each block,
  which the forward increments.

``train_data_parallel`` is the reference: plain flax NNX and optax on one device, running N-way data
parallelism as its definition says: device ``d`` takes rows ``[d * B / N, (d + 1) * B / N)`` of each batch
with its own copy of the model state (its own BatchNorm statistics; its RNG keys folded with ``d`` when
N > 1), the loss is the mean of the devices' losses and one AdamW step updates the Params. At N = 1 it is
ordinary single-device ``nnx`` training.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_backend import flatten_params
from tests.jax_backend.jax_reference import float64

BATCH, STEPS, CLASSES = 24, 3, 10


class CNN(nnx.Module):
    """flax's MNIST tutorial CNN (smaller widths): images (B, 28, 28, 1) -> logits (B, 10)."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.025, param_dtype=jnp.float32):
        kw = {"rngs": rngs, "param_dtype": param_dtype}  # float64 under x64: drawn in float64 too
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), **kw)
        self.batch_norm1 = nnx.BatchNorm(8, **kw)
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), **kw)
        self.batch_norm2 = nnx.BatchNorm(16, **kw)
        self.linear1 = nnx.Linear(7 * 7 * 16, 64, **kw)
        self.dropout2 = nnx.Dropout(rate=rate, rngs=rngs)
        self.linear2 = nnx.Linear(64, CLASSES, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        pool = lambda h: nnx.avg_pool(h, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
        x = pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
        x = pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x)))
        return self.linear2(x)


class CallCount(nnx.Variable):
    """A user's own Variable kind: how many times a module ran."""


# Two encoder blocks, each a unit with its Dropouts and counter, one after the other (the step treats every
# unit alike, whatever its place): a third covered nothing more and cost ~40% more compile time (the
# 8-device remat step: 3.0 s of CPU, 2.2 s with two).
IMAGE, PATCH, DIM, HEADS, MLP, BLOCKS = 16, 4, 32, 4, 64, 2


class EncoderBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, rate: float):
        self.norm1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, dropout_rate=rate, broadcast_dropout=False,
                                           decode=False, deterministic=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(DIM, MLP, rngs=rngs), nnx.gelu, nnx.Dropout(rate, rngs=rngs),
                                  nnx.Linear(MLP, DIM, rngs=rngs), nnx.Dropout(rate, rngs=rngs))
        self.calls = CallCount(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls[...] += 1
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nnx.Module):
    """A small vision transformer: images (B, 16, 16, 3) -> logits (B, 10)."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.1):
        patches = (IMAGE // PATCH) ** 2
        self.patch_embed = nnx.Conv(3, DIM, kernel_size=(PATCH, PATCH), strides=(PATCH, PATCH), rngs=rngs)
        self.cls_token = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, 1, DIM)))
        self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, patches + 1, DIM)))
        self.dropout = nnx.Dropout(rate, rngs=rngs)
        self.blocks = nnx.List([EncoderBlock(rngs, rate) for _ in range(BLOCKS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, CLASSES, rngs=rngs)
        self.logit_scale = nnx.Param(jnp.asarray(1.0))  # 0-d
        self.calls = CallCount(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls[...] += 1
        x = self.patch_embed(x)
        x = x.reshape(x.shape[0], -1, DIM)
        cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, DIM))
        x = self.dropout(jnp.concatenate([cls, x], axis=1) + self.pos_embed[...])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0])) * self.logit_scale[...]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def adamw() -> optax.GradientTransformation:
    return optax.adamw(3e-3, weight_decay=0.1)


def sgd() -> optax.GradientTransformation:
    """SGD with momentum, the model-state tests' optimizer: its update is linear in the gradient, so the
    rounding of a gradient that is zero in exact arithmetic (a bias before BatchNorm, attention's key
    bias) is not amplified as AdamW's division by sqrt(nu) would."""
    return optax.sgd(0.05, momentum=0.9)


@functools.cache
def float64_model(kind: str, rate: float) -> nnx.Module:
    """``CNN`` or ``ViT`` (``kind``: "cnn", "vit") from seed 0 with Dropout ``rate``, in float64
    (jax_reference.float64: Params and BatchNorm statistics), built once per session (training never
    changes a user's model)."""
    return float64((CNN if kind == "cnn" else ViT)(nnx.Rngs(0), rate=rate))


IMAGE_SHAPES = {"cnn": (28, 28, 1), "vit": (16, 16, 3)}


@functools.cache
def float64_reference(kind: str, rate: float, n: int) -> tuple[list, dict, nnx.State]:
    """``train_data_parallel`` of ``float64_model(kind, rate)`` at ``n`` devices with ``sgd()`` on the
    float64 ``image_batches`` of its shape, under x64: trained once per session (test_model_state and
    test_orbax share the CNN's one-device run)."""
    images, labels = image_batches(IMAGE_SHAPES[kind], dtype=np.float64)
    with jax.enable_x64(True):
        return train_data_parallel(float64_model(kind, rate), images, labels, n, sgd())


def image_batches(shape: tuple[int, ...], steps: int = STEPS,
                  dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` batches of images ``(BATCH, *shape)`` (``dtype``: float64 for the float64 tests, the
    fp32 images exactly) and integer labels ``(BATCH,)``."""
    rng = np.random.default_rng(0)
    return (rng.normal(size=(steps, BATCH, *shape)).astype(np.float32).astype(dtype),
            rng.integers(0, CLASSES, size=(steps, BATCH)).astype(np.int32))


def per_device_state(state: nnx.State, n: int) -> nnx.State:
    """``state`` once per device on dim 0, typed PRNG keys folded with the device's index when n > 1."""
    def stack(x):
        if n > 1 and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jnp.stack([jax.random.fold_in(x, d) for d in range(n)])
        return jnp.stack([x] * n)

    return jax.tree.map(stack, state)


def train_data_parallel(model: nnx.Module, images: np.ndarray, labels: np.ndarray, n: int,
                        opt: optax.GradientTransformation | None = None) -> tuple[list, dict, nnx.State]:
    """N-way data parallelism run on one device with flax and optax (see the module docstring).

    Returns the losses, the final Params ``{fqn: np.ndarray}`` and the per-device model state
    (dim 0: the device)."""
    opt = adamw() if opt is None else opt
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    losses, params, _, states = data_parallel_steps(graphdef, params, opt.init(params),
                                                    per_device_state(state, n), images, labels, n, opt)
    return losses, {k: np.asarray(v) for k, v in flatten_params(params).items()}, states


def data_parallel_steps(graphdef: nnx.GraphDef, params: nnx.State, opt_state: Any, states: nnx.State,
                        images: np.ndarray, labels: np.ndarray, n: int,
                        opt: optax.GradientTransformation) -> tuple[list, nnx.State, Any, nnx.State]:
    """``train_data_parallel``'s steps from given Params, optimizer state and per-device model states:
    the losses and the three after the steps (to continue the run, at another ``n`` too)."""
    def device_loss(p, st, x, y):
        m = nnx.merge(graphdef, p, jax.tree.map(lambda a: a, st))
        loss = cross_entropy(m(x), y)
        return loss, nnx.state(m, nnx.Not(nnx.Param))

    @jax.jit
    def step(p, s, sts, x, y):
        def loss_fn(q):
            split = lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:])  # noqa: E731
            losses, new = jax.vmap(device_loss, in_axes=(None, 0, 0, 0))(q, sts, split(x), split(y))
            return jnp.mean(losses), new

        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, new, loss

    losses = []
    for x, y in zip(images, labels):
        params, opt_state, states, loss = step(params, opt_state, states, x, y)
        losses.append(float(loss))
    return losses, params, opt_state, states


def near_error(a, b) -> float:
    """``||a - b||`` over ``max(||b||, sqrt(numel))``: relative for tensors of RMS one or more, absolute RMS
    below. Values near zero are sums that cancel (biases near their zero init, BatchNorm's mean of
    activations centred near zero: 1e-5 for batch_norm1): they carry the rounding of their terms, of RMS
    about one, and relative to themselves it is of order one."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), np.sqrt(b.size)))


def assert_params_near(got: dict, want: dict, tol: float) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert near_error(got[k], want[k]) <= tol, (k, near_error(got[k], want[k]))


def state_leaves(state) -> dict:
    """``{path: np.ndarray}`` of a model state, PRNG keys as their key data."""
    def plain(x):
        return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return {jax.tree_util.keystr(p): plain(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def assert_state_close(got, want, rtol):
    got, want = state_leaves(got), state_leaves(want)
    assert list(got) == list(want)
    for k in want:
        if np.issubdtype(want[k].dtype, np.floating):
            assert near_error(got[k], want[k]) <= rtol, (k, near_error(got[k], want[k]), got[k], want[k])
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
