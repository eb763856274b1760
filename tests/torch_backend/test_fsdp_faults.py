"""A rank that dies or raises mid-step, or dies while a checkpoint is written.

The survivors must end with an error naming the collective (and unit) they were in, within the process
group's timeout, and a checkpoint torn by the failure must never replace the last complete one.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.parity import float64_rtol
from tests.torch_backend import _dist
from tests.torch_backend import _fsdp_workers as W

WORKERS = str(Path(W.__file__))
PG_TIMEOUT_S = 5.0
WORLD = 2


def launch_survivors(fn: str, *args: object, answers: int, timeout_s: float = 60.0) -> dict[int, object]:
    """Returns once ``answers`` ranks answered (a killed rank never does)."""
    return _dist.collect(WORKERS, fn, WORLD, *args, answers=answers, timeout_s=timeout_s,
                         pg_timeout_s=PG_TIMEOUT_S)


@pytest.mark.parametrize("how", ["kill", "raise", "hang"])
def test_survivor_names_the_collective_within_the_timeout(tmp_path, how):
    results = launch_survivors("fault_checks", str(tmp_path), how, answers=WORLD if how == "raise" else 1)
    survivor = results[0]
    assert isinstance(survivor, dict) and survivor.get("during") == "training", survivor
    error = survivor["error"]
    assert error is not None and error.startswith("CollectiveError"), error
    # the unit's all-gather or reduce-scatter, or the check that precedes a unit's forward
    unit = r"(tok_embeddings|layers\.\d|output)"
    collective = rf"(all_gather|reduce_scatter) of '{unit}'"
    check = rf"all_reduce of '(forward|backward|reduce-scatter) of {unit} \(check\)'"  # before each
    assert re.search(rf"({collective}|{check}) .* on rank 0", error), error
    assert survivor["seconds"] < PG_TIMEOUT_S + 2
    if how == "hang":  # nothing closed a connection: the process group's timeout ended the wait
        assert survivor["seconds"] > PG_TIMEOUT_S * 0.8 and "timed out" in error.lower(), error
    if how == "raise":
        assert "injected failure on the last rank" in results[1]["error"]


def test_a_launch_that_times_out_shows_where_its_silent_rank_is():
    """A rank hung outside any collective is killed at the launch's timeout, its threads' stacks shown."""
    results = _dist.launch(WORKERS, "sleep_checks", WORLD, _dist.scaled_timeout(60.0), timeout_s=3.0)
    assert results[0] == {"slept": False}, results
    where = results[1]["<worker>"]
    timeout = _dist.scaled_timeout(3.0)
    assert where.startswith(f"rank 1 did not answer within {timeout}s") and " in sleep_checks" in where, where


def test_checkpoint_torn_by_a_dead_rank_leaves_the_previous_one_loadable(tmp_path):
    survivor = launch_survivors("fault_checks", str(tmp_path), "kill_saving", answers=1)[0]
    assert survivor["during"] == "saving" and survivor["error"].startswith("CheckpointError"), survivor
    assert "torn" in survivor["error"] and survivor["seconds"] < PG_TIMEOUT_S + 2
    assert not (tmp_path / "torn").exists()  # never renamed into place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["complete", "torn.partial"]
    # The complete checkpoint loads without any process group into plain full tensors.
    want = W.reference(steps=1)["params"]
    state = {f"model.{n}": torch.zeros(v.shape, dtype=W.FULL) for n, v in want.items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "complete"))
    for n, v in want.items():
        got = state[f"model.{n}"].numpy()
        # One float64 AdamW step from the same init, summed in another order (tests/parity.py).
        assert np.linalg.norm(got - v) <= float64_rtol(1) * np.linalg.norm(v), n
