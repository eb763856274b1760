"""Parity bounds: how far a sharded run may be from its reference, from the dtype's rounding and nothing else.

A sharded run and its single-process reference compute the same sums in another order, so they differ by
roundings only. AdamW amplifies those wherever a gradient is near zero (a rounding-sized gradient becomes
a step of arbitrary sign), by an amount that depends on the CPU's kernels: in float32 the same four steps
measured 1e-7 on one machine and 4e-5 (700 float32 epsilons) on another. In float64 the same noise sits
far under Adam's ``eps`` (1e-8), so it is not amplified at all, and a bound of many float64 epsilons per
step sits orders of magnitude above rounding and orders of magnitude below any real bug (a wrong shard
offset, a missing divide, a dropped expert gradient moves results by 1e-3 or more).
"""

from __future__ import annotations

FLOAT64_EPS = 2.0**-52
# How many float64 epsilons one training step may cost, relative: the worst float32 amplification seen
# (700 epsilons over four AdamW steps, about 200 a step) times 5,000 for headroom: 2.2e-10 a step.
# Three steps give 6.7e-10, 2,000 times the largest float64 distance measured (3.3e-13, GPT-2's key
# biases in test_fsdp_user_models), and far below what the bugs of experiments/bug_injection.py move
# (the smallest, a gradient not divided by the world size, which AdamW nearly hides: 8.9e-7).
EPS_PER_STEP = 1e6


def float64_rtol(steps: int) -> float:
    """The relative bound on losses and parameters after ``steps`` float64 training steps (or one
    forward and backward, ``steps=1``) compared with a reference that sums in another order."""
    if steps < 1:
        raise ValueError(f"float64_rtol: steps must be at least 1, got {steps}")
    return FLOAT64_EPS * EPS_PER_STEP * steps


# Cases that must stay in fp32 or bf16 (mixed precision, a bf16 all-gather, 8-bit Adam's quantization
# codes, bf16 Newton-Schulz) have no float64 to move to. They are bounded by the spread of the same case's
# summation orders instead: the reference computed in SPREAD_ORDERS other orders (its rows permuted, in
# as many micro-batches as the sharded run has devices: each block's gradient rounded apart, as each
# device's), the run within SPREAD_MARGIN times the farthest of them from the reference. Several orders,
# never one baseline, and never a fixed number: the spread is what this CPU's kernels make of the case's
# rounding (JAX, tests/jax_backend/jax_reference.py: at most 1.7 times the spread measured, 1.3 at the
# default ISA; the torch cases' own measurements sit with their tests).
SPREAD_ORDERS = 3
SPREAD_MARGIN = 4


def assert_within_spread(distances: dict[str, float], orders: list[dict[str, float]],
                         margin: float = SPREAD_MARGIN) -> dict[str, float]:
    """``distances`` (``{measure: the run's distance from the reference}``) each within ``margin`` times
    the largest of ``orders`` (the same measures of the reference computed in other summation orders, each
    from the reference); returns the distances with each measure's spread (``{measure}_spread``)."""
    if not orders:
        raise ValueError("assert_within_spread: no other order to take a spread from")
    d = dict(distances)
    for k in distances:
        d[f"{k}_spread"] = max(o[k] for o in orders)
    assert all(d[f"{k}_spread"] > 0 for k in distances), d  # the orders did round differently
    assert all(d[k] <= margin * d[f"{k}_spread"] for k in distances), d
    return d


def floored_by(orders: list[dict[str, float]], key: str = "params") -> list[dict[str, float]]:
    """``orders`` with each measure's distance at least its ``key`` distance, for measures that a case's
    rounding reaches only through ``key``. 8-bit Adam: a code that flips in one order moves its element's
    step by a fraction of lr, so its parameters spread by 1e-5 to 1e-3, while its losses and gradient norms
    differ by a few fp32 roundings (often none: the orders' losses equal the reference's bit for bit),
    which a sharded run's other sums can exceed; they are bounded by what the orders move at all."""
    return [{k: max(v, o[key]) for k, v in o.items()} for o in orders]
