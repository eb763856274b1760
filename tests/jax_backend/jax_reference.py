"""Helpers of the JAX tests: the single-device reference run and error measures (no fixtures here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_backend import FSDP
from jax_backend.models import Llama, cross_entropy, model_params
from tests.jax_backend.any_models import train_reference as train_pytree

STEPS = 10
BATCH = 24  # divisible by 1, 2, 3, 4 and 8 devices
SEQ = 16
LR = 1e-3


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LR, weight_decay=0.1)


def train_reference(model: Llama, batches: np.ndarray, compute_dtype=None,
                    opt: optax.GradientTransformation | None = None) -> tuple[list[float], dict]:
    """Single-device training (AdamW unless ``opt``); with ``compute_dtype`` the forward runs on a cast
    copy of fp32 masters."""
    graphdef, params = nnx.split(model, nnx.Param)

    def apply(p, x):
        if compute_dtype is not None:
            p = jax.tree.map(lambda a: a.astype(compute_dtype), p)
        return nnx.merge(graphdef, p)(x)

    return train_pytree(apply, params, cross_entropy, batches, opt or adamw())


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


def assert_params_close(got: dict, want: dict, rtol: float) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want)
    errors = {k: rel_err(jnp.asarray(got[k], jnp.float32), want[k]) for k in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, f"{worst}: relative error {errors[worst]:.3g} > {rtol}"
