"""DCP checkpoints of a sharded model (and its optimizer): torch.distributed.checkpoint's own format.

Every rank saves its local pieces as they are: the sharded parameters and the optimizer state are
RaggedShard DTensors whose chunk metadata (``_dcp``) tells DCP which regular boxes of each global tensor
they hold, so a checkpoint written at one world size (or granularity) loads at another, in place into
the new local pieces. Keys are ``model.<fqn>`` and ``optim.<fqn>.<state>``.

Names are the ones one process gives each tensor. A parameter that another parallel dim placed (expert
parallelism keeps ``E / ep`` experts per rank, as ``experts.0..`` or a slice of a fused tensor) carries a
``CheckpointAs`` (attribute ``checkpoint_as``) that gives its one-process name and, for a slice, the whole
tensor as a DTensor whose outer placement (``Shard(0)`` over ``ep``) wraps the parameter's own; so a
checkpoint saved at ``(ep, fsdp) = (2, 2)`` loads at ``(1, 4)``, at plain FSDP and at any world size.

A checkpoint is written to ``<path>.partial`` and renamed to ``<path>`` only once every rank has written
its part, so a run that dies while saving leaves the previous complete checkpoint as the latest.
Failures raise the core's ``ragged.checkpoint.CheckpointError`` (the one checkpoint error of every format).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ragged.checkpoint import CheckpointError
from torch_backend.fsdp._fully_shard import units
from torch_backend.placement import make_dtensor


@dataclass(frozen=True)
class CheckpointAs:
    """How a parameter placed along a mesh dim FSDP does not shard is named and shaped in a checkpoint.

    ``local_name``/``global_name``: the end of its FQN here and in one process (``"0.w1.weight"`` /
    ``"4.w1.weight"`` on EP rank 1 of 2 with 8 experts). ``mesh``, ``outer``, ``shape``: for a slice of a
    larger tensor, that tensor's shape and the placement (``Shard(0)``) over ``mesh``'s first dim that cut
    the slice; the parameter's own placements follow on the other dims. ``mesh`` None: a whole tensor.
    """

    local_name: str
    global_name: str
    mesh: DeviceMesh | None = None
    outer: Placement | None = None
    shape: tuple[int, ...] | None = None

    def fqn(self, fqn: str) -> str:
        if fqn != self.local_name and not fqn.endswith("." + self.local_name):
            raise CheckpointError(f"CheckpointAs: parameter {fqn!r} does not end with {self.local_name!r}")
        return fqn[:len(fqn) - len(self.local_name)] + self.global_name

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the parameter or a tensor placed like it) as the whole tensor: the same local storage."""
        if self.mesh is None or not isinstance(t, DTensor):
            return t
        with torch.no_grad():
            local = t.to_local()
        return make_dtensor(local, self.mesh, (self.outer, *t.placements), self.shape)

    def local_part(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of the one-process tensor ``whole`` (full, not sharded): the inverse of ``view``
        on values, the rows ``outer`` gives this rank's index along ``mesh``'s first dim."""
        if self.mesh is None:
            return whole
        return whole.chunk(self.mesh.size(0), dim=self.outer.dim)[self.mesh.get_local_rank(0)].contiguous()


def _saved_as(fqn: str, p: torch.Tensor) -> tuple[str, CheckpointAs | None]:
    how = getattr(p, "checkpoint_as", None)
    return (fqn, None) if how is None else (how.fqn(fqn), how)


def _view(how: CheckpointAs | None, t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``t`` as saved: viewed as the whole tensor when it is placed like ``param`` (not a scalar state)."""
    return t if how is None or t.shape != param.shape else how.view(t)


def _resharded(model: nn.Module) -> None:
    for unit in units(model):
        unit.reshard()  # the modules then hold the sharded parameters


def sharded_state_dict(model: nn.Module,
                       optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """``{"model.<fqn>": sharded param, "optim.<fqn>.<key>": state tensor}``; views, no copies."""
    _resharded(model)
    out: dict[str, torch.Tensor] = {}
    for fqn, p in model.named_parameters():
        name, how = _saved_as(fqn, p)
        out[f"model.{name}"] = _view(how, p, p)
        if optimizer is not None:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{name}.{key}"] = _view(how, value, p)
    return out


def save_dcp_checkpoint(path: str | os.PathLike, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``path`` from every rank, atomically.

    Raises:
        CheckpointError: ``path`` exists already (on every rank, before any collective), or a rank failed
            while writing (then ``path`` does not exist and ``<path>.partial`` holds the incomplete files).
    """
    path = Path(path)
    if path.exists():
        raise CheckpointError(f"save_dcp_checkpoint: checkpoint {str(path)!r} exists already; save to a "
                              "new directory")
    partial = path.with_name(path.name + ".partial")
    rank = dist.get_rank()
    try:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by an earlier run that died while saving
        dist.barrier()
        dcp.save(sharded_state_dict(model, optimizer), checkpoint_id=str(partial))
        # dcp.save returns once the metadata is written, which the coordinator does after every rank wrote.
        dist.barrier()
        if rank == 0:
            os.rename(partial, path)
        dist.barrier()
    except Exception as e:
        raise CheckpointError(f"save_dcp_checkpoint: writing checkpoint {str(path)!r} failed on rank "
                              f"{rank}: {e}") from e


def load_dcp_checkpoint(path: str | os.PathLike, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a ``save_dcp_checkpoint`` checkpoint (of any world size) in place into ``model``'s local pieces.

    The optimizer's per-parameter state is created with the parameters' placements (tensors shaped like
    the parameter) or as plain scalars, then filled from the checkpoint; its hyperparameters are the ones
    it was built with.

    Raises:
        CheckpointError: no complete checkpoint at ``path``, or the read failed.
    """
    path = Path(path)
    if not (path / ".metadata").exists():
        raise CheckpointError(f"load_dcp_checkpoint: {str(path)!r} is not a complete checkpoint "
                              "(no .metadata)")
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        target = sharded_state_dict(model)
        fresh: dict[str, tuple[nn.Parameter, str, torch.Tensor]] = {}
        if optimizer is not None:
            for fqn, p in model.named_parameters():
                name, how = _saved_as(fqn, p)
                for key, meta in saved.items():
                    prefix = f"optim.{name}."
                    if key.startswith(prefix) and "." not in key[len(prefix):]:
                        state = _like(p, tuple(meta.size), how, _scalar_device(optimizer, p))
                        target[key] = _view(how, state, p)
                        fresh[key] = (p, key[len(prefix):], state)
        dcp.load(target, checkpoint_id=str(path))
    except Exception as e:
        rank = dist.get_rank()
        raise CheckpointError(f"load_dcp_checkpoint: reading checkpoint {str(path)!r} failed on rank "
                              f"{rank}: {e}") from e
    for p, name, state in fresh.values():
        optimizer.state[p][name] = state


def _like(param: nn.Parameter, size: tuple[int, ...], how: CheckpointAs | None,
          scalar_device: torch.device) -> torch.Tensor:
    """A zero destination for a saved optimizer tensor: the parameter's placement, or a plain scalar on
    ``scalar_device``."""
    saved_shape = tuple(param.shape if how is None or how.shape is None else how.shape)
    if size == saved_shape and isinstance(param, DTensor):
        local = torch.zeros_like(param.to_local())
        return make_dtensor(local, param.device_mesh, param.placements, param.shape)
    return torch.zeros(size, dtype=torch.float32, device=scalar_device)


def _scalar_device(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> torch.device:
    """Where torch keeps ``param``'s scalar optimizer state (``step``), as ``Optimizer.load_state_dict``
    puts it: on the parameter's device for a fused or capturable optimizer (its kernels read ``step``
    there), else on the CPU."""
    group = next(g for g in optimizer.param_groups if any(q is param for q in g["params"]))
    return param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
