"""The two JAX APIs whose spelling moved between versions: ``shard_map`` and mesh axis types."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh


def shard_map(f: Callable, mesh: Any, in_specs: Any, out_specs: Any,
              axis_names: frozenset[str] | set[str] | None = None) -> Callable:
    """``jax.shard_map`` where it exists (0.6+), else ``jax.experimental.shard_map.shard_map``.

    Replication checking is off (``check_vma`` / ``check_rep``): the FSDP step says explicitly which
    collective reduces each gradient (a custom VJP), so no implicit ``psum`` may be inserted.
    ``axis_names``: the axes that are manual (default: all); the others stay ``Auto``, partitioned by XLA.
    """
    if hasattr(jax, "shard_map"):
        manual = {} if axis_names is None else {"axis_names": set(axis_names)}
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **manual)
    from jax.experimental.shard_map import shard_map as experimental_shard_map

    auto = {} if axis_names is None else {"auto": frozenset(mesh.axis_names) - set(axis_names)}
    return experimental_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False,
                                  **auto)


def make_mesh(shape: Sequence[int], axis_names: Sequence[str],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` of the first ``prod(shape)`` devices with ``Auto`` axes, as ``shard_map`` expects.

    ``jax.make_mesh`` defaults to ``Explicit`` axes since JAX 0.7; building the ``Mesh`` directly with
    ``AxisType.Auto`` gives the same mesh on 0.10 and 0.11 (and on versions without axis types).

    Raises:
        ValueError: fewer devices than ``prod(shape)`` or a name per dim missing.
    """
    shape, names = tuple(int(s) for s in shape), tuple(axis_names)
    if len(shape) != len(names):
        raise ValueError(f"make_mesh: shape {shape} and axis_names {names} differ in length")
    pool = list(jax.devices() if devices is None else devices)
    if math.prod(shape) > len(pool):
        raise ValueError(f"make_mesh: shape {shape} needs {math.prod(shape)} devices, only {len(pool)} given")
    grid = np.asarray(pool[:math.prod(shape)], dtype=object).reshape(shape)
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:
        return Mesh(grid, names)
    return Mesh(grid, names, axis_types=(axis_type.Auto,) * len(names))
