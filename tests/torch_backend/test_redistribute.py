"""RaggedShard as a DTensor placement: distribute/from_local/to_local/full_tensor and every redistribution.

Runs on real gloo process groups of 1, 2, 3 and 4 workers (one launch per world size for this module)
and compares every local tensor bit for bit with an independent reference cut from the full tensor.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import ragged
from tests.torch_backend._dist import Launcher, assert_case, run_cases
from tests.torch_backend._ragged_cases import cases, chunk_local, full, moved_elements, ragged_local
from torch_backend import RaggedShard

WORLDS = (1, 2, 3, 4)


def _expect_error(fn, *needles: str) -> None:
    try:
        fn()
    except (ragged.RaggedError, RuntimeError) as e:
        missing = [n for n in needles if n not in str(e)]
        assert not missing, f"error {e!r} does not mention {missing}"
    else:
        raise AssertionError("no error raised")
    dist.barrier()  # every rank raised before any collective: they are all still in step


def _op_names(comm: CommDebugMode) -> list[str]:
    return sorted(str(op) for op, n in comm.get_comm_counts().items() for _ in range(n))


def _count_all_to_all(fn):
    """Run ``fn`` and count the elements this rank sends to other ranks through ``all_to_all_single``."""
    sent = []
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        sent.append(sum(input_split_sizes))
        return original(output, input, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = counting
    try:
        return fn(), sum(sent)
    finally:
        dist.all_to_all_single = original


def _layout_cases(rank: int, world: int, mesh) -> dict:
    out = {}
    for c in cases(world):
        t = full(c.shape, seed=len(c.name))
        p = RaggedShard(c.dims, c.units)
        ref = ragged_local(t, c.units, rank)

        def distribute(t=t, p=p, ref=ref, c=c):
            dt = distribute_tensor(t, mesh, [p])
            assert dt.shape == t.shape and dt.placements == (p,)
            assert torch.equal(dt.to_local(), ref)
            assert torch.equal(dt.full_tensor(), t)
            given = DTensor.from_local(ref.clone(), mesh, [p], shape=t.shape, stride=t.stride())
            assert torch.equal(given.full_tensor(), t)
            if len(c.dims) > 1:
                _expect_error(lambda: DTensor.from_local(ref.clone(), mesh, [p]), "cannot be inferred")
                return
            inferred = DTensor.from_local(ref.clone(), mesh, [p])
            assert inferred.shape == (t.numel(),)
            assert torch.equal(inferred.full_tensor(), t.reshape(-1))

        def replicate(t=t, p=p, ref=ref):
            dt = distribute_tensor(t, mesh, [p])
            assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), t)
            rep = distribute_tensor(t, mesh, [Replicate()])
            with CommDebugMode() as comm:
                back = rep.redistribute(mesh, [p])
            assert comm.get_total_counts() == 0, "Replicate -> RaggedShard is a local slice"
            assert torch.equal(back.to_local(), ref)

        def shard(t=t, p=p, ref=ref):
            dt = distribute_tensor(t, mesh, [p])
            for d in range(t.ndim):
                s = dt.redistribute(mesh, [Shard(d)])
                assert torch.equal(s.to_local(), chunk_local(t, d, world, rank)), d
                assert torch.equal(s.redistribute(mesh, [p]).to_local(), ref), d

        def partial(t=t, p=p, ref=ref):
            pieces = [t * (r + 1) - r for r in range(world)]  # sums exactly to the reference below
            part = DTensor.from_local(pieces[rank], mesh, [Partial()], shape=t.shape, stride=t.stride())
            total = sum(pieces[1:], pieces[0])
            with CommDebugMode() as comm:
                scattered = part.redistribute(mesh, [p])
            assert _op_names(comm) == ["c10d._reduce_scatter_base_"], comm.get_comm_counts()
            assert torch.equal(scattered.to_local(), ragged_local(total, p.local_units, rank))

        def other_units(t=t, p=p, c=c):
            for other in (tuple(reversed(c.units)), c.units[1:] + c.units[:1]):
                q = RaggedShard(c.dims, other)
                start = distribute_tensor(t, mesh, [p])
                moved, sent = _count_all_to_all(lambda start=start, q=q: start.redistribute(mesh, [q]))
                assert torch.equal(moved.to_local(), ragged_local(t, other, rank))
                total = torch.tensor([sent])
                dist.all_reduce(total)
                assert int(total) == moved_elements(t.numel(), c.units, other), (int(total), other)

        def whole(t=t, p=p, ref=ref):
            for device in {0, world - 1}:
                one = RaggedShard.whole_on(device, world)
                on_one = distribute_tensor(t, mesh, [p]).redistribute(mesh, [one])
                assert torch.equal(on_one.to_local(), t.reshape(-1) if rank == device else t.reshape(-1)[:0])
                assert torch.equal(on_one.redistribute(mesh, [p]).to_local(), ref)

        for fn in (distribute, replicate, shard, partial, other_units, whole):
            out[f"{c.name}:{fn.__name__}"] = fn
    return out


def _autograd_cases(rank: int, world: int, mesh) -> dict:
    t = full((25, 3), seed=1)
    w = full((25, 3), seed=2)
    units = tuple([0] + [25 // max(world - 1, 1)] * (world - 1)) if world > 1 else (25,)
    units = units[:-1] + (units[-1] + 25 - sum(units),)
    p = RaggedShard((0,), units)

    def ragged_to_replicate_backward_is_local():
        x = distribute_tensor(t, mesh, [p]).requires_grad_()
        loss = (x.redistribute(mesh, [Replicate()]).to_local() * w).sum()
        with CommDebugMode() as comm:
            loss.backward()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert x.grad.placements == (p,)
        assert torch.equal(x.grad.to_local(), ragged_local(w, units, rank))

    def replicate_to_ragged_backward_gathers():
        x = distribute_tensor(t, mesh, [Replicate()]).requires_grad_()
        loss = (x.redistribute(mesh, [p]).to_local() * ragged_local(w, units, rank)).sum()
        with CommDebugMode() as comm:
            loss.backward()
        assert comm.get_total_counts() == 1, comm.get_comm_counts()
        assert x.grad.placements == (Replicate(),)
        assert torch.equal(x.grad.to_local(), w)

    def to_local_backward_keeps_ragged():
        x = distribute_tensor(t, mesh, [p]).requires_grad_()
        (x.to_local() * ragged_local(w, units, rank)).sum().backward()
        assert x.grad.placements == (p,) and x.grad.shape == t.shape and x.grad.stride() == t.stride()
        assert torch.equal(x.grad.full_tensor(), w)

    return {
        f.__name__: f
        for f in (
            ragged_to_replicate_backward_is_local,
            replicate_to_ragged_backward_gathers,
            to_local_backward_keeps_ragged,
        )
    }


def _error_cases(rank: int, world: int, mesh) -> dict:
    t = full((25, 3))

    def units_of_wrong_length():
        p = RaggedShard((0,), (5,) * (world + 1))
        _expect_error(lambda: distribute_tensor(t, mesh, [p]), "entries", f"{world} devices")

    def units_that_do_not_divide():
        p = RaggedShard((0,), (2,) * world)  # 2 * world units never divide 25 rows
        _expect_error(lambda: distribute_tensor(t, mesh, [p]), "divisible")

    def redistribute_to_units_that_do_not_divide():
        dt = distribute_tensor(t, mesh, [Replicate()])
        _expect_error(lambda: dt.redistribute(mesh, [RaggedShard((0,), (2,) * world)]), "divisible")

    def local_of_the_wrong_size():
        p = RaggedShard((0,), (25,) + (0,) * (world - 1))
        local = torch.zeros(ragged_local(t, p.local_units, rank).numel() + 1)
        build = functools.partial(DTensor.from_local, local, mesh, [p], shape=t.shape, stride=t.stride())
        _expect_error(build, "from_local")
        # run_check=False skips that collective (the runtime's hot path); redistribute still checks.
        dt = DTensor.from_local(local, mesh, [p], run_check=False, shape=t.shape, stride=t.stride())
        _expect_error(dt.full_tensor, "elements but")

    def non_prefix_dims():
        _expect_error(lambda: RaggedShard((1,), (1,) * world), "prefix")

    return {
        f.__name__: f
        for f in (
            units_of_wrong_length,
            units_that_do_not_divide,
            redistribute_to_units_that_do_not_divide,
            local_of_the_wrong_size,
            non_prefix_dims,
        )
    }


# (name, shape, placements over a (2, 2) mesh); RaggedShard boxes come from the other mesh dim.
_MESH_2D = (
    ("hsdp", (8, 6), (Replicate(), RaggedShard((0,), (3, 5)))),
    ("shard0_ragged", (8, 6), (Shard(0), RaggedShard((0,), (1, 3)))),
    ("ragged_shard0", (8, 6), (RaggedShard((0,), (3, 1)), Shard(0))),
    ("shard1_ragged", (8, 6), (Shard(1), RaggedShard((0, 1), (10, 14)))),
    ("ragged_shard1", (8, 6), (RaggedShard((0,), (0, 8)), Shard(1))),
    ("uneven_shard0_onehot", (5, 4), (Shard(0), RaggedShard((0,), (1, 0)))),
)


def _reference_2d(t: torch.Tensor, placements, coord) -> torch.Tensor:
    box = t
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            box = chunk_local(box, p.dim, 2, coord[m])
    for m, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            return ragged_local(box.contiguous(), p.local_units, coord[m])
    return box


def _mesh_2d_cases(rank: int, world: int, mesh2) -> dict:
    """``mesh2()`` gives the (2, 2) mesh (built on first use: case names are listed without one)."""
    if world != 4:
        return {}
    coord = (rank // 2, rank % 2)
    out = {}
    for i, (name, shape, placements) in enumerate(_MESH_2D):
        t = full(shape, seed=i)
        nxt = _MESH_2D[(i + 1) % len(_MESH_2D)]

        def layout(t=t, placements=placements, nxt=nxt):
            dt = distribute_tensor(t, mesh2(), placements)
            assert torch.equal(dt.to_local(), _reference_2d(t, placements, coord))
            assert torch.equal(dt.full_tensor(), t)
            replicated = dt.redistribute(mesh2(), [Replicate(), Replicate()])
            assert torch.equal(replicated.to_local(), t)
            assert torch.equal(replicated.redistribute(mesh2(), placements).to_local(), dt.to_local())
            given = DTensor.from_local(
                dt.to_local().clone(), mesh2(), placements, shape=t.shape, stride=t.stride()
            )
            assert torch.equal(given.full_tensor(), t)
            if nxt[1] == t.shape:
                moved = dt.redistribute(mesh2(), nxt[2])
                assert torch.equal(moved.to_local(), _reference_2d(t, nxt[2], coord))

        def single_dims(t=t, placements=placements):
            # Change only the RaggedShard's mesh dim: to Replicate and to Shard(0), and back.
            m = next(j for j, p in enumerate(placements) if isinstance(p, RaggedShard))
            dt = distribute_tensor(t, mesh2(), placements)
            for target in (Replicate(), Shard(0), Shard(1)):
                pl = tuple(target if j == m else p for j, p in enumerate(placements))
                moved = dt.redistribute(mesh2(), pl)
                assert torch.equal(moved.full_tensor(), t), pl
                assert torch.equal(moved.redistribute(mesh2(), placements).to_local(), dt.to_local()), pl

        out[f"2d:{name}:layout"] = layout
        out[f"2d:{name}:single_dims"] = single_dims

    def hsdp_reduce_scatter():
        # HSDP gradients: the Partial mesh dim of (Replicate, Partial) turns ragged in one reduce-scatter.
        t = full((8, 6), 5)
        pieces = [t * (r + 1) for r in range(2)]
        part = DTensor.from_local(
            pieces[coord[1]], mesh2(), (Replicate(), Partial()), shape=t.shape, stride=t.stride()
        )
        p = RaggedShard((0,), (3, 5))
        with CommDebugMode() as comm:
            scattered = part.redistribute(mesh2(), (Replicate(), p))
        assert _op_names(comm) == ["c10d._reduce_scatter_base_"], comm.get_comm_counts()
        assert torch.equal(scattered.to_local(), ragged_local(pieces[0] + pieces[1], p.local_units, coord[1]))

    out["2d:hsdp_reduce_scatter"] = hsdp_reduce_scatter

    def ragged_on_two_mesh_dims():
        p = RaggedShard((0,), (4, 4))
        _expect_error(lambda: distribute_tensor(full((8, 6)), mesh2(), [p, p]), "one mesh dim")

    def units_that_cut_one_box():
        # Shard(0) of 5 rows leaves boxes of 3 and 2 rows: 2 units fit the second, not the first.
        bad = (Shard(0), RaggedShard((0,), (1, 1)))
        _expect_error(lambda: distribute_tensor(full((5, 4)), mesh2(), bad), "box (3, 4)")

    out["2d:ragged_on_two_mesh_dims"] = ragged_on_two_mesh_dims
    out["2d:units_that_cut_one_box"] = units_that_cut_one_box
    return out


def _all_cases(rank: int, world: int, mesh, mesh2) -> dict:
    return {
        **_error_cases(rank, world, mesh),
        **_layout_cases(rank, world, mesh),
        **_autograd_cases(rank, world, mesh),
        **_mesh_2d_cases(rank, world, mesh2),
    }


def checks(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    return run_cases(_all_cases(rank, world, mesh, functools.cache(lambda: init_device_mesh("cpu", (2, 2)))))


_run = Launcher(__file__)
# Case names are listed at collection time, without a process group (no mesh is touched).
_PAIRS = [(w, name) for w in WORLDS for name in _all_cases(0, w, None, None)]


@pytest.mark.parametrize(("world", "case"), _PAIRS, ids=[f"w{w}-{n}" for w, n in _PAIRS])
def test_redistribute(world: int, case: str) -> None:
    assert_case(_run(world), case)
