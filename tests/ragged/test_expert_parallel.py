"""The core's EP x ragged FSDP plan: each EP rank's experts planned over fsdp, composed over ep x fsdp.

Checked against brute force over the flat buffers: packing each full-model expert tensor (or its rows)
into the composed layout must put EP rank ``i``'s experts exactly where the local plan puts them inside
shards ``[i fsdp, (i+1) fsdp)``, so gathering over fsdp alone rebuilds the rank's buffer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ragged import PlanningError
from ragged.models import MOE_CONFIGS, expert_shapes, moe_shapes, plan_expert_parallel


def pack(layout, tensors: dict) -> np.ndarray:
    buf = np.zeros(layout.total_numel)
    for t in layout.tensors:
        buf[t.offset:t.end] = tensors[t.name].ravel()
    return buf


@pytest.mark.parametrize("name", ["mixtral-tiny", "gpt-oss-tiny", "deepseek-v3-tiny"])
@pytest.mark.parametrize("ep,fsdp", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_each_ep_rank_holds_its_experts_where_the_local_plan_puts_them(name, ep, fsdp):
    c = MOE_CONFIGS[name]
    rng = np.random.default_rng(0)
    full = {fqn: rng.standard_normal(shape) for fqn, shape in
            (t for unit in moe_shapes(name, c).units for t in unit.tensors)}
    units = plan_expert_parallel(c, ep, fsdp)
    assert [u.name for u in units] == [f"layers.{i}.feed_forward.experts" for i in range(c.n_layers)
                                       if c.is_moe(i)]
    n_local = c.n_experts // ep
    for unit in units:
        assert unit.local.world_size == fsdp and unit.layout.world_size == ep * fsdp
        assert unit.layout.shard_size == unit.local.shard_size
        assert [(t.name, t.shape) for t in unit.local.tensors] == expert_shapes(unit.name, c, n_local)
        composed = pack(unit.layout, {t.name: (full[s.fqn] if s.lo is None else full[s.fqn][s.lo:s.hi])
                                      for t, s in zip(unit.layout.tensors, unit.sources)})
        for i in range(ep):  # rank i's local tensors, taken from the full model by expert index
            lo = i * n_local
            if c.experts == "fused":
                fused = expert_shapes(unit.name, c, c.n_experts)
                mine = {fqn: full[fqn][lo:lo + n_local] for fqn, _ in fused}
            else:
                mine = {f"{unit.name}.{j}.{w}.weight": full[f"{unit.name}.{lo + j}.{w}.weight"]
                        for j in range(n_local) for w in ("w1", "w2", "w3")}
            rank_buffer = composed[i * unit.local.total_numel:(i + 1) * unit.local.total_numel]
            np.testing.assert_array_equal(rank_buffer, pack(unit.local, mine))
        for t in unit.layout.tensors:  # no tensor crosses from one EP rank's shards into another's
            assert t.offset // unit.local.total_numel == (t.end - 1) // unit.local.total_numel
        assert math.isclose(unit.layout.padding_ratio, unit.local.padding_ratio)


def test_composed_tensors_are_named_after_what_they_hold():
    unit = plan_expert_parallel(MOE_CONFIGS["gpt-oss-tiny"], 2, 2)[0]
    assert unit.layout.tensors[4].name == "layers.0.feed_forward.experts.gate_up_proj[4:8]"
    assert unit.sources[4] == ("layers.0.feed_forward.experts.gate_up_proj", 4, 8)
    unit = plan_expert_parallel(MOE_CONFIGS["mixtral-tiny"], 2, 2)[0]
    assert unit.layout.tensors[12].name == unit.sources[12].fqn == "layers.0.feed_forward.experts.4.w1.weight"


@pytest.mark.parametrize("ep,fsdp", [(3, 2), (0, 4), (2, 0)])
def test_an_ep_degree_that_does_not_divide_the_experts_is_refused(ep, fsdp):
    with pytest.raises(PlanningError, match="must divide the 8 experts"):
        plan_expert_parallel(MOE_CONFIGS["mixtral-tiny"], ep, fsdp)
