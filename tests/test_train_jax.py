"""``experiments.train --stack jax``: two JAX processes (``jax.distributed``) against one, and resuming."""

from __future__ import annotations

import numpy as np
from _train_launch import TINY, jax_processes, losses

STEPS = 5


def test_two_jax_processes_match_one_and_resume_bit_exactly(tmp_path):
    """One process is the reference; two processes killed after step 3 (checkpoint after step 2) and
    relaunched give steps 2 and 3 bit-identical to their first launch, and every step equal the reference."""
    args = [*TINY, "--steps", str(STEPS), "--save-interval", "2"]
    one = jax_processes(1, [*args, "--checkpoint-dir", str(tmp_path / "one")])
    assert one[0].returncode == 0, one[0].stdout[-3000:]
    want = losses(tmp_path / "one" / "log.jsonl")
    two = [*args, "--checkpoint-dir", str(tmp_path / "two")]
    first = jax_processes(2, [*two, "--fail-after-step", "3"])
    assert all(p.returncode != 0 for p in first)
    before = losses(tmp_path / "two" / "log.jsonl")
    assert sorted(before) == [0, 1, 2, 3]
    second = jax_processes(2, two)
    assert all(p.returncode == 0 for p in second), second[0].stdout[-3000:]
    after = losses(tmp_path / "two" / "log.jsonl")
    assert [after[s] for s in (2, 3)] == [before[s] for s in (2, 3)]
    np.testing.assert_allclose([after[s] for s in range(STEPS)], [want[s] for s in range(STEPS)], rtol=1e-5)
