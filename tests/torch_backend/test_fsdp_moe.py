"""The MoE decoders under ``parallelize`` train like single-process training, with experts forced empty.

Per-expert modules (mixtral-tiny), fused experts with biases (gpt-oss-tiny) and the sigmoid router with a
shared expert and a dense first layer (deepseek-v3-tiny), five AdamW steps at 2 and 4 gloo ranks; the
ranks holding the repeated-token rows run only ``top_k`` experts per layer, the others run experts they
do not (tests/torch_backend/_moe_workers.py).

Bounds. fp32: the suite's 1e-5 (tests/torch_backend/test_fsdp_data_dependent.py: only the order of fp32
gradient sums differs). bf16 under the mixed-precision policy, against the FSDP-free reference that applies
the same casts (a bf16 copy of the fp32 master per batch, bf16 gradients summed in fp32): again only fp32
sum order differs, so the same 1e-5 (measured 1e-7). Against fp32 training the losses are within the
suite's bf16 bound (2e-2, a few bf16 epsilons, as test_fsdp_parity.py); the parameters are not compared
there: a token whose top-k gap is below bf16 rounding picks another expert, whose whole Adam step
(lr 1e-2 on weights of scale 0.02) then differs, which no smooth bound covers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_backend import _moe_workers as W
from tests.torch_backend._dist import Launcher

FP32_RTOL = 1e-5
BF16_RTOL = 2e-2
run = Launcher(str(Path(W.__file__)))


def results(world: int, case: str) -> list[dict]:
    errors = [f"rank {r}: {res.get(case, res.get('<worker>'))}" for r, res in enumerate(run(world))
              if "<worker>" in res or "traceback" in res.get(case, {})]
    if errors:
        raise AssertionError("\n".join(errors))
    return [res[case] for res in run(world)]


def assert_experts_went_empty_on_some_ranks(ranks: list[dict]) -> None:
    """Every step and MoE layer: the first rank ran only top_k experts, another rank ran one it did not."""
    top_k, n_experts = ranks[0]["top_k"], ranks[0]["n_experts"]
    for step, layers in enumerate(ranks[0]["routes"]):
        for layer, ran in enumerate(layers):
            assert len(ran) == top_k < n_experts, (step, layer, ran)
            elsewhere = set().union(*(r["routes"][step][layer] for r in ranks[1:]))
            assert elsewhere - set(ran), (step, layer, ran, elsewhere)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", W.MODELS)
def test_fp32_with_empty_experts_equals_single_process(world, name):
    ranks = results(world, f"{name}/fp32")
    assert_experts_went_empty_on_some_ranks(ranks)
    r = ranks[0]["fp32"]
    assert r["loss"] <= FP32_RTOL and r["params"] <= FP32_RTOL, r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", W.MODELS)
def test_bf16_policy_with_empty_experts_equals_the_fsdp_free_policy_reference(world, name):
    ranks = results(world, f"{name}/bf16")
    assert_experts_went_empty_on_some_ranks(ranks)
    r = ranks[0]
    assert r["policy"]["loss"] <= FP32_RTOL and r["policy"]["params"] <= FP32_RTOL, r["policy"]
    assert 0 < r["fp32"]["loss"] <= BF16_RTOL, r["fp32"]  # computed in bf16, within bf16's bound
