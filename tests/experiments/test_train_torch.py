"""``experiments.train`` on the torch stack, its memory plan and its data, on CPU.

The distributed runs are checked against plain single-process training (an unsharded ``Llama`` or
``MoEDecoder``, the same init and batches, ``torch.optim.AdamW``), and a run killed after a checkpoint must
resume bit for bit. One test launches through the ``torchrun`` CLI (killed, then relaunched); the others fork
their ranks from the tests' preloaded forkserver (``_train_launch.torch_ranks``: the same ``main``, the
environment torchrun gives each worker, a fraction of a second to start instead of several per process).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import ragged
import ragged.models
from experiments._train.data import TokenSource
from experiments.train import main
from tests.experiments._train_launch import LOSS_RTOL, TINY, losses, torch_ranks, torchrun

STEPS, LR, WD = 5, 3e-3, 0.1


def plain_torch_losses(steps: int, optimizer: str = "adamw") -> list[float]:
    """The reference: one process, no sharding, the run's init (``init_weights(0)``) and batches, with
    ``torch.optim.AdamW`` or (``optimizer="muon"``) our Muon as the run builds it."""
    from torch_backend.models import Llama, cross_entropy
    from torch_backend.optim import Muon

    torch.manual_seed(0)
    model = Llama(ragged.models.LLAMA_TINY)
    model.init_weights(0)
    opt = (Muon(model.named_parameters(), lr=LR, weight_decay=WD) if optimizer == "muon" else
           torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    data = TokenSource(ragged.models.LLAMA_TINY.vocab_size, 32, 8, seed=0)
    out = []
    for step in range(steps):
        tokens = torch.from_numpy(data.rows(step, 0, 8)).long()
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_torchrun_two_gloo_processes_match_plain_training_and_resume_bit_exactly(tmp_path):
    """Killed after step 3 (checkpoint after steps 0 and 1), relaunched: steps 2 and 3 come out
    bit-identical to the first launch's (step 3 needs the optimizer state back too), and every step
    equals plain single-process training."""
    args = [*TINY, "--steps", str(STEPS), "--lr", str(LR), "--weight-decay", str(WD),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-interval", "2"]
    first = torchrun(2, [*args, "--fail-after-step", "3"])
    assert first.returncode != 0
    before = losses(tmp_path / "ckpt" / "log.jsonl")
    assert sorted(before) == [0, 1, 2, 3]
    second = torchrun(2, args)
    assert second.returncode == 0, second.stderr[-3000:]
    after = losses(tmp_path / "ckpt" / "log.jsonl")
    assert [after[s] for s in (2, 3)] == [before[s] for s in (2, 3)]  # resumed bit for bit
    want = plain_torch_losses(STEPS)
    got = [after[s] for s in range(STEPS)]
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000002", "step_00000004",
                                                                         "step_00000005"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_tensor_parallel_matches_plain_training(tmp_path, optimizer):
    """``--tp 2`` on 4 gloo processes: a (dp 2, tp 2) mesh, torchtitan's plan with sequence parallel and loss
    parallel (the loss on each TP rank's vocabulary half), then fully_shard on dp; the meta-device init
    writes each TP rank's part, and every step's loss equals plain single-process training with the same
    optimizer (Muon gathers each matrix over dp and tp)."""
    args = [*TINY, "--steps", str(STEPS), "--lr", str(LR), "--weight-decay", str(WD), "--tp", "2",
            "--optimizer", optimizer, "--checkpoint-dir", str(tmp_path / "ckpt")]
    result = torch_ranks(4, args)
    assert result.returncode == 0, result.stderr[-3000:]
    got = losses(tmp_path / "ckpt" / "log.jsonl")
    np.testing.assert_allclose([got[s] for s in range(STEPS)], plain_torch_losses(STEPS, optimizer),
                               rtol=LOSS_RTOL)


def test_tp_that_does_not_divide_the_devices_or_the_sequence_is_refused():
    with pytest.raises(SystemExit, match="--tp 3: the tensor-parallel degree must divide"):
        main([*TINY, "--tp", "3", "--dry-run", "--gpus", "4"])


def test_tp_on_an_moe_or_with_a_non_elementwise_jax_optimizer_is_refused():
    wired = "--tp 2: tensor parallelism is wired for the llamas only, not mixtral-tiny"
    with pytest.raises(SystemExit, match=wired):
        main(["--model", "mixtral-tiny", "--tp", "2", "--dry-run", "--gpus", "4"])
    with pytest.raises(SystemExit, match="--tp: on the JAX stack tensor parallelism runs with adamw"):
        main(["--stack", "jax", "--optimizer", "muon", "--tp", "2", "--dry-run", "--gpus", "4"])


def plain_moe_losses(name: str, steps: int, ranks: int) -> list[float]:
    """The MoE reference: one process, no sharding; each step averages the loss of each rank's rows, computed
    apart (the load-balancing loss is a product of per-batch means, so it is defined per rank's batch, as
    data-parallel training defines it)."""
    from torch_backend.models import MoEDecoder, moe_loss

    c = ragged.models.MOE_CONFIGS[name]
    model = MoEDecoder(c)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    data = TokenSource(c.vocab_size, 16, 4, seed=0)
    out = []
    for step in range(steps):
        tokens = torch.from_numpy(data.rows(step, 0, 4)).long()
        loss = sum(moe_loss(model(rows[:, :-1]), rows[:, 1:], c.aux_loss_coef)
                   for rows in tokens.chunk(ranks)) / ranks
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("name", ["mixtral-tiny", "gpt-oss-tiny", "deepseek-v3-tiny"])
def test_trains_the_moe_presets_like_plain_training(tmp_path, name):
    """The MoE presets train as MoE decoders (both expert storages, both routers) on 2 gloo processes."""
    args = ["--model", name, "--dtype", "fp32", "--batch", "4", "--seq-len", "16", "--no-progress",
            "--steps", "3",
            "--lr", str(LR), "--weight-decay", str(WD), "--checkpoint-dir", str(tmp_path)]
    result = torch_ranks(2, args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{name}: MoE: " in result.stderr
    got = losses(tmp_path / "log.jsonl")
    np.testing.assert_allclose([got[s] for s in range(3)], plain_moe_losses(name, 3, ranks=2), rtol=1e-5)


@pytest.mark.parametrize("name", ["mixtral-tiny", "gpt-oss-tiny"])
def test_ep_trains_like_plain_training_and_its_checkpoint_resumes_without_ep(tmp_path, name):
    """``--ep 2`` on 2 gloo processes (each keeps half of the experts), checkpointed after step 2; relaunched
    without ``--ep``, the run loads that checkpoint (one-process expert names, fused tensors whole) and goes
    on: every step equals plain training. Bound: test_fsdp_moe's 1e-5 on losses (expert parallelism sums
    an expert's gradient in another order; the loss moves far less than the 1e-4 it allows parameters)."""
    args = ["--model", name, "--dtype", "fp32", "--batch", "4", "--seq-len", "16", "--no-progress",
            "--lr", str(LR), "--weight-decay", str(WD), "--checkpoint-dir", str(tmp_path),
            "--save-interval", "2"]
    first = torch_ranks(2, [*args, "--steps", "2", "--ep", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = torch_ranks(2, [*args, "--steps", "4"])
    assert second.returncode == 0, second.stderr[-3000:]
    got = losses(tmp_path / "log.jsonl")
    np.testing.assert_allclose([got[s] for s in range(4)], plain_moe_losses(name, 4, ranks=2), rtol=1e-5)


def test_ep_with_hsdp_trains_like_plain_training_and_resumes_as_plain_hsdp(tmp_path):
    """``--ep 2 --hsdp 2`` on 4 gloo processes, gpt-oss-tiny (fused experts: the checkpoint writes each
    whole ``[E, ...]`` tensor from (replicate, ep, fsdp) slices), checkpointed after step 2 and resumed with
    ``--hsdp 2`` alone: every step equals plain training (bound as in the test above)."""
    args = ["--model", "gpt-oss-tiny", "--dtype", "fp32", "--batch", "4", "--seq-len", "16", "--no-progress",
            "--lr", str(LR), "--weight-decay", str(WD), "--checkpoint-dir", str(tmp_path),
            "--save-interval", "2", "--hsdp", "2"]
    first = torch_ranks(4, [*args, "--steps", "2", "--ep", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = torch_ranks(4, [*args, "--steps", "4"])
    assert second.returncode == 0, second.stderr[-3000:]
    got = losses(tmp_path / "log.jsonl")
    np.testing.assert_allclose([got[s] for s in range(4)], plain_moe_losses("gpt-oss-tiny", 4, ranks=4),
                               rtol=1e-5)


def test_ep_is_refused_where_it_cannot_split_the_experts():
    """Refused by ``main`` before any process group exists (a launched run's ranks refuse alike)."""
    with pytest.raises(SystemExit, match="--ep 2: it trains mixture-of-experts models only"):
        main([*TINY, "--steps", "1", "--ep", "2"])
    with pytest.raises(SystemExit, match="--ep 2 must divide the 1 devices of each replica's shard group"):
        main(["--model", "mixtral-tiny", "--ep", "2", "--hsdp", "2", "--dry-run", "--gpus", "2"])
    with pytest.raises(SystemExit, match="--ep 3: it must divide the 8 experts of mixtral-tiny"):
        main(["--model", "mixtral-tiny", "--ep", "3", "--dry-run", "--gpus", "6"])


def test_adam8bit_state_resumes_bit_exactly(tmp_path):
    """8-bit Adam's state (per-rank local tensors, a step count) is saved beside the DCP checkpoint.

    Checkpoint after steps 0 and 1, killed after step 3: step 2's loss needs only the weights back, step 3's
    also the optimizer state of step 2's update."""
    args = [*TINY, "--optimizer", "adam8bit", "--steps", "4", "--checkpoint-dir", str(tmp_path),
            "--save-interval", "2"]
    assert torch_ranks(1, [*args, "--fail-after-step", "3"]).returncode != 0
    before = losses(tmp_path / "log.jsonl")
    resumed = torch_ranks(1, args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(tmp_path / "log.jsonl")
    assert [after[2], after[3]] == [before[2], before[3]]


def test_a_preset_too_large_is_refused_before_allocating():
    result = torch_ranks(1, ["--model", "llama3-405b", "--no-progress", "--steps", "1"])
    assert result.returncode != 0
    assert "out of memory: llama3-405b needs about" in result.stderr
    assert "refused before allocating" in result.stderr
    # The process never came near the model's size (405 B parameters are 1.6 TB in fp32).
    assert 0 < result.peak_rss_kib < 4 * 2**20  # KiB: 4 GiB


def test_dry_run_prints_the_plan_of_the_core(capsys):
    main(["--model", "llama3-70b", "--gpus", "64", "--seq-len", "8192", "--batch", "64",
          "--activation-checkpointing", "--dry-run"])
    printed = capsys.readouterr().out
    config, _ = ragged.models.trained_llama("llama3-70b")
    plan = ragged.models.memory_plan("llama3-70b", config, 64, seq_len=8192, batch_per_device=1,
                              activation_checkpointing=True)
    assert plan.describe() in printed
    assert "64 devices = 1 replica(s) x 64 shards" in printed and "total per device" in printed


def test_dry_run_with_tp_plans_the_tp_local_units_for_the_batch_of_each_tp_group(capsys):
    main(["--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--seq-len", "8192", "--batch", "16",
          "--activation-checkpointing", "--dry-run"])
    config, _ = ragged.models.trained_llama("llama3-70b")
    plan = ragged.models.memory_plan("llama3-70b", config, 64, tp=8, seq_len=8192, batch_per_device=2,
                                     activation_checkpointing=True)  # 16 sequences over 8 data-parallel ranks
    assert plan.describe() in capsys.readouterr().out


def test_dry_run_of_an_moe_preset_counts_every_expert_tensor(capsys):
    main(["--model", "deepseek-v3", "--gpus", "256", "--batch", "256", "--seq-len", "4096", "--dry-run"])
    printed = capsys.readouterr().out
    config, _ = ragged.models.trained_model("deepseek-v3")
    plan = ragged.models.memory_plan("deepseek-v3", config, 256, seq_len=4096)
    assert plan.describe() in printed and "256 modules experts of 2048, top-8 sigmoid" in printed
    assert plan.numel == ragged.models.moe_shapes("deepseek-v3", config).numel > 600e9


def test_memory_plan_closed_forms():
    """One device holds the whole model unpadded: 4 + 4 + 8 bytes per parameter under AdamW."""
    config, _ = ragged.models.trained_llama("llama3-8b")
    plan = ragged.models.memory_plan("llama3-8b", config, 1, optimizer="adamw", seq_len=1024)
    assert plan.numel == 8_030_261_248  # Meta's published count for Llama 3 8B
    assert (plan.params, plan.grads, plan.optimizer_state) == (4 * plan.numel, 4 * plan.numel, 8 * plan.numel)
    assert plan.unsharded == (128256 * 4096 + 4096) * (3 * 2 + 4)  # the output unit (norm + head) is largest
    assert plan.logits == 1024 * 128256 * (2 + 8)
    sharded = ragged.models.memory_plan("llama3-8b", config, 64, replicas=2, optimizer="adam8bit",
                                        seq_len=1024)
    assert sharded.shard_group == 32
    layouts = ragged.plan_model(ragged.models.llama_shapes("llama3-8b", config), 32)
    shard = sum(lay.shard_size for lay in layouts)
    assert sharded.params == 4 * shard and sharded.optimizer_state == int(np.ceil(2.0078125 * shard))
    checkpointed = ragged.models.memory_plan("llama3-8b", config, 1, seq_len=1024,
                                             activation_checkpointing=True)
    assert checkpointed.activations < plan.activations / 10
    # 6 N + 12 L H Q T with N the non-embedding parameters
    matmul_params = 8_030_261_248 - 128256 * 4096
    assert ragged.models.flops_per_token(config, 1024) == 6 * matmul_params + 12 * 32 * 32 * 128 * 1024
    with pytest.raises(ragged.RaggedError, match="3 HSDP replicas must divide 64"):
        ragged.models.memory_plan("llama3-8b", config, 64, replicas=3)


def test_token_file_rows_are_slices_of_the_file_and_split_over_ranks(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 1000, 5000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    data = TokenSource(1000, 16, 6, seed=3, path=str(path))
    rows = data.rows(7, 0, 6)
    offsets = np.random.default_rng([3, 7]).integers(0, 5000 - 17, 6)
    np.testing.assert_array_equal(rows, np.stack([tokens[o:o + 17] for o in offsets]))
    np.testing.assert_array_equal(np.concatenate([data.rows(7, 0, 2), data.rows(7, 2, 6)]), rows)
    assert not np.array_equal(data.rows(8, 0, 6), rows)
    with pytest.raises(ValueError, match="token id .* is not below the model's vocabulary of 10"):
        TokenSource(10, 16, 6, path=str(path)).rows(0, 0, 6)


def test_ep_that_does_not_divide_the_shard_group_is_refused_and_auto_hsdp_respects_it(capsys):
    with pytest.raises(SystemExit, match=r"--ep 4 must divide the 2 devices of each replica's shard group"):
        main(["--model", "mixtral-tiny", "--ep", "4", "--hsdp", "2", "--dry-run", "--gpus", "4"])
    # Without EP the advisor shards gpt-oss-tiny over groups of 12 of the 24 devices (less padding), which
    # EP 8 cannot split: with --ep 8 it must pick a group EP divides.
    main(["--model", "gpt-oss-tiny", "--hsdp", "auto", "--dry-run", "--gpus", "24", "--batch", "24"])
    assert "2 replica(s) x 12 shards" in capsys.readouterr().out
    main(["--model", "gpt-oss-tiny", "--ep", "8", "--hsdp", "auto", "--dry-run", "--gpus", "24",
          "--batch", "24"])
    group = int(re.search(r"x (\d+) shards", capsys.readouterr().out).group(1))
    assert group % 8 == 0


def test_adam8bit_with_a_tp_split_that_cuts_its_tiles_is_refused_before_launch():
    """llama-tiny's wk (32 x 64) keeps 16 rows of each 32x32 tile per TP rank at tp 2 (Adam8bit's own
    TileError, raised here from the plan instead of inside every worker); llama3-8b's split keeps them."""
    with pytest.raises(SystemExit, match=r"--tp 2 --optimizer adam8bit: .*wk.weight.*cuts the 32x32"):
        main([*TINY, "--tp", "2", "--optimizer", "adam8bit", "--dry-run", "--gpus", "4"])
    main(["--model", "llama3-8b", "--tp", "8", "--optimizer", "adam8bit", "--dry-run", "--gpus", "64",
          "--batch", "8"])
