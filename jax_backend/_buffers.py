"""Unit buffers: each FSDP unit's core ``Layout`` as one 1-D ``jax.Array`` sharded over a mesh axis.

A unit's buffer holds ``world_size * S`` elements with ``NamedSharding(mesh, P(axis))``, so device ``d`` of
the axis owns ``[d * S, (d + 1) * S)``, exactly the core's shard. Every parameter is the static slice
``[offset, offset + numel)`` of its unit's buffer, reshaped; offsets are read from the ``Layout`` and never
recomputed, so converting parameters to buffers and back is exact (only copies, no arithmetic).
Parameters are addressed by FQN (``layers.0.attention.wq.weight``, ``_names.fqn``), the names the Layout was
planned with.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
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


def _slices(buffer: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    if buffer.shape != (layout.total_numel,):
        raise LayoutMismatchError(
            f"unit {layout.name!r}: buffer has shape {buffer.shape}, expected ({layout.total_numel},) "
            f"= world_size {layout.world_size} x S {layout.shard_size}"
        )
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
    sharding = buffer_sharding(mesh, axis)
    shardings = {lay.name: sharding for lay in layouts}
    dtypes = {lay.name: jnp.result_type(*(params[t.name] for t in lay.tensors)) for lay in layouts}
    # Three steps, so that XLA cannot fuse the reinterpretations into the data movement: take the bits,
    # pack them into sharded buffers, then reinterpret the buffers shard by shard.
    bits = {t.name: as_bits(jnp.asarray(params[t.name], dtypes[lay.name]))
            for lay in layouts for t in lay.tensors}
    pack = jax.jit(lambda p: {lay.name: pack_unit(p, lay) for lay in layouts}, out_shardings=shardings)
    as_dtype = jax.jit(lambda b: {k: lax.bitcast_convert_type(v, dtypes[k]) if v.dtype != dtypes[k] else v
                                  for k, v in b.items()}, out_shardings=shardings)
    out = as_dtype(pack(bits))
    return {lay.name: out[lay.name] for lay in layouts}  # in unit order (jit sorts dict keys)


def full_params(buffers: Mapping[str, jax.Array], layouts: Sequence[Layout]) -> dict[str, jax.Array]:
    """``{unit: buffer}`` -> full parameters ``{fqn: array}`` in Layout order (static slices only)."""
    missing = [layout.name for layout in layouts if layout.name not in buffers]
    if missing:
        raise LayoutMismatchError(f"buffers miss the units {missing} (have {list(buffers)})")
    def slices(b: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return {k: v for lay in layouts for k, v in unpack_unit(as_bits(b[lay.name]), lay).items()}


    dtypes = {t.name: buffers[lay.name].dtype for lay in layouts for t in lay.tensors}
    out = jax.jit(slices)({lay.name: buffers[lay.name] for lay in layouts})  # jit returns sorted keys
    return {k: out[k] if out[k].dtype == d else lax.bitcast_convert_type(out[k], d) for k, d in dtypes.items()
            }
