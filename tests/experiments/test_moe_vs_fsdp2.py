"""The core part of experiments/moe_vs_fsdp2.py (the 256-GPU cliff) against closed forms written out here.

FSDP2's per-parameter ``Shard(0)`` gives every device ``ceil(rows / m)`` rows of every tensor, so one
unit's all-gather buffer is ``m * ceil_to(sum_t ceil(rows_t / m) * row_numel_t, 4)`` elements (4: 16 bytes
of fp32, the alignment the experiment and the planner use). GPT-OSS-120B's decoder layer is written out
from its published sizes (dim 2880, 64 query and 8 kv heads of 64, 128 experts of 2880, fused gate-up of
2 x 2880 with biases), not taken from ``ragged.models``.
"""

import math

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
