"""experiments/moe_vs_fsdp2.py: the core part (the 256-GPU cliff) against closed forms written out here, and
the JAX part (EP + ragged FSDP against GSPMD with an expert axis) on its losses and collective counts.

FSDP2's per-parameter ``Shard(0)`` gives every device ``ceil(rows / m)`` rows of every tensor, so one
unit's all-gather buffer is ``m * ceil_to(sum_t ceil(rows_t / m) * row_numel_t, 4)`` elements (4: 16 bytes
of fp32, the alignment the experiment and the planner use). GPT-OSS-120B's decoder layer is written out
from its published sizes (dim 2880, 64 query and 8 kv heads of 64, 128 experts of 2880, fused gate-up of
2 x 2880 with biases), not taken from ``ragged.models``.
"""

import importlib
import math
import os

import pytest

from experiments.moe_vs_fsdp2 import CLIFF_DEVICES, cliff

D, E, F = 2880, 128, 2880
GPT_OSS_LAYER = [(4096, D), (512, D), (512, D), (D, 4096),  # wq, wk, wv, wo
                 (E, D), (E,),  # router weight and bias
                 (E, D, 2 * F), (E, 2 * F), (E, F, D), (E, D),  # fused experts and their biases
                 (D,), (D,)]  # the two norms


def fsdp2_buffer(m: int) -> int:
    shard = sum(-(-s[0] // m) * math.prod(s[1:]) for s in GPT_OSS_LAYER)
    return m * (-(-shard // 4) * 4)


@pytest.fixture(scope="module")
def rows():
    return {r["devices"]: r for r in cliff()}


def test_fsdp2_layer_buffer_and_its_memory_term_are_the_closed_form(rows):
    numel = sum(math.prod(s) for s in GPT_OSS_LAYER)
    for m in CLIFF_DEVICES:
        r = rows[m]
        assert r["numel"] == numel
        assert r["fsdp2"]["buffer"] == fsdp2_buffer(m), m
        # two bf16 copies gathered (running, prefetched) + the bf16 and fp32 unsharded gradient: 10 B/element,
        # of the largest unit, which is this layer (the 201088 x 2880 embedding is 5.6x smaller)
        assert r["fsdp2"]["unsharded_bytes"] == 10 * fsdp2_buffer(m), m
        assert r["fsdp2_expert_rows_per_device"] == -(-E // m)


def test_fsdp2_doubles_its_buffer_from_128_to_256_devices_and_ours_does_not(rows):
    assert fsdp2_buffer(256) / fsdp2_buffer(128) > 1.99  # one whole expert per device, half of them padding
    assert rows[256]["fsdp2"]["buffer"] == fsdp2_buffer(256)
    assert rows[256]["ours"]["buffer"] < 1.001 * rows[128]["ours"]["buffer"]
    assert not rows[256]["fsdp2"]["fits"] and rows[256]["ours"]["fits"]


def test_ours_is_near_the_lower_bound_and_below_fsdp2_where_fsdp2_pads(rows):
    """Ours never beats ``ceil(numel / m)`` per device; it stays within 0.1% of FSDP2 where FSDP2's even split
    happens to be exact (64, 128: 2 and 1 whole experts per device; ours keeps each tensor contiguous, so
    the shard boundaries must fall between rows of one flat buffer) and is smaller wherever FSDP2 pads."""
    for m in CLIFF_DEVICES:
        ours, theirs, numel = rows[m]["ours"]["buffer"], rows[m]["fsdp2"]["buffer"], rows[m]["numel"]
        assert ours >= m * -(-numel // m)
        if theirs > 1.01 * numel:
            assert ours < theirs, m
        else:
            assert ours <= 1.001 * theirs, m


def test_ours_with_ep_gathers_one_ep_ranks_experts_and_the_rest_of_the_layer(rows):
    """Under EP 8 a device gathers the layer without its experts and 16 of the 128 experts: at least their
    elements and under a fifth of the whole layer's buffer; the largest unit gathered is then that or the
    head (201088 x 2880 plus the final norm), and the step fits where FSDP2's does not."""
    from experiments.moe_vs_fsdp2 import CLIFF_EP

    rest = sum(math.prod(s) for s in GPT_OSS_LAYER[:6] + GPT_OSS_LAYER[10:])
    experts = sum(math.prod(s) for s in GPT_OSS_LAYER[6:10]) // CLIFF_EP
    head = 201088 * D + D
    for m in CLIFF_DEVICES:
        ep = rows[m]["ours_ep"]
        assert rest + experts <= ep["buffer"] < rows[m]["ours"]["buffer"] / 5, m
        assert ep["unsharded_bytes"] >= 10 * max(ep["buffer"], head) and ep["fits"], m
        assert ep["unsharded_bytes"] < rows[m]["ours"]["unsharded_bytes"] / 5, m


# ---- the JAX part: ours (EP + ragged FSDP) against GSPMD with an expert axis, 8 host devices ---------------

@pytest.fixture(scope="module")
def jax_part():
    """experiments._moe_vs_fsdp2_jax, imported once the backend runs on the suite's XLA_FLAGS (conftest):
    importing experiments.jax_vs_gspmd appends its own flags, which the rest of the suite must not get."""
    import jax

    jax.devices()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored on leaving
        return importlib.import_module("experiments._moe_vs_fsdp2_jax")


@pytest.fixture(scope="module")
def gpt_oss_2x4(jax_part):
    """Two steps of each program (one warm-up round, one kept) on 8 x 8 tokens, (ep, fsdp) = (2, 4)."""
    batches = jax_part.token_batches(2, 8, 8, 256)
    return jax_part.bench("gpt-oss-tiny", 2, 4, batches, rounds=2, warmup=1)


def test_jax_part_ours_and_gspmd_compute_the_same_losses(gpt_oss_2x4):
    """Both minimise the mean over device batches of moe_loss (ours drops nothing at capacity_factor=None),
    so they differ only by fp32 summation order: an expert's gradient summed over EP peers and fsdp ranks in
    another order, the chosen outputs combined by another contraction. Bound: 1e-5 relative, the bound of
    tests/jax_backend/test_expert_parallel.py for EP against single-device training (measured 1.7e-7)."""
    r = gpt_oss_2x4
    assert r["dropped_assignments"] == 0
    assert len(r["losses"]["ours"]) == len(r["losses"]["gspmd"]) == 2
    assert all(math.isfinite(x) for x in r["losses"]["ours"])
    assert r["losses"]["ours"][1] != r["losses"]["ours"][0]  # a step was taken (another batch, new params)
    assert r["max_relative_loss_difference"] <= 1e-5


def test_jax_part_collectives_of_ours_follow_from_its_units_and_moe_layers(gpt_oss_2x4):
    """Per step, ours gathers each FSDP unit in its forward and, resharded after forward (the default),
    every unit but the root again in its backward, where XLA drops the embedding's (its backward needs no
    weights); it reduce-scatters each unit once. Each MoE layer exchanges tokens by one all_to_all each
    way in the forward, and the backward transposes both: 4 per MoE layer. GSPMD's choices are XLA's and
    are only recorded."""
    r = gpt_oss_2x4
    ours = r["collectives"]["ours"]
    assert r["moe_layers"] == 2 and r["units"] == 6  # embedding, 2 attentions, 2 experts units, root
    assert ours["all-to-all"]["ops"] == 4 * r["moe_layers"]
    assert ours["reduce-scatter"]["ops"] == r["units"]
    assert ours["all-gather"]["ops"] == r["units"] + r["units"] - 2
    for run in ("ours", "gspmd"):
        assert r["rows"][run]["temp_bytes"] > 0  # memory_analysis of the compiled executable


def test_gspmd_specs_put_experts_on_ep_and_the_rest_on_both_axes(jax_part):
    """gpt-oss-tiny's fused experts and mixtral-tiny's stacked ones, (ep, fsdp) = (2, 4): dim 0 on ep, the
    largest other dim 4 divides on fsdp; everything else on the largest dim 8 divides, over both axes."""
    from jax.sharding import PartitionSpec as P

    spec = jax_part.expert_axis_spec
    ep_fsdp = ("ep", "fsdp")
    assert spec("layers.0.feed_forward.experts.gate_up_proj", (8, 64, 96), 4) == P("ep", None, "fsdp")
    assert spec("layers.0.feed_forward.experts.gate_up_proj_bias", (8, 96), 4) == P("ep", "fsdp")
    assert spec("layers.0.feed_forward.experts.down_proj", (8, 48, 64), 4) == P("ep", None, "fsdp")
    assert spec("layers.0.feed_forward.experts.stacked.w1.weight", (8, 96, 64), 4) == P("ep", "fsdp", None)
    assert spec("layers.0.feed_forward.experts.stacked.w1.weight", (8, 6, 3), 4) == P("ep", None, None)
    assert spec("layers.0.feed_forward.router.weight", (8, 64), 4) == P(None, ep_fsdp)
    assert spec("layers.0.feed_forward.shared_expert.w1.weight", (32, 64), 4) == P(None, ep_fsdp)
    assert spec("norm.weight", (6,), 4) == P()


def test_stacked_experts_equal_the_expert_list(jax_part):
    """GSPMD's mixtral-tiny runs its per-expert SwiGLUs as one stacked FeedForward under vmap: the same
    values as ExpertList on every expert's rows (same arithmetic per expert; 1e-6 allows XLA to fuse the
    batched dots differently)."""
    import jax
    import numpy as np
    from flax import nnx

    from jax_backend.models.moe import MoEDecoder
    from ragged.models import MOE_CONFIGS

    experts = MoEDecoder(MOE_CONFIGS["mixtral-tiny"], rngs=nnx.Rngs(0)).layers[0].feed_forward.experts
    x = jax.random.normal(jax.random.key(1), (8, 5, 64))
    stacked = jax_part.StackedExperts(experts)
    assert stacked.stacked.w1.weight.shape == (8, 96, 64)
    np.testing.assert_allclose(stacked(x), experts(x), rtol=1e-6, atol=1e-6)
