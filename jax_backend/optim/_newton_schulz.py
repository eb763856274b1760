"""Newton-Schulz orthogonalization: on one device, or split over a group of devices inside ``shard_map``.

The split runs ``ragged.split_newton_schulz_reference``'s scheme (``ragged/_muon_split.py``): on the wide
orientation ``X`` (``m x n``, ``m <= n``) member ``i`` of the group (members in sorted device order) holds
the column block ``X_i = X[:, i n/g:(i+1) n/g]``; the squared norm is one all-reduce; each step all-reduces
``A = sum_i X_i X_i^T`` (as a reduce-scatter of row blocks, then an all-gather), member ``i`` computes the
row block ``B_i = b A_i + c A_i A``, the ``B_i`` are all-gathered and ``X_i <- a X_i + B X_i``.

The group's collectives are rings of ``lax.ppermute`` over its members (a partial permutation of the mesh
axis: the other devices send nothing and receive zeros). ``psum`` / ``all_gather`` with
``axis_index_groups`` would need groups that partition the whole axis, and are not supported by every
backend. Sums run in member order, so every member gets the same bits of ``A``. The members' matmuls run
under ``lax.cond`` (the other devices skip them); the collectives stay outside, on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ragged


def _matmul(p: jax.Array, q: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """As torch computes in bf16: products accumulate in fp32, the result is rounded to ``dtype``."""
    return jnp.matmul(p, q, preferred_element_type=jnp.float32).astype(dtype)


def _times(k: float, v: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``k * v`` with the coefficient in fp32 (a Python float times a bf16 array would first round 3.4445
    to 3.4375), rounded to ``dtype``."""
    return (jnp.float32(k) * v.astype(jnp.float32)).astype(dtype)


def newton_schulz(g: jax.Array, steps: int = ragged.NS_STEPS, eps: float = 1e-7,
                  dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``U p^steps(S / ||G||_F) V^T`` with the quintic ``p`` of ``ragged.NS_COEFFS``, computed in ``dtype``.

    Returns fp32. ``dtype=jnp.bfloat16`` halves the matmul cost on accelerators; its relative Frobenius
    error against fp32 is a few percent (tested < 5%, docs/optimizers.md), as on the torch side.
    """
    a, b, c = ragged.NS_COEFFS
    x = g.astype(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (jnp.linalg.norm(x.astype(jnp.float32)).astype(dtype) + eps)
    for _ in range(steps):
        gram = _matmul(x, x.T, dtype)
        poly = _times(b, gram, dtype) + _times(c, _matmul(gram, gram, dtype), dtype)
        x = _times(a, x, dtype) + _matmul(poly, x, dtype)
    return (x.T if tall else x).astype(jnp.float32)


class _Group:
    """The members of a split group, as seen from this device inside ``shard_map``."""

    def __init__(self, devices: Sequence[int], world_size: int, axis: str):
        self.devices, self.size, self.axis = tuple(devices), len(devices), axis
        rank = lax.axis_index(axis)
        position = np.zeros(world_size, np.int32)  # 0 on the other devices: they only ever hold zeros
        position[list(self.devices)] = np.arange(self.size)
        self.pos = jnp.asarray(position)[rank]
        self.member = jnp.asarray(np.isin(np.arange(world_size), self.devices))[rank]

    def from_members(self, outgoing: Callable[[int], jax.Array]) -> jax.Array:
        """``(g, ...)``: entry ``i`` is what member ``i`` sent to this device, where each member sends
        ``outgoing(s)`` to the member ``s`` places after it in the ring (``outgoing(0)`` it keeps)."""
        own = outgoing(0)
        out = lax.dynamic_update_index_in_dim(jnp.zeros((self.size, *own.shape), own.dtype), own, self.pos, 0)
        for s in range(1, self.size):
            ring = [(self.devices[i], self.devices[(i + s) % self.size]) for i in range(self.size)]
            got = lax.ppermute(outgoing(s), self.axis, ring)
            out = lax.dynamic_update_index_in_dim(out, got, (self.pos - s) % self.size, 0)
        return out

    def all_gather(self, v: jax.Array) -> jax.Array:
        """``(g, ...)``: every member's ``v``, in member order."""
        return self.from_members(lambda s: v)

    def all_to_all(self, blocks: jax.Array) -> jax.Array:
        """``(g, ...)``: entry ``i`` is member ``i``'s ``blocks[pos]`` (``blocks[j]`` goes to member j)."""
        return self.from_members(
            lambda s: lax.dynamic_index_in_dim(blocks, (self.pos + s) % self.size, 0, keepdims=False))

    def exchange(self, x: jax.Array, split: int, join: int) -> jax.Array:
        """Cut ``x`` in ``g`` blocks along ``split``, send block ``j`` to member ``j``, and join what this
        device got along ``join``, in member order (rows to columns: ``split=1, join=0``; back: ``0, 1``)."""
        got = self.all_to_all(jnp.stack(jnp.split(x, self.size, axis=split)))
        return jnp.concatenate(list(got), axis=join)

    def on_members(self, fn: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
        """``fn(*args)`` on the members; zeros on the other devices, which skip the work."""
        shape = jax.eval_shape(fn, *args)
        return lax.cond(self.member, fn, lambda *_: jnp.zeros(shape.shape, shape.dtype), *args)


def split_newton_schulz(rows: jax.Array, shape: tuple[int, int], devices: Sequence[int], world_size: int,
                        axis: str, steps: int = ragged.NS_STEPS, eps: float = 1e-7,
                        dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``newton_schulz`` of a ``shape`` matrix over the group ``devices`` (inside ``shard_map``).

    Args:
        rows: this device's row block of the matrix, ``(rows / g, cols)``: member ``i`` (sorted order)
            holds rows ``[i rows/g, (i+1) rows/g)``; ignored on the other devices.
        shape: the matrix's shape; ``g = len(devices)`` divides both sides (``muon_plan`` checks).
        devices: the group, sorted; world_size: the devices on ``axis``.
        steps, eps, dtype: as ``newton_schulz``.

    Returns:
        fp32, this device's row block of the result (zeros on the devices outside the group).
    """
    a, b, c = ragged.NS_COEFFS
    group = _Group(devices, world_size, axis)
    g, tall = group.size, shape[0] > shape[1]
    m = min(shape)
    x = rows.astype(dtype)
    if tall:
        x = x.T  # a row block of the tall matrix is a column block of its wide transpose
    else:  # rows (r/g, c) -> columns (r, c/g): member j gets every member's j-th column sub-block
        x = group.exchange(x, split=1, join=0)
    squares = group.on_members(lambda v: jnp.sum(jnp.square(v.astype(jnp.float32))), x)
    x = x / (jnp.sqrt(jnp.sum(group.all_gather(squares))).astype(dtype) + eps)
    for _ in range(steps):
        # A = sum_i X_i X_i^T, summed in fp32 and in member order: a reduce-scatter of its row blocks ...
        partial = group.on_members(lambda v: jnp.matmul(v, v.T, preferred_element_type=jnp.float32), x)
        own_rows = jnp.sum(group.all_to_all(partial.reshape(g, m // g, m)), axis=0).astype(dtype)
        gram = group.all_gather(own_rows).reshape(m, m)  # ... then an all-gather
        poly_rows = group.on_members(
            lambda r, full: _times(b, r, dtype) + _times(c, _matmul(r, full, dtype), dtype), own_rows, gram)
        poly = group.all_gather(poly_rows).reshape(m, m)
        x = group.on_members(lambda v, p: _times(a, v, dtype) + _matmul(p, v, dtype), x, poly)
    return (x.T if tall else group.exchange(x, split=0, join=1)).astype(jnp.float32)
