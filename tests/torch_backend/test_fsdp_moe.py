"""The MoE decoders under ``parallelize`` train like single-process training, with experts forced empty.

Per-expert modules (mixtral-tiny), fused experts with biases (gpt-oss-tiny) and the sigmoid router with a
shared expert and a dense first layer (deepseek-v3-tiny), five AdamW steps at 2 and 4 gloo ranks; the
ranks holding the repeated-token rows run only ``top_k`` experts per layer, the others run experts they
do not (tests/torch_backend/_moe_workers.py). Expert parallelism (``expert_parallel``) on (ep, fsdp) =
(2, 1), (2, 2) and (4, 1), float64, the other parameters sharded over all ranks ((1, 4) is plain FSDP at 4
ranks); at (2, 2) in bf16; and with HSDP, (replicas, ep, fsdp) = (2, 2, 2) on 8 ranks (one row per rank),
in float64 and bf16, for both expert storages (mixtral-tiny, gpt-oss-tiny).

Bounds. Without a policy every case runs in float64 (masters, compute, gloo's reductions; the router's
logits stay fp32, as the model computes them) against its float64 reference: only the order of gradient
sums differs (expert parallelism sums an expert's gradient as one GEMM over every EP rank's tokens), which
float64 keeps far under Adam's eps, so ``tests.parity.float64_rtol`` holds on any CPU's kernels; a token
sent to the wrong expert, a missing 1/ep or a gradient lost on one rank is off by 1e-3 to 1e-1 (in fp32
these cases needed 1e-5, and 1e-4 with expert parallelism). bf16 under the mixed-precision policy (fp32
masters), against the FSDP-free reference that applies the same casts (a bf16 copy of the fp32 master per
batch, bf16 gradients summed in fp32): only fp32 sum order differs (measured 0 at 2 ranks, 2e-8 at 4), so it
is bounded by that reference's spread over SPREAD_ORDERS other orders of the same sums (the ranks' batches in
permuted orders, each one's rows permuted; ``tests.parity.assert_within_spread``; at 4 ranks each rank holds
one row and the orders' losses equal the reference's bit for bit: they are bounded by what the orders move at
all, ``tests.parity.floored_by``). Against fp32 training the losses are within the suite's bf16 bound (2e-2,
a few bf16 epsilons, as test_fsdp_parity.py); the parameters are not compared there: a token whose top-k gap
is below bf16 rounding picks another expert, whose whole Adam step (lr 1e-2 on weights of scale 0.02) then
differs, which no smooth bound covers.

bf16 with expert parallelism rounds otherwise than the policy reference: an expert's gradient is one bf16
GEMM over the tokens of every EP rank, where the reference rounds each rank's gradient to bf16 and sums in
fp32, so the runs differ by bf16 rounding, and by the tokens it moves to another expert. It is bounded by
the policy reference's spread over orders that sum the ranks' bf16 gradients in bf16 (each partial sum
rounded to bf16, the ranks and rows permuted: the same gradient summed in other orders at the run's
precision), the worst tensor over every rank's. Measured at (2, 2) / (2, 2, 2), mixtral-tiny and
gpt-oss-tiny: parameters 3.4e-3, 3.8e-2 / 1.4e-2, 1.3e-2 from the policy reference against spreads of
8.1e-2, 1.6e-2 / 7.5e-2, 4.1e-2 (the most: 2.4 times, gpt-oss-tiny at (2, 2)); losses 4.1e-5, 1.3e-4 /
4.4e-6, 2.5e-5 against 5.7e-5, 6.1e-5 / 3.4e-5, 8.4e-5; against fp32 training within the bf16 bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parity import assert_within_spread, float64_rtol, floored_by
from tests.torch_backend import _moe_workers as W
from tests.torch_backend._dist import Launcher, case_results

RTOL = float64_rtol(W.STEPS)
BF16_RTOL = 2e-2  # bf16 training against fp32 training: a few bf16 epsilons (2^-8)
run = Launcher(str(Path(W.__file__)))
run_bf16 = Launcher(str(Path(W.__file__)), "ep_bf16_checks")
run_hsdp = Launcher(str(Path(W.__file__)), "hsdp_checks", False)  # 8 ranks: one launch per dtype, each
run_hsdp_bf16 = Launcher(str(Path(W.__file__)), "hsdp_checks", True)  # well within the launch timeout


def results(world: int, case: str) -> list[dict]:
    return case_results(run(world), case)


def assert_experts_went_empty_on_some_ranks(ranks: list[dict], idle_everywhere: bool = True) -> None:
    """Every step and MoE layer the first rank ran only top_k experts and another rank ran one it did not;
    at step 0 some expert ran on no rank (its ``.grad`` stays None), unless not ``idle_everywhere`` (at 8
    ranks the last rank's few distinct tokens reach every expert of gpt-oss-tiny, top 4 of 8)."""
    top_k, n_experts = ranks[0]["top_k"], ranks[0]["n_experts"]
    for step, layers in enumerate(ranks[0]["routes"]):
        for layer, ran in enumerate(layers):
            assert len(ran) == top_k < n_experts, (step, layer, ran)
            elsewhere = set().union(*(r["routes"][step][layer] for r in ranks[1:]))
            assert elsewhere - set(ran), (step, layer, ran, elsewhere)
    idle = [n_experts - len(set().union(*(r["routes"][0][layer] for r in ranks)))
            for layer in range(len(ranks[0]["routes"][0]))]
    assert max(idle) > 0 or not idle_everywhere, idle


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", W.MODELS)
def test_float64_with_empty_experts_equals_single_process(world, name):
    ranks = results(world, f"{name}/fp32")
    assert_experts_went_empty_on_some_ranks(ranks)
    r = ranks[0]["full"]
    assert r["loss"] <= RTOL and r["params"] <= RTOL, r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", W.MODELS)
def test_bf16_policy_with_empty_experts_equals_the_fsdp_free_policy_reference(world, name):
    ranks = results(world, f"{name}/bf16")
    assert_experts_went_empty_on_some_ranks(ranks)
    r = ranks[0]
    assert_within_spread(r["policy"], floored_by(r["orders"]))
    assert 0 < r["full"]["loss"] <= BF16_RTOL, r["full"]  # computed in bf16, within bf16's bound


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("name", W.MODELS)
def test_expert_parallel_with_fsdp_equals_single_process(world, ep, name):
    """(ep, fsdp) = (2, 1), (2, 2), (4, 1): each EP rank holds E/ep experts, sharded over its fsdp ranks,
    and tokens move by uneven all-to-all."""
    ranks = results(world, f"{name}/ep{ep}")
    assert_experts_went_empty_on_some_ranks(ranks)
    for r in ranks:
        assert r["expert_numel_held"] * ep == r["expert_numel_total"], r
        assert r["full"]["loss"] <= RTOL and r["full"]["params"] <= RTOL, r["full"]
    for step in range(W.STEPS):  # uneven splits: the EP ranks' experts received different token counts
        received = [r["received"][step] for r in ranks]
        assert len({tuple(rows) for rows in received}) > 1, (step, received)


def test_an_ep_rank_whose_experts_receive_no_token_still_trains_like_single_process():
    """mixtral-tiny at (ep, fsdp) = (2, 2): at step 0 rank 0's experts receive no token in layer 0 while
    rank 1, which holds the same experts (its fsdp peer), receives some: rank 0 still runs its experts
    unit, on empty tensors, and takes part in every collective."""
    ranks = results(4, "mixtral-tiny/ep2")
    assert ranks[0]["received"][0][0] == 0 < ranks[1]["received"][0][0], [r["received"][0] for r in ranks]
    assert all(r["full"]["params"] <= RTOL for r in ranks)


@pytest.mark.parametrize("ep", [2, 4])
def test_fused_experts_of_ep_ranks_that_receive_nothing_train_like_single_process(ep):
    """gpt-oss-tiny with its router biased onto experts 0..top_k-1: the experts of ranks 2 and 3 receive no
    token in any step, at (ep, fsdp) = (2, 2) (a whole fsdp group) and (4, 1). In one process the fused
    tensors still get a gradient (zero on idle experts' slices, so weight decay moves them): so must
    these ranks' slices, or their AdamW steps differ by ~5e-3."""
    ranks = results(4, f"gpt-oss-tiny{W.SKEWED}/ep{ep}")
    assert [max(r["received"][step]) for r in ranks for step in range(W.STEPS)][2 * W.STEPS:] == [0] * 10
    assert all(r["full"]["loss"] <= RTOL and r["full"]["params"] <= RTOL for r in ranks), \
        [r["full"] for r in ranks]



def test_expert_parallel_refuses_a_mesh_whose_dims_are_not_replicate_ep_fsdp():
    for message in case_results(run(4), "ep-mesh-refused"):
        assert "ep_mesh must have dims ('ep', 'fsdp') or ('replicate', 'ep', 'fsdp')" in message, message
        assert "('ep', 'replicate', 'fsdp')" in message, message  # names what it got


def assert_bf16_within_the_policys_spread(ranks: list[dict]) -> None:
    """bf16 expert parallelism against the policy reference, within its spread over bf16 sums in other
    orders (the worst tensor over every rank's, as each order's), and against fp32 training within bf16's
    bound (see the module docstring)."""
    run = {k: max(r["policy"][k] for r in ranks) for k in ("loss", "params")}
    orders = [{k: max(r["orders"][i][k] for r in ranks) for k in ("loss", "params")}
              for i in range(len(ranks[0]["orders"]))]
    assert_within_spread(run, orders)
    for r in ranks:
        assert 0 < r["policy_vs_full"]["loss"] <= BF16_RTOL, r  # the case computed in bf16
        assert 0 < r["full"]["loss"] <= BF16_RTOL, r


@pytest.mark.parametrize("name", W.EP_MODELS)
def test_expert_parallel_in_bf16_within_the_policy_references_spread(name):
    """(ep, fsdp) = (2, 2) under the mixed-precision policy (bf16 compute and all-to-all, fp32 reduce)."""
    ranks = case_results(run_bf16(4), f"{name}/ep2-bf16")
    assert_experts_went_empty_on_some_ranks(ranks)
    assert_bf16_within_the_policys_spread(ranks)


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
@pytest.mark.parametrize("name", W.EP_MODELS)
def test_expert_parallel_with_hsdp_equals_single_process(name, bf16):
    """(replicas, ep, fsdp) = (2, 2, 2) on 8 ranks: the experts unit sharded over fsdp and replicated over
    the replicas, the rest HSDP over (replicas, ep * fsdp); tokens move along ep inside a replica."""
    ranks = case_results((run_hsdp_bf16 if bf16 else run_hsdp)(8), f"{name}/hsdp2-ep2")
    assert_experts_went_empty_on_some_ranks(ranks, idle_everywhere=False)
    for r in ranks:
        assert r["expert_numel_held"] * 2 == r["expert_numel_total"], r
        if not bf16:
            assert r["full"]["loss"] <= RTOL and r["full"]["params"] <= RTOL, r["full"]
    if bf16:
        assert_bf16_within_the_policys_spread(ranks)
    assert [r["received"] for r in ranks[:4]] != [r["received"] for r in ranks[4:]]  # replicas: other rows


def test_hsdp_replicas_of_an_ep_rank_whose_fused_experts_receive_nothing_train_like_single_process():
    """gpt-oss-tiny with its router biased onto experts 0..top_k-1 at (2, 2, 2): EP rank 1's experts (ranks
    2, 3 of each replica) receive no token in any step, and their fused slices still get the zero gradient
    one process gives them, all-reduced over the replicas."""
    ranks = case_results(run_hsdp(8), f"gpt-oss-tiny{W.SKEWED}/hsdp2-ep2")
    assert all(max(r["received"][step]) == 0 for r in ranks for step in range(W.STEPS)
               if r["rank"] % 4 >= 2), [r["received"] for r in ranks]
    assert all(r["full"]["loss"] <= RTOL and r["full"]["params"] <= RTOL for r in ranks), \
        [r["full"] for r in ranks]
