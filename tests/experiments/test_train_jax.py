"""``experiments.train --stack jax``: two JAX processes (``jax.distributed``) against one, and resuming;
a tensor axis against one device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.experiments._train_launch import LOSS_RTOL, ROOT, TINY, env, finish, log_records, losses, start_jax

STEPS = 4


def train(run: Path, devices: int, extra: list[str], fail_after: int | None = None) -> dict[int, float]:
    """One JAX process of ``experiments.train`` on ``devices`` host devices, checkpointing into ``run``
    (``extra``: its save interval and the rest); killed after step ``fail_after`` if given. Its log's
    losses."""
    failing = [] if fail_after is None else ["--fail-after-step", str(fail_after)]
    done = subprocess.run([sys.executable, "-m", "experiments.train", "--stack", "jax", *TINY, "--steps",
                           str(STEPS), "--checkpoint-dir", str(run), *extra, *failing], cwd=ROOT,
                          env=env(devices), capture_output=True, text=True, timeout=240)
    assert (done.returncode == 0) == (fail_after is None), done.stdout[-3000:] + done.stderr[-3000:]
    return losses(run / "log.jsonl")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict[int, float]:
    """The reference of both multi-device tests: the same run on one process with one device."""
    return train(tmp_path_factory.mktemp("one"), 1, ["--save-interval", "2"])


def test_two_jax_processes_match_one_and_resume_bit_exactly(tmp_path, one_device):
    """Two processes killed after step 3 (checkpoint after steps 0, 1) and relaunched give steps 2 and 3
    bit-identical to their first launch, and every step equal the one-device reference."""
    two = [*TINY, "--steps", str(STEPS), "--save-interval", "2", "--checkpoint-dir", str(tmp_path / "two")]
    first = finish(start_jax(2, [*two, "--fail-after-step", "3"]))
    assert all(p.returncode != 0 for p in first)
    assert (tmp_path / "two" / "log.jsonl").exists(), first[0].stdout[-3000:] + first[1].stdout[-3000:]
    before = losses(tmp_path / "two" / "log.jsonl")
    assert sorted(before) == [0, 1, 2, 3]
    second = finish(start_jax(2, two))
    assert all(p.returncode == 0 for p in second), second[0].stdout[-3000:]
    after = losses(tmp_path / "two" / "log.jsonl")
    assert [after[s] for s in (2, 3)] == [before[s] for s in (2, 3)]  # resumed bit for bit
    np.testing.assert_allclose([after[s] for s in range(STEPS)], [one_device[s] for s in range(STEPS)],
                               rtol=LOSS_RTOL)


def test_tensor_parallel_run_matches_one_device_and_resumes_bit_exactly(tmp_path, one_device):
    """``--tp 2 --hsdp 2`` on 8 host devices (replica 2 x fsdp 2 x tensor 2) against one device, killed after
    step 3 (checkpoints after steps 0 and 1) and relaunched: steps 2 and 3 bit-identical to the first launch
    (the restored optimizer state is split over the tensor axis like the buffers). Bound: LOSS_RTOL, the
    data-parallel summation order; the row-parallel partial sums round the logits far less."""
    tp = ["--save-interval", "2", "--tp", "2", "--hsdp", "2"]
    before = train(tmp_path, 8, tp, fail_after=3)
    assert sorted(before) == list(range(STEPS))
    got = train(tmp_path, 8, tp)
    assert [got[s] for s in (2, 3)] == [before[s] for s in (2, 3)]  # resumed bit for bit
    np.testing.assert_allclose([got[s] for s in range(STEPS)], [one_device[s] for s in range(STEPS)],
                               rtol=LOSS_RTOL)


def test_resumes_from_an_orbax_checkpoint_written_on_another_mesh(tmp_path):
    """``--checkpoint-format orbax``: 4 host devices, an async Orbax checkpoint after every step, killed
    after step 3 (its last checkpoint may be cut off, as in a real job; the one before is complete, since
    Orbax finishes a save before it starts the next), relaunched on 2 devices, whose units are planned
    anew: the resumed steps equal the first launch's (the uninterrupted run) within LOSS_RTOL, the
    summation order of another device count."""
    run, orbax = tmp_path / "run", ["--save-interval", "1", "--checkpoint-format", "orbax"]
    train(run, 4, orbax, fail_after=3)
    first = {r["step"]: r["loss"] for r in log_records(run / "log.jsonl")}
    assert sorted(first) == list(range(STEPS))
    train(run, 2, orbax)
    resumed = log_records(run / "log.jsonl")[STEPS:]
    steps = [r["step"] for r in resumed]
    assert steps in ([2, 3], [3]), steps  # from the checkpoint after step 1 or 2, not from scratch
    np.testing.assert_allclose([r["loss"] for r in resumed], [first[s] for s in steps], rtol=LOSS_RTOL)
