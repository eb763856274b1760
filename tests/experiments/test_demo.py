"""`make demo`'s main job, small: torch fully_shard and JAX shard_map from one checkpoint vs 1 process."""

import numpy as np

from experiments.demo import run


def test_demo_trains_the_same_model_on_both_stacks():
    result = run(world_size=2, steps=4)
    assert result.reference[-1] < result.reference[0] - 0.05  # it trains
    np.testing.assert_allclose(result.torch, result.reference, rtol=1e-5)
    np.testing.assert_allclose(result.jax, result.reference, rtol=1e-5)
    assert result.torch_params < 1e-5 and result.jax_params < 1e-5, result
