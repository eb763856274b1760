"""Muon as optax transformations, on whole matrices or distributed over FSDP unit shards (Algorithm 2).

``scale_by_muon`` keeps a momentum buffer and replaces each matrix update by its Newton-Schulz
orthogonalization (5 quintic steps on ``X / ||X||_F``, coefficients ``ragged.muon.NS_COEFFS``, transposed
when rows > cols), scaled by ``sqrt(max(1, rows / cols))``; a 3-D stack ``[E, m, n]`` (fused experts) is
``E`` matrices, each orthogonalized on its own. ``muon`` chains it with weight decay and the learning
rate for the matrices of ``ragged.muon.muon_matrices`` (2-D weights and stacks; not biases, whatever their
shape) and uses AdamW for the others.

Distributed (``plan=muon_plan(layouts, axis)``): the leaves are FSDP unit shards ``(S,)`` inside
``shard_map``. Momentum runs on the local shard; each matrix is gathered to its load-balanced NS device
(``ragged.muon.assign_ns_devices``) with ``gather_tensor(..., device=r)``, orthogonalized under ``lax.cond``
on that device only, and written back to every device's piece with ``scatter_tensor(..., device=r)``; a
stack's matrices are gathered one by one (``ragged.muon.matrix_layout`` names them ``name[e]``). With
``muon_plan(..., max_imbalance=)`` the matrices that stop the balance are split over groups of devices
(``ragged.muon.assign_groups``): each member gets a row block (``gather_rows``) and ``split_newton_schulz``
runs the core's split scheme. The plan's windows (``in_flight`` NS-device buckets) issue their gathers before
their Newton-Schulz and scatters after, so XLA can overlap them. Elements of tensors that are not
matrices get AdamW through a static per-device mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import ragged
import ragged.muon
from jax_backend._names import fqn
from jax_backend._redistribute import gather_rows, gather_tensor, scatter_rows, scatter_tensor
from jax_backend.optim._adam8bit import piece_of
from jax_backend.optim._newton_schulz import newton_schulz, split_newton_schulz
from ragged import Layout, RaggedShard


@dataclass(frozen=True)
class MuonMatrix:
    """One matrix of a unit (a 2-D tensor, or ``name[e]`` of a stack) and the devices that orthogonalize it:
    its NS device, or a split group."""

    name: str
    shape: tuple[int, int]
    group: tuple[int, ...]

    @property
    def ns_device(self) -> int:
        """The one device of a whole-matrix Newton-Schulz."""
        if len(self.group) != 1:
            raise ValueError(f"{self.name}: Newton-Schulz is split over devices {self.group}, it has no NS "
                             "device")
        return self.group[0]

    def rows(self, world_size: int) -> RaggedShard:
        """Where a split group holds the matrix: member ``i`` (sorted) rows ``[i r/g, (i+1) r/g)``."""
        units = self.shape[0] // len(self.group)
        return RaggedShard((0,), tuple(units if d in self.group else 0 for d in range(world_size)))


@dataclass(frozen=True)
class MuonPlan:
    """The distributed Muon plan of a model's units: matrices with NS devices, and which elements they cover.

    ``layouts`` are the units' matrix layouts (``ragged.muon.matrix_layout``: the same buffers, a stack's
    matrices as tensors of their own, no other tensor).

    ``pieces[unit]`` is ``(offset, length)``: per device, where its pieces of 2-D tensors lie in its shard
    (``(world_size, pieces)`` int32 each, ascending, missing pieces at ``S`` with length 0); ``mask`` turns
    a device's row into a per-element mask inside ``shard_map``.
    """

    layouts: tuple[Layout, ...]
    axis: str
    matrices: dict[str, tuple[MuonMatrix, ...]]
    pieces: dict[str, tuple[np.ndarray, np.ndarray]]
    in_flight: int | None = 2

    def windows(self) -> tuple[tuple[tuple[str, MuonMatrix], ...], ...]:
        """The schedule: ``(unit, matrix)`` groups whose gathers are issued together, then their
        Newton-Schulz, then their scatters; ``in_flight`` NS-device buckets per group
        (``ragged.muon.ns_device_buckets``), or one matrix per group when ``in_flight`` is ``None``
        (sequential). Matrices split over a group of devices come after the whole ones, ``in_flight`` per
        window (one when sequential)."""
        found = [(unit, m) for unit, ms in self.matrices.items() for m in ms]
        whole = [f for f in found if len(f[1].group) == 1]
        split = [f for f in found if len(f[1].group) > 1]
        if self.in_flight is None:
            return tuple((f,) for f in whole + split)
        buckets = ragged.muon.ns_device_buckets([m.ns_device for _, m in whole])
        return (tuple(tuple(whole[i] for b in buckets[j:j + self.in_flight] for i in b)
                      for j in range(0, len(buckets), self.in_flight))
                + tuple(tuple(split[j:j + self.in_flight]) for j in range(0, len(split), self.in_flight)))

    @property
    def newton_schulz_load(self) -> np.ndarray:
        """Newton-Schulz matmul FLOPs each device runs per step (``ragged.muon.group_load`` of the groups):
        ``(world_size,)`` int64, ``max / mean`` is the step's load imbalance."""
        world = self.layouts[0].world_size if self.layouts else 1
        found = [m for ms in self.matrices.values() for m in ms]
        return ragged.muon.group_load([m.shape for m in found], [m.group for m in found], world)

    def mask(self, unit: str) -> jax.Array:
        """True where this device's shard element of ``unit`` belongs to a matrix (inside shard_map)."""
        offset, length = (jnp.asarray(a)[lax.axis_index(self.axis)] for a in self.pieces[unit])
        size = next(lay.shard_size for lay in self.layouts if lay.name == unit)
        return piece_of(offset, length, size)[2]


def muon_plan(layouts: Sequence[Layout], axis: str, *, in_flight: int | None = 2,
              max_imbalance: float | None = None) -> MuonPlan:
    """Who orthogonalizes every matrix of ``layouts`` (``ragged.muon.muon_matrices``), its pieces, and the
    schedule.

    Args:
        layouts: the units; axis: the mesh axis they are sharded over.
        in_flight: NS-device buckets gathered together and overlapped by XLA with their Newton-Schulz
            (``None``: one matrix after another; both give the same bits).
        max_imbalance: ``None``: one NS device per matrix, greedy largest-first over Newton-Schulz FLOPs
            (``ragged.muon.assign_ns_devices``). A target ``max / mean`` of per-device FLOPs: matrices whose
            cost stops it are split over groups of devices (``ragged.muon.assign_groups``); the others keep
            one NS device. Splitting balances the FLOPs (llama3-8b's layers at 256 devices: 1.057 instead of
            2.11) but adds collectives inside each group at every Newton-Schulz step
            (``split_newton_schulz_bytes``).

    Raises:
        ValueError: ``in_flight < 1``, ``max_imbalance < 1``, or a split group that does not divide both
            sides of its matrix (before any collective is traced).
    """
    if in_flight is not None and in_flight < 1:
        raise ValueError(f"muon_plan: in_flight={in_flight} must be >= 1 (or None for sequential)")
    layouts = tuple(ragged.muon.matrix_layout(lay) for lay in layouts)
    world = layouts[0].world_size if layouts else 1
    found = [(lay.name, t) for lay in layouts for t in lay.tensors]
    groups = ragged.muon.assign_groups([t.shape for _, t in found], world, max_imbalance=max_imbalance)
    for (unit, t), group in zip(found, groups):
        if t.shape[0] % len(group) or t.shape[1] % len(group):
            raise ValueError(f"muon_plan: {t.name} of unit {unit!r} has shape {t.shape}; a split "
                             f"Newton-Schulz group of {len(group)} devices must divide both sides")
    matrices = {lay.name: tuple(MuonMatrix(t.name, t.shape, g) for (u, t), g in zip(found, groups)
                                if u == lay.name) for lay in layouts}
    pieces = {}
    for lay in layouts:
        names = {m.name for m in matrices[lay.name]}
        rows = [[(p.local_offset, p.stop - p.start) for p in lay.local_pieces(d) if p.name in names]
                for d in range(lay.world_size)]
        most = max(1, max(len(r) for r in rows))
        table = np.array([r + [(lay.shard_size, 0)] * (most - len(r)) for r in rows], np.int32)
        pieces[lay.name] = (table[:, :, 0], table[:, :, 1])
    return MuonPlan(layouts, axis, matrices, pieces, in_flight)


class ScaleByMuonState(NamedTuple):
    """State of ``scale_by_muon``: the momentum buffer, like the params."""

    momentum: Any


def _orthogonalize_shards(updates: dict[str, jax.Array], plan: MuonPlan,
                          ns_dtype: jnp.dtype) -> dict[str, jax.Array]:
    """Newton-Schulz of every matrix of the unit shards, each on its NS device (or split over its group);
    other elements become 0.

    One window at a time (``plan.windows()``): all its gathers, then its Newton-Schulz (under
    ``lax.cond(ns_device)``, or ``split_newton_schulz`` on row blocks), then its scatters, inside one jitted
    step so XLA can overlap them. The next window's gathers read ``updates`` minus an exact zero computed from
    this window's scatters: a data dependency that keeps them behind it, so a device holds about one window
    of whole matrices (the subtraction fuses into the gathers' slices: no copy of the shard).
    (``lax.optimization_barrier`` did not: XLA:CPU drops it before scheduling, and then issued every
    window's gathers first, so the sequential schedule ran as one window and temp memory grew with the
    model.)
    """
    by_unit = {lay.name: lay for lay in plan.layouts}
    world = plan.layouts[0].world_size if plan.layouts else 1
    outs = {k: jnp.zeros_like(u) for k, u in updates.items()}
    rank = lax.axis_index(plan.axis)
    done = jnp.zeros((), jnp.float32)

    def gather(u: str, m: MuonMatrix) -> jax.Array:
        if len(m.group) > 1:  # this device's row block
            return gather_rows(updates[u] - done, by_unit[u], m.name, plan.axis, m.rows(world))
        return gather_tensor(updates[u] - done, by_unit[u], m.name, plan.axis, device=m.ns_device)

    def orthogonalize(m: MuonMatrix, w: jax.Array) -> jax.Array:
        if len(m.group) > 1:
            return split_newton_schulz(w, m.shape, m.group, world, plan.axis, dtype=ns_dtype)
        return lax.cond(rank == m.ns_device, lambda w: newton_schulz(w, dtype=ns_dtype), jnp.zeros_like, w)

    def scatter(u: str, m: MuonMatrix, o: jax.Array) -> jax.Array:
        if len(m.group) > 1:
            return scatter_rows(o, outs[u], by_unit[u], m.name, plan.axis, m.rows(world))
        return scatter_tensor(o, outs[u], by_unit[u], m.name, plan.axis, device=m.ns_device)

    for window in plan.windows():
        held = [gather(u, m) for u, m in window]
        orthos = [orthogonalize(m, w) * ragged.muon.muon_scale(m.shape) for (_, m), w in zip(window, held)]
        for (u, m), o in zip(window, orthos):
            outs[u] = scatter(u, m, o)
        # ``x != x`` is False for every value but NaN, so ``done`` is 0.0 exactly and ``v - 0.0`` is ``v``
        # (negative zeros and NaN included); XLA cannot fold it, since it cannot prove the product 0.
        scattered = [outs[u][:1] for u in dict.fromkeys(u for u, _ in window)]
        done = sum(jnp.any(o != o).astype(jnp.float32) for o in scattered) * 0.0
    return outs


def scale_by_muon(momentum: float = 0.95, nesterov: bool = True, *, plan: MuonPlan | None = None,
                  ns_dtype: jnp.dtype = jnp.float32) -> optax.GradientTransformation:
    """Momentum, then Newton-Schulz orthogonalization of every matrix, scaled by ``sqrt(max(1, rows/cols))``.

    Args:
        momentum: the momentum coefficient; nesterov: use ``lerp(g, buf, momentum)`` as the update.
        plan: ``None`` when every leaf is a whole matrix or 3-D stack of matrices; for FSDP unit shards
            inside ``shard_map``, ``muon_plan(layouts, axis)`` (elements of tensors that are not matrices
            then get a zero update).
        ns_dtype: the dtype Newton-Schulz computes in (``jnp.bfloat16`` for the fast path; the momentum,
            the gathers and scatters stay fp32).

    Returns:
        An ``optax.GradientTransformation`` whose state is a ``ScaleByMuonState``.

    Raises:
        ValueError: without a plan, a leaf that is neither 2-D nor 3-D (naming its path).
    """

    def init_fn(params: Any) -> ScaleByMuonState:
        return ScaleByMuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update_fn(updates: Any, state: ScaleByMuonState, params: Any = None) -> tuple:
        del params
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        buf = jax.tree.map(lambda b, g: b + (1 - momentum) * (g - b), state.momentum, grads)
        direction = jax.tree.map(lambda g, b: g + momentum * (b - g), grads, buf) if nesterov else buf
        if plan is None:
            _check_matrices(updates)
            ortho = jax.tree.map(lambda u: _orthogonalize_whole(u, ns_dtype), direction)
        else:
            ortho = _orthogonalize_shards(direction, plan, ns_dtype)
        return jax.tree.map(lambda o, g: o.astype(g.dtype), ortho, updates), ScaleByMuonState(buf)

    return optax.GradientTransformation(init_fn, update_fn)


def _orthogonalize_whole(u: jax.Array, ns_dtype: jnp.dtype) -> jax.Array:
    """Newton-Schulz of a whole matrix, or of each matrix of a stack ``[E, m, n]``, with the shape scale."""
    ns = jax.vmap(lambda m: newton_schulz(m, dtype=ns_dtype)) if u.ndim == 3 else (
        lambda m: newton_schulz(m, dtype=ns_dtype))
    return ns(u) * ragged.muon.muon_scale(u.shape[-2:])


def _check_matrices(tree: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf.ndim not in (2, 3):
            raise ValueError(
                f"scale_by_muon: leaf {jax.tree_util.keystr(path)} has shape {leaf.shape}; Muon "
                "orthogonalizes 2-D matrices and 3-D stacks of them only (use `muon`, which gives other "
                "leaves AdamW)"
            )


def _select(mask_of: Any, if_true: optax.GradientTransformation,
            if_false: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run both transforms on every leaf and keep ``if_true``'s update where ``mask_of(key)`` is True."""

    def init_fn(params: Any) -> tuple:
        return if_true.init(params), if_false.init(params)

    def update_fn(updates: Any, state: tuple, params: Any = None) -> tuple:
        a, sa = if_true.update(updates, state[0], params)
        b, sb = if_false.update(updates, state[1], params)
        return {k: jnp.where(mask_of(k), a[k], b[k]) for k in updates}, (sa, sb)

    return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate: optax.ScalarOrSchedule, momentum: float = 0.95, nesterov: bool = True,
         weight_decay: float = 0.0, adamw_learning_rate: optax.ScalarOrSchedule = 3e-4,
         adamw_b1: float = 0.9, adamw_b2: float = 0.95, adamw_eps: float = 1e-8, *,
         plan: MuonPlan | None = None, ns_dtype: jnp.dtype = jnp.float32) -> optax.GradientTransformation:
    """Muon for matrices, AdamW for the others; decoupled weight decay on both.

    Matrices are ``ragged.muon.muon_matrices``'s: 2-D weights and 3-D stacks (one matrix per expert), not
    biases (fused experts' ``[E, n]`` ones are vectors). Without ``plan`` the leaves are whole tensors and
    are split by that rule on their names (``optax.partition``). With ``plan`` (FSDP unit shards inside
    ``shard_map``) both run on every shard and a static per-device mask picks Muon's update for elements of
    matrices. ``ns_dtype``: as in ``scale_by_muon``.

    Example:
        >>> opt = muon(0.02, adamw_learning_rate=3e-4, plan=muon_plan(fsdp.layouts, fsdp.axis))
        >>> step = fsdp.train_step(jax_backend.on_shards(opt), loss_fn)

    References:
        Jordan et al., Muon (2024); veScale-FSDP Algorithm 2 (2026).
    """
    matrices = optax.chain(scale_by_muon(momentum, nesterov, plan=plan, ns_dtype=ns_dtype),
                           optax.add_decayed_weights(weight_decay),
                           optax.scale_by_learning_rate(learning_rate))
    adamw = optax.adamw(adamw_learning_rate, adamw_b1, adamw_b2, adamw_eps, weight_decay=weight_decay)
    if plan is None:
        partition = getattr(optax, "partition", None) or optax.multi_transform  # renamed in optax 0.2.4
        return partition({"muon": matrices, "adamw": adamw}, lambda params: jax.tree_util.tree_map_with_path(
            lambda path, p: "muon" if ragged.muon.muon_matrices(fqn(path), p.shape) else "adamw", params))
    return _select(plan.mask, matrices, adamw)
