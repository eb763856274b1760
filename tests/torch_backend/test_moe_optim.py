"""8-bit Adam and Muon on the MoE decoders under expert parallelism + FSDP equal single-process training.

(ep, fsdp) = (2, 2) on 4 gloo ranks (tests/torch_backend/_moe_optim_workers.py over _moe_workers.py's models,
data and reference): per-expert modules (mixtral-tiny) and fused ``[E, d, 2f]`` experts with biases
(gpt-oss-tiny), five steps each with ``Adam8bit`` (every tensor planned by ``tile_granularity``: the
experts' fsdp unit too) and ``Muon``, against the same optimizer on the whole model in one process. Experts
go empty on some ranks every step and unused everywhere at step 0 (``.grad`` None, so both skip them);
``+skewed`` also leaves whole EP ranks without a token.

Muon orthogonalizes each expert's matrix (``ragged.muon.muon_matrices``: a fused stack is E matrices, its
``[E, n]`` biases get AdamW), gathered whole to an NS device among its EP rank's fsdp ranks; with
``max_imbalance=1.0`` the other matrices are split over groups (the experts stay whole: each EP rank's
matrices balance exactly over its 2 fsdp ranks). On one MoE layer of 6 experts (``+1-layer-6-experts``,
its own launch) an EP rank's 3 experts' matrices (9 equal ones, or 3 + 3 in two stacks) do not balance
whole, so with ``max_imbalance=1.0`` they split over both fsdp ranks too, each matrix ``e`` of a stack
on its own, gathered from the ranks' pieces of the stack (a shard boundary cuts ``gate_up_proj[2]``).

Bounds. Muon trains in float64 (masters, compute, gloo's reductions; Muon computes in at least its
parameters' dtype), against float64 Muon in one process: an expert's gradient is summed in another order,
which float64 keeps far under ``tests.parity.float64_rtol`` of the steps; a matrix gathered from the wrong
pieces, an expert's gradient lost or a token sent to another expert is off by 1e-3 or more (in fp32 these
cases needed 1e-4). 8-bit Adam cannot leave fp32 (its moments are 8-bit codes of fp32 values): that last-ulp
difference can move a moment across a code's rounding threshold, one code step changing one element's step
by a few percent of lr = 1e-2. So it is bounded by the spread of its reference trained in other summation
orders (the ranks' batches accumulated in permuted orders, each one's rows permuted;
``tests.parity.assert_within_spread``); quantizing a tile other than the single-process one (a tile cut by a
split) moves every element of it by a code step: far more. Its losses differ from the reference's only where
a parameter's difference flips the last bit of a rank's fp32 loss (each rank holds one row, whose loss no
order changes by itself: the orders' losses often equal the reference's bit for bit), so they are bounded
by what the orders move at all, their losses or their parameters (``tests.parity.floored_by``). The
distances are the worst tensor's over every rank's (the run's and each order's on the same tensors): one
code that flips in another order moves its tensor by up to 6e-4 (mixtral-tiny), and the tensor it falls in
is held by one EP rank only. Measured (native kernels, ATEN_CPU_CAPABILITY=default and avx2): Muon at most
2.9e-14 (against 1.1e-9); 8-bit Adam's parameters 0.4 to 2.75 times their spread (the most: mixtral-tiny
under avx2, 8.1e-4 against 2.95e-4).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parity import assert_within_spread, float64_rtol, floored_by
from tests.torch_backend import _moe_optim_workers as W
from tests.torch_backend._dist import Launcher, case_results
from tests.torch_backend._moe_workers import ONE_LAYER_6_EXPERTS, SKEWED, STEPS
from tests.torch_backend.test_fsdp_moe import assert_experts_went_empty_on_some_ranks

RTOL = float64_rtol(STEPS)
run = Launcher(str(Path(W.__file__)))
run_split_experts = Launcher(str(Path(W.__file__)), "split_expert_checks")
MODELS = ("mixtral-tiny", "gpt-oss-tiny", f"gpt-oss-tiny{SKEWED}")


def results(case: str) -> list[dict]:
    return case_results(run(4), case)


def assert_equals_single_process(ranks: list[dict]) -> None:
    """float64 within float64_rtol; 8-bit Adam (fp32, with ``orders``) within its reference's spread."""
    if ranks[0]["skewed"]:  # EP rank 1's experts (ranks 2 and 3) receive no token in any step
        assert [max(rows) for r in ranks[2:] for rows in r["received"]] == [0] * 2 * STEPS
    else:
        assert_experts_went_empty_on_some_ranks(ranks)
    for r in ranks:
        assert r["expert_numel_held"] * 2 == r["expert_numel_total"], r  # E / ep experts on each EP rank
        if "orders" not in r:
            assert r["full"]["loss"] <= RTOL and r["full"]["params"] <= RTOL, r["full"]
    if "orders" in ranks[0]:  # the worst of every rank's tensors, the run's and each order's
        run = {k: max(r["full"][k] for r in ranks) for k in ("loss", "params")}
        orders = [{k: max(r["orders"][i][k] for r in ranks) for k in ("loss", "params")}
                  for i in range(len(ranks[0]["orders"]))]
        assert_within_spread(run, floored_by(orders))


@pytest.mark.parametrize("name", MODELS)
def test_adam8bit_under_expert_parallelism_equals_single_process(name):
    assert_equals_single_process(results(f"{name}/adam8bit"))


@pytest.mark.parametrize("name", MODELS)
def test_muon_under_expert_parallelism_equals_single_process(name):
    ranks = results(f"{name}/muon")
    assert_equals_single_process(ranks)
    for r in ranks:  # each expert matrix whole on one of its EP rank's 2 fsdp ranks, both ranks used
        experts = [d for n, ds in r["ns_devices"].items() if ".experts." in n for d in ds]
        assert {len(d) for d in experts} == {1} and {d[0] for d in experts} == {0, 1}, r["ns_devices"]
    if name.startswith("gpt-oss"):  # fused stacks: one matrix per local expert, biases to AdamW
        stacks = {n: ds for n, ds in ranks[0]["ns_devices"].items() if ".experts." in n}
        assert stacks and all(len(ds) == 4 and not n.endswith("bias") for n, ds in stacks.items()), stacks


@pytest.mark.parametrize("name", ("mixtral-tiny", "gpt-oss-tiny"))
def test_muon_with_split_groups_under_expert_parallelism_equals_single_process(name):
    ranks = results(f"{name}/muon-split")
    assert_equals_single_process(ranks)
    split = [n for n, ds in ranks[0]["ns_devices"].items() if any(len(d) > 1 for d in ds)]
    assert split and not any(".experts." in n for n in split), split


@pytest.mark.parametrize("name", ("mixtral-tiny", "gpt-oss-tiny"))
def test_muon_with_expert_matrices_split_under_expert_parallelism_equals_single_process(name):
    ranks = case_results(run_split_experts(4), f"{name}{ONE_LAYER_6_EXPERTS}/muon-split")
    assert_equals_single_process(ranks)
    for r in ranks:  # expert matrices split over both fsdp ranks of their EP rank, some cut by a shard
        experts = {n: ds for n, ds in r["ns_devices"].items() if ".experts." in n}
        split = {(n, e) for n, ds in experts.items() for e, d in enumerate(ds) if len(d) > 1}
        assert split and all(d == (0, 1) for ds in experts.values() for d in ds if len(d) > 1), experts
        assert split & set(r["expert_matrices_across_shards"]), (split, r["expert_matrices_across_shards"])
    if name.startswith("gpt-oss"):  # fused stacks: one matrix per local expert, matrix e split on its own
        stacks = {n: ds for n, ds in ranks[0]["ns_devices"].items() if ".experts." in n}
        assert stacks and all(len(ds) == 3 for ds in stacks.values()), stacks
