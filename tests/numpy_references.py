"""Framework-free references shared by the torch and the JAX optimizer tests (numpy only)."""

from __future__ import annotations

import numpy as np

import ragged
import ragged.muon


def newton_schulz_closed_form(x: np.ndarray, steps: int = ragged.muon.NS_STEPS,
                              eps: float = 0.0) -> np.ndarray:
    """``U p^steps(S / (||X||_F + eps)) V^T`` in float64: what the quintic iteration does to each singular
    value."""
    a, b, c = ragged.muon.NS_COEFFS
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    s = s / (np.linalg.norm(x) + eps)
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return (u * s) @ vt


def assert_tracks_fp32_adamw(ours: list[float], ref: list[float]) -> None:
    """8-bit Adam trains like fp32 AdamW: to the noise floor, final loss within 2%, and at most 10% more
    steps to reach each loss level."""
    # Bounds (docs/optimizers.md): it converges (loss / 1000), ends within 2% of fp32 AdamW's final loss, and
    # reaches each level at most 10% later: 8-bit moments change the trajectory, not where it goes.
    assert ours[-1] < 1e-3 * ours[0], (ours[0], ours[-1])
    assert abs(ours[-1] - ref[-1]) <= 0.02 * ref[-1], (ours[-1], ref[-1])
    for level in (1.0, 0.1, 0.02):
        first = [next(i for i, loss in enumerate(c) if loss < level) for c in (ours, ref)]
        assert first[0] <= 1.1 * first[1], (level, first)
