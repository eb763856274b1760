"""Rules that decide devices and communicators on a GPU, checked on CPU with torch's answers stubbed.

Which device the default mesh is on (the process group's backend against the machine's accelerator),
that the post-forward groups of ``reshard_after_forward=<int>`` are built once per mesh (each
``DeviceMesh`` makes new NCCL communicators), and where a loaded optimizer's scalar state goes
(torch's own ``Optimizer.load_state_dict`` is the reference).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_backend.fsdp import _dcp_checkpoint, _fully_shard

CUDA = torch.device("cuda")


@pytest.mark.parametrize("backend,accelerator,want", [
    ("nccl", CUDA, "cuda"),
    ("cpu:gloo,cuda:nccl", CUDA, "cuda"),  # init_process_group(backend="cpu:gloo,cuda:nccl")
    ("undefined", CUDA, "cuda"),  # init_process_group() with no backend
    ("gloo", CUDA, "cpu"),  # a gloo group on a GPU machine keeps CPU tensors
    ("undefined", None, "cpu"),
    ("cpu:gloo,cuda:nccl", None, "cpu"),
])
def test_the_default_mesh_is_on_the_device_its_backend_serves(monkeypatch, backend, accelerator, want):
    made = []
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available: accelerator)
    monkeypatch.setattr(_fully_shard.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(_fully_shard.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(_fully_shard.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(_fully_shard, "init_device_mesh", lambda device, shape: made.append((device, shape)))
    _fully_shard._default_mesh()
    assert made == [(want, (4,))]


class _Mesh:
    """What ``_post_forward_group`` reads of a mesh: 8 ranks on one dim."""

    device_type = "cuda"
    mesh = torch.arange(8)


def test_post_forward_groups_are_built_once_per_mesh_and_size(monkeypatch):
    built = []

    class CountingMesh:
        def __init__(self, device_type, ranks):
            built.append(ranks.shape)
            self.group = object()

        def get_group(self, dim):
            return self.group

        def get_local_rank(self, dim):
            return 1

    monkeypatch.setattr(_fully_shard, "DeviceMesh", CountingMesh)
    mesh = _Mesh()
    first = [_fully_shard._post_forward_group(mesh, 2) for _ in range(3)]  # three units, one mesh
    assert built == [(4, 2)]
    assert all(g is first[0][0] and i == 1 for g, i in first)
    _fully_shard._post_forward_group(mesh, 4)
    _fully_shard._post_forward_group(_Mesh(), 2)  # another mesh: its own groups
    assert built == [(4, 2), (2, 4), (4, 2)]


@pytest.mark.parametrize("options", [{}, {"fused": True}, {"capturable": True}])
def test_loaded_scalar_state_goes_where_torch_puts_it(options):
    """A parameter on another device than the CPU (``meta`` stands in for ``cuda``): torch's
    ``load_state_dict`` moves ``step`` there for fused and capturable AdamW and leaves it on the CPU
    otherwise; ``load_dcp_checkpoint`` makes its destination the same way."""
    p = nn.Parameter(torch.empty(3, device="meta"))
    opt = torch.optim.AdamW([p], **options)
    opt.load_state_dict({"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3),
                                       "exp_avg_sq": torch.zeros(3)}},
                         "param_groups": opt.state_dict()["param_groups"]})
    want = opt.state[p]["step"]
    got = _dcp_checkpoint._like(p, (), None, _dcp_checkpoint._scalar_device(opt, p))
    assert (got.device, got.dtype, got.shape) == (want.device, want.dtype, want.shape)
