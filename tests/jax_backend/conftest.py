"""Shared fixtures: llama-tiny, its data, the single-device reference run and its GSPMD data-parallel
baselines (each computed once per session).

The reference is the plain way to train: ``jax.grad`` of the unsharded flax model and ``optax.adamw`` on
the full parameter pytree, with none of jax_backend's buffers, layouts or collectives.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jax_backend.models import Llama
from tests.jax_backend.jax_reference import BATCH, SEQ, STEPS, train_reference


@pytest.fixture(scope="session")
def model() -> Llama:
    return Llama(rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def batches() -> np.ndarray:
    """``STEPS`` batches of token ids ``(BATCH, SEQ + 1)``: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    return np.random.default_rng(0).integers(0, 256, size=(STEPS, BATCH, SEQ + 1)).astype(np.int32)


@pytest.fixture(scope="session")
def reference(model: Llama, batches: np.ndarray) -> tuple[list[float], dict]:
    return train_reference(model, batches)


@pytest.fixture(scope="session")
def baseline(model: Llama, batches: np.ndarray, reference):
    """``baseline(n)``: the reference's recipe as GSPMD data parallelism over n devices (the bound of
    jax_reference.within_baseline), trained once per n; on one device it is the reference itself."""
    return functools.cache(lambda n: reference if n == 1 else train_reference(model, batches, devices=n))


@pytest.fixture
def x64():
    """The test computes in float64: ``jax_enable_x64`` for its duration only (jit keys its caches on it, so
    the fp32 tests' programs are not reused)."""
    with jax.enable_x64(True):
        yield
