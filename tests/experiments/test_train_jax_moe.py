"""``experiments.train --stack jax`` on an MoE preset: the MoE decoder under expert parallelism (``--ep``).

The same 8 host devices and data at ep 1 (FSDP over all 8) and at ep 2 with 2 HSDP replicas (each EP
rank's experts over 2 devices) train the same model: the losses differ only by summation order (bound:
``LOSS_RTOL``, as for the other distributed runs); so do ep 1 and ep 2 with 8-bit Adam and Muon, on 4
devices (each EP rank's experts over 2 again; HSDP is the first test's).

The 8-device runs call ``main`` in this process, whose 8 host devices they are (``main`` keeps no state
between runs); the four 4-device runs share one process of their own.
"""

from __future__ import annotations

import numpy as np
import pytest

from experiments.train import main
from tests.experiments._train_launch import BATCH, LOSS_RTOL, SEQ, jax_runs, losses

STEPS = 3
OPTIMIZERS = ("adam8bit", "muon")


def argv(log, extra: list[str]) -> list[str]:
    return ["--model", "mixtral-tiny", "--dtype", "fp32", "--batch", str(BATCH), "--seq-len", str(SEQ),
            "--steps", str(STEPS), "--no-progress", "--log", str(log), *extra]


def train_here(tmp_path, name: str, extra: list[str]) -> dict[int, float]:
    """A run on this process's 8 host devices."""
    main(["--stack", "jax", *argv(tmp_path / f"{name}.jsonl", extra)])
    return losses(tmp_path / f"{name}.jsonl")


def test_expert_parallel_trains_the_moe_as_fsdp_does(tmp_path):
    fsdp = train_here(tmp_path, "ep1", [])
    ep = train_here(tmp_path, "ep2", ["--ep", "2", "--hsdp", "2"])
    assert sorted(ep) == list(range(STEPS))
    np.testing.assert_allclose([ep[s] for s in range(STEPS)], [fsdp[s] for s in range(STEPS)], rtol=LOSS_RTOL)


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory) -> dict[tuple[str, int], dict[int, float]]:
    """``{(optimizer, ep): losses}``: ep 1 and ep 2 with each optimizer, in one process on 4 devices."""
    out = tmp_path_factory.mktemp("four_devices")
    cases = [(opt, ep) for opt in OPTIMIZERS for ep in (1, 2)]
    done = jax_runs(4, [argv(out / f"{opt}-ep{ep}.jsonl", ["--optimizer", opt, "--ep", str(ep)])
                        for opt, ep in cases])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {(opt, ep): losses(out / f"{opt}-ep{ep}.jsonl") for opt, ep in cases}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_expert_parallel_trains_with_the_structure_aware_optimizers_as_fsdp_does(four_devices, optimizer):
    """8-bit Adam (tile granularity, auto) and Muon on the composed EP layouts: ep 2 on 4 devices gives
    ep 1's losses (tests/jax_backend/test_expert_parallel_optim.py compares the parameters too)."""
    fsdp, ep = four_devices[optimizer, 1], four_devices[optimizer, 2]
    np.testing.assert_allclose([ep[s] for s in range(STEPS)], [fsdp[s] for s in range(STEPS)], rtol=LOSS_RTOL)


def test_ep_on_a_dense_model_is_refused():
    """Refused by ``main`` before JAX is set up (every process of a launched run refuses alike)."""
    with pytest.raises(SystemExit, match="--ep 2: it trains mixture-of-experts models only"):
        main(["--stack", "jax", "--model", "llama-tiny", "--ep", "2"])
