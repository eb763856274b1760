"""Two models that are not the llama, written as a user would: an NNX mixture-of-experts with odd sizes,
biases, LayerNorm, 3-D expert weights, an output head tied to the embedding and a router loss; and a pure
function over a params dict that uses its embedding twice. Plus their single-device training reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_backend import flatten_params

VOCAB, DIM, HIDDEN, EXPERTS, BLOCKS = 37, 21, 29, 3, 3
BATCH, SEQ, STEPS = 24, 7, 5


class MoEBlock(nnx.Module):
    """Pre-norm dense mixture of experts: every expert runs, the router's softmax weights them."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.router = nnx.Linear(DIM, EXPERTS, rngs=rngs)
        self.w_in = nnx.Param(0.2 * jax.random.normal(rngs.params(), (EXPERTS, DIM, HIDDEN)))
        self.b_in = nnx.Param(jnp.zeros((EXPERTS, HIDDEN)))
        self.w_out = nnx.Param(0.2 * jax.random.normal(rngs.params(), (EXPERTS, HIDDEN, DIM)))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = self.norm(x)
        scores = self.router(h)
        probs = jax.nn.softmax(scores, axis=-1)  # (B, T, E)
        hidden = jax.nn.gelu(jnp.einsum("btd,edh->bteh", h, self.w_in[...]) + self.b_in[...])
        out = jnp.einsum("bteh,ehd,bte->btd", hidden, self.w_out[...], probs)
        # The router z-loss (ST-MoE): a mean over tokens, so the mean of the per-device losses is the global
        # one (a loss of batch statistics, like Switch's balance loss, differs per device under any DP).
        z_loss = jnp.mean(jax.nn.logsumexp(scores, axis=-1) ** 2)
        return x + out, z_loss


class TiedHead(nnx.Module):
    """Logits from the embedding table it shares with the model's ``embed`` (the same ``nnx.Variable``)."""

    def __init__(self, table: nnx.Param, rngs: nnx.Rngs):
        self.table = table
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((VOCAB,)))

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.norm(h) @ self.table[...].T + self.bias[...]


class MoE(nnx.Module):
    """Token ids (B, T) -> (logits (B, T, VOCAB), router loss)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([MoEBlock(rngs) for _ in range(BLOCKS)])
        self.head = TiedHead(self.embed.embedding, rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        h, router_loss = self.embed(tokens), 0.0
        for block in self.blocks:
            h, z = block(h)
            router_loss = router_loss + z
        return self.head(h), router_loss


def moe_loss(outputs: tuple, targets: jax.Array) -> tuple[jax.Array, dict]:
    logits, router_loss = outputs
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    return ce + 0.01 * router_loss, {"router_loss": router_loss}


def mlp_params(seed: int = 0) -> dict:
    """A pure-function model's params: an embedding (also the output head), layers of biased MLPs."""
    keys = iter(jax.random.split(jax.random.key(seed), 3 * BLOCKS + 1))
    layer = lambda: {"w1": 0.2 * jax.random.normal(next(keys), (DIM, HIDDEN)), "b1": jnp.zeros(HIDDEN),
                     "w2": 0.2 * jax.random.normal(next(keys), (HIDDEN, DIM)),
                     "scale": 1 + 0.1 * jax.random.normal(next(keys), (DIM,))}
    return {"embed": jax.random.normal(next(keys), (VOCAB, DIM)), "layers": [layer() for _ in range(BLOCKS)],
            "out_bias": jnp.zeros(VOCAB)}


def mlp_apply(params: dict, tokens: jax.Array) -> jax.Array:
    h = params["embed"][tokens]
    for layer in params["layers"]:
        h = h + jnp.tanh(h @ layer["w1"] + layer["b1"]) @ layer["w2"] * layer["scale"]
    return h @ params["embed"].T + params["out_bias"]  # the embedding again: a tied head


def mlp_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def adamw() -> optax.GradientTransformation:
    return optax.adamw(3e-3, weight_decay=0.1)


def batches() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, size=(STEPS, BATCH, SEQ + 1)).astype(np.int32)


def _with_aux(out):
    return out if isinstance(out, tuple) else (out, None)


def train_reference(apply, params, loss_fn, data, opt=None,
                    micro_batches: int = 1) -> tuple[list[float], dict]:
    """Plain single-device training: ``jax.grad`` of ``loss_fn(apply(params, x), y)``, optax on the pytree
    (``adamw()`` unless ``opt`` is given): the loss per step and the final ``{fqn: array}``.

    With ``micro_batches`` > 1, the loss is the mean of that many equal row blocks' losses, each through its
    own ``apply`` (a bf16 ``apply`` rounds each block's gradient to bf16 apart, as a data-parallel device
    does its rows')."""
    return train_references(apply, params, loss_fn, [data], opt, micro_batches)[0]


def train_references(apply, params, loss_fn, datasets, opt=None, micro_batches: int = 1) -> list[tuple]:
    """``train_reference`` on each of ``datasets`` (of one shape) from the same ``params``, one program for
    all: the same training on permuted rows is another summation order (jax_reference's spread bound)."""
    opt = adamw() if opt is None else opt

    def loss_of(q, x, y):
        if micro_batches == 1:
            return _with_aux(loss_fn(apply(q, x), y))[0]
        # The blocks by a scan: one block's forward and backward in the program, not micro_batches copies
        # (llama-tiny's bf16 reference in 4 blocks: 3.9 s of CPU to compile, 8.1 s unrolled), and the same
        # training bit for bit (measured there): each block's cotangent of q still reaches q's dtype
        # apart (a bf16 copy's, rounded per block), then the blocks' are summed.
        def block(_, xy):
            return None, _with_aux(loss_fn(apply(q, xy[0]), xy[1]))[0]

        split = lambda a: a.reshape(micro_batches, a.shape[0] // micro_batches, *a.shape[1:])  # noqa: E731
        return jnp.mean(jax.lax.scan(block, None, (split(x), split(y)))[1])

    @jax.jit
    def step(p, s, x, y):
        loss, grads = jax.value_and_grad(loss_of)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    runs = []
    for data in datasets:
        p, state, losses = params, opt.init(params), []
        for b in data:
            p, state, loss = step(p, state, b[:, :-1], b[:, 1:])
            losses.append(float(loss))
        runs.append((losses, {k: np.asarray(v) for k, v in flatten_params(p).items()}))
    return runs


def nnx_reference(model: nnx.Module, data) -> tuple[list[float], dict]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    apply = lambda p, x: nnx.merge(graphdef, p, rest)(x)  # noqa: E731
    return train_reference(apply, params, moe_loss, data)


def gspmd_step(apply, params, loss_fn, mesh, opt):
    """The GSPMD FSDP baseline: ``jit`` with each parameter's largest dim that the mesh divides sharded
    (replicated when none does), the optimizer state sharded alike, the batch split over the devices.
    Returns ``(jitted step, params, opt_state)``."""
    n = mesh.size

    def sharding(x):
        dims = sorted((d for d in range(x.ndim) if x.shape[d] % n == 0), key=lambda d: -x.shape[d])
        spec = [None] * x.ndim
        if dims:
            spec[dims[0]] = mesh.axis_names[0]
        return NamedSharding(mesh, P(*spec))

    shardings = jax.tree.map(sharding, params)
    state_shardings = jax.tree.map(sharding, jax.eval_shape(opt.init, params))
    params = jax.device_put(params, shardings)
    state = jax.jit(opt.init, out_shardings=state_shardings)(params)

    def step(p, s, x, y):
        out = jax.value_and_grad(lambda q: _with_aux(loss_fn(apply(q, x), y)), has_aux=True)(p)
        (loss, _), grads = out
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    data = NamedSharding(mesh, P(mesh.axis_names[0]))
    jitted = jax.jit(step, in_shardings=(shardings, state_shardings, data, data),
                     out_shardings=(shardings, state_shardings, NamedSharding(mesh, P())),
                     donate_argnums=(0, 1))
    return jitted, params, state
