"""Unit buffers: each FSDP unit's core ``Layout`` as one 1-D ``jax.Array`` sharded over a mesh axis.

A unit's buffer holds ``world_size * S`` elements with ``NamedSharding(mesh, P(axis))``, so device ``d`` of
the axis owns ``[d * S, (d + 1) * S)``, exactly the core's shard. Every parameter is the static slice
``[offset, offset + numel)`` of its unit's buffer, reshaped; offsets are read from the ``Layout`` and never
recomputed, so converting parameters to buffers and back is exact (only copies, no arithmetic).
Parameters are addressed by FQN (``layers.0.attention.wq.weight``, ``_names.fqn``), the names the Layout was
planned with.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ragged
from ragged import Layout

Shape = tuple[int, ...]


class LayoutMismatchError(ragged.RaggedError):
    """Parameters, a mesh or a world size that do not match the planned Layouts."""


# The shard axis: one mesh axis, or several taken as one (major first), as a PartitionSpec entry takes them.
Axis = str | tuple[str, ...]


def axis_names(axis: Axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def axis_size(mesh: Mesh, axis: Axis) -> int:
    """Devices along ``axis`` (the product of its mesh axes' sizes)."""
    return math.prod(mesh.shape[a] for a in axis_names(axis))


def check_mesh(mesh: Mesh, layouts: Sequence[Layout], axis: Axis, replica_axis: str | None = None) -> None:
    """Raise ``LayoutMismatchError`` unless ``axis`` (and ``replica_axis``) exist and match the Layouts."""
    names = tuple(mesh.axis_names)
    for role, name in [*(("axis", a) for a in axis_names(axis)), ("replica_axis", replica_axis)]:
        if name is not None and name not in names:
            raise LayoutMismatchError(
                f"{role}={name!r} is not an axis of the mesh (its axes are {names}, shape "
                f"{dict(mesh.shape)}); pass one of {names}"
            )
    if replica_axis in axis_names(axis):
        raise LayoutMismatchError(f"replica_axis and axis both hold {replica_axis!r}; HSDP needs two "
                                  "distinct axes")
    size = axis_size(mesh, axis)
    for layout in layouts:
        if layout.world_size != size:
            raise LayoutMismatchError(
                f"unit {layout.name!r} was planned for world_size {layout.world_size}, but mesh axis "
                f"{axis!r} has {size} devices; plan the units for {size} devices (ragged.plan_model) "
                f"or use a mesh whose {axis!r} axis has {layout.world_size} devices"
            )


def check_params(params: Mapping[str, Any], layouts: Sequence[Layout]) -> None:
    """Raise ``LayoutMismatchError`` naming the FQN if ``params`` do not match the Layouts' tensors."""
    planned = {t.name: t.shape for layout in layouts for t in layout.tensors}
    missing = [n for n in planned if n not in params]
    extra = [n for n in params if n not in planned]
    if missing or extra:
        raise LayoutMismatchError(
            f"params do not match the layout: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''} (layout units: "
            f"{[layout.name for layout in layouts]})"
        )
    for name, shape in planned.items():
        got = tuple(params[name].shape)
        if got != shape:
            raise LayoutMismatchError(
                f"{name}: params has shape {got}, the layout was planned for shape {shape}"
            )
    for layout in layouts:
        dtypes = {jnp.dtype(params[t.name].dtype) for t in layout.tensors}
        if len(dtypes) > 1:
            raise LayoutMismatchError(
                f"unit {layout.name!r} mixes dtypes {sorted(map(str, dtypes))}; one buffer has one dtype"
            )


def pack_unit(params: Mapping[str, jax.Array], layout: Layout) -> jax.Array:
    """The unit's global flat buffer ``(world_size * S,)``: each tensor at its offset, zeros between."""
    dtype = jnp.result_type(*(params[t.name] for t in layout.tensors))
    parts, cursor = [], 0
    for t in sorted(layout.tensors, key=lambda t: t.offset):
        if t.offset > cursor:
            parts.append(jnp.zeros(t.offset - cursor, dtype))
        parts.append(jnp.ravel(params[t.name]).astype(dtype))
        cursor = max(cursor, t.end)
    if layout.total_numel > cursor:
        parts.append(jnp.zeros(layout.total_numel - cursor, dtype))
    return jnp.concatenate(parts)


def as_bits(x: jax.Array) -> jax.Array:
    """Floats as unsigned integers of their width. XLA's CPU backend moves bf16 through fp32 in concatenates
    and collectives, which rewrites NaN payloads; conversions and checkpoints must keep every bit."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def check_buffer(buffer: jax.Array, layout: Layout) -> None:
    if buffer.shape != (layout.total_numel,):
        raise LayoutMismatchError(
            f"unit {layout.name!r}: buffer has shape {buffer.shape}, expected ({layout.total_numel},) "
            f"= world_size {layout.world_size} x S {layout.shard_size}"
        )


def _slices(buffer: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    check_buffer(buffer, layout)
    return {t.name: buffer[t.offset:t.end].reshape(t.shape) for t in layout.tensors}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def unpack_unit(buffer: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    """The unit's tensors as static slices of its unsharded buffer, reshaped: ``{fqn: array}``.

    Its VJP packs the tensors' gradients into one buffer (``pack_unit``: one concatenate, zeros in the
    gaps). The VJP JAX derives for the slices gives the same values but pads every gradient to the whole
    buffer and sums the pads, one pass over the buffer per tensor.

    Raises:
        LayoutMismatchError: the buffer is not ``(world_size * S,)`` for this Layout.
    """
    return _slices(buffer, layout)


unpack_unit.defvjp(lambda buffer, layout: (_slices(buffer, layout), None),
                   lambda layout, _, grads: (pack_unit(grads, layout),))


def buffer_sharding(mesh: Mesh, axis: Axis) -> NamedSharding:
    """Buffers are split over ``axis`` and replicated over every other mesh axis (HSDP replicas)."""
    return NamedSharding(mesh, PartitionSpec(axis))


def onto_mesh(tree: Any, mesh: Mesh) -> Any:
    """Every ``jax.Array`` of ``tree`` committed to other devices than ``mesh``'s (another mesh's, one
    device's) copied onto the mesh, replicated; host arrays and arrays already on the mesh as they are.
    One jitted program cannot read arrays from two device sets, so every entry that takes the user's
    arrays (parameters, optimizer state, model state) passes them through this first."""
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())

    def onto(x: Any) -> Any:
        if isinstance(x, jax.Array) and x.committed and x.sharding.device_set != devices:
            return jax.device_put(x, replicated)
        return x

    return jax.tree.map(onto, tree)


def shard_params(params: Mapping[str, Any], layouts: Sequence[Layout], mesh: Mesh,
                 axis: Axis) -> dict[str, jax.Array]:
    """Full parameters ``{fqn: array}`` -> ``{unit: buffer}``, each ``NamedSharding(mesh, P(axis))``.

    Raises:
        LayoutMismatchError: the axis is not in the mesh or has another size than the Layouts were
            planned for, or params miss / add a tensor or have another shape than planned.
    """
    check_mesh(mesh, layouts, axis)
    check_params(params, layouts)
    params = onto_mesh(dict(params), mesh)
    dtypes, bits = params_as_bits(params, layouts)
    sharding = buffer_sharding(mesh, axis)
    pack = sharded_program(_pack_bits, (tuple(map(anonymous, layouts)),), sharding)
    out = sharded_program(from_bits, (dtypes,), sharding)(pack(bits))
    return {lay.name: buffer for lay, buffer in zip(layouts, out)}


def full_params(buffers: Mapping[str, jax.Array], layouts: Sequence[Layout]) -> dict[str, jax.Array]:
    """``{unit: buffer}`` -> full parameters ``{fqn: array}`` in Layout order (static slices only)."""
    missing = [layout.name for layout in layouts if layout.name not in buffers]
    if missing:
        raise LayoutMismatchError(f"buffers miss the units {missing} (have {list(buffers)})")
    for lay in layouts:
        check_buffer(buffers[lay.name], lay)  # here: the programs' layouts have no names
    bits = _unpacked(tuple(buffers[lay.name] for lay in layouts), tuple(map(anonymous, layouts)))
    return tensors_from_bits(bits, buffers, layouts)


# The conversions' programs, compiled for ``anonymous`` layouts: units of one structure (a model's decoder
# layers, the same model planned again) share one program, and converting again (a checkpoint every N
# steps, an evaluation) compiles nothing. Floats move as their bits (``as_bits``), reinterpreted by a
# program of their own, so that XLA cannot fuse the reinterpretation into the data movement.
@functools.lru_cache(maxsize=4096)
def anonymous(layout: Layout) -> Layout:
    """``layout`` with the unit and its tensors named by position (``"0"``, ``"1"``, ...)."""
    return dataclasses.replace(layout, name="", tensors=tuple(
        dataclasses.replace(t, name=str(i)) for i, t in enumerate(layout.tensors)))


def from_bits(arrays: tuple[jax.Array, ...], dtypes: tuple) -> tuple[jax.Array, ...]:
    """The bits of ``as_bits`` reinterpreted as ``dtypes``."""
    return tuple(x if x.dtype == d else lax.bitcast_convert_type(x, d) for x, d in zip(arrays, dtypes))


@functools.lru_cache(maxsize=1024)
def sharded_program(fn: Callable, static: tuple, sharding: NamedSharding) -> Callable:
    """``fn(arrays, *static)`` jitted with every output on ``sharding``, compiled once per arguments."""
    return jax.jit(lambda arrays: fn(arrays, *static), out_shardings=sharding)


def params_as_bits(params: Mapping[str, Any], layouts: Sequence[Layout]) -> tuple[tuple, tuple]:
    """Each unit's dtype, and its tensors' bits (``as_bits``) in Layout order: what a pack program takes."""
    dtypes = tuple(jnp.result_type(*(params[t.name] for t in lay.tensors)) for lay in layouts)
    return dtypes, tuple(tuple(as_bits(jnp.asarray(params[t.name], d)) for t in lay.tensors)
                         for lay, d in zip(layouts, dtypes))


_from_bits = jax.jit(from_bits, static_argnums=1)  # the outputs keep the slices' sharding


def tensors_from_bits(bits: tuple[tuple[jax.Array, ...], ...], buffers: Mapping[str, jax.Array],
                      layouts: Sequence[Layout]) -> dict[str, jax.Array]:
    """An unpack program's tensors (per unit, in Layout order, as bits) -> ``{fqn: array}`` of the buffers'
    dtypes."""
    dtypes = tuple(buffers[lay.name].dtype for lay in layouts for _ in lay.tensors)
    names = [t.name for lay in layouts for t in lay.tensors]
    return dict(zip(names, _from_bits(sum(bits, ()), dtypes)))


@functools.partial(jax.jit, static_argnums=1)
def _unpacked(buffers: tuple[jax.Array, ...],
              layouts: tuple[Layout, ...]) -> tuple[tuple[jax.Array, ...], ...]:
    """Each unit's tensors in Layout order (not its dict's: a pytree's keys are sorted), as their bits."""
    units = (unpack_unit(as_bits(b), lay) for b, lay in zip(buffers, layouts))
    return tuple(tuple(u[t.name] for t in lay.tensors) for u, lay in zip(units, layouts))


def _pack_bits(bits: tuple[tuple[jax.Array, ...], ...], layouts: tuple[Layout, ...]) -> tuple[jax.Array, ...]:
    return tuple(pack_unit({t.name: x for t, x in zip(lay.tensors, b)}, lay) for b, lay in zip(bits, layouts))
