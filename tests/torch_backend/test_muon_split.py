"""Split Newton-Schulz on torch: one matrix orthogonalized by a group of devices
(``ragged.muon.assign_groups``).

The case is one llama3-8b decoder layer's seven matrices scaled by 1/128 on 8 devices: the same ratios of
matrices to devices and of costs as the whole model (224 matrices) on 256 devices, so the same plan: one NS
device per whole matrix reaches only max/mean 2.11, and ``assign_groups`` splits the three FFN matrices (two
tall, one wide) over groups of 4 that overlap, reaching 1.057. References: single-process Muon and the core's
numpy scheme (``ragged.muon.split_newton_schulz_reference``, float64). The split adds the Gram matrix's inner
products in ``g`` partial sums, another rounding order: in float64 (parameters, gradients and Muon, which
computes in at least its parameters' dtype) that stays far under ``tests.parity.float64_rtol`` of the steps,
where a row block sent to the wrong member or a partial sum left out moves the result by 1e-2 or more. bf16
Newton-Schulz has no float64: the split is bounded by one device's bf16 Newton-Schulz computed in other
summation orders (the matrix's rows and columns permuted, ``tests.parity.assert_within_spread``), and
against the float64 scheme by bf16's stated 5% (docs/optimizers.md). Measured: float64 split Newton-Schulz
2.5e-15 at most, split Muon 4.7e-17 (against 1.1e-9); bf16 3.7% to 4.3% from one device, its orders 3.7% to
4.5% (each member's matmul rounds its part of the Gram matrix to bf16 before the sum).
Threads (threaded process group) for the numbers; gloo processes to count FLOPs and collectives per rank.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

import ragged
import ragged.muon
from tests.parity import SPREAD_ORDERS, assert_within_spread, float64_rtol
from tests.torch_backend._dist import Launcher, assert_case, run_cases
from tests.torch_backend.test_optim import (
    MUON_SPECS,
    _fulls,
    _muon,
    _train,
    assert_float64_close,
    run_threads,
)
from torch_backend import RaggedShard
from torch_backend.optim import Muon, newton_schulz

LAYER_SPECS = (("wq", (32, 32), "rows:1"), ("wk", (8, 32), "rows:1"), ("wv", (8, 32), "rows:1"),
               ("wo", (32, 32), "rows:1"), ("w_gate", (112, 32), "rows:1"), ("w_up", (112, 32), "rows:1"),
               ("w_down", (32, 112), "rows:1"), ("norm", (32,), "element"))
WORLD = 8
SPLIT = {"w_gate": 4, "w_up": 4, "w_down": 4}  # the plan of the whole model at 256 devices, in 4s
NS_RTOL = float64_rtol(ragged.muon.NS_STEPS)  # one float64 Newton-Schulz: as many steps as it iterates


def _split_muon(named):
    """``_muon`` with splitting on (the llama3-8b target of ``assign_groups``)."""
    return Muon(named, lr=0.02, weight_decay=0.01, adamw_lr=1e-2, max_imbalance=1.1)


def _rel(got: torch.Tensor, want) -> float:
    want = torch.as_tensor(want, dtype=torch.float64)
    return float((got.double() - want).norm() / want.norm())


def _blocked_newton_schulz(x: torch.Tensor, g: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """One device's Newton-Schulz of ``x`` in ``dtype``, its Gram matrices summed as a split's are: over ``g``
    blocks of the wide orientation's columns, each block's product rounded to ``dtype`` (as each member's
    matmul rounds its part), summed in fp32 and rounded once more; the columns permuted by ``seed`` (another
    summation order of the same matrix: ``NS(X Q) = NS(X) Q``) and permuted back."""
    a, b, c = ragged.muon.NS_COEFFS
    tall = x.shape[0] > x.shape[1]
    w = x.T if tall else x
    cols = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed))
    w = w[:, cols].to(dtype)
    w = w / (w.float().square().sum().sqrt().to(dtype) + 1e-7)
    for _ in range(ragged.muon.NS_STEPS):
        gram = sum((blk @ blk.T).float() for blk in w.chunk(g, dim=1)).to(dtype)
        w = a * w + (b * gram + c * gram @ gram) @ w
    w = w[:, torch.argsort(cols)].float()
    return w.T if tall else w


def _placed(world: int, specs):
    """``place(name, tensor)``: RaggedShard DTensors of the planner's layout on a 1-D mesh of ``world``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    layout = ragged.plan([ragged.TensorSpec(n, s, g) for n, s, g in specs], world)
    return lambda n, t: distribute_tensor(t, mesh, [RaggedShard.from_core(layout.placement(n))])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bf16"])
@pytest.mark.parametrize("shape,g", [((48, 16), 2), ((16, 48), 4), ((24, 24), 3)],
                         ids=["tall", "wide", "square"])
def test_split_newton_schulz_equals_the_numpy_scheme_and_one_device(shape, g, dtype):
    """Members 1..g of g + 1 ranks (rank 0 is outside the group) each hold a row block; the row blocks of
    the result equal the numpy scheme and one device's ``newton_schulz``: float64 within float64's
    rounding of its steps; bf16 within the spread of one device's bf16 over summation orders, and the
    stated 5% of the float64 scheme."""
    import torch.distributed as dist

    from torch_backend.optim._muon_split import new_subgroups, split_newton_schulz

    x = torch.randn(shape, generator=torch.Generator().manual_seed(g))
    x = x.double() if dtype == torch.float64 else x  # bf16 computes from the fp32 matrix, as Muon's momentum
    devices = tuple(range(1, g + 1))

    def fn(rank: int, world: int):
        groups = new_subgroups([devices], dist.group.WORLD)
        if rank not in devices:
            assert groups == {}
            return None
        rows = x.view(g, -1)[rank - 1].clone()  # row block rank - 1 of g
        return split_newton_schulz(rows, shape, groups[devices], dtype=dtype)

    got = torch.cat(run_threads(g + 1, fn)[1:]).view(shape)
    ref, _, _ = ragged.muon.split_newton_schulz_reference(x.double().numpy(), g)
    if dtype == torch.float64:
        assert got.dtype == torch.float64
        assert _rel(got, ref) <= NS_RTOL and _rel(got, newton_schulz(x)) <= NS_RTOL
        return
    one = newton_schulz(x, dtype=dtype)
    orders = [{"ns": _rel(_blocked_newton_schulz(x, g, dtype, seed), one)} for seed in range(SPREAD_ORDERS)]
    assert_within_spread({"ns": _rel(got, one)}, orders)
    assert _rel(got, ref) < 0.05


def test_split_newton_schulz_refuses_bad_blocks_before_communicating():
    """A group that does not divide the matrix, or a block that is not one row block: an error naming the
    rule on every member (run_threads fails on a hang), not a wrong answer."""
    import torch.distributed as dist

    from torch_backend.optim._muon_split import split_newton_schulz

    def fn(rank: int, world: int) -> list[str]:
        errors = []
        for rows, shape in ((torch.ones(24 * 15), (48, 15)), (torch.ones(10), (48, 16))):
            with pytest.raises((ragged.PlanningError, ValueError)) as e:
                split_newton_schulz(rows, shape, dist.group.WORLD)
            errors.append(str(e.value))
        return errors

    for errors in run_threads(2, fn):
        assert "group of 2 must divide both sides of (48, 15)" in errors[0]
        assert "holds 10 elements of the (48, 16) matrix; its row block has 24 x 16" in errors[1]


def _layer_run(make_opt, steps: int):
    """``steps`` Muon steps on the float64 layer, sharded over ``WORLD`` threads: the parameters and the
    ranks' ``(full parameters, ns_devices per matrix)``."""
    params, grads = _fulls(LAYER_SPECS, seed=7, steps=steps, dtype=torch.float64)

    def fn(rank: int, world: int):
        place = _placed(world, LAYER_SPECS)
        live = {n: torch.nn.Parameter(place(n, t.clone())) for n, t in params.items()}
        opt = make_opt(list(live.items()))
        for step in grads:
            for n, p in live.items():
                p.grad = place(n, step[n])
            opt.step()
        return ({n: p.full_tensor().detach() for n, p in live.items()},
                {n: opt.ns_devices(p) for n, p in live.items() if p.ndim == 2})

    return params, grads, run_threads(WORLD, fn)


def test_split_muon_equals_single_process_muon_on_a_llama_layer():
    params, grads, results = _layer_run(_split_muon, steps=3)
    want = _train(_muon, params, grads)
    for rank, (got, devices) in enumerate(results):
        assert {n: len(d) for n, d in devices.items() if len(d) > 1} == SPLIT  # the split does happen
        assert_float64_close(got, want, steps=3, msg=f"rank {rank}")
        for n in params:
            assert not torch.equal(got[n], params[n]), f"{n} did not move"


def test_split_muon_first_update_is_the_numpy_split_scheme():
    """One step from zero weights with plain momentum: ``-lr * scale * NS((1 - mu) grad)``, NS by the numpy
    scheme over the group sizes the runtime used."""
    mu = 0.95

    def make(named):
        return Muon(named, lr=1.0, momentum=mu, nesterov=False, adamw_lr=1e-2, max_imbalance=1.1)

    params, grads, results = _layer_run(make, steps=1)
    got, devices = results[0]
    for n, shape, _ in LAYER_SPECS:
        if len(shape) == 2:
            ref, _, _ = ragged.muon.split_newton_schulz_reference((1 - mu) * grads[0][n].double().numpy(),
                                                             len(devices[n]))
            update = (params[n] - got[n]) / ragged.muon.muon_scale(shape)
            assert _rel(update, ref) <= NS_RTOL, n


def test_split_muon_under_hsdp_equals_single_process_muon():
    """A (4, 2) mesh, RaggedShard on dim 0 (Replicate on dim 1): each replica's shard dim is the global
    ranks (0, 2, 4, 6) or (1, 3, 5, 7), so every split group exists once per replica, from global ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    params, grads = _fulls(MUON_SPECS, seed=5, steps=2, dtype=torch.float64)
    want = _train(_muon, params, grads)

    def fn(rank: int, world: int):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("shard", "replicate"))
        layout = ragged.plan([ragged.TensorSpec(n, s, g) for n, s, g in MUON_SPECS], 4)
        return _train(_split_muon, params, grads,
                      lambda n, t: distribute_tensor(t, mesh, [RaggedShard.from_core(layout.placement(n)),
                                                               Replicate()]))

    matrices = [s for _, s, _ in MUON_SPECS if len(s) == 2]
    assert [len(d) for d in ragged.muon.assign_groups(matrices, 4)] == [4, 2, 4]  # wide, tall, square split
    for rank, got in enumerate(run_threads(8, fn)):
        assert_float64_close(got, want, steps=2, msg=f"rank {rank}")


def test_muon_rejects_max_imbalance_below_one():
    with pytest.raises(ValueError, match="max_imbalance"):
        Muon([torch.nn.Parameter(torch.ones(2, 2))], max_imbalance=0.9)


def checks(rank: int, world: int) -> dict:
    """gloo worker: what one Muon step runs on this rank, counted by torch and by the runtime's counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch_backend._debug import debug_counter

    def split_counts() -> None:
        params, grads = _fulls(LAYER_SPECS, seed=3, steps=1)
        place = _placed(world, LAYER_SPECS)
        live = {n: torch.nn.Parameter(place(n, t)) for n, t in params.items()}
        for n, p in live.items():
            p.grad = place(n, grads[0][n])
        opt = _split_muon(list(live.items()))
        matrices = {n: p for n, p in live.items() if p.ndim == 2}
        shapes = [tuple(p.shape) for p in matrices.values()]
        groups = ragged.muon.assign_groups(shapes, world)
        load = opt.newton_schulz_load()
        np.testing.assert_array_equal(load, ragged.muon.group_load(shapes, groups, world))
        assert load.max() / load.mean() < 1.06  # 1.057, against 2.11 for one NS device per matrix:
        flops = [ragged.muon.newton_schulz_flops(s) for s in shapes]
        ns_devices = ragged.muon.assign_ns_devices(flops, world)
        whole = ragged.muon.newton_schulz_load(shapes, ns_devices, world)
        assert whole.max() / whole.mean() > 2.1
        np.testing.assert_array_equal(_muon(list(live.items())).newton_schulz_load(), whole)  # the default
        with FlopCounterMode(display=False) as flops, debug_counter() as counter:
            opt.step()
        assert flops.get_total_flops() == load[rank]  # the matmuls this rank ran are its share of the plan
        want = Counter()
        for n, p in matrices.items():
            devices = opt.ns_devices(p)
            assert tuple(devices) == groups[list(matrices).index(n)]
            if len(devices) > 1 and rank in devices:
                unit = f"muon split {tuple(p.shape)}"
                want[("all_reduce", unit)] += 1 + ragged.muon.NS_STEPS
                want[("all_gather", unit)] += ragged.muon.NS_STEPS
                want[("all_to_all", unit)] += 2 * (p.shape[0] <= p.shape[1])  # row <-> column blocks
        got = Counter({key: c for key, c in counter.calls.items() if key[1].startswith("muon split")})
        assert got == want, (got, want)
        whole_on = [opt.ns_device(p) for p in matrices.values() if len(opt.ns_devices(p)) == 1]
        buckets = ragged.muon.ns_device_buckets(whole_on)
        assert counter.calls[("all_to_all", "muon gather")] == len(buckets) + 1
        with pytest.raises(ValueError, match="split over devices"):
            opt.ns_device(matrices["w_down"])

    return run_cases({"split_counts": split_counts})


_launch = Launcher(__file__)


def test_split_muon_runs_each_members_share_of_the_plan_over_its_group():
    """Per rank: torch's FLOP counter over a step equals ``newton_schulz_load()[rank]`` (``group_load`` of
    ``assign_groups``), and the group collectives are those of the groups the rank is in, none elsewhere."""
    assert_case(_launch(WORLD), "split_counts")
