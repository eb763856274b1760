"""``experiments.train --stack jax`` on an MoE preset: the MoE decoder under expert parallelism (``--ep``).

The same 8 host devices and data at ep 1 (FSDP over all 8) and at ep 2 with 2 HSDP replicas (each EP
rank's experts over 2 devices) train the same model: the losses differ only by summation order (bound:
``LOSS_RTOL``, as for the other distributed runs); so do ep 1 and ep 2 with 8-bit Adam and Muon, on 4
devices (each EP rank's experts over 2 again; HSDP is the first test's).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from experiments.train import main
from tests.experiments._train_launch import BATCH, LOSS_RTOL, ROOT, SEQ, env, losses

STEPS = 3


def train(tmp_path, name: str, extra: list[str], devices: int = 8) -> dict[int, float]:
    log = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "experiments.train", "--stack", "jax", "--model", "mixtral-tiny", "--dtype",
           "fp32", "--batch", str(BATCH), "--seq-len", str(SEQ), "--steps", str(STEPS), "--no-progress",
           "--log", str(log), *extra]
    done = subprocess.run(cmd, cwd=ROOT, env=env(devices), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses(log)


def test_expert_parallel_trains_the_moe_as_fsdp_does(tmp_path):
    fsdp = train(tmp_path, "ep1", [])
    ep = train(tmp_path, "ep2", ["--ep", "2", "--hsdp", "2"])
    assert sorted(ep) == list(range(STEPS))
    np.testing.assert_allclose([ep[s] for s in range(STEPS)], [fsdp[s] for s in range(STEPS)], rtol=LOSS_RTOL)


@pytest.mark.parametrize("optimizer", ["adam8bit", "muon"])
def test_expert_parallel_trains_with_the_structure_aware_optimizers_as_fsdp_does(tmp_path, optimizer):
    """8-bit Adam (tile granularity, auto) and Muon on the composed EP layouts: ep 2 on 8 devices gives
    ep 1's losses (tests/jax_backend/test_expert_parallel_optim.py compares the parameters too)."""
    fsdp = train(tmp_path, f"ep1-{optimizer}", ["--optimizer", optimizer], devices=4)
    ep = train(tmp_path, f"ep2-{optimizer}", ["--ep", "2", "--optimizer", optimizer], devices=4)
    np.testing.assert_allclose([ep[s] for s in range(STEPS)], [fsdp[s] for s in range(STEPS)], rtol=LOSS_RTOL)


def test_ep_on_a_dense_model_is_refused():
    """Refused by ``main`` before JAX is set up (every process of a launched run refuses alike)."""
    with pytest.raises(SystemExit, match="--ep 2: it trains mixture-of-experts models only"):
        main(["--stack", "jax", "--model", "llama-tiny", "--ep", "2"])
