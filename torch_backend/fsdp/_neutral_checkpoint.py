"""torch side of the neutral checkpoint (``ragged.checkpoint.save_neutral_checkpoint``): state dicts <-> full
tensors.

Saving takes a module or a state dict of plain tensors or DTensors (any placement, RaggedShard included),
gathers DTensors with ``full_tensor()`` and stores every tensor whole, bit for bit: dtypes numpy lacks
(bf16, float8) travel as their raw bits. Loading returns full tensors, or loads them into a module, giving
each DTensor entry its module's mesh and placements with ``distribute_tensor``; so a checkpoint written
by JAX (or at another world size) loads into any sharding. Uses only public torch APIs.
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
from ragged.checkpoint import StoredTensor

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
    """Write ``state`` (a module's ``state_dict()`` or a state dict) as full tensors by FQN.

    With a process group, every rank must call it (``full_tensor`` is a collective); rank 0 writes.

    Raises:
        ragged.checkpoint.CheckpointError: as ``ragged.checkpoint.save_neutral_checkpoint``.
    """
    sd = state.state_dict() if isinstance(state, nn.Module) else state
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return Path(path)
    tensors = {k: _to_stored(v) for k, v in full.items()}
    return ragged.checkpoint.save_neutral_checkpoint(path, tensors, layouts=layouts,
                                          meta={"framework": "torch", **(meta or {})}, overwrite=overwrite)


def load_neutral_checkpoint(path: str | os.PathLike,
                            module: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Read full tensors by FQN; with ``module``, also load them into it (strict, resharding DTensors).

    Returns:
        The full tensors (CPU, stored dtypes).

    Raises:
        ragged.checkpoint.CheckpointError: a malformed checkpoint.
        RuntimeError: from ``load_state_dict`` when the checkpoint's names or shapes differ from the module's.
    """
    full = {k: _from_stored(v) for k, v in ragged.checkpoint.load_neutral_checkpoint(path).tensors.items()}
    if module is not None:
        current = module.state_dict()
        sd = {}
        for k, v in full.items():
            target = current.get(k)
            if isinstance(target, DTensor):
                v = distribute_tensor(v.to(target.device), target.device_mesh, target.placements)
            sd[k] = v
        module.load_state_dict(sd, strict=True)
    return full
