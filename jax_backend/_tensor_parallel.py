"""A ``tensor`` mesh axis beside ``fsdp``: each tensor rank's pieces of the weights in its own unit buffers.

A parameter split over the tensor axis on dim ``k`` has, on tensor rank ``t``, the ``t``-th of ``T`` equal
slices along ``k`` (``Shard(k)``); a parameter that names no tensor dim is whole on every rank. The core
plans each unit from these TP-local shapes (one ``Layout`` serves every tensor rank: the local shapes are
equal), and a unit's buffer is ``(T, W * S)``: row ``t`` is tensor rank ``t``'s buffer, sharded over
``fsdp`` exactly as a 1-D buffer is (``NamedSharding(mesh, P(tensor, fsdp))``).

In the step the ``shard_map`` is manual over the data axes (``replica``, ``fsdp``) only; ``tensor`` stays
``Auto``, so the model runs as written on full-shape parameters sharded over ``tensor`` and XLA's
partitioner inserts the tensor-parallel collectives (Megatron's all-reduces follow from the shardings).
Two things are manual over ``tensor`` too, in a nested ``shard_map``: the unit's all-gather and
reduce-scatter over ``fsdp`` (left to the partitioner, it first replicates the whole buffer over
``tensor``), and the read of a parameter that is whole on every rank (each rank reads its own copy: no
collective; the copies stay equal because their gradients are the one replicated gradient).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_backend._buffers import (
    LayoutMismatchError,
    as_bits,
    check_mesh,
    check_params,
    from_bits,
    onto_mesh,
    pack_unit,
    params_as_bits,
    sharded_program,
    tensors_from_bits,
)
from jax_backend._compat import shard_map
from jax_backend._names import fqn
from ragged import Layout

Shape = tuple[int, ...]
# A rules table: ``fnmatch`` pattern of a parameter FQN -> the dim split over the tensor axis (None: whole).
TensorRules = Mapping[str, int | None]


class TensorParallelError(LayoutMismatchError):
    """A tensor-parallel annotation or rule that cannot be honored (names the parameter)."""


@dataclass(frozen=True)
class TensorParallel:
    """Which dim of each parameter the tensor axis splits.

    Args:
        axis: the mesh axis of tensor parallelism.
        size: its number of devices (``T``).
        dims: ``((fqn, dim or None), ...)``: every parameter, with the dim split over ``axis`` (None:
            whole on every tensor rank). A tuple, so that the value is hashable (a static argument).
    """

    axis: str
    size: int
    dims: tuple[tuple[str, int | None], ...]

    def dim(self, name: str) -> int | None:
        return dict(self.dims)[name]

    def local_shape(self, name: str, shape: Shape) -> Shape:
        """The shape of tensor rank ``t``'s piece of parameter ``name`` (full shape ``shape``)."""
        k = self.dim(name)
        if k is None:
            return tuple(shape)
        return (*shape[:k], shape[k] // self.size, *shape[k + 1:])

    def split(self, name: str, full: Any) -> list[Any]:
        """``full`` as its ``T`` tensor-rank pieces (the same array ``T`` times if it is not split)."""
        k = self.dim(name)
        return [full] * self.size if k is None else list(jnp.split(full, self.size, axis=k))

    def join(self, name: str, pieces: Any) -> jax.Array:
        """``(T, *local)`` -> the full tensor: pieces joined along the split dim (rank 0's if whole)."""
        k = self.dim(name)
        if k is None:
            return pieces[0]
        moved = jnp.moveaxis(pieces, 0, k)  # (..., T, local_k, ...): merging the two dims is the join
        return moved.reshape(*moved.shape[:k], moved.shape[k] * moved.shape[k + 1], *moved.shape[k + 2:])


def _annotated_dim(name: str, shape: Shape, spec: Any, axis: str, mesh_axes: Iterable[str],
                   data_axes: Iterable[str]) -> int | None:
    """The dim that ``spec`` (a partition spec: one entry per dim, an axis name, a tuple of them or None)
    puts on ``axis``. Data axes are accepted and ignored (the ragged buffers shard over them)."""
    if spec is None:
        return None
    entries = tuple(spec)
    if len(entries) > len(shape):
        raise TensorParallelError(f"parameter {name!r} (shape {shape}) has the sharding annotation {spec}: "
                                  f"{len(entries)} entries for {len(shape)} dims")
    found = []
    for k, entry in enumerate(entries):
        for a in entry if isinstance(entry, tuple) else (entry,):
            if a is None:
                continue
            if a not in mesh_axes:
                raise TensorParallelError(
                    f"parameter {name!r} (shape {shape}) is annotated {spec}: {a!r} is not a mesh axis "
                    f"(the mesh has {tuple(mesh_axes)}); name {axis!r} on the dim to split, or None")
            if a == axis:
                found.append(k)
            elif a not in data_axes:
                raise TensorParallelError(
                    f"parameter {name!r} (shape {shape}) is annotated {spec}: axis {a!r} is neither the "
                    f"tensor axis {axis!r} nor a data axis {tuple(data_axes)}")
    if len(found) > 1:
        raise TensorParallelError(f"parameter {name!r} (shape {shape}) is annotated {spec}: the tensor axis "
                                  f"{axis!r} splits dims {found}; one dim at most")
    return found[0] if found else None


def _rule_dim(name: str, rules: TensorRules) -> tuple[bool, int | None]:
    """``(matched, dim)`` of the first rule whose pattern matches ``name`` (``fnmatch``)."""
    for pattern, dim in rules.items():
        if fnmatch.fnmatchcase(name, pattern):
            return True, dim
    return False, None


def build_tensor_parallel(shapes: Mapping[str, Shape], annotations: Mapping[str, Any], *, axis: str,
                          mesh_shape: Mapping[str, int], data_axes: Iterable[str],
                          rules: TensorRules | None = None) -> TensorParallel:
    """Every parameter's split dim: from ``rules`` where a pattern matches, else from its annotation.

    Args:
        shapes: ``{fqn: full shape}``.
        annotations: ``{fqn: partition spec}`` (flax NNX ``out_sharding`` metadata; absent or None: whole).
        axis: the tensor axis; mesh_shape: the mesh's ``{axis: size}``; data_axes: the FSDP/HSDP axes.
        rules: ``{fnmatch pattern: dim or None}``; the first matching pattern wins over the annotation.

    Raises:
        TensorParallelError: naming the parameter: an annotation with an axis not in the mesh, two dims
            on the tensor axis, a split dim out of range or not divisible by the tensor axis's size.
    """
    if axis not in mesh_shape:
        raise TensorParallelError(f"tensor_axis={axis!r} is not an axis of the mesh {dict(mesh_shape)}")
    size, data_axes = mesh_shape[axis], tuple(data_axes)
    dims = []
    for name, shape in shapes.items():
        matched, k = _rule_dim(name, rules or {})
        if not matched:
            k = _annotated_dim(name, shape, annotations.get(name), axis, tuple(mesh_shape), data_axes)
        if k is not None:
            if not -len(shape) <= k < len(shape):
                raise TensorParallelError(f"parameter {name!r} (shape {shape}): tensor dim {k} out of range")
            k %= len(shape)
            if shape[k] % size:
                raise TensorParallelError(
                    f"parameter {name!r} (shape {shape}): dim {k} ({shape[k]}) is not divisible by the size "
                    f"{size} of tensor axis {axis!r}; split another dim, leave it whole, or change the mesh")
        dims.append((name, k))
    return TensorParallel(axis, size, tuple(dims))


def nnx_annotations(state: Any) -> dict[str, Any]:
    """``{fqn: partition spec}`` of an NNX ``State`` of Params (flax's ``out_sharding`` metadata, or the
    ``sharding`` / ``sharding_names`` of older flax versions)."""
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, var in leaves:
        meta = var.get_metadata() if isinstance(var, nnx.Variable) else {}
        spec = next((meta[k] for k in ("out_sharding", "sharding_names", "sharding") if meta.get(k)), None)
        if spec is not None:
            out[fqn(path)] = spec
    return out


# ----- host side: full parameters <-> (T, W * S) buffers -------------------------------------------------
def pack_tp_unit(params: Mapping[str, jax.Array], layout: Layout, tp: TensorParallel) -> jax.Array:
    """The unit's ``(T, W * S)`` buffer from full parameters: row ``t`` packs tensor rank ``t``'s pieces."""
    pieces = {t.name: tp.split(t.name, params[t.name]) for t in layout.tensors}
    return jnp.stack([pack_unit({n: p[r] for n, p in pieces.items()}, layout) for r in range(tp.size)])


def unpack_tp_rows(buffer: jax.Array, layout: Layout, tp: TensorParallel) -> dict[str, jax.Array]:
    """``(T, W * S)`` -> ``{fqn: full tensor}`` (static slices, a reshape, a moveaxis: no arithmetic)."""
    if buffer.shape != (tp.size, layout.total_numel):
        raise LayoutMismatchError(
            f"unit {layout.name!r}: buffer has shape {buffer.shape}, expected ({tp.size}, "
            f"{layout.total_numel}) = (tensor size, world_size {layout.world_size} x S {layout.shard_size})")
    return {t.name: tp.join(t.name, buffer[:, t.offset:t.end].reshape(tp.size, *t.shape))
            for t in layout.tensors}


# ----- in the step (inside the shard_map over the data axes) ---------------------------------------------
def per_tensor_rank(fn: Callable, axis: str) -> Callable:
    """``fn`` on each tensor rank's own row, manual over ``axis`` too (nested in the step's ``shard_map``):
    operands and result ``(T, ...)`` with dim 0 over ``axis``."""
    return shard_map(fn, jax.sharding.get_abstract_mesh(), in_specs=P(axis), out_specs=P(axis),
                     axis_names={axis})


def _own_copy(rows: jax.Array, axis: str) -> jax.Array:
    """``(T, *shape)`` of equal rows -> ``shape``, each tensor rank its own row (no collective)."""
    return shard_map(lambda r: r[0], jax.sharding.get_abstract_mesh(), in_specs=P(axis), out_specs=P(),
                     axis_names={axis})(rows)


def _tp_slices(full: jax.Array, layout: Layout, tp: TensorParallel) -> dict[str, jax.Array]:
    out = {}
    for t in layout.tensors:
        rows = full[:, t.offset:t.end].reshape(tp.size, *t.shape)
        out[t.name] = _own_copy(rows, tp.axis) if tp.dim(t.name) is None else tp.join(t.name, rows)
    return out


def _tp_pack(grads: Mapping[str, jax.Array], layout: Layout, tp: TensorParallel) -> jax.Array:
    """The gradients (full shapes) as the unit's ``(T, W * S)`` gradient: each split one cut back into its
    ranks' pieces; a whole one's replicated gradient is every rank's copy's gradient."""
    rows = {}
    for t in layout.tensors:
        g, k = grads[t.name], tp.dim(t.name)
        if k is None:
            rows[t.name] = jnp.broadcast_to(g, (tp.size, *g.shape))
        else:  # the inverse of TensorParallel.join
            g = g.reshape(*g.shape[:k], tp.size, g.shape[k] // tp.size, *g.shape[k + 1:])
            rows[t.name] = jnp.moveaxis(g, k, 0)
    dtype = jnp.result_type(*grads.values())
    parts, cursor = [], 0
    for t in sorted(layout.tensors, key=lambda t: t.offset):
        if t.offset > cursor:
            parts.append(jnp.zeros((tp.size, t.offset - cursor), dtype))
        parts.append(rows[t.name].reshape(tp.size, -1).astype(dtype))
        cursor = max(cursor, t.end)
    if layout.total_numel > cursor:
        parts.append(jnp.zeros((tp.size, layout.total_numel - cursor), dtype))
    return jnp.concatenate(parts, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def unpack_tp_unit(full: jax.Array, layout: Layout, tp: TensorParallel) -> dict[str, jax.Array]:
    """The gathered unit ``(T, W * S)`` as full-shape parameters sharded over the tensor axis.

    A split parameter is its ranks' pieces joined along its dim (dim 0 of the buffer is over the tensor
    axis, so the join moves no data); a whole one is each rank's own copy. The VJP packs the gradients
    back with one concatenate, the replicated gradient of a whole parameter into every rank's copy.
    """
    return _tp_slices(full, layout, tp)


unpack_tp_unit.defvjp(lambda full, layout, tp: (_tp_slices(full, layout, tp), None),
                      lambda layout, tp, _, grads: (_tp_pack(grads, layout, tp),))


def shard_tp_params(params: Mapping[str, Any], layouts: Sequence[Layout], mesh: Mesh, axis: str,
                    tp: TensorParallel) -> dict[str, jax.Array]:
    """Full parameters ``{fqn: array}`` -> ``{unit: (T, W * S) buffer}``, ``NamedSharding(P(tensor, axis))``.

    Floats move as unsigned integers of their width (as ``shard_params``): every bit is kept.

    Raises:
        LayoutMismatchError: params that miss or add a tensor, or whose tensor-rank pieces do not have the
            planned shapes (names the FQN).
    """
    check_mesh(mesh, layouts, axis)
    dims = dict(tp.dims)
    for name, k in dims.items():
        if k is not None and name in params and np.shape(params[name])[k] % tp.size:
            raise TensorParallelError(f"parameter {name!r} (shape {np.shape(params[name])}): dim {k} is not "
                                      f"divisible by the size {tp.size} of tensor axis {tp.axis!r}")
    check_params({n: jax.ShapeDtypeStruct(tp.local_shape(n, np.shape(a)) if n in dims else np.shape(a),
                                          jnp.result_type(a)) for n, a in params.items()}, layouts)
    params = onto_mesh(dict(params), mesh)
    dtypes, bits = params_as_bits(params, layouts)
    sharding = NamedSharding(mesh, P(tp.axis, axis))
    pack = sharded_program(_pack_tp_bits, (tuple(layouts), tp), sharding)
    out = sharded_program(from_bits, (dtypes,), sharding)(pack(bits))
    return {lay.name: buffer for lay, buffer in zip(layouts, out)}


def full_tp_params(buffers: Mapping[str, jax.Array], layouts: Sequence[Layout],
                   tp: TensorParallel) -> dict[str, jax.Array]:
    """``{unit: (T, W * S) buffer}`` -> full parameters ``{fqn: array}`` in Layout order (exact)."""
    missing = [layout.name for layout in layouts if layout.name not in buffers]
    if missing:
        raise LayoutMismatchError(f"buffers miss the units {missing} (have {list(buffers)})")
    bits = _unpacked_tp(tuple(buffers[lay.name] for lay in layouts), tuple(layouts), tp)
    return tensors_from_bits(bits, buffers, layouts)


# Compiled once per units and split (as _buffers' conversions, there for anonymous layouts: here the split
# is by parameter name).
def _pack_tp_bits(bits: tuple[tuple[jax.Array, ...], ...], layouts: tuple[Layout, ...],
                  tp: TensorParallel) -> tuple[jax.Array, ...]:
    return tuple(pack_tp_unit({t.name: x for t, x in zip(lay.tensors, b)}, lay, tp)
                 for b, lay in zip(bits, layouts))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _unpacked_tp(buffers: tuple[jax.Array, ...], layouts: tuple[Layout, ...],
                 tp: TensorParallel) -> tuple[tuple[jax.Array, ...], ...]:
    units = (unpack_tp_rows(as_bits(b), lay, tp) for b, lay in zip(buffers, layouts))
    return tuple(tuple(u[t.name] for t in lay.tensors) for u, lay in zip(units, layouts))
