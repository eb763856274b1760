"""Overlapped (bucketed by NS device, asynchronous) Muon gives the same bits as sequential Muon, and the
core's Newton-Schulz FLOP count matches torch's own FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import ragged
import ragged.muon
from tests.torch_backend.test_optim import MUON_SPECS, _fulls, _sharded, _train, run_threads
from torch_backend.optim import Muon, newton_schulz

# more matrices than devices, so that there are several buckets and in_flight matters
SPECS = MUON_SPECS + (("wide2", (16, 72), "rows:1"), ("tall2", (56, 24), "rows:2"),
                      ("sq2", (40, 40), "rows:1"))


# max_imbalance=1.1 at 4 devices splits the (48, 48) matrix over devices (2, 3) (test_muon_split.py)
@pytest.mark.parametrize("world,in_flight,max_imbalance",
                         [(2, 1, None), (3, 2, None), (4, 1, None), (4, 2, 1.1)])
def test_overlapped_muon_equals_sequential_muon_bit_for_bit(world, in_flight, max_imbalance):
    params, grads = _fulls(SPECS, seed=world, steps=3)
    if max_imbalance is not None:
        shapes = [s for _, s, _ in SPECS if len(s) == 2]
        assert max(len(g) for g in ragged.muon.assign_groups(shapes, world, max_imbalance=max_imbalance)) > 1

    def make(overlap):
        return lambda named: Muon(named, lr=0.02, weight_decay=0.01, adamw_lr=1e-2, overlap=overlap,
                                  in_flight=in_flight, max_imbalance=max_imbalance)

    # One intra-op thread: the ranks are threads of this process, and a matmul split over a pool that
    # other ranks' matmuls share at the same time may sum in another order (not a schedule difference).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sequential = run_threads(world, _sharded(SPECS, make(False), params, grads))
        overlapped = run_threads(world, _sharded(SPECS, make(True), params, grads))
    finally:
        torch.set_num_threads(threads)
    for rank, (want, got) in enumerate(zip(sequential, overlapped)):
        for n in params:
            assert torch.equal(got[n], want[n]), f"rank {rank}: {n} differs"
            assert not torch.equal(got[n], params[n]), f"{n} did not move"
    single = _train(make(True), params, grads)  # plain tensors: local Newton-Schulz, no buckets
    for n in params:
        # Bound: the same Newton-Schulz on the same matrix, gathered in another order: fp32 rounding of 5
        # matmul iterations (1e-5 ~ 80 eps relative; atol for entries near 0).
        torch.testing.assert_close(overlapped[0][n], single[n], rtol=1e-5, atol=1e-6, msg=n)


def test_muon_rejects_in_flight_below_one():
    with pytest.raises(ValueError, match="in_flight"):
        Muon([torch.nn.Parameter(torch.ones(2, 2))], in_flight=0)


@pytest.mark.parametrize("shape", [(32, 96), (80, 16), (48, 48)])
def test_newton_schulz_flops_match_torchs_flop_counter(shape):
    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(shape))
    assert counter.get_total_flops() == ragged.muon.newton_schulz_flops(shape)


def test_bf16_newton_schulz_is_within_its_stated_tolerance_of_fp32():
    g = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    fp32, bf16 = newton_schulz(g), newton_schulz(g, dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32
    rel = (bf16 - fp32).norm() / fp32.norm()
    assert 0 < rel < 0.05, rel  # docs/optimizers.md states this bound
