"""``torch_backend.fully_shard`` as a drop-in for FSDP2: its keywords and ``FSDPModule`` methods.

Workers: ``_dropin_workers.py``, one launch per world size (2 and 4). Each case trains a small token or
float-input model single-process (the reference), under ours and under PyTorch FSDP2 with the same
option or method, and compares both with the reference. Every model, batch and master is float64 (gloo
reduces it): losses and every parameter's relative norm within ``tests.parity.float64_rtol`` of the
reference (only the order of the sums differs, which float64 keeps far under Adam's eps, whatever the
CPU's kernels). Under a bf16 policy (bf16 compute, fp32 reduce): within the spread of the policy's own
single-process reference (a bf16 cast of the master and inputs per rank's rows, ``W.policy_reference``)
over row orders (``tests.parity.assert_within_spread``), and within bf16's own bound of float64 training.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.parity import assert_within_spread, float64_rtol
from tests.torch_backend import _dropin_workers as W
from tests.torch_backend._dist import Launcher, case_results

RTOL = float64_rtol(W.STEPS)
BF16_RTOL = 2e-2  # bf16 parameters and activations against the float64 reference (8 mantissa bits)
_CHECKPOINTS = tempfile.TemporaryDirectory(prefix="dropin_dcp_")  # removed when the session ends
run = Launcher(str(Path(W.__file__)), "checks", _CHECKPOINTS.name)


def result(world: int, case: str):
    return case_results(run(world), case)[0]


def assert_trains(r: dict, rtol: float = RTOL) -> None:
    """Ours and FSDP2 both within ``rtol`` of the single-process reference."""
    for which in ("ours", "fsdp2"):
        assert r[which]["loss"] <= rtol and r[which]["params"] <= rtol, (which, r)


def assert_within_the_policy_spread(r: dict, prefix: str = "") -> None:
    """bf16 ours and FSDP2 (the case is sound) within the spread of the policy reference's row orders."""
    for which in ("fsdp2", "ours"):
        assert_within_spread(r[f"{prefix}{which}_vs_policy"], r[f"{prefix}policy_orders"])


# ----- FSDPModule -----------------------------------------------------------------------------------
def test_our_modules_are_torch_fsdp_modules_and_override_every_method():
    r = result(2, "module_api")
    assert r["isinstance"] == [True, True, True]
    assert r["not_overridden"] == []  # none of FSDP2's own methods runs on our modules
    assert r["handle"], "unshard(async_op=True) returns a torch UnshardHandle"
    assert r["accepted"] == "no error"
    for method, message in r["refused"].items():
        assert message.startswith(f"NotImplementedError: FSDPModule.{method} (torch_backend): "), message
    assert "deepcopy" in r["deepcopy"] and "state dict" in r["deepcopy"]
    assert r["shared_class"] and r["slice"] == "Sequential", r  # FSDP2's class cache and __new__


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["divide_factor", "all_reduce_hook"])
def test_gradient_divide_factor_and_all_reduce_hook_scale_gradients_like_fsdp2(world, case):
    r = result(world, case)  # the gradients after one backward against the reference's, scaled alike
    assert r["fsdp2"] <= RTOL and r["ours"] <= RTOL, r


@pytest.mark.parametrize("world", [2, 4])
def test_micro_batches_without_sync_and_without_resharding_after_backward(world):
    r = result(world, "accumulate_without_resharding")
    assert_trains(r)
    kept, resharded = r["second_micro_batch_gathers_keep=True"], r["second_micro_batch_gathers_keep=False"]
    assert resharded == {"": 1, "blocks.0": 2, "blocks.1": 2, "embed": 2}, resharded
    assert kept == {"blocks.0": 1, "blocks.1": 1, "embed": 1}, kept  # no forward gather, root none


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_after_forward_method_and_int_forms(world):
    r = result(world, "reshard_after_forward")
    assert_trains(r)
    assert r["after_forward_unsharded"] == [True] * 4 and r["gathers_per_unit"] == [1]
    assert r["int"] == {"1": [True], str(world): [False]}  # FSDP2: 1 means False, the shard size True
    assert "divides the shard dim's size" in r["int_bad"], r["int_bad"]
    if world == 4:  # FSDP2's reshard to groups of 2 ranks after forward
        assert_trains(r["int_2"])
        for name, (state, kept, total) in r["int_2_state"].items():  # the root too: an explicit value
            assert (state, kept) == ("grouped", total // 2), (name, r["int_2_state"])
        assert r["int_2_groups"] == 1  # the units of one mesh share its post-forward communicators


@pytest.mark.parametrize("world", [2, 4])
def test_unshard_in_backward_false_skips_the_backward_gather(world):
    r = result(world, "unshard_in_backward")
    assert_trains(r)
    assert r["embed_gathers_in_backward"] == 0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["separate_group", "reset_iter_state"])
def test_separate_reduce_scatter_group_and_reset_iter_state(world, case):
    r = result(world, case)
    assert_trains(r)
    if case == "reset_iter_state":
        assert r["ours"]["caught"] == r["fsdp2"]["caught"] == "RuntimeError: injected"
        assert "must be called on the root" in r["not_root"]


def test_hsdp_requires_all_reduce_false_then_true_sums_both_micro_batches():
    assert_trains(result(4, "hsdp_requires_all_reduce"))


# ----- fully_shard's keywords -----------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_shard_placement_fn_shard0_trains_and_shard1_is_refused_naming_the_parameter(world):
    r = result(world, "shard_placement_fn")
    assert_trains(r)
    assert r["shard1"].startswith("NotImplementedError: fully_shard: shard_placement_fn returned S(1) for "
                                  "parameter 'up.weight'"), r["shard1"]


@pytest.mark.parametrize("world", [2, 4])
def test_ignored_params_stay_plain_and_unreduced_like_fsdp2(world):
    r = result(world, "ignored_params")
    assert r["ours_plain"] and r["fsdp2_plain"]
    # Each rank steps the ignored bias with its own gradient, so nothing equals the reference; ours
    # equals FSDP2 (same rows, same arithmetic).
    assert r["ignored_ours_vs_fsdp2"] <= RTOL, r
    assert abs(r["others_vs_reference"] - r["fsdp2_others_vs_reference"]) <= RTOL, r
    assert max(abs(a - b) / b for a, b in zip(r["ours_losses"], r["fsdp2_losses"])) <= RTOL, r


def test_unknown_policies_and_dp_mesh_dims_are_refused_naming_the_option():
    r = result(2, "refused_keywords")
    assert r["dp_mesh_dims"].startswith("NotImplementedError: fully_shard: dp_mesh_dims"), r
    assert r["offload_policy"].startswith("TypeError: fully_shard: offload_policy='cpu'"), r
    assert r["mp_policy"].startswith("TypeError: fully_shard: mp_policy='bf16'"), r


# ----- mixed precision ------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_torch_mixed_precision_policy_casts_inputs_and_outputs_like_fsdp2(world):
    r = result(world, "torch_mp_policy")
    assert_within_the_policy_spread(r)
    assert_trains(r, BF16_RTOL)
    assert r["dtypes"]["ours"] == r["dtypes"]["fsdp2"] == {"block_in": "torch.bfloat16",
                                                           "output": "torch.float32"}
    for which in ("ours", "fsdp2"):  # cast_forward_inputs=False: fp32 inputs meet bf16 weights in both
        assert "must have the same dtype" in r[f"no_cast_{which}"], r


# ----- CPU offload ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_cpu_offload_trains_like_fsdp2_with_host_parameters_gradients_and_optimizer_state(world):
    r = result(world, "cpu_offload")
    assert_trains({"ours": r["ours"], "fsdp2": r["fsdp2"]})
    assert_within_the_policy_spread(r, "bf16_")
    assert_trains({"ours": r["ours_bf16"], "fsdp2": r["fsdp2_bf16"]}, BF16_RTOL)
    assert r["where"] == {"devices": ["cpu"], "offload": True, "separate_compute_buffer": True}, r
    assert "accelerator" in r["pin_memory_default"]  # FSDP2 pins even without an accelerator; ours does not


# ----- beyond FSDP2 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_gradient_penalty_double_backward_trains_like_single_process(world):
    r = result(world, "gradient_penalty")
    assert "error" in r["fsdp2"], r  # FSDP2 frees what the penalty's graph still views
    assert r["ours"]["loss"] <= RTOL and r["ours"]["params"] <= RTOL, r
    assert "backward(create_graph=True)" in r["create_graph_backward"], r  # refused, naming the fix


@pytest.mark.parametrize("world", [2, 4])
def test_embedding_max_norm_renorms_rows_used_on_any_rank(world):
    r = result(world, "embedding_max_norm")
    assert r["fsdp2"]["params"] > 0.1, r  # FSDP2 loses the renormed rows at reshard
    assert r["ours"]["loss"] <= RTOL and r["ours"]["params"] <= RTOL, r


# ----- async DCP ------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_dcp_async_save_then_load_at_another_world_size(world):
    r = result(world, "async_dcp")  # at 4 ranks loaded over 2; at 2 over the same 2
    for which in ("ours", "fsdp2"):
        assert r[which]["model"] == 0.0 and r[which]["optim"] == 0.0, r  # bit-exact round trip


# ----- torch.compile --------------------------------------------------------------------------------
def test_torch_compile_with_inductor_whole_model_and_per_block():
    r = result(2, "compiled")
    for key in ("ours_whole", "ours_blocks", "fsdp2_whole", "fsdp2_blocks"):
        assert r[key]["loss"] <= RTOL and r[key]["params"] <= RTOL, (key, r)
    # The hooks run outside the graphs, as FSDP2's: per block, one graph shared by the identical blocks
    # and no graph break, as FSDP2 gets; whole, the graph breaks FSDP2 has.
    for key in ("graphs", "breaks"):
        assert r["ours_blocks"][key] == r["fsdp2_blocks"][key], r
    assert r["ours_blocks"]["breaks"] == 0, r
    assert r["ours_whole"]["graphs"] >= 1 and r["ours_whole"]["breaks"] == r["fsdp2_whole"]["breaks"], r
