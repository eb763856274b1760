"""The unit calls of one forward, inside ``shard_map``: gather a unit where it is used, free it after.

Every device holds, per unit, its contiguous shard of ``S`` elements. Where the model uses a unit,
``all_gather(shard, tiled=True)`` rebuilds its flat buffer (in the compute dtype) and static slices give
its parameters (``_buffers.unpack_unit``). The gather is a custom VJP whose backward is the unit's explicit
``psum_scatter(tiled=True)`` (in the reduce dtype), followed by a ``psum`` over the replica axis under HSDP,
so each device ends with the gradient of exactly its own shard.

Three ways to keep a unit for its backward (``Units.call``): kept gathered from the forward
(``reshard_after_forward=False``, FSDP2's option of that name); freed after the unit's forward
(``reshard_after_forward=True``): a ``jax.checkpoint`` whose policy saves every activation but the gathered
parameters and the elementwise arithmetic, so the backward re-gathers the unit and recomputes no dot,
convolution or reduction; or ``remat=True``, which keeps just the shard and the unit's input: the backward
gathers the unit again and recomputes its activations too (FSDP2's option with activation checkpointing
of every unit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_backend._buffers import LayoutMismatchError, unpack_unit
from jax_backend._tensor_parallel import TensorParallel, per_tensor_rank, unpack_tp_unit
from ragged import Layout


class UnitError(LayoutMismatchError):
    """A unit that matches nothing, nests in another, or reads a parameter of another unit."""


def refuse_non_float(shapes: Mapping[str, tuple[tuple[int, ...], Any]], how_to_fix: str) -> None:
    """Raise ``UnitError`` naming the first parameter (``{fqn: (shape, dtype)}``) that is not floating
    point: its gradient would be ``float0`` and no optimizer can step it."""
    for name, (shape, dtype) in shapes.items():
        if not jnp.issubdtype(dtype, jnp.floating):
            raise UnitError(f"parameter {name!r} (shape {shape}) has dtype {jnp.dtype(dtype)}: only floating "
                            f"point parameters can be trained; {how_to_fix}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the gathered parameters (compute) and of the gradient reduction; None keeps the master's.

    The master shards and the optimizer state stay in the buffers' dtype (fp32).
    """

    param_dtype: Any = None
    reduce_dtype: Any = None


class _Comm(NamedTuple):
    """Static arguments of the unit gather (hashable, so they can be ``nondiff_argnums``)."""

    axis: str | tuple[str, ...]
    replica_axis: str | None
    param_dtype: Any
    reduce_dtype: Any
    master_dtype: Any
    tp: TensorParallel | None = None  # with a tensor axis: buffers (T, W * S), dim 0 over it


def _all_gather(shard: jax.Array, comm: _Comm) -> jax.Array:
    def gather(x: jax.Array) -> jax.Array:
        return lax.all_gather(x.astype(comm.param_dtype), comm.axis, axis=x.ndim - 1, tiled=True)

    return gather(shard) if comm.tp is None else per_tensor_rank(gather, comm.tp.axis)(shard)


def _reduce_scatter(grad: jax.Array, comm: _Comm) -> jax.Array:
    """The transpose of the tiled all-gather: each device receives the sum of its own slice."""
    def reduce_scatter(g: jax.Array) -> jax.Array:
        shard_grad = lax.psum_scatter(g.astype(comm.reduce_dtype), comm.axis, scatter_dimension=g.ndim - 1,
                                      tiled=True)
        if comm.replica_axis is not None:
            shard_grad = lax.psum(shard_grad, comm.replica_axis)  # HSDP: reduce-scatter, then all-reduce
        return shard_grad.astype(comm.master_dtype)

    return reduce_scatter(grad) if comm.tp is None else per_tensor_rank(reduce_scatter, comm.tp.axis)(grad)


def _unpack(full: jax.Array, layout: Layout, comm: _Comm) -> dict[str, jax.Array]:
    """The gathered unit's parameters (full shapes; sharded over the tensor axis if there is one)."""
    return unpack_unit(full, layout) if comm.tp is None else unpack_tp_unit(full, layout, comm.tp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_unit(shard: jax.Array, comm: _Comm) -> jax.Array:
    """All-gather a unit's shard ``(S,)`` into its flat buffer ``(W * S,)`` in the compute dtype.

    Its VJP is the unit's reduce-scatter (then the replica all-reduce under HSDP), in the reduce dtype.
    """
    return _all_gather(shard, comm)


gather_unit.defvjp(lambda shard, comm: (_all_gather(shard, comm), None),
                   lambda comm, _, grad: (_reduce_scatter(grad, comm),))


def _depend_on(shard: jax.Array, grad: Any) -> jax.Array:
    """``shard`` plus a (signed) zero taken from ``grad``, NaN-safe: a re-gather of the shard in the backward
    then depends on the incoming gradient. Otherwise XLA sees the forward's identical all-gather and merges
    the two (XLA:CPU drops optimization barriers first), which would keep every unit unsharded from its
    forward to its backward."""
    inexact = [g for g in jax.tree.leaves(grad) if jnp.issubdtype(g.dtype, jnp.inexact)]
    if not inexact:  # nothing differentiable flows back (integer outputs): no gather to keep apart
        return shard
    first = inexact[0].ravel()[0]
    return shard + (jnp.where(jnp.isfinite(first), first, 0) * 0).astype(shard.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def run_resharded(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> Any:
    """``apply(unit params, h)`` on the gathered unit, keeping only ``(shard, h)`` for the backward.

    The backward gathers the unit again, runs the unit's VJP (recomputing its activations) and
    reduce-scatters: the unsharded buffer lives during this unit's forward and its backward only
    (``remat``).
    """
    return apply(_unpack(_all_gather(shard, comm), layout, comm), h)


def _resharded_fwd(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> tuple:
    return run_resharded(apply, layout, comm, shard, h), (shard, h)


def _resharded_bwd(apply: Callable, layout: Layout, comm: _Comm, res: tuple, grad: Any) -> tuple:
    shard, h = res
    _, vjp = jax.vjp(lambda full, x: apply(_unpack(full, layout, comm), x),
                     _all_gather(_depend_on(shard, grad), comm), h)
    full_grad, h_grad = vjp(grad)
    return _reduce_scatter(full_grad, comm), h_grad


run_resharded.defvjp(_resharded_fwd, _resharded_bwd)


_UNIT_SHARD = "ragged_fsdp_unit_shard"
# Saving these would keep a copy of the gathered parameters (a slice, a reshape, ``w.T``, a cast), so the
# backward recomputes them from the re-gathered unit; they move bytes and compute nothing (applied to an
# activation, the backward recomputes them from the saved input: a copy, no arithmetic).
_LAYOUT = frozenset({"all_gather", "slice", "reshape", "transpose", "convert_element_type", "squeeze",
                     "expand_dims", "broadcast_in_dim", "copy", "copy_p"})
# Elementwise arithmetic is recomputed too. Saved, XLA fuses it into the backward's kernels anyway, which then
# read the parameters they use (a norm's scale, a bias) from the forward's gathered unit and keep that whole
# buffer alive from the forward to the backward: every unit gathered twice over at the peak (measured on
# experiments/jax_vs_gspmd.py's four models: 1.1 to 3.3 MB less temporary memory recomputed). Dots,
# convolutions, reductions, collectives and random bits are saved: recomputing them would cost arithmetic
# or communication.
_ELEMENTWISE = frozenset(p.name for p in (
    lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.rem_p, lax.neg_p, lax.max_p, lax.min_p, lax.clamp_p,
    lax.select_n_p, lax.abs_p, lax.sign_p, lax.square_p, lax.integer_pow_p, lax.pow_p, lax.sqrt_p,
    lax.rsqrt_p, lax.cbrt_p, lax.exp_p, lax.exp2_p, lax.expm1_p, lax.log_p, lax.log1p_p, lax.tanh_p,
    lax.logistic_p, lax.erf_p, lax.sin_p, lax.cos_p, lax.floor_p, lax.ceil_p, lax.round_p, lax.is_finite_p,
    lax.reduce_precision_p, lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p, lax.and_p, lax.or_p,
    lax.not_p, lax.xor_p, lax.shift_left_p, lax.shift_right_logical_p, lax.shift_right_arithmetic_p))
_RECOMPUTED = _LAYOUT | _ELEMENTWISE


def _save_activations(prim: Any, *_: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy: save every value of the unit's forward but its shard's gather, the layout
    ops and the elementwise arithmetic above, so the backward re-gathers the unit and recomputes no dot,
    convolution, reduction or collective."""
    if prim.name == "name":
        return params["name"] != _UNIT_SHARD
    return prim.name not in _RECOMPUTED


def _residual_as_argument(vjp: Any, leaf: jax.Array) -> jax.tree_util.Partial:
    """``vjp`` (a pytree over its residuals) as ``f(new_leaf, grad)``: the residuals that are ``leaf`` (none
    when the backward needs no parameter, e.g. an embedding's) are replaced by ``new_leaf`` when it runs."""
    leaves, treedef = jax.tree_util.tree_flatten(vjp)
    # jax.vjp passes a primal input that the backward needs through as a residual, the same tracer. Were
    # that to change, nothing would be replaced: still correct, but XLA would merge the two gathers (the
    # compiled-program tests count them).
    where = {i for i, x in enumerate(leaves) if x is leaf}

    def call(*args: Any) -> Any:
        *rest, new_leaf, grad = args
        for i in sorted(where):
            rest.insert(i, new_leaf)
        return jax.tree_util.tree_unflatten(treedef, rest)(grad)

    return jax.tree_util.Partial(call, *(x for i, x in enumerate(leaves) if i not in where))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def run_keeping_activations(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> Any:
    """``apply(unit params, h)`` on the gathered unit, keeping its activations but not the gathered unit.

    The forward is ``jax.checkpoint`` of gather and ``apply`` with a policy that saves every value but the
    gather and the layout ops on the parameters (``_save_activations``), so the backward re-gathers the unit
    and runs the unit's VJP on the saved activations (FSDP2's ``reshard_after_forward=True``). This custom
    VJP around it hands that backward the shard as ``_depend_on(shard, grad)``: given the forward's shard,
    the two all-gathers would be identical and XLA would merge them.
    """
    return apply(_unpack(_all_gather(shard, comm), layout, comm), h)


def _checkpointed(apply: Callable, layout: Layout, comm: _Comm) -> Callable:
    def forward(shard: jax.Array, h: Any) -> Any:
        return apply(_unpack(gather_unit(checkpoint_name(shard, _UNIT_SHARD), comm), layout, comm), h)

    return jax.checkpoint(forward, policy=_save_activations)


def _keeping_fwd(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> tuple:
    out, vjp = jax.vjp(_checkpointed(apply, layout, comm), shard, h)
    return out, (shard, _residual_as_argument(vjp, shard))


def _keeping_bwd(apply: Callable, layout: Layout, comm: _Comm, res: tuple, grad: Any) -> tuple:
    shard, vjp = res
    return vjp(_depend_on(shard, grad), grad)


run_keeping_activations.defvjp(_keeping_fwd, _keeping_bwd)


class Units:
    """The unit buffers of one forward inside ``shard_map``, as the model's forward uses them.

    ``gather(unit)`` returns the unit's ``{fqn: array}`` (the all-gather's VJP reduce-scatters the
    gradient); ``call(unit, apply, h)`` runs ``apply({fqn: array}, h)`` on the gathered unit, re-gathering
    it in the backward under ``reshard_after_forward`` or ``remat`` (then ``apply`` must read nothing but
    its arguments).

    Args:
        local: this device's shard ``(S,)`` of each unit's buffer, ``{unit: shard}``.
        layouts: the units' Layouts; axis, replica_axis: the mesh axes of the shards and of the replicas.
        mp_policy: the compute and reduce dtypes; remat, reshard_after_forward: as ``FSDP``'s.
        expert_layouts, expert_axis: units gathered over ``expert_axis`` (a part of ``axis``) only, each
            unpacked by its layout there (an EP rank's experts: ``FSDP.expert_layouts``).
        tp: the tensor axis's split of every parameter (shards ``(T, S)``), or None.
    """

    def __init__(self, local: Mapping[str, jax.Array], layouts: Sequence[Layout], *,
                 axis: str | tuple[str, ...], replica_axis: str | None, mp_policy: MixedPrecisionPolicy,
                 remat: bool, reshard_after_forward: bool | None,
                 expert_layouts: Mapping[str, Layout] | None = None, expert_axis: str | None = None,
                 tp: TensorParallel | None = None):
        self.local, self.layouts, self.tp = local, {lay.name: lay for lay in layouts}, tp
        self.layouts.update(expert_layouts or {})
        self.axes = {u: expert_axis if u in (expert_layouts or {}) else axis for u in self.layouts}
        self.axis, self.replica_axis, self.mp_policy = axis, replica_axis, mp_policy
        self.remat, self.reshard_after_forward = remat, reshard_after_forward

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (replicas first): sync BN averages over them."""
        shard = (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)
        return shard if self.replica_axis is None else (self.replica_axis, *shard)

    def _comm(self, unit: str) -> _Comm:
        master, mp = self.local[unit].dtype, self.mp_policy
        return _Comm(self.axes[unit], self.replica_axis, mp.param_dtype or master, mp.reduce_dtype or master,
                     master, self.tp)

    def gather(self, unit: str) -> dict[str, jax.Array]:
        comm = self._comm(unit)
        return _unpack(gather_unit(self.local[unit], comm), self.layouts[unit], comm)

    def call(self, unit: str, apply: Callable[[Mapping[str, jax.Array], Any], Any], h: Any) -> Any:
        if self.remat:
            return run_resharded(apply, self.layouts[unit], self._comm(unit), self.local[unit], h)
        if self.reshard_after_forward:
            return run_keeping_activations(apply, self.layouts[unit], self._comm(unit), self.local[unit], h)
        return apply(self.gather(unit), h)
