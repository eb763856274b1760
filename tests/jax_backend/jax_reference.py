"""Helpers of the JAX tests: the single-device reference run and error measures (no fixtures here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx.nn import attention as nnx_attention

from jax_backend import FSDP
from jax_backend.models import Llama, cross_entropy, model_params
from tests import parity
from tests.jax_backend.any_models import train_references as train_pytree_runs
from tests.parity import SPREAD_MARGIN, SPREAD_ORDERS  # noqa: F401 (the JAX tests import them from here)

STEPS = 10
BATCH = 24  # divisible by 1, 2, 3, 4 and 8 devices
SEQ = 16
LR = 1e-3


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LR, weight_decay=0.1)


def train_reference(model: Llama, batches: np.ndarray, compute_dtype=None,
                    opt: optax.GradientTransformation | None = None,
                    micro_batches: int = 1) -> tuple[list[float], dict]:
    """Single-device training (AdamW unless ``opt``); with ``compute_dtype`` the forward runs on a cast
    copy of fp32 masters (one per micro-batch: ``any_models.train_reference``)."""
    return train_references(model, [batches], compute_dtype, opt, micro_batches)[0]


def train_references(model: Llama, datasets: list, compute_dtype=None,
                     opt: optax.GradientTransformation | None = None, micro_batches: int = 1) -> list[tuple]:
    """``train_reference`` on each of ``datasets``, one compiled step for all (``any_models``')."""
    graphdef, params = nnx.split(model, nnx.Param)

    def apply(p, x):
        if compute_dtype is not None:
            p = jax.tree.map(lambda a: a.astype(compute_dtype), p)
        return nnx.merge(graphdef, p)(x)

    return train_pytree_runs(apply, params, cross_entropy, datasets, opt or adamw(), micro_batches)


def run_fsdp(fsdp: FSDP, model: Llama, batches: np.ndarray,
             opt: optax.GradientTransformation | None = None) -> tuple[list[float], dict]:
    """``fsdp.train_step`` from the model's parameters (AdamW unless ``opt``): losses and unit buffers."""
    opt = opt or adamw()
    buffers = fsdp.shard_params(model_params(model))
    state = fsdp.init(opt, buffers)
    step = fsdp.train_step(opt, cross_entropy)
    losses = []
    for b in batches:
        buffers, state, loss = step(buffers, state, b[:, :-1], b[:, 1:])
        losses.append(float(loss))
    return losses, buffers


def train_fsdp(fsdp: FSDP, model: Llama, batches: np.ndarray,
               opt: optax.GradientTransformation | None = None) -> tuple[list[float], dict]:
    """``run_fsdp`` with the final parameters unsharded: losses and ``{fqn: np.ndarray}``."""
    losses, buffers = run_fsdp(fsdp, model, batches, opt)
    return losses, {k: np.asarray(v) for k, v in fsdp.full_params(buffers).items()}


def rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def param_errors(got: dict, want: dict) -> dict:
    """``{fqn: rel_err}`` of each tensor (bf16, fp32 or float64 values, compared in float64)."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return {k: rel_err(got[k], want[k]) for k in want}


def assert_params_close(got: dict, want: dict, rtol: float) -> None:
    errors = param_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, f"{worst}: relative error {errors[worst]:.3g} > {rtol}"


def params_distance(got: dict, want: dict) -> float:
    """The worst tensor's relative error: how far a run's parameters are from the reference's."""
    return max(param_errors(got, want).values())


def float64(model):
    """A copy of ``model`` (an NNX module or a params pytree) with its parameters and its other
    floating-point state (BatchNorm statistics, a user's float Variables) in float64 (exact from fp32;
    integers and RNG keys as they are); use it under ``jax.enable_x64(True)``, where its programs compute
    in float64. Flax layers that fixed their compute ``dtype`` at construction (``nnx.Embed``: its
    table's) compute in float64 too, and so does flax's attention (``unfused_attention``)."""
    with jax.enable_x64(True):
        if not isinstance(model, nnx.Module):
            return jax.tree.map(_to_float64, model)
        graphdef, state = nnx.split(model)
        copy = nnx.merge(graphdef, jax.tree.map(_to_float64, state))
    for _, module in nnx.iter_modules(copy):
        if getattr(module, "dtype", None) == jnp.float32:
            module.dtype = jnp.float64
        if isinstance(module, nnx.MultiHeadAttention) and module.attention_fn is nnx.dot_product_attention:
            module.attention_fn = unfused_attention
    return copy


def _to_float64(a):
    a = jnp.asarray(a)
    return a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a


def unfused_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                      dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                      **kw):
    """``nnx.dot_product_attention`` by its own unfused path (the one it takes with dropout on): without
    dropout it calls ``jax.nn.dot_product_attention``, which takes its softmax in fp32 whatever the
    inputs' dtype (a float64 copy then trains ~1e-5 from its float64 reference)."""
    assert query.shape[-2] == key.shape[-2] == value.shape[-2], "grouped-query heads: not needed here"
    weights = nnx_attention.dot_product_attention_weights(
        query, key, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype,
        precision, module, **kw)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


# Parity bounds (issue 32). A sharded run cannot equal the reference bit for bit: each device sums its own
# rows and the reduce-scatter sums the devices, where the reference sums all rows at once, and AdamW divides
# each gradient element by its own scale, so that rounding grows over the steps wherever a gradient is near
# zero, by an amount that depends on the CPU's kernels. In fp32 it reached 1e-5 on some machines, where a
# bug (a wrong offset, a missing divide) moves a tensor by 1e-3 or more: a bound there sits on the rounding.
# So the parity tests train in float64 (``jax.enable_x64``): the same growth, from eps = 2.2e-16, is bounded
# by F64_GROWTH eps per step. That is ~1e3 times the growth measured in fp32 (at most ~90 eps per step:
# 1.1e-5 in 5 steps of gpt-oss-tiny at (ep, fsdp) = (4, 1)) and ~2e3 times the largest measured in float64
# (5.7e-14 in 5 steps, mixtral-tiny at (4, 1); 3.4e-14 with XLA's ISA limited to AVX2, 1.4e-14 to SSE4.2;
# 2.8e-14 against test_expert_parallel's per-device-gradient reference, which sums the same terms in
# another order), and, at 5 to 10 steps (1e-10 to 2e-10), ~1e7 times below a bug.
FP32_EPS = float(np.finfo(np.float32).eps)  # the fp32 tests' unit: one rounding per step
F64_EPS = float(np.finfo(np.float64).eps)
F64_GROWTH = 1e5


def float64_bound(steps: int) -> float:
    """The largest relative distance float64 rounding may make in ``steps`` steps (see above)."""
    return steps * F64_GROWTH * F64_EPS


def assert_float64_parity(losses, params: dict, reference: tuple) -> dict:
    """Losses and parameters of a float64 run against the float64 ``reference`` (``(losses, {fqn:
    array})``), within ``float64_bound`` of its step count; returns the distances."""
    ref_losses, ref_params = reference
    assert all(np.asarray(v).dtype == np.float64 for v in (*params.values(), *ref_params.values())), \
        "a float64 parity test ran in another dtype: run it under jax.enable_x64(True) on float64 params"
    d = {"loss": rel_err(losses, ref_losses), "params": params_distance(params, ref_params),
         "bound": float64_bound(len(ref_losses))}
    assert d["loss"] <= d["bound"] and d["params"] <= d["bound"], d
    return d


def permuted_rows(batches: np.ndarray, seed: int) -> np.ndarray:
    """``batches`` with each step's rows in another order: the same training (the loss is a mean over
    rows) summed in another order."""
    rng = np.random.default_rng(seed)
    return np.stack([b[rng.permutation(len(b))] for b in batches])


# Cases that must run in fp32 or bf16 (mixed precision, optimizers that compute in fp32) are bounded by
# the spread of the same case's summation orders instead (tests.parity.assert_within_spread): the
# reference trained in micro-batches (the sharded run's device count: a bf16 gradient rounded per block, as
# per device) on SPREAD_ORDERS row permutations of the data, and the run within SPREAD_MARGIN times the
# farthest of them from the reference. Measured: at most 1.7 times the spread (the bf16 step's losses with
# XLA's ISA limited to SSE4.2; 1.3 at the default ISA).


def whole_model_distance(got: dict, want: dict) -> float:
    """``rel_err`` of all parameters as one vector, where each tensor weighs as much as its share of the
    model (the worst tensor's distance weighs a small tensor like the whole)."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return rel_err(np.concatenate([np.ravel(got[k]).astype(np.float64) for k in want]),
                   np.concatenate([np.ravel(want[k]).astype(np.float64) for k in want]))


def assert_within_spread(losses, params: dict, reference: tuple, orders: list[tuple],
                         whole_model: bool = False) -> dict:
    """Losses and parameters of a run against ``reference``, within ``SPREAD_MARGIN`` times the largest
    distance of ``orders`` (the reference's training in other summation orders, ``(losses, params)``
    each) from it; returns the distances. ``whole_model``: also ``whole_model_distance`` (a case whose
    worst tensor spreads widely, by tokens that rounding moves to another expert, hides a bug there that
    moves every expert a little)."""
    ref_losses, ref_params = reference

    def distances(run_losses, run_params) -> dict:
        d = {"loss": rel_err(run_losses, ref_losses), "params": params_distance(run_params, ref_params)}
        if whole_model:
            d["params_whole"] = whole_model_distance(run_params, ref_params)
        return d

    return parity.assert_within_spread(distances(losses, params), [distances(*o) for o in orders])


def assert_params_within_spread(params: dict, reference: dict, orders: list[dict]) -> dict:
    """``assert_within_spread`` for parameters alone (an optimizer run on given gradients): ``params``
    within ``SPREAD_MARGIN`` times the largest distance of ``orders`` (the reference's run in other
    summation orders) from ``reference``; returns the distances."""
    return parity.assert_within_spread(
        {"params": params_distance(params, reference)},
        [{"params": params_distance(o, reference)} for o in orders])


LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def passed_with_fusion_emitters(request) -> bool:
    """For a test of bit-for-bit equality between two programs: XLA:CPU's loop emitters (tests/conftest.py
    passes them for compile speed) round a transcendental's last bits by the program it is fused into (the
    sharded init's erfinv: 28 of 777 elements by up to 3 ulps), so in such a process the test runs in a
    process of XLA's default emitters instead: True once it passed there; False in a process of those."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if LOOP_EMITTERS not in flags:
        return False
    flags = [f for f in flags if f != LOOP_EMITTERS] + ["--xla_cpu_use_fusion_emitters=true"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
    done = subprocess.run(command, env={**os.environ, "XLA_FLAGS": " ".join(flags)}, capture_output=True,
                          cwd=Path(__file__).parents[2], text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:]
    return True
