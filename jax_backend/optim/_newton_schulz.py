"""Newton-Schulz orthogonalization: on one device, or split over a group of devices inside ``shard_map``.

The split runs ``ragged.muon.split_newton_schulz_reference``'s scheme (``ragged/muon/_split.py``): on the wide
orientation ``X`` (``m x n``, ``m <= n``) member ``i`` of the group (members in sorted device order) holds
the column block ``X_i = X[:, i n/g:(i+1) n/g]``; the squared norm is one all-reduce; each step all-reduces
``A = sum_i X_i X_i^T`` (as a reduce-scatter of row blocks, then an all-gather), member ``i`` computes the
row block ``B_i = b A_i + c A_i A``, the ``B_i`` are all-gathered and ``X_i <- a X_i + B X_i``.

The group's collectives are rings of ``lax.ppermute`` over its members (a partial permutation of the mesh
axis: the other devices send nothing and receive zeros). ``psum`` / ``all_gather`` with
``axis_index_groups`` would need groups that partition the whole axis, and are not supported by every
backend. Sums run in member order, so every member gets the same bits of ``A``. The members' work runs
under ``lax.cond`` (the other devices skip it); the collectives stay outside, on every device (as the
whole-matrix NS devices' ``ppermute``s: a device outside gets a zero buffer of each message's size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ragged
import ragged.muon


def _matmul(p: jax.Array, q: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """As torch computes in bf16: products accumulate in fp32, the result is rounded to ``dtype``."""
    return jnp.matmul(p, q, preferred_element_type=jnp.float32).astype(dtype)


def _times(k: float, v: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``k * v`` with the coefficient in fp32 (a Python float times a bf16 array would first round 3.4445
    to 3.4375), rounded to ``dtype``."""
    return (jnp.float32(k) * v.astype(jnp.float32)).astype(dtype)


def newton_schulz(g: jax.Array, steps: int = ragged.muon.NS_STEPS, eps: float = 1e-7,
                  dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``U p^steps(S / ||G||_F) V^T`` with the quintic ``p`` of ``ragged.muon.NS_COEFFS``, computed in
    ``dtype``.

    Returns fp32. ``dtype=jnp.bfloat16`` halves the matmul cost on accelerators; its relative Frobenius
    error against fp32 is a few percent (tested < 5%, docs/optimizers.md), as on the torch side.
    """
    a, b, c = ragged.muon.NS_COEFFS
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
    """The members of a split group, as seen from this device inside ``shard_map``.

    ``send_all`` (all-gather) and ``send_blocks`` (all-to-all, and the first half of a reduce-scatter) run
    a collective's ``g - 1`` ring shifts (every device runs them: the others send nothing and get zeros);
    what arrived is put in member order (``in_order``) inside the next ``on_members``, so the other devices
    skip that work too.
    """

    def __init__(self, devices: Sequence[int], world_size: int, axis: str):
        self.devices, self.size, self.axis = tuple(devices), len(devices), axis
        rank = lax.axis_index(axis)
        position = np.zeros(world_size, np.int32)  # 0 on the other devices: they only ever hold zeros
        position[list(self.devices)] = np.arange(self.size)
        self.pos = jnp.asarray(position)[rank]
        self.member = jnp.asarray(np.isin(np.arange(world_size), self.devices))[rank]

    def _receive(self, outgoing: Callable[[int], jax.Array]) -> list[jax.Array]:
        """Each member sends ``outgoing(s)`` to the member ``s`` places after it in the ring, for
        ``s = 1 .. g-1``: entry ``s - 1`` is what the member ``s`` places before this device sent."""
        rings = [[(self.devices[i], self.devices[(i + s) % self.size]) for i in range(self.size)]
                 for s in range(1, self.size)]
        return [lax.ppermute(outgoing(s), self.axis, ring) for s, ring in enumerate(rings, start=1)]

    def send_all(self, v: jax.Array) -> list[jax.Array]:
        """All-gather: ``v`` to every other member (``in_order(v, received)`` is every member's)."""
        return self._receive(lambda s: v)

    def send_blocks(self, blocks: jax.Array) -> list[jax.Array]:
        """All-to-all: ``blocks[j]`` to member ``j`` (``in_order(block(blocks, 0), received)``)."""
        return self._receive(lambda s: self.block(blocks, s))

    def in_order(self, own: jax.Array, received: Sequence[jax.Array]) -> jax.Array:
        """``(g, ...)``: what each member sent this device (``own`` from itself), in member order."""
        out = lax.dynamic_update_index_in_dim(jnp.zeros((self.size, *own.shape), own.dtype), own, self.pos, 0)
        for s, got in enumerate(received, start=1):
            out = lax.dynamic_update_index_in_dim(out, got, (self.pos - s) % self.size, 0)
        return out

    def block(self, blocks: jax.Array, s: int) -> jax.Array:
        """``blocks[(pos + s) % g]``: the block for the member ``s`` places after this device."""
        return lax.dynamic_index_in_dim(blocks, (self.pos + s) % self.size, 0, keepdims=False)

    def exchange(self, x: jax.Array, split: int, join: int) -> jax.Array:
        """Cut ``x`` in ``g`` blocks along ``split``, send block ``j`` to member ``j``, and join what this
        device got along ``join``, in member order (rows to columns: ``split=1, join=0``; back: ``0, 1``)."""
        blocks = jnp.stack(jnp.split(x, self.size, axis=split))
        got = self.send_blocks(blocks)
        return self.on_members(lambda b, *got: jnp.concatenate(list(self.in_order(self.block(b, 0), got)),
                                                               axis=join), blocks, *got)

    def on_members(self, fn: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
        """``fn(*args)`` on the members; zeros on the other devices, which skip the work."""
        shape = jax.eval_shape(fn, *args)
        return lax.cond(self.member, fn, lambda *_: jnp.zeros(shape.shape, shape.dtype), *args)


def split_newton_schulz(rows: jax.Array, shape: tuple[int, int], devices: Sequence[int], world_size: int,
                        axis: str, steps: int = ragged.muon.NS_STEPS, eps: float = 1e-7,
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
    a, b, c = ragged.muon.NS_COEFFS
    group = _Group(devices, world_size, axis)
    g, tall, m = group.size, shape[0] > shape[1], min(shape)
    x = rows.astype(dtype)
    if tall:
        x = x.T  # a row block of the tall matrix is a column block of its wide transpose
    else:  # rows (r/g, c) -> columns (r, c/g): member j gets every member's j-th column sub-block
        x = group.exchange(x, split=1, join=0)
    squares = group.on_members(lambda v: jnp.sum(jnp.square(v.astype(jnp.float32))), x)
    x = group.on_members(
        lambda v, own, *got: v / (jnp.sqrt(jnp.sum(group.in_order(own, got))).astype(dtype) + eps),
        x, squares, *group.send_all(squares))

    def gram_rows(p: jax.Array, *got: jax.Array) -> jax.Array:  # this member's rows of sum_i X_i X_i^T
        return jnp.sum(group.in_order(group.block(p, 0), got), axis=0).astype(dtype)

    def poly_rows(rows: jax.Array, *got: jax.Array) -> jax.Array:  # B_i = b A_i + c A_i A
        whole = group.in_order(rows, got).reshape(m, m)
        return _times(b, rows, dtype) + _times(c, _matmul(rows, whole, dtype), dtype)

    def update(v: jax.Array, rows: jax.Array, *got: jax.Array) -> jax.Array:  # X_i <- a X_i + B X_i
        return _times(a, v, dtype) + _matmul(group.in_order(rows, got).reshape(m, m), v, dtype)

    for _ in range(steps):
        # A in fp32, summed in member order: a reduce-scatter of its row blocks, then an all-gather (every
        # member gets the same bits); B all-gathered.
        partial = group.on_members(lambda v: _matmul(v, v.T, jnp.float32), x).reshape(g, m // g, m)
        gram = group.on_members(gram_rows, partial, *group.send_blocks(partial))
        poly = group.on_members(poly_rows, gram, *group.send_all(gram))
        x = group.on_members(update, x, poly, *group.send_all(poly))
    return (x.T if tall else group.exchange(x, split=0, join=1)).astype(jnp.float32)
