"""Muon's plan in the core: exact Newton-Schulz FLOPs, NS devices (against brute force), their buckets,
split groups."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ragged
import ragged.models
import ragged.muon


def _counted_flops(shape) -> int:
    """Run numpy Newton-Schulz and count 2*m*k*n for every matmul it does (an independent count)."""
    flops = 0

    def mm(a, b):
        nonlocal flops
        flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return a @ b

    a, b, c = ragged.muon.NS_COEFFS
    x = np.ones(shape)
    x = x.T if x.shape[0] > x.shape[1] else x
    for _ in range(ragged.muon.NS_STEPS):
        gram = mm(x, x.T)
        x = a * x + mm(b * gram + c * mm(gram, gram), x)
    return flops


@pytest.mark.parametrize("shape", [(32, 96), (80, 16), (48, 48), (7, 3)])
def test_newton_schulz_flops_count_every_matmul(shape):
    assert ragged.muon.newton_schulz_flops(shape) == _counted_flops(shape)


def _llama3_8b_layer_matrices():
    shapes = ragged.models.model_shapes("llama3-8b")
    return [s for u in shapes.units if u.name.startswith("layers.") for _, s in u.tensors if len(s) == 2]


@pytest.mark.parametrize("world", [8, 64])
def test_llama3_8b_layers_balance_within_ten_percent(world):
    mats = _llama3_8b_layer_matrices()
    devices = ragged.muon.assign_ns_devices([ragged.muon.newton_schulz_flops(s) for s in mats], world)
    load = ragged.muon.newton_schulz_load(mats, devices, world)
    # the independent count: each device sums the closed form 5 (4 m^2 n + 2 m^3) of its matrices
    want = np.zeros(world, np.int64)
    for s, r in zip(mats, devices):
        m, n = min(s), max(s)
        want[r] += 5 * (4 * m * m * n + 2 * m ** 3)
    np.testing.assert_array_equal(load, want)
    # Bound: the 10% Muon's default max_imbalance (1.1) asks for, which whole-matrix roots meet here.
    assert load.max() / load.mean() <= 1.1
    # deterministic
    assert devices == ragged.muon.assign_ns_devices([ragged.muon.newton_schulz_flops(s) for s in mats], world)


def test_llama3_8b_at_256_devices_is_bounded_by_its_largest_matrix():
    """224 matrices on 256 devices: no whole-matrix assignment beats largest / mean; LPT reaches it."""
    mats = _llama3_8b_layer_matrices()
    costs = [ragged.muon.newton_schulz_flops(s) for s in mats]
    load = ragged.muon.newton_schulz_load(mats, ragged.muon.assign_ns_devices(costs, 256), 256)
    assert load.max() == max(costs)  # the optimum for whole matrices
    assert 2.1 < load.max() / load.mean() < 2.12  # > 1.1: needs Newton-Schulz split over devices


def test_ns_device_buckets_hold_one_matrix_per_ns_device_in_order():
    assert ragged.muon.ns_device_buckets([0, 1, 0, 2, 0, 1]) == ((0, 1, 3), (2, 5), (4,))
    for devices in ([3, 3, 3], [0, 1, 2, 3], []):
        buckets = ragged.muon.ns_device_buckets(devices)
        assert sorted(i for b in buckets for i in b) == list(range(len(devices)))
        assert all(len({devices[i] for i in b}) == len(b) for b in buckets)


def test_bucket_holdings_concatenate_and_give_one_plan():
    a = ragged.ragged_holdings(ragged.RaggedShard((0,), (1, 1)), (2, 3))   # ((0,3),), ((3,6),)
    b = ragged.ragged_holdings(ragged.RaggedShard((0,), (0, 2)), (2, 2))   # (), ((0,4),)
    assert ragged.muon.bucket_holdings([a, b], [6, 4]) == (((0, 3),), ((3, 6), (6, 10)))
    with pytest.raises(ragged.PlanningError, match="NS device 3"):
        ragged.muon.newton_schulz_load([(2, 2)], [3], 2)


# ----- split Newton-Schulz (the core's plan; the runtimes run it: tests/*/test_muon_split*.py) ---------
@pytest.mark.parametrize("shape,group", [((48, 16), 2), ((16, 48), 4), ((32, 32), 8), ((24, 40), 1)])
def test_split_newton_schulz_scheme_equals_one_device_and_counts_flops_and_bytes(shape, group):
    """The scheme in numpy (column blocks, all-reduced Gram, all-gathered row blocks) gives the singular
    value closed form; each member runs 1/group of the counted FLOPs and receives the stated bytes."""
    from tests.numpy_references import newton_schulz_closed_form

    x = np.random.default_rng(group).standard_normal(shape)
    out, flops, received = ragged.muon.split_newton_schulz_reference(x, group)
    np.testing.assert_allclose(out, newton_schulz_closed_form(x), rtol=0, atol=1e-6)  # (eps 1e-7 in the norm)
    np.testing.assert_allclose(out, ragged.muon.split_newton_schulz_reference(x, 1)[0], rtol=0, atol=1e-12)
    assert flops == [_counted_flops(shape) // group] * group
    assert flops[0] == ragged.muon.split_newton_schulz_flops(shape, group)
    assert 4 * received == ragged.muon.split_newton_schulz_bytes(shape, group)
    assert (received == 0) == (group == 1)


def test_split_newton_schulz_rejects_a_group_that_does_not_divide_the_matrix():
    with pytest.raises(ragged.PlanningError, match="group of 3"):
        ragged.muon.split_newton_schulz_flops((48, 16), 3)


@pytest.mark.parametrize("world", [8, 64, 256])
def test_llama3_8b_layers_balance_within_ten_percent_with_split_groups(world):
    mats = _llama3_8b_layer_matrices()
    groups = ragged.muon.assign_groups(mats, world)
    assert groups == ragged.muon.assign_groups(mats, world)  # deterministic
    load = ragged.muon.group_load(mats, groups, world)
    want = np.zeros(world, np.int64)  # independent: closed form / group size, to every member
    for s, devices in zip(mats, groups):
        assert len(set(devices)) == len(devices)
        m, n = min(s), max(s)
        for d in devices:
            want[d] += 5 * (4 * m * m * n + 2 * m ** 3) // len(devices)
    np.testing.assert_array_equal(load, want)
    # Bound: 1.1, assign_groups' default max_imbalance, which it splits matrices to meet.
    assert load.max() / load.mean() <= 1.1
    costs = [ragged.muon.newton_schulz_flops(s) for s in mats]
    if world < 256:  # no split needed: the whole-matrix NS devices
        assert groups == tuple((r,) for r in ragged.muon.assign_ns_devices(costs, world))
    else:  # the lower bound of whole matrices (2.11) is beaten by splitting only the FFN matrices, in 4s
        assert max(costs) / load.mean() > 2.1
        assert {s: len(d) for s, d in zip(mats, groups)} == {(4096, 4096): 1, (1024, 4096): 1,
                                                             (14336, 4096): 4, (4096, 14336): 4}


def test_assign_groups_without_a_target_is_one_ns_device_per_matrix_and_refuses_a_target_below_one():
    shapes = [(64, 32), (32, 32), (128, 64), (16, 48)]
    devices = ragged.muon.assign_ns_devices([ragged.muon.newton_schulz_flops(s) for s in shapes], 3)
    assert ragged.muon.assign_groups(shapes, 3, max_imbalance=None) == tuple((r,) for r in devices)
    with pytest.raises(ragged.PlanningError, match=r"max_imbalance=0.9 is a max / mean ratio"):
        ragged.muon.assign_groups(shapes, 3, max_imbalance=0.9)


def _brute_makespan(costs, world):
    return min(max(sum(c for c, r in zip(costs, devices) if r == d) for d in range(world))
               for devices in itertools.product(range(world), repeat=len(costs)))


@pytest.mark.parametrize("seed", range(12))
def test_assign_ns_devices_is_within_the_largest_cost_of_the_optimum(seed):
    rng = np.random.default_rng(seed)
    world = int(rng.integers(1, 5))
    costs = [int(c) for c in rng.integers(0, 100, size=int(rng.integers(1, 8)))]
    devices = ragged.muon.assign_ns_devices(costs, world)
    assert devices == ragged.muon.assign_ns_devices(list(costs), world)  # deterministic
    assert all(0 <= r < world for r in devices)
    makespan = max(sum(c for c, r in zip(costs, devices) if r == d) for d in range(world))
    # Bound: Graham's list-scheduling bound, greedy makespan <= optimum + the largest job.
    assert makespan <= _brute_makespan(costs, world) + max(costs)


def test_assign_ns_devices_largest_first_to_least_loaded():
    assert ragged.muon.assign_ns_devices([5, 9, 5, 1], 2) == (1, 0, 1, 0)  # 9->0, 5->1, 5->1, 1->0
    costs = [ragged.muon.newton_schulz_flops((64, 32)), ragged.muon.newton_schulz_flops((32, 32))]
    assert ragged.muon.assign_ns_devices(costs, 3) == (0, 1)
    with pytest.raises(ragged.PlanningError, match="world_size"):
        ragged.muon.assign_ns_devices([1], 0)
    with pytest.raises(ragged.PlanningError, match="2-D"):
        ragged.muon.newton_schulz_flops((4, 4, 4))
