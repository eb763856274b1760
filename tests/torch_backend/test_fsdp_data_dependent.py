"""Data-dependent control flow under ``fully_shard``: modules and parameters used on some ranks only.

Routing sends each rank's rows to some experts and not others, a root parameter is used by some ranks'
rows only, an auxiliary head gets a gradient on some ranks only, a parameter is used twice on one rank
and never on another, and some steps use a parameter on no rank at all (its ``.grad`` stays None, as
single-process training leaves it). Training must equal single-process training on the whole batch: the
collectives never depend on the data (fsdp/_schedule.py), not even where a unit sharded on its own
(an expert) is skipped on some ranks or gets no gradient there.

Bound: float64 (every model and batch), at most four AdamW steps. Sharded and single-process training
differ only in the order gradients are summed (rows split over ranks, then averaged); in float64 that
rounding stays far under Adam's eps, so ``tests.parity.float64_rtol`` bounds it (8.9e-10) whatever the
CPU's kernels; a rank that drops or misorders a gradient is off by 1e-3 to 1e-1. Measured at 2 and 4
ranks, under ATEN_CPU_CAPABILITY=default and avx2 alike: losses 1.1e-16 to 6.0e-16, parameters 8.5e-17
to 3.0e-15 (SwitchTransformers' the largest; in float32 it gave 1e-7 under default, 4e-5 under avx2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parity import float64_rtol
from tests.torch_backend import _data_dependent_workers as W
from tests.torch_backend._dist import Launcher, case_results

RTOL = float64_rtol(W.STEPS)
run = Launcher(str(Path(W.__file__)))


def result(world: int, case: str, rank: int = 0):
    return case_results(run(world), case)[rank]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_routed_experts_root_and_aux_parameters_train_like_single_process(world):
    routes = [result(world, "routed", r)["routes"] for r in range(world)]
    # The case is exercised: at some step an expert runs on one rank and not on another.
    assert any(len({tuple(rank_routes[s]) for rank_routes in routes}) > 1 for s in range(W.STEPS))
    r = result(world, "routed")
    assert r["loss"] <= RTOL and r["params"] <= RTOL, r


def test_routed_under_hsdp_2x2_trains_like_single_process():
    r = result(4, "routed_hsdp")
    assert r["replicas"] == 2
    assert r["loss"] <= RTOL and r["params"] <= RTOL, r


@pytest.mark.parametrize("reentrant", [False, True])
def test_routed_under_activation_checkpointing_trains_like_single_process(reentrant):
    r = result(2, f"routed_checkpointed_reentrant={reentrant}")
    assert r["loss"] <= RTOL and r["params"] <= RTOL, r


@pytest.mark.parametrize("world", [2, 4])
def test_unit_done_on_some_ranks_first_reduces_when_every_rank_is(world):
    """``SideTowers``: a unit's backward ends early on the ranks that used all its parameters and only at
    the end of backward on the others; training still equals single-process training (before the
    reduce-scatters rode on the backward checks, the early ranks' reduce met the others' next check
    and every rank raised)."""
    routes = [result(world, "side_towers", r)["routes"] for r in range(world)]
    assert any(len({tuple(rank_routes[s]) for rank_routes in routes}) > 1 for s in range(W.STEPS))
    r = result(world, "side_towers")
    assert r["loss"] <= RTOL and r["params"] <= RTOL, r


@pytest.mark.parametrize("world", [2, 4])
def test_huggingface_switch_transformers_trains_like_single_process(world):
    pytest.importorskip("transformers")
    hits = [result(world, "switch", r)["hits"] for r in range(world)]
    # Experts are hit on some ranks and not on others, in every step.
    assert all(len({frozenset(h[s]) for h in hits}) > 1 for s in range(len(hits[0])))
    r = result(world, "switch")
    assert r["loss"] <= RTOL and r["params"] <= RTOL, r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["experts_as_units", "aux_without_gradient"])
def test_units_that_run_or_get_gradients_on_some_ranks_only_train_like_single_process(world, case):
    """An expert sharded as its own unit and skipped on some ranks, or a unit with no gradient on some:
    the schedule still gathers and reduce-scatters them on every rank (zeros where unused)."""
    r = result(world, case)
    assert r["loss"] <= RTOL and r["params"] <= RTOL, r
