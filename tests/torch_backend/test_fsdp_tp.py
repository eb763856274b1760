"""fully_shard composed with tensor parallelism (torchtitan's recipe: TP first, then FSDP on the dp mesh).

Workers: ``_tp_workers.py``. One launch of 4 gloo ranks as (dp 2, tp 2) trains the project's llama (its
TP plan with sequence parallel, ``torch_backend.models.apply_tensor_parallel``) and a HuggingFace
``LlamaForCausalLM`` (torchtitan-style projections plan) under ours and under PyTorch FSDP2 + TP, both
with loss parallelism (the logits split by vocabulary; once with them gathered instead), checks
bf16 mixed precision, 8-bit Adam and Muon against the same optimizer in one process, redistribute, the
refusals, and writes a DCP checkpoint that loads at (dp 4, tp 1)
in the same launch and at (dp 1, tp 2) in a 2-rank launch. One launch of 8 ranks runs HSDP as
(replicate 2, dp 2, tp 2).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from ragged.models import LLAMA_TINY
from tests.parity import assert_within_spread, float64_rtol, floored_by
from tests.torch_backend import _tp_workers as W
from tests.torch_backend._dist import case_results, launch

WORKERS = str(Path(W.__file__))
# Bounds. The AdamW and Muon cases run in float64 (W.FULL: models, activations, gloo's reductions; Muon
# computes in at least its parameters' dtype) against float64 single-process training: TP sums each
# rowwise layer's output in tp partial sums and the dp ranks' gradients in another order, which float64
# keeps far under Adam's eps, so ``tests.parity.float64_rtol`` holds on any CPU's kernels, for losses,
# gradient norms and parameters alike (in fp32 they needed 1e-5: ours measured 2.0e-6 to 3.6e-6 from the
# reference). FSDP2 + TP on the same case must meet the same bound: the case itself is sound. Measured:
# losses at most 3.2e-16, gradient norms 1.1e-15, parameters 4.2e-15 (Muon), against 1.1e-9.
RTOL = float64_rtol(W.STEPS)
# bf16 mixed precision and 8-bit Adam keep fp32 masters: bounded by the spread of their micro-batched
# reference over row orders (W.micro_reference, ``tests.parity.assert_within_spread``), FSDP2 + TP's bf16
# run too (measured: bf16 parameters 4.2e-3 against a spread of 2.0e-3, ours and FSDP2 alike; 8-bit Adam's
# at most its spread, 4.2e-5). Against float64 training the bf16 run stays within a few bf16 epsilons
# (2^-8) of 5 steps (5.9e-3).
BF16_RTOL = 2e-2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One launch per world size; the 2-rank one after the 4-rank one (it loads its checkpoint)."""
    ckpt = str(tmp_path_factory.mktemp("tp_ckpt"))

    @functools.cache
    def get(world: int) -> list[dict]:
        if world == 2:
            get(4)
        return launch(WORKERS, "checks", world, ckpt, timeout_s=300)

    return get


def assert_trains_like_reference_and_fsdp2(r: dict, logits: list[int]) -> None:
    ours, fsdp2 = r["ours"], r["fsdp2"]
    assert ours["logits"] == fsdp2["logits"] == logits, r  # what each rank holds: its rows, its TP part
    assert r["dtypes"] == ["torch.float64"], r
    assert all(v <= RTOL for v in (fsdp2["loss"], fsdp2["norm"], fsdp2["params"])), r  # the case is sound
    assert all(v <= RTOL for v in (ours["loss"], ours["norm"], ours["params"], r["ours_vs_fsdp2"])), r
    assert r["copy_bytes"] == 0 and r["reduce_scatters"] == [W.STEPS], r  # zero-copy; one reduce per unit


def spread_distances(r: dict) -> dict:
    return {k: r[k] for k in ("loss", "norm", "params")}


V, TP = LLAMA_TINY.vocab_size, 2


# Loss parallel: each rank holds the logits of its dp rank's rows (B / dp) for its vocab / tp columns. The
# loss on the parts takes each token's max exactly and its sum of exponentials as tp partial sums
# all-reduced: another order of the same terms, within the same float64 bound.
# llama_gathered_logits: the head's output gathered to the full vocabulary (loss_parallel=False).
@pytest.mark.parametrize("case, world, logits", [
    ("llama", 4, [W.B // 2, W.T, V // TP]), ("hf", 4, [W.B // 2, W.T, V // TP]),
    ("llama_hsdp", 8, [W.B // 4, W.T, V // TP]), ("hf_hsdp", 8, [W.B // 4, W.T, V // TP]),
    ("llama_gathered_logits", 4, [W.B // 2, W.T, V]),
])
def test_tp_then_fully_shard_trains_like_single_process_and_fsdp2(run, case, world, logits):
    assert_trains_like_reference_and_fsdp2(case_results(run(world), case)[0], logits)


def test_bf16_mixed_precision_trains_like_the_policy_reference_within_its_row_orders(run):
    """Ours and FSDP2 + TP under the same bf16 policy (fp32 masters) against one process applying the
    policy's casts per dp micro-batch, within that reference's spread over row orders."""
    r = case_results(run(4), "llama_bf16")[0]
    assert r["dtypes"] == ["torch.float32"], r  # the sharded masters stay fp32
    assert_within_spread(spread_distances(r["fsdp2"]), r["orders"])  # the case is sound
    assert_within_spread(spread_distances(r["ours"]), r["orders"])
    assert 0 < r["ours_vs_full"]["loss"] and r["ours_vs_full"]["params"] <= BF16_RTOL, r  # bf16, near float64


def test_sharded_parameters_compose_ragged_shard_on_dp_with_the_tp_placement(run):
    placements = case_results(run(4), "llama")[0]["placements"]
    assert placements["layers.0.attention.wq.weight"][1] == "S(0)"  # colwise
    assert placements["layers.0.attention.wo.weight"][1] == "S(1)"  # rowwise
    assert placements["layers.0.attention_norm.weight"][1] == "R"  # sequence parallel
    assert all(p[0].startswith("RS(") for p in placements.values()), placements
    hf = case_results(run(4), "hf")[0]["placements"]
    assert len(hf["model.norm.weight"]) == 1, hf  # a plain parameter in a TP unit: the dp mesh only


def test_redistribute_to_replicate_and_to_the_tp_placement_gives_the_reference_values(run):
    r = case_results(run(4), "redistribute")[0]
    assert r == {"replicate": 0.0, "tp_only": 0.0}, r  # pure data movement: bit-equal


@pytest.mark.parametrize("case, world", [("dcp_load_dp4_tp1", 4), ("dcp_load_dp1_tp2", 2)])
def test_dcp_saved_at_dp2_tp2_loads_at_another_mesh_and_trains_on(run, case, world):
    case_results(run(4), "dcp_save")[0]
    r = case_results(run(world), case)[0]
    assert r["state_keys"] and r["params"] == 0.0 and r["state"] == 0.0, r  # the saved bits, resharded
    # step 6 against the reference's, in float64
    assert r["loss"] <= float64_rtol(W.STEPS + 1) and r["after"] <= float64_rtol(W.STEPS + 1), r


@pytest.mark.parametrize("kind, world", [("llama", 4), ("hf", 4), ("llama_hsdp", 8)])
@pytest.mark.parametrize("optimizer", ["adam8bit", "muon"])
def test_8bit_adam_and_muon_under_tp_train_like_the_same_optimizer_in_one_process(run, kind, world,
                                                                                  optimizer):
    # 8-bit Adam with 8x8 tiles (they divide every TP part), Muon gathering each matrix over dp and tp (under
    # HSDP each replica over its own (dp, tp) slice). 8-bit Adam (fp32) against one process in the run's dp
    # micro-batches, within its spread over row orders: where a last-bit difference moves a moment across a
    # threshold of the codebook one code flips, and that element's step changes by a fraction of lr;
    # quantizing other tiles (8x4 against the reference's 8x8) moves every element by a code step. Muon in
    # float64: Newton-Schulz of the same gathered matrix, summation order only, as AdamW.
    r = case_results(run(world), f"{kind}_{optimizer}")[0]
    if optimizer == "adam8bit":  # losses and gradient norms move by code flips only through the parameters
        assert_within_spread(spread_distances(r), floored_by(r["orders"]))
    else:
        assert r["loss"] <= RTOL and r["norm"] <= RTOL and r["params"] <= RTOL, r
    assert r["moved"] >= 100 * r["params"], r  # the parameters did train


def test_8bit_adam_refuses_a_tp_split_that_cuts_its_tiles_naming_parameter_split_and_tile(run):
    # llama-tiny's wk is 32 x 64, ColwiseParallel over 2 TP ranks: 16 rows each, half of a 32x32 tile.
    message = case_results(run(4), "refusals")[0]["adam8bit"]
    assert message.startswith("TileError: layers.0.attention.wk.weight: Shard(0) over 2 devices cuts the "
                              "32x32 quantization tiles of shape (32, 64): each device gets 16 rows"), message


def test_split_logits_outside_loss_parallel_are_refused_saying_where_the_loss_must_run(run):
    message = case_results(run(4), "refusals")[0]["loss_parallel"]
    assert message.startswith("ValueError: cross_entropy: the logits are a DTensor (Shard(dim=2),)"), message
    assert "call backward under torch.distributed.tensor.parallel.loss_parallel()" in message, message


@pytest.mark.parametrize("case, rule", [
    ("partial", "composes with tensor parallelism's Shard(dim) and Replicate only"),
    ("uneven", "does not split evenly over 2 TP ranks"),
    ("other_mesh", "must be named sub-meshes of one device mesh"),
    ("same_dims", "shares the dims ['dp'] with the data-parallel mesh"),
    ("dp_uses_tp", "shares the dims ['tp'] with the data-parallel mesh"),
])
def test_what_cannot_compose_is_refused_naming_the_parameter_and_the_rule(run, case, rule):
    message = case_results(run(4), "refusals")[0][case]
    assert message.startswith("ValueError: fully_shard: parameter 'weight' is a DTensor"), message
    assert rule in message, message
