"""torch Muon on 3-D stacks of matrices (fused experts ``[E, m, n]``) and stacked biases.

The rule (``ragged.muon.muon_matrices``): each matrix ``p[e]`` of a stack is orthogonalized on its own, a
parameter named ``...bias`` gets AdamW whatever its shape. References: Muon on the stack's matrices as
separate parameters and ``torch.optim.AdamW`` for the bias (single process); the same single-process Muon
for the sharded runs, whose planner cuts stack matrices across devices (threaded process group).
"""

from __future__ import annotations

import pytest
import torch

import ragged
from tests.torch_backend.test_optim import _fulls, _sharded, _train, run_threads
from torch_backend.optim import Muon

# a stack whose 3 matrices the planner cuts across devices (rows:1 over 3 x 32 rows), its stacked bias,
# and a plain matrix
SPECS = (("experts.gate_up_proj", (3, 32, 48), "rows:1"), ("experts.gate_up_proj_bias", (3, 48), "rows:1"),
         ("w", (48, 32), "rows:1"))
LR, WD, ADAMW_LR = 0.02, 0.01, 1e-2


def _muon(named, max_imbalance=None, overlap=True):
    return Muon(named, lr=LR, weight_decay=WD, adamw_lr=ADAMW_LR, max_imbalance=max_imbalance,
                overlap=overlap)


def test_a_stack_is_its_matrices_and_a_stacked_bias_gets_adamw():
    params, grads = _fulls(SPECS, seed=0, steps=3)
    got = _train(_muon, params, grads)
    stack = params["experts.gate_up_proj"]
    apart = {f"m{e}": stack[e] for e in range(3)} | {"w": params["w"]}  # each expert its own matrix
    apart_grads = [{f"m{e}": g["experts.gate_up_proj"][e] for e in range(3)} | {"w": g["w"]} for g in grads]
    want = _train(_muon, apart, apart_grads)
    torch.testing.assert_close(got["experts.gate_up_proj"], torch.stack([want[f"m{e}"] for e in range(3)]))
    torch.testing.assert_close(got["w"], want["w"])
    bias = _train(lambda named: torch.optim.AdamW([p for _, p in named], lr=ADAMW_LR, betas=(0.9, 0.95),
                                                  eps=1e-8, weight_decay=WD),
                  {"b": params["experts.gate_up_proj_bias"]}, [{"b": g["experts.gate_up_proj_bias"]}
                                                               for g in grads])
    # Bound: AdamW's arithmetic in another order than torch's (a few fp32 roundings of lr-sized steps)
    torch.testing.assert_close(got["experts.gate_up_proj_bias"], bias["b"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_imbalance,overlap", [(None, True), (None, False), (1.1, True)])
def test_sharded_stacks_equal_single_process_muon(max_imbalance, overlap):
    """World 3: the planner cuts the stack's matrices across devices; each is gathered whole to its NS
    device (``None``; NS-device buckets or one redistribution after another) or split over a group (1.1: 4
    equal matrices on 3 devices are 1.5 x the mean)."""
    def make(named):
        return _muon(named, max_imbalance, overlap)

    params, grads = _fulls(SPECS, seed=1, steps=3)
    want = _train(make, params, grads)
    layout = ragged.plan([ragged.TensorSpec(n, s, g) for n, s, g in SPECS], 3)
    stack = layout.placement("experts.gate_up_proj").ranges((3, 32, 48))
    assert any(a % (32 * 48) for a, _ in stack[1:]), stack  # some matrix is cut between two devices

    groups: list = []

    def record(named):
        opt = make(named)
        stack = dict(named)["experts.gate_up_proj"]
        groups.append([opt.ns_devices(stack, e) for e in range(3)])
        return opt

    for rank, got in enumerate(run_threads(3, _sharded(SPECS, record, params, grads))):
        for n in params:
            # Bound: sharded Muon gathers each matrix and runs the same Newton-Schulz (a split one sums its
            # Gram matrix in g partial sums): summation order only, as test_optim.py
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {n}")
    split = [d for rank_groups in groups for d in rank_groups if len(d) > 1]
    assert bool(split) == (max_imbalance is not None), groups
