"""Several forwards before one backward, a unit reused in one forward, ``Embedding(max_norm=)``.

Each pattern (tests/torch_backend/_multi_forward_workers.py) trains 3 AdamW steps in float64 at 2, 3 and 4
gloo ranks, under both ``reshard_after_forward`` settings, against single-process training on the whole
batch and against PyTorch FSDP2 on the same case.

Bound: float64, ``tests.parity.float64_rtol`` for 3 steps (6.7e-10). Sharded and single-process training
differ only in the order the rows' gradients are summed, a few float64 roundings per element, far under
Adam's eps, so not amplified; a bug (a gradient lost from one forward, a unit resharded under a graph
that still reads it) moves results by 1e-3 or more. FSDP2 passes the same bound where it is correct,
which shows the case and the bound are sound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parity import float64_rtol
from tests.torch_backend import _multi_forward_workers as W
from tests.torch_backend._dist import Launcher, case_results

RTOL = float64_rtol(W.STEPS)
run = Launcher(str(Path(W.__file__)))


def result(world: int, case: str) -> dict:
    return case_results(run(world), case)[0]


def within(r: dict) -> bool:
    return "error" not in r and r["loss"] <= RTOL and r["params"] <= RTOL


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("pattern", ["pair", "pair_no_grad", "reuse"])
def test_forwards_before_one_backward_train_like_single_process_and_fsdp2(world, reshard, pattern):
    r = result(world, f"{pattern} reshard={reshard}")
    assert within(r["fsdp2"]), r  # the case and the bound are sound
    assert within(r["ours"]), r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reshard", [True, False])
def test_embedding_max_norm_with_a_tied_head_trains_like_single_process(world, reshard):
    """Every rank renorms the rows any rank's batch uses before the head reads the shared weight. FSDP2
    keeps only the rows its own rank renormed (and loses those at reshard): far from the reference."""
    r = result(world, f"max_norm_tied reshard={reshard}")
    assert within(r["ours"]), r
    assert not within(r["fsdp2"]), r
