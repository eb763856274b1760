"""``transformers.Trainer`` through HF accelerate's FSDP2 plugin, sharding with ours via
``torch_backend.integrations.use_in_accelerate``, at 2 gloo ranks.

An HF Llama and an HF Qwen3-MoE (experts routed per token, inside accelerate's decoder-layer units)
train four clipped AdamW steps under ``Trainer`` with ours and with PyTorch FSDP2 (accelerate's own
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
from tests.torch_backend import _accelerate_workers as W
from tests.torch_backend._dist import case_results, launch
from torch_backend.integrations import use_in_accelerate

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

# Bounds as in test_fsdp_user_models: ours at most twice FSDP2's distance from the reference (the same
# data-parallel arithmetic, sums in another order), one fp32 rounding per step where that is zero; FSDP2
# itself far below one wrong step (lr 1e-2 on weights of scale 0.02) for it to be a baseline. A resumed
# run repeats the unbroken run's last steps on the same values: equal up to the floor, where a checkpoint
# that was not loaded (another seed's weights) would be off by about 1.
FP32_FLOOR = W.STEPS * torch.finfo(torch.float32).eps
SOUND_CASE = 1e-3
WORLD = 2


@functools.cache
def run() -> list[dict]:
    return launch(str(Path(W.__file__)), "checks", WORLD, timeout_s=400)


def within_baseline(ours: float, baseline: float) -> bool:
    return ours <= max(FP32_FLOOR, 2 * baseline)


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
    assert max(fsdp2["loss"], fsdp2["grad_norm"], fsdp2["params"]) < SOUND_CASE, fsdp2
    for metric in ("loss", "grad_norm", "params"):
        assert within_baseline(ours[metric], fsdp2[metric]), (metric, r)
    assert within_baseline(r["ours_vs_fsdp2"], fsdp2["params"]), r


@pytest.mark.parametrize("model", list(W.MODELS))
def test_trainer_resumes_from_its_sharded_checkpoint(model):
    r = case_results(run(), model)[0]
    resumed = r["resumed"]
    assert resumed["ragged"] and resumed["steps"] == list(range(1, W.STEPS + 1)), r
    assert resumed["vs_unbroken"] <= FP32_FLOOR, r
    assert within_baseline(resumed["params"], r["fsdp2"]["params"]), r


def test_cpu_ram_efficient_loading_gives_every_rank_rank0s_weights():
    """accelerate's ``cpu_ram_efficient_loading`` shards on the meta device and loads rank 0's weights
    with ``load_state_dict(assign=True)``; without the load hook ours ended 1.0 away (relative error)."""
    r = case_results(run(), "llama_rank0_weights")[0]
    assert r["ours"]["ragged"] and not r["fsdp2"]["ragged"], r
    assert r["fsdp2"]["params"] < SOUND_CASE, r
    assert within_baseline(r["ours"]["params"], r["fsdp2"]["params"]), r
