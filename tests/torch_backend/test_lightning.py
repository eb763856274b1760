"""Lightning's ``ModelParallelStrategy`` (Fabric and Trainer) with our ``fully_shard`` in the user's
parallelize function, at 2 (FSDP) and 4 (HSDP 2 x 2, TP 2 then FSDP 2) gloo ranks, in float64.

Each layout trains four AdamW steps under Fabric and under ``Trainer.fit`` with ours and with PyTorch
FSDP2 in the same parallelize function, both against single-process training; then Lightning's
distributed checkpoint (DCP) saved after two steps, by ours and by FSDP2, is loaded into ours built from
another seed, which trains the other two steps and must end where the unbroken run ended.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.parity import float64_rtol
from tests.torch_backend import _lightning_workers as W
from tests.torch_backend._dist import case_results, launch

pytest.importorskip("lightning")

# Bounds: every run is float64 (the llama, its batches' losses and the checkpoints), so a sharded run
# differs from single-process training by the order of its sums only, within tests/parity.float64_rtol of
# the steps; so do FSDP2 on the same case, ours from FSDP2, and a run resumed from a checkpoint from the
# unbroken run that wrote it. A checkpoint that was not loaded (the model starts from another seed) would be
# off by about 1; a step lost or repeated by 1e-3 or more.
BOUND = float64_rtol(W.STEPS)
LAUNCHES = {2: ("fsdp",), 4: ("hsdp", "tp")}
CASES = [(world, layout, api) for world, layouts in LAUNCHES.items() for layout in layouts
         for api in ("fabric", "trainer")]


@functools.cache
def run(world: int) -> list[dict]:
    """One launch per world size for every case of its layouts (a Lightning run takes seconds on 2 cores
    with other jobs: the wait for an answer is the whole launch's)."""
    return launch(str(Path(W.__file__)), "checks", world, LAUNCHES[world], timeout_s=400)


def result(world: int, case: str) -> dict:
    return case_results(run(world), case)[0]


@pytest.mark.parametrize(("world", "layout", "api"), CASES)
def test_trains_like_single_process_and_fsdp2(world, layout, api):
    r = result(world, f"{api}_{layout}")
    for which in ("ours", "fsdp2"):
        assert r[which]["loss"] <= BOUND and r[which]["params"] <= BOUND, (which, r)
    assert r["ours_vs_fsdp2"] <= BOUND, r


@pytest.mark.parametrize("writer", ["ours", "fsdp2"])
@pytest.mark.parametrize(("world", "layout", "api"), CASES)
def test_resumes_from_a_distributed_checkpoint(world, layout, api, writer):
    resumed = result(world, f"{api}_{layout}")[f"resumed_from_{writer}"]
    assert resumed["vs_writer"] <= BOUND and resumed["params"] <= BOUND and resumed["loss"] <= BOUND, resumed
