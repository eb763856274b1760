"""Move one tensor between its ragged pieces and a whole copy (on one device, or on every device).

For Muon-style optimizers: the update of a matrix needs the whole matrix, but FSDP leaves it in ragged
pieces across the unit shards. These functions run inside ``shard_map`` on a unit's local shard ``(S,)``
and execute the core's interval plans (``ragged.transfers`` between ``ragged_holdings`` of the tensor's
``RaggedShard`` and a one-hot / replicated placement) with static-size collectives only:

- to every device: one ``all_gather`` of the static window that covers every device's piece, then static
  slices (the plan says which slice of which row goes where);
- to one device (Muon's NS device), and back from it: one ``ppermute`` per transfer between two devices
  (static size, a single source/destination pair), plus local copies; ``ragged_all_to_all`` would batch
  these where a backend has it, but it is not implemented on CPU;
- to row blocks on some devices (``gather_rows`` / ``scatter_rows``, a ``RaggedShard`` over dim 0: split
  Newton-Schulz): the same, with the core's plan to that placement.

Offsets come from the Layout (the tensor's pieces) and the plan; nothing is recomputed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ragged
from ragged import Layout, RaggedShard, Transfer


def _pieces(layout: Layout, name: str) -> dict[int, int]:
    """Device -> where tensor ``name``'s piece starts inside that device's shard."""
    return {rank: p.local_offset for rank in range(layout.world_size)
            for p in layout.local_pieces(rank) if p.name == name}


def _plan(layout: Layout, name: str, target: RaggedShard | None, *, gather: bool) -> tuple[Transfer, ...]:
    """The core's transfers between the tensor's FSDP pieces and ``target`` (``None``: replicated)."""
    slot = layout.slot(name)
    ragged_ = ragged.ragged_holdings(layout.placement(name), slot.shape, name)
    if target is None:
        other = ragged.replicate_holdings(slot.numel, layout.world_size)
    else:
        other = ragged.ragged_holdings(target, slot.shape, name)
    return ragged.transfers(ragged_, other) if gather else ragged.transfers(other, ragged_)


def _execute(plan: tuple[Transfer, ...], src: jax.Array, dst: jax.Array, src_base: dict[int, int],
             dst_base: dict[int, int], axis: str) -> jax.Array:
    """Run ``plan``: each transfer is a static slice, a ``ppermute`` if it crosses devices, a masked write."""
    rank = lax.axis_index(axis)
    for t in plan:
        a = src_base.get(t.src, 0) + t.src_offset
        part = src[a:a + t.length]
        if t.src != t.dst:
            part = lax.ppermute(part, axis, [(t.src, t.dst)])
        b = dst_base.get(t.dst, 0) + t.dst_offset
        dst = jnp.where(rank == t.dst, dst.at[b:b + t.length].set(part), dst)  # only the receiver writes
    return dst


def _check(local: jax.Array, layout: Layout, name: str, device: int | None) -> None:
    layout.slot(name)  # KeyError naming the tensor and the unit
    if local.shape != (layout.shard_size,):
        raise ValueError(f"{name}: local shard has shape {local.shape}, unit {layout.name!r} has "
                         f"({layout.shard_size},) per device (call inside shard_map on the unit's shard)")
    if device is not None and not 0 <= device < layout.world_size:
        raise ValueError(f"{name}: device {device} is outside the {layout.world_size} devices")


def gather_tensor(local: jax.Array, layout: Layout, name: str, axis: str, *,
                  device: int | None = None) -> jax.Array:
    """Tensor ``name`` whole, from its pieces in the unit's local shards (inside ``shard_map``).

    Args:
        local: this device's shard of the unit buffer, ``(S,)``.
        layout: the unit's Layout; name: the tensor's FQN; axis: the mesh axis the unit is sharded over.
        device: the device (its index along ``axis``) that receives the tensor; ``None`` gives it to every
            device.

    Returns:
        The tensor with its shape: correct on ``device`` (zeros on the other devices), or on every device.

    Raises:
        KeyError: ``name`` is not in the unit. ValueError: a local shard of the wrong size or a bad device.
    """
    _check(local, layout, name, device)
    slot, pieces = layout.slot(name), _pieces(layout, name)
    if device is not None:
        flat = jnp.zeros(slot.numel, local.dtype)
        plan = _plan(layout, name, RaggedShard.whole_on(device, layout.world_size), gather=True)
        flat = _execute(plan, local, flat, pieces, {}, axis)
        return flat.reshape(slot.shape)
    plan = [t for t in _plan(layout, name, None, gather=True) if t.dst == 0]  # every device gets the same
    lo = min(pieces[t.src] + t.src_offset for t in plan)
    hi = max(pieces[t.src] + t.src_offset + t.length for t in plan)
    rows = lax.all_gather(local[lo:hi], axis)  # (W, hi - lo): the window that covers every piece
    starts = [(t, pieces[t.src] + t.src_offset - lo) for t in sorted(plan, key=lambda t: t.dst_offset)]
    parts = [rows[t.src, a:a + t.length] for t, a in starts]
    return jnp.concatenate(parts).reshape(slot.shape)


def scatter_tensor(full: jax.Array, local: jax.Array, layout: Layout, name: str, axis: str, *,
                   device: int | None = None) -> jax.Array:
    """Write the whole tensor ``full`` back into each device's piece of ``local`` (inside ``shard_map``).

    Args:
        full: the tensor, read on ``device`` only (or on every device when ``device`` is None: no
            communication).
        local: this device's shard of the unit buffer ``(S,)``; everything outside the piece is kept.

    Returns:
        ``local`` with tensor ``name``'s piece replaced.

    Raises:
        KeyError / ValueError: as ``gather_tensor``, or ``full`` without the tensor's shape.
    """
    _check(local, layout, name, device)
    slot = layout.slot(name)
    if tuple(full.shape) != slot.shape:
        raise ValueError(f"{name}: full tensor has shape {tuple(full.shape)}, the layout has {slot.shape}")
    plan = _plan(layout, name, None if device is None else RaggedShard.whole_on(device, layout.world_size),
                 gather=False)
    return _execute(plan, full.reshape(-1).astype(local.dtype), local, {}, _pieces(layout, name), axis)


def _rows_shape(layout: Layout, name: str, rows: RaggedShard) -> tuple[int, ...]:
    """A device's row block under ``rows`` (static): the most rows a device gets, the tensor's other dims."""
    shape = layout.slot(name).shape
    if rows.dims != (0,) or rows.world_size != layout.world_size:
        raise ValueError(f"{name}: row blocks need a RaggedShard over dims (0,) on {layout.world_size} "
                         f"devices, got dims={rows.dims} on {rows.world_size}")
    rows.validate(shape, name)
    return (max(rows.local_units) * shape[0] // sum(rows.local_units), *shape[1:])


def gather_rows(local: jax.Array, layout: Layout, name: str, axis: str, rows: RaggedShard) -> jax.Array:
    """This device's rows of tensor ``name`` under ``rows`` (a ``RaggedShard`` over dim 0), from the
    unit's local shards (inside ``shard_map``): as many rows as the device that gets the most, this
    device's own first, zeros after them (all zeros where it holds none).

    Raises:
        KeyError / ValueError: as ``gather_tensor``, or ``rows`` that is not a row placement of the tensor.
    """
    _check(local, layout, name, None)
    shape = _rows_shape(layout, name, rows)
    flat = jnp.zeros(int(np.prod(shape)), local.dtype)
    flat = _execute(_plan(layout, name, rows, gather=True), local, flat, _pieces(layout, name), {}, axis)
    return flat.reshape(shape)


def scatter_rows(block: jax.Array, local: jax.Array, layout: Layout, name: str, axis: str,
                 rows: RaggedShard) -> jax.Array:
    """The inverse of ``gather_rows``: each device's row block (as it returns it) back into the pieces of
    tensor ``name`` in ``local``; everything outside the pieces is kept."""
    _check(local, layout, name, None)
    shape = _rows_shape(layout, name, rows)
    if tuple(block.shape) != shape:
        raise ValueError(f"{name}: row block has shape {tuple(block.shape)}, the placement gives {shape}")
    plan = _plan(layout, name, rows, gather=False)
    return _execute(plan, block.reshape(-1).astype(local.dtype), local, {}, _pieces(layout, name), axis)
