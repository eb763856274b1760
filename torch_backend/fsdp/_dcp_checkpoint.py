"""DCP checkpoints of a sharded model (and its optimizer): torch.distributed.checkpoint's own format.

Every rank saves its local pieces as they are: the sharded parameters and the optimizer state are
RaggedShard DTensors whose chunk metadata (``_dcp``) tells DCP which regular boxes of each global tensor
they hold, so a checkpoint written at one world size (or granularity) loads at another, in place into
the new local pieces. Keys are ``model.<fqn>`` and ``optim.<fqn>.<state>``.

A checkpoint is written to ``<path>.partial`` and renamed to ``<path>`` only once every rank has written
its part, so a run that dies while saving leaves the previous complete checkpoint as the latest.
Failures raise the core's ``ragged.checkpoint.CheckpointError`` (the one checkpoint error of every format).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from ragged.checkpoint import CheckpointError
from torch_backend.fsdp._fully_shard import units
from torch_backend.placement import make_dtensor


def _resharded(model: nn.Module) -> None:
    for unit in units(model):
        unit.reshard()  # the modules then hold the sharded parameters


def sharded_state_dict(model: nn.Module,
                       optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """``{"model.<fqn>": sharded param, "optim.<fqn>.<key>": state tensor}``; views, no copies."""
    _resharded(model)
    out: dict[str, torch.Tensor] = {}
    for fqn, p in model.named_parameters():
        out[f"model.{fqn}"] = p
        if optimizer is not None:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{fqn}.{key}"] = value
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
        fresh: dict[str, tuple[nn.Parameter, str]] = {}
        if optimizer is not None:
            for fqn, p in model.named_parameters():
                for key, meta in saved.items():
                    prefix = f"optim.{fqn}."
                    if key.startswith(prefix) and "." not in key[len(prefix):]:
                        target[key] = _like(p, tuple(meta.size))
                        fresh[key] = (p, key[len(prefix):])
        dcp.load(target, checkpoint_id=str(path))
    except Exception as e:
        rank = dist.get_rank()
        raise CheckpointError(f"load_dcp_checkpoint: reading checkpoint {str(path)!r} failed on rank "
                              f"{rank}: {e}") from e
    for key, (p, name) in fresh.items():
        optimizer.state[p][name] = target[key]


def _like(param: nn.Parameter, size: tuple[int, ...]) -> torch.Tensor:
    """A zero destination for a saved optimizer tensor: the parameter's placement, or a plain scalar."""
    if size == tuple(param.shape) and isinstance(param, DTensor):
        local = torch.zeros_like(param.to_local())
        return make_dtensor(local, param.device_mesh, param.placements, param.shape)
    return torch.zeros(size, dtype=torch.float32)
