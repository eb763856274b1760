"""`make demo`'s main job, small: torch fully_shard and JAX shard_map from one checkpoint vs 1 process.

Bounds. Losses: ``experiments.demo.LOSS_RTOL``, the worst-case rounding of the batch mean summed in
another order. Parameters: AdamW divides each gradient element by its own
scale, so wherever a gradient is near zero it amplifies that rounding by an amount no epsilon bound
predicts and that depends on the CPU's kernels (AVX2 or AVX-512 summation order). The demo measures it:
the reference trained again on the ranks' rows as micro-batches differs from the reference only by
data parallelism's rounding, JAX on one device only by XLA's kernels; a sharded run may differ by at
most twice what its stack's rounding alone gives (same kind of rounding, another order), or by one
rounding per step where that is zero.
"""

import numpy as np

from experiments.demo import LOSS_RTOL, run

FP32_EPS = float(np.finfo(np.float32).eps)
STEPS, WORLD = 4, 2


def test_demo_trains_the_same_model_on_both_stacks():
    result = run(world_size=WORLD, steps=STEPS)
    assert result.reference[-1] < result.reference[0] - 0.05  # it trains
    np.testing.assert_allclose(result.torch, result.reference, rtol=LOSS_RTOL)
    np.testing.assert_allclose(result.jax, result.reference, rtol=LOSS_RTOL)
    floor = STEPS * FP32_EPS
    assert result.torch_params <= max(floor, 2 * result.data_parallel_params), result
    jax_rounding = max(result.data_parallel_params, result.jax_one_device_params)
    assert result.jax_params <= max(floor, 2 * jax_rounding), result
