"""Overlapped JAX Muon (gathers of ``in_flight`` root buckets issued before their Newton-Schulz) gives the
same bits as the sequential schedule (one matrix after another), both inside one jitted shard_map step."""

from __future__ import annotations

import numpy as np
import pytest
from test_optim_jax import MUON_SPECS, _fulls, _muon, _run_sharded

from jax_backend.optim import muon_plan

SPECS = MUON_SPECS + (("wide2", (16, 72), "rows:1"), ("tall2", (56, 24), "rows:2"),
                      ("sq2", (40, 40), "rows:1"))


@pytest.mark.parametrize("world,in_flight", [(3, 1), (4, 2)])
def test_overlapped_muon_equals_sequential_muon_bit_for_bit(world, in_flight):
    params, grads = _fulls(SPECS, seed=world, steps=2)
    seq, _ = _run_sharded(lambda lays: _muon(muon_plan(lays, "fsdp", in_flight=None)), SPECS, params, grads,
                          world)
    ovl, _ = _run_sharded(lambda lays: _muon(muon_plan(lays, "fsdp", in_flight=in_flight)), SPECS, params,
                          grads, world)
    plan = muon_plan([], "fsdp", in_flight=in_flight)
    assert plan.windows() == ()
    for n in params:
        np.testing.assert_array_equal(np.asarray(ovl[n]), np.asarray(seq[n]), err_msg=n)
        assert not np.array_equal(np.asarray(ovl[n]), np.asarray(params[n])), f"{n} did not move"


def test_muon_plan_rejects_in_flight_below_one():
    with pytest.raises(ValueError, match="in_flight"):
        muon_plan([], "fsdp", in_flight=0)
