"""``transformers.Trainer`` through HF accelerate's FSDP2 plugin, sharding with ours via
``torch_backend.integrations.use_in_accelerate``, at 2 gloo ranks.

An HF Llama and an HF Qwen3-MoE (experts routed per token, inside accelerate's decoder-layer units)
train four clipped AdamW steps in float64 under ``Trainer`` with ours and with PyTorch FSDP2 (accelerate's own
``fully_shard``), both against single-process training; ours saves accelerate's sharded checkpoint (DCP)
halfway, and a model built from another seed resumed from it must end where the unbroken run ended.
Also accelerate's ``cpu_ram_efficient_loading`` load (rank 0's weights, ``load_state_dict(assign=True)``)
into a model sharded by ours.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp

import torch_backend
from tests.parity import float64_rtol
from tests.torch_backend import _accelerate_workers as W
from tests.torch_backend._dist import case_results, launch
from torch_backend.integrations import use_in_accelerate

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

# Bounds: every run is float64, so ours, FSDP2 on the same case and single-process training differ by the
# order of their sums only, within tests/parity.float64_rtol of the steps; a run resumed from ours'
# checkpoint repeats the unbroken run's last steps on the same values (a checkpoint that was not loaded,
# another seed's weights, would be off by about 1).
BOUND = float64_rtol(W.STEPS)
# The logged loss is the exception: the Trainer sums it into an fp32 accumulator (transformers' tr_loss) and
# averages the ranks' in fp32, a few fp32 roundings of the float64 loss (measured 1.9e-7); 16 allowed, far
# under a lost or repeated step (1e-3 and more). Gradient norms and parameters keep the float64 bound.
LOGGED_LOSS_BOUND = 16 * 2.0**-24
WORLD = 2


@functools.cache
def run() -> list[dict]:
    return launch(str(Path(W.__file__)), "checks", WORLD, timeout_s=400)


def test_use_in_accelerate_swaps_fully_shard_for_the_context_only():
    original = torch.distributed.fsdp.fully_shard
    with pytest.raises(RuntimeError, match="inside"):
        with use_in_accelerate():
            assert torch.distributed.fsdp.fully_shard is torch_backend.fully_shard
            raise RuntimeError("inside")
    assert torch.distributed.fsdp.fully_shard is original


@pytest.mark.parametrize("model", list(W.MODELS))
def test_trainer_trains_like_single_process_and_fsdp2(model):
    r = case_results(run(), model)[0]
    ours, fsdp2 = r["ours"], r["fsdp2"]
    assert ours["ragged"] and not fsdp2["ragged"], r  # each run sharded with the fully_shard it names
    assert r["clipped"], r
    assert ours["steps"] == fsdp2["steps"] == list(range(1, W.STEPS + 1)), r
    for metric, bound in (("loss", LOGGED_LOSS_BOUND), ("grad_norm", BOUND), ("params", BOUND)):
        assert ours[metric] <= bound and fsdp2[metric] <= bound, (metric, r)
    assert r["ours_vs_fsdp2"] <= BOUND, r


@pytest.mark.parametrize("model", list(W.MODELS))
def test_trainer_resumes_from_its_sharded_checkpoint(model):
    r = case_results(run(), model)[0]
    resumed = r["resumed"]
    assert resumed["ragged"] and resumed["steps"] == list(range(1, W.STEPS + 1)), r
    assert resumed["vs_unbroken"] <= BOUND and resumed["params"] <= BOUND, r


def test_cpu_ram_efficient_loading_gives_every_rank_rank0s_weights():
    """accelerate's ``cpu_ram_efficient_loading`` shards on the meta device and loads rank 0's weights
    with ``load_state_dict(assign=True)``; without the load hook ours ended 1.0 away (relative error)."""
    r = case_results(run(), "llama_rank0_weights")[0]
    assert r["ours"]["ragged"] and not r["fsdp2"]["ragged"], r
    assert r["ours"]["params"] <= BOUND and r["fsdp2"]["params"] <= BOUND, r
