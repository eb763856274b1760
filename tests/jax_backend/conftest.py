"""Shared fixtures: llama-tiny, its data and the single-device reference run in float64 (each computed once
per session), and ``x64``, which runs a test in float64.

The reference is the plain way to train: ``jax.grad`` of the unsharded flax model and ``optax.adamw`` on
the full parameter pytree, with none of jax_backend's buffers, layouts or collectives.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jax_backend.models import Llama
from tests.jax_backend.jax_reference import BATCH, SEQ, STEPS, float64, train_reference


@pytest.fixture(scope="session")
def model() -> Llama:
    return Llama(rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def batches() -> np.ndarray:
    """``STEPS`` batches of token ids ``(BATCH, SEQ + 1)``: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    return np.random.default_rng(0).integers(0, 256, size=(STEPS, BATCH, SEQ + 1)).astype(np.int32)


@pytest.fixture(scope="session")
def model64(model: Llama) -> Llama:
    """``model`` in float64, for the tests that take ``x64`` (jax_reference.float64_bound)."""
    return float64(model)


@pytest.fixture(scope="session")
def reference(model64: Llama, batches: np.ndarray) -> tuple[list[float], dict]:
    """The float64 reference: ``model64`` trained on one device under x64."""
    with jax.enable_x64(True):
        return train_reference(model64, batches)


@pytest.fixture
def x64():
    """The test computes in float64: ``jax_enable_x64`` for its duration only (jit keys its caches on it, so
    the fp32 tests' programs are not reused)."""
    with jax.enable_x64(True):
        yield
