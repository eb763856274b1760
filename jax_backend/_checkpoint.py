"""Checkpoints of unit buffers in the framework-neutral format
(``ragged.checkpoint.save_neutral_checkpoint``).

Saving unshards every unit buffer into full tensors by FQN (static slices, no arithmetic) and writes them
with the Layouts; loading reads the full tensors and shards them with the caller's Layouts, which may be
planned for another device count: that is resharding on load. Dtypes are kept bit for bit (a bf16 tensor
comes back as the same bf16 bits), so a torch checkpoint loaded here and saved again is unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import ragged
import ragged.checkpoint
from jax_backend._buffers import full_params, shard_params
from jax_backend._tensor_parallel import TensorParallel, full_tp_params, shard_tp_params
from ragged import Layout


def save_neutral_checkpoint(path: str | os.PathLike, buffers: Mapping[str, jax.Array],
                            layouts: Sequence[Layout], *, meta: Mapping[str, Any] | None = None,
                            overwrite: bool = False, tensor_parallel: TensorParallel | None = None) -> Path:
    """Write the unit buffers as full tensors by FQN, plus ``layouts``.

    Every process must call it (unsharding gathers across processes); only process 0 writes. With
    ``tensor_parallel`` (``fsdp.tensor_parallel``) the buffers are ``(T, W * S)`` and the tensors are
    joined whole: the checkpoint is the same as without tensor parallelism, except that the Layouts (planned
    for the tensor ranks' local shapes) are not recorded; the split is, in the metadata.

    Raises:
        ragged.checkpoint.CheckpointError: as ``ragged.checkpoint.save_neutral_checkpoint``;
            LayoutMismatchError for missing units.
    """
    if tensor_parallel is None:
        full = full_params(buffers, layouts)
    else:
        full = full_tp_params(buffers, layouts, tensor_parallel)
        tp = tensor_parallel
        meta = {**(meta or {}), "tensor_parallel": {"axis": tp.axis, "size": tp.size, "dims": dict(tp.dims)}}
        layouts = ()
    return save_neutral_params(path, full, layouts=layouts, meta=meta, overwrite=overwrite)


def save_neutral_params(path: str | os.PathLike, params: Mapping[str, jax.Array], *,
                        layouts: Sequence[Layout] = (), meta: Mapping[str, Any] | None = None,
                        overwrite: bool = False) -> Path:
    """Write full tensors ``{fqn: array}`` (the inverse of ``load_neutral_params``): for runtimes whose
    buffers are not one Layout per unit, e.g. expert parallelism, ``save_neutral_params(path,
    ep.full_params(buffers))``, every expert under its one-process name, loaded back with
    ``ep.shard_params(load_neutral_params(path))``.

    Every process must call it; only process 0 writes.

    Raises:
        ragged.checkpoint.CheckpointError: as ``ragged.checkpoint.save_neutral_checkpoint``.
    """
    if jax.process_count() > 1:  # shards live on other hosts: gather them, every process takes part
        params = {k: multihost_utils.process_allgather(v, tiled=True) for k, v in params.items()}
    tensors = {name: np.asarray(jax.device_get(value)) for name, value in params.items()}
    if jax.process_index() != 0:
        return Path(path)
    return ragged.checkpoint.save_neutral_checkpoint(path, tensors, layouts=layouts,
                                          meta={"framework": "jax", **(meta or {})}, overwrite=overwrite)


def load_neutral_params(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The checkpoint's full tensors ``{fqn: np.ndarray}`` in their stored dtypes (bf16 via ml_dtypes)."""
    checkpoint = ragged.checkpoint.load_neutral_checkpoint(path)
    return {name: t.bits.view(jnp.dtype(t.dtype)) for name, t in checkpoint.tensors.items()}


def load_neutral_checkpoint(path: str | os.PathLike, layouts: Sequence[Layout], mesh: Mesh, axis: str, *,
                            tensor_parallel: TensorParallel | None = None) -> dict[str, jax.Array]:
    """Read full tensors and shard them into unit buffers with ``layouts`` on ``mesh`` (any world size;
    with ``tensor_parallel``, any tensor size: ``(T, W * S)`` buffers, whatever the checkpoint was saved
    with).

    Raises:
        ragged.checkpoint.CheckpointError: a malformed checkpoint.
        LayoutMismatchError: the checkpoint's tensors differ from the Layouts' (named by FQN), or the mesh
            axis does not match the Layouts' world size.
    """
    if tensor_parallel is not None:
        return shard_tp_params(load_neutral_params(path), layouts, mesh, axis, tensor_parallel)
    return shard_params(load_neutral_params(path), layouts, mesh, axis)
