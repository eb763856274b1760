"""torch side of the neutral checkpoint (``ragged.checkpoint.save_neutral_checkpoint``): state dicts <-> full
tensors.

Saving takes a module or a state dict of plain tensors or DTensors (any placement: RaggedShard, and
RaggedShard composed with tensor parallelism's ``Shard``/``Replicate`` on a ``(dp, tp)`` mesh), gathers
DTensors with ``full_tensor()`` and stores every tensor whole, bit for bit: dtypes numpy lacks (bf16,
float8) travel as their raw bits. Loading returns full tensors, or loads them into a module, giving each
DTensor entry its module's mesh and placements with ``distribute_tensor``; so a checkpoint written by JAX
(or at another world size, with or without tensor parallelism) loads into any sharding.

Expert parallelism: a parameter with a ``CheckpointAs`` (``models.expert_parallel``) is saved and loaded
under its one-process name and shape (``experts.4.w1.weight``, a fused ``[E, ...]`` tensor whole), as in
DCP checkpoints. An EP rank holds only its experts, so saving gathers to rank 0 what it lacks, each tensor
from the lowest rank that holds it, and loading takes each rank's experts (or rows) from the whole tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import ragged
import ragged.checkpoint
from ragged import Layout
from ragged.checkpoint import CheckpointError, StoredTensor
from torch_backend.fsdp._dcp_checkpoint import CheckpointAs

# torch dtypes that numpy cannot hold: (name, same-width integer dtype in torch, and in numpy).
_BITS_DTYPES = {
    torch.bfloat16: ("bfloat16", torch.int16, np.int16),
    torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8, np.uint8),
    torch.float8_e5m2: ("float8_e5m2", torch.uint8, np.uint8),
}
_BY_NAME = {name: (dtype, np_int) for dtype, (name, _, np_int) in _BITS_DTYPES.items()}


def _to_stored(t: torch.Tensor) -> StoredTensor | np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype in _BITS_DTYPES:
        name, torch_int, _ = _BITS_DTYPES[t.dtype]
        bits = t.view(torch_int).numpy()
        return StoredTensor(bits.view(f"uint{8 * bits.itemsize}"), name)  # the format stores unsigned bits
    return t.numpy()


def _from_stored(stored: StoredTensor) -> torch.Tensor:
    if stored.dtype in _BY_NAME:
        dtype, np_int = _BY_NAME[stored.dtype]
        return torch.from_numpy(stored.bits.view(np_int).copy()).view(dtype)
    return torch.from_numpy(stored.bits.copy())


def save_neutral_checkpoint(path: str | os.PathLike, state: nn.Module | Mapping[str, torch.Tensor], *,
                            layouts: Sequence[Layout] = (), meta: Mapping[str, Any] | None = None,
                            overwrite: bool = False) -> Path:
    """Write ``state`` (a module, or a state dict) as full tensors by their one-process FQNs.

    With a process group, every rank must call it (``full_tensor`` is a collective, and under expert
    parallelism rank 0 gathers the experts it does not hold); rank 0 writes.

    Raises:
        ragged.checkpoint.CheckpointError: as ``ragged.checkpoint.save_neutral_checkpoint``.
    """
    full = _full_tensors(state)
    if dist.is_initialized():
        if _placed_by_another_dim(state):
            full = _gather_on_rank0(full)
        if dist.get_rank() != 0:
            return Path(path)
    tensors = {k: _to_stored(v) for k, v in full.items()}
    return ragged.checkpoint.save_neutral_checkpoint(path, tensors, layouts=layouts,
                                          meta={"framework": "torch", **(meta or {})}, overwrite=overwrite)


def _full_tensors(state: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors this rank can make whole, by one-process FQN (DTensors gathered: a collective)."""
    if not isinstance(state, nn.Module):
        return {k: _whole(v) for k, v in state.items()}
    params = dict(state.named_parameters())
    out = {}
    for k, v in state.state_dict().items():
        how = _checkpoint_as(params.get(k))
        out[k if how is None else how.fqn(k)] = _whole(v if how is None else how.view(v))
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _checkpoint_as(param: torch.Tensor | None) -> CheckpointAs | None:
    return getattr(param, "checkpoint_as", None)


def _placed_by_another_dim(state: nn.Module | Mapping[str, torch.Tensor]) -> bool:
    """Whether some parameter carries a ``CheckpointAs`` (expert parallelism): then every rank has such
    parameters, holds only its own, and saving and loading exchange names (collectives on every rank)."""
    return isinstance(state, nn.Module) and any(_checkpoint_as(p) for p in state.parameters())


def _gather_on_rank0(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``full`` on rank 0, completed with the tensors only other ranks hold (EP ranks' experts), each
    sent (on CPU) by the lowest rank that holds it; ``{}`` elsewhere."""
    names: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(names, sorted(full))
    rank = dist.get_rank()
    seen = {name for held in names[:rank] for name in held}
    mine = {k: v.detach().cpu() for k, v in full.items() if k not in seen} if rank else {}
    parts: list[dict[str, torch.Tensor]] | None = [{} for _ in names] if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank:
        return {}
    for part in parts[1:]:
        full.update(part)
    return full


def load_neutral_checkpoint(path: str | os.PathLike,
                            module: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Read full tensors by FQN; with ``module``, also load them into it (strict, resharding DTensors).

    Under expert parallelism each rank loads its experts from their one-process names (a fused tensor's
    rows from the whole tensor), and the check that every saved tensor is used counts every rank's.

    Returns:
        The full tensors (CPU, stored dtypes).

    Raises:
        ragged.checkpoint.CheckpointError: a malformed checkpoint, or (with ``module``) tensors the module
            has no parameter or buffer for, named.
        RuntimeError: from ``load_state_dict`` when the checkpoint lacks one of the module's names or has
            another shape.
    """
    full = {k: _from_stored(v) for k, v in ragged.checkpoint.load_neutral_checkpoint(path).tensors.items()}
    if module is None:
        return full
    params = dict(module.named_parameters())
    sd, used = {}, set()
    for k, target in module.state_dict().items():
        how = _checkpoint_as(params.get(k))
        name = k if how is None else how.fqn(k)
        if name not in full:
            continue  # load_state_dict names it as missing
        used.add(name)
        v = full[name] if how is None else how.local_part(full[name])
        if isinstance(target, DTensor):
            v = distribute_tensor(v.to(target.device), target.device_mesh, target.placements)
        sd[k] = v
    if dist.is_initialized() and _placed_by_another_dim(module):  # other EP ranks load other experts
        everyone: list[set[str]] = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, used)
        used = set().union(*everyone)
    unused = sorted(set(full) - used)
    if unused:
        raise CheckpointError(f"{path}: the module has nothing to load {len(unused)} saved tensors into: "
                              f"{unused[:5]}{' ...' if len(unused) > 5 else ''}")
    module.load_state_dict(sd, strict=True)
    return full
