"""DCP with RaggedShard DTensors: save at 4 ranks, load at 2, 3 and 4 under other layouts.

The saved file holds one regular box per contiguous piece of each ragged shard; loading into other
units, Shard(0), Replicate, a 2-D layout or a plain tensor must give back the saved tensor exactly (bit for
bit: DCP moves bits). The 4-rank launch saves and then loads (one launch, not two).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.torch_backend._dist import assert_case, launch, run_cases
from tests.torch_backend._ragged_cases import chunk_local, full, ragged_local, units_for
from torch_backend import RaggedShard

# name -> (shape, dims, total units); saved with multinomial units at 4 ranks.
_TENSORS = {
    "rows": ((25, 3), (0,), 25),
    "elements": ((3, 26), (0, 1), 78),
    "vector": ((7,), (0,), 7),
    "blocks": ((5, 3, 6, 7), (0, 1), 5),
}
# name -> (shape, seed, placements on the (2, 2) mesh): tensor/expert parallel boxes and HSDP replicas.
_TENSORS_2D = {
    "tp": ((8, 6), 3, (Shard(0), RaggedShard((0,), (1, 3)))),
    "hsdp": ((8, 6), 4, (Replicate(), RaggedShard((0,), (3, 5)))),
}
_SAVE_WORLD = 4
_TARGETS = ("ragged", "shard0", "replicate", "plain")


def _reference(name: str) -> torch.Tensor:
    if name in _TENSORS_2D:
        shape, seed, _ = _TENSORS_2D[name]
        return full(shape, seed)
    return full(_TENSORS[name][0], seed=len(name))


def _saved_placement(name: str, world: int) -> RaggedShard:
    _, dims, total = _TENSORS[name]
    return RaggedShard(dims, units_for("zeros", total, world, seed=7))


def save_checks(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2))

    def save():
        state = {n: distribute_tensor(_reference(n), mesh, [_saved_placement(n, world)]) for n in _TENSORS}
        for n, (_, _, placements) in _TENSORS_2D.items():
            state[n] = distribute_tensor(_reference(n), mesh2, placements)
        dcp.save(state, checkpoint_id=path)

    return run_cases({"save": save})


def _target(kind: str, name: str, shape, mesh, world: int, rank: int):
    """(empty tensor to load into, expected local after loading)."""
    ref = _reference(name)
    zeros = torch.zeros(shape)
    if kind == "ragged":
        dims, total = ((0,), 8) if name in _TENSORS_2D else _TENSORS[name][1:]
        p = RaggedShard(dims, units_for("multinomial", total, world, seed=11))
        return distribute_tensor(zeros, mesh, [p]), ragged_local(ref, p.local_units, rank)
    if kind == "shard0":
        return distribute_tensor(zeros, mesh, [Shard(0)]), chunk_local(ref, 0, world, rank)
    if kind == "replicate":
        return distribute_tensor(zeros, mesh, [Replicate()]), ref
    return zeros, ref


def load_checks(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    shapes = {n: s for n, (s, _, _) in (_TENSORS | _TENSORS_2D).items()}

    def load(kind: str):
        targets = {n: _target(kind, n, shapes[n], mesh, world, rank) for n in shapes}
        dcp.load({n: t for n, (t, _) in targets.items()}, checkpoint_id=path)
        for n, (t, want) in targets.items():
            got = t.to_local() if hasattr(t, "to_local") else t
            assert torch.equal(got, want), f"{kind} {n}: max err {(got - want).abs().max()}"

    cases = {f"load:{kind}": functools.partial(load, kind) for kind in _TARGETS}
    if world == 4:

        def load_2d():
            mesh2 = init_device_mesh("cpu", (2, 2))
            coord = (rank // 2, rank % 2)
            placements = (RaggedShard((0,), (2, 2)), Shard(1))  # boxes of 3 columns cut into 4-row halves
            t = distribute_tensor(torch.zeros(8, 6), mesh2, placements)
            dcp.load({"tp": t}, checkpoint_id=path)
            box = chunk_local(_reference("tp"), 1, 2, coord[1]).contiguous()
            assert torch.equal(t.to_local(), ragged_local(box, (2, 2), coord[0]))

        cases["load:2d"] = load_2d
    return run_cases(cases)


def save_and_load_checks(rank: int, world: int, path: str) -> dict:
    """At the saving world size: save, then (every rank past the save) load as any other world size."""
    import torch.distributed as dist

    out = save_checks(rank, world, path)
    dist.barrier()
    return out | load_checks(rank, world, path)


_SAVE_LAUNCH: dict[str, list] = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ragged_dcp"))
    _SAVE_LAUNCH[path] = launch(__file__, "save_and_load_checks", _SAVE_WORLD, path)
    assert_case(_SAVE_LAUNCH[path], "save")
    return path


@functools.cache
def _loaded(world: int, path: str):
    if world == _SAVE_WORLD:
        return _SAVE_LAUNCH[path]
    return launch(__file__, "load_checks", world, path)


def test_save_at_four_ranks(saved: str) -> None:
    assert saved


@pytest.mark.parametrize("world", (2, 3, 4))
@pytest.mark.parametrize("kind", _TARGETS)
def test_load(saved: str, world: int, kind: str) -> None:
    assert_case(_loaded(world, saved), f"load:{kind}")


def test_load_into_2d_layout(saved: str) -> None:
    assert_case(_loaded(4, saved), "load:2d")


@pytest.mark.parametrize("name", list(_TENSORS) + list(_TENSORS_2D))
def test_saved_chunks_tile_each_tensor_once(saved: str, name: str) -> None:
    """Every element is covered by exactly one saved box (what the split into regular boxes must give)."""
    meta = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata[name]
    cover = torch.zeros(tuple(meta.size), dtype=torch.int64)
    for chunk in meta.chunks:
        cover[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] += 1
    assert torch.equal(cover, torch.ones_like(cover))
    assert len(meta.chunks) > 1
