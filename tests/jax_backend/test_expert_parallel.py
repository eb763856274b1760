"""Expert parallelism composed with ragged FSDP (``parallelize_moe``) on 4 and 8 host devices.

Five AdamW steps at (ep, fsdp) = (1, 4), (2, 2), (4, 1) on 4 devices and (2, 2) with 2 HSDP replicas on 8
(float64; bf16 at (2, 4) and (2, 2) x 2 on 8), for per-expert modules (mixtral-tiny) and fused experts with
biases (gpt-oss-tiny), equal single-device training of the whole MoE (``jax.grad`` of the unsharded model,
``optax.adamw`` on its pytree). The reference's loss is the mean of the device batches' losses, computed
apart: the load-balancing loss is a product of per-batch means, so data-parallel training defines it per
device's batch.

Experts go empty, forced by the data and the router: the devices at fsdp index 0 (one per EP rank and
replica; at fsdp = 1 every device) see one token repeated, so their tokens route alike and reach
``top_k`` experts only, and gpt-oss-tiny's first MoE layer has a router bias of +5 on experts
0 .. top_k-1, so there every token goes to them and the other EP ranks' experts receive nothing. Step 0
repeats one token in every row but for its first two positions. The test asserts, from the reference's
routing, that some experts received no row from their EP group in some step and, for ep > 1, that some EP
rank's experts all did.

Bounds: the fp32 cases train in float64 (the ``x64`` fixture, a float64 copy of the model and reference),
within ``jax_reference.float64_bound``: 5 steps of 1e5 float64 eps, 1.1e-10. The sharded step sums each
gradient in another order (an expert's over the devices of its EP group and then its fsdp peers, the rest
by reduce-scatter) and AdamW divides by sqrt(nu), which amplifies that rounding where a gradient is near
zero, most at fsdp = 1, whose data after step 0 is one token per step on every device (in fp32: 1.1e-5 on
``layers.1.attention.wq.weight`` of gpt-oss-tiny at (4, 1), 1.4e-6 at (2, 2) x 2, CPU-dependent). Measured
in float64 on parameters (mixtral-tiny; gpt-oss-tiny): (1, 4) 1.4e-15; 2.6e-15, (2, 2) 2.4e-15; 3.1e-15,
(4, 1) 2.8e-14; 2.3e-14, (2, 2) x 2 9.0e-15; 5.7e-15; losses within 2.2e-16. A token routed to another
expert would move its layer's output by ~1e-2, far outside the bound.

bf16 under the mixed-precision policy (bf16 gathers, compute and all-to-all; fp32 reduce and masters) at
(2, 4) and (2, 2) x 2 replicas, against the policy reference (each device batch on its own bf16 copy of the
fp32 parameters, the gradients cast back and summed in fp32). EP cannot meet a float64 bound here: an
expert's gradient is one bf16 dot over the rows of every EP rank where the reference rounds each device's
to bf16, and a token whose top-k gap is below bf16 rounding changes experts. The bound is the spread of the
policy reference over ``SPREAD_ORDERS`` orders that sum the devices' bf16 gradients in bf16 (each partial
sum rounded to bf16, as the one GEMM rounds; the device batches, and each one's rows, in another order:
``reordered``), the worst tensor's distance (``tests.parity.assert_within_spread``), as on torch
(tests/torch_backend/test_fsdp_moe.py), and all parameters as one vector's (``whole_model``): the worst
tensor spreads by the tokens that bf16 moves to another expert, which hides a bug that moves every expert
a little. Measured (mixtral-tiny / gpt-oss-tiny, (2, 4) then (2, 2) x 2), of the spread: worst tensor
0.10, 0.11 / 1.10, 0.54; whole model 0.13, 0.10 / 0.59, 0.32; losses 0.05, 0.09 / 0.18, 0.09. With the
last EP rank's gradient dropped (experiments/bug_injection.py) gpt-oss-tiny's whole model is 12 and 11
times its spread; mixtral-tiny's 4.3 and 3.5, about the margin (its orders move tokens between experts
far more), so that bug is caught here on gpt-oss-tiny and by the float64 cases on both.

Capacity: with ``capacity_factor=0.5``, each device's dropped (token, expert) assignments per MoE layer
equal a numpy count (``sum_e max(0, n_e - C)``) over the routing of a single-device forward that drops the
same assignments (the first ``C`` per expert in token order are kept), and the losses agree.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_backend import MixedPrecisionPolicy, make_mesh, on_shards
from jax_backend.models import model_params
from jax_backend.models.expert_parallel import parallelize_moe
from jax_backend.models.llama import FeedForward
from jax_backend.models.moe import MoEDecoder, load_balancing_loss, moe_loss, route_tokens
from ragged.models import MOE_CONFIGS
from tests.jax_backend.jax_reference import (
    SPREAD_ORDERS,
    assert_float64_parity,
    assert_within_spread,
    float64,
    float64_bound,
    rel_err,
)

DEVICES, ROWS, SEQ, STEPS, LR = 8, 2, 8, 5, 1e-2  # ROWS per device; DEVICES: the bf16 and capacity tests'
CASES = [(1, 4, 1), (2, 2, 1), (4, 1, 1), (2, 2, 2)]  # (ep, fsdp, replica), on ep * fsdp * replica devices
BF16_CASES = [(2, 4, 1), (2, 2, 2)]
MODELS = ["mixtral-tiny", "gpt-oss-tiny"]
ADAMW = optax.adamw(LR, weight_decay=0.1)
BF16_RTOL = 2e-2  # a few bf16 epsilons (2^-8), as tests/torch_backend/test_fsdp_moe.py


def build(name: str) -> MoEDecoder:
    c = MOE_CONFIGS[name]
    model = MoEDecoder(c, rngs=nnx.Rngs(0))
    if c.router_bias:  # first MoE layer: every token to experts 0 .. top_k-1 (EP rank 0 for ep <= 2)
        router = model.layers[c.n_dense_layers].feed_forward.router
        router.bias[...] = router.bias[...].at[:c.top_k].add(5.0)
    return model


def batches(vocab: int, fsdp: int, devices: int = DEVICES) -> np.ndarray:
    """(STEPS, devices * ROWS, SEQ + 1) token ids, device d's rows at [d ROWS, (d+1) ROWS)."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, vocab, size=(STEPS, devices * ROWS, SEQ + 1)).astype(np.int32)
    data[0, :, 2:] = data[0, :, 2:3]  # step 0: one token per row but for two positions
    at_fsdp_0 = [d for d in range(devices) if d % fsdp == 0]
    for s in range(1, STEPS):
        for d in at_fsdp_0:
            data[s, d * ROWS:(d + 1) * ROWS] = data[s, 0, 0]  # one token: routes to top_k experts only
    return data


def device_loss(graphdef: nnx.GraphDef, params: nnx.State, batch: jax.Array, coef: float) -> jax.Array:
    """One device batch's loss, token ids (ROWS, SEQ + 1)."""
    return moe_loss(nnx.merge(graphdef, params)(batch[:, :-1]), batch[:, 1:], coef)


@functools.cache
def device_grad(graphdef: nnx.GraphDef, coef: float, dtype):
    """Jitted: one device batch's ``device_loss`` and its gradient, taken on the device's own ``dtype`` copy
    of the parameters (None: on them), so in ``dtype`` (the mixed-precision policy's gradient before its
    exact cast back to fp32). One program per model and dtype for every device count, optimizer and way of
    summing (jit keys its own cache on x64 too): compiling is most of these tests' time."""
    def grad(params, batch):
        low = params if dtype is None else jax.tree.map(lambda a: a.astype(dtype), params)
        return jax.value_and_grad(lambda p: device_loss(graphdef, p, batch, coef))(low)

    return jax.jit(grad)


@jax.jit
def plus(total, grads):
    """``total + grads`` leaf by leaf, rounded to ``total``'s dtypes."""
    return jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)


@functools.cache
def reference_update(opt: optax.GradientTransformation):
    """Jitted: ``opt``'s step on the mean gradient and the mean loss, from ``total``, the sums of ``n``
    devices' (the gradients cast back to the parameters' dtype, then divided: ``n`` is traced, one program
    for every device count)."""
    @jax.jit
    def update(params, state, total, n):
        loss, grads = total[0] / n, jax.tree.map(lambda g, p: g.astype(p.dtype) / n, total[1], params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return update


def train_reference(model: MoEDecoder, data: np.ndarray, dtype=None,
                    opt: optax.GradientTransformation = ADAMW,
                    summed_in_dtype: bool = False) -> tuple[list[float], list[dict]]:
    """Single-device ``opt`` (AdamW) of the mean of the device batches' losses (``data.shape[1] // ROWS``
    devices), on one device: each device's gradient taken apart (``device_grad``, forward and backward in
    ``dtype``: the mixed-precision policy's cast copy) and the gradients summed over the devices in their
    order, in fp32 (the policy: each device's gradient cast back before they are summed) or, with
    ``summed_in_dtype``, in ``dtype``, rounded at each partial sum (as expert parallelism's one bf16 GEMM
    over every EP rank's tokens rounds) before it is cast back. The loss per step and the parameters
    before each step and after the last."""
    graphdef, params = nnx.split(model, nnx.Param)
    batches_ = data.reshape(len(data), data.shape[1] // ROWS, ROWS, SEQ + 1)
    grad, update = device_grad(graphdef, model.config.aux_loss_coef, dtype), reference_update(opt)
    # the sums of the losses (in the masters' dtype, as the loss is) and of the gradients
    zeros = (np.zeros((), jax.tree.leaves(params)[0].dtype),
             jax.tree.map(lambda p: np.zeros(p.shape, dtype if summed_in_dtype else p.dtype), params))
    state, losses, history = opt.init(params), [], []
    for b in batches_:
        history.append(model_params(nnx.merge(graphdef, params)))
        total = zeros
        for device_batch in b:
            total = plus(total, grad(params, device_batch))
        params, state, loss = update(params, state, total, len(b))
        losses.append(float(loss))
    history.append(model_params(nnx.merge(graphdef, params)))
    return losses, history


def train_ep(model: MoEDecoder, data: np.ndarray, ep: int, fsdp: int, replica: int,
             capacity_factor: float | None = None, steps: int = STEPS,
             mp_policy: MixedPrecisionPolicy | None = None, on_shards_opt=None,
             granularity="rows:1", reshard_after_forward: bool = True) -> tuple[list[float], dict, list]:
    """``parallelize_moe`` training (with ``granularity``): losses, final full params and each step's
    per-device drop counts. AdamW, or ``on_shards(on_shards_opt(fsdp))`` for a layout-aware optimizer."""
    hsdp = replica > 1
    assert data.shape[1] == replica * ep * fsdp * ROWS, f"data of {data.shape[1] // ROWS} devices, mesh of " \
        f"{replica * ep * fsdp}: each device would train on other rows than the reference's"
    mesh = make_mesh((replica, ep, fsdp), ("replica", "ep", "fsdp")) if hsdp else \
        make_mesh((ep, fsdp), ("ep", "fsdp"))
    runtime = parallelize_moe(model, mesh, replica_axis="replica" if hsdp else None,
                              capacity_factor=capacity_factor, mp_policy=mp_policy,
                              granularity=granularity, reshard_after_forward=reshard_after_forward)
    opt = ADAMW if on_shards_opt is None else on_shards(on_shards_opt(runtime.fsdp))
    buffers = runtime.shard_params(model_params(model))
    state, model_state = runtime.fsdp.init(opt, buffers), runtime.init_model_state()
    step = runtime.fsdp.train_step(opt, lambda out, y: moe_loss(out, y, model.config.aux_loss_coef))
    losses, drops = [], []
    for b in data[:steps]:
        buffers, state, loss, model_state = step(buffers, state, b[:, :-1], b[:, 1:], model_state)
        losses.append(float(loss))
        drops.append(runtime.dropped(model_state))
    return losses, {k: np.asarray(v) for k, v in runtime.full_params(buffers).items()}, drops


def kept(chosen: np.ndarray, n_experts: int, capacity: int) -> np.ndarray:
    """(N, k) bool: each expert keeps its first ``capacity`` assignments in token order."""
    flat = chosen.reshape(-1)
    seen = np.zeros(n_experts, np.int64)
    keep = np.zeros(flat.shape, bool)
    for i, e in enumerate(flat):
        keep[i] = seen[e] < capacity
        seen[e] += 1
    return keep.reshape(chosen.shape)


def routed_forward(model: MoEDecoder, tokens: np.ndarray, capacity: int | None) -> tuple[jax.Array, list]:
    """One device's single-device forward, dropping each MoE layer's assignments past ``capacity`` (then
    eagerly: the kept assignments are counted on the host): its loss inputs ``(logits, aux)`` and each MoE
    layer's chosen experts (N, k)."""
    c = model.config
    h, aux, routes = model.tok_embeddings(jnp.asarray(tokens)), [], []
    for layer in model.layers:
        h = h + layer.attention(layer.attention_norm(h))
        x = layer.ffn_norm(h)
        if isinstance(layer.feed_forward, FeedForward):
            h = h + layer.feed_forward(x)
            continue
        moe, (b, t, d) = layer.feed_forward, x.shape
        flat = x.reshape(b * t, d)
        weights, chosen, probs = moe.router(flat)
        routes.append(chosen)
        if capacity is not None:
            weights = weights * jnp.asarray(kept(np.asarray(chosen), c.n_experts, capacity))
        out = route_tokens(moe.experts(jnp.broadcast_to(flat, (c.n_experts, b * t, d))), weights, chosen)
        if moe.shared_expert is not None:
            out = out + moe.shared_expert(flat)
        h = h + out.reshape(b, t, d)
        aux.append(load_balancing_loss(probs, chosen))
    return (model.output(model.norm(h)), jnp.mean(jnp.stack(aux))), routes


_REFERENCES: dict[tuple, tuple] = {}


def reference(name: str, fsdp: int, devices: int,
              dtype=jnp.float64) -> tuple[list[float], list[dict], np.ndarray]:
    """``train_reference`` of ``name`` on ``batches(vocab, fsdp, devices)``, once per process: the float64
    model (under x64: its history is numpy, for the fp32 and bf16 tests alike), or ``dtype`` compute on
    fp32 masters."""
    key = (name, fsdp, devices, jnp.dtype(dtype).name)
    if key not in _REFERENCES:
        model = build(name)
        data = batches(model.config.vocab_size, fsdp, devices)
        if dtype == jnp.float64:
            with jax.enable_x64(True):
                trained = train_reference(float64(model), data)
        else:
            trained = train_reference(model, data, dtype)
        _REFERENCES[key] = (*trained, data)
    return _REFERENCES[key]


def with_params(model: MoEDecoder, params: dict) -> MoEDecoder:
    graphdef, state = nnx.split(model, nnx.Param)
    leaves = [jnp.asarray(params[k]) for k in model_params(model)]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), leaves))


@functools.cache
def device_routes(graphdef: nnx.GraphDef):
    """Jitted: one device's ``routed_forward`` without a capacity on its tokens (ROWS, SEQ), each MoE
    layer's chosen experts (MoE layers, N, k); one program for every device count."""
    return jax.jit(lambda params, tokens:
                   jnp.stack(routed_forward(nnx.merge(graphdef, params), tokens, None)[1]))


def received(name: str, history: list[dict], data: np.ndarray, ep: int, fsdp: int) -> np.ndarray:
    """(STEPS, MoE layers, groups, E): rows each expert received from its EP group (the devices of one
    (replica, fsdp) index), from the reference's routing at each step's parameters."""
    c, model, devices = MOE_CONFIGS[name], build(name), data.shape[1] // ROWS
    counts = []
    for s in range(STEPS):
        graphdef, params = nnx.split(with_params(model, history[s]), nnx.Param)
        routes = device_routes(graphdef)
        n = np.array([[np.bincount(r.reshape(-1), minlength=c.n_experts)
                       for r in np.asarray(routes(params, data[s, d * ROWS:(d + 1) * ROWS, :-1]))]
                      for d in range(devices)])
        # (devices, layers, E), device d = (replica, ep, fsdp)
        by_group = n.reshape(devices // (ep * fsdp), ep, fsdp, *n.shape[1:]).sum(axis=1)  # (R, fsdp, L, E)
        counts.append(by_group.transpose(2, 0, 1, 3).reshape(n.shape[1], -1, c.n_experts))
    return np.array(counts)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("ep,fsdp,replica", CASES)
def test_five_adamw_steps_equal_single_device_training(x64, name, ep, fsdp, replica):
    want_losses, history, data = reference(name, fsdp, ep * fsdp * replica)
    losses, params, drops = train_ep(float64(build(name)), data, ep, fsdp, replica)
    assert all(int(v.sum()) == 0 for step in drops for v in step.values())  # no capacity limit: no drops
    assert_float64_parity(losses, params, (want_losses, history[-1]))
    rows = received(name, history, data, ep, fsdp)  # (steps, layers, groups, E)
    assert (rows == 0).any() and (rows > 0).any(), "no expert went empty: the forcing did not work"
    by_rank = rows.reshape(*rows.shape[:-1], ep, -1).sum(axis=-1)
    assert ep == 1 or (by_rank == 0).any(), "no EP rank's experts went empty: the forcing did not work"


def test_units_kept_gathered_equal_single_device_training(x64):
    """``reshard_after_forward=False`` (every unit kept gathered from its forward to its backward, the other
    of the two ways; the cases above run the default, resharded)."""
    want_losses, history, data = reference("gpt-oss-tiny", 2, 4)
    losses, params, _ = train_ep(float64(build("gpt-oss-tiny")), data, 2, 2, 1, reshard_after_forward=False)
    assert_float64_parity(losses, params, (want_losses, history[-1]))


@pytest.mark.parametrize("name", MODELS)
def test_dropped_assignments_equal_a_numpy_count(x64, name):
    """In float64: the EP step's drops equal the count, and its loss the single-device forward's that
    drops the same assignments, within float64_bound of one step (measured 3.8e-14 mixtral-tiny, 6.6e-15
    gpt-oss-tiny; in fp32 8.6e-8)."""
    ep, fsdp, replica, factor = 2, 4, 1, 0.5
    model, c = float64(build(name)), MOE_CONFIGS[name]
    data = np.random.default_rng(1).integers(0, c.vocab_size, (1, DEVICES * ROWS, SEQ + 1)).astype(np.int32)
    losses, _, drops = train_ep(model, data, ep, fsdp, replica, capacity_factor=factor, steps=1)
    n_tokens = ROWS * SEQ
    capacity = max(1, min(n_tokens, math.ceil(factor * n_tokens * c.top_k / c.n_experts)))
    want_drops, device_loss = [], []
    for d in range(DEVICES):
        x, y = data[0, d * ROWS:(d + 1) * ROWS, :-1], data[0, d * ROWS:(d + 1) * ROWS, 1:]
        out, routes = routed_forward(model, x, capacity)
        device_loss.append(float(moe_loss(out, y, c.aux_loss_coef)))
        counts = [np.bincount(np.asarray(r).reshape(-1), minlength=c.n_experts) for r in routes]
        want_drops.append([int(np.maximum(n - capacity, 0).sum()) for n in counts])
    got = np.array(list(drops[0].values())).T  # (DEVICES, MoE layers)
    np.testing.assert_array_equal(got, np.array(want_drops))
    assert got.sum() > 0, "capacity factor 0.5 dropped nothing: the test would not see drops"
    assert rel_err(losses[0], np.mean(device_loss)) <= float64_bound(1), (losses[0], np.mean(device_loss))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("ep,fsdp,replica", BF16_CASES)
def test_bf16_policy_within_the_spread_of_the_policy_reference(name, ep, fsdp, replica):
    """bf16 gathers, compute and all-to-all, fp32 reduce and masters, against the policy reference (each
    device batch on its own bf16 copy, gradients summed in fp32), within the spread of its other summation
    orders (see the module doc); the case rounds as bf16 does (within BF16_RTOL of float64 training)."""
    exact_losses, _, data = reference(name, fsdp, DEVICES)
    model = build(name)
    policy_ref = train_reference(model, data, jnp.bfloat16)
    orders = [train_reference(model, reordered(data, seed), jnp.bfloat16, summed_in_dtype=True)
              for seed in range(SPREAD_ORDERS)]
    assert 0 < rel_err(policy_ref[0], exact_losses) <= BF16_RTOL  # the case computed in bf16
    losses, params, _ = train_ep(build(name), data, ep, fsdp, replica,
                                 mp_policy=MixedPrecisionPolicy(jnp.bfloat16, jnp.float32))
    assert all(v.dtype == np.float32 for v in params.values())  # masters stay fp32
    assert_within_spread(losses, params, (policy_ref[0], policy_ref[1][-1]),
                         [(o[0], o[1][-1]) for o in orders], whole_model=True)


def reordered(data: np.ndarray, seed: int) -> np.ndarray:
    """``data`` (steps, devices * ROWS, SEQ + 1) with each step's device batches, and each batch's rows, in
    another order: the same training (the loss is the mean of the device batches' losses, each a mean over
    its rows), summed in another order."""
    rng, (steps, n, width) = np.random.default_rng(seed), data.shape
    blocks = data.reshape(steps, n // ROWS, ROWS, width)
    return np.stack([np.stack([b[rng.permutation(ROWS)] for b in step[rng.permutation(len(step))]])
                     for step in blocks]).reshape(data.shape)
