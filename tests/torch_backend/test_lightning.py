"""Lightning's ``ModelParallelStrategy`` (Fabric and Trainer) with our ``fully_shard`` in the user's
parallelize function, at 2 (FSDP) and 4 (HSDP 2 x 2, TP 2 then FSDP 2) gloo ranks.

Each layout trains four AdamW steps under Fabric and under ``Trainer.fit`` with ours and with PyTorch
FSDP2 in the same parallelize function, both against single-process training; then Lightning's
distributed checkpoint (DCP) saved after two steps, by ours and by FSDP2, is loaded into ours built from
another seed, which trains the other two steps and must end where the unbroken run ended.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.torch_backend import _lightning_workers as W
from tests.torch_backend._dist import case_results, launch

pytest.importorskip("lightning")

# Bounds, as in test_fsdp_user_models: a sharded run differs from the single-process reference by the
# order of its sums, which AdamW amplifies where a gradient is near zero (1e-5 here), by an amount that
# depends on the CPU; FSDP2 does the same data-parallel arithmetic, so ours may be at most twice FSDP2's
# distance from the reference (one fp32 rounding per step where that distance is zero). FSDP2 itself must
# be far below a wrong step (lr 1e-2 on weights of scale 0.02) for it to be a baseline.
FP32_FLOOR = W.STEPS * torch.finfo(torch.float32).eps
SOUND_CASE = 1e-3
# A run resumed from a checkpoint repeats the writer's last steps on the same values: equal to the writer's
# run up to the floor when the writer is ours, and no further from FSDP2's run than twice ours and FSDP2
# differ on the unbroken run; a checkpoint that was not loaded (the model starts from another seed) would
# be off by about 1.
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


def within_baseline(ours: float, baseline: float) -> bool:
    return ours <= max(FP32_FLOOR, 2 * baseline)


@pytest.mark.parametrize(("world", "layout", "api"), CASES)
def test_trains_like_single_process_and_fsdp2(world, layout, api):
    r = result(world, f"{api}_{layout}")
    ours, fsdp2 = r["ours"], r["fsdp2"]
    assert fsdp2["params"] < SOUND_CASE and fsdp2["loss"] < SOUND_CASE, fsdp2
    assert within_baseline(ours["loss"], fsdp2["loss"]), r
    assert within_baseline(ours["params"], fsdp2["params"]), r
    assert within_baseline(r["ours_vs_fsdp2"], fsdp2["params"]), r


@pytest.mark.parametrize("writer", ["ours", "fsdp2"])
@pytest.mark.parametrize(("world", "layout", "api"), CASES)
def test_resumes_from_a_distributed_checkpoint(world, layout, api, writer):
    r = result(world, f"{api}_{layout}")
    resumed = r[f"resumed_from_{writer}"]
    assert within_baseline(resumed["vs_writer"], 0.0 if writer == "ours" else r["ours_vs_fsdp2"]), r
    assert within_baseline(resumed["params"], r["fsdp2"]["params"]), r
    assert within_baseline(resumed["loss"], r["fsdp2"]["loss"]), r
